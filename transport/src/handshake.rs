//! Runs the authentication of [`eccl_protocol::auth`] over any byte stream.
//!
//! Both functions are bounded by a deadline so that a silent or slow client cannot hold
//! an acceptor's slot.

use std::time::Duration;

use eccl_protocol::auth::*;
use eccl_protocol::PROTOCOL_VERSION;
use rand::RngCore;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::TransportError;

/// How long a handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

/// Dialer side: proves it holds `secret`, then checks that the acceptor does too.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    role: Role,
    peer: &str,
) -> Result<(), TransportError> {
    let run = async {
        let io = |e| TransportError::io(peer, e);
        let auth = |e| TransportError::Auth {
            peer: peer.to_string(),
            source: e,
        };
        let mut hello = [0u8; SERVER_HELLO_LEN];
        stream.read_exact(&mut hello).await.map_err(io)?;
        let hello = ServerHello::decode(&hello).map_err(auth)?;
        if hello.version != PROTOCOL_VERSION {
            return Err(auth(AuthError::Version {
                ours: PROTOCOL_VERSION,
                theirs: hello.version,
            }));
        }
        let my_nonce = nonce();
        let msg = ClientAuth {
            version: PROTOCOL_VERSION,
            role,
            nonce: my_nonce,
            proof: secret.dialer_proof(role, &hello.nonce, &my_nonce),
        };
        stream.write_all(&msg.encode()).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let mut proof = [0u8; SERVER_AUTH_LEN];
        // An acceptor that does not like our proof hangs up without a word.
        stream
            .read_exact(&mut proof)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
                    auth(AuthError::Rejected)
                }
                _ => io(e),
            })?;
        if !secret.verify_acceptor(role, &my_nonce, &hello.nonce, &proof) {
            return Err(auth(AuthError::BadProof));
        }
        Ok(())
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| TransportError::Timeout(peer.to_string()))?
}

/// Acceptor side: returns the role the dialer authenticated for. Anything short of a
/// valid proof is an error and the caller drops the connection; nothing but a random
/// nonce has been sent by then.
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &Secret,
    peer: &str,
) -> Result<Role, TransportError> {
    accept_any(stream, std::slice::from_ref(secret), peer)
        .await
        .map(|(role, _)| role)
}

/// [`accept`] for an acceptor that holds several secrets (a master that serves the
/// stores of several jobs): returns the role and the index of the secret the dialer
/// proved. Every secret is tried, so the time taken does not say which one matched.
pub async fn accept_any<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secrets: &[Secret],
    peer: &str,
) -> Result<(Role, usize), TransportError> {
    let run = async {
        let io = |e| TransportError::io(peer, e);
        let auth = |e| TransportError::Auth {
            peer: peer.to_string(),
            source: e,
        };
        let my_nonce = nonce();
        let hello = ServerHello {
            version: PROTOCOL_VERSION,
            nonce: my_nonce,
        };
        stream.write_all(&hello.encode()).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let mut buf = [0u8; CLIENT_AUTH_LEN];
        stream.read_exact(&mut buf).await.map_err(io)?;
        let msg = ClientAuth::decode(&buf).map_err(auth)?;
        if msg.version != PROTOCOL_VERSION {
            return Err(auth(AuthError::Version {
                ours: PROTOCOL_VERSION,
                theirs: msg.version,
            }));
        }
        let mut matched = None;
        for (i, secret) in secrets.iter().enumerate() {
            let ok = secret.verify_dialer(msg.role, &my_nonce, &msg.nonce, &msg.proof);
            if ok && matched.is_none() {
                matched = Some(i);
            }
        }
        let Some(i) = matched else {
            return Err(auth(AuthError::BadProof));
        };
        let proof = secrets[i].acceptor_proof(msg.role, &msg.nonce, &my_nonce);
        stream.write_all(&proof).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        Ok((msg.role, i))
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| TransportError::Timeout(peer.to_string()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret {
        Secret::new(s).unwrap()
    }

    #[tokio::test]
    async fn same_secret_authenticates_both_ways() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let s = secret("a-job-secret-of-enough-length");
        let s2 = s.clone();
        let acc = tokio::spawn(async move { accept(&mut b, &s2, "dialer").await });
        dial(&mut a, &s, Role::PeerLink, "acceptor").await.unwrap();
        assert_eq!(acc.await.unwrap().unwrap(), Role::PeerLink);
    }

    #[tokio::test]
    async fn wrong_secret_is_refused_by_acceptor() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let acc =
            tokio::spawn(
                async move { accept(&mut b, &secret("the-real-secret-0000"), "dialer").await },
            );
        let r = dial(
            &mut a,
            &secret("a-guessed-secret-000"),
            Role::PeerToMaster,
            "acceptor",
        )
        .await;
        assert!(r.is_err());
        assert!(matches!(
            acc.await.unwrap(),
            Err(TransportError::Auth {
                source: AuthError::BadProof,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn garbage_client_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let acc =
            tokio::spawn(
                async move { accept(&mut b, &secret("the-real-secret-0000"), "dialer").await },
            );
        let mut hello = [0u8; SERVER_HELLO_LEN];
        a.read_exact(&mut hello).await.unwrap();
        a.write_all(&[0x41u8; CLIENT_AUTH_LEN]).await.unwrap();
        assert!(matches!(
            acc.await.unwrap(),
            Err(TransportError::Auth {
                source: AuthError::BadMagic,
                ..
            })
        ));
    }
}
