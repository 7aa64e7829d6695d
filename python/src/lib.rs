//! `eccl._eccl`: the native half of the Python package. The Python half (`python/eccl/`)
//! turns numpy arrays and CPU torch tensors into (address, length, dtype) triples,
//! keeps them alive while a call is in flight, and gives the API its Python shape.
//!
//! Each communicator lives in one task of a shared tokio runtime and runs the calls of
//! its queue in order; a Python call enqueues and returns a [`Work`] at once (the async
//! variants) or waits on it with the GIL released. The buffers are never copied on the
//! Python side: the addresses go to the library as they are.

use std::sync::{mpsc as std_mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

use eccl::{
    CollArgs, CollectiveKind, Config, DType, OpInfo, ReduceOp, Secret, SharedTensor, SyncInfo,
    SyncStrategy, Topology,
};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::mpsc;

create_exception!(
    _eccl,
    EcclError,
    PyException,
    "Base class of every eccl error."
);
create_exception!(_eccl, AbortedError, EcclError, "The epoch was aborted (a peer died, hung or failed the call); inputs are unchanged. Call update_topology() and retry.");
create_exception!(
    _eccl,
    EvictedError,
    EcclError,
    "This peer was evicted; create a new Communicator to register again."
);
create_exception!(
    _eccl,
    MismatchError,
    EcclError,
    "Ranks called different collectives or the same one with different arguments."
);
create_exception!(
    _eccl,
    TimeoutError,
    EcclError,
    "No progress within the deadline."
);
create_exception!(
    _eccl,
    MasterUnavailableError,
    EcclError,
    "The master could not be reached."
);
create_exception!(
    _eccl,
    InvalidArgumentError,
    EcclError,
    "The call is wrong on its own (sizes, dtype, op, root...)."
);
create_exception!(
    _eccl,
    TooFewPeersError,
    EcclError,
    "Fewer peers remain than required."
);

fn to_py(e: eccl::Error) -> PyErr {
    let msg = format!("{e} ({})", e.hint());
    match e {
        eccl::Error::Aborted { .. } => AbortedError::new_err(msg),
        eccl::Error::Evicted { .. } => EvictedError::new_err(msg),
        eccl::Error::Mismatch { .. } => MismatchError::new_err(msg),
        eccl::Error::Timeout { .. } => TimeoutError::new_err(msg),
        eccl::Error::MasterUnavailable { .. } => MasterUnavailableError::new_err(msg),
        eccl::Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        eccl::Error::TooFewPeers { .. } => TooFewPeersError::new_err(msg),
    }
}

fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidArgumentError::new_err(msg.into())
}

/// The runtime every communicator and embedded master of this process runs on. A child
/// made by `fork()` (multiprocessing's default on Linux) inherits the parent's runtime
/// without its threads, so it gets a runtime of its own.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: Mutex<Option<(u32, &'static tokio::runtime::Runtime)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut slot = RT.lock().unwrap_or_else(|e| e.into_inner());
    match *slot {
        Some((p, rt)) if p == pid => rt,
        _ => {
            eccl::logging::init();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("eccl")
                .enable_all()
                .build()
                .expect("cannot start the eccl runtime");
            // Lives as long as the process: tasks hold on to it, and a forked parent's
            // copy must never be dropped in the child.
            let rt: &'static tokio::runtime::Runtime = Box::leak(Box::new(rt));
            *slot = Some((pid, rt));
            rt
        }
    }
}

/// A caller's buffer: address and length in bytes. The Python side keeps its owner
/// alive until the call's `Work` has completed.
#[derive(Clone, Copy)]
struct Raw {
    ptr: usize,
    len: usize,
}

impl Raw {
    /// # Safety
    /// The buffer must be alive and not used elsewhere while the slice lives.
    unsafe fn slice<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len)
    }
}

enum Call {
    UpdateTopology,
    ArePeersPending,
    Collective {
        args: CollArgs,
        input: Raw,
        output: Raw,
    },
    InPlace {
        args: CollArgs,
        buf: Raw,
    },
    Send {
        dtype: DType,
        buf: Raw,
        peer: u32,
        tag: u32,
    },
    Recv {
        dtype: DType,
        buf: Raw,
        peer: u32,
        tag: u32,
    },
    Sync {
        revision: u64,
        tensors: Vec<(String, Raw)>,
        strategy: SyncStrategy,
    },
    Leave,
}

