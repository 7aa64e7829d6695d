//! Control messages between a peer and the master. They travel with [`crate::codec`]
//! after the authentication handshake.
//!
//! A peer sends [`Request`]s, each with an id; the master answers each with a
//! [`MasterMessage::Reply`] carrying the same id, in any order, and may push
//! [`MasterMessage::Event`]s at any time (abort an epoch, you were evicted).

use serde::{Deserialize, Serialize};

use crate::types::PeerId;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// Port where this peer accepts TCP (and TLS) links from other peers.
    pub listen_port: u16,
    /// UDP port of this peer's QUIC endpoint.
    pub quic_port: Option<u16>,
    /// Name of this peer's abstract unix socket for shm links (same host only).
    pub shm_name: Option<String>,
    /// Address other peers should dial; if `None` the master uses the source address of
    /// this connection (which is right unless NAT or several interfaces are involved).
    pub advertise_host: Option<String>,
    /// Host identity: peers that share it can share memory (see `Config::host`).
    pub host: String,
    /// Preferred rank (torchrun's RANK, `eccl-bench --local`'s child index). Honoured
    /// among the peers admitted together; never displaces an existing member.
    pub rank_hint: Option<u32>,
    pub protocol_version: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerRequest {
    Register(RegisterRequest),
    /// Vote for the next epoch. Answered once every live member of the current epoch has
    /// voted (and, for the first world, once `min_world` peers are waiting).
    UpdateTopology {
        peer_id: PeerId,
        /// The epoch the peer is in now (0 before its first world).
        epoch: u64,
        /// Do not form a world smaller than this (torchrun's WORLD_SIZE on start-up).
        min_world: u32,
        /// The peer's current epoch was aborted: commit a new epoch even if nobody
        /// joined or left.
        aborted: bool,
        /// Members whose link from this peer cannot carry on into the next epoch (it
        /// failed, or a send stopped halfway through a frame): both ends connect it
        /// again. Every other link between members of both epochs carries on, also after
        /// an abort (frames of the old epoch are dropped by their epoch number).
        fresh: Vec<PeerId>,
    },
    /// Are peers waiting to be admitted? Answered with the same value to every member of
    /// `epoch` once all of them have asked.
    ArePeersPending {
        peer_id: PeerId,
        epoch: u64,
    },
    /// Renews the peer's lease.
    Heartbeat {
        peer_id: PeerId,
    },
    /// The peer saw a fault: a link to `suspect` failed, or a collective made no progress.
    ReportFault {
        peer_id: PeerId,
        epoch: u64,
        suspect: Option<PeerId>,
        reason: String,
    },
    /// The peer leaves the job on purpose.
    Leave {
        peer_id: PeerId,
    },
    /// This connection speaks for `peer_id` again: the peer lost its master (a
    /// fail-over) and shows the credential it was given at registration.
    Attach {
        peer_id: PeerId,
        token: [u8; 32],
    },
    /// One member's part of `sync_shared_state()`: what it holds. Answered with a
    /// [`MasterReply::SyncPlan`] once every live member of `epoch` has reported.
    SyncState {
        peer_id: PeerId,
        epoch: u64,
        /// Which sync of the epoch this is (1, 2, ...): a leader that takes over answers a
        /// member whose round its predecessor already decided with that decision.
        round: u64,
        revision: u64,
        strategy: SyncStrategy,
        tensors: Vec<TensorDigest>,
    },
    /// Who leads the master cluster, its members and how many peers are live. Any
    /// master answers, leader or not.
    ClusterStatus,
    /// Change the master cluster's membership. `proof` is [`ClusterChange::proof`] under
    /// the cluster's admin key for the cluster's membership `membership` (its
    /// [`ClusterStatus::membership`] when the change was signed): the job secret alone
    /// cannot change the cluster, and a recorded change cannot be played again once the
    /// membership has moved on.
    ClusterChange {
        change: ClusterChange,
        membership: u64,
        proof: [u8; 32],
    },
    /// A request to the key-value store (torchrun's rendezvous, `torch.distributed`
    /// stores): see [`crate::store`]. Store clients are not peers; they open a session.
    Store(crate::store::StoreRequest),
    // New variants go last: the wire names variants by their index.
    /// torch's `_reconfigure(uuid, handles)`: the next epoch is a world of exactly
    /// `members`, ranks in list order when `ordered` (else the master chooses: members
    /// of the current world first, in their order). Answered with the same `World` to
    /// every member once all of them have asked with this `uuid` and this list, or with
    /// the same error (a uuid not newer than the last one, a member that is gone, members
    /// that disagree). Members of the current world left out are removed from the job.
    Reconfigure {
        peer_id: PeerId,
        uuid: u64,
        members: Vec<PeerId>,
        ordered: bool,
    },
    /// One member's part of `optimize_topology()`: what it measured of its links to the
    /// other members of `epoch`. Answered with the same `World` at a new epoch (same
    /// members and ranks, the ring solved from every member's measurements) once every
    /// live member has reported, or with an error if one is lost meanwhile.
    Topology {
        peer_id: PeerId,
        epoch: u64,
        links: Vec<crate::types::LinkMeasure>,
    },
}

