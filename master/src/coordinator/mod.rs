//! What the leader keeps in memory: the control connections of peers, the votes of an
//! `update_topology()` round, the `are_peers_pending()` queries, and the leases.
//! Decisions (register, commit an epoch, evict) go through raft; the rest is soft state
//! that a new leader rebuilds as peers reconnect.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eccl_protocol::{ErrorCode, MasterEvent, MasterMessage, MasterReply, PeerId, World};
use tokio::sync::{mpsc, Mutex};

use crate::raft::{ProposeError, RaftRegistry};
use crate::registry::{Command, Outcome, PeerState};
use crate::sync::{self, Report};

mod liveness;
mod reconfigure;
pub mod store;
mod topology;
pub use liveness::{Timing, TAKEOVER_GRACE};

/// What the master sends a peer, queued for the connection's writer. Bounded: a peer
/// that does not read what it asked for loses what does not fit (its requests time out
/// on its side) instead of making the master hold it.
pub type Outbox = mpsc::Sender<Outgoing>;

/// Messages a peer's outbox holds.
pub const OUTBOX: usize = 1024;

/// A message on its way to a connection's writer, with what it holds of the master's
/// budget for large replies until it is written (or dropped).
#[derive(Debug)]
pub struct Outgoing {
    pub msg: MasterMessage,
    pub held: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Outgoing {
    pub fn event(ev: MasterEvent) -> Outgoing {
        Outgoing {
            msg: MasterMessage::Event(ev),
            held: None,
        }
    }
}

/// Where the answer to one request goes.
#[derive(Clone)]
pub struct ReplyTo {
    pub conn: Outbox,
    pub id: u64,
}

impl ReplyTo {
    pub fn send(&self, body: MasterReply) {
        self.send_holding(body, None)
    }

    /// Sends a large reply that holds `held` (its bytes in the master's reply budget)
    /// until the writer has written it.
    pub fn send_holding(&self, body: MasterReply, held: Option<tokio::sync::OwnedSemaphorePermit>) {
        let _ = self.conn.try_send(Outgoing {
            msg: MasterMessage::Reply { id: self.id, body },
            held,
        });
    }
}

struct Vote {
    reply: ReplyTo,
    epoch: u64,
    min_world: u32,
    aborted: bool,
    /// Members whose link from this voter cannot carry on (`UpdateTopology::fresh`).
    fresh: Vec<PeerId>,
}

struct SyncEntry {
    reply: ReplyTo,
    epoch: u64,
    report: Report,
}

#[derive(Default)]
struct State {
    conns: HashMap<PeerId, Outbox>,
    votes: HashMap<PeerId, Vote>,
    queries: HashMap<PeerId, (ReplyTo, u64)>,
    syncs: HashMap<PeerId, SyncEntry>,
    /// Members waiting in a `reconfigure()` for the others it names.
    reconfigs: HashMap<PeerId, reconfigure::Request>,
    /// Members waiting in an `optimize_topology()` for the others of their epoch.
    topologies: HashMap<PeerId, topology::Report>,
    /// Epochs aborted because of a fault report (one abort per epoch is enough), and
    /// epochs in which a member was evicted (their links are suspect); trimmed to the
    /// worlds' current epochs.
    reported: std::collections::BTreeSet<u64>,
    evicted: std::collections::BTreeSet<u64>,
}

impl State {
    /// Forgets per-epoch marks of epochs that are no world's current one any more.
    fn trim(&mut self, current: &[u64]) {
        self.reported.retain(|e| current.contains(e));
        self.evicted.retain(|e| current.contains(e));
    }
}

/// A refusal with `code`, saying why.
fn refused(code: ErrorCode, message: impl Into<String>) -> MasterReply {
    MasterReply::Error {
        code,
        message: message.into(),
    }
}

fn aborted_reply(message: String) -> MasterReply {
    MasterReply::Error {
        code: ErrorCode::Aborted,
        message,
    }
}

pub struct Coordinator {
    pub raft: Arc<RaftRegistry>,
    pub timing: Timing,
    state: Mutex<State>,
    /// When each peer's lease was last renewed. Apart from `state`, whose lock is held
    /// across raft proposals: a heartbeat must never wait behind a proposal (a slow one,
    /// during an election, would make every peer look silent).
    leases: std::sync::Mutex<HashMap<PeerId, Instant>>,
    /// The term in which this leader has applied everything its predecessors committed
    /// (see [`Coordinator::caught_up`]).
    caught_up_term: std::sync::atomic::AtomicU64,
    /// Held while one request checks `caught_up_term`'s leadership (see there).
    caught_up_check: tokio::sync::Mutex<()>,
    /// Store sessions' leases and waiters.
    store: store::StoreLive,
}

fn propose_error(e: ProposeError) -> MasterReply {
    match e {
        ProposeError::NotLeader { leader_addr, .. } => MasterReply::NotLeader {
            leader: leader_addr,
        },
        ProposeError::Fatal(m) => MasterReply::Error {
            code: ErrorCode::Internal,
            message: m,
        },
    }
}

impl Coordinator {
    pub fn new(raft: Arc<RaftRegistry>, timing: Timing) -> Arc<Coordinator> {
        Arc::new(Coordinator {
            raft,
            timing,
            state: Mutex::new(State::default()),
            leases: std::sync::Mutex::new(HashMap::new()),
            caught_up_term: std::sync::atomic::AtomicU64::new(u64::MAX),
            caught_up_check: tokio::sync::Mutex::new(()),
            store: Default::default(),
        })
    }