enum Done {
    Topology(Topology),
    Pending(bool),
    Op(OpInfo),
    Sync(SyncInfo),
    Left,
}

type Outcome = Result<Done, eccl::Error>;

struct Job {
    call: Call,
    done: std_mpsc::Sender<Outcome>,
}

#[derive(Clone, Copy, Default)]
struct Info {
    peer_id: u64,
    rank: Option<u32>,
    world_size: u32,
    epoch: u64,
}

async fn serve(
    mut comm: eccl::Communicator,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    info: Arc<Mutex<Info>>,
) {
    while let Some(job) = jobs.recv().await {
        // SAFETY (every `slice()` below): the Python side holds the buffers' owners until
        // this job's Work completes, and runs one call per buffer at a time.
        let out = match job.call {
            Call::UpdateTopology => comm.update_topology().await.map(Done::Topology),
            Call::ArePeersPending => comm.are_peers_pending().await.map(Done::Pending),
            Call::Collective {
                args,
                input,
                output,
            } => comm
                .collective(args, unsafe { input.slice() }, unsafe { output.slice() })
                .await
                .map(Done::Op),
            Call::InPlace { args, buf } => comm
                .collective_inplace(args, unsafe { buf.slice() })
                .await
                .map(Done::Op),
            Call::Send {
                dtype,
                buf,
                peer,
                tag,
            } => comm
                .send_bytes(dtype, unsafe { buf.slice() }, peer, tag)
                .await
                .map(Done::Op),
            Call::Recv {
                dtype,
                buf,
                peer,
                tag,
            } => comm
                .recv_bytes(dtype, unsafe { buf.slice() }, peer, tag)
                .await
                .map(Done::Op),
            Call::Sync {
                revision,
                tensors,
                strategy,
            } => {
                let mut ts: Vec<SharedTensor<'_>> = tensors
                    .iter()
                    .map(|(n, r)| SharedTensor::bytes(n.clone(), unsafe { r.slice() }))
                    .collect();
                comm.sync_shared_state(revision, &mut ts, strategy)
                    .await
                    .map(Done::Sync)
            }
            Call::Leave => {
                let r = comm.leave().await.map(|_| Done::Left);
                let _ = job.done.send(r);
                jobs.close();
                while let Some(j) = jobs.recv().await {
                    let _ = j.done.send(Err(eccl::Error::Evicted {
                        reason: "this peer left the job".into(),
                    }));
                }
                return;
            }
        };
        if let Ok(mut i) = info.lock() {
            *i = Info {
                peer_id: comm.peer_id(),
                rank: comm.rank(),
                world_size: comm.world_size(),
                epoch: comm.epoch(),
            };
        }
        let _ = job.done.send(out);
    }
}

/// Handles of live communicators' tasks, so that interpreter exit can stop them before
/// Python frees the buffers they may be writing.
/// Each with the pid that started it: a forked child must leave its parent's alone.
type Tasks = Mutex<Vec<(u32, tokio::task::JoinHandle<()>)>>;

fn live_tasks() -> &'static Tasks {
    static TASKS: OnceLock<Tasks> = OnceLock::new();
    TASKS.get_or_init(Default::default)
}

/// Stops every communicator at once (the package registers this with `atexit`): calls
/// in flight end where they are and their Work objects report `AbortedError`.
#[pyfunction]
fn _shutdown(py: Python<'_>) {
    let pid = std::process::id();
    let tasks: Vec<_> = live_tasks()
        .lock()
        .map(|mut t| {
            t.drain(..)
                .filter(|(p, _)| *p == pid)
                .map(|(_, h)| h)
                .collect()
        })
        .unwrap_or_default();
    if tasks.is_empty() {
        // Nothing ran here: do not start a runtime just to stop nothing.
        return;
    }
    py.detach(|| {
        runtime().block_on(async {
            for t in tasks {
                t.abort();
                let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
            }
        })
    });
}

