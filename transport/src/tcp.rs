//! The TCP backend: a listener that authenticates every incoming data connection, and a
//! dialer. `TCP_NODELAY` is always on: eccl writes whole frames, and Nagle's algorithm
//! would hold back the last segment of every small collective.

use std::net::SocketAddr;
use std::time::Duration;

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::codec;
use eccl_protocol::LinkHello;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::control::tcp_connect;
use crate::{handshake, TransportError};

/// An authenticated incoming data connection and what it says it is.
pub struct Accepted {
    pub hello: LinkHello,
    pub stream: TcpStream,
    pub remote: SocketAddr,
}

/// Accepts connections on `listener` forever. Each one must authenticate as a peer link
/// and introduce itself with a [`LinkHello`] within the handshake timeout; anything else
/// is logged and dropped before it reaches a collective.
pub fn spawn_acceptor(
    listener: TcpListener,
    secret: Secret,
    out: mpsc::Sender<Accepted>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let (stream, remote) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let secret = secret.clone();
            let out = out.clone();
            tokio::spawn(async move {
                match accept_one(stream, remote, &secret).await {
                    Ok(a) => {
                        let _ = out.send(a).await;
                    }
                    Err(e) => tracing::warn!("refused data connection from {remote}: {e}"),
                }
            });
        }
    })
}

async fn accept_one(
    mut stream: TcpStream,
    remote: SocketAddr,
    secret: &Secret,
) -> Result<Accepted, TransportError> {
    let name = remote.to_string();
    stream
        .set_nodelay(true)
        .map_err(|e| TransportError::io(&name, e))?;
    let role = handshake::accept(&mut stream, secret, &name).await?;
    if role != Role::PeerLink {
        return Err(TransportError::Auth {
            peer: name,
            source: eccl_protocol::auth::AuthError::WrongRole {
                expected: Role::PeerLink,
                got: role,
            },
        });
    }
    let hello = tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT, read_hello(&mut stream, &name))
        .await
        .map_err(|_| TransportError::Timeout(name.clone()))??;
    Ok(Accepted {
        hello,
        stream,
        remote,
    })
}

async fn read_hello(stream: &mut TcpStream, name: &str) -> Result<LinkHello, TransportError> {
    let mut prefix = [0u8; 4];
    stream
        .read_exact(&mut prefix)
        .await
        .map_err(|e| TransportError::io(name, e))?;
    let len = codec::check_len(prefix).map_err(|e| TransportError::Codec {
        peer: name.into(),
        source: e,
    })?;
    if len > 1024 {
        return Err(TransportError::BadHello {
            peer: name.into(),
            reason: format!("{len} bytes is too long"),
        });
    }
    let mut body = vec![0u8; len];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| TransportError::io(name, e))?;
    codec::decode(&body).map_err(|e| TransportError::Codec {
        peer: name.into(),
        source: e,
    })
}

/// Dials one stream of a data link and introduces it.
pub async fn dial(
    addr: &str,
    secret: &Secret,
    hello: &LinkHello,
    timeout: Duration,
) -> Result<TcpStream, TransportError> {
    let mut stream = tcp_connect(addr, addr, timeout).await?;
    handshake::dial(&mut stream, secret, Role::PeerLink, addr).await?;
    let bytes = codec::encode(hello).map_err(|e| TransportError::Codec {
        peer: addr.into(),
        source: e,
    })?;
    stream
        .write_all(&bytes)
        .await
        .map_err(|e| TransportError::io(addr, e))?;
    Ok(stream)
}