impl PeerRequest {
    /// The member a request is made in the name of, for the requests a registered peer
    /// makes (a connection may make them only for the peer it registered); `None` for
    /// registration, attaching, the store and the cluster's requests.
    pub fn member(&self) -> Option<PeerId> {
        match self {
            PeerRequest::UpdateTopology { peer_id, .. }
            | PeerRequest::ArePeersPending { peer_id, .. }
            | PeerRequest::Heartbeat { peer_id }
            | PeerRequest::ReportFault { peer_id, .. }
            | PeerRequest::Leave { peer_id }
            | PeerRequest::Reconfigure { peer_id, .. }
            | PeerRequest::Topology { peer_id, .. }
            | PeerRequest::SyncState { peer_id, .. } => Some(*peer_id),
            PeerRequest::Register(_)
            | PeerRequest::Attach { .. }
            | PeerRequest::ClusterStatus
            | PeerRequest::ClusterChange { .. }
            | PeerRequest::Store(_) => None,
        }
    }
}

/// A change to the master cluster (openraft joint consensus underneath).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClusterChange {
    /// Add master `id` (started with `--join`): it catches up as a learner, then votes.
    Add {
        id: u64,
        client: String,
        raft: String,
    },
    /// Remove master `id` (dead or alive) from the voters and the cluster.
    Remove { id: u64 },
}

impl ClusterChange {
    /// The label the admin key is derived under from the cluster secret.
    pub const KEY_LABEL: &'static [u8] = b"eccl-cluster-admin";

    /// HMAC-SHA256 of this change, made to the cluster whose membership is
    /// `membership` ([`ClusterStatus::membership`]), under `key` (the cluster secret's
    /// `derive(ClusterChange::KEY_LABEL)`). Every change moves the membership on, so a
    /// proof is good for one change at most: a recorded request played again later (to
    /// remove a master the operator added back, say) is refused.
    pub fn proof(&self, key: &[u8; 32], membership: u64) -> [u8; 32] {
        use hmac::{Hmac, Mac};
        let mut m = <Hmac<sha2::Sha256> as Mac>::new_from_slice(key)
            .expect("HMAC takes keys of any length");
        m.update(b"eccl-cluster-change-v2");
        m.update(&membership.to_le_bytes());
        match self {
            ClusterChange::Add { id, client, raft } => {
                m.update(b"add");
                m.update(&id.to_le_bytes());
                for s in [client, raft] {
                    m.update(&(s.len() as u64).to_le_bytes());
                    m.update(s.as_bytes());
                }
            }
            ClusterChange::Remove { id } => {
                m.update(b"remove");
                m.update(&id.to_le_bytes());
            }
        }
        m.finalize().into_bytes().into()
    }
}

/// One master as [`ClusterStatus`] shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterInfo {
    pub id: u64,
    pub client: String,
    pub raft: String,
    /// A voter; otherwise a learner still catching up.
    pub voter: bool,
}

