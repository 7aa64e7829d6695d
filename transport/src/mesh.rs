//! Finished links, whatever the transport (gloo's `transport::Pair`, which its
//! `connectFullMesh` makes for every pair): [`Dialer::link`] opens a link to a peer's
//! addresses over the transport the caller chose, and [`Assembler::add`] turns what the
//! listeners accepted into links once they are complete (every stream of a TCP or TLS
//! link, a shm link's segment, a QUIC connection). A caller deals in `(LinkTx, LinkRx)`
//! and names a transport only to choose one; how each is dialed, accepted and put
//! together stays here.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::{AuthError, Secret};
use eccl_protocol::LinkHello;

use crate::connect;
use crate::link::stream::{link_from_streams, BoxRead, BoxWrite};
use crate::link::{LinkObserver, LinkRx, LinkTx, Transport};
use crate::listen::Conn;
use crate::{quic, shm, TransportError};

/// What every link of a mesh is made with.
#[derive(Clone)]
pub struct LinkSettings {
    /// The frame size of a shm link's rings.
    pub shm_frame_bytes: usize,
    /// How long one link may take to connect.
    pub connect_timeout: Duration,
    /// Receive buffers larger than this are not kept for reuse.
    pub keep_buf_max: usize,
    /// Told of every link's failure (the peer aborts the epoch).
    pub observer: Arc<dyn LinkObserver>,
}

impl LinkSettings {
    /// A link over `streams` (a TCP or TLS link's connections, with their sockets
    /// `tcp_fds`; a QUIC connection's streams, whose `guard` keeps the connection open).
    fn stream_link(
        &self,
        peer: String,
        transport: Transport,
        streams: Vec<(BoxRead, BoxWrite)>,
        tcp_fds: Vec<std::os::fd::RawFd>,
        guard: Option<Arc<dyn crate::link::stream::LinkGuard>>,
    ) -> (LinkTx, LinkRx) {
        link_from_streams(
            peer,
            transport,
            streams,
            tcp_fds,
            self.observer.clone(),
            self.keep_buf_max,
            guard,
        )
    }
}

/// How a peer picks the transport of each of its links.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory between peers of one host, TCP (TLS with `ECCL_TLS=1`) otherwise.
    #[default]
    Auto,
    Tcp,
    /// Shared memory between peers of one host; links to other hosts use TCP.
    Shm,
    Quic,
}

impl TransportChoice {
    pub const ALL: [TransportChoice; 4] = [
        TransportChoice::Auto,
        TransportChoice::Tcp,
        TransportChoice::Shm,
        TransportChoice::Quic,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Shm => "shm",
            TransportChoice::Quic => "quic",
        }
    }

    pub fn parse(s: &str) -> Option<TransportChoice> {
        let s = s.trim().to_ascii_lowercase();
        TransportChoice::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// How links to a peer are chosen: the user's preference (`ECCL_TRANSPORT`) and
/// whether stream links use TLS (`ECCL_TLS`).
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    pub prefer: TransportChoice,
    pub tls: bool,
}

impl Policy {
    /// TCP, or TLS where the policy asks for it.
    fn stream(self) -> Transport {
        if self.tls {
            Transport::Tls
        } else {
            Transport::Tcp
        }
    }

    /// The transport of a link to a peer at `to`; `same_host`: the peer runs on this
    /// peer's host (shared memory reaches it if both have a segment socket).
    pub fn choose(self, to: &Addresses<'_>, same_host: bool) -> Result<Transport, String> {
        let shm = same_host && to.shm.is_some();
        Ok(match self.prefer {
            TransportChoice::Auto | TransportChoice::Shm if shm => Transport::Shm,
            TransportChoice::Auto | TransportChoice::Tcp => self.stream(),
            TransportChoice::Shm => {
                tracing::warn!(target: "eccl::net", "ECCL_TRANSPORT=shm, but that peer is on another host: its link uses {}", self.stream());
                self.stream()
            }
            TransportChoice::Quic if to.quic.is_some() => Transport::Quic,
            TransportChoice::Quic => {
                return Err("ECCL_TRANSPORT=quic, but that peer has no QUIC endpoint".into())
            }
        })
    }
}

/// Attempts at a link whose connection was closed before its handshake was done.
const DIAL_TRIES: u32 = 4;

