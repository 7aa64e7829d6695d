//! The key-value store on the leader: store sessions' leases, `wait` requests, and the
//! answers to store requests. Changes go through raft ([`crate::store`]); reads are the
//! leader's replica, which holds every change it has answered (a new leader answers only
//! once it has applied what its predecessors committed, as for attach).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use eccl_protocol::{ErrorCode, MasterReply, StoreLimits, StoreReply, StoreRequest};

use super::{propose_error, refused, Coordinator, ReplyTo};
use crate::registry::{Command, Outcome};
use crate::store::StoreCommand;

/// Bytes of store replies (values and listings) queued for their connections' writers
/// on one master at once: what clients that ask and never read can make it hold.
pub const MAX_REPLY_BYTES_QUEUED: usize = 256 << 20;

/// Bytes of store writes proposed and not yet applied on one master at once: what the
/// raft log's unapplied tail and the messages that replicate it can be made to hold.
pub const MAX_WRITE_BYTES_IN_FLIGHT: usize = 64 << 20;

/// The unit of [`StoreLive::replies`] and [`StoreLive::writes`]: one permit per KiB.
const REPLY_UNIT: usize = 1024;

/// The leader's soft state of the store: when each session last renewed its lease, and
/// a counter that moves whenever the store changes (what `wait` requests watch).
pub(crate) struct StoreLive {
    leases: std::sync::Mutex<HashMap<u64, Instant>>,
    changed: tokio::sync::watch::Sender<u64>,
    /// `wait` requests pending at once, bounded.
    waits: Arc<tokio::sync::Semaphore>,
    /// [`MAX_REPLY_BYTES_QUEUED`], in KiB: a reply with values holds its size until it
    /// is written.
    replies: Arc<tokio::sync::Semaphore>,
    /// [`MAX_WRITE_BYTES_IN_FLIGHT`], in KiB: a write holds its size until applied.
    writes: Arc<tokio::sync::Semaphore>,
}

impl Default for StoreLive {
    fn default() -> Self {
        StoreLive {
            leases: Default::default(),
            changed: tokio::sync::watch::channel(0).0,
            waits: Arc::new(tokio::sync::Semaphore::new(StoreLimits::MAX_WAITS)),
            replies: Arc::new(tokio::sync::Semaphore::new(
                MAX_REPLY_BYTES_QUEUED / REPLY_UNIT,
            )),
            writes: Arc::new(tokio::sync::Semaphore::new(
                MAX_WRITE_BYTES_IN_FLIGHT / REPLY_UNIT,
            )),
        }
    }
}

impl StoreLive {
    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Instant>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Room in the reply budget for a reply of `bytes`, or the refusal to send instead.
    fn reply_room(&self, bytes: usize) -> Result<tokio::sync::OwnedSemaphorePermit, MasterReply> {
        let units = bytes.div_ceil(REPLY_UNIT).max(1) as u32;
        self.replies.clone().try_acquire_many_owned(units).map_err(|_| {
            refused(
                ErrorCode::Timeout,
                format!(
                    "the master holds {MAX_REPLY_BYTES_QUEUED} bytes of store replies not yet read by their clients; try again"
                ),
            )
        })
    }
}

/// Bytes a reply of `count` names with these values takes on the wire, about (a tag and
/// a length per value): what is compared with [`StoreLimits::MAX_REPLY_BYTES`] before
/// any value is copied.
fn reply_bytes<'a>(values: impl Iterator<Item = Option<&'a [u8]>>) -> usize {
    values.map(|v| 1 + v.map_or(0, |v| v.len() + 5)).sum()
}

fn too_large(bytes: usize) -> MasterReply {
    refused(
        ErrorCode::InvalidArgument,
        format!(
            "the answer would carry {bytes} bytes (at most {} per reply): ask for fewer keys",
            StoreLimits::MAX_REPLY_BYTES
        ),
    )
}

fn check_keys(keys: &[Vec<u8>]) -> Result<(), MasterReply> {
    if keys.len() > StoreLimits::MAX_BATCH {
        return Err(refused(
            ErrorCode::InvalidArgument,
            format!(
                "{} keys in one request (at most {})",
                keys.len(),
                StoreLimits::MAX_BATCH
            ),
        ));
    }
    for k in keys {
        StoreLimits::check_key(k).map_err(|e| refused(ErrorCode::InvalidArgument, e))?;
    }
    let bytes: usize = keys.iter().map(Vec::len).sum();
    if bytes > StoreLimits::MAX_KEYS_BYTES {
        return Err(refused(
            ErrorCode::InvalidArgument,
            format!(
                "{bytes} bytes of keys in one request (at most {})",
                StoreLimits::MAX_KEYS_BYTES
            ),
        ));
    }
    Ok(())
}

