//! `eccl._eccl.Master`: an embedded master (a one-node raft cluster) in this process.

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
}

#[pymethods]
impl Master {
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", secret=None, lease_ms=2000, heartbeat_ms=250))]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret: Option<String>,
        lease_ms: u64,
        heartbeat_ms: u64,
    ) -> PyResult<Master> {
        if heartbeat_ms == 0 || heartbeat_ms >= lease_ms {
            return Err(invalid(format!(
                "heartbeat_ms ({heartbeat_ms}) must be positive and below lease_ms ({lease_ms})"
            )));
        }
        let secret = secret.unwrap_or_else(eccl_master::secret::generate);
        let s = Secret::new(secret.clone()).map_err(|e| invalid(format!("secret: {e}")))?;
        let mut opts = eccl_master::MasterOptions::new(listen, s);
        opts.timing = eccl_master::Timing {
            lease: Duration::from_millis(lease_ms),
            heartbeat: Duration::from_millis(heartbeat_ms),
        };
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
            handle: Mutex::new(Some(handle)),
            secret,
        })
    }

    /// Stops the master (peers then get `MasterUnavailableError` from calls that need it).
    fn shutdown(&self, py: Python<'_>) {
        let h = self.handle.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = h {
            py.detach(|| runtime().block_on(h.shutdown()));
        }
    }
}
