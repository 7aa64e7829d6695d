//! The tokio runtime that every communicator and embedded master of this process runs
//! on, and the stop at interpreter exit.

use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;

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

/// Each live communicator's task, with the pid that started it (a forked child must
/// leave its parent's alone).
type Tasks = Mutex<Vec<(u32, tokio::task::JoinHandle<()>)>>;

fn live_tasks() -> &'static Tasks {
    static TASKS: OnceLock<Tasks> = OnceLock::new();
    TASKS.get_or_init(Default::default)
}

/// Remembers a communicator's task so that [`_shutdown`] can stop it.
pub(crate) fn track(task: tokio::task::JoinHandle<()>) {
    if let Ok(mut t) = live_tasks().lock() {
        t.retain(|(_, h)| !h.is_finished());
        t.push((std::process::id(), task));
    }
}

/// Stops every communicator of this process (the package registers this with
/// `atexit`): calls in flight end where they are and their Works report `AbortedError`.
/// Returns only once every task has stopped, so that nothing writes into memory the
/// interpreter frees after this. A task stops at its next await, which is never far:
/// the library does no blocking work between awaits beyond one frame's copy or reduce.
#[pyfunction]
pub(crate) fn _shutdown(py: Python<'_>) {
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
            for t in &tasks {
                t.abort();
            }
            for t in tasks {
                // Cancelled or finished, the task's future (and every buffer it owned)
                // has been dropped when this returns.
                let _ = t.await;
            }
        })
    });
}
