//! The openraft type configuration of the master cluster and the messages masters
//! exchange on their raft connections.

use std::io::Cursor;

use openraft::error::{Fatal, InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::{Deserialize, Serialize};

use crate::registry::{Command, Outcome};

openraft::declare_raft_types!(
    /// Raft types of the master cluster: the log carries registry [`Command`]s, applying
    /// one yields an [`Outcome`]; a node is addressed by its master listen address.
    pub TypeConfig:
        D = Command,
        R = Outcome,
        NodeId = u64,
        Node = BasicNode,
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
