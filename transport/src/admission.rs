//! How many connections may be authenticating at once, and what happens past that.
//!
//! A stranger that connects and says nothing holds a handshake slot until the handshake
//! timeout. A fixed cap that refuses newcomers would let a flood of such connections
//! lock every real peer out for as long as the flood lasts; so when the cap is reached,
//! the *oldest* handshake in progress is cancelled to make room, once it has been going
//! on for [`GRACE`]. A real peer finishes its handshake within milliseconds of
//! connecting, long before the flood can push it out. Until the oldest is that old (a
//! storm of real peers connecting at once: hundreds starting a job), the newcomer is
//! closed before the master says anything, which its dialer takes for a master not
//! ready yet and retries after a pause, rather than cancelling a real peer's handshake
//! halfway, which its dialer could not tell from a refused secret
//! (`eccl-chaos load` found it: 3,000 peers registering 256 at a time).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::AbortHandle;

/// Connections that may be authenticating at once on one listener set (a master's
/// client port, a peer's link listeners).
pub const MAX_PENDING: usize = 64;
/// How long a handshake may go on before a newcomer may cancel it to take its place.
pub const GRACE: Duration = Duration::from_millis(250);

pub struct Admission {
    cap: usize,
    grace: Duration,
    pending: Mutex<VecDeque<(u64, AbortHandle, Instant)>>,
    next: AtomicU64,
    /// Handshakes cancelled to make room, for logs and tests.
    pub displaced: AtomicU64,
    /// Newcomers closed unheard because every handshake in progress was younger than
    /// the grace period.
    pub turned_away: AtomicU64,
}

impl Admission {
    pub fn new(cap: usize) -> Arc<Admission> {
        Admission::with_grace(cap, GRACE)
    }

    pub fn with_grace(cap: usize, grace: Duration) -> Arc<Admission> {
        Arc::new(Admission {
            cap: cap.max(1),
            grace,
            pending: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
            displaced: AtomicU64::new(0),
            turned_away: AtomicU64::new(0),
        })
    }

    /// Runs `handshake` for a new connection in a task of its own, counted against the
    /// cap until it returns; then, if it produced something, `serve` with it (no longer
    /// counted). At the cap, the oldest handshake in progress is cancelled first if it
    /// is older than the grace period; otherwise `handshake` is dropped unrun (with the
    /// connection it owns).
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
            if pending
                .front()
                .is_some_and(|(_, _, since)| since.elapsed() < self.grace)
            {
                self.turned_away.fetch_add(1, Ordering::Relaxed);
                return;
            }
            if let Some((_, oldest, _)) = pending.pop_front() {
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
        pending.push_back((id, task.abort_handle(), Instant::now()));
    }

    fn done(&self, id: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|(i, _, _)| *i != id);
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
    async fn a_newcomer_is_turned_away_while_every_handshake_is_young() {
        let a = Admission::with_grace(2, Duration::from_secs(60));
        for _ in 0..2 {
            a.admit(std::future::pending::<Option<()>>(), |_| async {});
        }
        let ran = Arc::new(AtomicU64::new(0));
        let r = ran.clone();
        a.admit(
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Some(())
            },
            |_| async {},
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 0, "never started");
        assert_eq!(a.turned_away.load(Ordering::SeqCst), 1);
        assert_eq!(
            (a.displaced.load(Ordering::SeqCst), a.in_progress()),
            (0, 2)
        );
    }

    #[tokio::test]
    async fn the_oldest_handshake_makes_room_and_finished_ones_are_not_counted() {
        let a = Admission::with_grace(3, Duration::ZERO);
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