/// The result of one call, now or later.
#[pyclass(module = "eccl._eccl")]
struct Work {
    rx: Mutex<Option<std_mpsc::Receiver<Outcome>>>,
    result: Mutex<Option<Result<Py<PyAny>, (String, String)>>>,
}

fn done_to_py(py: Python<'_>, d: Done) -> PyResult<Py<PyAny>> {
    let dict = PyDict::new(py);
    match d {
        Done::Topology(t) => {
            dict.set_item("epoch", t.epoch)?;
            dict.set_item("changed", t.changed)?;
            dict.set_item("rank", t.rank)?;
            dict.set_item("world_size", t.world_size)?;
            dict.set_item("links_kept", t.links_kept)?;
        }
        Done::Pending(p) => return Ok(p.into_pyobject(py)?.to_owned().into_any().unbind()),
        Done::Op(o) => {
            dict.set_item("epoch", o.epoch)?;
            dict.set_item("seq", o.seq)?;
            dict.set_item("rank", o.rank)?;
            dict.set_item("world_size", o.world_size)?;
            dict.set_item("members", o.members.to_vec())?;
            dict.set_item("algo", o.algo.to_string())?;
        }
        Done::Sync(s) => {
            dict.set_item("epoch", s.epoch)?;
            dict.set_item("revision", s.revision)?;
            dict.set_item("bytes_sent", s.bytes_sent)?;
            dict.set_item("bytes_received", s.bytes_received)?;
            dict.set_item("sources", s.sources)?;
            dict.set_item("updated", s.updated)?;
            dict.set_item("hash", hex::encode(s.hash))?;
        }
        Done::Left => return Ok(py.None()),
    }
    Ok(dict.into_any().unbind())
}

fn err_parts(e: &PyErr, py: Python<'_>) -> (String, String) {
    let name = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "EcclError".into());
    (name, e.value(py).to_string())
}

fn err_from_parts(name: &str, msg: &str) -> PyErr {
    let m = msg.to_string();
    match name {
        "AbortedError" => AbortedError::new_err(m),
        "EvictedError" => EvictedError::new_err(m),
        "MismatchError" => MismatchError::new_err(m),
        "TimeoutError" => TimeoutError::new_err(m),
        "MasterUnavailableError" => MasterUnavailableError::new_err(m),
        "InvalidArgumentError" => InvalidArgumentError::new_err(m),
        "TooFewPeersError" => TooFewPeersError::new_err(m),
        _ => EcclError::new_err(m),
    }
}

impl Work {
    fn settle(&self, py: Python<'_>, outcome: Outcome) {
        let r = match outcome.map_err(to_py).and_then(|d| done_to_py(py, d)) {
            Ok(v) => Ok(v),
            Err(e) => Err(err_parts(&e, py)),
        };
        if let Ok(mut slot) = self.result.lock() {
            *slot = Some(r);
        }
    }

    fn stopped() -> Outcome {
        Err(eccl::Error::Aborted {
            epoch: 0,
            cause: "the communicator was shut down".into(),
        })
    }
}

#[pymethods]
impl Work {
    /// Whether the call has finished (successfully or not).
    fn is_completed(&self, py: Python<'_>) -> bool {
        if self.result.lock().map(|r| r.is_some()).unwrap_or(false) {
            return true;
        }
        let got = {
            let rx = self.rx.lock().ok();
            rx.as_ref().and_then(|r| r.as_ref()).map(|r| r.try_recv())
        };
        match got {
            Some(Ok(o)) => self.settle(py, o),
            Some(Err(std_mpsc::TryRecvError::Disconnected)) => self.settle(py, Work::stopped()),
            _ => return false,
        }
        true
    }

