//! RDMA verbs links between hosts (cargo feature `verbs`, built on the `ibverbs` crate).
//!
//! A verbs link is set up like a shared-memory one: the dialer opens an authenticated
//! TCP stream to the peer (eccl's handshake with the job secret, then the
//! [`LinkHello`](eccl_protocol::LinkHello)), and over that stream both sides exchange a
//! [`VerbsHello`](eccl_protocol::VerbsHello): their reliable-connected queue pair and
//! receive ring. Frames then travel as RDMA sends into the receiver's posted buffers;
//! aborts and the closing frame go over the TCP stream, which also tells a dead peer at
//! once (RDMA itself notices only after its retries). A work completion with an error
//! status becomes a [`TransportError::Verbs`](crate::TransportError::Verbs) link failure
//! ([`status`]), which aborts the epoch like any failed link.
//!
//! Status: the set-up and data path are built in CI (`cargo build -p eccl-transport
//! --features verbs`), and what runs without a device is tested (the hello's checks, the
//! completion mapping, device probing); no RDMA device exists where eccl is tested today,
//! so the data path has not run yet (see the README).

pub mod status;

#[cfg(feature = "verbs")]
mod engine;
#[cfg(feature = "verbs")]
mod link;
#[cfg(feature = "verbs")]
pub use link::{establish, VerbsOptions};

/// The RDMA devices this process can open, by name; `Err` says why there are none to
/// look at (no `verbs` feature in this build, or no RDMA support in the kernel). An
/// empty list means RDMA works but no device is there.
pub fn probe() -> Result<Vec<String>, String> {
    #[cfg(feature = "verbs")]
    {
        link::probe()
    }
    #[cfg(not(feature = "verbs"))]
    {
        Err("eccl was built without the `verbs` cargo feature".into())
    }
}
