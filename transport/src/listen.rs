//! Where a peer accepts data links: a TCP listener (plain or TLS, told apart by the
//! dialer's first byte), an abstract unix socket for shared memory, and a QUIC
//! endpoint. Every connection must authenticate and introduce itself within the
//! handshake timeout before it reaches the caller; at most [`MAX_PENDING`] may be doing
//! so at once (see [`crate::admission`]: a flood of strangers cannot lock peers out).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::Secret;
use eccl_protocol::LinkHello;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;

use crate::admission::Admission;

use crate::connect::{expect_link_role, read_hello, MODE_PLAIN, MODE_TLS};
use crate::link::stream::{BoxRead, BoxWrite};
use crate::link::Transport;
use crate::quic::QuicLink;
use crate::{handshake, quic, tls, TransportError};

pub use crate::admission::MAX_PENDING;

/// A TCP port free on `host` now, for a listener that starts later: a master whose
/// address others must be told before it runs, or one restarted at its old address
/// (eccl-chaos's master set, the tests' clusters).
///
/// It lies below the kernel's ephemeral range (`ip_local_port_range`), where neither a
/// bind to port 0 nor an outgoing connection gets its port, so it stays free until the
/// listener binds it, also while that listener is down between a kill and a restart. (A
/// port found by a bind to port 0 can go to some connection in between, and the listener
/// then fails with "address already in use".) Each process walks the range from a start
/// of its own (its PID) and hands out each port once; where nearly every port is
/// ephemeral, the kernel's choice (a bind to port 0) is all there is, still never a port
/// handed out before.
pub fn port_to_listen_later(host: IpAddr) -> std::io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (low, high) = (ephemeral_low.saturating_sub(16384).max(1024), ephemeral_low);
    if high > low + 1024 {
        let span = high - low;
        let start = std::process::id().wrapping_mul(2_654_435_761) % span;
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            if n >= span {
                break;
            }
            let port = (low + (start + n) % span) as u16;
            if std::net::TcpListener::bind((host, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind((host, 0))?.local_addr()?.port();
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
}

/// An authenticated, introduced data connection, not yet part of a link.
pub struct Accepted {
    pub hello: LinkHello,
    pub remote: String,
    pub conn: Conn,
}

pub enum Conn {
    /// One stream of a link over TCP or TLS (each of a link's streams is a connection).
    Stream {
        transport: Transport,
        read: BoxRead,
        write: BoxWrite,
        /// The connection's socket, held open by `read` and `write`.
        fd: std::os::fd::RawFd,
    },
    /// A whole shm link, whose segment is passed next ([`crate::shm::accept_link`]).
    Shm(UnixStream),
    /// A whole QUIC link.
    Quic(QuicLink),
}

impl Conn {
    pub fn transport(&self) -> Transport {
        match self {
            Conn::Stream { transport, .. } => *transport,
            Conn::Shm(_) => Transport::Shm,
            Conn::Quic(_) => Transport::Quic,
        }
    }
}

/// What to accept.
#[derive(Clone, Debug)]
pub struct ListenOptions {
    pub bind: IpAddr,
    pub secret: Secret,
    /// Refuse plaintext TCP links (this peer runs with `ECCL_TLS=1`).
    pub require_tls: bool,
    /// Name of the abstract unix socket for shm links; `None`: no shm listener.
    pub shm_name: Option<String>,
    /// Open a QUIC endpoint.
    pub quic: bool,
}

/// The listeners of one peer; dropping it stops them.
pub struct Listeners {
    pub tcp_addr: SocketAddr,
    pub shm_name: Option<String>,
    pub quic_addr: Option<SocketAddr>,
    /// The QUIC endpoint, also used to dial.
    pub quic: Option<quinn::Endpoint>,
    pub accepted: mpsc::Receiver<Accepted>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Listeners {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Some(e) = &self.quic {
            e.close(0u32.into(), b"bye");
        }
    }
}

/// Opens every listener `opts` asks for.
pub async fn listen(opts: ListenOptions) -> Result<Listeners, TransportError> {
    let (tx, rx) = mpsc::channel(256);
    let pending = Admission::new(MAX_PENDING);
    let tcp = TcpListener::bind((opts.bind, 0))
        .await
        .map_err(|e| TransportError::io(opts.bind, e))?;
    let tcp_addr = tcp
        .local_addr()
        .map_err(|e| TransportError::io(opts.bind, e))?;
    let mut tasks = vec![tokio::spawn(accept_tcp(
        tcp,
        opts.clone(),
        tx.clone(),
        pending.clone(),
    ))];
    let shm_name = match &opts.shm_name {
        Some(name) => {
            let addr =
                crate::connect::abstract_addr(name).map_err(|e| TransportError::io(name, e))?;
            let std = std::os::unix::net::UnixListener::bind_addr(&addr)
                .map_err(|e| TransportError::io(name, e))?;
            std.set_nonblocking(true)
                .map_err(|e| TransportError::io(name, e))?;
            let l = UnixListener::from_std(std).map_err(|e| TransportError::io(name, e))?;
            tasks.push(tokio::spawn(accept_shm(
                l,
                opts.secret.clone(),
                tx.clone(),
                pending.clone(),
            )));
            Some(name.clone())
        }
        None => None,
    };
    let (quic, quic_addr) = if opts.quic {
        let ep = quic::endpoint(SocketAddr::new(opts.bind, 0))?;
        let addr = ep
            .local_addr()
            .map_err(|e| TransportError::io(opts.bind, e))?;
        tasks.push(tokio::spawn(accept_quic(
            ep.clone(),
            opts.secret.clone(),
            tx,
            pending,
        )));
        (Some(ep), Some(addr))
    } else {
        (None, None)
    };
    Ok(Listeners {
        tcp_addr,
        shm_name,
        quic_addr,
        quic,
        accepted: rx,
        tasks,
    })
}

/// Runs the introduction of one connection under the admission cap, and hands what it
/// produced to the link manager (or logs why it was refused).
fn handle<F>(pending: &Arc<Admission>, out: mpsc::Sender<Accepted>, remote: String, work: F)
where
    F: std::future::Future<Output = Result<Accepted, TransportError>> + Send + 'static,
{
    pending.admit(
        async move {
            match work.await {
                Ok(a) => Some(a),
                Err(e) => {
                    if let Some(held) = crate::logging::limit("refused data connection") {
                        tracing::warn!(target: "eccl::net", "refused data connection from {remote}: {e}{}", crate::logging::held_note(held));
                    }
                    None
                }
            }
        },
        move |a| async move {
            // A full queue means nobody is taking links now (no world is being connected)
            // and many have come: drop this one rather than keep it waiting.
            if out.try_send(a).is_err() {
                tracing::debug!(target: "eccl::net", "dropping a link nobody is waiting for");
            }
        },
    );
}

async fn accept_tcp(
    listener: TcpListener,
    opts: ListenOptions,
    out: mpsc::Sender<Accepted>,
    pending: Arc<Admission>,
) {
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(target: "eccl::net", "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let opts = opts.clone();
        handle(&pending, out.clone(), remote.to_string(), async move {
            tcp_one(stream, remote, &opts).await
        });
    }
}

async fn tcp_one(
    mut stream: TcpStream,
    remote: SocketAddr,
    opts: &ListenOptions,
) -> Result<Accepted, TransportError> {
    let name = remote.to_string();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    stream
        .set_nodelay(true)
        .map_err(|e| TransportError::io(&name, e))?;
    let mut mode = [0u8; 1];
    tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT, stream.read_exact(&mut mode))
        .await
        .map_err(|_| TransportError::Timeout(name.clone()))?
        .map_err(|e| TransportError::io(&name, e))?;
    let (hello, transport, read, write): (LinkHello, Transport, BoxRead, BoxWrite) = match mode[0] {
        MODE_TLS => {
            let (role, mut s) = tls::accept(stream, &opts.secret, &name).await?;
            expect_link_role(role, &name)?;
            let hello = read_hello(&mut s, &name).await?;
            let (r, w) = tokio::io::split(s);
            (hello, Transport::Tls, Box::new(r), Box::new(w))
        }
        MODE_PLAIN if !opts.require_tls => {
            let role = handshake::accept(&mut stream, &opts.secret, &name).await?;
            expect_link_role(role, &name)?;
            let hello = read_hello(&mut stream, &name).await?;
            let (r, w) = stream.into_split();
            (hello, Transport::Tcp, Box::new(r), Box::new(w))
        }
        MODE_PLAIN => {
            return Err(TransportError::BadHello {
                peer: name,
                reason: "a plaintext link, and this peer requires TLS (ECCL_TLS=1 on every peer)"
                    .into(),
            })
        }
        other => {
            return Err(TransportError::BadHello {
                peer: name,
                reason: format!("unknown mode byte {other:#04x} (not an eccl peer?)"),
            })
        }
    };
    Ok(Accepted {
        hello,
        remote: name,
        conn: Conn::Stream {
            transport,
            read,
            write,
            fd,
        },
    })
}

async fn accept_shm(
    listener: UnixListener,
    secret: Secret,
    out: mpsc::Sender<Accepted>,
    pending: Arc<Admission>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(target: "eccl::net", "shm accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let secret = secret.clone();
        handle(
            &pending,
            out.clone(),
            "a local process".into(),
            async move { shm_one(stream, &secret).await },
        );
    }
}

async fn shm_one(mut stream: UnixStream, secret: &Secret) -> Result<Accepted, TransportError> {
    let name = match stream.peer_cred() {
        Ok(c) => format!("local pid {}", c.pid().unwrap_or(0)),
        Err(_) => "a local process".to_string(),
    };
    crate::shm::check_same_user(&stream, &name)?;
    let mut mode = [0u8; 1];
    tokio::time::timeout(handshake::HANDSHAKE_TIMEOUT, stream.read_exact(&mut mode))
        .await
        .map_err(|_| TransportError::Timeout(name.clone()))?
        .map_err(|e| TransportError::io(&name, e))?;
    if mode[0] != MODE_PLAIN {
        return Err(TransportError::BadHello {
            peer: name,
            reason: format!("mode byte {:#04x} on a shm link", mode[0]),
        });
    }
    let role = handshake::accept(&mut stream, secret, &name).await?;
    expect_link_role(role, &name)?;
    let hello = read_hello(&mut stream, &name).await?;
    Ok(Accepted {
        hello,
        remote: name,
        conn: Conn::Shm(stream),
    })
}

async fn accept_quic(
    endpoint: quinn::Endpoint,
    secret: Secret,
    out: mpsc::Sender<Accepted>,
    pending: Arc<Admission>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let remote = incoming.remote_address().to_string();
        let secret = secret.clone();
        handle(&pending, out.clone(), remote, async move {
            quic::accept(incoming, &secret)
                .await
                .map(|(hello, link, remote)| Accepted {
                    hello,
                    remote,
                    conn: Conn::Quic(link),
                })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::port_to_listen_later;

    #[test]
    fn ports_to_listen_later_are_free_distinct_and_outside_the_ephemeral_range() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(32768);
        let lo = [127, 0, 0, 1].into();
        // A port held by a listener must be skipped as busy.
        let held =
            std::net::TcpListener::bind(("127.0.0.1", port_to_listen_later(lo).unwrap())).unwrap();
        let mut seen = vec![held.local_addr().unwrap().port()];
        for _ in 0..50 {
            let p = port_to_listen_later(lo).unwrap();
            assert!(!seen.contains(&p), "port {p} handed out twice");
            if low > 2048 {
                assert!(p < low, "port {p} is in the ephemeral range from {low}");
            }
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("the port is free");
            seen.push(p);
        }
    }
}
