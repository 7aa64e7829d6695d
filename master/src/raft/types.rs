//! The openraft type configuration of the master cluster and the messages masters
//! exchange on their raft connections.

use std::io::Cursor;

use openraft::error::{Fatal, InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{Deserialize, Serialize};

use crate::registry::{Command, Outcome};

/// A master as the cluster knows it: where other masters reach it (its raft listener)
/// and where clients do (its client listener, which a follower names when it redirects
/// a client to the leader).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterNode {
    pub raft: String,
    pub client: String,
}

impl MasterNode {
    pub fn new(client: impl Into<String>, raft: impl Into<String>) -> MasterNode {
        MasterNode {
            raft: raft.into(),
            client: client.into(),
        }
    }
}

impl std::fmt::Display for MasterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (raft {})", self.client, self.raft)
    }
}

/// The first message on a raft connection after authentication: which master dials.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaftHello {
    pub from: MasterId,
}

/// Terms at or above this are refused: no real cluster comes near it, and one more than
/// the largest term overflows.
pub const TERM_LIMIT: u64 = 1 << 48;

openraft::declare_raft_types!(
    /// Raft types of the master cluster: the log carries registry [`Command`]s, applying
    /// one yields an [`Outcome`]; a node is a [`MasterNode`].
    pub TypeConfig:
        D = Command,
        R = Outcome,
        NodeId = u64,
        Node = MasterNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// Id of a master in the raft cluster.
pub type MasterId = u64;

/// A running raft node of the master cluster.
pub type RaftNode = openraft::Raft<TypeConfig>;

/// A request from one master to another on a `Role::MasterToMaster` connection.
/// One request is answered by one [`RaftRpcReply`] before the next is sent.
#[derive(Debug, Serialize, Deserialize)]
pub enum RaftRpc {
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<MasterId>),
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
}

/// The answer to a [`RaftRpc`], same variant as the request.
///
/// `RaftError<_, Infallible>` has no serde impl (serde does not serialize `Infallible`),
/// so the infallible calls carry their only possible error, [`Fatal`], directly.
#[derive(Debug, Serialize, Deserialize)]
pub enum RaftRpcReply {
    AppendEntries(Result<AppendEntriesResponse<MasterId>, Fatal<MasterId>>),
    Vote(Result<VoteResponse<MasterId>, Fatal<MasterId>>),
    InstallSnapshot(
        Result<InstallSnapshotResponse<MasterId>, RaftError<MasterId, InstallSnapshotError>>,
    ),
}

impl RaftRpc {
    pub fn kind(&self) -> &'static str {
        match self {
            RaftRpc::AppendEntries(_) => "append_entries",
            RaftRpc::Vote(_) => "vote",
            RaftRpc::InstallSnapshot(_) => "install_snapshot",
        }
    }

    /// Why a request cannot come from master `from`: it claims another sender, or a term
    /// no real cluster reaches (a term of 2^64-1 once made openraft panic on `term + 1`).
    pub fn refuse(&self, from: MasterId) -> Option<String> {
        let leader = match self {
            RaftRpc::AppendEntries(r) => &r.vote.leader_id,
            RaftRpc::Vote(r) => &r.vote.leader_id,
            RaftRpc::InstallSnapshot(r) => &r.vote.leader_id,
        };
        if leader.node_id != from {
            return Some(format!(
                "{} in the name of master {} on master {from}'s connection",
                self.kind(),
                leader.node_id
            ));
        }
        if leader.term >= TERM_LIMIT {
            return Some(format!("{} with term {}", self.kind(), leader.term));
        }
        // Log ids from a term after the sender's own vote cannot be real.
        let mut terms: Vec<u64> = Vec::new();
        match self {
            RaftRpc::AppendEntries(r) => {
                terms.extend(r.prev_log_id.iter().map(|l| l.leader_id.term));
                terms.extend(r.leader_commit.iter().map(|l| l.leader_id.term));
                terms.extend(r.entries.iter().map(|e| e.log_id.leader_id.term));
            }
            RaftRpc::Vote(r) => terms.extend(r.last_log_id.iter().map(|l| l.leader_id.term)),
            RaftRpc::InstallSnapshot(r) => {
                terms.extend(r.meta.last_log_id.iter().map(|l| l.leader_id.term))
            }
        }
        if let Some(t) = terms.into_iter().find(|t| *t > leader.term) {
            return Some(format!(
                "{} carrying a log id of term {t} from a sender at term {}",
                self.kind(),
                leader.term
            ));
        }
        None
    }
}

/// Raft timing of the master cluster, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaftTiming {
    /// Leader heartbeat interval; also openraft's per-append-entries RPC timeout.
    pub heartbeat_ms: u64,
    /// A follower that hears no leader for a random time in `[election_min_ms,
    /// election_max_ms)` starts an election.
    pub election_min_ms: u64,
    pub election_max_ms: u64,
}

impl Default for RaftTiming {
    /// 50/150/300 ms: a lost leader is replaced well under a second after it dies.
    fn default() -> Self {
        RaftTiming {
            heartbeat_ms: 50,
            election_min_ms: 150,
            election_max_ms: 300,
        }
    }
}

/// Why a proposal did not go through.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    /// This master is not the leader. The caller redirects to `leader_addr` when known.
    /// A proposal that was accepted by a leader which then lost leadership also ends
    /// here; it may or may not have been committed (retry only idempotent/CAS commands
    /// blindly).
    #[error("not the leader (leader: {leader_id:?} at {leader_addr:?})")]
    NotLeader {
        leader_id: Option<MasterId>,
        leader_addr: Option<String>,
    },
    /// Raft is shut down or its storage failed.
    #[error("raft failure: {0}")]
    Fatal(String),
}
