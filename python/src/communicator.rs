//! `eccl.Communicator`: one peer's membership in a job, and every collective, on numpy
//! arrays, CPU torch tensors and other buffer-protocol objects, used where they are.
//!
//! Each method turns its arguments into a [`Call`] that owns the buffers, queues it on
//! the communicator's task, and either returns a `Work` (`async_op=True`) or waits for
//! it with the GIL released.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eccl::{CollectiveKind, Config, DType, Rank, ReduceOp, Secret, SyncStrategy};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pyo3::IntoPyObjectExt;
use tokio::sync::mpsc;

use crate::buffer::{check_disjoint, HostBuffer, WritableBuffer};
use crate::call::{serve, Call, Info, Queued};
use crate::errors::{invalid, OrRaise};
use crate::runtime::{runtime, track};
use crate::work::{Completer, Work};
use eccl::device::DeviceCall;

/// Names every call of this process, for [`crate::buffer::Claim`].
static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

/// A reduce operator given as `eccl.ReduceOp` (an int), or by any name of eccl's table
/// (`"sum"`, `"avg"`, torch's `"PRODUCT"`, ...); `None` is sum.
fn reduce_op(op: Option<&Bound<'_, PyAny>>) -> PyResult<ReduceOp> {
    let Some(op) = op else {
        return Ok(ReduceOp::Sum);
    };
    if let Ok(code) = op.extract::<u8>() {
        return ReduceOp::from_u8(code)
            .ok_or_else(|| invalid(format!("reduce op code {code} is not one of eccl's")));
    }
    let name = op.str()?.to_string();
    let name = name.trim_start_matches("RedOpType.");
    ReduceOp::parse(name).ok_or_else(|| {
        let all: Vec<_> = ReduceOp::ALL.iter().map(|o| o.name()).collect();
        invalid(format!("unknown reduce op {name:?}: {}", all.join(", ")))
    })
}

/// Refuses a call whose buffers differ in dtype.
fn one_dtype(input: &[HostBuffer], output: &[WritableBuffer]) -> PyResult<()> {
    let mut dtypes = input
        .iter()
        .map(|b| b.dtype())
        .chain(output.iter().map(|b| b.read().dtype()));
    if let Some(first) = dtypes.next() {
        if let Some(other) = dtypes.find(|d| *d != first) {
            return Err(invalid(format!(
                "the call's buffers differ in dtype: {first} and {other}"
            )));
        }
    }
    Ok(())
}

/// One side of an out-of-place call: a buffer, or a list (or tuple) of buffers that the
/// call reads as one, back to back (torch's list forms: one per rank).
fn buffers<T>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    extract: impl Fn(&Bound<'_, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    let items = if let Ok(l) = obj.cast::<PyList>() {
        l.iter().collect::<Vec<_>>()
    } else if let Ok(t) = obj.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return Ok(vec![extract(obj, what)?]);
    };
    if items.is_empty() {
        // (An empty list would leave the call without a dtype where no other buffer
        // names one: an empty buffer says "no elements" and what they are.)
        return Err(invalid(format!(
            "{what} is an empty list: pass a buffer (an empty one for no elements)"
        )));
    }
    items
        .iter()
        .enumerate()
        .map(|(k, b)| extract(b, &format!("{what}[{k}]")))
        .collect()
}

#[pyclass(module = "eccl", frozen)]
pub(crate) struct Communicator {
    queue: mpsc::UnboundedSender<Queued>,
    info: Arc<Mutex<Info>>,
    aborter: eccl::AbortHandle,
    job_id: String,
    masters: String,
}

/// A device call's dtype, as `torch`'s or eccl's name for it.
fn device_dtype(dtype: &str) -> PyResult<DType> {
    DType::parse(dtype).ok_or_else(|| invalid(format!("unknown dtype {dtype:?}")))
}

impl Communicator {
    /// Submits one device collective on CUDA device `device` (none of its buffers may
    /// have the null address when there is something to move).
    fn device_call(
        &self,
        py: Python<'_>,
        device: usize,
        call: DeviceCall,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        if call.has_null_pointer() {
            return Err(invalid("a null device pointer".to_string()));
        }
        let _owner = owner.unwrap_or_else(|| py.None());
        self.submit(
            py,
            Call::Device {
                device,
                call,
                _owner,
            },
            async_op,
        )
    }

