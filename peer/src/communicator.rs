//! The `Communicator`: one peer's membership in a job, its current world, and every
//! collective over that world.
//!
//! Collectives take `&mut self`: within an epoch every member calls the same collectives
//! in the same order, and the borrow checker keeps one caller from interleaving two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eccl_algorithms::{buffer_lens, build, choose_algo, Element, Schedule};
use eccl_protocol::frame::AbortCause;
use eccl_protocol::{
    Algo, CollectiveKind, DType, Descriptor, ErrorCode, MasterEvent, MasterReply, PeerId,
    PeerRequest, ReduceOp, RegisterRequest, World, PROTOCOL_VERSION,
};
use eccl_transport::pool::AlignedBuf;
use tokio::sync::mpsc;

use crate::abort::AbortState;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::executor::{self, Bufs, Op};
use crate::links::{LinkManager, PeerLink};
use crate::master_client::MasterClient;

/// What a successful collective reports (G3): the epoch it ran in and who took part, so
/// that a caller can, for example, weight an average by the members that contributed.
#[derive(Clone, Debug)]
pub struct OpInfo {
    pub epoch: u64,
    /// Number of the collective in its epoch.
    pub seq: u64,
    pub rank: u32,
    pub world_size: u32,
    pub members: Arc<[PeerId]>,
    pub algo: Algo,
}

/// The outcome of `update_topology()`.
#[derive(Clone, Debug)]
pub struct WorldUpdate {
    pub epoch: u64,
    /// Whether a new epoch began (someone joined or left, or the last one was aborted).
    pub changed: bool,
    pub rank: u32,
    pub world_size: u32,
    /// Links to other members carried over from the previous epoch (after a clean
    /// epoch, only links to newcomers are connected).
    pub links_kept: u32,
}

/// How the retry helpers retry.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Give up with `TooFewPeers` when fewer members remain.
    pub min_world: u32,
    /// Calls of the collective at most, the first included.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            min_world: 1,
            max_attempts: 16,
        }
    }
}

/// Arguments of one collective, untyped (the Python layer and eccl-bench use this form).
#[derive(Clone, Copy, Debug)]
pub struct CollArgs {
    pub kind: CollectiveKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: u32,
    /// Element count, NCCL's convention (see [`Descriptor`]).
    pub count: usize,
}

impl CollArgs {
    /// The arguments of a collective of `kind` over buffers of `input` and `output`
    /// elements in a world of `world` ranks, with the count in NCCL's convention. A rank
    /// of a rooted collective passes `None` for a buffer it does not use (gather's output
    /// or scatter's input off the root); an in-place call passes its buffer as both.
    pub fn for_buffers(
        kind: CollectiveKind,
        dtype: DType,
        op: ReduceOp,
        root: u32,
        input: Option<usize>,
        output: Option<usize>,
        world: u32,
    ) -> CollArgs {
        use CollectiveKind::*;
        let (i, o) = (input.unwrap_or(0), output.unwrap_or(0));
        let count = match kind {
            Broadcast | Scatter | ReduceScatter => o,
            Reduce | AllReduce | Gather | AllGather | SendRecv => i,
            AllToAll => i / world.max(1) as usize,
            Barrier => 0,
        };
        CollArgs {
            kind,
            dtype,
            op,
            root,
            count,
        }
    }
}

pub(crate) struct Current {
    pub world: World,
    pub rank: u32,
    pub members: Arc<[PeerId]>,
    pub links: Vec<Option<PeerLink>>,
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_recvd: Vec<u64>,
    /// Shared-state syncs so far in this epoch; names the frames of each round.
    pub sync_round: u64,
}

pub struct Communicator {
    pub(crate) cfg: Config,
    pub(crate) master: Arc<MasterClient>,
    peer_id: PeerId,
    links: LinkManager,
    pub(crate) cur: Option<Current>,
    pub(crate) abort: Arc<AbortState>,
    evicted: Arc<std::sync::Mutex<Option<String>>>,
    /// Rank blamed by the collective that failed last (see `fail`).
    suspect: AtomicU32,
    events: tokio::task::JoinHandle<()>,
    heartbeat: tokio::task::JoinHandle<()>,
    scratch: AlignedBuf,
    inplace: AlignedBuf,
    schedules: HashMap<(Descriptor, u32, u32), Arc<Schedule>>,
    last_algo: HashMap<CollectiveKind, Algo>,
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.events.abort();
        self.heartbeat.abort();
    }
}

