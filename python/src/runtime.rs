//! The tokio runtime that every communicator and embedded master of this process runs
//! on, and the stop at interpreter exit.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::prelude::*;
use tokio::sync::Notify;

/// The runtime of this process. A child made by `fork()` (multiprocessing's default on
/// Linux) inherits the parent's runtime without its threads, so it gets one of its own.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
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

/// A live communicator's task: the pid that started it (a forked child must leave its
/// parent's alone), its handle, and the signal that asks it to stop.
type Tasks = Mutex<Vec<(u32, tokio::task::JoinHandle<()>, Arc<Notify>)>>;

/// How long interpreter exit lets communicators close their links in order (so that
/// what a QUIC send handed over is delivered) before it stops them outright.
const ORDERLY_EXIT: Duration = Duration::from_secs(3);

fn live_tasks() -> &'static Tasks {
    static TASKS: OnceLock<Tasks> = OnceLock::new();
    TASKS.get_or_init(Default::default)
}

/// Remembers a communicator's task so that [`_shutdown`] can stop it.
pub(crate) fn track(task: tokio::task::JoinHandle<()>, stop: Arc<Notify>) {
    if let Ok(mut t) = live_tasks().lock() {
        t.retain(|(_, h, _)| !h.is_finished());
        t.push((std::process::id(), task, stop));
    }
}

/// Stops every communicator of this process (the package registers this with
/// `atexit`): calls in flight end where they are and their Works report `AbortedError`;
/// each communicator then closes its links in order, for at most [`ORDERLY_EXIT`], after
/// which the ones still closing are cancelled. Returns only once every task has
/// stopped, so that nothing writes into memory the interpreter frees after this. A
/// cancelled task stops at its next await, which is never far: the library does no
/// blocking work between awaits beyond one frame's copy or reduce. Then the done-callbacks
/// already handed over run, and later ones are dropped ([`crate::work::close_callbacks`]).
#[pyfunction]
pub(crate) fn _shutdown(py: Python<'_>) {
    let pid = std::process::id();
    let tasks: Vec<_> = live_tasks()
        .lock()
        .map(|mut t| {
            t.drain(..)
                .filter(|(p, _, _)| *p == pid)
                .map(|(_, h, stop)| {
                    stop.notify_one();
                    h
                })
                .collect()
        })
        .unwrap_or_default();
    if tasks.is_empty() {
        // Nothing ran here: do not start a runtime just to stop nothing.
        crate::work::close_callbacks(py);
        return;
    }
    py.detach(|| {
        runtime().block_on(async {
            let deadline = tokio::time::Instant::now() + ORDERLY_EXIT;
            for mut t in tasks {
                if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                    t.abort();
                    // Cancelled or finished, the task's future (and every buffer it
                    // owned) has been dropped when this returns.
                    let _ = t.await;
                }
            }
        })
    });
    // Stopped calls completed their Works with errors: their callbacks run now, while
    // the interpreter can still run them.
    crate::work::close_callbacks(py);
}
