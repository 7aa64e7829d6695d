//! `eccl.Work`: the handle of a call in flight. The call itself (and the buffers it
//! owns) lives in the communicator's task; the `Work` only waits for its outcome, so
//! dropping it changes nothing about when the buffers are released.
//!
//! `Work.add_done_callback(fn)` lets the task that finishes the call run `fn` itself
//! (with the GIL), as gloo's `AsyncWork::execute` completes its own future: the torch
//! backend completes torch's future that way, with no thread of its own in between.

use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::errors::{invalid, to_py};
use crate::results::{PyOpInfo, PySyncInfo, PyWorldUpdate};

/// What a finished call produced.
#[derive(Clone)]
pub(crate) enum Done {
    World(eccl::WorldUpdate),
    Pending(bool),
    /// A yes-or-no result (the shared-memory collectives: whether they read the other
    /// ranks' memory directly).
    Flag(bool),
    Op(eccl::OpInfo),
    Sync(eccl::SyncInfo),
    Topology(eccl::TopologyUpdate),
    Left,
}

pub(crate) type Outcome = eccl::Result<Done>;

thread_local! {
    /// Set while this thread runs done-callbacks: a callback that waited on an
    /// unfinished call could be waiting on the very task that runs it.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// The outcome once there is one, and the callbacks that wait for it (with whether
/// they run for errors only).
#[derive(Default)]
struct Slot {
    outcome: Option<Outcome>,
    callbacks: Vec<(Py<PyAny>, bool)>,
}

/// Where a native call leaves its outcome.
#[derive(Default)]
pub(crate) struct Completion {
    slot: Mutex<Slot>,
    cv: Condvar,
    /// Set once the outcome is in `slot`: what a waiter spins on before it sleeps.
    ready: std::sync::atomic::AtomicBool,
}

impl Completion {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_if_empty(&self, o: Outcome) {
        let callbacks = {
            let mut slot = self.lock();
            if slot.outcome.is_some() {
                return;
            }
            slot.outcome = Some(o);
            self.ready.store(true, std::sync::atomic::Ordering::Release);
            self.cv.notify_all();
            let failed = matches!(slot.outcome, Some(Err(_)));
            let mut callbacks = std::mem::take(&mut slot.callbacks);
            // A call that succeeded takes no GIL for callbacks that wait for errors.
            callbacks.retain(|(_, errors_only)| failed || !errors_only);
            callbacks
        };
        // The lock is released first: Python may ask `is_completed()` (taking the lock
        // with the GIL held) while this thread waits for the GIL.
        if !callbacks.is_empty() {
            run_callbacks(callbacks);
        }
    }

    fn get(&self) -> Option<Outcome> {
        self.lock().outcome.clone()
    }

    /// Waits for the outcome, at most `timeout`.
    fn wait(&self, timeout: Option<Duration>) -> Option<Outcome> {
        let deadline = timeout.map(|t| Instant::now() + t);
        // A short call ends within microseconds on the runtime's threads: spinning,
        // with the core offered to them, saves the wake-up (see `spin_until`).
        if timeout.is_none_or(|t| !t.is_zero()) {
            eccl::spin_until(
                || self.ready.load(std::sync::atomic::Ordering::Acquire),
                true,
            );
        }
        let mut slot = self.lock();
        loop {
            if let Some(o) = slot.outcome.as_ref() {
                return Some(o.clone());
            }
            slot = match deadline {
                None => self.cv.wait(slot).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    self.cv
                        .wait_timeout(slot, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}

type Callbacks = Vec<(Py<PyAny>, bool)>;

/// The process's callback threads: a queue of finished calls' callbacks, run in the
/// order the calls finished by one thread at a time, and a second thread standing by.
/// The standby takes the next callbacks only once they have waited [`STALLED`] behind a
/// callback that is still running: a callback that waits for another eccl-backed future
/// (torch's PowerSGD hook waits for an all_reduce's future inside its `then` callback)
/// would otherwise wait for callbacks queued behind itself, for good. Whoever takes
/// callbacks while every thread is busy starts another standby (up to
/// [`MAX_CALLBACK_THREADS`]); threads beyond two end after [`IDLE_END`] without work.
struct Callers {
    /// The process that started them (a forked child starts its own).
    pid: u32,
    queue: std::collections::VecDeque<(Instant, Callbacks)>,
    threads: usize,
    busy: usize,
    /// Set at interpreter exit ([`close_callbacks`]): what is queued still runs, nothing
    /// more is taken.
    closed: bool,
}

static CALLERS: Mutex<Option<Callers>> = Mutex::new(None);
static CALLERS_CV: Condvar = Condvar::new();

/// How long callbacks wait behind a running one before the standby thread runs them.
const STALLED: Duration = Duration::from_millis(5);
const MAX_CALLBACK_THREADS: usize = 64;
const IDLE_END: Duration = Duration::from_secs(5);

/// How long interpreter exit waits for callbacks already handed over to run.
const CALLBACKS_AT_EXIT: Duration = Duration::from_secs(10);

fn callers() -> std::sync::MutexGuard<'static, Option<Callers>> {
    CALLERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts one more callback thread; false if the system would not.
fn start_caller(c: &mut Callers) -> bool {
    let ok = std::thread::Builder::new()
        .name("eccl-callbacks".into())
        .spawn(caller)
        .is_ok();
    if ok {
        c.threads += 1;
    }
    ok
}

/// A callback thread's loop (see [`Callers`]).
fn caller() {
    let mut g = callers();
    let mut idle_since = Instant::now();
    loop {
        let Some(c) = g.as_mut() else { return };
        if c.pid != std::process::id() {
            return;
        }
        let take = c
            .queue
            .front()
            .map(|(at, _)| c.busy == 0 || at.elapsed() >= STALLED);
        match take {
            Some(true) => {
                let (_, cbs) = c.queue.pop_front().expect("a front");
                c.busy += 1;
                if c.busy == c.threads && c.threads < MAX_CALLBACK_THREADS && !c.closed {
                    // Keep one thread standing by while this one runs.
                    start_caller(c);
                }
                drop(g);
                call_now(cbs);
                g = callers();
                if let Some(c) = g.as_mut() {
                    c.busy -= 1;
                    if c.closed {
                        CALLERS_CV.notify_all(); // close_callbacks waits for the queue
                    }
                }
                idle_since = Instant::now();
            }
            Some(false) => {
                // Callbacks wait behind a running one: look again when they would stall.
                let left =
                    STALLED.saturating_sub(c.queue.front().map_or(STALLED, |(at, _)| at.elapsed()));
                g = CALLERS_CV
                    .wait_timeout(g, left.max(Duration::from_micros(100)))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            None => {
                if c.closed || (c.threads > 2 && idle_since.elapsed() >= IDLE_END) {
                    c.threads -= 1;
                    CALLERS_CV.notify_all();
                    return;
                }
                g = CALLERS_CV
                    .wait_timeout(g, IDLE_END)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
    }
}

/// Hands a finished call's callbacks to the process's callback threads (see
/// [`Callers`]). Never on the communicator's task: a callback waits for the GIL and may
/// run for a while (torch's future chains), and a runtime worker held there stops timers
/// and I/O for every task of the process (four DDP ranks on two cores lost their leases
/// so: the heartbeat's timer did not fire for a second). Once the interpreter is exiting
/// ([`close_callbacks`] ran) callbacks are dropped unrun: a thread that takes the GIL
/// while the interpreter finalizes is ended under it, and the process aborts
/// ("PyGILState_Release: thread state must be current").
fn run_callbacks(callbacks: Callbacks) {
    let pid = std::process::id();
    let mut g = callers();
    if g.as_ref().is_none_or(|c| c.pid != pid) {
        // (Again in a forked child: the parent's threads are not there.)
        *g = Some(Callers {
            pid,
            queue: Default::default(),
            threads: 0,
            busy: 0,
            closed: false,
        });
    }
    let c = g.as_mut().expect("made above");
    if c.closed {
        return;
    }
    if c.threads == 0 && !start_caller(c) {
        drop(g);
        call_now(callbacks);
        return;
    }
    c.queue.push_back((Instant::now(), callbacks));
    drop(g);
    // One waiting thread: the one that runs callbacks, or the standby while it is busy.
    CALLERS_CV.notify_one();
}

/// At interpreter exit (from `_shutdown`, before the interpreter finalizes): closes the
/// callback threads' queue and waits, with the GIL released, for the callbacks already
/// handed over to run (at most [`CALLBACKS_AT_EXIT`]); later ones are dropped unrun.
pub(crate) fn close_callbacks(py: Python<'_>) {
    let pid = std::process::id();
    {
        let mut g = callers();
        match g.as_mut() {
            Some(c) if c.pid == pid => c.closed = true,
            _ => {
                *g = Some(Callers {
                    pid,
                    queue: Default::default(),
                    threads: 0,
                    busy: 0,
                    closed: true,
                });
                return;
            }
        }
    }
    CALLERS_CV.notify_all();
    py.detach(|| {
        let deadline = Instant::now() + CALLBACKS_AT_EXIT;
        let mut g = callers();
        while g
            .as_ref()
            .is_some_and(|c| c.threads > 0 && (c.busy > 0 || !c.queue.is_empty()))
            && Instant::now() < deadline
        {
            g = CALLERS_CV
                .wait_timeout(g, Duration::from_millis(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    });
}

/// Runs callbacks with the GIL on this thread. An interpreter that is shutting down runs
/// none: nothing is left to tell. A callback's exception is reported as unraisable, like
/// one raised in a `weakref` callback.
fn call_now(callbacks: Callbacks) {
    let _ = Python::try_attach(|py| {
        let was = IN_CALLBACK.with(|c| c.replace(true));
        for (cb, _) in callbacks {
            if let Err(e) = cb.call0(py) {
                e.write_unraisable(py, Some(cb.bind(py)));
            }
        }
        IN_CALLBACK.with(|c| c.set(was));
    });
}

/// The call's side of a [`Completion`]. Dropped without completing (the communicator's
/// task was stopped), it completes with `Aborted`, so no `Work` waits forever.
pub(crate) struct Completer(Arc<Completion>);

impl Completer {
    pub fn new() -> (Completer, Arc<Completion>) {
        let c = Arc::new(Completion::default());
        (Completer(c.clone()), c)
    }

    pub fn complete(self, outcome: Outcome) {
        self.0.set_if_empty(outcome);
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        self.0.set_if_empty(Err(eccl::Error::Aborted {
            epoch: 0,
            cause: "the communicator was shut down".into(),
        }));
    }
}

/// A call in flight. `wait()` returns its result or raises its error.
#[pyclass(module = "eccl", frozen)]
pub(crate) struct Work {
    done: Arc<Completion>,
}

impl Work {
    pub fn new(done: Arc<Completion>) -> Work {
        Work { done }
    }

    /// Waits with the GIL released and converts the outcome.
    pub fn finish(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let t = timeout.map(|s| Duration::from_secs_f64(s.max(0.0)));
        if let Some(o) = self.done.get() {
            return outcome_to_py(py, o);
        }
        if IN_CALLBACK.with(|c| c.get()) {
            return Err(invalid(
                "a done-callback cannot wait for an unfinished eccl call: it runs on the \
                 task that finishes calls, so it would wait on itself (wait elsewhere, or \
                 add another callback)",
            ));
        }
        let done = self.done.clone();
        match py.detach(move || done.wait(t)) {
            Some(o) => outcome_to_py(py, o),
            None => Err(to_py(&eccl::Error::Timeout {
                what: "waiting for the call (it goes on)".into(),
                ms: t.map_or(0, |t| t.as_millis() as u64),
            })),
        }
    }
}

fn outcome_to_py(py: Python<'_>, o: Outcome) -> PyResult<Py<PyAny>> {
    match o.map_err(|e| to_py(&e))? {
        Done::World(w) => PyWorldUpdate(w).into_py_any(py),
        Done::Pending(p) | Done::Flag(p) => p.into_py_any(py),
        Done::Op(o) => PyOpInfo(o).into_py_any(py),
        Done::Sync(s) => PySyncInfo(s).into_py_any(py),
        Done::Topology(t) => {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("epoch", t.epoch)?;
            d.set_item("ring", t.ring)?;
            let links = pyo3::types::PyList::empty(py);
            for (rank, m) in t.links {
                let l = pyo3::types::PyDict::new(py);
                l.set_item("rank", rank.0)?;
                l.set_item("bytes_per_s", m.bytes_per_s)?;
                l.set_item("latency_us", m.latency_ns as f64 / 1e3)?;
                links.append(l)?;
            }
            d.set_item("links", links)?;
            let algorithms = pyo3::types::PyList::empty(py);
            for t in t.tuned {
                let a = pyo3::types::PyDict::new(py);
                a.set_item("collective", t.kind.name())?;
                // The kind's last entry takes every larger call: None, no bound.
                a.set_item("up_to_bytes", (t.up_to != u64::MAX).then_some(t.up_to))?;
                a.set_item("algo", t.algo.name())?;
                algorithms.append(a)?;
            }
            d.set_item("algorithms", algorithms)?;
            d.into_py_any(py)
        }
        Done::Left => Ok(py.None()),
    }
}

#[pymethods]
impl Work {
    /// Whether the call has finished, successfully or not.
    fn is_completed(&self) -> bool {
        self.done.get().is_some()
    }

    /// Waits for the call (the GIL is released meanwhile) and returns its result, or
    /// raises its error. With `timeout` (seconds), raises `eccl.EcclTimeoutError` (a `TimeoutError`) if it passes
    /// first; the call goes on.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        self.finish(py, timeout)
    }

    /// Calls `fn()` once the call has finished, successfully or not (with
    /// `errors_only=True`: only if it failed): here and now if it has, otherwise on eccl's
    /// callback thread, with the GIL, after the outcome is set (so `wait()` there returns
    /// at once), in the order calls finish. `fn` should be short, and it cannot wait for
    /// an unfinished call (that raises `InvalidArgumentError`). Its exceptions are
    /// reported as unraisable.
    #[pyo3(signature = (r#fn, *, errors_only=false))]
    fn add_done_callback(
        &self,
        py: Python<'_>,
        r#fn: Py<PyAny>,
        errors_only: bool,
    ) -> PyResult<()> {
        let failed = {
            let mut slot = self.done.lock();
            match &slot.outcome {
                None => {
                    slot.callbacks.push((r#fn, errors_only));
                    return Ok(());
                }
                Some(o) => o.is_err(),
            }
        };
        if failed || !errors_only {
            r#fn.call0(py)?;
        }
        Ok(())
    }

    /// The error the call ended with, `None` if it succeeded or is still running.
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match self.done.get() {
            Some(Err(e)) => Some(to_py(&e).into_value(py).into_any()),
            _ => None,
        }
    }

    fn __repr__(&self) -> &'static str {
        match self.done.get() {
            None => "<eccl.Work running>",
            Some(Ok(_)) => "<eccl.Work done>",
            Some(Err(_)) => "<eccl.Work failed>",
        }
    }
}
