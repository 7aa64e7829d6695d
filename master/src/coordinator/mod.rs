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
mod votes;
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
        // A notification is done, not answered: its sender reads no answer to it.
        if self.id == eccl_protocol::NOTIFICATION {
            return;
        }
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

    /// Whether `peer` may take part in a round this leader runs (a vote, a topology
    /// report): once it has caught up (else a redirect), a peer it knows and has not
    /// removed (else the refusal to answer with).
    async fn round_peer(&self, peer: PeerId) -> Result<(), MasterReply> {
        if !self.caught_up().await {
            return Err(self.not_leader());
        }
        match self.known(peer) {
            None => Err(refused(
                ErrorCode::UnknownPeer,
                format!("peer {peer} is not registered"),
            )),
            Some(PeerState::Gone { reason }) => Err(refused(ErrorCode::Evicted, reason)),
            Some(_) => Ok(()),
        }
    }

    /// Whether this leader has applied everything committed before its term: a new
    /// leader may hold its predecessor's last decisions (an epoch, a sync plan) in its log
    /// without having applied them yet, and must not decide a round again meanwhile. A
    /// linearizable read once per term settles it.
    ///
    /// One check runs at a time (the others wait for its answer), and a check that a
    /// quorum did not answer in time is made again while this master still leads, for up
    /// to an election timeout ([`Coordinator::leads_now`]): a leader busy with a large epoch change (1,000 members'
    /// answers) saw its followers' acknowledgements come later than openraft's per-RPC
    /// limit (the raft heartbeat), and answered "not the leader" while naming itself to
    /// hundreds of requests; its peers left it as told, and it evicted each for the
    /// closed connection (`eccl-chaos load --masters 3`).
    pub(super) async fn caught_up(&self) -> bool {
        use std::sync::atomic::Ordering;
        let term = self.raft.term();
        if self.caught_up_term.load(Ordering::Acquire) == term {
            return true;
        }
        let _one_at_a_time = self.caught_up_check.lock().await;
        let term = self.raft.term();
        if self.caught_up_term.load(Ordering::Acquire) == term {
            return true;
        }
        let confirmed = self.leads_now().await;
        if confirmed {
            self.caught_up_term.store(term, Ordering::Release);
        }
        confirmed
    }

    /// Whether a quorum confirms this master's leadership now (a linearizable read), asked
    /// again while the quorum is short for up to an election timeout (a busy follower's
    /// late acknowledgement is not a lost quorum). A leader cut off from its followers
    /// still believes it leads until it hears otherwise; an answer that reports the
    /// replicated state as it stands (an epoch that stays) must come from one that a
    /// quorum still follows.
    pub(super) async fn leads_now(&self) -> bool {
        use openraft::error::{CheckIsLeaderError, RaftError};
        let patience = Duration::from_millis(self.raft.raft.config().election_timeout_max);
        let until = Instant::now() + patience;
        loop {
            if !self.raft.is_leader() {
                return false;
            }
            match self.raft.raft.ensure_linearizable().await {
                Ok(_) => return true,
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
        // No round in progress: nothing to complete or end (see `answer_queries`).
        if st.syncs.is_empty() {
            return;
        }
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
}
