//! The peer's connection to the masters: requests with ids, answered in any order, and
//! events the leader pushes (abort an epoch, you were evicted).
//!
//! A peer knows a list of masters (`ECCL_MASTER=a:48148,b:48148,c:48148`). It talks to
//! the raft leader: a follower answers `NotLeader` with the leader's client address, and
//! the client goes there. When the connection is lost, or the master stops answering
//! heartbeats (a hung leader), the client drops it and looks for the next leader across
//! the list with a bounded backoff, re-attaches as the same peer (with the credential
//! the master gave at registration) and sends the request again. Requests are safe to
//! send again: a vote, a sync report or a query is answered by whichever leader holds
//! the round, and a leader that committed the world before it died has it in the log the
//! next one serves. After `deadline` without a leader a request fails with
//! `MasterUnavailable`, never hangs.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::{
    ErrorCode, MasterEvent, MasterMessage, MasterReply, PeerId, PeerRequest, Request,
};
use eccl_transport::control::{self, ControlTx};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::error::{Error, Result};

type Pending = Arc<Mutex<Option<HashMap<u64, oneshot::Sender<MasterReply>>>>>;

/// Longest pause between two rounds over the master list.
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// Hang-ups after our proof tolerated before the secret is taken to differ: with the
/// backoff between them, a wrong secret is reported within about 1.3 s, and a peer
/// pushed out of a master's handshake queue by hundreds of others connecting at once
/// gets back in (`eccl-chaos load` registered 175 of 200 peers at once before this).
const MAX_HANG_UPS: u32 = 6;

/// One authenticated connection to one master.
struct Conn {
    addr: String,
    tx: tokio::sync::Mutex<ControlTx>,
    pending: Pending,
    reader: tokio::task::JoinHandle<()>,
    /// Counts connections, so that a request that saw this one fail drops only it.
    serial: u64,
}

impl Conn {
    /// Its reader still runs: the master has not closed it, nor has it failed.
    fn live(&self) -> bool {
        !self.reader.is_finished()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.reader.abort();
        // Dropping the senders fails every request still waiting on this connection.
        if let Ok(mut m) = self.pending.lock() {
            *m = None;
        }
    }
}

/// Why one attempt on one connection did not produce an answer.
enum Attempt {
    /// The connection is gone (or was dropped as hung): try the next leader.
    Lost(String),
    /// No answer within the caller's timeout.
    Timeout,
}

pub(crate) struct MasterClient {
    /// The masters as the user listed them.
    addrs: Vec<String>,
    /// The list as one string, for errors.
    list: String,
    secret: Secret,
    /// How long to look for a leader before a call fails with `MasterUnavailable`.
    deadline: Duration,
    events: mpsc::UnboundedSender<MasterEvent>,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    /// The leader a follower named last.
    hint: Mutex<Option<String>>,
    /// Who this peer is, once registered, and its credential to attach again.
    me: Mutex<Option<(PeerId, [u8; 32])>>,
    /// The store session this client speaks for, and its credential.
    store_session: Mutex<Option<(u64, [u8; 32])>>,
    next_id: AtomicU64,
    serial: AtomicU64,
    /// This client's heartbeats that ran a quarter lease or more after their time (its
    /// runtime starved of CPU or blocked): `eccl-chaos load` tells with it a lease its
    /// own simulated peers let run out from one the master lost.
    late: AtomicU64,
}

impl MasterClient {
    /// Connects to a master of `list` (comma-separated client addresses), retrying until
    /// `deadline` has passed (the masters may still be starting). Events go to `events`.
    pub async fn connect(
        list: &str,
        secret: &Secret,
        deadline: Duration,
        events: mpsc::UnboundedSender<MasterEvent>,
    ) -> Result<MasterClient> {
        let addrs = parse_list(list)?;
        let c = MasterClient {
            addrs,
            list: list.to_string(),
            secret: secret.clone(),
            deadline,
            events,
            conn: tokio::sync::Mutex::new(None),
            hint: Mutex::new(None),
            me: Mutex::new(None),
            store_session: Mutex::new(None),
            next_id: AtomicU64::new(1),
            serial: AtomicU64::new(0),
            late: AtomicU64::new(0),
        };
        c.current(Instant::now() + deadline).await?;
        Ok(c)
    }