    /// Registers a peer and remembers its connection for later events.
    pub async fn register(&self, reg: Command, conn: Outbox) -> Result<PeerId, MasterReply> {
        let addr = match &reg {
            Command::Register { addr, .. } => addr.clone(),
            _ => String::new(),
        };
        let mut st = self.state.lock().await;
        match self.raft.propose(reg).await {
            Ok(Outcome::Registered(id)) => {
                tracing::info!(target: "eccl::master", "peer {id} registered from {addr}");
                st.conns.insert(id, conn);
                self.touch(id);
                Ok(id)
            }
            Ok(Outcome::Rejected(why)) => Err(MasterReply::Error {
                code: ErrorCode::InvalidArgument,
                message: why,
            }),
            Ok(o) => Err(MasterReply::Error {
                code: ErrorCode::Internal,
                message: format!("register: {o:?}"),
            }),
            Err(e) => Err(propose_error(e)),
        }
    }

    fn known(&self, peer: PeerId) -> Option<PeerState> {
        self.raft.read(|r| r.peer(peer).map(|p| p.state.clone()))
    }

    /// Whether this leader has applied everything committed before its term: a new
    /// leader may hold its predecessor's last decisions (an epoch, a sync plan) in its log
    /// without having applied them yet, and must not decide a round again meanwhile. A
    /// linearizable read once per term settles it.
    ///
    /// One check runs at a time (the others wait for its answer), and a check that a
    /// quorum did not answer in time is made again while this master still leads, for up
    /// to an election timeout: a leader busy with a large epoch change (1,000 members'
    /// answers) saw its followers' acknowledgements come later than openraft's per-RPC
    /// limit (the raft heartbeat), and answered "not the leader" while naming itself to
    /// hundreds of requests; its peers left it as told, and it evicted each for the
    /// closed connection (`eccl-chaos load --masters 3`).
    pub(super) async fn caught_up(&self) -> bool {
        use openraft::error::{CheckIsLeaderError, RaftError};
        use std::sync::atomic::Ordering;
        let term = || self.raft.term();
        if self.caught_up_term.load(Ordering::Acquire) == term() {
            return true;
        }
        let _one_at_a_time = self.caught_up_check.lock().await;
        let patience = Duration::from_millis(self.raft.raft.config().election_timeout_max);
        let until = Instant::now() + patience;
        loop {
            let t = term();
            if self.caught_up_term.load(Ordering::Acquire) == t {
                return true;
            }
            if !self.raft.is_leader() {
                return false;
            }
            match self.raft.raft.ensure_linearizable().await {
                Ok(_) => {
                    self.caught_up_term.store(t, Ordering::Release);
                    return true;
                }
                Err(RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(e)))
                    if Instant::now() < until =>
                {
                    tracing::debug!(target: "eccl::master", "leadership not confirmed yet ({e}); checking again");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => {
                    tracing::info!(target: "eccl::master", "leadership not confirmed: {e}");
                    return false;
                }
            }
        }
    }

