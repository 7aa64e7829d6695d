//! [`StoreClient`]: a session in the master's key-value store (see
//! `eccl_protocol::store`), which the Python package turns into a
//! `torch.distributed.Store` and torchrun's rendezvous backend.
//!
//! The client follows the raft leader as a peer does (redirects, fail-over, re-attaching
//! to its session with the credential the master gave), renews its session's lease in
//! the background, and numbers its writes so that one sent again after a fail-over is
//! answered once, not applied twice.

use futures::future::{BoxFuture, FutureExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::{ErrorCode, MasterReply, PeerRequest, StoreReply, StoreRequest, StoreWrite};
use tokio::sync::mpsc;

use crate::error::{Error, Result};
use crate::master_client::MasterClient;
use crate::Secret;

/// A value or `None`, per key asked.
pub type Values = Vec<Option<Vec<u8>>>;

struct Inner {
    master: MasterClient,
    session: u64,
    scope: String,
    seq: AtomicU64,
    /// How long one request may take (finding a leader included).
    timeout: Duration,
}

/// A session in one scope of the master's key-value store. Cloning shares the session;
/// it ends with [`StoreClient::close`], when the last clone is dropped, or when its
/// process dies (its connection drops).
#[derive(Clone)]
pub struct StoreClient {
    inner: Arc<Inner>,
    _keepalive: Arc<AbortOnDrop>,
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl StoreClient {
    /// Opens a session in `scope` on the masters of `masters` (comma-separated client
    /// addresses). `timeout` bounds finding a leader and every later request.
    pub fn open<'a>(
        masters: &'a str,
        secret: &'a Secret,
        scope: &'a str,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StoreClient>> {
        async move {
            eccl_protocol::StoreLimits::check_scope(scope).map_err(Error::InvalidArgument)?;
            // A store client gets no events; evictions come back as errors.
            let (events, _) = mpsc::unbounded_channel();
            let master = MasterClient::connect(masters, secret, timeout, events).await?;
            let reply = master
                .request(
                    PeerRequest::Store(StoreRequest::Open {
                        scope: scope.to_string(),
                    }),
                    timeout,
                )
                .await?;
            let (session, token, lease_ms) = match reply {
                MasterReply::Store(StoreReply::Session {
                    session,
                    token,
                    lease_ms,
                }) => (session, token, lease_ms),
                other => return Err(refusal(other, "opening a store session")),
            };
            master.store_session(session, token);
            tracing::info!(target: "eccl::init", "store session {session} in scope {scope:?}");
            let inner = Arc::new(Inner {
                master,
                session,
                scope: scope.to_string(),
                seq: AtomicU64::new(1),
                timeout,
            });
            // A quarter of the lease, and at most a second: the keep-alive's answer (or
            // its absence) is also how a hung leader is found, as for a peer.
            let period = Duration::from_millis((lease_ms / 4).clamp(10, 1000));
            let weak = Arc::downgrade(&inner);
            let keepalive = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(period).await;
                    let Some(c) = weak.upgrade() else { return };
                    let body = PeerRequest::Store(StoreRequest::KeepAlive);
                    if let Err(e) = c.master.keep_alive(body, period * 2).await {
                        tracing::warn!(target: "eccl::init", "store session {}: {e}", c.session);
                        if matches!(e, Error::Evicted { .. }) {
                            return;
                        }
                    }
                }
            });
            Ok(StoreClient {
                inner,
                _keepalive: Arc::new(AbortOnDrop(keepalive)),
            })
        }
        .boxed()
    }

    pub fn session(&self) -> u64 {
        self.inner.session
    }

    pub fn scope(&self) -> &str {
        &self.inner.scope
    }

    fn ask<'a>(
        &'a self,
        req: StoreRequest,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<StoreReply>> {
        async move {
            let what = match &req {
                StoreRequest::Write { op, .. } => format!("{op:?}"),
                r => format!("{r:?}"),
            };
            let what: String = what.chars().take(120).collect();
            match self
                .inner
                .master
                .request(PeerRequest::Store(req), timeout)
                .await?
            {
                MasterReply::Store(r) => Ok(r),
                MasterReply::Ok => Ok(StoreReply::Done),
                other => Err(refusal(other, &what)),
            }
        }
        .boxed()
    }

    async fn write(&self, op: StoreWrite) -> Result<StoreReply> {
        let seq = self.inner.seq.fetch_add(1, Ordering::Relaxed);
        self.ask(StoreRequest::Write { seq, op }, self.inner.timeout)
            .await
    }

    pub async fn set(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(StoreWrite::Set {
            key: key.to_vec(),
            value: value.to_vec(),
            ephemeral: false,
        })
        .await
        .map(drop)
    }

    /// Sets a key that is removed when this session ends.
    pub async fn set_ephemeral(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(StoreWrite::Set {
            key: key.to_vec(),
            value: value.to_vec(),
            ephemeral: true,
        })
        .await
        .map(drop)
    }

    pub async fn multi_set(&self, pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Result<()> {
        self.write(StoreWrite::MultiSet { pairs }).await.map(drop)
    }

    pub async fn add(&self, key: &[u8], delta: i64) -> Result<i64> {
        match self
            .write(StoreWrite::Add {
                key: key.to_vec(),
                delta,
            })
            .await?
        {
            StoreReply::Int(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    pub async fn append(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.write(StoreWrite::Append {
            key: key.to_vec(),
            value: value.to_vec(),
        })
        .await
        .map(drop)
    }

    /// torch's compare-and-set (see `StoreWrite::CompareSet`): the value now held.
    pub async fn compare_set(
        &self,
        key: &[u8],
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>> {
        match self
            .write(StoreWrite::CompareSet {
                key: key.to_vec(),
                expected: expected.to_vec(),
                desired: desired.to_vec(),
            })
            .await?
        {
            StoreReply::Value(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    pub async fn delete(&self, key: &[u8]) -> Result<bool> {
        match self.write(StoreWrite::Delete { key: key.to_vec() }).await? {
            StoreReply::Bool(b) => Ok(b),
            other => Err(unexpected(other)),
        }
    }

    /// The values of `keys` now (`None` for a missing key).
    pub async fn get(&self, keys: Vec<Vec<u8>>) -> Result<Values> {
        match self
            .ask(StoreRequest::Get { keys }, self.inner.timeout)
            .await?
        {
            StoreReply::Values(v) => Ok(v),
            other => Err(unexpected(other)),
        }
    }

    pub async fn check(&self, keys: Vec<Vec<u8>>) -> Result<bool> {
        match self
            .ask(StoreRequest::Check { keys }, self.inner.timeout)
            .await?
        {
            StoreReply::Bool(b) => Ok(b),
            other => Err(unexpected(other)),
        }
    }

    /// Returns once all of `keys` exist; `Error::Timeout` after `timeout`.
    pub async fn wait(&self, keys: Vec<Vec<u8>>, timeout: Duration) -> Result<()> {
        // The masters end a wait at this length whatever is asked.
        let timeout = timeout.min(Duration::from_millis(
            eccl_protocol::StoreLimits::MAX_WAIT_MS,
        ));
        let req = StoreRequest::Wait {
            keys,
            timeout_ms: timeout.as_millis() as u64,
        };
        // The master answers the timeout itself; the margin covers finding a leader.
        match self
            .ask(req, timeout.saturating_add(self.inner.timeout))
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Timeout { what, .. }) => Err(Error::Timeout {
                what,
                ms: timeout.as_millis() as u64,
            }),
            Err(e) => Err(e),
        }
    }

    /// Waits for `keys` (at most `timeout`), then returns their values. A key deleted
    /// between the wait and the read is waited for again, within the same `timeout`.
    pub async fn wait_get(&self, keys: Vec<Vec<u8>>, timeout: Duration) -> Result<Values> {
        let timeout = timeout.min(Duration::from_millis(
            eccl_protocol::StoreLimits::MAX_WAIT_MS,
        ));
        // At most a day from now: within the clock's range.
        let end = tokio::time::Instant::now() + timeout;
        loop {
            let now = self.get(keys.clone()).await?;
            if now.iter().all(Option::is_some) {
                return Ok(now);
            }
            let left = end.saturating_duration_since(tokio::time::Instant::now());
            self.wait(keys.clone(), left).await.map_err(|e| match e {
                Error::Timeout { what, .. } => Error::Timeout {
                    what,
                    ms: timeout.as_millis() as u64,
                },
                e => e,
            })?;
        }
    }

    pub async fn num_keys(&self) -> Result<u64> {
        match self.ask(StoreRequest::NumKeys, self.inner.timeout).await? {
            StoreReply::Count(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }

    /// The keys starting with `prefix`, with their values, in key order.
    pub async fn list(&self, prefix: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let req = StoreRequest::List {
            prefix: prefix.to_vec(),
        };
        match self.ask(req, self.inner.timeout).await? {
            StoreReply::Pairs(p) => Ok(p),
            other => Err(unexpected(other)),
        }
    }

    /// Ends the session: its ephemeral keys go, and the scope's keys if it was the last
    /// session of the scope.
    pub async fn close(&self) -> Result<()> {
        self.ask(StoreRequest::Close, self.inner.timeout)
            .await
            .map(drop)
    }
}

fn unexpected(r: StoreReply) -> Error {
    Error::MasterUnavailable {
        addr: String::new(),
        reason: format!("unexpected store answer {r:?}"),
    }
}

/// The error a master's refusal stands for.
fn refusal(reply: MasterReply, what: &str) -> Error {
    match reply {
        MasterReply::Error { code, message } => match code {
            ErrorCode::InvalidArgument => Error::InvalidArgument(message),
            ErrorCode::Timeout => Error::Timeout {
                what: message,
                ms: 0,
            },
            ErrorCode::UnknownPeer | ErrorCode::Evicted => Error::Evicted { reason: message },
            _ => Error::MasterUnavailable {
                addr: String::new(),
                reason: format!("{what}: {message}"),
            },
        },
        other => Error::MasterUnavailable {
            addr: String::new(),
            reason: format!("{what}: unexpected answer {other:?}"),
        },
    }
}
