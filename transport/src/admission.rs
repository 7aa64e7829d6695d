//! How many connections may be authenticating at once, and what happens past that.
//!
//! A stranger that connects and says nothing holds a handshake slot until the handshake
//! timeout. A fixed cap that refuses newcomers would let a flood of such connections
//! lock every real peer out for as long as the flood lasts; so when the cap is reached,
//! the *oldest* handshake in progress is cancelled to make room. A real peer finishes
//! its handshake within milliseconds of connecting, long before the flood can push it
//! out, and a peer that is pushed out anyway retries.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::task::AbortHandle;

/// Connections that may be authenticating at once on one listener set (a master's
/// client port, a peer's link listeners).
pub const MAX_PENDING: usize = 64;

pub struct Admission {
    cap: usize,
    pending: Mutex<VecDeque<(u64, AbortHandle)>>,
    next: AtomicU64,
    /// Handshakes cancelled to make room, for logs and tests.
    pub displaced: AtomicU64,
}

impl Admission {
    pub fn new(cap: usize) -> Arc<Admission> {
        Arc::new(Admission {
            cap: cap.max(1),
            pending: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
            displaced: AtomicU64::new(0),
        })
    }

    /// Runs `handshake` for a new connection in a task of its own, counted against the
    /// cap until it returns; then, if it produced something, `serve` with it (no longer
    /// counted). At the cap, the oldest handshake in progress is cancelled first.
    pub fn admit<T, H, S, SF>(self: &Arc<Self>, handshake: H, serve: S)
    where
        T: Send + 'static,
        H: Future<Output = Option<T>> + Send + 'static,
        S: FnOnce(T) -> SF + Send + 'static,
        SF: Future<Output = ()> + Send + 'static,
    {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        while pending.len() >= self.cap {
            if let Some((_, oldest)) = pending.pop_front() {
                oldest.abort();
                self.displaced.fetch_add(1, Ordering::Relaxed);
            }
        }
        // The lock is held until the task is listed, so its own removal (which takes the
        // lock) can only come after.
        let task = tokio::spawn(async move {
            let got = handshake.await;
            me.done(id);
            if let Some(t) = got {
                serve(t).await;
            }
        });
        pending.push_back((id, task.abort_handle()));
    }

    fn done(&self, id: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|(i, _)| *i != id);
    }

    /// Handshakes in progress now.
    pub fn in_progress(&self) -> usize {
        self.pending.lock().map(|p| p.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn the_oldest_handshake_makes_room_and_finished_ones_are_not_counted() {
        let a = Admission::new(3);
        let served = Arc::new(AtomicU64::new(0));
        // Three handshakes that never finish fill the cap.
        for _ in 0..3 {
            a.admit(std::future::pending::<Option<()>>(), |_| async {});
        }
        assert_eq!(a.in_progress(), 3);
        // A quick one displaces the oldest stall and is served.
        let s = served.clone();
        a.admit(async { Some(()) }, move |_| async move {
            s.fetch_add(1, Ordering::SeqCst);
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(served.load(Ordering::SeqCst), 1);
        assert_eq!(a.displaced.load(Ordering::SeqCst), 1);
        assert_eq!(a.in_progress(), 2);
    }
}
