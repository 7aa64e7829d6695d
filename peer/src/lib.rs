//! eccl: collectives that keep working while peers die, hang or join.
//!
//! A [`Communicator`] registers with an `eccl-master`, joins a world with
//! [`Communicator::update_topology`], and runs collectives over authenticated links to
//! the other members. See docs/architecture.md for the fault model.

mod abort;
pub mod blocking;
pub mod communicator;
pub mod config;
pub mod device;
pub mod error;
mod executor;
mod fault;
mod links;
pub use eccl_transport::limits;
pub use eccl_transport::listen::port_to_listen_later;
pub use eccl_transport::logging;
pub use eccl_transport::spin::{spin_until, spin_until_within};
mod master_client;
pub mod shared_state;
pub mod sim;
pub mod store;
pub mod variables;

pub use abort::AbortHandle;
pub use communicator::{
    CallQueue, CollArgs, Communicator, OnAbort, OpInfo, Quantize, Queued, RetryPolicy,
    TopologyUpdate, WorldUpdate, PROBE_TAG, QUANT_PIECE_VALUES,
};
pub use config::{Config, Transport, TransportChoice};
pub use eccl_algorithms::{buffer_lens, Element};
pub use eccl_protocol::{
    auth::Secret, Algo, CollectiveKind, DType, Descriptor, Member, NumClass, OpDomain, PeerId,
    Rank, ReduceOp, Tuned, World, KEEP_TO_RING, MAX_WORLD_SIZE,
};
pub use error::{Error, ErrorKind, Result};

/// The README's Rust example, compiled with the doc tests so that it stays what the API
/// takes.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
pub use shared_state::{SharedTensor, SyncInfo, SyncStrategy};
pub use store::StoreClient;
