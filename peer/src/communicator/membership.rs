//! Membership: registering with the master, the lease (heartbeats) and the master's
//! events, the votes that move the world to its next epoch, and leaving.

use futures::future::{BoxFuture, FutureExt};
use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::LinkKeys;
use eccl_protocol::{
    MasterEvent, MasterReply, PeerId, PeerRequest, Rank, RegisterRequest, World, PROTOCOL_VERSION,
};
use eccl_transport::pool::AlignedBuf;
use tokio::sync::mpsc;

use super::{Communicator, Current};
use crate::abort::AbortState;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::executor;
use crate::links::LinkManager;
use crate::master_client::{reply_error, MasterClient};

/// The outcome of `update_topology()`: the world this peer is in now.
#[derive(Clone, Debug)]
pub struct WorldUpdate {
    pub epoch: u64,
    /// Whether a new epoch began (someone joined or left, or the last one was aborted).
    pub changed: bool,
    pub rank: Rank,
    pub world_size: u32,
    /// Links to other members carried over from the previous epoch (after a clean
    /// epoch, only links to newcomers are connected).
    pub links_kept: u32,
}

impl Communicator {
    /// Registers with the master named in `cfg`. The peer is pending until its first
    /// `update_topology()`.
    pub fn connect(cfg: Config) -> BoxFuture<'static, Result<Communicator>> {
        async move {
        cfg.validate()?;
        let secret = cfg
            .secret
            .clone()
            .ok_or_else(|| Error::InvalidArgument("no job secret: set ECCL_SECRET or ECCL_SECRET_FILE (eccl-master prints where it keeps one)".into()))?;
        let abort = AbortState::new();
        let links = LinkManager::bind(&cfg, &abort).await?;
        let (etx, erx) = mpsc::unbounded_channel();
        let master = MasterClient::connect(&cfg.master, &secret, cfg.connect_timeout, etx).await?;
        let req = RegisterRequest {
                    listen_port: links.local_addr.port(),
                    quic_port: links.quic_port(),
                    shm_name: links.shm_name(),
                    advertise_host: links.advertise_host.clone(),
                    host: cfg.host.clone(),
                    rank_hint: cfg.rank_hint,
                    protocol_version: PROTOCOL_VERSION,
        };
        let (peer_id, heartbeat_ms, lease_ms) = master
            .register(req, &cfg.master, cfg.connect_timeout)
            .await?;
        let master = Arc::new(master);
        let heartbeat = master.spawn_heartbeats(peer_id, heartbeat_ms, lease_ms);
        tracing::info!(target: "eccl::init", "registered with master {} as peer {peer_id}", cfg.master);
        let evicted = Arc::new(std::sync::Mutex::new(None));
        let events = tokio::spawn(watch_master(erx, abort.clone(), evicted.clone()));
        Ok(Communicator {
            cfg,
            master,
            peer_id,
            links,
            cur: None,
            abort,
            evicted,
            suspect: AtomicU32::new(executor::NO_SUSPECT),
            events,
            heartbeat,
            scratch: AlignedBuf::default(),
            inplace: AlignedBuf::default(),
            schedules: HashMap::new(),
            last_algo: HashMap::new(),
            state_digests: HashMap::new(),
            quant_scratch: Default::default(),
        })
    }
        .boxed()
    }

    /// Votes for the next epoch and waits until every live member has voted. Pending
    /// peers are admitted and departed ones dropped; the links are reconnected when the
    /// world changed.
    pub fn update_topology<'a>(&'a mut self) -> BoxFuture<'a, Result<WorldUpdate>> {
        async move {
            if let Some(e) = self.evicted_error() {
                return Err(e);
            }
            let epoch = self.epoch();
            let aborted = self.abort.check(epoch).is_some() && epoch > 0;
            let req = PeerRequest::UpdateTopology {
                peer_id: self.peer_id,
                epoch,
                min_world: self.cfg.min_world,
                aborted,
                fresh: self.unfit_links(),
            };
            let reply = self.master.request(req, self.cfg.join_timeout).await?;
            if let MasterReply::Unchanged { epoch: kept } = reply {
                // The epoch stays: this peer's world and links go on as they are.
                let c = match &self.cur {
                    Some(c) if kept == epoch => c,
                    _ => return Err(reply_error(&self.cfg.master, epoch, reply)),
                };
                return Ok(WorldUpdate {
                    epoch: c.world.epoch,
                    changed: false,
                    rank: c.rank,
                    world_size: c.size(),
                    links_kept: c.links.iter().flatten().count() as u32,
                });
            }
            let (world, keys, changed, reuse, renew) = match reply {
                MasterReply::World {
                    world,
                    keys,
                    changed,
                    reuse_links,
                    renew,
                } => (world.into_world(), keys, changed, reuse_links, renew),
                other => return Err(reply_error(&self.cfg.master, epoch, other)),
            };
            let mut links_kept = 0;
            if changed || world.epoch != epoch {
                links_kept = self.install(world, keys, reuse, &renew).await?;
            } else if let Some(c) = &self.cur {
                links_kept = c.links.iter().flatten().count() as u32;
            }
            if changed && self.cfg.optimize_topology && self.world_size() > 2 {
                // ECCL_TOPOLOGY=optimize: every member got this same new world, and
                // measures it now (the new epoch keeps members and ranks).
                self.optimize_topology().await?;
            }
            let c = self.cur.as_ref().ok_or_else(|| Error::Aborted {
                epoch,
                cause: "no world".into(),
            })?;
            Ok(WorldUpdate {
                epoch: c.world.epoch,
                changed,
                rank: c.rank,
                world_size: c.size(),
                links_kept,
            })
        }
        .boxed()
    }

    /// torch's `_reconfigure`: the next epoch is a world of exactly `members` (ranks in
    /// list order when `ordered`; else members of the current world first, in their
    /// order), once every one of them has asked for it with the same `uuid`. A `uuid` not
    /// newer than the last reconfigure's, a member that is gone, or members that name
    /// different worlds are refused, with the same error for all of them. Members of the
    /// current world left out are removed from the job.
    pub fn reconfigure<'a>(
        &'a mut self,
        uuid: u64,
        members: Vec<PeerId>,
        ordered: bool,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<WorldUpdate>> {
        async move {
        if let Some(e) = self.evicted_error() {
            return Err(e);
        }
        let epoch = self.epoch();
        let req = PeerRequest::Reconfigure {
            peer_id: self.peer_id,
            uuid,
            members,
            ordered,
        };
        let (world, keys) = match self.master.request(req, timeout).await? {
            MasterReply::World { world, keys, .. } => (world.into_world(), keys),
            other => return Err(reply_error(&self.cfg.master, epoch, other)),
        };
        // Always fresh links: the old epoch may have lost a member mid-collective.
        let new_epoch = world.epoch;
        match self.install(world, keys, false, &[]).await {
            Ok(_) => {}
            // The world is committed and this peer is in it: if the master aborted it
            // while the links connected (a member went on at once to a reconfigure of its
            // own, or died), that is news for the next collective, which fails with it,
            // not a failed reconfigure. The uuid is spent; failing here would leave the
            // caller no way to retry it (torch's contract: a singleton split right after
            // a merge, while a slower member still connects).
            Err(Error::Aborted { epoch, cause }) if epoch == new_epoch => {
                tracing::info!(target: "eccl::init", "reconfigure {uuid}: epoch {epoch} was aborted while its links connected ({cause}); the next collective reports it");
            }
            Err(e) => return Err(e),
        }
        let c = self.cur.as_ref().ok_or_else(|| Error::Aborted {
            epoch,
            cause: "no world".into(),
        })?;
        tracing::info!(target: "eccl::init", "reconfigure {uuid}: epoch {}, rank {} of {}", c.world.epoch, c.rank, c.size());
        Ok(WorldUpdate {
            epoch: c.world.epoch,
            changed: true,
            rank: c.rank,
            world_size: c.size(),
            links_kept: 0,
        })
    }
        .boxed()
    }

    /// The job's public name: a hash of its secret under a label of its own (it reveals
    /// nothing of the secret), so that a handle of another job is told apart.
    pub fn job_id(&self) -> String {
        let secret = self.cfg.secret.as_ref().expect("connect() checked it");
        secret.derive(b"eccl-job-id")[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The master addresses this peer was given (comma-separated).
    pub fn masters(&self) -> &str {
        &self.cfg.master
    }

    /// Enters `world`, whose links this peer proves and checks with `keys`; returns how
    /// many links were kept from the previous epoch.
    pub(super) async fn install(
        &mut self,
        world: World,
        keys: LinkKeys,
        reuse: bool,
        renew: &[PeerId],
    ) -> Result<u32> {
        // The master's word is checked like any other input from the network before
        // anything is indexed by rank.
        world.validate().map_err(|e| Error::MasterUnavailable {
            addr: self.cfg.master.clone(),
            reason: format!("the master sent an invalid world: {e}"),
        })?;
        let rank = world.rank_of(self.peer_id).ok_or_else(|| Error::Evicted {
            reason: format!("not a member of epoch {}", world.epoch),
        })?;
        // The links between members of both worlds carry on, also after an abort, but
        // for those either end reported unfit (`renew`, from the master, so that both
        // ends decide alike); frames of the old epoch that are still queued are dropped
        // by their epoch number. Other old links close: their peers' observers no longer
        // watch that epoch.
        let mut keep = HashMap::new();
        if let Some(old) = self.cur.take() {
            if reuse && old.world.epoch + 1 == world.epoch {
                let me = self.peer_id;
                let streams = |w: &World, p| crate::links::streams_between(w, &self.cfg, me, p);
                for (m, link) in old.world.members.iter().zip(old.links) {
                    // A link the master striped anew (or no longer) is connected again
                    // with its new count; both ends see the change in the same worlds.
                    let carries_on = world.rank_of(m.peer_id).is_some()
                        && !renew.contains(&m.peer_id)
                        && streams(&old.world, m.peer_id) == streams(&world, m.peer_id);
                    if let Some(mut link) = link.filter(|_| carries_on) {
                        link.rx.stash.retain(|f| f.header.epoch >= world.epoch);
                        keep.insert(m.peer_id, link);
                    }
                }
            }
        }
        self.schedules.clear();
        tracing::info!(
            target: "eccl::init",
            "epoch {}: rank {rank} of {} (members {:?})",
            world.epoch,
            world.size(),
            world.peer_ids()
        );
        let kept = keep.len() as u32;
        crate::fault::hit(crate::fault::Point::Connect);
        let links = match self
            .links
            .connect_world(&world, &keys, self.peer_id, &self.cfg, keep, &self.abort)
            .await
        {
            Ok(l) => l,
            Err(e) => {
                self.abort.raise(world.epoch, e.clone());
                // One empty slot per rank: whatever runs next on this epoch meets its
                // abort, never an index past the end.
                let none = (0..world.size()).map(|_| None).collect();
                self.cur = Some(Current::new(world, rank, none));
                return Err(e);
            }
        };
        self.cur = Some(Current::new(world, rank, links));
        Ok(kept)
    }

    /// The members of this epoch whose link from here cannot carry on into the next one:
    /// missing, ended, or with a send stopped halfway through a frame.
    fn unfit_links(&self) -> Vec<PeerId> {
        let Some(c) = &self.cur else {
            return Vec::new();
        };
        c.world
            .members
            .iter()
            .zip(&c.links)
            .filter(|(m, _)| m.peer_id != self.peer_id)
            .filter(|(_, l)| {
                l.as_ref()
                    .is_none_or(|l| l.tx.is_poisoned() || l.rx.link.has_ended())
            })
            .map(|(m, _)| m.peer_id)
            .collect()
    }

    /// Are peers waiting to be admitted? Every member of the epoch gets the same answer,
    /// so all of them can skip `update_topology()` together.
    pub fn are_peers_pending<'a>(&'a mut self) -> BoxFuture<'a, Result<bool>> {
        async move {
            let epoch = self.epoch();
            let req = PeerRequest::ArePeersPending {
                peer_id: self.peer_id,
                epoch,
            };
            match self.master.request(req, self.cfg.join_timeout).await? {
                MasterReply::PeersPending(p) => Ok(p),
                other => Err(reply_error(&self.cfg.master, epoch, other)),
            }
        }
        .boxed()
    }

    /// Leaves the job on purpose; the other members see a new world at their next
    /// `update_topology()`.
    pub fn leave(self) -> BoxFuture<'static, Result<()>> {
        async move {
            // No lease to renew once leaving: a heartbeat the master answered after the
            // leave ("this connection is not peer N") read as an eviction and logged a
            // warning at the end of every clean run.
            self.heartbeat.abort();
            let req = PeerRequest::Leave {
                peer_id: self.peer_id,
            };
            // The links close in order whatever the master answers (or if it is gone).
            let r = match self.master.request(req, self.cfg.connect_timeout).await {
                Ok(MasterReply::Ok) => Ok(()),
                Ok(other) => Err(reply_error(&self.cfg.master, 0, other)),
                Err(e) => Err(e),
            };
            self.close().await;
            r
        }
        .boxed()
    }

    /// Closes this peer's links in order, so that what its sends handed to them reaches
    /// the peers (a QUIC link keeps its connection until both sides are done; TCP and
    /// shared memory deliver what was sent in any case). Dropping a `Communicator`
    /// instead closes the links at once. Bounded: a peer that never finishes does not
    /// hold this up for more than a few seconds.
    pub fn close(mut self) -> BoxFuture<'static, ()> {
        async move {
        let Some(cur) = self.cur.take() else { return };
        let epoch = cur.world.epoch;
        let closes = cur.links.into_iter().flatten().map(|l| async move {
            let crate::links::PeerLink { tx, rx } = l;
            tx.close(executor::close_header(epoch)).await;
            drop(rx);
        });
        let t = std::time::Instant::now();
        futures::future::join_all(closes).await;
        self.links.quiesce().await;
        tracing::debug!(target: "eccl::net", "links of epoch {epoch} closed in {:?}", t.elapsed());
    }
        .boxed()
    }
}

/// Acts on what the master pushes: an aborted epoch (and the peer evicted with it), or
/// this peer's own eviction.
async fn watch_master(
    mut events: mpsc::UnboundedReceiver<MasterEvent>,
    abort: Arc<AbortState>,
    evicted: Arc<std::sync::Mutex<Option<String>>>,
) {
    while let Some(ev) = events.recv().await {
        match ev {
            MasterEvent::AbortEpoch {
                epoch,
                cause,
                evicted,
            } => {
                if let Some(p) = evicted {
                    abort.peer_gone(p);
                }
                abort.raise(epoch, Error::Aborted { epoch, cause })
            }
            MasterEvent::Evicted { reason } => {
                tracing::warn!(target: "eccl::init", "evicted by the master: {reason}");
                if let Ok(mut e) = evicted.lock() {
                    *e = Some(reason.clone());
                }
                abort.evicted(reason);
            }
        }
    }
}
