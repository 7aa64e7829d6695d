//! QUIC links (quinn over rustls): one connection per pair of peers with several
//! streams, TLS 1.3 with this process's certificate, and the job secret bound to the
//! session (see [`crate::tls`]).
//!
//! Tuned for bulk data rather than quinn's defaults (which assume 100 Mbit/s × 100 ms):
//! stream and connection windows of tens of MiB, large UDP socket buffers, and packets
//! of at most 6,500 bytes, so that quinn's ten packets per GSO call stay under the
//! 64 KiB datagram limit (above it the send fails and the path falls back to 1,200-byte
//! packets). GSO and GRO are used wherever the kernel has them (quinn-udp).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::LinkHello;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{MtuDiscoveryConfig, TransportConfig, VarInt};

use crate::connect::{expect_link_role, read_hello, write_hello, MODE_QUIC};
use crate::link::stream::{BoxRead, BoxWrite, LinkGuard};
use crate::{handshake, tls, TransportError};

/// quinn's types, as the links and probes use them.
pub use quinn::{Endpoint, RecvStream, SendStream};

/// Largest UDP payload quinn may send: ten of them per GSO call fit in 64 KiB.
const MAX_PACKET: u16 = 6500;
/// Bytes a stream may have in flight unacknowledged.
const STREAM_WINDOW: u32 = 32 << 20;
/// Bytes a connection may have in flight over all its streams.
const CONN_WINDOW: u32 = 64 << 20;
/// What an acceptor lets a connection send before eccl's handshake has authenticated it:
/// the mode byte, the handshake and the hello fit many times over. A stranger cannot
/// make a peer buffer more than this per connection (the windows above are granted once
/// the dialer has proven the secret, see [`authenticated`]).
const PRE_AUTH_WINDOW: u32 = 64 << 10;
/// Most streams a link has (its hello's `nstreams`).
const MAX_STREAMS: u16 = 64;
/// UDP socket buffers asked for (the kernel caps them at `net.core.*mem_max`).
const SOCKET_BUFFER: usize = 16 << 20;

/// Application close code of a connection whose eccl handshake failed: the dialer reads
/// it as "the acceptor refused our proof" rather than as a lost connection.
const AUTH_REFUSED: u32 = 0xecc1;

/// A QUIC link as set up: the connection (closed when dropped) and its streams in order.
pub struct QuicLink {
    pub conn: quinn::Connection,
    pub streams: Vec<(quinn::RecvStream, quinn::SendStream)>,
}

impl QuicLink {
    /// The streams as byte-stream halves, and the guard that ends the connection in
    /// order (see [`LinkGuard`]).
    pub fn into_parts(self) -> (Vec<(BoxRead, BoxWrite)>, Arc<dyn LinkGuard>) {
        let streams = self
            .streams
            .into_iter()
            .map(|(r, w)| (Box::new(r) as BoxRead, Box::new(w) as BoxWrite))
            .collect();
        let guard = Arc::new(ConnGuard {
            conn: self.conn,
            ends: std::sync::atomic::AtomicU8::new(0),
        });
        (streams, guard)
    }
}

/// Closes a link's connection once both sides are done sending: this side has sent its
/// `Close` frames and read the peer's on every stream. Until then the connection (and
/// the data in its send buffers) stays, however early the process wants to go.
struct ConnGuard {
    conn: quinn::Connection,
    /// Bit 0: done sending; bit 1: drained.
    ends: std::sync::atomic::AtomicU8,
}

impl ConnGuard {
    fn end(&self, bit: u8) {
        let before = self.ends.fetch_or(bit, std::sync::atomic::Ordering::AcqRel);
        tracing::trace!(target: "eccl::net", "quic link to {}: end bit {bit}, before {before}", self.conn.remote_address());
        if before | bit == 3 && before != 3 {
            self.conn.close(VarInt::from_u32(0), b"done");
        }
    }
}