    /// Submits one device send or receive: `(ptr, count, dtype, peer, tag, send)`.
    fn device_p2p(
        &self,
        py: Python<'_>,
        (ptr, count, dtype, peer, tag, send): (u64, usize, &str, u32, u32, bool),
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        if ptr == 0 && count > 0 {
            return Err(invalid("a null device pointer".to_string()));
        }
        let call = eccl::device::DeviceP2p {
            buf: ptr,
            count,
            dtype: device_dtype(dtype)?,
            peer: Rank(peer),
            tag,
            send,
        };
        let _owner = owner.unwrap_or_else(|| py.None());
        self.submit(
            py,
            Call::DeviceP2p {
                device,
                call,
                _owner,
            },
            async_op,
        )
    }

    fn submit(&self, py: Python<'_>, call: Call, async_op: bool) -> PyResult<Py<PyAny>> {
        {
            let (reads, writes) = call.buffers();
            check_disjoint(&reads, &writes)?;
        }
        let (done, completion) = Completer::new();
        let id = NEXT_CALL.fetch_add(1, Ordering::Relaxed);
        if let Err(mpsc::error::SendError(queued)) = self.queue.send(Queued { id, call, done }) {
            queued.done.complete(Err(eccl::Error::Evicted {
                reason: "this communicator has left the job or was shut down".into(),
            }));
        }
        let work = Work::new(completion);
        if async_op {
            work.into_py_any(py)
        } else {
            work.finish(py, None)
        }
    }

    fn info(&self) -> Info {
        self.info.lock().map(|i| i.clone()).unwrap_or_default()
    }