/// The answer to [`PeerRequest::ClusterStatus`] (and to a change, once committed), as the
/// answering master sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The master that answered.
    pub me: u64,
    pub leader: Option<u64>,
    pub term: u64,
    /// The raft log index of the membership in effect: it grows with every change to the
    /// cluster, and a change is signed for it ([`ClusterChange::proof`]).
    pub membership: u64,
    pub members: Vec<MasterInfo>,
    /// Live peers in this master's replica of the registry.
    pub peers: u64,
    /// The current epoch in that replica.
    pub epoch: u64,
}

/// How a member takes part in a shared-state sync.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncStrategy {
    /// Its content counts in the vote; it sends and receives.
    #[default]
    EnforcePopular,
    /// Its content does not count; it only receives.
    ReceiveOnly,
    /// Its content is authoritative; it never receives.
    SendOnly,
}

impl SyncStrategy {
    pub const ALL: [SyncStrategy; 3] = [
        SyncStrategy::EnforcePopular,
        SyncStrategy::ReceiveOnly,
        SyncStrategy::SendOnly,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            SyncStrategy::EnforcePopular => "enforce_popular",
            SyncStrategy::ReceiveOnly => "receive_only",
            SyncStrategy::SendOnly => "send_only",
        }
    }

    pub fn parse(s: &str) -> Option<SyncStrategy> {
        let s = s.trim().to_ascii_lowercase().replace('-', "_");
        SyncStrategy::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// A tensor of the shared state as its owner describes it: a blake3 hash per chunk of
/// [`STATE_CHUNK`](crate::STATE_CHUNK) bytes and one over the whole tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDigest {
    pub name: String,
    pub len: u64,
    pub hash: [u8; 32],
    pub chunks: Vec<[u8; 32]>,
}

/// The [`Request::id`] of a request whose sender wants no answer (a heartbeat between
/// the ones a peer awaits, a fault report): the master does what it asks and answers
/// nothing, not even an error, which spares it a write per heartbeat.
pub const NOTIFICATION: u64 = 0;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Names the answer ([`MasterMessage::Reply`]'s `id`). [`NOTIFICATION`]: the
    /// sender wants no answer, and the master sends none.
    pub id: u64,
    pub body: PeerRequest,
}

