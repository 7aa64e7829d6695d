//! `update_topology()` rounds: the votes of a world's members, the epoch they commit
//! (or keep), the elastic world formed from pending peers, and the
//! `are_peers_pending()` queries answered from the same state.

use super::*;

impl Coordinator {
    /// A vote of `update_topology()`. The answer comes once the round completes.
    pub async fn vote(
        &self,
        peer: PeerId,
        epoch: u64,
        min_world: u32,
        aborted: bool,
        fresh: Vec<PeerId>,
        reply: ReplyTo,
    ) {
        if let Err(no) = self.round_peer(peer).await {
            return reply.send(no);
        }
        let mut st = self.state.lock().await;
        self.touch(peer);
        st.votes.insert(
            peer,
            Vote {
                reply,
                epoch,
                min_world,
                aborted,
                fresh,
            },
        );
        // A member that moved on to the next epoch will not join this epoch's sync
        // round, and will not ask whether peers are pending: answer those who wait.
        if self.raft.read(|r| r.world_of(peer).map(|w| w.epoch)) == Some(epoch) {
            let cur: Vec<PeerId> = st
                .syncs
                .iter()
                .filter(|(_, e)| e.epoch == epoch)
                .map(|(p, _)| *p)
                .collect();
            for p in cur {
                if let Some(e) = st.syncs.remove(&p) {
                    e.reply.send(aborted_reply(format!(
                        "peer {peer} left epoch {epoch} for update_topology() before the shared-state sync"
                    )));
                }
            }
            self.answer_queries(&mut st);
        }
        self.try_commit(&mut st).await;
    }

    /// Completes every world's vote round whose live members have all voted, and forms
    /// the elastic world from pending peers when there is none.
    pub(super) async fn try_commit(&self, st: &mut State) {
        // Votes of peers that are gone are answered and dropped (one read of the
        // registry for all of them: this runs at every vote).
        let gone: Vec<PeerId> = self.raft.read(|r| {
            st.votes
                .keys()
                .copied()
                .filter(|p| {
                    !matches!(r.peer(*p).map(|x| &x.state), Some(s) if !matches!(s, PeerState::Gone { .. }))
                })
                .collect()
        });
        for p in gone {
            if let Some(v) = st.votes.remove(&p) {
                v.reply.send(MasterReply::Error {
                    code: ErrorCode::Evicted,
                    message: format!("peer {p} was removed"),
                });
            }
        }
        // Only a world whose live members have all voted, or one of whose members votes
        // from another epoch, has anything to do: the others are not copied (this runs
        // at every vote, and a world of a thousand is about 100 KB).
        let votes = &st.votes;
        let (worlds, current, has_elastic) = self.raft.read(|r| {
            let (mut worlds, mut current, mut has_elastic) = (Vec::new(), Vec::new(), false);
            for e in r.worlds() {
                let epoch = e.world.epoch;
                current.push(epoch);
                has_elastic |= !e.by_reconfigure;
                // Votes first (a hash lookup each), the registry only for a member that
                // has not voted, and the scan stops at the first live one.
                let members = || e.world.members.iter().map(|m| m.peer_id);
                let behind = members().any(|m| votes.get(&m).is_some_and(|v| v.epoch != epoch));
                let all_voted = || {
                    members().all(|m| {
                        votes.contains_key(&m)
                            || !matches!(r.peer(m), Some(p) if p.state == PeerState::Member)
                    })
                };
                if behind || all_voted() {
                    worlds.push((e.world.clone(), r.live_members_of(epoch), e.by_reconfigure));
                }
            }
            (worlds, current, has_elastic)
        });
        st.trim(&current);
        for (world, members, by_reconfigure) in worlds {
            self.try_commit_world(st, world, members, !by_reconfigure)
                .await;
        }
        if !has_elastic {
            self.try_first_world(st).await;
        }
    }

