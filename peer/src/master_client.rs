//! The peer's connection to the master: requests with ids, answered in any order, and
//! events the master pushes (abort an epoch, you were evicted).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eccl_protocol::auth::{Role, Secret};
use eccl_protocol::{ErrorCode, MasterEvent, MasterMessage, MasterReply, PeerRequest, Request};
use eccl_transport::control::{self, ControlTx};
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};

type Pending = Arc<Mutex<Option<HashMap<u64, oneshot::Sender<MasterReply>>>>>;

pub(crate) struct MasterClient {
    addr: String,
    tx: tokio::sync::Mutex<ControlTx>,
    pending: Pending,
    next_id: AtomicU64,
    reader: tokio::task::JoinHandle<()>,
}

impl MasterClient {
    /// Connects and authenticates, retrying until `wait` has passed (the master may still
    /// be starting). Events go to `events`.
    pub async fn connect(
        addr: &str,
        secret: &Secret,
        wait: Duration,
        events: mpsc::UnboundedSender<MasterEvent>,
    ) -> Result<MasterClient> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(20);
        let conn = loop {
            let left = wait.saturating_sub(start.elapsed());
            match control::connect(
                addr,
                secret,
                Role::PeerToMaster,
                left.max(Duration::from_millis(10)),
            )
            .await
            {
                Ok(c) => break c,
                Err(e) => {
                    // A wrong secret will not get better by retrying.
                    if matches!(e, eccl_transport::TransportError::Auth { .. })
                        || start.elapsed() + delay >= wait
                    {
                        return Err(Error::MasterUnavailable {
                            addr: addr.to_string(),
                            reason: e.to_string(),
                        });
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        };
        let pending: Pending = Arc::new(Mutex::new(Some(HashMap::new())));
        let mut rx = conn.rx;
        let p2 = pending.clone();
        let name = addr.to_string();
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
                        tracing::warn!(target: "eccl::init", "lost the master at {name}: {e}");
                        // Dropping the senders fails every request in flight.
                        if let Ok(mut m) = p2.lock() {
                            *m = None;
                        }
                        return;
                    }
                }
            }
        });
        Ok(MasterClient {
            addr: addr.to_string(),
            tx: tokio::sync::Mutex::new(conn.tx),
            pending,
            next_id: AtomicU64::new(1),
            reader,
        })
    }

    fn unavailable(&self, reason: impl ToString) -> Error {
        Error::MasterUnavailable {
            addr: self.addr.clone(),
            reason: reason.to_string(),
        }
    }

    /// Sends `body` without waiting for an answer (heartbeats, fault reports): id 0 is
    /// never a request's, so a reply to it is dropped.
    pub async fn notify(&self, body: PeerRequest) -> Result<()> {
        self.tx
            .lock()
            .await
            .send(&Request { id: 0, body })
            .await
            .map_err(|e| self.unavailable(e))
    }

    /// Sends `body` and waits for the answer, at most `timeout`.
    pub async fn request(&self, body: PeerRequest, timeout: Duration) -> Result<MasterReply> {
        let is_vote = matches!(body, PeerRequest::UpdateTopology { .. });
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut m = self
                .pending
                .lock()
                .map_err(|_| self.unavailable("internal lock poisoned"))?;
            match m.as_mut() {
                Some(m) => m.insert(id, tx),
                None => return Err(self.unavailable("the connection to the master is closed")),
            };
        }
        let sent = self.tx.lock().await.send(&Request { id, body }).await;
        if let Err(e) = sent {
            return Err(self.unavailable(e));
        }
        if is_vote {
            crate::fault::hit(crate::fault::Point::UpdateTopology);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err(self.unavailable("the connection to the master closed")),
            Err(_) => {
                if let Ok(mut m) = self.pending.lock() {
                    if let Some(m) = m.as_mut() {
                        m.remove(&id);
                    }
                }
                Err(Error::Timeout {
                    what: "waiting for the master".into(),
                    ms: timeout.as_millis() as u64,
                })
            }
        }
    }
}

impl Drop for MasterClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
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