/// Why the master refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    InvalidArgument,
    UnknownPeer,
    Evicted,
    Timeout,
    VersionMismatch,
    NotLeader,
    Internal,
    /// The epoch was aborted (a member moved on to `update_topology()` or was evicted).
    Aborted,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MasterReply {
    Registered {
        peer_id: PeerId,
        /// The lease the master holds on this peer; heartbeat well within it.
        lease_ms: u64,
        heartbeat_ms: u64,
        /// The peer's credential to attach again to whichever master leads next.
        token: [u8; 32],
    },
    /// The world after an `UpdateTopology` vote; `changed` is false when the master kept
    /// the current epoch because nobody joined or left.
    World {
        /// Shared among the answers of one epoch, and encoded once for all of them.
        world: crate::shared_world::SharedWorld,
        /// This member's link keys for the epoch (see [`LinkKeys`]).
        keys: crate::auth::LinkKeys,
        changed: bool,
        /// Members of both epochs keep the links between them and connect only to
        /// newcomers, and to the members in `renew`.
        reuse_links: bool,
        /// Members whose link to this one must be connected again: either end reported
        /// it unfit in its vote (`UpdateTopology::fresh`).
        renew: Vec<PeerId>,
    },
    /// The answer to an `UpdateTopology` vote of `epoch` when the master kept that epoch
    /// (nobody joined, left or aborted): the voter has the world already, so none is
    /// sent (a world of a thousand is about 100 KB, to each of its members).
    Unchanged {
        epoch: u64,
    },
    PeersPending(bool),
    /// The outcome of a `SyncState` round: the content everyone must end with, and the
    /// members that hold it (the sources).
    SyncPlan {
        revision: u64,
        target: Vec<TensorDigest>,
        sources: Vec<PeerId>,
        /// Members that will fetch from the sources; each source serves until every one
        /// of them is done or gone.
        receivers: Vec<PeerId>,
    },
    Ok,
    Error {
        code: ErrorCode,
        message: String,
    },
    /// This master is not the raft leader; `leader` is the leader's peer-facing address
    /// if known.
    NotLeader {
        leader: Option<String>,
    },
    Cluster(ClusterStatus),
    Store(crate::store::StoreReply),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MasterEvent {
    /// Every collective of `epoch` must fail with `Aborted`.
    AbortEpoch {
        epoch: u64,
        cause: String,
        /// The peer whose eviction caused it, if any.
        evicted: Option<PeerId>,
    },
    /// This peer is no longer part of the job; it may register again as a new peer.
    Evicted { reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MasterMessage {
    Reply { id: u64, body: MasterReply },
    Event(MasterEvent),
}

/// First message on a data link after authentication: who dials whom, for which epoch,
/// and which of the link's streams this connection is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkHello {
    pub from: PeerId,
    pub to: PeerId,
    pub epoch: u64,
    pub stream: u16,
    pub nstreams: u16,
    /// The dialer's proof that it is `from` in `epoch` (see [`LinkKeys`]).
    pub proof: [u8; 32],
}

/// What each side of a verbs (RDMA) link tells the other, over the link's authenticated
/// TCP stream and after its [`LinkHello`], before any RDMA traffic: its reliable-connected
/// queue pair and the receive ring it has posted. Nothing in it is secret (a queue pair
/// accepts traffic only from the one it was connected to), but it is checked with
/// [`VerbsHello::validate`] before it reaches the verbs library.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbsHello {
    /// The queue pair's number (24 bits; 0 and 1 are the special QPs).
    pub qp_num: u32,
    /// The port's local identifier (InfiniBand); 0 where only the GID routes (RoCE).
    pub lid: u16,
    /// The port's global identifier, for routing through a GRH (RoCE, or across subnets).
    pub gid: Option<[u8; 16]>,
    /// Receive buffers the sender may have in flight before it waits for credits.
    pub recv_slots: u32,
    /// Bytes of each receive buffer: the most one message (header and payload) may carry.
    pub slot_bytes: u32,
}

impl VerbsHello {
    /// At most this many receive buffers a side may announce.
    pub const MAX_SLOTS: u32 = 4096;
    /// At most this many bytes per buffer (a frame never exceeds this).
    pub const MAX_SLOT_BYTES: u32 = 64 << 20;

    /// Checks the fields before they configure a queue pair.
    pub fn validate(&self) -> Result<(), String> {
        if self.qp_num < 2 || self.qp_num >= 1 << 24 {
            return Err(format!(
                "queue pair number {} is not a data QP",
                self.qp_num
            ));
        }
        if self.lid == 0 && self.gid.is_none() {
            return Err("neither a LID nor a GID to reach the queue pair".into());
        }
        Self::check_ring(self.recv_slots, self.slot_bytes)
    }

    /// The bounds of a ring of `slots` buffers of `slot_bytes` each (a frame header and
    /// at least one byte of payload), for a peer's hello and for our own options alike.
    pub fn check_ring(slots: u32, slot_bytes: u32) -> Result<(), String> {
        if slots == 0 || slots > Self::MAX_SLOTS {
            return Err(format!("{slots} receive slots (1 to {})", Self::MAX_SLOTS));
        }
        let min = crate::FRAME_HEADER_LEN as u32 + 1;
        if slot_bytes < min || slot_bytes > Self::MAX_SLOT_BYTES {
            return Err(format!(
                "{slot_bytes} bytes per slot ({min} to {})",
                Self::MAX_SLOT_BYTES
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ClusterChange;

    #[test]
    fn a_cluster_change_proof_holds_for_one_membership_and_one_change() {
        let key = [3u8; 32];
        let remove = ClusterChange::Remove { id: 2 };
        let p = remove.proof(&key, 7);
        assert_eq!(p, remove.proof(&key, 7));
        assert_ne!(p, remove.proof(&key, 8), "bound to the membership");
        assert_ne!(p, ClusterChange::Remove { id: 3 }.proof(&key, 7));
        assert_ne!(p, remove.proof(&[4u8; 32], 7), "bound to the key");
        let add = |client: &str, raft: &str| ClusterChange::Add {
            id: 2,
            client: client.into(),
            raft: raft.into(),
        };
        // Lengths are part of the proof: moving bytes between the addresses changes it.
        assert_ne!(add("ab", "c").proof(&key, 7), add("a", "bc").proof(&key, 7));
    }
}