impl Coordinator {
    /// Answers one store request of a connection. `session` is the session this
    /// connection speaks for (set by `Open`/`Attach`, cleared by `Close`); `job` the
    /// store job its secret belongs to (`None`: the job whose peers the masters serve),
    /// whose scopes are the only ones it opens or attaches to.
    pub async fn store_request(
        self: &Arc<Self>,
        session: &mut Option<u64>,
        job: Option<&str>,
        req: StoreRequest,
        reply: ReplyTo,
    ) {
        if !self.caught_up().await {
            return reply.send(self.not_leader());
        }
        match req {
            StoreRequest::Open { scope } => {
                if session.is_some() {
                    return reply.send(refused(
                        ErrorCode::InvalidArgument,
                        "this connection has a store session already",
                    ));
                }
                if let Err(e) = StoreLimits::check_scope(&scope) {
                    return reply.send(refused(ErrorCode::InvalidArgument, e));
                }
                let token: [u8; 32] = rand::random();
                let cmd = StoreCommand::Open {
                    scope: crate::store::job_scope(job, &scope),
                    token,
                };
                match self.store_propose(cmd).await {
                    Ok(StoreReply::Session { session: id, .. }) => {
                        self.store.leases().insert(id, Instant::now());
                        *session = Some(id);
                        tracing::info!(target: "eccl::master", "store session {id} opened in scope {scope:?}");
                        reply.send(MasterReply::Store(StoreReply::Session {
                            session: id,
                            token,
                            lease_ms: self.timing.store_lease().as_millis() as u64,
                        }));
                    }
                    Ok(other) => {
                        reply.send(refused(ErrorCode::Internal, format!("open gave {other:?}")))
                    }
                    Err(r) => reply.send(r),
                }
            }
            StoreRequest::Attach { session: id, token } => {
                // A session of another job is as unknown as one that never was.
                let known = self.raft.read(|r| {
                    r.store()
                        .session(id)
                        .filter(|s| crate::store::job_of_scope(&s.scope) == job)
                        .map(|s| s.token)
                });
                match known {
                    Some(t) if blake3::Hash::from(t) == blake3::Hash::from(token) => {
                        self.store.leases().insert(id, Instant::now());
                        *session = Some(id);
                        reply.send(MasterReply::Ok);
                    }
                    _ => reply.send(refused(
                        ErrorCode::UnknownPeer,
                        format!("store session {id} has ended (or this is not its credential)"),
                    )),
                }
            }
            req => {
                let Some(id) = *session else {
                    return reply.send(refused(
                        ErrorCode::UnknownPeer,
                        "no store session on this connection (open one first)",
                    ));
                };
                self.store_in_session(session, id, req, reply).await
            }
        }
    }

