//! Connecting the links of a world: every pair of members gets one link (a full mesh, so
//! that direct algorithms and abort frames reach everyone in one hop). The member with
//! the smaller peer id dials and picks the link's transport; the other accepts whatever
//! arrives from the member it expects.

use futures::future::try_join_all;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use eccl_protocol::auth::{LinkKeys, Secret};
use eccl_protocol::{LinkHello, Member, PeerId, World};
use eccl_transport::link::{Incoming, LinkObserver, LinkRx, LinkTx};
use eccl_transport::listen::{self, Accepted, ListenOptions, Listeners};
use eccl_transport::mesh::{self, Addresses, Assembler, LinkSettings};
use eccl_transport::spin;

use crate::abort::{AbortState, EpochLinkObserver};
use crate::config::Config;
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
    ///
    /// Each pair has one dialer, the larger peer id (it dials the smaller:
    /// [`dial_link`]); the smaller accepts ([`accept_links`]). Both sides run at once
    /// under the collective timeout, and stop when `abort` breaks the epoch.
    pub async fn connect_world(
        &mut self,
        world: &World,
        keys: &LinkKeys,
        me: PeerId,
        cfg: &Config,
        mut keep: HashMap<PeerId, PeerLink>,
        abort: &AbortState,
    ) -> Result<Vec<Option<PeerLink>>> {
        let epoch = world.epoch;
        let mine = world
            .rank_of(me)
            .and_then(|r| world.member(r))
            .ok_or_else(|| Error::Evicted {
                reason: format!("not a member of epoch {epoch}"),
            })?;
        let local = world.members.iter().filter(|m| m.host == mine.host).count();
        spin::plan_spin(local);
        plan_reduce_threads(local, cfg.reduce_threads);
        self.observer.enter(
            epoch,
            world
                .members
                .iter()
                .map(|m| (peer_name(world, m.rank.0), m.rank.0))
                .collect(),
        );
        let observer: Arc<dyn LinkObserver> = self.observer.clone();
        let kept = keep.len();
        let settings = LinkSettings {
            shm_frame_bytes: cfg.frame_bytes,
            connect_timeout: cfg.connect_timeout,
            keep_buf_max: KEEP_BUF_MAX,
            observer,
        };
        let hellos = Hellos {
            me,
            epoch,
            world,
            cfg,
            keys,
        };
        let dialer = mesh::Dialer {
            secret: &self.secret,
            quic: self.listeners.quic.as_ref(),
            settings: &settings,
        };
        // A few dials at a time: a world of hundreds forming at once on one host had every
        // member dial every other at the same moment, and the handshakes timed out or
        // were turned away faster than they completed (`eccl-chaos --peers 256`).
        let gate = tokio::sync::Semaphore::new(DIALS_AT_ONCE);
        let dials = try_join_all(
            world
                .members
                .iter()
                .filter(|m| m.peer_id > me && !keep.contains_key(&m.peer_id))
                .map(|m| {
                    let (gate, dialer, hellos) = (&gate, &dialer, &hellos);
                    async move {
                        // Never closed, so acquiring cannot fail.
                        let _turn = gate.acquire().await;
                        dial_link(dialer, cfg, world, mine, m, hellos).await
                    }
                }),
        );
        let expect = Expect {
            world,
            hellos: &hellos,
            from: world
                .members
                .iter()
                .filter(|m| m.peer_id < me && !keep.contains_key(&m.peer_id))
                .map(|m| (m.peer_id, m.rank.0))
                .collect(),
        };
        let early = std::mem::take(&mut self.early);
        let mut later = Vec::new();
        let accepts = accept_links(
            &expect,
            early,
            &mut self.listeners.accepted,
            Assembler::new(settings.clone()),
            &mut later,
        );
        // The master's abort of this epoch (a member evicted at its lease, or gone) ends
        // the wait at once: a member that stopped after the commit accepts TCP in its
        // kernel but never answers a handshake, and the connect would otherwise hold
        // every other member in update_topology() until the collective timeout
        // (`eccl-chaos --churn` found it: 30 s of a world without progress).
        // Links that are all there win over an abort heard at the same moment.
        let res = tokio::select! {
            biased;
            r = tokio::time::timeout(cfg.timeout, async { tokio::try_join!(dials, accepts) }) => {
                r.map_err(|_| Error::Timeout {
                    what: format!("connecting the links of epoch {epoch}"),
                    ms: cfg.timeout.as_millis() as u64,
                })
            }
            e = abort.wait(epoch, None) => Err(e),
        };
        self.early.extend(later);
        let (dialed, accepted) = res??;

        let mut links: Vec<Option<PeerLink>> = world
            .members
            .iter()
            .map(|m| keep.remove(&m.peer_id))
            .collect();
        for (rank, link) in dialed.into_iter().chain(accepted) {
            links[rank as usize] = Some(PeerLink::new(link));
        }
        tracing::info!(target: "eccl::net", "epoch {epoch}: kept {kept} links, connected {} ({} stream(s) per stream link{})", world.size().saturating_sub(1 + kept), cfg.nstreams, if world.stripes.is_empty() || !cfg.stripe_from_measure { String::new() } else { format!(", striped from measurements: {:?}", world.stripes) });
        Ok(links)
    }
}

