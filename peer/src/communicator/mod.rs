//! The `Communicator`: one peer's membership in a job, its current world and the links
//! of that world. Its methods live in one file per job:
//!
//! | file | job |
//! |---|---|
//! | `membership.rs` | connect, `update_topology`, `are_peers_pending`, `leave`, leases |
//! | `collective.rs` | running a schedule over the links, in place and out of place |
//! | `p2p.rs` | tagged `send` / `recv` |
//! | `queue.rs` | `in_flight`: several calls submitted before the first finishes |
//! | `retry.rs` | [`RetryPolicy`], `recover` and the `*_with_retry` helpers |
//! | `topology.rs` | `optimize_topology`: link measurements, the master's ring |
//! | `typed.rs` | the typed API (`all_reduce(&mut [f32], op)`, ...) over [`Element`](crate::Element) |
//!
//! Collectives take `&mut self`: within an epoch every member calls the same collectives
//! in the same order, and the borrow checker keeps one caller from interleaving two.
//!
//! The calls that lead into the engine (connect, the membership calls, the one
//! collective and point-to-point funnels, shared-state sync) return a
//! [`BoxFuture`](futures::future::BoxFuture) made here: a future's `poll` is compiled in
//! the crate that polls it, so an `async fn` awaited from eccl-bench, eccl-chaos,
//! eccl-python and every test would compile the engine again in each (one box per call
//! costs nothing measurable; docs/measurements.md).

mod collective;
mod membership;
mod p2p;
mod quantized;
mod queue;
mod retry;
mod topology;
mod typed;

use futures::future::{BoxFuture, FutureExt};
use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use eccl_protocol::{Algo, CollectiveKind, Descriptor, PeerId, Rank, World};
use eccl_transport::pool::AlignedBuf;

use crate::abort::AbortState;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::executor;
use crate::links::{LinkManager, PeerLink};
use crate::master_client::MasterClient;

pub use collective::{CollArgs, OnAbort, OpInfo};
pub use membership::WorldUpdate;
pub use quantized::{Quantize, QUANT_PIECE_VALUES};
pub use queue::{CallQueue, Queued};
pub use retry::RetryPolicy;
pub use topology::{TopologyUpdate, PROBE_TAG};

/// The world this peer is in, and what it keeps per epoch.
pub(crate) struct Current {
    pub world: World,
    pub rank: Rank,
    pub members: Arc<[PeerId]>,
    /// Indexed by rank; `None` at our own rank.
    pub links: Vec<Option<PeerLink>>,
    /// Collectives so far in this epoch; names the frames of each.
    seq: u64,
    /// Collectives of this epoch that succeeded here, all of them in a row from the
    /// first: every frame this rank sends for them is in its links. An abort this rank
    /// announces breaks collective `done` and later ones only, so a slower rank still
    /// finishing one of those keeps a call that succeeded here.
    done: u64,
    /// Point-to-point messages so far in this epoch, per (peer, tag) and direction.
    p2p_sent: HashMap<(Rank, u32), u64>,
    p2p_recvd: HashMap<(Rank, u32), u64>,
    /// Shared-state syncs so far in this epoch; names the frames of each round.
    pub sync_round: u64,
}

impl Current {
    fn new(world: World, rank: Rank, links: Vec<Option<PeerLink>>) -> Current {
        let members: Arc<[PeerId]> = world.peer_ids().into();
        Current {
            world,
            rank,
            members,
            links,
            seq: 0,
            done: 0,
            p2p_sent: HashMap::new(),
            p2p_recvd: HashMap::new(),
            sync_round: 0,
        }
    }

    pub fn size(&self) -> u32 {
        self.world.size() as u32
    }
}