    pub(super) fn not_leader(&self) -> MasterReply {
        MasterReply::NotLeader {
            leader: self.raft.leader().map(|(_, a)| a),
        }
    }

    /// A vote of `update_topology()`. The answer comes once the round completes.
    pub async fn vote(
        &self,
        peer: PeerId,
        epoch: u64,
        min_world: u32,
        aborted: bool,
        fresh: Vec<PeerId>,
        reply: ReplyTo,
    ) {
        if !self.caught_up().await {
            return reply.send(self.not_leader());
        }
        match self.known(peer) {
            None => {
                return reply.send(MasterReply::Error {
                    code: ErrorCode::UnknownPeer,
                    message: format!("peer {peer} is not registered"),
                })
            }
            Some(PeerState::Gone { reason }) => {
                return reply.send(MasterReply::Error {
                    code: ErrorCode::Evicted,
                    message: reason,
                })
            }
            _ => {}
        }
        let mut st = self.state.lock().await;
        self.touch(peer);
        st.votes.insert(
            peer,
            Vote {
                reply,
                epoch,
                min_world,
                aborted,
                fresh,
            },
        );
        // A member that moved on to the next epoch will not join this epoch's sync
        // round, and will not ask whether peers are pending: answer those who wait.
        if self.raft.read(|r| r.world_of(peer).map(|w| w.epoch)) == Some(epoch) {
            let cur: Vec<PeerId> = st
                .syncs
                .iter()
                .filter(|(_, e)| e.epoch == epoch)
                .map(|(p, _)| *p)
                .collect();
            for p in cur {
                if let Some(e) = st.syncs.remove(&p) {
                    e.reply.send(aborted_reply(format!(
                        "peer {peer} left epoch {epoch} for update_topology() before the shared-state sync"
                    )));
                }
            }
            self.answer_queries(&mut st);
        }
        self.try_commit(&mut st).await;
    }

    /// One member's report of `sync_shared_state()`; answered with the plan once every
    /// live member of the epoch has reported.
    pub async fn sync_report(&self, peer: PeerId, epoch: u64, report: Report, reply: ReplyTo) {
        if !self.caught_up().await {
            return reply.send(self.not_leader());
        }
        match self.known(peer) {
            Some(PeerState::Member) => {}
            Some(PeerState::Gone { reason }) => {
                return reply.send(MasterReply::Error {
                    code: ErrorCode::Evicted,
                    message: reason,
                })
            }
            _ => {
                return reply.send(MasterReply::Error {
                    code: ErrorCode::InvalidArgument,
                    message: format!(
                        "peer {peer} is not a member yet: call update_topology() first"
                    ),
                })
            }
        }
        let mut st = self.state.lock().await;
        self.touch(peer);
        let current = self.raft.read(|r| r.world_of(peer).map_or(0, |w| w.epoch));
        if epoch != current {
            return reply.send(aborted_reply(format!(
                "epoch {epoch} is over (this peer's world is at epoch {current})"
            )));
        }
        // This round was decided (by a leader that then died, or while this member's
        // connection was down): the member gets the decision the others got.
        let input = report.input();
        if let Some(plan) = self.raft.read(|r| r.plan_for(epoch, &input).cloned()) {
            tracing::info!(target: "eccl::master", "peer {peer}: sync round {} of epoch {epoch} was decided already; answering with its plan", report.round);
            return reply.send(plan);
        }
        if st.votes.values().any(|v| v.epoch == epoch) {
            return reply.send(aborted_reply(format!(
                "a member of epoch {epoch} already moved on to update_topology()"
            )));
        }
        st.syncs.insert(
            peer,
            SyncEntry {
                reply,
                epoch,
                report,
            },
        );
        self.try_sync(&mut st).await;
    }

