//! What calls return to Python: read-only views of eccl's own result types.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// What a successful collective reports (G3): its epoch and the members whose
/// contributions the result holds.
#[pyclass(module = "eccl", name = "OpInfo", frozen)]
pub(crate) struct PyOpInfo(pub eccl::OpInfo);

#[pymethods]
impl PyOpInfo {
    #[getter]
    fn epoch(&self) -> u64 {
        self.0.epoch
    }
    /// Number of the collective in its epoch.
    #[getter]
    fn seq(&self) -> u64 {
        self.0.seq
    }
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank.0
    }
    #[getter]
    fn world_size(&self) -> u32 {
        self.0.world_size
    }
    /// Peer ids of the members, in rank order.
    #[getter]
    fn members<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.members.iter().map(|p| p.0))
    }
    #[getter]
    fn algo(&self) -> &'static str {
        self.0.algo.name()
    }
    /// Point-to-point: the rank at the other end (a receive's sender); None for
    /// collectives.
    #[getter]
    fn peer(&self) -> Option<u32> {
        self.0.peer.map(|p| p.0)
    }
    fn __repr__(&self) -> String {
        let o = &self.0;
        format!(
            "OpInfo(epoch={}, seq={}, rank={}, world_size={}, members={:?}, algo={:?}, peer={:?})",
            o.epoch,
            o.seq,
            o.rank.0,
            o.world_size,
            o.members,
            o.algo.name(),
            o.peer.map(|p| p.0)
        )
    }
}

/// What `update_topology()` returns: the world this peer is in now.
#[pyclass(module = "eccl", name = "WorldUpdate", frozen)]
pub(crate) struct PyWorldUpdate(pub eccl::WorldUpdate);

#[pymethods]
impl PyWorldUpdate {
    #[getter]
    fn epoch(&self) -> u64 {
        self.0.epoch
    }
    /// Whether a new epoch began (someone joined or left, or the last one was aborted).
    #[getter]
    fn changed(&self) -> bool {
        self.0.changed
    }
    #[getter]
    fn rank(&self) -> u32 {
        self.0.rank.0
    }
    #[getter]
    fn world_size(&self) -> u32 {
        self.0.world_size
    }
    /// Links to other members carried over from the previous epoch.
    #[getter]
    fn links_kept(&self) -> u32 {
        self.0.links_kept
    }
    fn __repr__(&self) -> String {
        let t = &self.0;
        format!(
            "WorldUpdate(epoch={}, changed={}, rank={}, world_size={}, links_kept={})",
            t.epoch, t.changed, t.rank.0, t.world_size, t.links_kept
        )
    }
}

/// What `sync_shared_state()` did.
#[pyclass(module = "eccl", name = "SyncInfo", frozen)]
pub(crate) struct PySyncInfo(pub eccl::SyncInfo);

#[pymethods]
impl PySyncInfo {
    #[getter]
    fn epoch(&self) -> u64 {
        self.0.epoch
    }
    /// The revision every member now holds.
    #[getter]
    fn revision(&self) -> u64 {
        self.0.revision
    }
    #[getter]
    fn bytes_sent(&self) -> u64 {
        self.0.bytes_sent
    }
    #[getter]
    fn bytes_received(&self) -> u64 {
        self.0.bytes_received
    }
    /// Peers this member fetched chunks from.
    #[getter]
    fn sources<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.sources.iter().map(|p| p.0))
    }
    /// Names of the tensors that were replaced.
    #[getter]
    fn updated<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.updated.iter())
    }
    /// blake3 of the whole state (hex), equal on every member (G5).
    #[getter]
    fn hash(&self) -> String {
        hex::encode(self.0.hash)
    }
    /// Milliseconds spent hashing this member's tensors.
    #[getter]
    fn hash_ms(&self) -> f64 {
        self.0.hash_ms
    }
    /// Milliseconds waiting for the master's plan (every member's report).
    #[getter]
    fn plan_ms(&self) -> f64 {
        self.0.plan_ms
    }
    /// Milliseconds serving or fetching chunks.
    #[getter]
    fn transfer_ms(&self) -> f64 {
        self.0.transfer_ms
    }
    /// Bytes this call hashed (tensors promised unchanged are not).
    #[getter]
    fn hashed_bytes(&self) -> u64 {
        self.0.hashed_bytes
    }
    fn __repr__(&self) -> String {
        let s = &self.0;
        format!(
            "SyncInfo(epoch={}, revision={}, bytes_sent={}, bytes_received={}, sources={:?}, updated={:?})",
            s.epoch, s.revision, s.bytes_sent, s.bytes_received, s.sources, s.updated
        )
    }
}
