//! Starting a master: its options, the client and raft listeners, and the handle that
//! stops it (the `server` feature).

use futures::future::{BoxFuture, FutureExt};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use eccl_protocol::auth::Secret;
use tokio::net::TcpListener;

use crate::{raft, secret, server, Coordinator, MasterNode, RaftRegistry, RaftTiming, Timing};

/// A replicated master's cluster: the other masters and how raft reaches them.
#[derive(Clone)]
pub struct ClusterOptions {
    /// Where this master accepts raft connections from the others (etcd's 2380).
    pub raft_listen: String,
    /// The cluster's own secret: raft connections use it, never the job's, and the
    /// client listener never accepts it. Only masters hold it.
    pub secret: Secret,
    /// Every master of the cluster, this one included, by raft node id.
    pub members: BTreeMap<u64, MasterNode>,
    /// Wait to be added to a running cluster (`eccl-master cluster add`) instead of
    /// forming one with `members`.
    pub join: bool,
}

pub struct MasterOptions {
    /// Client listener: peers, the command line, stores (etcd's 2379).
    pub listen: String,
    /// The client address other masters give clients for this one; default: this
    /// master's entry in the cluster, or the address `listen` bound.
    pub advertise: Option<String>,
    /// The job's secret, which peers and clients hold.
    pub secret: Secret,
    /// Other jobs whose stores these masters keep too (torchrun rendezvous of several
    /// jobs on shared masters): each name's secret opens that job's store scopes and
    /// nothing else, neither the job's peers nor another job's scopes.
    pub store_jobs: Vec<(String, Secret)>,
    /// This master's raft node id.
    pub node_id: u64,
    /// `None`: a single master (a one-node raft cluster with no raft listener).
    pub cluster: Option<ClusterOptions>,
    pub timing: Timing,
    pub raft_timing: RaftTiming,
    /// Where the raft log, vote and snapshots are kept (fsynced); `None`: in memory.
    pub data_dir: Option<std::path::PathBuf>,
}

impl MasterOptions {
    pub fn new(listen: impl Into<String>, secret: Secret) -> MasterOptions {
        MasterOptions {
            listen: listen.into(),
            advertise: None,
            secret,
            store_jobs: Vec::new(),
            node_id: 1,
            cluster: None,
            timing: Timing::default(),
            raft_timing: RaftTiming::default(),
            data_dir: None,
        }
    }
}

/// A running master; dropping it stops it.
pub struct MasterHandle {
    /// The client listener's address.
    pub addr: SocketAddr,
    /// The raft listener's address, for a master of a cluster.
    pub raft_addr: Option<SocketAddr>,
    pub coordinator: Arc<Coordinator>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl MasterHandle {
    /// Stops the master (boxed for the reason [`start`] is).
    pub fn shutdown(mut self) -> BoxFuture<'static, ()> {
        async move {
            for t in self.tasks.drain(..) {
                t.abort();
            }
            self.coordinator.raft.shutdown().await;
        }
        .boxed()
    }
}

impl Drop for MasterHandle {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts a master in the current tokio runtime.
///
/// The future is boxed here, in this crate, so that its code (the whole start-up,
/// openraft's included) is compiled once, here, and not again in every crate that
/// awaits it (a future's `poll` is compiled where it is polled).
pub fn start(opts: MasterOptions) -> BoxFuture<'static, anyhow::Result<MasterHandle>> {
    start_master(opts).boxed()
}

async fn start_master(opts: MasterOptions) -> anyhow::Result<MasterHandle> {
    let listener = TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", opts.listen))?;
    let addr = listener.local_addr()?;
    let join = opts.cluster.as_ref().is_some_and(|c| c.join);
    let (members, raft_secret, raft_listener) = match &opts.cluster {
        Some(c) => {
            let Some(me) = c.members.get(&opts.node_id) else {
                anyhow::bail!(
                    "the cluster does not list this master's node id {}",
                    opts.node_id
                );
            };
            let l = TcpListener::bind(&c.raft_listen)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen for raft on {}: {e}", c.raft_listen))?;
            let mut members = c.members.clone();
            let client = opts.advertise.clone().unwrap_or_else(|| me.client.clone());
            members.insert(opts.node_id, MasterNode::new(client, me.raft.clone()));
            (members, c.secret.clone(), Some(l))
        }
        None => {
            // A one-node cluster speaks raft to nobody: its cluster secret is random and
            // it opens no raft listener.
            let client = opts.advertise.clone().unwrap_or_else(|| addr.to_string());
            let secret = Secret::new(secret::generate())
                .map_err(|e| anyhow::anyhow!("cannot make a cluster secret: {e}"))?;
            (
                BTreeMap::from([(opts.node_id, MasterNode::new(client, String::new()))]),
                secret,
                None,
            )
        }
    };
    let me = members[&opts.node_id].clone();
    let raft = Arc::new(
        RaftRegistry::start(
            opts.node_id,
            me,
            members,
            raft_secret.clone(),
            opts.raft_timing,
            opts.data_dir.as_deref(),
            join,
        )
        .await?,
    );
    let coordinator = Coordinator::new(raft.clone(), opts.timing.clone());
    let mut tasks = vec![coordinator.spawn_lease_checker()];
    tasks.push(tokio::spawn(server::serve(
        listener,
        coordinator.clone(),
        server::Jobs::new(opts.secret.clone(), opts.store_jobs.clone())?,
    )));
    let raft_addr = match raft_listener {
        Some(l) => {
            let raft_addr = l.local_addr()?;
            let r = raft.clone();
            let is_master = Arc::new(move |id| r.is_master(id));
            tasks.push(tokio::spawn(raft::serve_raft_listener(
                l,
                raft.raft.clone(),
                raft_secret,
                is_master,
            )));
            Some(raft_addr)
        }
        None => None,
    };
    tracing::info!(target: "eccl::master", "master {} listening on {addr} (raft: {raft_addr:?})", opts.node_id);
    Ok(MasterHandle {
        addr,
        raft_addr,
        coordinator,
        tasks,
    })
}