    fn unavailable(&self, reason: impl ToString) -> Error {
        Error::MasterUnavailable {
            addr: self.list.clone(),
            reason: reason.to_string(),
        }
    }

    /// The next leader no longer knows this peer (it was evicted meanwhile): the
    /// communicator hears it as it would from the master itself.
    fn evicted(&self, reason: String) -> Error {
        let _ = self.events.send(MasterEvent::Evicted {
            reason: reason.clone(),
        });
        Error::Evicted { reason }
    }

    /// Registers this peer (`req`) and remembers who it is; returns its id, heartbeat
    /// period and lease (ms). `masters` names the master list in errors.
    pub async fn register(
        &self,
        req: eccl_protocol::RegisterRequest,
        masters: &str,
        timeout: Duration,
    ) -> Result<(PeerId, u64, u64)> {
        match self.request(PeerRequest::Register(req), timeout).await? {
            MasterReply::Registered {
                peer_id,
                heartbeat_ms,
                lease_ms,
                token,
            } => {
                self.registered(peer_id, token);
                Ok((peer_id, heartbeat_ms, lease_ms))
            }
            other => Err(reply_error(masters, 0, other)),
        }
    }

    /// Remembers who this peer is, so that a new connection attaches as it.
    pub fn registered(&self, peer: PeerId, token: [u8; 32]) {
        if let Ok(mut m) = self.me.lock() {
            *m = Some((peer, token));
        }
    }

    /// Remembers the store session this client opened, so that a new connection attaches
    /// to it.
    pub fn store_session(&self, session: u64, token: [u8; 32]) {
        if let Ok(mut m) = self.store_session.lock() {
            *m = Some((session, token));
        }
    }

