//! eccl master: the openraft-replicated registry of peers and epochs, and the leader's
//! coordination of `update_topology()` rounds.
//!
//! [`start`] runs a master inside the calling tokio runtime (the embedded default is a
//! one-node raft cluster); the `eccl-master` binary wraps it.

pub mod coordinator;
pub mod raft;
pub mod registry;
pub mod secret;
pub mod server;
pub mod sync;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use eccl_protocol::auth::Secret;
use tokio::net::TcpListener;

pub use coordinator::{Coordinator, Timing};
pub use raft::{RaftRegistry, RaftTiming};

pub struct MasterOptions {
    /// Address to listen on for peers and other masters.
    pub listen: String,
    pub secret: Secret,
    /// This master's raft node id.
    pub node_id: u64,
    /// Every master of the cluster, by node id (this one included). Empty: a one-node
    /// cluster.
    pub masters: BTreeMap<u64, String>,
    pub timing: Timing,
    pub raft_timing: RaftTiming,
}

impl MasterOptions {
    pub fn new(listen: impl Into<String>, secret: Secret) -> MasterOptions {
        MasterOptions {
            listen: listen.into(),
            secret,
            node_id: 1,
            masters: BTreeMap::new(),
            timing: Timing::default(),
            raft_timing: RaftTiming::default(),
        }
    }
}

/// A running master; dropping it stops it.
pub struct MasterHandle {
    pub addr: SocketAddr,
    pub coordinator: Arc<Coordinator>,
    server: tokio::task::JoinHandle<()>,
    leases: tokio::task::JoinHandle<()>,
}

impl MasterHandle {
    pub async fn shutdown(self) {
        self.server.abort();
        self.leases.abort();
        self.coordinator.raft.shutdown().await;
    }
}

impl Drop for MasterHandle {
    fn drop(&mut self) {
        self.server.abort();
        self.leases.abort();
    }
}

/// Starts a master in the current tokio runtime.
pub async fn start(opts: MasterOptions) -> anyhow::Result<MasterHandle> {
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    let addr = listener.local_addr()?;
    let mut masters = opts.masters.clone();
    if masters.is_empty() {
        masters.insert(opts.node_id, addr.to_string());
    }
    let raft = RaftRegistry::start(
        opts.node_id,
        addr.to_string(),
        masters,
        opts.secret.clone(),
        opts.raft_timing,
    )
    .await?;
    let coordinator = Coordinator::new(Arc::new(raft), opts.timing.clone());
    let leases = coordinator.spawn_lease_checker();
    let server = tokio::spawn(server::serve(
        listener,
        coordinator.clone(),
        opts.secret.clone(),
    ));
    tracing::info!(target: "eccl::master", "master {} listening on {addr}", opts.node_id);
    Ok(MasterHandle {
        addr,
        coordinator,
        server,
        leases,
    })
}
