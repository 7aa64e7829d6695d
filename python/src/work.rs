//! `eccl.Work`: the handle of a call in flight. The call itself (and the buffers it
//! owns) lives in the communicator's task; the `Work` only waits for its outcome, so
//! dropping it changes nothing about when the buffers are released.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::errors::to_py;
use crate::results::{PyOpInfo, PySyncInfo, PyWorldUpdate};

/// What a finished call produced.
#[derive(Clone)]
pub(crate) enum Done {
    World(eccl::WorldUpdate),
    Pending(bool),
    Op(eccl::OpInfo),
    Sync(eccl::SyncInfo),
    Left,
}

pub(crate) type Outcome = eccl::Result<Done>;

/// Where a native call leaves its outcome.
#[derive(Default)]
pub(crate) struct Completion {
    slot: Mutex<Option<Outcome>>,
    cv: Condvar,
}

impl Completion {
    fn set_if_empty(&self, o: Outcome) {
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(o);
        }
        self.cv.notify_all();
    }

    fn get(&self) -> Option<Outcome> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits for the outcome, at most `timeout`.
    fn wait(&self, timeout: Option<Duration>) -> Option<Outcome> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(o) = slot.as_ref() {
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
        Done::Pending(p) => p.into_py_any(py),
        Done::Op(o) => PyOpInfo(o).into_py_any(py),
        Done::Sync(s) => PySyncInfo(s).into_py_any(py),
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