impl LinkGuard for ConnGuard {
    fn done_sending(&self) {
        self.end(1);
    }
    fn drained(&self) {
        self.end(2);
    }
    fn closed(&self) -> futures::future::BoxFuture<'static, ()> {
        let c = self.conn.clone();
        Box::pin(async move {
            c.closed().await;
        })
    }
}

/// The configuration of both ends. The acceptor's (`accepting`) starts with one stream
/// and a connection window of [`PRE_AUTH_WINDOW`], raised by [`authenticated`]; the
/// dialer's lets the acceptor open no stream at all (links are opened by the dialer).
fn transport_config(accepting: bool) -> TransportConfig {
    let mut t = TransportConfig::default();
    let (window, streams) = if accepting {
        (PRE_AUTH_WINDOW, 1)
    } else {
        (CONN_WINDOW, 0)
    };
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW))
        .receive_window(VarInt::from_u32(window))
        .send_window(u64::from(CONN_WINDOW))
        .max_concurrent_bidi_streams(VarInt::from_u32(streams))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .keep_alive_interval(Some(Duration::from_secs(2)))
        .max_idle_timeout(Some(
            Duration::from_secs(30)
                .try_into()
                .expect("30 s is a valid idle timeout"),
        ));
    let mut mtu = MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_PACKET);
    t.mtu_discovery_config(Some(mtu));
    t
}

fn quic_err(peer: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Quic {
        peer: peer.to_string(),
        reason: e.to_string(),
    }
}

/// An endpoint on `bind` that accepts eccl's QUIC links and dials them.
pub fn endpoint(bind: SocketAddr) -> Result<quinn::Endpoint, TransportError> {
    let name = bind.to_string();
    let server = tls::server_config().map_err(|e| quic_err(&name, e))?;
    let server = QuicServerConfig::try_from(server).map_err(|e| quic_err(&name, e))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server));
    server.transport_config(Arc::new(transport_config(true)));
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(bind),
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )
    .map_err(|e| TransportError::io(&name, e))?;
    // Best effort: a smaller buffer only costs drops, which QUIC recovers.
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    socket
        .bind(&bind.into())
        .map_err(|e| TransportError::io(&name, e))?;
    let runtime =
        quinn::default_runtime().ok_or_else(|| quic_err(&name, "no async runtime for quinn"))?;
    quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server),
        socket.into(),
        runtime,
    )
    .map_err(|e| TransportError::io(&name, e))
}

/// The client side of eccl's QUIC configuration (for dialing, and for probes).
pub fn client_config(peer: &str) -> Result<quinn::ClientConfig, TransportError> {
    let client = tls::client_config().map_err(|e| quic_err(peer, e))?;
    let client = QuicClientConfig::try_from(client).map_err(|e| quic_err(peer, e))?;
    let mut c = quinn::ClientConfig::new(Arc::new(client));
    c.transport_config(Arc::new(transport_config(false)));
    Ok(c)
}

/// Grants an accepted connection whose dialer has authenticated the full connection
/// window and `nstreams` streams (the acceptor's configuration gives a stranger one
/// stream and [`PRE_AUTH_WINDOW`] bytes).
pub fn authenticated(conn: &quinn::Connection, nstreams: u16) {
    conn.set_receive_window(VarInt::from_u32(CONN_WINDOW));
    conn.set_max_concurrent_bi_streams(VarInt::from(nstreams.min(MAX_STREAMS)));
}

/// The session's exported keying material, which the secret is bound to.
fn binding(conn: &quinn::Connection, peer: &str) -> Result<[u8; 32], TransportError> {
    let mut ekm = [0u8; 32];
    conn.export_keying_material(&mut ekm, tls::EXPORTER_LABEL, b"")
        .map_err(|e| quic_err(peer, format!("{e:?}")))?;
    Ok(ekm)
}

