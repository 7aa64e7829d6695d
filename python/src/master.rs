//! `eccl._eccl.Master`: an embedded master in this process: alone (a one-node raft
//! cluster), or one member of a cluster of masters.

use std::sync::Mutex;
use std::time::Duration;

use eccl::Secret;
use pyo3::prelude::*;

use crate::errors::{invalid, to_py};
use crate::runtime::runtime;

#[pyclass(module = "eccl._eccl")]
pub(crate) struct Master {
    handle: Mutex<Option<eccl_master::MasterHandle>>,
    #[pyo3(get)]
    addr: String,
    #[pyo3(get)]
    secret: String,
    /// The raft listener's address, for a member of a master cluster.
    #[pyo3(get)]
    raft_addr: Option<String>,
    #[pyo3(get)]
    node_id: u64,
}

#[pymethods]
impl Master {
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", secret=None, lease_ms=800, heartbeat_ms=200,
        node_id=1, masters=None, cluster_secret=None, data_dir=None, join=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret: Option<String>,
        lease_ms: u64,
        heartbeat_ms: u64,
        node_id: u64,
        masters: Option<&str>,
        cluster_secret: Option<String>,
        data_dir: Option<std::path::PathBuf>,
        join: bool,
    ) -> PyResult<Master> {
        if heartbeat_ms == 0 || heartbeat_ms >= lease_ms {
            return Err(invalid(format!(
                "heartbeat_ms ({heartbeat_ms}) must be positive and below lease_ms ({lease_ms})"
            )));
        }
        let secret = secret.unwrap_or_else(eccl_master::secret::generate);
        let s = Secret::new(secret.clone()).map_err(|e| invalid(format!("secret: {e}")))?;
        let mut opts = eccl_master::MasterOptions::new(listen, s);
        opts.timing = eccl_master::Timing::new(
            Duration::from_millis(lease_ms),
            Duration::from_millis(heartbeat_ms),
        );
        opts.node_id = node_id;
        opts.data_dir = data_dir;
        match (masters, cluster_secret) {
            (Some(list), Some(cs)) => {
                let members = eccl_master::parse_masters(list).map_err(invalid)?;
                let me = members.get(&node_id).ok_or_else(|| {
                    invalid(format!("masters does not list this master's node_id {node_id}"))
                })?;
                let cs = Secret::new(cs).map_err(|e| invalid(format!("cluster_secret: {e}")))?;
                opts.cluster = Some(eccl_master::ClusterOptions {
                    raft_listen: me.raft.clone(),
                    secret: cs,
                    members,
                    join,
                });
            }
            (None, None) if !join => {}
            _ => {
                return Err(invalid(
                    "a master of a cluster needs both masters= and cluster_secret= (join= goes with them)",
                ))
            }
        }
        let handle = py
            .detach(|| runtime().block_on(eccl_master::start(opts)))
            .map_err(|e| {
                to_py(&eccl::Error::MasterUnavailable {
                    addr: listen.to_string(),
                    reason: format!("cannot start the master: {e}"),
                })
            })?;
        Ok(Master {
            addr: handle.addr.to_string(),
            raft_addr: handle.raft_addr.map(|a| a.to_string()),
            node_id,
            handle: Mutex::new(Some(handle)),
            secret,
        })
    }

    /// Whether this master leads its cluster now.
    fn is_leader(&self) -> bool {
        self.handle
            .lock()
            .ok()
            .and_then(|h| h.as_ref().map(|h| h.coordinator.raft.is_leader()))
            .unwrap_or(false)
    }

    /// (peers registered so far, departed ones included; peers registered and not gone
    /// now): what a process hosting the master waits on before it stops it.
    fn peer_counts(&self) -> (usize, usize) {
        self.handle
            .lock()
            .ok()
            .and_then(|h| {
                h.as_ref().map(|h| {
                    h.coordinator
                        .raft
                        .read(|r| (r.peers_seen(), r.live_peers().len()))
                })
            })
            .unwrap_or((0, 0))
    }

    /// Stops the master (peers then get `MasterUnavailableError` from calls that need it).
    fn shutdown(&self, py: Python<'_>) {
        let h = self.handle.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = h {
            py.detach(|| runtime().block_on(h.shutdown()));
        }
    }
}
