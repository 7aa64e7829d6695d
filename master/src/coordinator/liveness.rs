//! Liveness on the leader: heartbeats and leases, fault reports, removing peers (on
//! leaving, a closed connection, a lapsed lease), and what changes hands in a fail-over
//! (a peer attaching to the new leader, a leader stepping down, the fresh leases a new
//! leader grants).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eccl_protocol::{ErrorCode, MasterEvent, MasterReply, PeerId};
use tokio::task::JoinHandle;

use super::{Coordinator, Outbox, Outgoing, State};
use crate::raft::ProposeError;
use crate::registry::PeerState;
use crate::registry::{Command, Outcome};

/// What a new leader adds to every peer's first lease: the time a peer needs to notice
/// that its leader is gone (an asked heartbeat left unanswered for half a lease, asked
/// at most every half lease: up to a lease) and to find the new one.
pub const TAKEOVER_GRACE: Duration = Duration::from_secs(2);

/// The leader's leases on peers (and on store sessions).
#[derive(Clone, Debug)]
pub struct Timing {
    /// A peer whose lease lapses is evicted.
    pub lease: Duration,
    /// How often peers should renew it.
    pub heartbeat: Duration,
    /// The shortest lease a store session gets ([`STORE_LEASE_FLOOR`] unless a test
    /// says otherwise).
    pub store_lease_floor: Duration,
}

/// The shortest lease a store session gets. A client that dies ends its session at
/// once (its connection drops): the lease only catches a client that hangs or is cut
/// off, and a torchrun agent stopped for a second (a loaded host, a debugger) must not
/// lose its rendezvous for good (torch's own c10d rendezvous rides out 15 s).
pub const STORE_LEASE_FLOOR: Duration = Duration::from_secs(10);

impl Timing {
    /// Peers' leases of `lease`, renewed every `heartbeat`; store sessions' of
    /// [`Timing::store_lease`].
    pub fn new(lease: Duration, heartbeat: Duration) -> Timing {
        Timing {
            lease,
            heartbeat,
            store_lease_floor: STORE_LEASE_FLOOR,
        }
    }

    /// A store session's lease: the peers' lease, or the floor where that is longer.
    pub fn store_lease(&self) -> Duration {
        self.lease.max(self.store_lease_floor)
    }

    /// How long an authenticated connection may say nothing before the master closes
    /// it. Every real client speaks far more often (peers heartbeat every lease / 4,
    /// store clients keep their session alive every second at most, the CLI asks once
    /// and leaves), so only a connection that holds a slot for nothing is closed:
    /// without this, a job member could keep any number of them open.
    pub fn idle_timeout(&self) -> Duration {
        (self.lease * 10).max(Duration::from_secs(2))
    }

    /// The same for a connection that holds a store session: longer than the session's
    /// lease, so that a client stopped for less keeps its session (closing the
    /// connection would end it).
    pub fn store_idle_timeout(&self) -> Duration {
        self.idle_timeout()
            .max(self.store_lease() + Duration::from_secs(2))
    }
}

impl Default for Timing {
    fn default() -> Self {
        Timing::new(Duration::from_millis(800), Duration::from_millis(200))
    }
}

impl Coordinator {
    /// Takes a peer back after a fail-over: its connection to the old leader is gone and
    /// it shows the credential it was given at registration. A leader that has just
    /// taken over answers only once it has applied everything its predecessors
    /// committed ([`Coordinator::caught_up`]), so it knows every peer they registered.
    pub async fn attach(
        &self,
        peer: PeerId,
        token: &[u8; 32],
        conn: Outbox,
    ) -> Result<(), MasterReply> {
        if !self.caught_up().await {
            return Err(self.not_leader());
        }
        let rec = self
            .raft
            .read(|r| r.peer(peer).map(|p| (p.state.clone(), p.token)));
        match rec {
            // blake3's Hash compares in constant time.
            Some((state, t)) if blake3::Hash::from(t) == blake3::Hash::from(*token) => {
                match state {
                    PeerState::Gone { reason } => Err(MasterReply::Error {
                        code: ErrorCode::Evicted,
                        message: reason,
                    }),
                    _ => {
                        let mut st = self.state.lock().await;
                        st.conns.insert(peer, conn);
                        self.touch(peer);
                        tracing::info!(target: "eccl::master", "peer {peer} attached");
                        Ok(())
                    }
                }
            }
            _ => Err(MasterReply::Error {
                code: ErrorCode::UnknownPeer,
                message: format!("peer {peer} is not registered with this credential"),
            }),
        }
    }

    /// This master stopped leading: every round it held is answered with a redirect (the
    /// peers send their part again to the next leader) and it forgets connections and
    /// leases, which the next leader keeps.
    async fn step_down(&self) {
        let redirect = self.not_leader();
        let redirect = || redirect.clone();
        let mut st = self.state.lock().await;
        for (_, v) in st.votes.drain() {
            v.reply.send(redirect());
        }
        for (_, (q, _)) in st.queries.drain() {
            q.send(redirect());
        }
        for (_, s) in st.syncs.drain() {
            s.reply.send(redirect());
        }
        st.conns.clear();
        self.leases().clear();
        self.store_step_down();
        tracing::info!(target: "eccl::master", "no longer the leader ({redirect:?})", redirect = redirect());
    }

