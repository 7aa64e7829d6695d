//! TLS 1.3 for eccl's connections, and the one place where the job secret is bound to a
//! TLS or QUIC session.
//!
//! Each process makes a self-signed certificate at first use (rcgen); certificates are
//! not what authenticates a peer. After the TLS handshake both ends export keying
//! material from the session ([`EXPORTER_LABEL`]) and run eccl's HMAC challenge-response
//! with the job secret bound to it ([`Secret::bind`]). Someone without the secret cannot
//! complete that exchange; someone in the middle holds two TLS sessions with different
//! material, so proofs made in one are refused in the other. The client accepts any
//! certificate but checks the handshake's signatures, so the TLS session itself is sound.

use std::sync::{Arc, OnceLock};

use eccl_protocol::auth::{Role, Secret};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{ring, verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::{handshake, TransportError};

/// The label both ends export keying material under.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-eccl-secret-binding";

/// ALPN protocol name of eccl's links.
pub const ALPN: &[u8] = b"eccl";

pub(crate) fn provider() -> Arc<CryptoProvider> {
    static P: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    P.get_or_init(|| Arc::new(ring::default_provider())).clone()
}

/// This process's certificate and key, made at first use.
fn identity() -> Result<&'static (CertificateDer<'static>, PrivatePkcs8KeyDer<'static>), String> {
    static ID: OnceLock<Result<(CertificateDer<'static>, PrivatePkcs8KeyDer<'static>), String>> =
        OnceLock::new();
    ID.get_or_init(|| {
        let ck = rcgen::generate_simple_self_signed(vec!["eccl".to_string()])
            .map_err(|e| format!("cannot make a certificate: {e}"))?;
        let key = PrivatePkcs8KeyDer::from(ck.key_pair.serialize_der());
        Ok((ck.cert.der().clone(), key))
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// The rustls configuration of an accepting end (TLS over TCP, and QUIC).
pub fn server_config() -> Result<Arc<ServerConfig>, String> {
    let (cert, key) = identity()?;
    let mut c = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], PrivateKeyDer::Pkcs8(key.clone_key()))
        .map_err(|e| e.to_string())?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(c))
}

/// The rustls configuration of a dialing end: any certificate, checked signatures.
pub fn client_config() -> Result<Arc<ClientConfig>, String> {
    let mut c = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider())))
        .with_no_client_auth();
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(Arc::new(c))
}

/// Accepts any server certificate (authentication is the secret's job, see above) but
/// verifies the handshake signatures made with it.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn tls_err(peer: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Tls {
        peer: peer.to_string(),
        reason: e.to_string(),
    }
}

/// TLS over `tcp` as the dialer, then eccl's handshake with the secret bound to the
/// session.
pub async fn connect(
    tcp: TcpStream,
    secret: &Secret,
    role: Role,
    peer: &str,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, TransportError> {
    let config = client_config().map_err(|e| tls_err(peer, e))?;
    let name = ServerName::try_from("eccl").expect("a valid DNS name");
    let run = async {
        let mut tls = TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| tls_err(peer, e))?;
        let ekm = tls
            .get_ref()
            .1
            .export_keying_material([0u8; 32], EXPORTER_LABEL, None)
            .map_err(|e| tls_err(peer, e))?;
        handshake::dial(&mut tls, &secret.bind(&ekm), role, peer).await?;
        Ok(tls)
    };
    tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| TransportError::Timeout(peer.to_string()))?
}

/// TLS over `tcp` as the acceptor, then eccl's handshake with the secret bound to the
/// session; returns the role the dialer authenticated for.
pub async fn accept(
    tcp: TcpStream,
    secret: &Secret,
    peer: &str,
) -> Result<(Role, tokio_rustls::server::TlsStream<TcpStream>), TransportError> {
    accept_any(tcp, std::slice::from_ref(secret), peer)
        .await
        .map(|(role, _, tls)| (role, tls))
}

/// [`accept`] with several secrets (see [`handshake::accept_any`]): also says which one
/// the dialer proved.
pub async fn accept_any(
    tcp: TcpStream,
    secrets: &[Secret],
    peer: &str,
) -> Result<(Role, usize, tokio_rustls::server::TlsStream<TcpStream>), TransportError> {
    let config = server_config().map_err(|e| tls_err(peer, e))?;
    let run = async {
        let mut tls = TlsAcceptor::from(config)
            .accept(tcp)
            .await
            .map_err(|e| tls_err(peer, e))?;
        let ekm = tls
            .get_ref()
            .1
            .export_keying_material([0u8; 32], EXPORTER_LABEL, None)
            .map_err(|e| tls_err(peer, e))?;
        let bound: Vec<Secret> = secrets.iter().map(|s| s.bind(&ekm)).collect();
        let (role, i) = handshake::accept_any(&mut tls, &bound, peer).await?;
        Ok((role, i, tls))
    };
    tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| TransportError::Timeout(peer.to_string()))?
}