pub struct Communicator {
    pub(crate) cfg: Config,
    pub(crate) master: Arc<MasterClient>,
    peer_id: PeerId,
    links: LinkManager,
    pub(crate) cur: Option<Current>,
    pub(crate) abort: Arc<AbortState>,
    evicted: Arc<std::sync::Mutex<Option<String>>>,
    /// Rank blamed by the collective that failed last (see `fail`).
    suspect: AtomicU32,
    events: tokio::task::JoinHandle<()>,
    heartbeat: tokio::task::JoinHandle<()>,
    /// Scratch of the running schedule, and the buffer in-place calls work in.
    scratch: AlignedBuf,
    inplace: AlignedBuf,
    schedules: HashMap<(Descriptor, u32, u32), Arc<collective::Built>>,
    last_algo: HashMap<CollectiveKind, Algo>,
    /// Shared-state tensors' digests as the last sync left them (by name).
    pub(crate) state_digests: HashMap<String, crate::shared_state::KnownDigest>,
    /// The quantized all_reduce's buffers, kept between calls.
    quant_scratch: quantized::Scratch,
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.events.abort();
        self.heartbeat.abort();
    }
}

impl Communicator {
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }
    pub fn rank(&self) -> Option<Rank> {
        self.cur.as_ref().map(|c| c.rank)
    }
    pub fn world_size(&self) -> u32 {
        self.cur.as_ref().map_or(0, Current::size)
    }
    pub fn epoch(&self) -> u64 {
        self.cur.as_ref().map_or(0, |c| c.world.epoch)
    }
    pub fn world(&self) -> Option<&World> {
        self.cur.as_ref().map(|c| &c.world)
    }
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// A handle that aborts this communicator's calls from another thread (torch's
    /// `ProcessGroup.abort()`); see [`Communicator::announce_abort`].
    pub fn abort_handle(&self) -> crate::AbortHandle {
        crate::AbortHandle(self.abort.clone())
    }

    /// After an [`crate::AbortHandle::abort`]: tells the other ranks of the epoch, once,
    /// so that their calls waiting on this rank fail at once instead of at their
    /// timeout. Does nothing if the epoch was not aborted here.
    pub fn announce_abort<'a>(&'a mut self) -> BoxFuture<'a, ()> {
        async move {
            let Some(c) = self.cur.as_mut() else { return };
            let epoch = c.world.epoch;
            let Some(e) = self.abort.check(epoch) else {
                return;
            };
            if let Some(cause) = self.abort.take_local() {
                let reason = format!("rank {}: {e}", c.rank);
                let h = executor::close_header(epoch);
                executor::broadcast_abort(epoch, c.done, h.desc, cause, &reason, &mut c.links)
                    .await;
            }
        }
        .boxed()
    }

    /// The transport of each link of the current world, by rank (`None` at this rank).
    pub fn link_transports(&self) -> Vec<Option<eccl_transport::Transport>> {
        self.cur.as_ref().map_or_else(Vec::new, |c| {
            c.links
                .iter()
                .map(|l| l.as_ref().map(|l| l.tx.transport()))
                .collect()
        })
    }

    /// What this peer's links run on, as `eccl-bench` reports it: `shm`, `tcp`,
    /// `shm+tcp` for a mixed world, `local` in a world of one.
    pub fn transport_summary(&self) -> String {
        let mut names: Vec<&str> = self
            .link_transports()
            .into_iter()
            .flatten()
            .map(|t| t.name())
            .collect();
        names.sort_unstable();
        names.dedup();
        if names.is_empty() {
            "local".into()
        } else {
            names.join("+")
        }
    }

    fn evicted_error(&self) -> Option<Error> {
        self.evicted
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .map(|reason| Error::Evicted { reason })
    }

    /// The current world, if this peer may run a call in it now.
    fn ready(&mut self) -> Result<&mut Current> {
        if let Some(e) = self.evicted_error() {
            return Err(e);
        }
        let c = self.cur.as_mut().ok_or_else(|| {
            Error::InvalidArgument("no world yet: call update_topology() first".into())
        })?;
        if let Some(e) = self.abort.check(c.world.epoch) {
            return Err(e);
        }
        Ok(c)
    }
}
