//! Connecting the links of a world: every pair of members gets one link (a full mesh, so
//! that direct algorithms and abort frames reach everyone in one hop). The member with
//! the smaller peer id dials and picks the link's transport; the other accepts whatever
//! arrives from the member it expects.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use eccl_protocol::auth::{LinkKeys, Secret};
use eccl_protocol::{LinkHello, Member, PeerId, World};
use eccl_transport::connect::{self, stream_link};
use eccl_transport::link::stream::{BoxRead, BoxWrite};
use eccl_transport::link::{Incoming, LinkObserver, LinkRx, LinkTx, Transport};
use eccl_transport::listen::{self, Accepted, Conn, ListenOptions, Listeners};
use eccl_transport::shm;
use futures::future::try_join_all;

use crate::abort::{AbortState, EpochLinkObserver};
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};

/// Receive buffers larger than this are not kept for reuse.
const KEEP_BUF_MAX: usize = 64 << 20;
/// Connections for the next epoch kept until this peer gets there.
const MAX_EARLY: usize = 1024;

pub(crate) struct PeerRx {
    pub link: LinkRx,
    /// Frames that arrived before the executor asked for them (a later step, a later
    /// collective, a send/recv message), in memory of their own.
    pub stash: VecDeque<Incoming>,
}

pub(crate) struct PeerLink {
    pub tx: LinkTx,
    pub rx: PeerRx,
}

impl PeerLink {
    fn new((tx, rx): (LinkTx, LinkRx)) -> PeerLink {
        PeerLink {
            tx,
            rx: PeerRx {
                link: rx,
                stash: VecDeque::new(),
            },
        }
    }
}

pub(crate) struct LinkManager {
    secret: Secret,
    listeners: Listeners,
    /// Connections for an epoch we have not reached yet.
    early: Vec<Accepted>,
    /// Watches every link for abort frames of the current epoch.
    observer: Arc<EpochLinkObserver>,
    pub local_addr: SocketAddr,
    pub advertise_host: Option<String>,
}

/// The IPv4 address of interface `name` (`ECCL_SOCKET_IFNAME`).
fn interface_addr(name: &str) -> Result<IpAddr> {
    let ifs = if_addrs::get_if_addrs()
        .map_err(|e| Error::InvalidArgument(format!("cannot list interfaces: {e}")))?;
    ifs.iter()
        .filter(|i| i.name == name)
        .map(|i| i.ip())
        .min_by_key(|ip| !ip.is_ipv4())
        .ok_or_else(|| {
            let names: Vec<_> = ifs.iter().map(|i| i.name.clone()).collect();
            Error::InvalidArgument(format!(
                "ECCL_SOCKET_IFNAME={name}: no such interface (have {})",
                names.join(", ")
            ))
        })
}

/// The transport of the link from `me` to `them`, which `me` dials.
fn choose(cfg: &Config, me: &Member, them: &Member) -> Result<Transport> {
    let same_host = me.host == them.host && me.shm.is_some() && them.shm.is_some();
    let tcp = if cfg.tls {
        Transport::Tls
    } else {
        Transport::Tcp
    };
    Ok(match cfg.transport {
        TransportChoice::Auto if same_host => Transport::Shm,
        TransportChoice::Auto | TransportChoice::Tcp => tcp,
        TransportChoice::Shm if same_host => Transport::Shm,
        TransportChoice::Shm => {
            tracing::warn!(target: "eccl::net", "ECCL_TRANSPORT=shm, but peer {} is on another host ({}): that link uses {tcp}", them.peer_id, them.host);
            tcp
        }
        TransportChoice::Quic if them.quic.is_some() => Transport::Quic,
        TransportChoice::Quic => {
            return Err(Error::InvalidArgument(format!(
                "ECCL_TRANSPORT=quic, but peer {} has no QUIC endpoint",
                them.peer_id
            )))
        }
    })
}

