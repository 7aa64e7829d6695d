//! torch's `_reconfigure(uuid, handles)` on the master: every member named in the
//! handles asks for the same world with the same uuid; once all of them have, the world
//! is committed through raft as the next epoch and each gets it. Until then the requests
//! wait here, in the leader's memory (a new leader hears them again as peers resend).

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
        // Members that named different worlds under one uuid all hear so.
        let clash = st
            .reconfigs
            .values()
            .any(|r| r.uuid == uuid && (r.members != req.members || r.ordered != req.ordered));
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
        if let Some(last) = self.raft.read(|r| r.last_uuid()).filter(|l| uuid <= *l) {
            return Some(refused(
                ErrorCode::InvalidArgument,
                format!("reconfigure uuid {uuid} is not newer than the last one ({last}): pass a fresh, larger uuid"),
            ));
        }
        for (i, p) in members.iter().enumerate() {
            if members[..i].contains(p) {
                return Some(refused(
                    ErrorCode::InvalidArgument,
                    format!("peer {p} is named twice in reconfigure {uuid}"),
                ));
            }
            match state(*p) {
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
        let old = self.raft.read(|r| (r.epoch(), r.live_members()));
        let cmd = Command::Reconfigure {
            uuid,
            members: members.clone(),
            ordered,
        };
        match self.raft.propose(cmd).await {
            Ok(Outcome::Epoch(w)) => {
                let (epoch, before) = old;
                let dropped: Vec<PeerId> = before
                    .iter()
                    .copied()
                    .filter(|p| w.rank_of(*p).is_none())
                    .collect();
                tracing::info!(
                    target: "eccl::master",
                    "epoch {} committed by reconfigure {uuid}: {} members {:?}{}",
                    w.epoch,
                    w.size(),
                    w.peer_ids(),
                    if dropped.is_empty() { String::new() } else { format!(" (left out: {dropped:?})") }
                );
                for m in w.peer_ids() {
                    if let Some(r) = st.reconfigs.remove(&m) {
                        r.reply.send(MasterReply::World {
                            keys: self.raft.link_keys(&w, m),
                            world: w.clone(),
                            changed: true,
                            reuse_links: false,
                        });
                    }
                }
                // Members left out stop at once: their calls of the old epoch fail and
                // they are out of the job.
                for p in &dropped {
                    self.forget(*p);
                    if let Some(c) = st.conns.remove(p) {
                        for ev in [
                            MasterEvent::AbortEpoch {
                                epoch,
                                cause: format!("left out of the world by reconfigure {uuid}"),
                                evicted: None,
                            },
                            MasterEvent::Evicted {
                                reason: format!("left out of the world by reconfigure {uuid}"),
                            },
                        ] {
                            let _ = c.try_send(super::Outgoing::event(ev));
                        }
                    }
                    if let Some(r) = st.reconfigs.remove(p) {
                        r.reply.send(refused(
                            ErrorCode::Evicted,
                            format!("left out of the world by reconfigure {uuid}"),
                        ));
                    }
                }
                // update_topology() votes of the old epoch now catch up or end.
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