    /// Completes every world's sync round whose live members have all reported.
    async fn try_sync(&self, st: &mut State) {
        let worlds = self.raft.read(|r| {
            r.worlds()
                .map(|e| (e.world.epoch, r.live_members_of(e.world.epoch)))
                .collect::<Vec<_>>()
        });
        // A report from outside its world's current epoch (a member evicted since, or
        // moved to another world) is over.
        let over: Vec<PeerId> = st
            .syncs
            .iter()
            .filter(|(p, e)| {
                !worlds
                    .iter()
                    .any(|(epoch, m)| *epoch == e.epoch && m.contains(p))
            })
            .map(|(p, _)| *p)
            .collect();
        for p in over {
            if let Some(e) = st.syncs.remove(&p) {
                e.reply
                    .send(aborted_reply(format!("peer {p} is no longer a member")));
            }
        }
        for (epoch, members) in worlds {
            self.try_sync_world(st, epoch, members).await;
        }
    }

    async fn try_sync_world(&self, st: &mut State, epoch: u64, members: Vec<PeerId>) {
        if members.is_empty()
            || !members
                .iter()
                .all(|m| st.syncs.get(m).is_some_and(|e| e.epoch == epoch))
        {
            return;
        }
        let reports: Vec<Report> = members
            .iter()
            .filter_map(|m| st.syncs.get(m).map(|e| e.report.clone()))
            .collect();
        let Some(plan) = sync::plan(&reports) else {
            return;
        };
        let mut h = blake3::Hasher::new();
        for t in &plan.target {
            h.update(t.name.as_bytes());
            h.update(&t.hash);
        }
        let inputs: Vec<_> = reports.iter().map(Report::input).collect();
        let first = inputs[0];
        let answer = MasterReply::SyncPlan {
            revision: plan.revision,
            target: plan.target,
            sources: plan.sources.clone(),
            receivers: plan.receivers.clone(),
        };
        let cmd = Command::StateRevision {
            epoch,
            inputs,
            revision: plan.revision,
            hash: *h.finalize().as_bytes(),
            plan: answer.clone(),
        };
        let reply = match self.raft.propose(cmd).await {
            Ok(_) => {
                tracing::info!(
                    target: "eccl::master",
                    "epoch {epoch}: shared state at revision {} from {:?}; {:?} fetch it",
                    plan.revision,
                    plan.sources,
                    plan.receivers
                );
                // The first plan committed for this round is the round's, also when a
                // predecessor's decision reached the log before ours: every member of
                // the round gets the same one.
                self.raft
                    .read(|r| r.plan_for(epoch, &first).cloned())
                    .unwrap_or(answer)
            }
            Err(e) => propose_error(e),
        };
        for m in &members {
            if let Some(e) = st.syncs.remove(m) {
                e.reply.send(reply.clone());
            }
        }
    }

    /// Completes every world's vote round whose live members have all voted, and forms
    /// the elastic world from pending peers when there is none.
    async fn try_commit(&self, st: &mut State) {
        // Votes of peers that are gone are answered and dropped (one read of the
        // registry for all of them: this runs at every vote).
        let gone: Vec<PeerId> = self.raft.read(|r| {
            st.votes
                .keys()
                .copied()
                .filter(|p| {
                    !matches!(r.peer(*p).map(|x| &x.state), Some(s) if !matches!(s, PeerState::Gone { .. }))
                })
                .collect()
        });
        for p in gone {
            if let Some(v) = st.votes.remove(&p) {
                v.reply.send(MasterReply::Error {
                    code: ErrorCode::Evicted,
                    message: format!("peer {p} was removed"),
                });
            }
        }
        // Only a world whose live members have all voted, or one of whose members votes
        // from another epoch, has anything to do: the others are not copied (this runs
        // at every vote, and a world of a thousand is about 100 KB).
        let votes = &st.votes;
        let (worlds, current, has_elastic) = self.raft.read(|r| {
            let (mut worlds, mut current, mut has_elastic) = (Vec::new(), Vec::new(), false);
            for e in r.worlds() {
                let epoch = e.world.epoch;
                current.push(epoch);
                has_elastic |= !e.by_reconfigure;
                // Votes first (a hash lookup each), the registry only for a member that
                // has not voted, and the scan stops at the first live one.
                let members = || e.world.members.iter().map(|m| m.peer_id);
                let behind = members().any(|m| votes.get(&m).is_some_and(|v| v.epoch != epoch));
                let all_voted = || {
                    members().all(|m| {
                        votes.contains_key(&m)
                            || !matches!(r.peer(m), Some(p) if p.state == PeerState::Member)
                    })
                };
                if behind || all_voted() {
                    worlds.push((e.world.clone(), r.live_members_of(epoch), e.by_reconfigure));
                }
            }
            (worlds, current, has_elastic)
        });
        st.trim(&current);
        for (world, members, by_reconfigure) in worlds {
            self.try_commit_world(st, world, members, !by_reconfigure)
                .await;
        }
        if !has_elastic {
            self.try_first_world(st).await;
        }
    }

