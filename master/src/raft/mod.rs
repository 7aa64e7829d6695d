//! The master's registry, replicated with openraft.
//!
//! - [`types`]: the openraft type configuration, the RPC messages between masters, the
//!   timing and the errors.
//! - [`log_store`]: the raft log, in memory or on disk ([`disk`]).
//! - [`state_machine`]: the [`Registry`] as a raft state machine, with snapshots.
//! - [`network`]: raft RPCs over TLS control connections authenticated with the
//!   cluster's own secret (`Role::MasterToMaster`), between configured masters only;
//!   client and server side.
//!
//! [`RaftRegistry`] ties them together: one master is a one-node cluster that leads
//! from the start; three masters survive the loss of one.
//!
//! # Durability
//!
//! With a data directory ([`disk`]), the log, the vote, the committed index and the
//! snapshots live in a redb database, written and fsynced before openraft is told they
//! are stored; a master that crashes restarts with its log and vote, does not form a
//! cluster again, and is caught up by the leader. Without one (a lone master, tests),
//! raft state is in memory: a master that restarts comes back as a fresh node with the
//! same id, bootstraps with the same member list (which openraft documents as safe when
//! the configuration is the same), loses any election against the live majority, and is
//! caught up by the leader. What that gives up: an entry counts as committed once a
//! majority holds it in memory, so if that majority loses it (one holder restarts and the
//! other dies before the restarted one has been caught up again), a committed entry can
//! be lost. Run clusters with `--data-dir`.
//!
//! # Membership changes
//!
//! [`admin`]: a master started with `--join` forms nothing and waits to be added; the
//! leader adds it as a learner, catches it up, and makes it a voter (joint consensus).

//! # Bootstrap
//!
//! Every master is started with the same list of all masters. The lowest id
//! initializes the cluster at once; the others initialize it themselves only if they
//! are still pristine after a grace period (so a cluster forms even when the lowest id
//! is down), staggered by their position in the list.

pub mod snapshot;
pub mod types;
// The running node and what it stands on: the server's (feature `server`, on by default).
#[cfg(feature = "server")]
pub mod admin;
#[cfg(feature = "server")]
pub mod disk;
#[cfg(feature = "server")]
pub mod log_store;
#[cfg(feature = "server")]
pub mod network;
#[cfg(feature = "server")]
mod node;
#[cfg(feature = "server")]
pub mod state_machine;

#[cfg(feature = "server")]
pub use log_store::LogStore;
#[cfg(feature = "server")]
pub use network::{serve_raft_conn, serve_raft_listener, MasterNetwork};
#[cfg(feature = "server")]
pub use node::*;
pub use snapshot::SmData;
#[cfg(feature = "server")]
pub use state_machine::{SmHandle, StateMachineStore};
pub use types::{
    MasterId, MasterNode, ProposeError, RaftHello, RaftNode, RaftRpc, RaftRpcReply, RaftTiming,
    TypeConfig, TERM_LIMIT,
};