    #[allow(clippy::too_many_arguments)]
    fn inplace(
        &self,
        py: Python<'_>,
        kind: CollectiveKind,
        tensor: &Bound<'_, PyAny>,
        op: ReduceOp,
        root: u32,
        async_op: bool,
        keep_on_abort: bool,
    ) -> PyResult<Py<PyAny>> {
        let buf = WritableBuffer::extract(tensor, "tensor")?;
        let on_abort = if keep_on_abort {
            eccl::OnAbort::Unchanged
        } else {
            eccl::OnAbort::Undefined
        };
        self.submit(
            py,
            Call::InPlace {
                kind,
                op,
                root: Rank(root),
                buf,
                on_abort,
            },
            async_op,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn out_of_place(
        &self,
        py: Python<'_>,
        kind: CollectiveKind,
        output: Option<&Bound<'_, PyAny>>,
        input: Option<&Bound<'_, PyAny>>,
        op: ReduceOp,
        root: u32,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let input = match input {
            Some(i) => buffers(i, "input", HostBuffer::extract)?,
            None => vec![],
        };
        let output = match output {
            Some(o) => buffers(o, "output", WritableBuffer::extract)?,
            None => vec![],
        };
        one_dtype(&input, &output)?;
        let call = Call::Collective {
            kind,
            op,
            root: Rank(root),
            input,
            output,
        };
        self.submit(py, call, async_op)
    }
}

#[pymethods]
impl Communicator {
    /// Registers with the master. Arguments beat the `ECCL_*` variables (`ECCL_MASTER`,
    /// `ECCL_SECRET`, `ECCL_TIMEOUT_MS`, ...).
    #[new]
    #[pyo3(signature = (master=None, secret=None, *, rank_hint=None, min_world=None, timeout_ms=None, connect_timeout_ms=None, join_timeout_ms=None, transport=None, tls=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        master: Option<String>,
        secret: Option<String>,
        rank_hint: Option<u32>,
        min_world: Option<u32>,
        timeout_ms: Option<u64>,
        connect_timeout_ms: Option<u64>,
        join_timeout_ms: Option<u64>,
        transport: Option<&str>,
        tls: Option<bool>,
    ) -> PyResult<Communicator> {
        let mut cfg = Config::from_env().or_raise()?;
        if let Some(t) = transport {
            cfg.transport = eccl::TransportChoice::parse(t).ok_or_else(|| {
                invalid(format!("transport {t:?}: expected auto, tcp, shm or quic"))
            })?;
        }
        if let Some(t) = tls {
            cfg.tls = t;
        }
        if let Some(m) = master {
            cfg.master = m;
        }
        if let Some(s) = secret {
            cfg.secret = Some(Secret::new(s).map_err(|e| invalid(format!("secret: {e}")))?);
        }
        if rank_hint.is_some() {
            cfg.rank_hint = rank_hint;
        }
        if let Some(w) = min_world {
            cfg.min_world = w;
        }
        if let Some(t) = timeout_ms {
            cfg.timeout = Duration::from_millis(t.max(1));
        }
        if let Some(t) = connect_timeout_ms {
            cfg.connect_timeout = Duration::from_millis(t);
        }
        if let Some(t) = join_timeout_ms {
            cfg.join_timeout = Duration::from_millis(t);
        }
        let comm = py
            .detach(|| runtime().block_on(eccl::Communicator::connect(cfg)))
            .or_raise()?;
        let info = Arc::new(Mutex::new(Info {
            peer_id: comm.peer_id().0,
            ..Default::default()
        }));
        let aborter = comm.abort_handle();
        let (job_id, masters) = (comm.job_id(), comm.masters().to_string());
        let (tx, rx) = mpsc::unbounded_channel();
        let stop = Arc::new(tokio::sync::Notify::new());
        track(
            runtime().spawn(serve(comm, rx, info.clone(), stop.clone())),
            stop,
        );
        Ok(Communicator {
            queue: tx,
            info,
            aborter,
            job_id,
            masters,
        })
    }

    #[getter]
    fn peer_id(&self) -> u64 {
        self.info().peer_id
    }
    /// This peer's rank in its current world, `None` before the first one.
    #[getter]
    fn rank(&self) -> Option<u32> {
        self.info().rank
    }
    #[getter]
    fn world_size(&self) -> u32 {
        self.info().world_size
    }
    #[getter]
    fn epoch(&self) -> u64 {
        self.info().epoch
    }
    /// What this peer's links run on now: "shm", "tcp", "tls", "quic", "shm+tcp" for a
    /// mixed world, "local" in a world of one.
    #[getter]
    fn transport(&self) -> String {
        self.info().transport.clone()
    }

    // -- membership -----------------------------------------------------------------

    /// Votes for the next epoch and waits until every live member has voted: pending
    /// peers are admitted, departed ones dropped. Returns a `WorldUpdate`.
    fn update_topology(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.submit(py, Call::UpdateTopology, false)
    }

    /// Measures the links to every other member (all pairs, in rounds where each member
    /// talks to one other) and has the master solve the ring order from them: returns
    /// at the new epoch that uses it, same members and ranks. A collective call: every
    /// member makes it. Returns `{"epoch", "ring": [ranks around the ring], "links":
    /// [{"rank", "bytes_per_s", "latency_us"}, ...]` (this member's measurements),
    /// `"algorithms": [{"collective", "up_to_bytes", "algo"}, ...]}` (what the master
    /// chose from everyone's measurements, by collective and size: `up_to_bytes` None is
    /// every larger call; empty: the defaults).
    #[pyo3(signature = (*, async_op=false))]
    fn optimize_topology(&self, py: Python<'_>, async_op: bool) -> PyResult<Py<PyAny>> {
        self.submit(py, Call::OptimizeTopology, async_op)
    }

    /// torch's `_reconfigure`: the next epoch is a world of exactly `peers` (peer ids),
    /// ranks in list order when `ordered` (else the master chooses: members of the
    /// current world first). Every one of them must call it with the same `uuid` and
    /// list; the master commits the world once all have, or answers all with the same
    /// error (a uuid not newer than the last one, a peer that is gone, lists that
    /// differ). Members of the current world left out are removed from the job. Waits at
    /// most `timeout_ms` (default: the join timeout). Returns a `WorldUpdate`.
    #[pyo3(signature = (uuid, peers, ordered=true, *, timeout_ms=None, async_op=false))]
    fn reconfigure(
        &self,
        py: Python<'_>,
        uuid: u64,
        peers: Vec<u64>,
        ordered: bool,
        timeout_ms: Option<u64>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let timeout = Duration::from_millis(timeout_ms.unwrap_or(60_000).max(1));
        let call = Call::Reconfigure {
            uuid,
            peers,
            ordered,
            timeout,
        };
        self.submit(py, call, async_op)
    }

    /// The job's public name (a one-way hash of its secret): handles of one job carry it.
    #[getter]
    fn job_id(&self) -> String {
        self.job_id.clone()
    }

    /// The master addresses this communicator was given (comma-separated).
    #[getter]
    fn masters(&self) -> String {
        self.masters.clone()
    }

    /// Whether peers wait to be admitted; the same answer on every member, so all can
    /// skip `update_topology()` together.
    fn are_peers_pending(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.submit(py, Call::ArePeersPending, false)
    }

    /// Aborts this peer's calls at once (torch's `ProcessGroup.abort()`): every call in
    /// flight or queued fails with `AbortedError` naming `reason`, the other ranks of the
    /// epoch are told (their calls fail too instead of waiting for this rank), and the
    /// next `update_topology()` forms the next epoch. Returns without waiting.
    #[pyo3(signature = (reason="abort() was called"))]
    fn abort(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        self.aborter.abort(reason);
        // Queued behind the calls it fails, so that it runs once they have.
        self.submit(py, Call::AnnounceAbort, true).map(|_| ())
    }

    /// Revokes this peer's epoch at once (NCCL's `ncclCommRevoke`): as `abort`, every
    /// call in flight or queued fails, now with `RevokedError` (an `AbortedError`), and
    /// the other ranks are told, theirs failing with `RevokedError` too. The
    /// communicator, its registration and its links' listeners stay; the next
    /// `update_topology()` forms the next epoch, and the torch backend waits for a
    /// reconfigure or a shrink instead of forming it on its own. Returns without waiting.
    #[pyo3(signature = (reason="revoke() was called"))]
    fn revoke(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        self.aborter.revoke(reason);
        self.submit(py, Call::AnnounceAbort, true).map(|_| ())
    }

    /// Raises the error that broke this communicator's current epoch, if one did (a
    /// peer that died or was evicted at its lease: `AbortedError` naming it; an abort or
    /// a revoke), without waiting for its calls; returns None otherwise. For waits that
    /// are not calls of the communicator (the torch backend's windows).
    fn raise_if_broken(&self) -> PyResult<()> {
        match self.aborter.broken() {
            Some(e) => Err(crate::errors::to_py(&e)),
            None => Ok(()),
        }
    }

    /// Leaves the job on purpose; the others see it at their next update_topology().
    fn leave(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.submit(py, Call::Leave, false)
    }

    // -- collectives ----------------------------------------------------------------

    /// Reduces `tensor` across all members, in place. Returns an `OpInfo` (or a `Work`).
    /// A failed call leaves `tensor` as it was (each piece is saved before its first
    /// write and put back on failure); with `keep_on_abort=False` it may leave partial
    /// results there instead, and saves nothing (as NCCL and gloo behave). `quantize="int8"` or
    /// `"fp8"` sends 8-bit values, scaled per block of 256 (f32, f16, bf16; sum and avg;
    /// within a documented bound, the same bits on every rank, a failed call leaves the
    /// tensor as it was).
    #[pyo3(signature = (tensor, op=None, *, async_op=false, keep_on_abort=true, quantize=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
        keep_on_abort: bool,
        quantize: Option<&str>,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        if let Some(q) = quantize {
            let quantize = eccl::Quantize::parse(q).ok_or_else(|| {
                invalid(format!(
                    "quantize={q:?}: eccl quantizes as \"int8\" or \"fp8\" (or None)"
                ))
            })?;
            let buf = WritableBuffer::extract(tensor, "tensor")?;
            return self.submit(py, Call::Quantized { op, buf, quantize }, async_op);
        }
        let kind = CollectiveKind::AllReduce;
        self.inplace(py, kind, tensor, op, 0, async_op, keep_on_abort)
    }