impl Communicator {
    /// Registers with the master named in `cfg`. The peer is pending until its first
    /// `update_topology()`.
    pub async fn connect(cfg: Config) -> Result<Communicator> {
        cfg.validate()?;
        let secret = cfg
            .secret
            .clone()
            .ok_or_else(|| Error::InvalidArgument("no job secret: set ECCL_SECRET or ECCL_SECRET_FILE (eccl-master prints where it keeps one)".into()))?;
        let abort = AbortState::new();
        let links = LinkManager::bind(&cfg, &abort).await?;
        let (etx, mut erx) = mpsc::unbounded_channel();
        let master = MasterClient::connect(&cfg.master, &secret, cfg.connect_timeout, etx).await?;
        let reply = master
            .request(
                PeerRequest::Register(RegisterRequest {
                    listen_port: links.local_addr.port(),
                    advertise_host: links.advertise_host.clone(),
                    host: cfg.host.clone(),
                    rank_hint: cfg.rank_hint,
                    protocol_version: PROTOCOL_VERSION,
                }),
                cfg.connect_timeout,
            )
            .await?;
        let (peer_id, heartbeat_ms) = match reply {
            MasterReply::Registered {
                peer_id,
                heartbeat_ms,
                ..
            } => (peer_id, heartbeat_ms),
            other => return Err(reply_error(&cfg.master, 0, other)),
        };
        let master = Arc::new(master);
        // Heartbeats renew the master's lease on this peer. They run on the runtime's
        // worker threads, apart from the caller, so a peer busy in a long collective
        // stays alive; only a peer that is really stuck (stopped, wedged) loses its lease.
        let heartbeat = {
            let master = master.clone();
            let every = Duration::from_millis(heartbeat_ms.max(10));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    if master
                        .notify(PeerRequest::Heartbeat { peer_id })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            })
        };
        tracing::info!(target: "eccl::init", "registered with master {} as peer {peer_id}", cfg.master);
        let evicted = Arc::new(std::sync::Mutex::new(None));
        let (a2, e2) = (abort.clone(), evicted.clone());
        let events = tokio::spawn(async move {
            while let Some(ev) = erx.recv().await {
                match ev {
                    MasterEvent::AbortEpoch {
                        epoch,
                        cause,
                        evicted,
                    } => {
                        if let Some(p) = evicted {
                            a2.peer_gone(p);
                        }
                        a2.raise(epoch, Error::Aborted { epoch, cause })
                    }
                    MasterEvent::Evicted { reason } => {
                        tracing::warn!(target: "eccl::init", "evicted by the master: {reason}");
                        if let Ok(mut e) = e2.lock() {
                            *e = Some(reason.clone());
                        }
                        a2.evicted(reason);
                    }
                }
            }
        });
        Ok(Communicator {
            cfg,
            master,
            peer_id,
            links,
            cur: None,
            abort,
            evicted,
            suspect: AtomicU32::new(executor::NO_SUSPECT),
            events,
            heartbeat,
            scratch: AlignedBuf::default(),
            inplace: AlignedBuf::default(),
            schedules: HashMap::new(),
            last_algo: HashMap::new(),
        })
    }

    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }
    pub fn rank(&self) -> Option<u32> {
        self.cur.as_ref().map(|c| c.rank)
    }
    pub fn world_size(&self) -> u32 {
        self.cur.as_ref().map_or(0, |c| c.world.size() as u32)
    }
    pub fn epoch(&self) -> u64 {
        self.cur.as_ref().map_or(0, |c| c.world.epoch)
    }
    pub fn world(&self) -> Option<&World> {
        self.cur.as_ref().map(|c| &c.world)
    }
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn evicted_error(&self) -> Option<Error> {
        self.evicted
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .map(|reason| Error::Evicted { reason })
    }

    /// Votes for the next epoch and waits until every live member has voted. Pending
    /// peers are admitted and departed ones dropped; the links are reconnected when the
    /// world changed.
    pub async fn update_topology(&mut self) -> Result<WorldUpdate> {
        if let Some(e) = self.evicted_error() {
            return Err(e);
        }
        let epoch = self.epoch();
        let aborted = self.abort.check(epoch).is_some() && epoch > 0;
        let req = PeerRequest::UpdateTopology {
            peer_id: self.peer_id,
            epoch,
            min_world: self.cfg.min_world,
            aborted,
        };
        let reply = self.master.request(req, self.cfg.join_timeout).await?;
        let (world, changed, reuse) = match reply {
            MasterReply::World {
                world,
                changed,
                reuse_links,
            } => (world, changed, reuse_links),
            other => return Err(reply_error(&self.cfg.master, epoch, other)),
        };
        let mut links_kept = 0;
        if changed || world.epoch != epoch {
            links_kept = self.install(world, reuse).await?;
        } else if let Some(c) = &self.cur {
            links_kept = c.links.iter().flatten().count() as u32;
        }
        let c = self.cur.as_ref().ok_or_else(|| Error::Aborted {
            epoch,
            cause: "no world".into(),
        })?;
        Ok(WorldUpdate {
            epoch: c.world.epoch,
            changed,
            rank: c.rank,
            world_size: c.world.size() as u32,
            links_kept,
        })
    }

    /// Enters `world`; returns how many links were kept from the previous epoch.
    async fn install(&mut self, world: World, reuse: bool) -> Result<u32> {
        let rank = world.rank_of(self.peer_id).ok_or_else(|| Error::Evicted {
            reason: format!("not a member of epoch {}", world.epoch),
        })?;
        // After a clean epoch the links between members of both worlds carry on; frames
        // of the old epoch that are still queued are dropped by their epoch number.
        // Other old links close: their peers' observers no longer watch that epoch.
        let mut keep = HashMap::new();
        if let Some(old) = self.cur.take() {
            if reuse && old.world.epoch + 1 == world.epoch {
                for (m, link) in old.world.members.iter().zip(old.links) {
                    if let Some(mut link) = link.filter(|_| world.rank_of(m.peer_id).is_some()) {
                        link.rx.stash.retain(|f| f.header.epoch >= world.epoch);
                        keep.insert(m.peer_id, link);
                    }
                }
            }
        }
        self.schedules.clear();
        tracing::info!(
            target: "eccl::init",
            "epoch {}: rank {rank} of {} (members {:?})",
            world.epoch,
            world.size(),
            world.peer_ids()
        );
        let kept = keep.len() as u32;
        let links = match self
            .links
            .connect_world(&world, self.peer_id, &self.cfg, keep)
            .await
        {
            Ok(l) => l,
            Err(e) => {
                self.abort.raise(world.epoch, e.clone());
                self.cur = Some(Current::new(world, rank, Vec::new()));
                return Err(e);
            }
        };
        self.cur = Some(Current::new(world, rank, links));
        Ok(kept)
    }

    /// Are peers waiting to be admitted? Every member of the epoch gets the same answer,
    /// so all of them can skip `update_topology()` together.
    pub async fn are_peers_pending(&mut self) -> Result<bool> {
        let epoch = self.epoch();
        let reply = self
            .master
            .request(
                PeerRequest::ArePeersPending {
                    peer_id: self.peer_id,
                    epoch,
                },
                self.cfg.join_timeout,
            )
            .await?;
        match reply {
            MasterReply::PeersPending(p) => Ok(p),
            other => Err(reply_error(&self.cfg.master, epoch, other)),
        }
    }

    /// Leaves the job on purpose; the other members see a new world at their next
    /// `update_topology()`.
    pub async fn leave(self) -> Result<()> {
        let r = self
            .master
            .request(
                PeerRequest::Leave {
                    peer_id: self.peer_id,
                },
                self.cfg.connect_timeout,
            )
            .await?;
        match r {
            MasterReply::Ok => Ok(()),
            other => Err(reply_error(&self.cfg.master, 0, other)),
        }
    }

    fn ready(&mut self) -> Result<&mut Current> {
        if let Some(e) = self.evicted_error() {
            return Err(e);
        }
        let c = self.cur.as_mut().ok_or_else(|| {
            Error::InvalidArgument("no world yet: call update_topology() first".into())
        })?;
        if let Some(e) = self.abort.check(c.world.epoch) {
            return Err(e);
        }
        Ok(c)
    }

    /// Runs one collective, out of place, on byte buffers. `input` and `output` hold
    /// exactly the elements [`buffer_lens`] names for this rank; on ranks that do not
    /// read the input (or write the output) of a rooted collective, any length is
    /// accepted and ignored.
    pub async fn collective(
        &mut self,
        args: CollArgs,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<OpInfo> {
        let forced = self.cfg.algo;
        let (timeout, frame_bytes) = (self.cfg.timeout, self.cfg.buffsize);
        if let Some(e) = self.evicted_error() {
            return Err(e);
        }
        let c = self.cur.as_mut().ok_or_else(|| {
            Error::InvalidArgument("no world yet: call update_topology() first".into())
        })?;
        let (epoch, rank, world) = (c.world.epoch, c.rank, c.world.size() as u32);
        let seq = c.seq;
        c.seq += 1;
        let elem = args.dtype.size();
        let choice = choose_algo(args.kind, args.count.saturating_mul(elem), world, forced);
        let desc = Descriptor {
            kind: args.kind,
            dtype: args.dtype,
            op: if args.kind.reduces() {
                args.op
            } else {
                ReduceOp::Sum
            },
            algo: choice.algo,
            root: args.root,
            count: args.count as u64,
        };
        // A call that is wrong on its own says so, even if the epoch is already broken.
        let (in_len, out_len) = match validate(&args, world, rank, input.len(), output.len()) {
            Ok(l) => l,
            Err(e) => return Err(self.fail(epoch, seq, desc, e).await),
        };
        if let Some(e) = self.abort.check(epoch) {
            return Err(e);
        }
        let result = async {
            let key = (desc, rank, world);
            let sched = match self.schedules.get(&key) {
                Some(s) => s.clone(),
                None => {
                    let s = build(&desc, rank, world).map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    s.validate().map_err(|e| Error::InvalidArgument(format!("internal schedule error: {e}")))?;
                    let s = Arc::new(s);
                    if self.schedules.len() > 256 {
                        self.schedules.clear();
                    }
                    self.schedules.insert(key, s.clone());
                    s
                }
            };
            if self.last_algo.insert(args.kind, choice.algo) != Some(choice.algo) {
                tracing::info!(target: "eccl::coll", "{} bytes on {world} ranks: {}", args.count * elem, choice.reason);
            }
            self.scratch.set_len(sched.scratch_len * elem);
            let c = self.cur.as_mut().expect("world checked at the start of the call");
            let op = Op { epoch, seq, desc, world, timeout, frame_bytes, abort: &self.abort, suspect: &self.suspect };
            if args.kind.is_rooted() && world > 1 {
                executor::check_round(&op, &mut c.links).await?;
            }
            let bufs = Bufs::new(&input[..in_len * elem], &mut output[..out_len * elem], self.scratch.as_bytes_mut(), elem);
            executor::run(&op, &mut c.links, &sched, &bufs).await
        }
        .await;
        match result {
            Ok(()) => {
                let c = self.cur.as_ref().expect("world present");
                Ok(OpInfo {
                    epoch,
                    seq,
                    rank,
                    world_size: world,
                    members: c.members.clone(),
                    algo: choice.algo,
                })
            }
            Err(e) => Err(self.fail(epoch, seq, desc, e).await),
        }
    }

    /// Breaks the epoch after a failed call and tells the other ranks why, so that none
    /// of them waits for this one.
    pub(crate) async fn fail(&mut self, epoch: u64, seq: u64, desc: Descriptor, e: Error) -> Error {
        if let Some(first) = self.abort.check(epoch) {
            // The caller's own mistake is the more useful answer to give it.
            return if matches!(e, Error::InvalidArgument(_)) {
                e
            } else {
                first
            };
        }
        let cause = match &e {
            Error::Mismatch { .. } => AbortCause::Mismatch,
            Error::InvalidArgument(_) => AbortCause::InvalidArgument,
            Error::Timeout { .. } => AbortCause::Timeout,
            _ => AbortCause::LinkFailure,
        };
        self.abort.raise(epoch, e.clone());
        let suspect = self.suspect.swap(executor::NO_SUSPECT, Ordering::Relaxed);
        if let Some(c) = self.cur.as_mut() {
            let reason = format!("rank {}: {e}", c.rank);
            executor::broadcast_abort(epoch, seq, desc, cause, &reason, &mut c.links).await;
            // A broken link or a silent peer is the master's business: it evicts the
            // peer if its lease agrees, and aborts the epoch on everyone otherwise.
            if matches!(cause, AbortCause::LinkFailure | AbortCause::Timeout) {
                let suspect = c.world.members.get(suspect as usize).map(|m| m.peer_id);
                let report = PeerRequest::ReportFault {
                    peer_id: self.peer_id,
                    epoch,
                    suspect,
                    reason: e.to_string(),
                };
                if let Err(err) = self.master.notify(report).await {
                    tracing::warn!(target: "eccl::coll", "could not report the fault to the master: {err}");
                }
            }
        }
        e
    }

    /// Sends `data` to rank `peer`, matched by the receiver's `recv` with the same tag.
    /// Returns when the message is handed to the link (eager send, like Gloo's).
    pub async fn send_bytes(
        &mut self,
        dtype: DType,
        data: &[u8],
        peer: u32,
        tag: u32,
    ) -> Result<OpInfo> {
        self.p2p(dtype, data.len(), peer, tag, P2p::Send(data))
            .await
    }

    /// Receives exactly `out.len()` bytes from rank `peer` with tag `tag`.
    pub async fn recv_bytes(
        &mut self,
        dtype: DType,
        out: &mut [u8],
        peer: u32,
        tag: u32,
    ) -> Result<OpInfo> {
        let n = out.len();
        self.p2p(dtype, n, peer, tag, P2p::Recv(out)).await
    }

    async fn p2p(
        &mut self,
        dtype: DType,
        nbytes: usize,
        peer: u32,
        tag: u32,
        dir: P2p<'_>,
    ) -> Result<OpInfo> {
        let (timeout, frame_bytes) = (self.cfg.timeout, self.cfg.buffsize);
        self.ready()?;
        let c = self.cur.as_mut().expect("checked by ready()");
        let (epoch, rank, world) = (c.world.epoch, c.rank, c.world.size() as u32);
        let desc = Descriptor {
            kind: CollectiveKind::SendRecv,
            dtype,
            op: ReduceOp::Sum,
            algo: Algo::Direct,
            root: tag,
            count: (nbytes / dtype.size()) as u64,
        };
        let check = if nbytes % dtype.size() != 0 {
            Err(Error::InvalidArgument(format!(
                "{nbytes} bytes is not a whole number of {dtype} elements"
            )))
        } else if peer >= world || peer == rank {
            Err(Error::InvalidArgument(format!(
                "peer rank {peer} is not another rank of this world of {world}"
            )))
        } else {
            Ok(())
        };
        if let Err(e) = check {
            // Rank-local mistake: nothing was sent, the other side has not been touched.
            return Err(e);
        }
        let members = c.members.clone();
        let is_send = matches!(dir, P2p::Send(_));
        let counter = if is_send {
            &mut c.p2p_sent[peer as usize]
        } else {
            &mut c.p2p_recvd[peer as usize]
        };
        let seq = *counter;
        *counter += 1;
        let link = c.links[peer as usize]
            .as_mut()
            .ok_or_else(|| Error::InvalidArgument(format!("no link to rank {peer}")))?;
        let op = Op {
            epoch,
            seq,
            desc,
            world,
            timeout,
            frame_bytes,
            abort: &self.abort,
            suspect: &self.suspect,
        };
        let r = match dir {
            P2p::Send(d) => executor::send_p2p(&op, link, peer, d).await,
            P2p::Recv(o) => executor::recv_p2p(&op, link, peer, o).await,
        };
        match r {
            Ok(()) => Ok(OpInfo {
                epoch,
                seq,
                rank,
                world_size: world,
                members,
                algo: Algo::Direct,
            }),
            Err(e) => Err(self.fail(epoch, seq, desc, e).await),
        }
    }

    /// Runs a collective in place on `buf`. The work happens in a scratch buffer that is
    /// copied back only on success, so a failed call leaves `buf` as it was (G2).
    pub async fn collective_inplace(&mut self, args: CollArgs, buf: &mut [u8]) -> Result<OpInfo> {
        let elem = args.dtype.size();
        let world = self.world_size().max(1);
        let rank = self.rank().unwrap_or(0);
        let (in_len, out_len) = buffer_lens(args.kind, args.count, world, rank, args.root);
        let mut tmp = std::mem::take(&mut self.inplace);
        tmp.set_len(out_len * elem);
        let input_bytes = if in_len == 0 { 0 } else { buf.len() };
        let r = self
            .collective(args, &buf[..input_bytes.min(buf.len())], tmp.as_bytes_mut())
            .await;
        if r.is_ok() && out_len > 0 {
            let n = (out_len * elem).min(buf.len());
            buf[..n].copy_from_slice(&tmp.as_bytes()[..n]);
        }
        if tmp.capacity() <= 256 << 20 {
            self.inplace = tmp;
        }
        r
    }

    /// All-reduces several buffers of one dtype as one collective (one descriptor, one
    /// schedule, like gloo's `allreduce_coalesced`): they are packed into one buffer,
    /// reduced, and copied back only on success, so a failure leaves every one of them
    /// as it was (G2).
    pub async fn all_reduce_coalesced(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        bufs: &mut [&mut [u8]],
    ) -> Result<OpInfo> {
        let elem = dtype.size();
        if let Some(b) = bufs.iter().find(|b| b.len() % elem != 0) {
            return Err(Error::InvalidArgument(format!(
                "a buffer of {} bytes is not a whole number of {dtype} elements",
                b.len()
            )));
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut input = AlignedBuf::with_len(total);
        let mut offset = 0;
        for b in bufs.iter() {
            input.as_bytes_mut()[offset..offset + b.len()].copy_from_slice(b);
            offset += b.len();
        }
        let mut output = AlignedBuf::with_len(total);
        let args = CollArgs {
            kind: CollectiveKind::AllReduce,
            dtype,
            op,
            root: 0,
            count: total / elem,
        };
        let info = self
            .collective(args, input.as_bytes(), output.as_bytes_mut())
            .await?;
        let mut offset = 0;
        for b in bufs.iter_mut() {
            let n = b.len();
            b.copy_from_slice(&output.as_bytes()[offset..offset + n]);
            offset += n;
        }
        Ok(info)
    }

    // ---- retry helpers -------------------------------------------------------------

    /// The step between attempts of a retry loop: given the error of attempt
    /// `*attempt`, either returns it (not retryable, or the last attempt) or moves to the
    /// next world with `update_topology()` and returns `Ok` for another attempt. The
    /// failed call left every input as it was (G2), so the next attempt computes over the
    /// new world's members exactly. Fails with `TooFewPeers` when the world has shrunk
    /// below `policy.min_world`.
    ///
    /// ```no_run
    /// # async fn f(comm: &mut eccl::Communicator, grads: &mut [f32]) -> eccl::Result<()> {
    /// let policy = eccl::RetryPolicy { min_world: 2, ..Default::default() };
    /// let mut attempt = 1;
    /// let info = loop {
    ///     match comm.all_reduce(grads, eccl::ReduceOp::Sum).await {
    ///         Ok(info) => break info,
    ///         Err(e) => comm.recover(e, &mut attempt, &policy).await?,
    ///     }
    /// };
    /// # let _ = info; Ok(()) }
    /// ```
    pub async fn recover(
        &mut self,
        error: Error,
        attempt: &mut u32,
        policy: &RetryPolicy,
    ) -> Result<()> {
        if !error.is_retryable() || *attempt >= policy.max_attempts {
            return Err(error);
        }
        tracing::info!(target: "eccl::coll", "attempt {attempt} failed ({error}); moving to the next world");
        *attempt += 1;
        loop {
            match self.update_topology().await {
                Ok(_) => break,
                Err(e) if e.is_retryable() && *attempt < policy.max_attempts => *attempt += 1,
                Err(e) => return Err(e),
            }
        }
        let have = self.world_size() as usize;
        let need = policy.min_world as usize;
        if have < need {
            return Err(Error::TooFewPeers { have, need });
        }
        Ok(())
    }

    /// `all_reduce` that retries over the next world after a fault (see
    /// [`Communicator::recover`]). On success `buf` holds the reduction over exactly the
    /// members in the returned [`OpInfo`].
    pub async fn all_reduce_with_retry<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        policy: &RetryPolicy,
    ) -> Result<OpInfo> {
        let mut attempt = 1;
        loop {
            match self.all_reduce(buf, op).await {
                Ok(info) => return Ok(info),
                Err(e) => self.recover(e, &mut attempt, policy).await?,
            }
        }
    }

    /// Any collective, retried over the next world after a fault.
    pub async fn collective_with_retry(
        &mut self,
        args: CollArgs,
        input: &[u8],
        output: &mut [u8],
        policy: &RetryPolicy,
    ) -> Result<OpInfo> {
        let mut attempt = 1;
        loop {
            match self.collective(args, input, output).await {
                Ok(info) => return Ok(info),
                Err(e) => self.recover(e, &mut attempt, policy).await?,
            }
        }
    }

    // ---- typed API -------------------------------------------------------------

    pub async fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::AllReduce,
            dtype: T::DTYPE,
            op,
            root: 0,
            count: buf.len(),
        };
        self.collective_inplace(a, bytemuck::cast_slice_mut(buf))
            .await
    }
    pub async fn all_reduce_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::AllReduce,
            dtype: T::DTYPE,
            op,
            root: 0,
            count: input.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    pub async fn broadcast<T: Element>(&mut self, buf: &mut [T], root: u32) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Broadcast,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root,
            count: buf.len(),
        };
        self.collective_inplace(a, bytemuck::cast_slice_mut(buf))
            .await
    }
    pub async fn broadcast_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: u32,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Broadcast,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root,
            count: output.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    /// Reduces into `buf` on `root`; other ranks' `buf` is left unchanged.
    pub async fn reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        root: u32,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Reduce,
            dtype: T::DTYPE,
            op,
            root,
            count: buf.len(),
        };
        self.collective_inplace(a, bytemuck::cast_slice_mut(buf))
            .await
    }
    pub async fn reduce_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: u32,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Reduce,
            dtype: T::DTYPE,
            op,
            root,
            count: input.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    /// `output` has `world_size * input.len()` elements; block r is rank r's input.
    pub async fn all_gather_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::AllGather,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root: 0,
            count: input.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    /// `input` has `world_size * output.len()` elements; rank r gets the reduction of
    /// block r.
    pub async fn reduce_scatter_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::ReduceScatter,
            dtype: T::DTYPE,
            op,
            root: 0,
            count: output.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    /// Block j of `input` goes to rank j; block j of `output` comes from rank j.
    pub async fn all_to_all_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<OpInfo> {
        let n = self.world_size().max(1) as usize;
        let a = CollArgs {
            kind: CollectiveKind::AllToAll,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root: 0,
            count: input.len() / n,
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    /// Root's `input` has `world_size * output.len()` elements; rank r gets block r.
    pub async fn scatter_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: u32,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Scatter,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root,
            count: output.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    /// Root's `output` has `world_size * input.len()` elements; block r is rank r's input.
    pub async fn gather_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        root: u32,
    ) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Gather,
            dtype: T::DTYPE,
            op: ReduceOp::Sum,
            root,
            count: input.len(),
        };
        self.collective(
            a,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
        .await
    }
    pub async fn barrier(&mut self) -> Result<OpInfo> {
        let a = CollArgs {
            kind: CollectiveKind::Barrier,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            root: 0,
            count: 0,
        };
        self.collective(a, &[], &mut []).await
    }
    pub async fn send<T: Element>(&mut self, data: &[T], peer: u32, tag: u32) -> Result<OpInfo> {
        self.send_bytes(T::DTYPE, bytemuck::cast_slice(data), peer, tag)
            .await
    }
    pub async fn recv<T: Element>(&mut self, out: &mut [T], peer: u32, tag: u32) -> Result<OpInfo> {
        self.recv_bytes(T::DTYPE, bytemuck::cast_slice_mut(out), peer, tag)
            .await
    }
}