    /// Renews a live peer's lease (a removed peer has none to renew).
    pub fn heartbeat(&self, peer: PeerId) {
        if let Some(t) = self.leases().get_mut(&peer) {
            *t = Instant::now();
        }
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<PeerId, Instant>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts or renews `peer`'s lease now.
    pub(super) fn touch(&self, peer: PeerId) {
        self.leases().insert(peer, Instant::now());
    }

    pub(super) fn forget(&self, peer: PeerId) {
        self.leases().remove(&peer);
    }

    /// A member saw a fault. If the suspect has also stopped renewing its lease it is
    /// evicted now, without waiting for the lease to run out; otherwise the epoch is
    /// aborted on every member, so that nobody waits for the broken collective.
    pub async fn report_fault(
        self: &Arc<Self>,
        reporter: PeerId,
        epoch: u64,
        suspect: Option<PeerId>,
        reason: String,
    ) {
        let current = self.raft.read(|r| r.world_of(reporter).map(|w| w.epoch));
        if current != Some(epoch) {
            return;
        }
        let silent_for = suspect.and_then(|s| self.leases().get(&s).map(|t| (s, t.elapsed())));
        if let Some((s, quiet)) = silent_for {
            if quiet > self.timing.lease / 2 {
                let why = format!(
                    "reported by peer {reporter} ({reason}) and silent for {} ms",
                    quiet.as_millis()
                );
                return self.remove(s, &why, false).await;
            }
        }
        let mut st = self.state.lock().await;
        if !st.reported.insert(epoch) {
            return;
        }
        tracing::info!(target: "eccl::master", "epoch {epoch} aborted: peer {reporter} reports {reason}");
        let ev = MasterEvent::AbortEpoch {
            epoch,
            cause: format!("peer {reporter} reports: {reason}"),
            evicted: None,
        };
        for m in self.raft.read(|r| r.live_members_of(epoch)) {
            if let Some(c) = st.conns.get(&m) {
                let _ = c.try_send(super::Outgoing::event(ev.clone()));
            }
        }
    }

    /// Evicts peers whose lease ran out. Only the leader holds leases; a master that
    /// becomes leader first grants every peer a fresh lease.
    pub fn spawn_lease_checker(self: &Arc<Self>) -> JoinHandle<()> {
        let me = Arc::downgrade(self);
        let period = (self.timing.heartbeat / 2)
            .clamp(Duration::from_millis(10), Duration::from_millis(100));
        tokio::spawn(async move {
            let mut was_leader = false;
            let mut last_tick = Instant::now();
            loop {
                tokio::time::sleep(period).await;
                let Some(c) = me.upgrade() else { return };
                let stalled = last_tick.elapsed();
                last_tick = Instant::now();
                if was_leader && stalled > c.timing.lease / 2 {
                    // This master did not run for a while (SIGSTOP, a swapped-out
                    // process, a frozen VM): its peers' silence is its own. Every lease
                    // starts again rather than running out for the master's pause; if
                    // it was deposed meanwhile, the next tick sees it.
                    tracing::warn!(target: "eccl::master", "this master stalled for {} ms; every peer's and store session's lease starts again", stalled.as_millis());
                    for t in c.leases().values_mut() {
                        *t = Instant::now();
                    }
                    c.restart_session_leases();
                    continue;
                }
                if !c.raft.is_leader() {
                    if was_leader {
                        c.step_down().await;
                    }
                    was_leader = false;
                    continue;
                }
                let fresh_from = (!was_leader).then(|| Instant::now() + TAKEOVER_GRACE);
                let expired: Vec<(PeerId, Duration)> = {
                    let mut leases = c.leases();
                    if !was_leader {
                        // A new leader gives every peer the registry knows a fresh lease,
                        // starting after TAKEOVER_GRACE: nobody is evicted for the election
                        // gap or while finding this leader, and a peer that never comes
                        // back is evicted one lease after the grace. Peers that already
                        // spoke to this leader (registered with it: leases are cleared on
                        // stepping down) keep the lease they have; they need no grace, and
                        // a peer that hangs right after a master's start is evicted on time.
                        let from = Instant::now() + TAKEOVER_GRACE;
                        let live = c.raft.read(|r| r.live_peers());
                        tracing::info!(target: "eccl::master", "leading now; {} peers get a fresh lease", live.len());
                        *leases = live
                            .into_iter()
                            .map(|p| (p, leases.get(&p).copied().unwrap_or(from)))
                            .collect();
                        was_leader = true;
                    }
                    leases
                        .iter()
                        .map(|(p, t)| (*p, t.elapsed()))
                        .filter(|(_, age)| *age > c.timing.lease)
                        .collect()
                };
                for (p, age) in expired {
                    let why = format!("lease expired (no heartbeat for {} ms)", age.as_millis());
                    tracing::warn!(target: "eccl::master", "peer {p}: {why}");
                    c.remove(p, &why, false).await;
                }
                for s in c.expired_sessions(fresh_from) {
                    tracing::warn!(target: "eccl::master", "store session {s}: lease expired");
                    c.close_session(s, "lease expired").await;
                }
            }
        })
    }
}

/// Removing peers: on leaving, on a closed connection, on a lapsed lease.
impl Coordinator {
    /// Removes a peer for good (it left, its connection closed, its lease lapsed). If it
    /// was a member, the epoch is aborted on every other member.
    pub async fn remove(&self, peer: PeerId, reason: &str, leave: bool) {
        let term = self.raft.term();
        let st = self.state.lock().await;
        self.remove_locked(st, peer, reason, leave, term).await
    }