/// Links one member dials at once while a world forms.
const DIALS_AT_ONCE: usize = 16;

/// How a member of `world` is named in errors and logs.
fn peer_name(world: &World, rank: u32) -> String {
    let m = &world.members[rank as usize];
    format!("peer {} ({})", m.peer_id, m.addr)
}

/// The hellos that open each stream of this epoch's links, with the master's proof for
/// the pair.
struct Hellos<'a> {
    me: PeerId,
    epoch: u64,
    world: &'a World,
    cfg: &'a Config,
    keys: &'a LinkKeys,
}

/// The connections (streams) of the link between `a` and `b` in `world`: what the master
/// striped it over from measurements where `ECCL_NSTREAMS=auto`, else `ECCL_NSTREAMS`.
/// Both ends read the same world and, by the job's rule, the same setting.
pub(crate) fn streams_between(world: &World, cfg: &Config, a: PeerId, b: PeerId) -> u16 {
    let fixed = cfg.nstreams as u16;
    if cfg.stripe_from_measure {
        world.stripes_between(a, b).unwrap_or(fixed)
    } else {
        fixed
    }
}

impl Hellos<'_> {
    /// The streams of our link to `to` this epoch.
    fn nstreams(&self, to: PeerId) -> u16 {
        streams_between(self.world, self.cfg, self.me, to)
    }

    /// The hello of each stream of our link to `to`. The master's proof is missing only
    /// if its world and keys disagree; the acceptor then refuses the link and the epoch's
    /// connection deadline reports it.
    fn to(&self, to: PeerId) -> impl Fn(u16) -> LinkHello {
        let (from, epoch) = (self.me, self.epoch);
        let nstreams = self.nstreams(to);
        let proof = self.keys.proof_for(to).unwrap_or_default();
        move |stream| LinkHello {
            from,
            to,
            epoch,
            stream,
            nstreams,
            proof,
        }
    }
}

/// Our link to member `m`, over the transport the mesh's [`mesh::Policy`] picks for it
/// from `ECCL_TRANSPORT` and `ECCL_TLS` (shared memory to a member on this host, TCP or
/// TLS otherwise, QUIC when asked for).
async fn dial_link(
    dialer: &mesh::Dialer<'_>,
    cfg: &Config,
    world: &World,
    mine: &Member,
    m: &Member,
    hellos: &Hellos<'_>,
) -> Result<(u32, (LinkTx, LinkRx))> {
    let (epoch, peer) = (world.epoch, peer_name(world, m.rank.0));
    let at = Addresses {
        tcp: &m.addr,
        quic: m.quic.as_deref(),
        shm: m.shm.as_deref(),
    };
    let same_host = mine.host == m.host && mine.shm.is_some();
    let policy = mesh::Policy {
        prefer: cfg.transport,
        tls: cfg.tls,
    };
    let link = dialer
        .link_to(at, same_host, policy, hellos.to(m.peer_id), peer.clone())
        .await
        .map_err(|(t, e)| Error::Aborted {
            epoch,
            cause: format!("cannot connect to rank {} over {t}: {e}", m.rank),
        })?;
    tracing::info!(target: "eccl::net", "epoch {epoch}: link to rank {} ({peer}) over {}", m.rank, link.0.transport());
    Ok((m.rank.0, link))
}

/// What the accepting side of an epoch expects: a link from each member in `from`
/// (peer id to rank), introduced by hellos of this epoch that carry the master's proof.
struct Expect<'a> {
    world: &'a World,
    hellos: &'a Hellos<'a>,
    from: HashMap<PeerId, u32>,
}