    /// Pending peers that voted, in id order.
    fn pending_voters(&self, st: &State) -> Vec<PeerId> {
        let mut p: Vec<PeerId> = st
            .votes
            .keys()
            .copied()
            .filter(|p| self.known(*p) == Some(PeerState::Pending))
            .collect();
        p.sort();
        p
    }

    /// The elastic world's first epoch, once as many pending peers voted as any of them
    /// asked for.
    async fn try_first_world(&self, st: &mut State) {
        let pending = self.pending_voters(st);
        if pending.is_empty() {
            return;
        }
        let need = pending
            .iter()
            .filter_map(|p| st.votes.get(p))
            .map(|v| v.min_world)
            .max()
            .unwrap_or(1)
            .max(1);
        if pending.len() < need as usize {
            return;
        }
        self.commit(st, 0, pending, false, false).await;
    }

    /// Completes the vote round of `world` if every live member of it has voted.
    async fn try_commit_world(
        &self,
        st: &mut State,
        world: World,
        members: Vec<PeerId>,
        elastic: bool,
    ) {
        let epoch = world.epoch;
        // One world for every answer (each member gets the same).
        let world = eccl_protocol::shared_world::SharedWorld::new(world);
        // A member still in an older epoch catches up at once; it missed a commit (or
        // its world went on without the members a reconfigure took).
        let behind: Vec<PeerId> = members
            .iter()
            .copied()
            .filter(|m| st.votes.get(m).is_some_and(|v| v.epoch != epoch))
            .collect();
        let keys = std::cell::OnceCell::new();
        for m in behind {
            if let Some(v) = st.votes.remove(&m) {
                // Its links are older than the others' idea of "previous epoch".
                v.reply.send(MasterReply::World {
                    keys: keys
                        .get_or_init(|| self.raft.world_keys(&world))
                        .for_member(m),
                    world: world.clone(),
                    changed: true,
                    reuse_links: false,
                    renew: vec![],
                });
            }
        }
        if members.is_empty() || !members.iter().all(|m| st.votes.contains_key(m)) {
            return;
        }
        let pending = if elastic {
            self.pending_voters(st)
        } else {
            vec![]
        };
        let lost_members = world.size() != members.len();
        let aborted = members
            .iter()
            .any(|m| st.votes.get(m).is_some_and(|v| v.aborted));
        if pending.is_empty() && !lost_members && !aborted {
            // Every voter left is in this epoch (the ones behind were answered above)
            // and has its world: it hears only that the epoch stays.
            for m in &members {
                if let Some(v) = st.votes.remove(m) {
                    v.reply.send(MasterReply::Unchanged { epoch });
                }
            }
            return;
        }
        self.commit(st, epoch, pending, lost_members, aborted).await;
    }

