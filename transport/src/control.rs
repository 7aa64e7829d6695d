//! Control connections (peer <-> master, master <-> master): TLS 1.3 over TCP, always,
//! with the job's (or the master cluster's) secret bound to the session (see
//! [`crate::tls`]), carrying length-prefixed bincode messages. They carry little traffic
//! and decide who is in the job, so every byte of them is encrypted and authenticated.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::codec;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::Semaphore;

use crate::link::stream::{BoxRead, BoxWrite};
use crate::TransportError;

/// Bytes of a control message read at a time.
const BODY_PIECE: usize = 64 << 10;
/// How long the body of a control message may take once its length has arrived.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

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

/// Connects to `addr` over TLS, authenticates for `role`, and returns the framed
/// connection; all of it within `timeout` (a stopped process accepts TCP in its kernel
/// but never answers the handshake).
pub async fn connect(
    addr: &str,
    secret: &Secret,
    role: Role,
    timeout: Duration,
) -> Result<ControlConn, TransportError> {
    let run = async {
        let stream = tcp_connect(addr, addr, timeout).await?;
        let peer_addr = stream.peer_addr().ok();
        let tls = crate::tls::connect(stream, secret, role, addr).await?;
        Ok(ControlConn::new(tls, addr.to_string(), peer_addr))
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| TransportError::Timeout(addr.to_string()))?
}

/// Accepts a control connection on `stream`: TLS, then the handshake with `secret`.
/// Returns the role the dialer authenticated for and the framed connection.
pub async fn accept(
    stream: TcpStream,
    secret: &Secret,
) -> Result<(Role, ControlConn), TransportError> {
    let peer_addr = stream.peer_addr().ok();
    let name = peer_addr.map_or_else(|| "?".to_string(), |a| a.to_string());
    let _ = stream.set_nodelay(true);
    let (role, tls) = crate::tls::accept(stream, secret, &name).await?;
    Ok((role, ControlConn::new(tls, name, peer_addr)))
}

/// [`accept`] with several secrets: also the index of the one the dialer proved (a
/// master serving several jobs' stores tells their connections apart by it).
pub async fn accept_any(
    stream: TcpStream,
    secrets: &[Secret],
) -> Result<(Role, usize, ControlConn), TransportError> {
    let peer_addr = stream.peer_addr().ok();
    let name = peer_addr.map_or_else(|| "?".to_string(), |a| a.to_string());
    let _ = stream.set_nodelay(true);
    let (role, i, tls) = crate::tls::accept_any(stream, secrets, &name).await?;
    Ok((role, i, ControlConn::new(tls, name, peer_addr)))
}

/// A framed control connection; split it to read and write from different tasks.
pub struct ControlConn {
    pub rx: ControlRx,
    pub tx: ControlTx,
    pub peer_addr: Option<SocketAddr>,
}

impl ControlConn {
    /// Frames an authenticated stream.
    pub fn new<S>(stream: S, name: String, peer_addr: Option<SocketAddr>) -> ControlConn
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (r, w) = tokio::io::split(stream);
        ControlConn {
            rx: ControlRx {
                r: Box::new(r),
                name: name.clone(),
                buf: Vec::new(),
                budget: None,
            },
            tx: ControlTx {
                w: Box::new(w),
                name,
            },
            peer_addr,
        }
    }

    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), TransportError> {
        self.tx.send(msg).await
    }

    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<T, TransportError> {
        self.rx.recv().await
    }
}

pub struct ControlTx {
    w: BoxWrite,
    name: String,
}

impl ControlTx {
    pub async fn send<T: Serialize>(&mut self, msg: &T) -> Result<(), TransportError> {
        let bytes = codec::encode(msg).map_err(|e| TransportError::Codec {
            peer: self.name.clone(),
            source: e,
        })?;
        let write = async {
            self.w.write_all(&bytes).await?;
            self.w.flush().await
        };
        write.await.map_err(|e| TransportError::io(&self.name, e))
    }
}

pub struct ControlRx {
    r: BoxRead,
    name: String,
    buf: Vec<u8>,
    /// Shared by every connection of one listener: room, in KiB, for the bodies of
    /// large messages being read (see [`ControlRx::share_body_budget`]).
    budget: Option<Arc<Semaphore>>,
}

impl ControlRx {
    /// Counts the bodies of large messages this connection reads against `budget`
    /// (permits of 1 KiB, shared by every connection of one listener): a message that
    /// would pass it ends its connection instead of being read, so that many connections
    /// sending large messages at once cannot make the reader hold more than the budget.
    /// Messages up to 64 KiB (heartbeats, votes, most requests) are never counted.
    pub fn share_body_budget(&mut self, budget: Arc<Semaphore>) {
        self.budget = Some(budget);
    }

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
        let _room = match &self.budget {
            Some(b) if len > BODY_PIECE => {
                let kib = len.div_ceil(1024).min(u32::MAX as usize) as u32;
                match b.clone().try_acquire_many_owned(kib) {
                    Ok(p) => Some(p),
                    Err(_) => {
                        return Err(TransportError::io(
                            &self.name,
                            std::io::Error::other(format!(
                                "a message of {len} bytes while others fill the reader's budget for large messages"
                            )),
                        ))
                    }
                }
            }
            _ => None,
        };
        // The body is read as it arrives, in pieces: memory follows the bytes received,
        // not the length announced, and a body that stalls ends the connection.
        self.buf.clear();
        let body = async {
            while self.buf.len() < len {
                let start = self.buf.len();
                let piece = (len - start).min(BODY_PIECE);
                self.buf.resize(start + piece, 0);
                self.r.read_exact(&mut self.buf[start..]).await?;
            }
            Ok::<(), std::io::Error>(())
        };
        match tokio::time::timeout(BODY_TIMEOUT, body).await {
            Ok(r) => r.map_err(|e| TransportError::io(&self.name, e))?,
            Err(_) => return Err(TransportError::Timeout(self.name.clone())),
        }
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