impl Expect<'_> {
    /// The rank whose link this stream belongs to, or `None` for a stream to drop:
    /// another epoch's, one not addressed to us or not from a member we expect, or one
    /// whose proof is not the master's (an impostor: logged, rate-limited).
    fn rank_of(&self, a: &Accepted) -> Option<u32> {
        let (h, epoch, me) = (&a.hello, self.hellos.epoch, self.hellos.me);
        let nstreams = self.hellos.nstreams(h.from);
        let rank = match self.from.get(&h.from) {
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
                return None;
            }
        };
        // Only the member the master admitted holds the proof for this link.
        if !self.hellos.keys.verify(h.from, me, epoch, &h.proof) {
            if let Some(held) = eccl_transport::logging::limit("link impostor") {
                tracing::warn!(target: "eccl::net", "refused a link from {} claiming to be peer {} in epoch {epoch}: its proof is not the master's{}", a.remote, h.from, eccl_transport::logging::held_note(held));
            }
            return None;
        }
        Some(rank)
    }
}

/// Accepts the links `expect` names, from the streams that came before this epoch
/// (`early`) and then from the listeners, and assembles each link from its streams.
/// Streams of the next epoch (a member may get there first) go to `later`, up to
/// [`MAX_EARLY`]; any other epoch's are dropped.
async fn accept_links(
    expect: &Expect<'_>,
    early: Vec<Accepted>,
    accepted: &mut tokio::sync::mpsc::Receiver<Accepted>,
    mut assembler: Assembler,
    later: &mut Vec<Accepted>,
) -> Result<Vec<(u32, (LinkTx, LinkRx))>> {
    let epoch = expect.hellos.epoch;
    let mut done: Vec<(u32, (LinkTx, LinkRx))> = Vec::new();
    let mut queue: VecDeque<Accepted> = early.into();
    while done.len() < expect.from.len() {
        let a = match queue.pop_front() {
            Some(a) => a,
            None => accepted.recv().await.ok_or_else(|| Error::Aborted {
                epoch,
                cause: "link acceptor stopped".into(),
            })?,
        };
        if a.hello.epoch == epoch + 1 && later.len() < MAX_EARLY {
            later.push(a);
            continue;
        }
        let Some(rank) = expect.rank_of(&a) else {
            continue;
        };
        if done.iter().any(|(r, _)| *r == rank) {
            continue;
        }
        let peer = peer_name(expect.world, rank);
        let (stream, nstreams) = (a.hello.stream, a.hello.nstreams);
        let link = assembler
            .add(rank, stream, nstreams, a.conn, peer.clone())
            .await
            .map_err(|e| Error::Aborted {
                epoch,
                cause: format!("link from {peer}: {e}"),
            })?;
        if let Some(link) = link {
            tracing::info!(target: "eccl::net", "epoch {epoch}: link from rank {rank} ({peer}) over {}", link.0.transport());
            done.push((rank, link));
        }
    }
    // What else waits was not expected (links that carry on need no new connection):
    // connections for this epoch or an older one are closed, an impostor's among them;
    // those for the next epoch wait for it.
    while let Some(a) = queue
        .pop_front()
        .or_else(|| eccl_transport::link::ready_now(accepted))
    {
        if a.hello.epoch == epoch + 1 && later.len() < MAX_EARLY {
            later.push(a);
        }
    }
    Ok(done)
}

/// Most threads one reduction takes by default: past four, a reduction is bound by the
/// memory, not the cores.
const MAX_AUTO_REDUCE_THREADS: usize = 4;

/// How many threads a large reduction of this process may use: `forced`
/// (`ECCL_REDUCE_THREADS`), else the host's cores shared among the `local` ranks on it,
/// so that ranks never compete for cores (two ranks on two cores: one thread each).
fn plan_reduce_threads(local: usize, forced: Option<usize>) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads =
        forced.unwrap_or_else(|| (cores / local.max(1)).clamp(1, MAX_AUTO_REDUCE_THREADS));
    if threads != eccl_algorithms::kernels::threads() {
        tracing::info!(
            "reductions of {} KiB and more on {threads} threads ({cores} cores, {local} ranks on \
             this host{})",
            eccl_algorithms::kernels::PAR_MIN_BYTES >> 10,
            if forced.is_some() {
                ", ECCL_REDUCE_THREADS"
            } else {
                ""
            }
        );
    }
    eccl_algorithms::kernels::set_threads(threads);
}