    /// Queues a wait for a CUDA stream: `stream` is a raw stream of CUDA device `device`
    /// (`torch._C._cuda_getCurrentRawStream(device)`, 0 for the default stream). An event
    /// is recorded on it now, and the calls queued after this one start once the work
    /// queued on `stream` before it is done; the calling thread does not block (where
    /// `torch.cuda.current_stream().synchronize()` would). If the device cannot say, the
    /// wait fails and aborts the epoch (this rank's later calls and the other ranks'
    /// copies of them fail with `AbortedError`), so that no rank's call takes unready
    /// data. Returns a `Work`. `stream` must be a live stream of `device`: the driver is
    /// handed it as it is, as the `*_device` calls' pointers are.
    #[pyo3(signature = (stream, *, device))]
    fn await_device_stream(
        &self,
        py: Python<'_>,
        stream: u64,
        device: usize,
    ) -> PyResult<Py<PyAny>> {
        let pool = eccl_cuda::EventPool::for_device(device)
            .map_err(|e| invalid(format!("cuda:{device}: {e}")))?;
        // SAFETY: the caller passes a live stream of `device` (torch's current stream).
        let event = unsafe { pool.record(stream) }
            .map_err(|e| invalid(format!("recording an event on cuda:{device}'s stream: {e}")))?;
        self.submit(py, Call::AwaitDevice { event }, true)
    }