    /// Waits for the call (the GIL is released meanwhile) and returns its result, or
    /// raises its error. `timeout` in seconds: `TimeoutError` if it passes first (the
    /// call goes on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        if !self.result.lock().map(|r| r.is_some()).unwrap_or(false) {
            let rx = self.rx.lock().ok().and_then(|mut r| r.take());
            if let Some(rx) = rx {
                // The receiver moves into the closure and back out: it is Send, not Sync.
                let (rx, got) = py.detach(move || {
                    let got = match timeout {
                        None => rx.recv().map_err(|_| false),
                        Some(t) => rx
                            .recv_timeout(Duration::from_secs_f64(t.max(0.0)))
                            .map_err(|e| matches!(e, std_mpsc::RecvTimeoutError::Timeout)),
                    };
                    (rx, got)
                });
                match got {
                    Ok(o) => self.settle(py, o),
                    Err(true) => {
                        if let Ok(mut slot) = self.rx.lock() {
                            *slot = Some(rx);
                        }
                        return Err(TimeoutError::new_err(format!(
                            "the call did not finish within {timeout:?} s"
                        )));
                    }
                    Err(false) => self.settle(py, Work::stopped()),
                }
            }
        }
        let slot = self
            .result
            .lock()
            .map_err(|_| EcclError::new_err("internal lock poisoned"))?;
        match slot.as_ref() {
            Some(Ok(v)) => Ok(v.clone_ref(py)),
            Some(Err((name, msg))) => Err(err_from_parts(name, msg)),
            None => Err(EcclError::new_err("the call's result was lost")),
        }
    }
}

fn parse_dtype(s: &str) -> PyResult<DType> {
    DType::parse(s).ok_or_else(|| {
        invalid(format!(
            "unsupported dtype {s:?}: eccl has f32, f64, f16, bf16, i8, u8, i32, i64"
        ))
    })
}

fn parse_op(s: &str) -> PyResult<ReduceOp> {
    ReduceOp::parse(s).ok_or_else(|| {
        invalid(format!(
            "unknown reduce op {s:?}: sum, prod, min, max, avg, band, bor, bxor"
        ))
    })
}

/// The native communicator; `eccl.Communicator` wraps it.
#[pyclass(module = "eccl._eccl")]
struct Communicator {
    jobs: mpsc::UnboundedSender<Job>,
    info: Arc<Mutex<Info>>,
}

impl Communicator {
    fn submit(&self, call: Call) -> Work {
        let (tx, rx) = std_mpsc::channel();
        if let Err(mpsc::error::SendError(job)) = self.jobs.send(Job { call, done: tx }) {
            let _ = job.done.send(Err(eccl::Error::Evicted {
                reason: "this communicator has left the job or was shut down".into(),
            }));
        }
        Work {
            rx: Mutex::new(Some(rx)),
            result: Mutex::new(None),
        }
    }

    fn info(&self) -> Info {
        self.info.lock().map(|i| *i).unwrap_or_default()
    }
}