    async fn store_in_session(
        self: &Arc<Self>,
        session: &mut Option<u64>,
        id: u64,
        req: StoreRequest,
        reply: ReplyTo,
    ) {
        let ended = || {
            refused(
                ErrorCode::UnknownPeer,
                format!("store session {id} has ended"),
            )
        };
        match req {
            StoreRequest::Open { .. } | StoreRequest::Attach { .. } => {
                unreachable!("handled by store_request")
            }
            StoreRequest::KeepAlive => {
                let live = self
                    .store
                    .leases()
                    .get_mut(&id)
                    .map(|t| *t = Instant::now());
                reply.send(match live {
                    Some(()) => MasterReply::Ok,
                    None => ended(),
                });
            }
            StoreRequest::Close => {
                *session = None;
                self.close_session(id, "closed by its client").await;
                reply.send(MasterReply::Ok);
            }
            StoreRequest::Write { seq, op } => {
                // What apply would refuse is refused here, and never proposed: the log
                // carries only writes that change something.
                if let Err(e) = self.raft.read(|r| r.store().precheck(id, seq, &op)) {
                    return reply.send(refused(ErrorCode::InvalidArgument, e));
                }
                if self.raft.log_bytes() > crate::raft::log_store::REFUSE_WRITES_AT_BYTES {
                    return reply.send(refused(
                        ErrorCode::Timeout,
                        "the masters' log is being compacted (a snapshot is on its way); try again",
                    ));
                }
                let units = op.bytes().div_ceil(REPLY_UNIT).max(1) as u32;
                let Ok(_writing) = self.store.writes.clone().try_acquire_many_owned(units) else {
                    return reply.send(refused(
                        ErrorCode::Timeout,
                        format!(
                            "{MAX_WRITE_BYTES_IN_FLIGHT} bytes of store writes are on their way through the masters' log; try again"
                        ),
                    ));
                };
                let r = self
                    .store_propose(StoreCommand::Write {
                        session: id,
                        seq,
                        op,
                    })
                    .await;
                reply.send(match r {
                    Ok(a) => MasterReply::Store(a),
                    Err(e) => e,
                });
            }
            StoreRequest::Get { keys } => {
                if let Err(e) = check_keys(&keys) {
                    return reply.send(e);
                }
                match self.store_values(id, &keys) {
                    Some(Ok((v, held))) => {
                        reply.send_holding(MasterReply::Store(StoreReply::Values(v)), Some(held))
                    }
                    Some(Err(r)) => reply.send(r),
                    None => reply.send(ended()),
                }
            }
            StoreRequest::Check { keys } => {
                if let Err(e) = check_keys(&keys) {
                    return reply.send(e);
                }
                reply.send(match self.store_present(id, &keys) {
                    Some(p) => MasterReply::Store(StoreReply::Bool(p.iter().all(|p| *p))),
                    None => ended(),
                });
            }
            StoreRequest::NumKeys => {
                let n = self
                    .raft
                    .read(|r| r.store().scope_of(id).map(|s| s.len() as u64));
                reply.send(match n {
                    Some(n) => MasterReply::Store(StoreReply::Count(n)),
                    None => ended(),
                });
            }
            StoreRequest::List { prefix } => {
                let l = self.raft.read(|r| {
                    r.store()
                        .scope_of(id)
                        .map(|s| s.list(&prefix, StoreLimits::MAX_REPLY_BYTES))
                });
                match l {
                    Some(Ok(l)) => {
                        let bytes: usize = l.iter().map(|(k, v)| k.len() + v.len() + 10).sum();
                        match self.store.reply_room(bytes) {
                            Ok(held) => reply
                                .send_holding(MasterReply::Store(StoreReply::Pairs(l)), Some(held)),
                            Err(r) => reply.send(r),
                        }
                    }
                    Some(Err(bytes)) => reply.send(too_large(bytes)),
                    None => reply.send(ended()),
                }
            }
            StoreRequest::Wait { keys, timeout_ms } => {
                if let Err(e) = check_keys(&keys) {
                    return reply.send(e);
                }
                let timeout = Duration::from_millis(timeout_ms.min(StoreLimits::MAX_WAIT_MS));
                let Ok(permit) = self.store.waits.clone().try_acquire_owned() else {
                    return reply.send(refused(
                        ErrorCode::InvalidArgument,
                        format!(
                            "{} store waits are pending on this master (at most that many)",
                            StoreLimits::MAX_WAITS
                        ),
                    ));
                };
                let me = self.clone();
                // Waits on its own task: the connection goes on serving other requests.
                tokio::spawn(async move {
                    let _permit = permit;
                    let mut changed = me.store.changed.subscribe();
                    let until = tokio::time::Instant::now() + timeout;
                    loop {
                        if !me.raft.is_leader() {
                            return reply.send(me.not_leader());
                        }
                        // Whether each key is there, copying no value.
                        match me.store_present(id, &keys) {
                            None => {
                                return reply.send(refused(
                                    ErrorCode::UnknownPeer,
                                    format!("store session {id} has ended"),
                                ))
                            }
                            Some(p) if p.iter().all(|p| *p) => return reply.send(MasterReply::Ok),
                            Some(p) => {
                                match tokio::time::timeout_at(until, changed.changed()).await {
                                    Ok(Ok(())) => {}
                                    _ => {
                                        // Named only now, and a few at most.
                                        let missing: Vec<String> = keys
                                            .iter()
                                            .zip(&p)
                                            .filter(|(_, p)| !**p)
                                            .take(8)
                                            .map(|(k, _)| {
                                                String::from_utf8_lossy(&k[..k.len().min(64)])
                                                    .into_owned()
                                            })
                                            .collect();
                                        return reply.send(refused(
                                            ErrorCode::Timeout,
                                            format!(
                                                "wait for {missing:?} timed out after {} ms",
                                                timeout.as_millis()
                                            ),
                                        ));
                                    }
                                }
                            }
                        }
                    }
                });
            }
        }
    }