/// Dials a link: the connection, eccl's handshake and the hello on stream 0, then the
/// other streams, each announced by its index.
pub(crate) async fn dial(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    secret: &Secret,
    hello: &LinkHello,
    peer: &str,
) -> Result<QuicLink, TransportError> {
    let conn = endpoint
        .connect_with(client_config(peer)?, addr, "eccl")
        .map_err(|e| quic_err(peer, e))?
        .await
        .map_err(|e| quic_err(peer, e))?;
    let (mut w, r) = conn.open_bi().await.map_err(|e| quic_err(peer, e))?;
    w.write_all(&[MODE_QUIC])
        .await
        .map_err(|e| quic_err(peer, e))?;
    let bound = secret.bind(&binding(&conn, peer)?);
    let mut s = tokio::io::join(r, w);
    if let Err(e) = handshake::dial(&mut s, &bound, Role::PeerLink, peer).await {
        let refused = matches!(
            conn.close_reason(),
            Some(quinn::ConnectionError::ApplicationClosed(c)) if c.error_code == VarInt::from_u32(AUTH_REFUSED)
        );
        return Err(if refused {
            TransportError::Auth {
                peer: peer.to_string(),
                source: eccl_protocol::auth::AuthError::Rejected,
            }
        } else {
            e
        });
    }
    write_hello(&mut s, hello, peer).await?;
    let (r, w) = s.into_inner();
    let mut streams = vec![(r, w)];
    for i in 1..hello.nstreams {
        let (mut w, r) = conn.open_bi().await.map_err(|e| quic_err(peer, e))?;
        w.write_all(&i.to_le_bytes())
            .await
            .map_err(|e| quic_err(peer, e))?;
        streams.push((r, w));
    }
    Ok(QuicLink { conn, streams })
}

/// Accepts a link on an incoming connection; returns its hello and the link.
pub(crate) async fn accept(
    incoming: quinn::Incoming,
    secret: &Secret,
) -> Result<(LinkHello, QuicLink, String), TransportError> {
    let remote = incoming.remote_address().to_string();
    let peer = remote.as_str();
    let run = async {
        let conn = incoming.await.map_err(|e| quic_err(peer, e))?;
        let (w, mut r) = conn.accept_bi().await.map_err(|e| quic_err(peer, e))?;
        let mut mode = [0u8; 1];
        r.read_exact(&mut mode)
            .await
            .map_err(|e| quic_err(peer, e))?;
        if mode[0] != MODE_QUIC {
            return Err(TransportError::BadHello {
                peer: peer.to_string(),
                reason: format!("mode byte {:#04x} on a QUIC link", mode[0]),
            });
        }
        let bound = secret.bind(&binding(&conn, peer)?);
        let mut s = tokio::io::join(r, w);
        let role = match handshake::accept(&mut s, &bound, peer).await {
            Ok(r) => r,
            Err(e) => {
                conn.close(VarInt::from_u32(AUTH_REFUSED), b"authentication refused");
                return Err(e);
            }
        };
        expect_link_role(role, peer)?;
        let hello = read_hello(&mut s, peer).await?;
        if hello.nstreams == 0 || hello.nstreams > MAX_STREAMS {
            return Err(TransportError::BadHello {
                peer: peer.to_string(),
                reason: format!("{} streams", hello.nstreams),
            });
        }
        authenticated(&conn, hello.nstreams);
        let (r, w) = s.into_inner();
        let mut streams = vec![(r, w)];
        for i in 1..hello.nstreams {
            let (w, mut r) = conn.accept_bi().await.map_err(|e| quic_err(peer, e))?;
            let mut idx = [0u8; 2];
            r.read_exact(&mut idx)
                .await
                .map_err(|e| quic_err(peer, e))?;
            if u16::from_le_bytes(idx) != i {
                return Err(TransportError::BadHello {
                    peer: peer.to_string(),
                    reason: format!("stream {} announced as {}", i, u16::from_le_bytes(idx)),
                });
            }
            streams.push((r, w));
        }
        Ok((hello, QuicLink { conn, streams }))
    };
    let (hello, link) = tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT * 2, run)
        .await
        .map_err(|_| TransportError::Timeout(peer.to_string()))??;
    Ok((hello, link, remote))
}