/// Where a peer accepts links: its TCP listener, and its QUIC endpoint and shm socket if
/// it has them.
#[derive(Clone, Copy, Debug)]
pub struct Addresses<'a> {
    pub tcp: &'a str,
    pub quic: Option<&'a str>,
    pub shm: Option<&'a str>,
}

/// Opens links to other peers.
pub struct Dialer<'a> {
    pub secret: &'a Secret,
    /// This peer's QUIC endpoint (QUIC links leave from it).
    pub quic: Option<&'a quic::Endpoint>,
    pub settings: &'a LinkSettings,
}

impl Dialer<'_> {
    /// A link to the peer at `to` over the transport `policy` chooses for it
    /// ([`Policy::choose`]); a shared-memory link that fails falls back to TCP (or TLS)
    /// when the choice was left to `auto`. Errors name the transport tried last.
    pub async fn link_to(
        &self,
        to: Addresses<'_>,
        same_host: bool,
        policy: Policy,
        hello: impl Fn(u16) -> LinkHello,
        peer: String,
    ) -> Result<(LinkTx, LinkRx), (Transport, TransportError)> {
        // The one refusal: QUIC asked for, and the peer has no QUIC endpoint.
        let t = policy.choose(&to, same_host).map_err(|reason| {
            (
                Transport::Quic,
                TransportError::Unavailable {
                    peer: peer.clone(),
                    reason,
                },
            )
        })?;
        match self.link_retrying(to, t, &hello, peer.clone()).await {
            Err(e) if t == Transport::Shm && policy.prefer == TransportChoice::Auto => {
                let fallback = policy.stream();
                tracing::warn!(target: "eccl::net", "shm link to {peer} failed ({e}); using {fallback}");
                self.link_retrying(to, fallback, &hello, peer)
                    .await
                    .map_err(|e| (fallback, e))
            }
            other => other.map_err(|e| (t, e)),
        }
    }

    /// [`Dialer::link`], tried again after a short pause when the connection was closed
    /// or reset before the handshake was done: a peer whose handshake queue is full (a
    /// world of hundreds forming at once) closes newcomers unheard until it has room
    /// (see [`crate::admission`]).
    async fn link_retrying(
        &self,
        to: Addresses<'_>,
        transport: Transport,
        hello: &impl Fn(u16) -> LinkHello,
        peer: String,
    ) -> Result<(LinkTx, LinkRx), TransportError> {
        let mut pause = Duration::from_millis(10);
        for _ in 1..DIAL_TRIES {
            match self.link(to, transport, hello, peer.clone()).await {
                // A hang-up right after our proof reads as a refused proof, but an
                // acceptor short of time (its handshake's limit passed while a host of
                // hundreds of processes ran others) hangs up the same way: asked again,
                // a wrong secret is refused again.
                Err(
                    TransportError::Io { .. }
                    | TransportError::Closed { .. }
                    | TransportError::Auth {
                        source: AuthError::Rejected,
                        ..
                    },
                ) => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                other => return other,
            }
        }
        self.link(to, transport, hello, peer).await
    }

    /// A link to the peer at `to` over `transport`, introduced on each stream by
    /// `hello(stream)` (a TCP or TLS link has the hello's `nstreams` connections);
    /// `peer` names it in errors and logs.
    pub async fn link(
        &self,
        to: Addresses<'_>,
        transport: Transport,
        hello: impl Fn(u16) -> LinkHello,
        peer: String,
    ) -> Result<(LinkTx, LinkRx), TransportError> {
        let s = self.settings;
        let unavailable = |reason: String| TransportError::Unavailable {
            peer: peer.clone(),
            reason,
        };
        match transport {
            Transport::Tcp | Transport::Tls => {
                let n = hello(0).nstreams.max(1);
                let mut streams = Vec::with_capacity(n as usize);
                let mut fds = Vec::with_capacity(n as usize);
                for i in 0..n {
                    let (r, w, fd) = connect::dial_tcp_stream(
                        to.tcp,
                        self.secret,
                        &hello(i),
                        transport == Transport::Tls,
                        s.connect_timeout,
                    )
                    .await?;
                    streams.push((r, w));
                    fds.push(fd);
                }
                Ok(s.stream_link(peer, transport, streams, fds, None))
            }
            Transport::Shm => {
                let name = to
                    .shm
                    .ok_or_else(|| unavailable("it has no shm socket".into()))?;
                connect::dial_shm(
                    name,
                    self.secret,
                    &hello(0),
                    s.shm_frame_bytes,
                    peer.clone(),
                    s.observer.clone(),
                    s.connect_timeout,
                )
                .await
            }
            Transport::Quic => {
                let ep = self
                    .quic
                    .ok_or_else(|| unavailable("this peer has no QUIC endpoint".into()))?;
                let addr = to
                    .quic
                    .ok_or_else(|| unavailable("it has no QUIC endpoint".into()))?;
                let at: SocketAddr = tokio::net::lookup_host(addr)
                    .await
                    .map_err(|e| TransportError::io(addr, e))?
                    .next()
                    .ok_or_else(|| unavailable(format!("{addr} does not resolve")))?;
                let link =
                    connect::dial_quic(ep, at, self.secret, &hello(0), s.connect_timeout).await?;
                let (streams, guard) = link.into_parts();
                Ok(s.stream_link(peer, Transport::Quic, streams, vec![], Some(guard)))
            }
            // The verbs link (crate::verbs) is built and tested on its own; a mesh does
            // not make verbs links yet.
            Transport::Verbs => Err(unavailable(
                "verbs links are not selectable for a world yet".into(),
            )),
        }
    }
}