    /// Pending peers that voted, in id order.
    fn pending_voters(&self, st: &State) -> Vec<PeerId> {
        let mut p: Vec<PeerId> = st
            .votes
            .keys()
            .copied()
            .filter(|p| self.known(*p) == Some(PeerState::Pending))
            .collect();
        p.sort();
        p
    }

    /// The elastic world's first epoch, once as many pending peers voted as any of them
    /// asked for.
    async fn try_first_world(&self, st: &mut State) {
        let pending = self.pending_voters(st);
        if pending.is_empty() {
            return;
        }
        let need = pending
            .iter()
            .filter_map(|p| st.votes.get(p))
            .map(|v| v.min_world)
            .max()
            .unwrap_or(1)
            .max(1);
        if pending.len() < need as usize {
            return;
        }
        self.commit(st, 0, pending, false, false).await;
    }

    /// Completes the vote round of `world` if every live member of it has voted.
    async fn try_commit_world(
        &self,
        st: &mut State,
        world: World,
        members: Vec<PeerId>,
        elastic: bool,
    ) {
        let epoch = world.epoch;
        // One world for every answer (each member gets the same).
        let world = eccl_protocol::shared_world::SharedWorld::new(world);
        // A member still in an older epoch catches up at once; it missed a commit (or
        // its world went on without the members a reconfigure took).
        let behind: Vec<PeerId> = members
            .iter()
            .copied()
            .filter(|m| st.votes.get(m).is_some_and(|v| v.epoch != epoch))
            .collect();
        if !behind.is_empty() {
            let keys = self.raft.world_keys(&world);
            for m in behind {
                if let Some(v) = st.votes.remove(&m) {
                    // Its links are older than the others' idea of "previous epoch".
                    v.reply.send(MasterReply::World {
                        keys: keys.for_member(m),
                        world: world.clone(),
                        changed: true,
                        reuse_links: false,
                        renew: vec![],
                    });
                }
            }
        }
        if members.is_empty() || !members.iter().all(|m| st.votes.contains_key(m)) {
            return;
        }
        let pending = if elastic {
            self.pending_voters(st)
        } else {
            vec![]
        };
        let lost_members = world.size() != members.len();
        let aborted = members
            .iter()
            .any(|m| st.votes.get(m).is_some_and(|v| v.aborted));
        if pending.is_empty() && !lost_members && !aborted {
            // Every voter left is in this epoch (the ones behind were answered above)
            // and has its world: it hears only that the epoch stays, from a leader a
            // quorum still follows (one whose followers died would say so without
            // anyone to agree; a commit below fails there by itself).
            let reply = match self.leads_now().await {
                true => MasterReply::Unchanged { epoch },
                false => MasterReply::Error {
                    code: ErrorCode::NotLeader,
                    message: "this master lost its quorum: membership cannot be decided".into(),
                },
            };
            for m in &members {
                if let Some(v) = st.votes.remove(m) {
                    v.reply.send(reply.clone());
                }
            }
            return;
        }
        self.commit(st, epoch, pending, lost_members, aborted).await;
    }

