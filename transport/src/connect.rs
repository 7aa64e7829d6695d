//! Opening a data link to a peer over each transport, and the introduction every link
//! starts with: one mode byte (what follows), eccl's handshake with the job secret
//! (bound to the session under TLS and QUIC), then a [`LinkHello`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::{AuthError, Role, Secret};
use eccl_protocol::codec;
use eccl_protocol::LinkHello;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::control::tcp_connect;
use crate::link::stream::{BoxRead, BoxWrite};
use crate::link::{LinkObserver, LinkRx, LinkTx, Transport};
use crate::{handshake, quic, shm, tls, TransportError};

/// First byte of a data link: eccl's handshake follows in the clear.
pub(crate) const MODE_PLAIN: u8 = b'P';
/// First byte of a data link: a TLS handshake follows.
pub(crate) const MODE_TLS: u8 = b'T';
/// First byte of the first stream of a QUIC link.
pub(crate) const MODE_QUIC: u8 = b'Q';

/// Largest hello we read; a real one is a few dozen bytes.
const MAX_HELLO: usize = 1024;

pub(crate) async fn write_hello<S: AsyncWrite + Unpin>(
    s: &mut S,
    hello: &LinkHello,
    peer: &str,
) -> Result<(), TransportError> {
    let bytes = codec::encode(hello).map_err(|e| TransportError::Codec {
        peer: peer.into(),
        source: e,
    })?;
    s.write_all(&bytes)
        .await
        .map_err(|e| TransportError::io(peer, e))?;
    s.flush().await.map_err(|e| TransportError::io(peer, e))
}

pub(crate) async fn read_hello<S: AsyncRead + Unpin>(
    s: &mut S,
    peer: &str,
) -> Result<LinkHello, TransportError> {
    read_message(s, peer).await
}

/// One length-prefixed message of at most [`MAX_HELLO`] bytes, read within the
/// handshake's time limit (the hellos of a link's set-up).
pub(crate) async fn read_message<S: AsyncRead + Unpin, T: serde::de::DeserializeOwned>(
    s: &mut S,
    peer: &str,
) -> Result<T, TransportError> {
    let run = async {
        let mut prefix = [0u8; 4];
        s.read_exact(&mut prefix)
            .await
            .map_err(|e| TransportError::io(peer, e))?;
        let len = codec::check_len(prefix).map_err(|e| TransportError::Codec {
            peer: peer.into(),
            source: e,
        })?;
        if len > MAX_HELLO {
            return Err(TransportError::BadHello {
                peer: peer.into(),
                reason: format!("{len} bytes is too long"),
            });
        }
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)
            .await
            .map_err(|e| TransportError::io(peer, e))?;
        codec::decode(&body).map_err(|e| TransportError::Codec {
            peer: peer.into(),
            source: e,
        })
    };
    tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT, run)
        .await
        .map_err(|_| TransportError::Timeout(peer.to_string()))?
}

/// Checks that an authenticated dialer asked to be a data link.
pub(crate) fn expect_link_role(role: Role, peer: &str) -> Result<(), TransportError> {
    if role == Role::PeerLink {
        return Ok(());
    }
    Err(TransportError::Auth {
        peer: peer.to_string(),
        source: AuthError::WrongRole {
            expected: Role::PeerLink,
            got: role,
        },
    })
}

/// One stream of a link over TCP, with TLS when `tls`: authenticated, introduced, and
/// split into its two directions.
pub async fn dial_tcp(
    addr: &str,
    secret: &Secret,
    hello: &LinkHello,
    tls: bool,
    timeout: Duration,
) -> Result<(BoxRead, BoxWrite), TransportError> {
    dial_tcp_stream(addr, secret, hello, tls, timeout)
        .await
        .map(|(r, w, _)| (r, w))
}