    /// The connection in use, or a new one to the leader (found before `until`).
    async fn current(&self, until: Instant) -> Result<Arc<Conn>> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if c.live() {
                return Ok(c.clone());
            }
        }
        *slot = None;
        let c = Arc::new(self.find_leader(until).await?);
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Forgets connection `serial` (lost or hung), unless a newer one replaced it.
    async fn drop_conn(&self, serial: u64, why: &str) {
        let mut slot = self.conn.lock().await;
        if slot.as_ref().is_some_and(|c| c.serial == serial) {
            if let Some(c) = slot.take() {
                tracing::info!(target: "eccl::init", "leaving master {}: {why}", c.addr);
                // Requests still waiting on it (a vote sent to a leader that hung) hear
                // that it is lost now and go to the next leader, rather than wait out
                // their timeout on a connection nobody reads.
                c.reader.abort();
                if let Ok(mut m) = c.pending.lock() {
                    *m = None;
                }
            }
        }
    }

    /// Tries the named leader first, then every master in turn, with a growing pause
    /// between rounds, until one accepts this peer (a follower's redirect is followed
    /// at once).
    async fn find_leader(&self, until: Instant) -> Result<Conn> {
        let mut delay = Duration::from_millis(20);
        let mut last = String::from("no master tried");
        let mut hung_up = 0;
        loop {
            let hinted = self.hint.lock().ok().and_then(|mut h| h.take());
            let order: Vec<String> = hinted
                .into_iter()
                .chain(self.addrs.iter().cloned())
                .collect();
            for addr in order {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(self.unavailable(last));
                }
                match self.open(&addr, left).await {
                    Ok(c) => return Ok(c),
                    Err(Refused::Auth(e)) => return Err(self.unavailable(e)),
                    Err(Refused::HungUp(e)) => {
                        hung_up += 1;
                        if hung_up >= MAX_HANG_UPS {
                            return Err(self.unavailable(e));
                        }
                        last = e;
                    }
                    Err(Refused::Evicted(reason)) => return Err(self.evicted(reason)),
                    Err(Refused::Redirect(leader)) => {
                        last = format!("{addr} is not the raft leader");
                        if let Some(l) = leader.filter(|l| *l != addr) {
                            // Follow the redirect before anything else.
                            match self
                                .open(&l, until.saturating_duration_since(Instant::now()))
                                .await
                            {
                                Ok(c) => return Ok(c),
                                Err(Refused::Auth(e)) => return Err(self.unavailable(e)),
                                Err(Refused::HungUp(e)) => {
                                    hung_up += 1;
                                    last = e;
                                }
                                Err(Refused::Evicted(reason)) => return Err(self.evicted(reason)),
                                Err(Refused::Redirect(_)) => {
                                    last = format!("{l} is not the raft leader (yet)")
                                }
                                Err(Refused::Down(e)) => last = e,
                            }
                        }
                    }
                    Err(Refused::Down(e)) => last = e,
                }
            }
            if Instant::now() + delay >= until {
                return Err(self.unavailable(last));
            }
            // Jittered, so that peers turned away together do not come back together.
            tokio::time::sleep(delay.mul_f64(rand::random::<f64>() + 0.5)).await;
            delay = (delay * 2).min(MAX_BACKOFF);
        }
    }

    /// Connects to `addr`, and if this peer is registered, attaches as it; a follower
    /// says where the leader is.
    async fn open(&self, addr: &str, wait: Duration) -> std::result::Result<Conn, Refused> {
        // One master that does not answer (stopped, or on a host that is gone) must not
        // use up the whole deadline: the others are tried after a second.
        let dial = wait.clamp(Duration::from_millis(10), Duration::from_secs(1));
        let conn = match control::connect(addr, &self.secret, Role::PeerToMaster, dial).await {
            Ok(c) => c,
            Err(
                e @ eccl_transport::TransportError::Auth {
                    source: eccl_protocol::auth::AuthError::Rejected,
                    ..
                },
            ) => return Err(Refused::HungUp(e.to_string())),
            // A wrong secret will not get better by retrying.
            Err(e @ eccl_transport::TransportError::Auth { .. }) => {
                return Err(Refused::Auth(e.to_string()))
            }
            Err(e) => return Err(Refused::Down(format!("{addr}: {e}"))),
        };
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let mut rx = conn.rx;
        let p2 = pending.clone();
        let name = addr.to_string();
        let events = self.events.clone();
        let reader = tokio::spawn(async move {
            loop {
                match rx.recv::<MasterMessage>().await {
                    Ok(MasterMessage::Reply { id, body }) => {
                        let tx = p2
                            .lock()
                            .ok()
                            .and_then(|mut m| m.as_mut().and_then(|m| m.remove(&id)));
                        if let Some(tx) = tx {
                            let _ = tx.send(body);
                        }
                    }
                    Ok(MasterMessage::Event(ev)) => {
                        let _ = events.send(ev);
                    }
                    Err(e) => {
                        tracing::info!(target: "eccl::init", "lost master {name}: {e}");
                        if let Ok(mut m) = p2.lock() {
                            *m = None;
                        }
                        return;
                    }
                }
            }
        });
        let c = Conn {
            addr: addr.to_string(),
            tx: tokio::sync::Mutex::new(conn.tx),
            pending,
            reader,
            serial: self.serial.fetch_add(1, Ordering::Relaxed) + 1,
        };
        let me = self.me.lock().ok().and_then(|m| *m);
        let session = self.store_session.lock().ok().and_then(|m| *m);
        // A registered peer (or a store session) attaches; one that is not registered yet
        // asks a harmless question, so that a follower's redirect comes now and not with
        // the first real request.
        let probe = match (me, session) {
            (Some((peer_id, token)), _) => PeerRequest::Attach { peer_id, token },
            (None, Some((session, token))) => {
                PeerRequest::Store(eccl_protocol::StoreRequest::Attach { session, token })
            }
            (None, None) => PeerRequest::Heartbeat { peer_id: PeerId(0) },
        };
        let attaching = me.is_some() || session.is_some();
        match self.exchange(&c, probe, dial).await {
            Ok(MasterReply::NotLeader { leader }) => Err(Refused::Redirect(leader)),
            Ok(MasterReply::Error {
                code: ErrorCode::Evicted | ErrorCode::UnknownPeer,
                message,
            }) if attaching => Err(Refused::Evicted(message)),
            Ok(MasterReply::Error {
                code: ErrorCode::Internal,
                message,
            }) => Err(Refused::Down(format!("{addr}: {message}"))),
            Ok(_) => {
                if attaching {
                    tracing::info!(target: "eccl::init", "attached to master {addr}");
                }
                Ok(c)
            }
            Err(Attempt::Lost(e)) => Err(Refused::Down(format!("{addr}: {e}"))),
            Err(Attempt::Timeout) => Err(Refused::Down(format!("{addr} did not answer"))),
        }
    }

    /// Sends one request on `c` and waits for its answer.
    async fn exchange(
        &self,
        c: &Conn,
        body: PeerRequest,
        timeout: Duration,
    ) -> std::result::Result<MasterReply, Attempt> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut m = c
                .pending
                .lock()
                .map_err(|_| Attempt::Lost("lock poisoned".into()))?;
            match m.as_mut() {
                Some(m) => m.insert(id, tx),
                None => return Err(Attempt::Lost("the connection is closed".into())),
            };
        }
        if let Err(e) = c.tx.lock().await.send(&Request { id, body }).await {
            return Err(Attempt::Lost(e.to_string()));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(Attempt::Lost("the connection closed".into())),
            Err(_) => {
                if let Ok(mut m) = c.pending.lock() {
                    if let Some(m) = m.as_mut() {
                        m.remove(&id);
                    }
                }
                Err(Attempt::Timeout)
            }
        }
    }

    /// Whether this client has a master connection whose reader still runs (a
    /// connection being set up or replaced counts as live: its lock is held).
    fn has_live_conn(&self) -> bool {
        self.conn
            .try_lock()
            .map(|c| c.as_ref().is_some_and(|c| c.live()))
            .unwrap_or(true)
    }

    /// Sends `body` as a notification (fault reports, the heartbeats between asked ones):
    /// the master does what it says and answers nothing. Fails at once, rather than wait
    /// for a leader, when there is no connection now: a collective's error path calls
    /// this.
    pub async fn notify(&self, body: PeerRequest) -> Result<()> {
        let c = self
            .conn
            .lock()
            .await
            .clone()
            .filter(|c| c.live())
            .ok_or_else(|| {
                self.unavailable("no master connection now (a fail-over is under way)")
            })?;
        let sent =
            c.tx.lock()
                .await
                .send(&Request {
                    id: eccl_protocol::NOTIFICATION,
                    body,
                })
                .await;
        sent.map_err(|e| self.unavailable(e))
    }

    /// Renews this peer's lease every `heartbeat_ms`, on the runtime's worker threads,
    /// apart from the caller, so a peer busy in a long collective stays alive; only a
    /// peer that is really stuck (stopped, wedged) loses its lease. Ends when the peer
    /// is evicted or refused for good.
    pub fn spawn_heartbeats(
        self: &Arc<Self>,
        peer_id: PeerId,
        heartbeat_ms: u64,
        lease_ms: u64,
    ) -> tokio::task::JoinHandle<()> {
        let master = self.clone();
        let every = Duration::from_millis(heartbeat_ms.max(10));
        // A master that does not answer within half the lease is taken for dead or
        // hung, so the peer is attached to the next leader before the lease that leader
        // grants runs out (its first lease adds `TAKEOVER_GRACE`).
        let within = Duration::from_millis((lease_ms / 2).max(50));
        // A tick that runs this much after its time means this process did not run its
        // runtime's timers (starved of CPU, or a long blocking call on its threads): it
        // explains a lease that ran out with the process alive.
        let late = Duration::from_millis(lease_ms / 4);
        // An answer is asked for at most every half lease: the ticks between send
        // notifications, which renew the lease as well and which the master does not
        // answer. A hung master is then found within half a lease plus `within` (a
        // lease), and at the default timing (lease 800 ms, a heartbeat every 200) the
        // master writes half the answers it wrote when every heartbeat had one: an
        // answer was most of a heartbeat's cost to it (`eccl-chaos load`). Without a
        // live connection (dropped for a redirect or a hung master, or its reader ended
        // with a killed master) the next tick asks at once: the ask is what finds the
        // next leader, and a notification has nowhere to go.
        let ask_every = (lease_ms / 2 / heartbeat_ms.max(10)).max(1);
        let mut since_asked = ask_every;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // Every tick sends a heartbeat. One at a time is awaited: its answer (or its
            // absence) tells whether the master lives. The others, also while that
            // answer is late (a master busy writing other answers, or gone), go as
            // notifications (`notify`), which nobody awaits: a peer that waited
            // renewed its lease at the pace of the master's answers, and a leader busy
            // with a large epoch change evicted peers that were alive (`eccl-chaos load
            // --masters 3 --peers 3000` on two cores: false evictions). Each of those
            // goes on a task of its own: awaited here, it could wait for the
            // connection's locks, which the awaited heartbeat holds across its own
            // awaits while this loop does not poll it.
            let mut awaited: Option<Pin<Box<dyn Future<Output = Result<()>> + Send>>> = None;
            loop {
                tokio::select! {
                    due = tick.tick() => {
                        let behind = due.elapsed();
                        if behind > late {
                            master.late.fetch_add(1, Ordering::Relaxed);
                            // A few lines a second: a process of thousands of simulated
                            // peers that falls behind would otherwise log one per peer
                            // per interval.
                            if let Some(held) = eccl_transport::logging::limit("late heartbeat") {
                                tracing::warn!(target: "eccl::init", "peer {peer_id}: a heartbeat ran {} ms after its time: this process's eccl runtime did not run meanwhile (starved of CPU, or blocked){}", behind.as_millis(), eccl_transport::logging::held_note(held));
                            }
                        }
                        since_asked += 1;
                        if awaited.is_none()
                            && (since_asked >= ask_every || !master.has_live_conn())
                        {
                            since_asked = 0;
                            let m = master.clone();
                            awaited = Some(Box::pin(async move { m.heartbeat(peer_id, within).await }));
                        } else {
                            let m = master.clone();
                            tokio::spawn(async move {
                                let _ = m.notify(PeerRequest::Heartbeat { peer_id }).await;
                            });
                        }
                    }
                    outcome = async { awaited.as_mut().expect("guarded").await }, if awaited.is_some() => {
                        awaited = None;
                        match outcome {
                            Ok(()) => {}
                            // Evicted or refused for good: nothing left to renew.
                            Err(Error::Evicted { .. } | Error::InvalidArgument(_)) => return,
                            // No leader reachable now: keep trying, the lease of the next
                            // one starts fresh.
                            Err(_) => {}
                        }
                    }
                }
            }
        })
    }

    /// How many of this client's heartbeats ran a quarter lease or more late.
    pub fn late_heartbeats(&self) -> u64 {
        self.late.load(Ordering::Relaxed)
    }

    /// Renews the lease: an answer within `within`, or the master is taken for lost
    /// (dead or hung) and the next call looks for the leader.
    pub async fn heartbeat(&self, peer_id: PeerId, within: Duration) -> Result<()> {
        self.keep_alive(PeerRequest::Heartbeat { peer_id }, within)
            .await
    }

    /// Sends a lease renewal (`body`: a peer's heartbeat or a store session's keep-alive)
    /// as [`MasterClient::heartbeat`] describes.
    pub async fn keep_alive(&self, body: PeerRequest, within: Duration) -> Result<()> {
        let c = self.current(Instant::now() + self.deadline).await?;
        match self.exchange(&c, body, within).await {
            Ok(MasterReply::NotLeader { leader }) => {
                if let Ok(mut h) = self.hint.lock() {
                    *h = leader;
                }
                self.drop_conn(c.serial, "it is not the leader any more")
                    .await;
                Ok(())
            }
            Ok(MasterReply::Error {
                code: ErrorCode::Evicted | ErrorCode::UnknownPeer,
                message,
            }) => Err(self.evicted(message)),
            Ok(_) => Ok(()),
            Err(Attempt::Lost(e)) => {
                self.drop_conn(c.serial, &e).await;
                Ok(())
            }
            Err(Attempt::Timeout) => {
                // Slow is not dead: leave this master only if another one names a
                // different leader (a hung leader's followers elect a new one). Leaving
                // a live leader would make it evict this peer for the lost connection.
                if let Some(leader) = self.leader_elsewhere(&c.addr, within).await {
                    let why = format!(
                        "no answer to a heartbeat within {} ms, and {leader} leads now",
                        within.as_millis()
                    );
                    if let Ok(mut h) = self.hint.lock() {
                        *h = Some(leader);
                    }
                    self.drop_conn(c.serial, &why).await;
                }
                Ok(())
            }
        }
    }

    /// Asks the other masters who leads; returns a leader other than `current`, if one
    /// of them names one (or is one).
    async fn leader_elsewhere(&self, current: &str, wait: Duration) -> Option<String> {
        for addr in self.addrs.iter().filter(|a| a.as_str() != current) {
            let Ok(conn) = control::connect(addr, &self.secret, Role::PeerToMaster, wait).await
            else {
                continue;
            };
            let mut conn = conn;
            let probe = Request {
                id: 1,
                body: PeerRequest::Heartbeat { peer_id: PeerId(0) },
            };
            if conn.tx.send(&probe).await.is_err() {
                continue;
            }
            let reply = tokio::time::timeout(wait, conn.rx.recv::<MasterMessage>()).await;
            match reply {
                Ok(Ok(MasterMessage::Reply {
                    body: MasterReply::NotLeader { leader: Some(l) },
                    ..
                })) if l != current => return Some(l),
                // Past the leader check: this master leads.
                Ok(Ok(MasterMessage::Reply {
                    body: MasterReply::Error { .. },
                    ..
                })) => return Some(addr.clone()),
                _ => {}
            }
        }
        None
    }

    /// Sends `body` to the leader and waits for the answer, at most `timeout`; follows
    /// fail-overs meanwhile (see the module's notes).
    pub async fn request(&self, body: PeerRequest, timeout: Duration) -> Result<MasterReply> {
        let is_vote = matches!(body, PeerRequest::UpdateTopology { .. });
        // A timeout too long for the clock is a day: no request waits longer.
        let until = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(24 * 3600));
        loop {
            // Looking for a leader is bounded by the deadline and by the call's timeout.
            let find_until = until.min(Instant::now() + self.deadline);
            let c = self.current(find_until).await?;
            if is_vote {
                crate::fault::hit(crate::fault::Point::UpdateTopology);
            }
            let left = until.saturating_duration_since(Instant::now());
            match self.exchange(&c, body.clone(), left).await {
                Ok(MasterReply::NotLeader { leader }) => {
                    if let Ok(mut h) = self.hint.lock() {
                        *h = leader;
                    }
                    self.drop_conn(c.serial, "it is not the leader any more")
                        .await;
                }
                Ok(reply) => return Ok(reply),
                Err(Attempt::Lost(e)) => self.drop_conn(c.serial, &e).await,
                Err(Attempt::Timeout) => {
                    return Err(Error::Timeout {
                        what: "waiting for the master".into(),
                        ms: timeout.as_millis() as u64,
                    })
                }
            }
            if Instant::now() >= until {
                return Err(Error::Timeout {
                    what: "waiting for the master".into(),
                    ms: timeout.as_millis() as u64,
                });
            }
        }
    }
}