    /// Proposes the next epoch of the world at `epoch` (0: the elastic world's first),
    /// admitting `pending`, and answers the new world's voters.
    async fn commit(
        &self,
        st: &mut State,
        epoch: u64,
        pending: Vec<PeerId>,
        lost_members: bool,
        aborted: bool,
    ) {
        // Links between members of both epochs carry on, also after an abort or an
        // eviction (frames of the old epoch are dropped by their epoch number), but for
        // those that either end reported unfit in its vote: both ends connect those
        // again. (Connecting every link again after an abort took 6 s for a world of
        // 256 on two cores: `eccl-chaos --peers 256 --faults kill`.)
        let reuse_links = epoch != 0;
        let clean = !aborted && !st.evicted.contains(&epoch) && !st.reported.contains(&epoch);
        let unfit: Vec<(PeerId, PeerId)> = if clean {
            Vec::new()
        } else {
            st.votes
                .iter()
                .filter(|(_, v)| v.epoch == epoch)
                .flat_map(|(p, v)| v.fresh.iter().map(move |q| (*p, *q)))
                .collect()
        };
        let renew_of = |m: PeerId| -> Vec<PeerId> {
            let mut r: Vec<PeerId> = unfit
                .iter()
                .filter_map(|&(a, b)| {
                    if a == m {
                        Some(b)
                    } else if b == m {
                        Some(a)
                    } else {
                        None
                    }
                })
                .collect();
            r.sort_unstable();
            r.dedup();
            r
        };
        let cmd = Command::CommitEpoch {
            expected_epoch: epoch,
            admit: pending.clone(),
            remove: vec![],
        };
        match self.raft.propose(cmd).await {
            Ok(Outcome::Epoch(w)) => {
                tracing::info!(
                    target: "eccl::master",
                    "epoch {} committed: {} members {:?} (admitted {:?}{}{})",
                    w.epoch,
                    w.size(),
                    w.peer_ids(),
                    pending,
                    if lost_members { ", after losing members" } else { "" },
                    if aborted { ", after an abort" } else { "" }
                );
                let w = eccl_protocol::shared_world::SharedWorld::new(w);
                let keys = self.raft.world_keys(&w);
                for m in w.peer_ids() {
                    if let Some(v) = st.votes.remove(&m) {
                        v.reply.send(MasterReply::World {
                            keys: keys.for_member(m),
                            world: w.clone(),
                            changed: true,
                            reuse_links,
                            renew: renew_of(m),
                        });
                    }
                }
                // Members of the new world may have queries pending for the old epoch.
                self.answer_queries(st);
            }
            Ok(other) => tracing::warn!(target: "eccl::master", "epoch commit refused: {other:?}"),
            Err(e) => {
                let reply = propose_error(e);
                for (_, v) in st.votes.drain() {
                    v.reply.send(reply.clone());
                }
            }
        }
    }

    /// An `are_peers_pending()` query; answered to all members at once.
    pub async fn pending_query(&self, peer: PeerId, epoch: u64, reply: ReplyTo) {
        let mut st = self.state.lock().await;
        st.queries.insert(peer, (reply, epoch));
        self.answer_queries(&mut st);
    }

    pub(super) fn answer_queries(&self, st: &mut State) {
        // Nothing to answer: skip the walk over every world's members (a job of
        // thousands leaving at its end removed them one by one, each removal walking
        // every world: quadratic in the job's size).
        if st.queries.is_empty() {
            return;
        }
        let worlds: Vec<(u64, Vec<PeerId>, bool)> = self.raft.read(|r| {
            r.worlds()
                .map(|e| {
                    (
                        e.world.epoch,
                        r.live_members_of(e.world.epoch),
                        !e.by_reconfigure,
                    )
                })
                .collect()
        });
        // Someone outside its world's current epoch must call update_topology() to catch
        // up.
        let stale: Vec<PeerId> = st
            .queries
            .iter()
            .filter(|(p, (_, e))| {
                !worlds
                    .iter()
                    .any(|(epoch, m, _)| epoch == e && m.contains(p))
            })
            .map(|(p, _)| *p)
            .collect();
        for p in stale {
            if let Some((r, _)) = st.queries.remove(&p) {
                r.send(MasterReply::PeersPending(true));
            }
        }
        let pending_voter = st
            .votes
            .keys()
            .any(|p| self.known(*p) == Some(PeerState::Pending));
        for (epoch, members, elastic) in worlds {
            let voted = members
                .iter()
                .any(|m| st.votes.get(m).is_some_and(|v| v.epoch == epoch));
            if members.is_empty() || (!voted && !members.iter().all(|m| st.queries.contains_key(m)))
            {
                continue;
            }
            // A member that already voted for the next epoch waits for the others: the
            // answer must send them to update_topology() too; so must a newcomer waiting
            // to be admitted to the elastic world.
            let waiting = voted || (elastic && pending_voter);
            for m in &members {
                if let Some((r, _)) = st.queries.remove(m) {
                    r.send(MasterReply::PeersPending(waiting));
                }
            }
        }
    }
}
