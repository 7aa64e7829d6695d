//! torch's `_reconfigure(uuid, handles)` on the master: every member named in the
//! handles asks for the same world with the same uuid; once all of them have, the world
//! is committed through raft at a new epoch and each gets it. Until then the requests
//! wait here, in the leader's memory (a new leader hears them again as peers resend).
//!
//! A reconfigure changes only who it names, and only with their agreement: the worlds
//! its members come from go on with the others, whose calls of the old epoch fail at
//! once (they were waiting on members that left) and whose next update_topology() gets
//! their smaller world. Nobody is evicted by it (see `crate::registry`).

use eccl_protocol::{ErrorCode, MasterEvent, MasterReply, PeerId};

use super::{propose_error, refused, Coordinator, ReplyTo, State};
use crate::registry::{Command, Outcome, PeerState};

/// One member's request, waiting for the others named in it.
pub(super) struct Request {
    reply: ReplyTo,
    uuid: u64,
    members: Vec<PeerId>,
    ordered: bool,
}

impl Coordinator {
    /// A member's `reconfigure(uuid, members)`; answered once every member named has
    /// asked for the same world, or with the error they all get.
    pub async fn reconfigure(
        &self,
        peer: PeerId,
        uuid: u64,
        members: Vec<PeerId>,
        ordered: bool,
        reply: ReplyTo,
    ) {
        if !self.caught_up().await {
            return reply.send(self.not_leader());
        }
        if let Some(why) = self.check_request(peer, uuid, &members) {
            return reply.send(why);
        }
        let mut st = self.state.lock().await;
        self.touch(peer);
        let req = Request {
            reply,
            uuid,
            members,
            ordered,
        };
        // Members that named different worlds under one uuid all hear so. A peer that is
        // not among the members of the request it clashes with cannot fail theirs: only
        // its own is refused.
        // Requests waiting under one uuid all name the same world (a clash fails them
        // all), so one of them stands for the rest: comparing with each would cost the
        // world's size squared per request.
        let clashing = st
            .reconfigs
            .values()
            .find(|r| r.uuid == uuid)
            .filter(|r| r.members != req.members || r.ordered != req.ordered);
        if clashing.is_some_and(|r| !r.members.contains(&peer)) {
            return req.reply.send(refused(
                ErrorCode::InvalidArgument,
                format!("reconfigure {uuid} is in progress for other members"),
            ));
        }
        let clash = clashing.is_some();
        if let Some(old) = st.reconfigs.insert(peer, req) {
            if old.uuid != uuid {
                old.reply.send(refused(
                    ErrorCode::Aborted,
                    format!("reconfigure {} replaced by reconfigure {uuid}", old.uuid),
                ));
            }
        }
        if clash {
            let why = format!(
                "the members of reconfigure {uuid} passed different handles (or one a list, another a set)"
            );
            return self.fail_reconfigure(&mut st, uuid, ErrorCode::InvalidArgument, why);
        }
        self.try_reconfigure(&mut st, uuid).await;
    }

    /// Why a request cannot be met whatever the others do, if it cannot.
    fn check_request(&self, peer: PeerId, uuid: u64, members: &[PeerId]) -> Option<MasterReply> {
        let state = |p: PeerId| self.known(p);
        match state(peer) {
            None => {
                return Some(refused(
                    ErrorCode::UnknownPeer,
                    format!("peer {peer} is not registered"),
                ))
            }
            Some(PeerState::Gone { reason }) => return Some(refused(ErrorCode::Evicted, reason)),
            _ => {}
        }
        if !members.contains(&peer) {
            return Some(refused(
                ErrorCode::InvalidArgument,
                format!("peer {peer} is not among the handles it passed to reconfigure {uuid}"),
            ));
        }
        if members.len() > eccl_protocol::MAX_WORLD_SIZE {
            return Some(refused(
                ErrorCode::InvalidArgument,
                format!(
                    "{} handles (at most {})",
                    members.len(),
                    eccl_protocol::MAX_WORLD_SIZE
                ),
            ));
        }
        if self.raft.read(|r| r.uuid_used(uuid)) {
            return Some(refused(
                ErrorCode::InvalidArgument,
                format!("reconfigure uuid {uuid} was already used in this job: pass a fresh one"),
            ));
        }
        // One read of the registry and a set for every member named: a world of a
        // thousand asks this of each of its members.
        self.raft.read(|r| {
            let mut seen = std::collections::HashSet::with_capacity(members.len());
            for p in members {
                if !seen.insert(*p) {
                    return Some(refused(
                        ErrorCode::InvalidArgument,
                        format!("peer {p} is named twice in reconfigure {uuid}"),
                    ));
                }
                match r.peer(*p).map(|x| &x.state) {
                    None => {
                        return Some(refused(
                            ErrorCode::InvalidArgument,
                            format!("peer {p} named in reconfigure {uuid} is not registered"),
                        ))
                    }
                    Some(PeerState::Gone { reason }) => {
                        return Some(refused(
                            ErrorCode::Aborted,
                            format!("peer {p} named in reconfigure {uuid} is gone ({reason})"),
                        ))
                    }
                    _ => {}
                }
            }
            None
        })
    }