impl LinkManager {
    pub async fn bind(cfg: &Config, abort: &Arc<AbortState>) -> Result<LinkManager> {
        let (bind, advertise_host) = match &cfg.socket_ifname {
            Some(name) => {
                let ip = interface_addr(name)?;
                (ip, Some(ip.to_string()))
            }
            None => ("0.0.0.0".parse().expect("valid literal"), None),
        };
        let secret = cfg
            .secret
            .clone()
            .ok_or_else(|| Error::InvalidArgument("no job secret".into()))?;
        let shm_name = format!("eccl-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let listeners = listen::listen(ListenOptions {
            bind,
            secret: secret.clone(),
            require_tls: cfg.tls,
            shm_name: Some(shm_name),
            quic: true,
        })
        .await
        .map_err(|e| Error::InvalidArgument(format!("cannot listen for links on {bind}: {e}")))?;
        tracing::info!(target: "eccl::net", "listening for links: tcp {}, quic {:?}, shm @{}", listeners.tcp_addr, listeners.quic_addr, listeners.shm_name.as_deref().unwrap_or("-"));
        Ok(LinkManager {
            secret,
            local_addr: listeners.tcp_addr,
            listeners,
            early: Vec::new(),
            observer: Arc::new(EpochLinkObserver::new(abort.clone())),
            advertise_host,
        })
    }

    /// Waits (at most two seconds) until the QUIC endpoint has sent what its closed
    /// connections still owe the peers, the close notices included: they leave from
    /// this process's own buffers, which do not outlive it as a TCP socket's do.
    pub fn quiesce(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let ep = self.listeners.quic.clone();
        async move {
            if let Some(ep) = ep {
                let _ =
                    tokio::time::timeout(std::time::Duration::from_secs(2), ep.wait_idle()).await;
            }
        }
    }

    pub fn quic_port(&self) -> Option<u16> {
        self.listeners.quic_addr.map(|a| a.port())
    }

    pub fn shm_name(&self) -> Option<String> {
        self.listeners.shm_name.clone()
    }

    /// Connects to every other member of `world` but those in `keep`, whose links from
    /// the previous epoch carry on (both ends decide alike, from the master's
    /// `reuse_links`). Returns links indexed by rank (`None` at our own rank).
    pub async fn connect_world(
        &mut self,
        world: &World,
        keys: &LinkKeys,
        me: PeerId,
        cfg: &Config,
        mut keep: HashMap<PeerId, PeerLink>,
    ) -> Result<Vec<Option<PeerLink>>> {
        let epoch = world.epoch;
        let nstreams = cfg.nstreams as u16;
        let name = |r: u32| {
            let m = &world.members[r as usize];
            format!("peer {} ({})", m.peer_id, m.addr)
        };
        let mine = world
            .rank_of(me)
            .and_then(|r| world.member(r))
            .ok_or_else(|| Error::Evicted {
                reason: format!("not a member of epoch {epoch}"),
            })?;
        shm::plan_spin(world.members.iter().filter(|m| m.host == mine.host).count());
        self.observer.enter(
            epoch,
            world
                .members
                .iter()
                .map(|m| (name(m.rank.0), m.rank.0))
                .collect(),
        );
        let observer: Arc<dyn LinkObserver> = self.observer.clone();
        let expected: HashMap<PeerId, u32> = world
            .members
            .iter()
            .filter(|m| m.peer_id < me && !keep.contains_key(&m.peer_id))
            .map(|m| (m.peer_id, m.rank.0))
            .collect();
        let kept = keep.len();

        let dialer = Dialer {
            keys,
            secret: &self.secret,
            quic: self.listeners.quic.as_ref(),
            cfg,
            observer: observer.clone(),
            epoch,
            me,
            nstreams,
        };
        let to_dial = world
            .members
            .iter()
            .filter(|m| m.peer_id > me && !keep.contains_key(&m.peer_id));
        let dials = try_join_all(to_dial.map(|m| {
            let dialer = &dialer;
            let peer = name(m.rank.0);
            async move {
                let t = choose(cfg, mine, m)?;
                let link = match dialer.dial(m, t, peer.clone()).await {
                    Err(e) if t == Transport::Shm && cfg.transport == TransportChoice::Auto => {
                        let tcp = if cfg.tls { Transport::Tls } else { Transport::Tcp };
                        tracing::warn!(target: "eccl::net", "shm link to {peer} failed ({e}); using {tcp}");
                        dialer.dial(m, tcp, peer.clone()).await?
                    }
                    other => other?,
                };
                tracing::info!(target: "eccl::net", "epoch {epoch}: link to rank {} ({peer}) over {}", m.rank, link.0.transport());
                Ok::<_, Error>((m.rank.0, link))
            }
        }));

        let early = std::mem::take(&mut self.early);
        let accepted = &mut self.listeners.accepted;
        let mut later = Vec::new();
        let accepts = async {
            let mut streams: HashMap<u32, Vec<Option<(BoxRead, BoxWrite)>>> = HashMap::new();
            let mut kinds: HashMap<u32, Transport> = HashMap::new();
            let mut done: Vec<(u32, (LinkTx, LinkRx))> = Vec::new();
            let mut queue: VecDeque<Accepted> = early.into();
            while done.len() < expected.len() {
                let a = match queue.pop_front() {
                    Some(a) => a,
                    None => accepted.recv().await.ok_or_else(|| Error::Aborted {
                        epoch,
                        cause: "link acceptor stopped".into(),
                    })?,
                };
                let h = &a.hello;
                // The next epoch's links wait for it (a member may get there first);
                // any other epoch's are dropped.
                if h.epoch == epoch + 1 && later.len() < MAX_EARLY {
                    later.push(a);
                    continue;
                }
                let rank = match expected.get(&h.from) {
                    Some(r)
                        if h.epoch == epoch
                            && h.to == me
                            && h.nstreams == nstreams
                            && h.stream < nstreams =>
                    {
                        *r
                    }
                    _ => {
                        if h.epoch == epoch {
                            tracing::warn!(target: "eccl::net", "dropping unexpected link from {} (from {}, to {}, stream {} of {})", a.remote, h.from, h.to, h.stream, h.nstreams);
                        }
                        continue;
                    }
                };
                // Only the member the master admitted holds the proof for this link.
                if !keys.verify(h.from, me, epoch, &h.proof) {
                    if let Some(held) = eccl_transport::logging::limit("link impostor") {
                        tracing::warn!(target: "eccl::net", "refused a link from {} claiming to be peer {} in epoch {epoch}: its proof is not the master's{}", a.remote, h.from, eccl_transport::logging::held_note(held));
                    }
                    continue;
                }
                if done.iter().any(|(r, _)| *r == rank) {
                    continue;
                }
                let peer = name(rank);
                let stream = a.hello.stream as usize;
                match a.conn {
                    Conn::Stream {
                        transport,
                        read,
                        write,
                    } => {
                        if *kinds.entry(rank).or_insert(transport) != transport {
                            continue;
                        }
                        let slots = streams
                            .entry(rank)
                            .or_insert_with(|| (0..nstreams).map(|_| None).collect());
                        if slots[stream].is_none() {
                            slots[stream] = Some((read, write));
                        }
                        if slots.iter().all(Option::is_some) {
                            let all = streams.remove(&rank).unwrap_or_default();
                            let all = all.into_iter().flatten().collect();
                            let link = stream_link(
                                peer.clone(),
                                transport,
                                all,
                                observer.clone(),
                                KEEP_BUF_MAX,
                                None,
                            );
                            done.push((rank, link));
                        }
                    }
                    Conn::Shm(s) => {
                        let link = shm::accept_link(
                            s,
                            peer.clone(),
                            observer.clone(),
                            cfg.connect_timeout,
                        )
                        .await
                        .map_err(|e| Error::Aborted {
                            epoch,
                            cause: format!("shm link from {peer}: {e}"),
                        })?;
                        done.push((rank, link));
                    }
                    Conn::Quic(q) => {
                        let (all, guard) = q.into_parts();
                        let link = stream_link(
                            peer.clone(),
                            Transport::Quic,
                            all,
                            observer.clone(),
                            KEEP_BUF_MAX,
                            Some(guard),
                        );
                        done.push((rank, link));
                    }
                }
                if let Some((r, l)) = done.last().filter(|(r, _)| *r == rank) {
                    tracing::info!(target: "eccl::net", "epoch {epoch}: link from rank {r} ({}) over {}", name(*r), l.0.transport());
                }
            }
            Ok::<_, Error>(done)
        };

        let both = async { tokio::try_join!(dials, accepts) };
        let res = tokio::time::timeout(cfg.timeout, both).await;
        self.early.extend(later);
        let (dialed, accepted) = match res {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Timeout {
                    what: format!("connecting the links of epoch {epoch}"),
                    ms: cfg.timeout.as_millis() as u64,
                })
            }
        };

        let mut links: Vec<Option<PeerLink>> = world
            .members
            .iter()
            .map(|m| keep.remove(&m.peer_id))
            .collect();
        for (rank, link) in dialed.into_iter().chain(accepted) {
            links[rank as usize] = Some(PeerLink::new(link));
        }
        tracing::info!(target: "eccl::net", "epoch {epoch}: kept {kept} links, connected {} ({} stream(s) per stream link)", world.size().saturating_sub(1 + kept), nstreams);
        Ok(links)
    }
}