    /// All_reduce of device memory in place, among ranks that all run on this host:
    /// `count` elements of `dtype` at address `ptr` on CUDA device `device` (a tensor's
    /// `data_ptr()`), read and written by every rank's GPU kernels straight from each
    /// other's memory over CUDA IPC. The memory must be ready (its stream synchronized,
    /// or an `await_device_stream` queued before this call) and untouched until the call
    /// is done; `owner` (the tensor) is held until then.
    #[pyo3(signature = (ptr, count, dtype, op=None, *, device, owner=None, async_op=false, keep_on_abort=true))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_device(
        &self,
        py: Python<'_>,
        ptr: u64,
        count: usize,
        dtype: &str,
        op: Option<&Bound<'_, PyAny>>,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
        keep_on_abort: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::AllReduce {
            buf: ptr,
            count,
            dtype: device_dtype(dtype)?,
            op: reduce_op(op)?,
            keep: keep_on_abort,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// All_gather of device memory among ranks that all run on this host: `count`
    /// elements of `dtype` at `send` from every rank into `recv` (world × count, rank
    /// order) on every rank, copied GPU to GPU over CUDA IPC. `send` may be `recv`'s slice
    /// at this rank's offset (NCCL's in-place form). After a failed call `recv` is
    /// undefined. Readiness and `owner` as for `all_reduce_device`.
    #[pyo3(signature = (send, recv, count, dtype, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_gather_device(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::AllGather {
            send,
            recv,
            count,
            dtype: device_dtype(dtype)?,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// Reduce_scatter of device memory among ranks that all run on this host: every
    /// rank's `send` (world × count elements) reduced with `op` in rank order, slice r of
    /// the result into rank r's `recv` (`count` elements), GPU to GPU over CUDA IPC.
    /// `recv` may be `send`'s slice at this rank's offset (NCCL's in-place form). After a
    /// failed call `recv` is undefined. Readiness and `owner` as for `all_reduce_device`.
    #[pyo3(signature = (send, recv, count, dtype, op=None, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_device(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        op: Option<&Bound<'_, PyAny>>,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::ReduceScatter {
            send,
            recv,
            count,
            dtype: device_dtype(dtype)?,
            op: reduce_op(op)?,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// Broadcast of device memory from rank `root`: `count` elements of `dtype` at `ptr`,
    /// copied GPU to GPU over CUDA IPC among ranks on this host, through host memory in
    /// pipelined chunks otherwise (as `all_reduce_device`). After a failed call a non-root
    /// buffer is undefined; the root's is never written.
    /// Readiness and `owner` as for `all_reduce_device`.
    #[pyo3(signature = (ptr, count, dtype, root, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn broadcast_device(
        &self,
        py: Python<'_>,
        ptr: u64,
        count: usize,
        dtype: &str,
        root: usize,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::Broadcast {
            buf: ptr,
            count,
            dtype: device_dtype(dtype)?,
            root,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// All_to_all of device memory (GPU to GPU over CUDA IPC among ranks that all run on
    /// this host; otherwise through host memory, a pipeline of chunks):
    /// `send_counts[t]` elements of `dtype` from `send` (blocks in rank order) to rank t,
    /// `recv_counts[s]` from rank s into `recv` (blocks in rank order), copied GPU to GPU
    /// over CUDA IPC (torch's `all_to_all_single` with its split sizes). Every rank checks
    /// every other's counts: a block sent with another size than its receiver expects is
    /// a `MismatchError` on every rank, before anything is written. `send` and `recv` must
    /// not overlap. After a failed call `recv` is undefined. Readiness and `owner` as for
    /// `all_reduce_device`.
    #[pyo3(signature = (send, recv, send_counts, recv_counts, dtype, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_device(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        dtype: &str,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::AllToAll {
            send,
            recv,
            send_counts,
            recv_counts,
            dtype: device_dtype(dtype)?,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// Gather of device memory to rank `root`: every rank's `send` (`count` elements of
    /// `dtype`) into the root's `recv` (world × count, rank order), copied GPU to GPU over
    /// CUDA IPC among ranks that all run on this host, otherwise through host memory (a
    /// pipeline of chunks). Ranks other than the root pass
    /// `recv=0`; the root's `send` may be its own slice of `recv`. After a failed call the
    /// root's `recv` is undefined. Readiness and `owner` as for `all_reduce_device`.
    #[pyo3(signature = (send, recv, count, dtype, root, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn gather_device(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        root: usize,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::Gather {
            send,
            recv,
            count,
            dtype: device_dtype(dtype)?,
            root,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// Scatter of device memory from rank `root`: block t of the root's `send` (world ×
    /// count elements of `dtype`) into rank t's `recv` (`count`), copied GPU to GPU over
    /// CUDA IPC among ranks that all run on this host, otherwise through host memory (a
    /// pipeline of chunks). Ranks other than the root pass
    /// `send=0`; the root's `recv` may be its own slice of `send`. After a failed call
    /// `recv` is undefined. Readiness and `owner` as for `all_reduce_device`.
    #[pyo3(signature = (send, recv, count, dtype, root, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn scatter_device(
        &self,
        py: Python<'_>,
        send: u64,
        recv: u64,
        count: usize,
        dtype: &str,
        root: usize,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let call = DeviceCall::Scatter {
            send,
            recv,
            count,
            dtype: device_dtype(dtype)?,
            root,
        };
        self.device_call(py, device, call, owner, async_op)
    }

    /// Several tensors of one dtype reduced in place by one all_reduce (one collective,
    /// one descriptor), as gloo's `allreduce_coalesced` does.
    #[pyo3(signature = (tensors, op=None, *, async_op=false))]
    fn all_reduce_coalesced(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        let mut bufs = Vec::new();
        for (i, t) in tensors.try_iter()?.enumerate() {
            bufs.push(WritableBuffer::extract(&t?, &format!("tensors[{i}]"))?);
        }
        if let Some(first) = bufs.first() {
            let d = first.read().dtype();
            if let Some(other) = bufs.iter().find(|b| b.read().dtype() != d) {
                return Err(invalid(format!(
                    "coalesced tensors must share one dtype: {d} and {}",
                    other.read().dtype()
                )));
            }
        }
        self.submit(py, Call::Coalesced { op, bufs }, async_op)
    }

    /// Copies root's `tensor` into every member's, in place (`keep_on_abort` as for
    /// `all_reduce`).
    #[pyo3(signature = (tensor, root=0, *, async_op=false, keep_on_abort=true))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: u32,
        async_op: bool,
        keep_on_abort: bool,
    ) -> PyResult<Py<PyAny>> {
        let (kind, op) = (CollectiveKind::Broadcast, ReduceOp::Sum);
        self.inplace(py, kind, tensor, op, root, async_op, keep_on_abort)
    }