    /// Commits reconfigure `uuid` if every member it names has asked for it.
    async fn try_reconfigure(&self, st: &mut State, uuid: u64) {
        let Some((members, ordered)) = st
            .reconfigs
            .values()
            .find(|r| r.uuid == uuid)
            .map(|r| (r.members.clone(), r.ordered))
        else {
            return;
        };
        if !members
            .iter()
            .all(|m| st.reconfigs.get(m).is_some_and(|r| r.uuid == uuid))
        {
            return;
        }
        let cmd = Command::Reconfigure {
            uuid,
            members: members.clone(),
            ordered,
        };
        match self.raft.propose(cmd).await {
            Ok(Outcome::Reconfigured {
                world: w,
                remainders,
            }) => {
                tracing::info!(
                    target: "eccl::master",
                    "epoch {} committed by reconfigure {uuid}: {} members {:?}{}",
                    w.epoch,
                    w.size(),
                    w.peer_ids(),
                    remainders
                        .iter()
                        .map(|(was, r)| format!("; world of epoch {was} goes on as epoch {} with {:?}", r.epoch, r.peer_ids()))
                        .collect::<String>()
                );
                let w = eccl_protocol::shared_world::SharedWorld::new(w);
                let keys = self.raft.world_keys(&w);
                for m in w.peer_ids() {
                    if let Some(r) = st.reconfigs.remove(&m) {
                        r.reply.send(MasterReply::World {
                            keys: keys.for_member(m),
                            world: w.clone(),
                            changed: true,
                            reuse_links: false,
                            renew: vec![],
                        });
                    }
                }
                // The members a reconfigure did not name stop their calls of the old
                // epoch at once (they wait on members that left); their next
                // update_topology() gets the world that went on without them.
                for (was, rest) in &remainders {
                    let ev = MasterEvent::AbortEpoch {
                        epoch: *was,
                        cause: format!("members {:?} left for reconfigure {uuid}", w.peer_ids()),
                        evicted: None,
                    };
                    for p in rest.peer_ids() {
                        if let Some(c) = st.conns.get(&p) {
                            let _ = c.try_send(super::Outgoing::event(ev.clone()));
                        }
                    }
                }
                // update_topology() votes of the old epochs now catch up.
                self.try_commit(st).await;
                self.answer_queries(st);
            }
            Ok(Outcome::Rejected(why)) => {
                self.fail_reconfigure(st, uuid, ErrorCode::InvalidArgument, why)
            }
            Ok(other) => self.fail_reconfigure(
                st,
                uuid,
                ErrorCode::Internal,
                format!("reconfigure {uuid}: {other:?}"),
            ),
            Err(e) => {
                let reply = propose_error(e);
                self.answer_reconfigure(st, |r| r.uuid == uuid, reply);
            }
        }
    }

    /// Every member waiting in reconfigure `uuid` gets the same error.
    fn fail_reconfigure(&self, st: &mut State, uuid: u64, code: ErrorCode, message: String) {
        tracing::info!(target: "eccl::master", "reconfigure {uuid} refused: {message}");
        self.answer_reconfigure(st, |r| r.uuid == uuid, refused(code, message));
    }

    fn answer_reconfigure(
        &self,
        st: &mut State,
        which: impl Fn(&Request) -> bool,
        reply: MasterReply,
    ) {
        let hit: Vec<PeerId> = st
            .reconfigs
            .iter()
            .filter(|(_, r)| which(r))
            .map(|(p, _)| *p)
            .collect();
        for p in hit {
            if let Some(r) = st.reconfigs.remove(&p) {
                r.reply.send(reply.clone());
            }
        }
    }

    /// `peer` is gone: reconfigures that name it cannot happen, and everyone waiting in
    /// one hears why.
    pub(super) fn reconfigure_lost(&self, st: &mut State, peer: PeerId, reason: &str) {
        let uuids: Vec<u64> = st
            .reconfigs
            .values()
            .filter(|r| r.members.contains(&peer))
            .map(|r| r.uuid)
            .collect();
        for uuid in uuids {
            self.fail_reconfigure(
                st,
                uuid,
                ErrorCode::Aborted,
                format!("peer {peer} named in reconfigure {uuid} is gone ({reason})"),
            );
        }
    }
}
