//! `optimize_topology()` on the master: every member of a world reports what it
//! measured of its links; once all live members of the epoch have, the measurements are
//! committed through raft, and the world goes on at a new epoch with the ring the
//! registry solves from them (same members, same ranks). Until then the reports wait
//! here, in the leader's memory (a new leader hears them again as peers resend).

use eccl_protocol::{ErrorCode, LinkMeasure, MasterReply, PeerId};

use super::{propose_error, refused, Coordinator, ReplyTo, State};
use crate::registry::{Command, Outcome};

/// One member's report, waiting for the others of its epoch.
pub(super) struct Report {
    reply: ReplyTo,
    epoch: u64,
    links: Vec<LinkMeasure>,
}

impl Coordinator {
    /// A member's measurements of its links in `epoch`; answered with the next epoch's
    /// world once every live member of `epoch` has reported.
    pub async fn topology(
        &self,
        peer: PeerId,
        epoch: u64,
        links: Vec<LinkMeasure>,
        reply: ReplyTo,
    ) {
        if let Err(no) = self.round_peer(peer).await {
            return reply.send(no);
        }
        let members = self.raft.read(|r| r.live_members_of(epoch));
        if !members.contains(&peer) {
            return reply.send(refused(
                ErrorCode::Aborted,
                format!("peer {peer} is not a live member of epoch {epoch} (the world moved on)"),
            ));
        }
        if links.len() > eccl_protocol::MAX_WORLD_SIZE {
            return reply.send(refused(
                ErrorCode::InvalidArgument,
                format!(
                    "{} link measurements (at most {})",
                    links.len(),
                    eccl_protocol::MAX_WORLD_SIZE
                ),
            ));
        }
        let mut st = self.state.lock().await;
        if st.evicted.contains(&epoch) || st.reported.contains(&epoch) {
            // Aborted: its links are suspect, and its measurements with them.
            return reply.send(refused(
                ErrorCode::Aborted,
                format!("epoch {epoch} was aborted: call update_topology() and measure again"),
            ));
        }
        self.touch(peer);
        if let Some(old) = st.topologies.insert(
            peer,
            Report {
                reply,
                epoch,
                links,
            },
        ) {
            old.reply.send(refused(
                ErrorCode::Aborted,
                format!("replaced by a newer optimize_topology() of epoch {epoch}"),
            ));
        }
        if !members
            .iter()
            .all(|m| st.topologies.get(m).is_some_and(|r| r.epoch == epoch))
        {
            return;
        }
        let rows: Vec<(PeerId, Vec<LinkMeasure>)> = members
            .iter()
            .map(|m| (*m, st.topologies[m].links.clone()))
            .collect();
        match self.raft.propose(Command::Topology { epoch, rows }).await {
            Ok(Outcome::Epoch(w)) => {
                tracing::info!(
                    target: "eccl::master",
                    "epoch {} committed by optimize_topology() of epoch {epoch}: ring {:?}",
                    w.epoch,
                    w.ring
                );
                let w = eccl_protocol::shared_world::SharedWorld::new(w);
                let keys = self.raft.world_keys(&w);
                for m in w.peer_ids() {
                    if let Some(r) = st.topologies.remove(&m) {
                        r.reply.send(MasterReply::World {
                            keys: keys.for_member(m),
                            world: w.clone(),
                            changed: true,
                            reuse_links: true,
                            renew: vec![],
                        });
                    }
                }
                self.try_commit(&mut st).await;
                self.answer_queries(&mut st);
            }
            Ok(Outcome::Rejected(why)) => {
                self.answer_topology(&mut st, epoch, refused(ErrorCode::Aborted, why))
            }
            Ok(other) => self.answer_topology(
                &mut st,
                epoch,
                refused(
                    ErrorCode::Internal,
                    format!("optimize_topology(): {other:?}"),
                ),
            ),
            Err(e) => self.answer_topology(&mut st, epoch, propose_error(e)),
        }
    }

    /// Every member waiting in `epoch`'s optimize_topology() gets `reply`.
    fn answer_topology(&self, st: &mut State, epoch: u64, reply: MasterReply) {
        let hit: Vec<PeerId> = st
            .topologies
            .iter()
            .filter(|(_, r)| r.epoch == epoch)
            .map(|(p, _)| *p)
            .collect();
        for p in hit {
            if let Some(r) = st.topologies.remove(&p) {
                r.reply.send(reply.clone());
            }
        }
    }

    /// `peer` is gone: the optimize_topology() of its epoch cannot complete, and every
    /// member waiting in it hears why (their epoch is aborted anyway).
    pub(super) fn topology_lost(&self, st: &mut State, peer: PeerId, epoch: u64, reason: &str) {
        st.topologies.remove(&peer);
        let why = format!("peer {peer} was lost during optimize_topology() ({reason})");
        self.answer_topology(st, epoch, refused(ErrorCode::Aborted, why));
    }
}
