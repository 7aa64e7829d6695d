//! Connecting the links of a world: every pair of members gets one link (a full mesh, so
//! that direct algorithms and abort frames reach everyone in one hop). The member with
//! the smaller peer id dials, the other accepts; both know who to expect from the world.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;

use eccl_protocol::auth::Secret;
use eccl_protocol::{LinkHello, PeerId, World};
use eccl_transport::link::{link_from_streams, Incoming, LinkRx, LinkTx};
use eccl_transport::tcp::{self, Accepted};
use futures::future::try_join_all;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::abort::{AbortState, EpochLinkObserver};
use crate::config::Config;
use crate::error::{Error, Result};

/// Receive buffers larger than this are not kept for reuse.
const KEEP_BUF_MAX: usize = 64 << 20;

pub(crate) struct PeerRx {
    pub link: LinkRx,
    /// Frames that arrived before the executor asked for them (a later step, a later
    /// collective, a send/recv message).
    pub stash: VecDeque<Incoming>,
}

pub(crate) struct PeerLink {
    pub tx: LinkTx,
    pub rx: PeerRx,
}

pub(crate) struct LinkManager {
    secret: Secret,
    accepted: mpsc::Receiver<Accepted>,
    /// Connections for an epoch we have not reached yet.
    early: Vec<Accepted>,
    acceptor: tokio::task::JoinHandle<()>,
    /// Watches every link for abort frames of the current epoch.
    observer: Arc<EpochLinkObserver>,
    pub local_addr: SocketAddr,
    pub advertise_host: Option<String>,
}

impl Drop for LinkManager {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

/// The IPv4 address of interface `name` (`ECCL_SOCKET_IFNAME`).
fn interface_addr(name: &str) -> Result<std::net::IpAddr> {
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

impl LinkManager {
    pub async fn bind(cfg: &Config, abort: &Arc<AbortState>) -> Result<LinkManager> {
        let (bind_ip, advertise_host) = match &cfg.socket_ifname {
            Some(name) => {
                let ip = interface_addr(name)?;
                (ip, Some(ip.to_string()))
            }
            None => ("0.0.0.0".parse().expect("valid literal"), None),
        };
        let listener = TcpListener::bind((bind_ip, 0))
            .await
            .map_err(|e| Error::InvalidArgument(format!("cannot listen on {bind_ip}: {e}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let secret = cfg
            .secret
            .clone()
            .ok_or_else(|| Error::InvalidArgument("no job secret".into()))?;
        let (tx, rx) = mpsc::channel(256);
        let acceptor = tcp::spawn_acceptor(listener, secret.clone(), tx);
        tracing::info!(target: "eccl::net", "listening for links on {local_addr}");
        Ok(LinkManager {
            secret,
            accepted: rx,
            early: Vec::new(),
            acceptor,
            observer: Arc::new(EpochLinkObserver::new(abort.clone())),
            local_addr,
            advertise_host,
        })
    }

    /// Connects to every other member of `world` but those in `keep`, whose links from
    /// the previous epoch carry on (both ends decide alike, from the master's
    /// `reuse_links`). Returns links indexed by rank (`None` at our own rank).
    pub async fn connect_world(
        &mut self,
        world: &World,
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
        self.observer.enter(
            epoch,
            world
                .members
                .iter()
                .map(|m| (name(m.rank.0), m.rank.0))
                .collect(),
        );
        let observer = self.observer.clone();
        let expected: HashMap<PeerId, u32> = world
            .members
            .iter()
            .filter(|m| m.peer_id < me && !keep.contains_key(&m.peer_id))
            .map(|m| (m.peer_id, m.rank.0))
            .collect();
        let kept = keep.len();

        let secret = &self.secret;
        let to_dial = world
            .members
            .iter()
            .filter(|m| m.peer_id > me && !keep.contains_key(&m.peer_id));
        let dials = try_join_all(to_dial.map(|m| async move {
            let mut streams = Vec::new();
            for s in 0..nstreams {
                let hello = LinkHello {
                    from: me,
                    to: m.peer_id,
                    epoch,
                    stream: s,
                    nstreams,
                };
                let st = tcp::dial(&m.addr, secret, &hello, cfg.connect_timeout)
                    .await
                    .map_err(|e| Error::Aborted {
                        epoch,
                        cause: format!("cannot connect to rank {} at {}: {e}", m.rank, m.addr),
                    })?;
                streams.push(st);
            }
            Ok::<_, Error>((m.rank.0, streams))
        }));

        let early = std::mem::take(&mut self.early);
        let accepted = &mut self.accepted;
        let mut later = Vec::new();
        let accepts = async {
            let mut got: HashMap<u32, Vec<Option<TcpStream>>> = HashMap::new();
            let mut complete = 0usize;
            let mut queue: VecDeque<Accepted> = early.into();
            while complete < expected.len() {
                let a = match queue.pop_front() {
                    Some(a) => a,
                    None => accepted.recv().await.ok_or_else(|| Error::Aborted {
                        epoch,
                        cause: "link acceptor stopped".into(),
                    })?,
                };
                let h = &a.hello;
                if h.epoch > epoch {
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
                            tracing::warn!(target: "eccl::net", "dropping unexpected link from {} ({:?})", a.remote, h);
                        }
                        continue;
                    }
                };
                let slots = got
                    .entry(rank)
                    .or_insert_with(|| (0..nstreams).map(|_| None).collect());
                let slot = &mut slots[h.stream as usize];
                if slot.is_none() {
                    *slot = Some(a.stream);
                    if slots.iter().all(Option::is_some) {
                        complete += 1;
                    }
                }
            }
            Ok::<_, Error>(got)
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
        let all = dialed.into_iter().chain(
            accepted
                .into_iter()
                .map(|(r, s)| (r, s.into_iter().flatten().collect::<Vec<_>>())),
        );
        for (rank, streams) in all {
            let halves = streams.into_iter().map(|s| s.into_split()).collect();
            let (tx, rx) = link_from_streams(name(rank), halves, observer.clone(), KEEP_BUF_MAX);
            links[rank as usize] = Some(PeerLink {
                tx,
                rx: PeerRx {
                    link: rx,
                    stash: VecDeque::new(),
                },
            });
        }
        tracing::info!(target: "eccl::net", "epoch {epoch}: kept {kept} links, connected {} over tcp ({} stream(s) each)", world.size().saturating_sub(1 + kept), nstreams);
        Ok(links)
    }
}