    /// A peer's connection to this master closed. The peer is evicted only if that was
    /// its current connection here: one it replaced (it attached again on a new one), or
    /// one from before this master last stepped down, says nothing of whether the peer
    /// lives. (A master hung while leading, then leading again, read the close of its
    /// peers' connections from before its hang and evicted them all, though they were
    /// attached on new ones: `eccl-chaos --masters 3 --seed 19261`.)
    pub async fn connection_closed(&self, peer: PeerId, conn: &Outbox) {
        let term = self.raft.term();
        let st = self.state.lock().await;
        if !st.conns.get(&peer).is_some_and(|c| c.same_channel(conn)) {
            tracing::debug!(target: "eccl::master", "a connection of peer {peer} that is not its current one closed");
            return;
        }
        self.remove_locked(st, peer, "lost its master connection", false, term)
            .await
    }

    async fn remove_locked(
        &self,
        mut st: tokio::sync::MutexGuard<'_, State>,
        peer: PeerId,
        reason: &str,
        leave: bool,
        decided_in: u64,
    ) {
        // An eviction decided in an earlier term is not this term's to make: the lock
        // can be held for seconds by a proposal that cannot commit (a leader resumed
        // after a SIGSTOP, deposed without knowing it yet), and by the time it is free
        // this master may lead again, with peers attached afresh whose old connection's
        // close or lapsed lease it had noticed before (seed 19261 of the three-master
        // chaos run: every member evicted so).
        if !leave && (self.raft.term() != decided_in || !self.raft.is_leader()) {
            tracing::info!(target: "eccl::master", "not removing peer {peer} ({reason}): decided in term {decided_in}, which is over");
            return;
        }
        if matches!(self.known(peer), Some(PeerState::Gone { .. }) | None) {
            st.conns.remove(&peer);
            self.forget(peer);
            return;
        }
        let cmd = if leave {
            Command::Leave { peer }
        } else {
            Command::Evict {
                peer,
                reason: reason.to_string(),
            }
        };
        match self.raft.propose(cmd).await {
            Ok(Outcome::Removed {
                was_member, epoch, ..
            }) => {
                tracing::info!(target: "eccl::master", "peer {peer} removed ({reason}); member of epoch {epoch}: {was_member}");
                if let Some(c) = st.conns.remove(&peer) {
                    if !leave {
                        let _ = c.try_send(Outgoing::event(MasterEvent::Evicted {
                            reason: reason.to_string(),
                        }));
                    }
                }
                self.forget(peer);
                st.queries.remove(&peer);
                if let Some(e) = st.syncs.remove(&peer) {
                    e.reply.send(MasterReply::Error {
                        code: ErrorCode::Evicted,
                        message: reason.to_string(),
                    });
                }
                if let Some(v) = st.votes.remove(&peer) {
                    v.reply.send(MasterReply::Error {
                        code: ErrorCode::Evicted,
                        message: reason.to_string(),
                    });
                }
                self.reconfigure_lost(&mut st, peer, reason);
                self.topology_lost(&mut st, peer, epoch, reason);
                // A member that leaves on purpose has finished its part of every collective
                // it returned from; the others learn of the new world at their next
                // update_topology(). An evicted member may be holding a collective up,
                // so its epoch is aborted everywhere at once.
                if was_member && !leave {
                    st.evicted.insert(epoch);
                    let ev = MasterEvent::AbortEpoch {
                        epoch,
                        cause: format!("peer {peer} {reason}"),
                        evicted: Some(peer),
                    };
                    // The members of its world; the job's other worlds go on.
                    for m in self.raft.read(|r| r.live_members_of(epoch)) {
                        if let Some(c) = st.conns.get(&m) {
                            let _ = c.try_send(Outgoing::event(ev.clone()));
                        }
                    }
                }
                self.try_commit(&mut st).await;
                self.try_sync(&mut st).await;
                self.answer_queries(&mut st);
            }
            Ok(other) => tracing::warn!(target: "eccl::master", "removing peer {peer}: {other:?}"),
            // The master is shutting down; nobody is left to tell.
            Err(ProposeError::Fatal(m)) if m.contains("stopped") => {
                tracing::debug!(target: "eccl::master", "removing peer {peer}: {m}")
            }
            Err(e) => tracing::warn!(target: "eccl::master", "removing peer {peer}: {e}"),
        }
    }
}
