//! The abort signal of a communicator. Link readers, the master's events and the
//! executor itself raise it; every collective in flight selects on it, so a failure seen
//! on any link ends the wait on every other one.
//!
//! An abort breaks its whole epoch: every later collective of that epoch fails at once
//! with the same error, until `update_topology()` moves to a new epoch. That keeps the
//! rule simple for users (after any error, update the topology) and means a frame of a
//! broken epoch is never mixed into a new one.

use std::sync::Arc;

use eccl_protocol::frame::{AbortCause, FrameHeader};
use eccl_transport::link::LinkObserver;
use eccl_transport::TransportError;
use tokio::sync::watch;

use crate::error::Error;

#[derive(Clone, Debug)]
pub(crate) struct AbortInfo {
    pub epoch: u64,
    pub error: Error,
}

/// An abort that applies to every epoch: this peer was evicted.
const ALL_EPOCHS: u64 = u64::MAX;

pub(crate) struct AbortState {
    tx: watch::Sender<Option<AbortInfo>>,
    /// Peers the master evicted, as its abort events named them; a shared-state sync
    /// stops using them as sources or waiting for them as receivers.
    gone: std::sync::Mutex<std::collections::HashSet<eccl_protocol::PeerId>>,
}

impl AbortState {
    pub fn new() -> Arc<AbortState> {
        Arc::new(AbortState {
            tx: watch::channel(None).0,
            gone: Default::default(),
        })
    }

    /// This peer was evicted: every epoch is over for it.
    pub fn evicted(&self, reason: String) {
        self.raise(ALL_EPOCHS, Error::Evicted { reason });
    }

    /// The master evicted `peer`; wakes whoever watches.
    pub fn peer_gone(&self, peer: eccl_protocol::PeerId) {
        if let Ok(mut g) = self.gone.lock() {
            g.insert(peer);
        }
        self.tx.send_modify(|_| {});
    }

    pub fn is_gone(&self, peer: eccl_protocol::PeerId) -> bool {
        self.gone.lock().map(|g| g.contains(&peer)).unwrap_or(false)
    }

    /// A receiver that wakes on every abort and eviction.
    pub fn subscribe(&self) -> watch::Receiver<Option<AbortInfo>> {
        self.tx.subscribe()
    }

    /// Breaks `epoch` with `error`, unless it is already broken (the first cause wins).
    pub fn raise(&self, epoch: u64, error: Error) {
        self.tx.send_if_modified(|cur| {
            let replace = match cur {
                Some(c) => c.epoch < epoch,
                None => true,
            };
            if replace {
                tracing::info!(target: "eccl::coll", "epoch {epoch} aborted: {error}");
                *cur = Some(AbortInfo {
                    epoch,
                    error: error.clone(),
                });
            }
            replace
        });
    }

    /// The error that broke `epoch`, if it is broken.
    pub fn check(&self, epoch: u64) -> Option<Error> {
        self.tx
            .borrow()
            .as_ref()
            .filter(|i| i.epoch == epoch || i.epoch == ALL_EPOCHS)
            .map(|i| i.error.clone())
    }

    /// Resolves when `epoch` is broken.
    pub async fn wait(&self, epoch: u64) -> Error {
        let mut rx = self.tx.subscribe();
        loop {
            if let Some(e) = rx
                .borrow_and_update()
                .as_ref()
                .filter(|i| i.epoch == epoch || i.epoch == ALL_EPOCHS)
            {
                return e.error.clone();
            }
            if rx.changed().await.is_err() {
                return Error::Aborted {
                    epoch,
                    cause: "communicator shut down".into(),
                };
            }
        }
    }
}

/// Observes every link of a communicator on behalf of its current epoch: an Abort frame
/// breaks the epoch it names only if that is the current one, so frames of an old
/// epoch never disturb the new one, also on links kept across epochs.
pub(crate) struct EpochLinkObserver {
    epoch: std::sync::atomic::AtomicU64,
    pub state: Arc<AbortState>,
    /// Rank in the current epoch of the peer at the other end of each link, by link name.
    names: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

impl EpochLinkObserver {
    pub fn new(state: Arc<AbortState>) -> EpochLinkObserver {
        EpochLinkObserver {
            epoch: Default::default(),
            state,
            names: Default::default(),
        }
    }

    /// Moves to `epoch`, whose members' links are named as in `names`.
    pub fn enter(&self, epoch: u64, names: std::collections::HashMap<String, u32>) {
        if let Ok(mut n) = self.names.lock() {
            *n = names;
        }
        self.epoch
            .store(epoch, std::sync::atomic::Ordering::Release);
    }
}

impl LinkObserver for EpochLinkObserver {
    fn on_abort(&self, peer: &str, header: &FrameHeader, reason: &str) {
        let epoch = self.epoch.load(std::sync::atomic::Ordering::Acquire);
        if header.epoch != epoch {
            return;
        }
        let rank = self.names.lock().ok().and_then(|n| n.get(peer).copied());
        let error = match AbortCause::from_u32(header.step) {
            Some(AbortCause::Mismatch) | Some(AbortCause::InvalidArgument) => Error::Mismatch {
                rank,
                ours: None,
                theirs: Some(header.desc),
                detail: reason.to_string(),
            },
            _ => Error::Aborted {
                epoch,
                cause: format!(
                    "rank {} aborted: {reason}",
                    rank.map_or("?".into(), |r| r.to_string())
                ),
            },
        };
        self.state.raise(epoch, error);
    }

    fn on_failure(&self, peer: &str, error: &TransportError) {
        // Deliberately not an abort: the failure also arrives in-band, after every frame
        // the peer sent before it, so a collective that already has its data completes.
        // A collective that needs the link fails when it reaches the failure, and then
        // tells every other rank with Abort frames.
        tracing::debug!(target: "eccl::net", "link {peer} ended: {error}");
    }
}
