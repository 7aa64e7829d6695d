//! Control connections: authenticated TCP carrying length-prefixed bincode messages.

use std::net::SocketAddr;
use std::time::Duration;

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::codec;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};

use crate::{handshake, TransportError};

/// Opens a TCP connection with `TCP_NODELAY` set (control messages are small and
/// latency-bound; Nagle's algorithm would add tens of milliseconds).
pub async fn tcp_connect<A: ToSocketAddrs>(
    addr: A,
    what: &str,
    timeout: Duration,
) -> Result<TcpStream, TransportError> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| TransportError::Timeout(what.to_string()))?
        .map_err(|e| TransportError::io(what, e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| TransportError::io(what, e))?;
    Ok(stream)
}

/// Connects to `addr`, authenticates for `role`, and returns the framed connection.
pub async fn connect(
    addr: &str,
    secret: &Secret,
    role: Role,
    timeout: Duration,
) -> Result<ControlConn, TransportError> {
    let mut stream = tcp_connect(addr, addr, timeout).await?;
    handshake::dial(&mut stream, secret, role, addr).await?;
    ControlConn::new(stream, addr.to_string())
}

/// A framed control connection; split it to read and write from different tasks.
pub struct ControlConn {
    pub rx: ControlRx,
    pub tx: ControlTx,
    pub peer_addr: Option<SocketAddr>,
}

impl ControlConn {
    pub fn new(stream: TcpStream, name: String) -> Result<ControlConn, TransportError> {
        let peer_addr = stream.peer_addr().ok();
        let _ = stream.set_nodelay(true);
        let (r, w) = stream.into_split();
        Ok(ControlConn {
            rx: ControlRx {
                r,
                name: name.clone(),
                buf: Vec::new(),
            },
            tx: ControlTx { w, name },
            peer_addr,
        })
    }

    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), TransportError> {
        self.tx.send(msg).await
    }

    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<T, TransportError> {
        self.rx.recv().await
    }
}

pub struct ControlTx {
    w: OwnedWriteHalf,
    name: String,
}

impl ControlTx {
    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), TransportError> {
        let bytes = codec::encode(msg).map_err(|e| TransportError::Codec {
            peer: self.name.clone(),
            source: e,
        })?;
        self.w
            .write_all(&bytes)
            .await
            .map_err(|e| TransportError::io(&self.name, e))
    }
}

pub struct ControlRx {
    r: OwnedReadHalf,
    name: String,
    buf: Vec<u8>,
}

impl ControlRx {
    /// Reads one message. Cancel-safe only between messages: dropping this future in
    /// the middle of a message leaves the stream at an unknown position, so callers
    /// read from one dedicated task.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<T, TransportError> {
        let mut prefix = [0u8; 4];
        self.r
            .read_exact(&mut prefix)
            .await
            .map_err(|e| TransportError::io(&self.name, e))?;
        let len = codec::check_len(prefix).map_err(|e| TransportError::Codec {
            peer: self.name.clone(),
            source: e,
        })?;
        self.buf.resize(len, 0);
        self.r
            .read_exact(&mut self.buf)
            .await
            .map_err(|e| TransportError::io(&self.name, e))?;
        let msg = codec::decode(&self.buf).map_err(|e| TransportError::Codec {
            peer: self.name.clone(),
            source: e,
        });
        if self.buf.capacity() > 1 << 20 {
            self.buf = Vec::new();
        }
        msg
    }
}