/// Why a master did not take this peer.
enum Refused {
    Auth(String),
    /// The master hung up after our proof: a wrong secret, or its admission making room
    /// for newer handshakes in a connection storm (it cancels the oldest past
    /// `admission::MAX_PENDING`); the two look alike, so a few are retried.
    HungUp(String),
    Evicted(String),
    Redirect(Option<String>),
    Down(String),
}

/// The masters of `ECCL_MASTER` (comma-separated `host:port`).
pub(crate) fn parse_list(list: &str) -> Result<Vec<String>> {
    let addrs: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect();
    if addrs.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "no master address in {list:?} (ECCL_MASTER takes host:port[,host:port...])"
        )));
    }
    if let Some(bad) = addrs.iter().find(|a| {
        a.rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    }) {
        return Err(Error::InvalidArgument(format!(
            "master address {bad:?} is not host:port (ECCL_MASTER takes host:port[,host:port...])"
        )));
    }
    Ok(addrs)
}

/// The error a caller gets for a reply that is not the one its request expects.
pub(crate) fn reply_error(master: &str, epoch: u64, reply: MasterReply) -> Error {
    match reply {
        MasterReply::Error { code, message } => match code {
            ErrorCode::Aborted => Error::Aborted {
                epoch,
                cause: message,
            },
            ErrorCode::Evicted | ErrorCode::UnknownPeer => Error::Evicted { reason: message },
            ErrorCode::Timeout => Error::Timeout {
                what: message,
                ms: 0,
            },
            ErrorCode::InvalidArgument | ErrorCode::VersionMismatch => {
                Error::InvalidArgument(message)
            }
            ErrorCode::NotLeader | ErrorCode::Internal => Error::MasterUnavailable {
                addr: master.into(),
                reason: message,
            },
        },
        MasterReply::NotLeader { leader } => Error::MasterUnavailable {
            addr: master.into(),
            reason: format!(
                "not the raft leader (leader: {})",
                leader.unwrap_or_else(|| "unknown".into())
            ),
        },
        other => Error::MasterUnavailable {
            addr: master.into(),
            reason: format!("unexpected reply {other:?}"),
        },
    }
}