/// Puts accepted connections together into links. Each link is keyed by the caller's
/// name for its peer (a rank); a TCP or TLS link is complete once all its streams have
/// arrived over one transport.
pub struct Assembler {
    settings: LinkSettings,
    partial: HashMap<
        u32,
        (
            Transport,
            Vec<Option<(BoxRead, BoxWrite, std::os::fd::RawFd)>>,
        ),
    >,
}

impl Assembler {
    pub fn new(settings: LinkSettings) -> Assembler {
        Assembler {
            settings,
            partial: HashMap::new(),
        }
    }

    /// Adds connection `conn`, stream `stream` of the `nstreams` of the link from `key`
    /// (the caller has checked who sent it and that the count is the link's); returns
    /// the link once it is complete. A stream of another transport than the link's
    /// first, or one already there, is dropped.
    pub async fn add(
        &mut self,
        key: u32,
        stream: u16,
        nstreams: u16,
        conn: Conn,
        peer: String,
    ) -> Result<Option<(LinkTx, LinkRx)>, TransportError> {
        let s = &self.settings;
        match conn {
            Conn::Stream {
                transport,
                read,
                write,
                fd,
            } => {
                let n = nstreams.max(1) as usize;
                let (kind, slots) = self
                    .partial
                    .entry(key)
                    .or_insert_with(|| (transport, (0..n).map(|_| None).collect()));
                let i = stream as usize;
                if *kind != transport || i >= slots.len() || slots[i].is_some() {
                    return Ok(None);
                }
                slots[i] = Some((read, write, fd));
                if !slots.iter().all(Option::is_some) {
                    return Ok(None);
                }
                let (kind, slots) = self.partial.remove(&key).expect("present above");
                let (streams, fds) = slots
                    .into_iter()
                    .flatten()
                    .map(|(r, w, fd)| ((r, w), fd))
                    .unzip();
                Ok(Some(s.stream_link(peer, kind, streams, fds, None)))
            }
            Conn::Shm(sock) => shm::accept_link(sock, peer, s.observer.clone(), s.connect_timeout)
                .await
                .map(Some),
            Conn::Quic(q) => {
                let (streams, guard) = q.into_parts();
                Ok(Some(s.stream_link(
                    peer,
                    Transport::Quic,
                    streams,
                    vec![],
                    Some(guard),
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_chooses_each_links_transport() {
        let both = Addresses {
            tcp: "h:1",
            quic: Some("h:2"),
            shm: Some("@s"),
        };
        let tcp_only = Addresses {
            tcp: "h:1",
            quic: None,
            shm: None,
        };
        let p = |prefer, tls| Policy { prefer, tls };
        use TransportChoice::*;
        assert_eq!(p(Auto, false).choose(&both, true), Ok(Transport::Shm));
        assert_eq!(p(Auto, false).choose(&both, false), Ok(Transport::Tcp));
        assert_eq!(p(Auto, true).choose(&tcp_only, true), Ok(Transport::Tls));
        assert_eq!(p(Shm, false).choose(&both, false), Ok(Transport::Tcp));
        assert_eq!(p(Tcp, false).choose(&both, true), Ok(Transport::Tcp));
        assert_eq!(p(Quic, false).choose(&both, true), Ok(Transport::Quic));
        assert!(p(Quic, false).choose(&tcp_only, false).is_err());
    }
}