#[pymethods]
impl Communicator {
    /// Registers with the master. Arguments beat the `ECCL_*` variables.
    #[new]
    #[pyo3(signature = (master=None, secret=None, rank_hint=None, min_world=None, timeout_ms=None, connect_timeout_ms=None, join_timeout_ms=None))]
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
    ) -> PyResult<Communicator> {
        let mut cfg = Config::from_env().map_err(to_py)?;
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
            .map_err(to_py)?;
        let info = Arc::new(Mutex::new(Info {
            peer_id: comm.peer_id(),
            ..Default::default()
        }));
        let (tx, rx) = mpsc::unbounded_channel();
        let task = runtime().spawn(serve(comm, rx, info.clone()));
        if let Ok(mut t) = live_tasks().lock() {
            t.retain(|(_, h)| !h.is_finished());
            t.push((std::process::id(), task));
        }
        Ok(Communicator { jobs: tx, info })
    }

    #[getter]
    fn peer_id(&self) -> u64 {
        self.info().peer_id
    }
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

    fn update_topology(&self) -> Work {
        self.submit(Call::UpdateTopology)
    }

    fn are_peers_pending(&self) -> Work {
        self.submit(Call::ArePeersPending)
    }

    fn leave(&self) -> Work {
        self.submit(Call::Leave)
    }

    /// One collective on raw buffers: `kind` as in eccl-bench (all_reduce, broadcast,
    /// reduce, all_gather, reduce_scatter, all_to_all, gather, scatter, barrier),
    /// `count` in NCCL's convention, buffers as (address, bytes).
    #[allow(clippy::too_many_arguments)]
    fn collective(
        &self,
        kind: &str,
        dtype: &str,
        op: &str,
        root: u32,
        count: usize,
        in_ptr: usize,
        in_len: usize,
        out_ptr: usize,
        out_len: usize,
    ) -> PyResult<Work> {
        let kind = CollectiveKind::parse(kind)
            .ok_or_else(|| invalid(format!("unknown collective {kind:?}")))?;
        let args = CollArgs {
            kind,
            dtype: parse_dtype(dtype)?,
            op: parse_op(op)?,
            root,
            count,
        };
        let (input, output) = (
            Raw {
                ptr: in_ptr,
                len: in_len,
            },
            Raw {
                ptr: out_ptr,
                len: out_len,
            },
        );
        if input.ptr != 0
            && output.ptr != 0
            && in_ptr < out_ptr + out_len
            && out_ptr < in_ptr + in_len
        {
            return Err(invalid("input and output overlap; use the in-place form"));
        }
        Ok(self.submit(Call::Collective {
            args,
            input,
            output,
        }))
    }

    /// An in-place collective (all_reduce, broadcast, reduce) on one buffer; it changes
    /// only if the call succeeds.
    fn collective_inplace(
        &self,
        kind: &str,
        dtype: &str,
        op: &str,
        root: u32,
        ptr: usize,
        len: usize,
    ) -> PyResult<Work> {
        let kind = CollectiveKind::parse(kind)
            .ok_or_else(|| invalid(format!("unknown collective {kind:?}")))?;
        if !matches!(
            kind,
            CollectiveKind::AllReduce | CollectiveKind::Broadcast | CollectiveKind::Reduce
        ) {
            return Err(invalid(format!(
                "{kind} has no in-place form; give an output buffer"
            )));
        }
        let dtype = parse_dtype(dtype)?;
        let args = CollArgs {
            kind,
            dtype,
            op: parse_op(op)?,
            root,
            count: len / dtype.size(),
        };
        Ok(self.submit(Call::InPlace {
            args,
            buf: Raw { ptr, len },
        }))
    }

    fn send(&self, dtype: &str, ptr: usize, len: usize, peer: u32, tag: u32) -> PyResult<Work> {
        Ok(self.submit(Call::Send {
            dtype: parse_dtype(dtype)?,
            buf: Raw { ptr, len },
            peer,
            tag,
        }))
    }

    fn recv(&self, dtype: &str, ptr: usize, len: usize, peer: u32, tag: u32) -> PyResult<Work> {
        Ok(self.submit(Call::Recv {
            dtype: parse_dtype(dtype)?,
            buf: Raw { ptr, len },
            peer,
            tag,
        }))
    }

    /// `tensors`: (name, address, bytes) triples; `strategy`: enforce_popular,
    /// receive_only or send_only.
    fn sync_shared_state(
        &self,
        revision: u64,
        tensors: Vec<(String, usize, usize)>,
        strategy: &str,
    ) -> PyResult<Work> {
        let strategy = match strategy {
            "enforce_popular" => SyncStrategy::EnforcePopular,
            "receive_only" => SyncStrategy::ReceiveOnly,
            "send_only" => SyncStrategy::SendOnly,
            s => {
                return Err(invalid(format!(
                    "unknown strategy {s:?}: enforce_popular, receive_only, send_only"
                )))
            }
        };
        let tensors = tensors
            .into_iter()
            .map(|(n, ptr, len)| (n, Raw { ptr, len }))
            .collect();
        Ok(self.submit(Call::Sync {
            revision,
            tensors,
            strategy,
        }))
    }
}

/// An embedded master in this process.
#[pyclass(module = "eccl._eccl")]
struct Master {
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
                MasterUnavailableError::new_err(format!("cannot start the master: {e}"))
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

#[pymodule]
fn _eccl(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Communicator>()?;
    m.add_class::<Work>()?;
    m.add_class::<Master>()?;
    m.add_function(wrap_pyfunction!(_shutdown, m)?)?;
    m.add("EcclError", py.get_type::<EcclError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("EvictedError", py.get_type::<EvictedError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("TimeoutError", py.get_type::<TimeoutError>())?;
    m.add(
        "MasterUnavailableError",
        py.get_type::<MasterUnavailableError>(),
    )?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("TooFewPeersError", py.get_type::<TooFewPeersError>())?;
    Ok(())
}