enum P2p<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
}

impl Current {
    fn new(world: World, rank: u32, links: Vec<Option<PeerLink>>) -> Current {
        let n = world.size();
        let members: Arc<[PeerId]> = world.peer_ids().into();
        Current {
            world,
            rank,
            members,
            links,
            seq: 0,
            p2p_sent: vec![0; n],
            p2p_recvd: vec![0; n],
            sync_round: 0,
        }
    }
}

/// Checks a call's arguments against this rank's part; returns the element counts of
/// input and output the schedule uses.
fn validate(
    a: &CollArgs,
    world: u32,
    rank: u32,
    in_bytes: usize,
    out_bytes: usize,
) -> Result<(usize, usize)> {
    let elem = a.dtype.size();
    if a.kind == CollectiveKind::SendRecv {
        return Err(Error::InvalidArgument(
            "send/recv is not a collective; use send() and recv()".into(),
        ));
    }
    if a.kind.reduces() && !a.op.valid_for(a.dtype) {
        return Err(Error::InvalidArgument(format!(
            "{} is not defined for {} (avg needs a floating type, band/bor/bxor an integer type)",
            a.op, a.dtype
        )));
    }
    if a.kind.is_rooted() && a.root >= world {
        return Err(Error::InvalidArgument(format!(
            "root {} is not a rank of this world of {world}",
            a.root
        )));
    }
    if in_bytes % elem != 0 || out_bytes % elem != 0 {
        return Err(Error::InvalidArgument(format!(
            "buffer lengths must be whole {} elements",
            a.dtype
        )));
    }
    let (need_in, need_out) = buffer_lens(a.kind, a.count, world, rank, a.root);
    let check = |what: &str, got: usize, need: usize| {
        if got == need || (need == 0 && a.kind.is_rooted()) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{} on rank {rank} of {world}: {what} has {got} elements, expected {need}",
                a.kind,
            )))
        }
    };
    check("input", in_bytes / elem, need_in)?;
    check("output", out_bytes / elem, need_out)?;
    Ok((need_in, need_out))
}

pub(crate) fn reply_error(master: &str, epoch: u64, reply: MasterReply) -> Error {
    match reply {
        MasterReply::Error { code, message } => match code {
            ErrorCode::Aborted => Error::Aborted {
                epoch,
                cause: message,
            },
            ErrorCode::Evicted | ErrorCode::UnknownPeer => Error::Evicted { reason: message },
            ErrorCode::Timeout => Error::Timeout {
                what: message,
                ms: 0,
            },
            ErrorCode::InvalidArgument | ErrorCode::VersionMismatch => {
                Error::InvalidArgument(message)
            }
            ErrorCode::NotLeader | ErrorCode::Internal => Error::MasterUnavailable {
                addr: master.into(),
                reason: message,
            },
        },
        MasterReply::NotLeader { leader } => Error::MasterUnavailable {
            addr: master.into(),
            reason: format!(
                "not the raft leader (leader: {})",
                leader.unwrap_or_else(|| "unknown".into())
            ),
        },
        other => Error::MasterUnavailable {
            addr: master.into(),
            reason: format!("unexpected reply {other:?}"),
        },
    }
}