    /// Reduces into `tensor` on `root`; other ranks' tensors stay as they were
    /// (`keep_on_abort` as for `all_reduce`, on the root).
    #[pyo3(signature = (tensor, root=0, op=None, *, async_op=false, keep_on_abort=true))]
    fn reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        root: u32,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
        keep_on_abort: bool,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        let kind = CollectiveKind::Reduce;
        self.inplace(py, kind, tensor, op, root, async_op, keep_on_abort)
    }

    /// `output` holds world_size blocks of `input`'s size; block r is rank r's input.
    /// `output` may be a list of world_size buffers, one per block, written where they
    /// are (torch's list form); any side of an out-of-place call may be a list, read as
    /// its buffers back to back.
    #[pyo3(signature = (output, input, *, async_op=false))]
    fn all_gather(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.out_of_place(
            py,
            CollectiveKind::AllGather,
            Some(output),
            Some(input),
            ReduceOp::Sum,
            0,
            async_op,
        )
    }

    /// All_gather (`output`: world blocks of `input`'s size) in which the ranks read each
    /// other's memory directly where every rank's source lies in eccl's shared memory
    /// (a tensor from the torch backend's `allocate_tensor`), and over the links
    /// otherwise (every rank takes the same way). `input=None`: this rank's block of
    /// `output` is its source (NCCL's in-place form). After a failed call `output` is
    /// undefined. `wait()` says whether the memory was read directly.
    #[pyo3(signature = (output, input=None, *, async_op=false))]
    fn all_gather_shared(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let output = WritableBuffer::extract(output, "output")?;
        let input = input.map(|i| HostBuffer::extract(i, "input")).transpose()?;
        one_dtype(input.as_slice(), std::slice::from_ref(&output))?;
        self.submit(py, Call::SharedAllGather { output, input }, async_op)
    }

    /// Reduce_scatter (`input`: world blocks of `output`'s size) in which each rank
    /// reduces its block straight from every rank's input where every rank's input lies
    /// in eccl's shared memory, and over the links otherwise. After a failed call
    /// `output` is undefined. `wait()` says whether the memory was read directly.
    #[pyo3(signature = (output, input, op=None, *, async_op=false))]
    fn reduce_scatter_shared(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let output = WritableBuffer::extract(output, "output")?;
        let input = HostBuffer::extract(input, "input")?;
        one_dtype(std::slice::from_ref(&input), std::slice::from_ref(&output))?;
        let op = reduce_op(op)?;
        self.submit(
            py,
            Call::SharedReduceScatter { op, output, input },
            async_op,
        )
    }

    /// `input` holds world_size blocks of `output`'s size; rank r gets block r reduced.
    /// `input` may be a list of world_size buffers, one per block, read where they are.
    #[pyo3(signature = (output, input, op=None, *, async_op=false))]
    fn reduce_scatter(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        op: Option<&Bound<'_, PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let op = reduce_op(op)?;
        self.out_of_place(
            py,
            CollectiveKind::ReduceScatter,
            Some(output),
            Some(input),
            op,
            0,
            async_op,
        )
    }

    /// Block j of `input` goes to rank j; block j of `output` comes from rank j. With
    /// `send_counts` and `recv_counts` (elements, one per rank, both or neither) the
    /// blocks may differ in size: `send_counts[j]` elements of `input` go to rank j,
    /// `recv_counts[j]` of `output` come from it, each buffer's blocks in rank order;
    /// every pair moves exactly its own blocks, and a pair whose ends disagree fails
    /// with `MismatchError` at both ends.
    #[pyo3(signature = (output, input, *, send_counts=None, recv_counts=None, async_op=false))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        send_counts: Option<Vec<usize>>,
        recv_counts: Option<Vec<usize>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        match (send_counts, recv_counts) {
            (None, None) => {}
            (Some(send_counts), Some(recv_counts)) => {
                let input = buffers(input, "input", HostBuffer::extract)?;
                let output = buffers(output, "output", WritableBuffer::extract)?;
                one_dtype(&input, &output)?;
                let call = Call::AllToAllV {
                    input,
                    output,
                    send_counts,
                    recv_counts,
                };
                return self.submit(py, call, async_op);
            }
            _ => {
                return Err(invalid(
                    "all_to_all: pass both send_counts and recv_counts, or neither",
                ))
            }
        }
        self.out_of_place(
            py,
            CollectiveKind::AllToAll,
            Some(output),
            Some(input),
            ReduceOp::Sum,
            0,
            async_op,
        )
    }

    /// On `root`, `output` holds world_size blocks (or is a list of world_size
    /// buffers, one per block); elsewhere pass `output=None`.
    #[pyo3(signature = (output, input, root=0, *, async_op=false))]
    fn gather(
        &self,
        py: Python<'_>,
        output: Option<&Bound<'_, PyAny>>,
        input: &Bound<'_, PyAny>,
        root: u32,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.out_of_place(
            py,
            CollectiveKind::Gather,
            output,
            Some(input),
            ReduceOp::Sum,
            root,
            async_op,
        )
    }

    /// On `root`, `input` holds world_size blocks (or is a list of world_size buffers,
    /// one per block); elsewhere pass `input=None`.
    #[pyo3(signature = (output, input, root=0, *, async_op=false))]
    fn scatter(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: Option<&Bound<'_, PyAny>>,
        root: u32,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.out_of_place(
            py,
            CollectiveKind::Scatter,
            Some(output),
            input,
            ReduceOp::Sum,
            root,
            async_op,
        )
    }

    #[pyo3(signature = (*, async_op=false))]
    fn barrier(&self, py: Python<'_>, async_op: bool) -> PyResult<Py<PyAny>> {
        self.out_of_place(
            py,
            CollectiveKind::Barrier,
            None,
            None,
            ReduceOp::Sum,
            0,
            async_op,
        )
    }

    /// Sends `tensor` to rank `peer`, matched by its `recv` with the same tag.
    #[pyo3(signature = (tensor, peer, tag=0, *, async_op=false))]
    fn send(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        peer: u32,
        tag: u32,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let buf = HostBuffer::extract(tensor, "tensor")?;
        self.submit(
            py,
            Call::Send {
                buf,
                peer: Rank(peer),
                tag,
            },
            async_op,
        )
    }

    /// Sends `count` elements of `dtype` of CUDA device `device`'s memory at `ptr` to rank
    /// `peer`, whose `recv_device` with the same tag takes them, through page-locked
    /// host memory in pipelined chunks (also between ranks of one host: not over CUDA
    /// IPC). Eager, as a host send is: returns once every chunk is handed to the link. A
    /// receive of another size or dtype fails the receiver with `MismatchError` and ends
    /// the epoch on every rank, as a host receive of another size does. The memory must be ready, as for `all_reduce_device`; `owner` is
    /// held until the call is done.
    #[pyo3(signature = (ptr, count, dtype, peer, tag=0, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn send_device(
        &self,
        py: Python<'_>,
        ptr: u64,
        count: usize,
        dtype: &str,
        peer: u32,
        tag: u32,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.device_p2p(
            py,
            (ptr, count, dtype, peer, tag, true),
            device,
            owner,
            async_op,
        )
    }

    /// Receives into `count` elements of `dtype` of CUDA device `device`'s memory at `ptr`
    /// what rank `peer` sends with `send_device` and the same tag. After a failed call the
    /// memory is undefined. Readiness and `owner` as for `send_device`.
    #[pyo3(signature = (ptr, count, dtype, peer, tag=0, *, device, owner=None, async_op=false))]
    #[allow(clippy::too_many_arguments)]
    fn recv_device(
        &self,
        py: Python<'_>,
        ptr: u64,
        count: usize,
        dtype: &str,
        peer: u32,
        tag: u32,
        device: usize,
        owner: Option<Py<PyAny>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        self.device_p2p(
            py,
            (ptr, count, dtype, peer, tag, false),
            device,
            owner,
            async_op,
        )
    }

    /// Receives into `tensor` from rank `peer` what it sent with the same tag; with
    /// `peer=None`, from whichever rank's message with that tag comes first (the
    /// returned `OpInfo.peer` names the sender).
    #[pyo3(signature = (tensor, peer=None, tag=0, *, async_op=false))]
    fn recv(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        peer: Option<u32>,
        tag: u32,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let buf = WritableBuffer::extract(tensor, "tensor")?;
        self.submit(
            py,
            Call::Recv {
                buf,
                peer: peer.map(Rank),
                tag,
            },
            async_op,
        )
    }

    // -- shared state ---------------------------------------------------------------

    /// Brings every member's `tensors` (name -> array or tensor, the same names and
    /// sizes everywhere) to the content most members hold at the highest revision;
    /// outdated members fetch it in checked chunks from several members at once.
    /// `strategy`: "enforce_popular" (default), "receive_only" or "send_only".
    /// `unchanged`: names of tensors the caller promises hold what the last sync left in
    /// them (same memory): they are not hashed again. Returns a `SyncInfo` whose
    /// `revision` every member now holds. A failed call leaves the tensors as they were,
    /// except a newcomer's (revision 0), which take each chunk as it arrives.
    #[pyo3(signature = (revision, tensors, strategy="enforce_popular", *, unchanged=None, async_op=false))]
    fn sync_shared_state(
        &self,
        py: Python<'_>,
        revision: u64,
        tensors: &Bound<'_, PyDict>,
        strategy: &str,
        unchanged: Option<std::collections::HashSet<String>>,
        async_op: bool,
    ) -> PyResult<Py<PyAny>> {
        let strategy = SyncStrategy::parse(strategy).ok_or_else(|| {
            let all: Vec<_> = SyncStrategy::ALL.iter().map(|s| s.name()).collect();
            invalid(format!("unknown strategy {strategy:?}: {}", all.join(", ")))
        })?;
        let mut bufs = Vec::new();
        for (name, t) in tensors.iter() {
            let name: String = name.extract()?;
            let buf = WritableBuffer::extract(&t, &format!("shared tensor {name:?}"))?;
            bufs.push((name, buf));
        }
        let call = Call::Sync {
            revision,
            tensors: bufs,
            strategy,
            unchanged: unchanged.unwrap_or_default(),
        };
        self.submit(py, call, async_op)
    }
}