/// What dialing one link needs.
struct Dialer<'a> {
    keys: &'a LinkKeys,
    secret: &'a Secret,
    quic: Option<&'a eccl_transport::quic::Endpoint>,
    cfg: &'a Config,
    observer: Arc<dyn LinkObserver>,
    epoch: u64,
    me: PeerId,
    nstreams: u16,
}

impl Dialer<'_> {
    fn hello(&self, to: PeerId, stream: u16) -> LinkHello {
        LinkHello {
            from: self.me,
            to,
            epoch: self.epoch,
            stream,
            nstreams: self.nstreams,
            // Missing only if the master's world and keys disagree; the acceptor then
            // refuses the link and the epoch's connection deadline reports it.
            proof: self.keys.proof_for(to).unwrap_or_default(),
        }
    }

    async fn dial(&self, m: &Member, t: Transport, peer: String) -> Result<(LinkTx, LinkRx)> {
        let (epoch, timeout) = (self.epoch, self.cfg.connect_timeout);
        let cannot = |e: &dyn std::fmt::Display| Error::Aborted {
            epoch,
            cause: format!("cannot connect to rank {} over {t}: {e}", m.rank),
        };
        match t {
            Transport::Tcp | Transport::Tls => {
                let mut streams = Vec::new();
                for s in 0..self.nstreams {
                    let h = self.hello(m.peer_id, s);
                    let st =
                        connect::dial_tcp(&m.addr, self.secret, &h, t == Transport::Tls, timeout)
                            .await
                            .map_err(|e| cannot(&format!("{} at {}", e, m.addr)))?;
                    streams.push(st);
                }
                Ok(stream_link(
                    peer,
                    t,
                    streams,
                    self.observer.clone(),
                    KEEP_BUF_MAX,
                    None,
                ))
            }
            Transport::Shm => {
                let name = m
                    .shm
                    .as_deref()
                    .ok_or_else(|| cannot(&"it has no shm socket"))?;
                let h = self.hello(m.peer_id, 0);
                connect::dial_shm(
                    name,
                    self.secret,
                    &h,
                    self.cfg.buffsize,
                    peer,
                    self.observer.clone(),
                    timeout,
                )
                .await
                .map_err(|e| cannot(&e))
            }
            // The verbs link (eccl_transport::verbs) is built and tested on its own; no
            // ECCL_TRANSPORT setting selects it for a world's links yet.
            Transport::Verbs => Err(cannot(&"verbs links are not selectable for a world yet")),
            Transport::Quic => {
                let ep = self
                    .quic
                    .ok_or_else(|| cannot(&"this peer has no QUIC endpoint"))?;
                let addr = m
                    .quic
                    .as_deref()
                    .ok_or_else(|| cannot(&"it has no QUIC endpoint"))?;
                let addr: SocketAddr = tokio::net::lookup_host(addr)
                    .await
                    .map_err(|e| cannot(&e))?
                    .next()
                    .ok_or_else(|| cannot(&format!("{addr} does not resolve")))?;
                let h = self.hello(m.peer_id, 0);
                let link = connect::dial_quic(ep, addr, self.secret, &h, timeout)
                    .await
                    .map_err(|e| cannot(&e))?;
                let (all, guard) = link.into_parts();
                Ok(stream_link(
                    peer,
                    Transport::Quic,
                    all,
                    self.observer.clone(),
                    KEEP_BUF_MAX,
                    Some(guard),
                ))
            }
        }
    }
}