    /// The values of `keys` in `session`'s scope, with the room they hold in the reply
    /// budget; or the refusal, decided before any value is copied (a request may name
    /// one large value thousands of times); `None` once the session has ended.
    #[allow(clippy::type_complexity)]
    fn store_values(
        &self,
        session: u64,
        keys: &[Vec<u8>],
    ) -> Option<Result<(Vec<Option<Vec<u8>>>, tokio::sync::OwnedSemaphorePermit), MasterReply>>
    {
        self.raft.read(|r| {
            let s = r.store().scope_of(session)?;
            let bytes = reply_bytes(keys.iter().map(|k| s.get(k)));
            if bytes > StoreLimits::MAX_REPLY_BYTES {
                return Some(Err(too_large(bytes)));
            }
            let held = match self.store.reply_room(bytes) {
                Ok(h) => h,
                Err(r) => return Some(Err(r)),
            };
            Some(Ok((
                keys.iter().map(|k| s.get(k).map(<[u8]>::to_vec)).collect(),
                held,
            )))
        })
    }

    /// Whether each of `keys` is in `session`'s scope (nothing copied); `None` once the
    /// session has ended.
    fn store_present(&self, session: u64, keys: &[Vec<u8>]) -> Option<Vec<bool>> {
        self.raft.read(|r| {
            r.store()
                .scope_of(session)
                .map(|s| keys.iter().map(|k| s.get(k).is_some()).collect())
        })
    }

    /// Proposes a store command; its answer, or the reply that says why not.
    async fn store_propose(&self, cmd: StoreCommand) -> Result<StoreReply, MasterReply> {
        let r = self.raft.propose(Command::Store(cmd)).await;
        self.store.bump();
        match r {
            Ok(Outcome::Store(Ok(a))) => Ok(a),
            Ok(Outcome::Store(Err(why))) => Err(refused(ErrorCode::InvalidArgument, why)),
            Ok(other) => Err(refused(ErrorCode::Internal, format!("store: {other:?}"))),
            Err(e) => Err(propose_error(e)),
        }
    }

    /// Ends a store session (closed, its connection lost, or its lease lapsed).
    pub async fn close_session(&self, id: u64, reason: &str) {
        self.store.leases().remove(&id);
        if !self.raft.is_leader() {
            return; // the next leader holds the lease now
        }
        let cmd = StoreCommand::Close {
            session: id,
            reason: reason.to_string(),
        };
        match self.store_propose(cmd).await {
            Ok(_) => tracing::info!(target: "eccl::master", "store session {id} ended: {reason}"),
            Err(e) => tracing::debug!(target: "eccl::master", "ending store session {id}: {e:?}"),
        }
    }

    /// Sessions whose lease lapsed; called by the lease checker on the leader. A new
    /// leader first gives every session it knows a fresh lease from `from`.
    pub(super) fn expired_sessions(&self, new_leader_from: Option<Instant>) -> Vec<u64> {
        let mut leases = self.store.leases();
        if let Some(from) = new_leader_from {
            let known: Vec<u64> = self.raft.read(|r| r.store().sessions().collect());
            *leases = known.into_iter().map(|s| (s, from)).collect();
        }
        leases
            .iter()
            .filter(|(_, t)| t.elapsed() > self.timing.store_lease())
            .map(|(s, _)| *s)
            .collect()
    }

    /// This master did not run for a while (see the lease checker): every store
    /// session's lease starts again, as every peer's does, rather than run out for the
    /// master's own pause.
    pub(super) fn restart_session_leases(&self) {
        for t in self.store.leases().values_mut() {
            *t = Instant::now();
        }
    }

    /// This master stopped leading: waits re-check (and redirect), leases are the next
    /// leader's.
    pub(super) fn store_step_down(&self) {
        self.store.leases().clear();
        self.store.bump();
    }
}