/// [`dial_tcp`], with the connection's socket (held open by the two halves), whose
/// counters tell whether its window bounds it ([`crate::link::tcp_info`]).
pub async fn dial_tcp_stream(
    addr: &str,
    secret: &Secret,
    hello: &LinkHello,
    tls: bool,
    timeout: Duration,
) -> Result<(BoxRead, BoxWrite, std::os::fd::RawFd), TransportError> {
    let mut tcp = tcp_connect(addr, addr, timeout).await?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&tcp);
    let mode = if tls { MODE_TLS } else { MODE_PLAIN };
    tcp.write_all(&[mode])
        .await
        .map_err(|e| TransportError::io(addr, e))?;
    if tls {
        let mut s = tls::connect(tcp, secret, Role::PeerLink, addr).await?;
        write_hello(&mut s, hello, addr).await?;
        let (r, w) = tokio::io::split(s);
        Ok((Box::new(r), Box::new(w), fd))
    } else {
        handshake::dial(&mut tcp, secret, Role::PeerLink, addr).await?;
        write_hello(&mut tcp, hello, addr).await?;
        let (r, w) = tcp.into_split();
        Ok((Box::new(r), Box::new(w), fd))
    }
}

/// A whole shm link to the peer listening on the abstract unix socket `name`.
pub async fn dial_shm(
    name: &str,
    secret: &Secret,
    hello: &LinkHello,
    frame_bytes: usize,
    peer: String,
    observer: Arc<dyn LinkObserver>,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), TransportError> {
    let std = tokio::time::timeout(timeout, async {
        loop {
            match connect_abstract(name) {
                // The listener's queue is full (a world of hundreds forming on one host):
                // again shortly, until the timeout.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                other => return other,
            }
        }
    })
    .await
    .map_err(|_| TransportError::Timeout(peer.clone()))?
    .map_err(|e| TransportError::io(&peer, e))?;
    let mut s = UnixStream::from_std(std).map_err(|e| TransportError::io(&peer, e))?;
    crate::shm::check_same_user(&s, &peer)?;
    s.write_all(&[MODE_PLAIN])
        .await
        .map_err(|e| TransportError::io(&peer, e))?;
    handshake::dial(&mut s, secret, Role::PeerLink, &peer).await?;
    write_hello(&mut s, hello, &peer).await?;
    shm::dial_link(s, frame_bytes, peer, observer, timeout).await
}

/// A whole QUIC link: one connection, `hello.nstreams` streams.
pub async fn dial_quic(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    secret: &Secret,
    hello: &LinkHello,
    timeout: Duration,
) -> Result<quic::QuicLink, TransportError> {
    let peer = addr.to_string();
    tokio::time::timeout(timeout, quic::dial(endpoint, addr, secret, hello, &peer))
        .await
        .map_err(|_| TransportError::Timeout(peer.clone()))?
}

/// The address of an abstract unix socket (Linux: no file, gone with its process).
/// A non-blocking connection to the abstract unix socket `name`. A unix-domain connect
/// completes at once or fails with `WouldBlock` when the listener's queue is full: no
/// thread waits on it (one blocking connect per dial on a thread of its own ran a host
/// of 256 processes out of threads, and tokio panics when it cannot start one).
fn connect_abstract(name: &str) -> std::io::Result<std::os::unix::net::UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let mut path = vec![0u8];
    path.extend_from_slice(name.as_bytes());
    let addr = socket2::SockAddr::unix(std::ffi::OsStr::from_bytes(&path))?;
    let s = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    s.set_nonblocking(true)?;
    s.connect(&addr)?;
    Ok(std::os::unix::net::UnixStream::from(
        std::os::fd::OwnedFd::from(s),
    ))
}

pub(crate) fn abstract_addr(name: &str) -> std::io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

/// Builds a stream link from accepted or dialed streams.
pub fn stream_link(
    peer: String,
    transport: Transport,
    streams: Vec<(BoxRead, BoxWrite)>,
    observer: Arc<dyn LinkObserver>,
    keep_buf_max: usize,
    guard: Option<Arc<dyn crate::link::stream::LinkGuard>>,
) -> (LinkTx, LinkRx) {
    crate::link::stream::link_from_streams(
        peer,
        transport,
        streams,
        vec![],
        observer,
        keep_buf_max,
        guard,
    )
}