    /// Proposes the next epoch of the world at `epoch` (0: the elastic world's first),
    /// admitting `pending`, and answers the new world's voters.
    async fn commit(
        &self,
        st: &mut State,
        epoch: u64,
        pending: Vec<PeerId>,
        lost_members: bool,
        aborted: bool,
    ) {
        // Links between members of both epochs carry on, also after an abort or an
        // eviction (frames of the old epoch are dropped by their epoch number), but for
        // those that either end reported unfit in its vote: both ends connect those
        // again. (Connecting every link again after an abort took 6 s for a world of
        // 256 on two cores: `eccl-chaos --peers 256 --faults kill`.)
        let reuse_links = epoch != 0;
        let clean = !aborted && !st.evicted.contains(&epoch) && !st.reported.contains(&epoch);
        let unfit: Vec<(PeerId, PeerId)> = if clean {
            Vec::new()
        } else {
            st.votes
                .iter()
                .filter(|(_, v)| v.epoch == epoch)
                .flat_map(|(p, v)| v.fresh.iter().map(move |q| (*p, *q)))
                .collect()
        };
        let renew_of = |m: PeerId| -> Vec<PeerId> {
            let mut r: Vec<PeerId> = unfit
                .iter()
                .filter_map(|&(a, b)| {
                    if a == m {
                        Some(b)
                    } else if b == m {
                        Some(a)
                    } else {
                        None
                    }
                })
                .collect();
            r.sort_unstable();
            r.dedup();
            r
        };
        let cmd = Command::CommitEpoch {
            expected_epoch: epoch,
            admit: pending.clone(),
            remove: vec![],
        };
        match self.raft.propose(cmd).await {
            Ok(Outcome::Epoch(w)) => {
                tracing::info!(
                    target: "eccl::master",
                    "epoch {} committed: {} members {:?} (admitted {:?}{}{})",
                    w.epoch,
                    w.size(),
                    w.peer_ids(),
                    pending,
                    if lost_members { ", after losing members" } else { "" },
                    if aborted { ", after an abort" } else { "" }
                );
                let w = eccl_protocol::shared_world::SharedWorld::new(w);
                let keys = self.raft.world_keys(&w);
                for m in w.peer_ids() {
                    if let Some(v) = st.votes.remove(&m) {
                        v.reply.send(MasterReply::World {
                            keys: keys.for_member(m),
                            world: w.clone(),
                            changed: true,
                            reuse_links,
                            renew: renew_of(m),
                        });
                    }
                }
                // Members of the new world may have queries pending for the old epoch.
                self.answer_queries(st);
            }
            Ok(other) => tracing::warn!(target: "eccl::master", "epoch commit refused: {other:?}"),
            Err(e) => {
                let reply = propose_error(e);
                for (_, v) in st.votes.drain() {
                    v.reply.send(reply.clone());
                }
            }
        }
    }

    /// An `are_peers_pending()` query; answered to all members at once.
    pub async fn pending_query(&self, peer: PeerId, epoch: u64, reply: ReplyTo) {
        let mut st = self.state.lock().await;
        st.queries.insert(peer, (reply, epoch));
        self.answer_queries(&mut st);
    }

    fn answer_queries(&self, st: &mut State) {
        let worlds: Vec<(u64, Vec<PeerId>, bool)> = self.raft.read(|r| {
            r.worlds()
                .map(|e| {
                    (
                        e.world.epoch,
                        r.live_members_of(e.world.epoch),
                        !e.by_reconfigure,
                    )
                })
                .collect()
        });
        // Someone outside its world's current epoch must call update_topology() to catch
        // up.
        let stale: Vec<PeerId> = st
            .queries
            .iter()
            .filter(|(p, (_, e))| {
                !worlds
                    .iter()
                    .any(|(epoch, m, _)| epoch == e && m.contains(p))
            })
            .map(|(p, _)| *p)
            .collect();
        for p in stale {
            if let Some((r, _)) = st.queries.remove(&p) {
                r.send(MasterReply::PeersPending(true));
            }
        }
        let pending_voter = st
            .votes
            .keys()
            .any(|p| self.known(*p) == Some(PeerState::Pending));
        for (epoch, members, elastic) in worlds {
            let voted = members
                .iter()
                .any(|m| st.votes.get(m).is_some_and(|v| v.epoch == epoch));
            if members.is_empty() || (!voted && !members.iter().all(|m| st.queries.contains_key(m)))
            {
                continue;
            }
            // A member that already voted for the next epoch waits for the others: the
            // answer must send them to update_topology() too; so must a newcomer waiting
            // to be admitted to the elastic world.
            let waiting = voted || (elastic && pending_voter);
            for m in &members {
                if let Some((r, _)) = st.queries.remove(m) {
                    r.send(MasterReply::PeersPending(waiting));
                }
            }
        }
    }
}
