//! The replicated registry: who registered, who is a member, and the world of the
//! current epoch. A pure state machine: `apply` is deterministic, so every master that
//! applies the same raft log holds the same registry (guarantee G6 rests on this).
//!
//! Only decisions live here. Heartbeats, votes in progress and connections live in the
//! leader's memory ([`crate::coordinator`]).

use std::collections::BTreeMap;

use eccl_protocol::{Member, PeerId, World};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PeerState {
    /// Registered, waiting for admission at the next epoch.
    Pending,
    /// Member of the current world.
    Member,
    /// Evicted or left; never part of a later epoch (G4). It may register again and
    /// gets a new id.
    Gone { reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRecord {
    pub addr: String,
    pub host: String,
    pub quic: Option<String>,
    pub shm: Option<String>,
    pub rank_hint: Option<u32>,
    pub state: PeerState,
    /// The credential the peer attaches with after a master fail-over.
    pub token: [u8; 32],
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    Register {
        addr: String,
        host: String,
        quic: Option<String>,
        shm: Option<String>,
        rank_hint: Option<u32>,
        /// Chosen at random by the leader that took the registration.
        token: [u8; 32],
    },
    /// Commit the next epoch if the current one is still `expected_epoch` (a
    /// compare-and-set, so a stale leader cannot commit over a newer epoch).
    CommitEpoch {
        expected_epoch: u64,
        admit: Vec<PeerId>,
        remove: Vec<PeerId>,
    },
    /// The peer is gone for good (lease lapsed, link failures, hang).
    Evict { peer: PeerId, reason: String },
    /// The peer leaves on purpose.
    Leave { peer: PeerId },
    /// A sync round of `epoch` settled on `revision` with content `hash`, as `plan` says.
    /// `inputs` names each member's report (its round and a fingerprint of what it
    /// held), so that a leader that takes over can answer a member that did not hear the
    /// plan, and only that member's same report.
    StateRevision {
        epoch: u64,
        inputs: Vec<(PeerId, u64, [u8; 32])>,
        revision: u64,
        hash: [u8; 32],
        plan: eccl_protocol::MasterReply,
    },
    /// A change to the key-value store (sessions, scopes, keys).
    Store(crate::store::StoreCommand),
    // New variants go last: raft logs on disk name variants by their index.
    /// torch's `_reconfigure`: the next epoch is a world of exactly `members` (ranks in
    /// list order when `ordered`), if `uuid` is newer than every earlier one. Members of
    /// the current world left out are gone (G4: they never come back under their id).
    Reconfigure {
        uuid: u64,
        members: Vec<PeerId>,
        ordered: bool,
    },
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    #[default]
    Nothing,
    Registered(PeerId),
    Epoch(World),
    /// The peer is now gone; `was_member` says whether the current epoch lost a member
    /// (and so must be aborted).
    Removed {
        peer: PeerId,
        was_member: bool,
        epoch: u64,
    },
    Rejected(String),
    /// The answer to a store command, or why it was refused (nothing changed).
    Store(Result<eccl_protocol::StoreReply, String>),
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    next_peer_id: PeerId,
    peers: BTreeMap<PeerId, PeerRecord>,
    epoch: u64,
    world: Option<World>,
    /// The last shared state the members agreed on: (epoch, revision, hash).
    state_revision: Option<(u64, u64, [u8; 32])>,
    /// The newest sync plan: (epoch, round, the reply every member of the round gets).
    last_plan: Option<(
        u64,
        Vec<(PeerId, u64, [u8; 32])>,
        eccl_protocol::MasterReply,
    )>,
    /// The key-value store (torchrun's rendezvous and stores).
    store: crate::store::Store,
    /// The uuid of the last committed reconfigure: a later one must be newer.
    last_uuid: Option<u64>,
}

/// Departed peers remembered (so that their late requests are told they are gone);
/// older ones are forgotten and get "unknown peer" instead.
pub const MAX_GONE: usize = 1024;
/// Peers registered and not gone at once: a job of the largest world, with room for
/// newcomers, and a bound on what registrations can make a master hold.
pub const MAX_LIVE: usize = 4 * eccl_protocol::MAX_WORLD_SIZE;

impl Registry {
    pub fn apply(&mut self, cmd: &Command) -> Outcome {
        let out = self.apply_one(cmd);
        self.prune();
        out
    }

    /// Forgets all but the [`MAX_GONE`] most recent departed peers. Deterministic, so
    /// every replica prunes alike.
    fn prune(&mut self) {
        let gone: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|(_, r)| matches!(r.state, PeerState::Gone { .. }))
            .map(|(p, _)| *p)
            .collect();
        if gone.len() > MAX_GONE {
            for p in &gone[..gone.len() - MAX_GONE] {
                self.peers.remove(p);
            }
        }
    }

    fn apply_one(&mut self, cmd: &Command) -> Outcome {
        match cmd {
            Command::Register {
                addr,
                host,
                quic,
                shm,
                rank_hint,
                token,
            } => {
                let live = self
                    .peers
                    .values()
                    .filter(|r| !matches!(r.state, PeerState::Gone { .. }))
                    .count();
                if live >= MAX_LIVE {
                    return Outcome::Rejected(format!(
                        "{live} peers are registered already (at most {MAX_LIVE})"
                    ));
                }
                let id = PeerId(self.next_peer_id.0.max(1));
                self.next_peer_id = PeerId(id.0 + 1);
                self.peers.insert(
                    id,
                    PeerRecord {
                        addr: addr.clone(),
                        host: host.clone(),
                        quic: quic.clone(),
                        shm: shm.clone(),
                        rank_hint: *rank_hint,
                        state: PeerState::Pending,
                        token: *token,
                    },
                );
                Outcome::Registered(id)
            }
            Command::CommitEpoch {
                expected_epoch,
                admit,
                remove,
            } => self.commit_epoch(*expected_epoch, admit, remove),
            Command::Reconfigure {
                uuid,
                members,
                ordered,
            } => self.reconfigure(*uuid, members, *ordered),
            Command::Evict { peer, reason } => self.remove(*peer, reason.clone()),
            Command::Leave { peer } => self.remove(*peer, "left".to_string()),
            Command::StateRevision {
                epoch,
                inputs,
                revision,
                hash,
                plan,
            } => {
                // Revisions only grow; a stale leader's late record changes nothing.
                if self.state_revision.is_none_or(|(_, r, _)| *revision >= r) {
                    self.state_revision = Some((*epoch, *revision, *hash));
                }
                // Two records of one round (a dying leader's and its successor's) share
                // an input: the first committed is the round's.
                let same_round = self.last_plan.as_ref().is_some_and(|(e, old, _)| {
                    e == epoch && old.iter().any(|i| inputs.contains(i))
                });
                if !same_round {
                    self.last_plan = Some((*epoch, inputs.clone(), plan.clone()));
                }
                Outcome::Nothing
            }
            Command::Store(cmd) => Outcome::Store(self.store.apply(cmd)),
        }
    }

    fn remove(&mut self, peer: PeerId, reason: String) -> Outcome {
        let Some(rec) = self.peers.get_mut(&peer) else {
            return Outcome::Rejected(format!("unknown peer {peer}"));
        };
        if matches!(rec.state, PeerState::Gone { .. }) {
            return Outcome::Removed {
                peer,
                was_member: false,
                epoch: self.epoch,
            };
        }
        let was_member = rec.state == PeerState::Member;
        rec.state = PeerState::Gone { reason };
        Outcome::Removed {
            peer,
            was_member,
            epoch: self.epoch,
        }
    }

    fn commit_epoch(&mut self, expected: u64, admit: &[PeerId], remove: &[PeerId]) -> Outcome {
        if expected != self.epoch {
            return Outcome::Rejected(format!("epoch is {} not {expected}", self.epoch));
        }
        for p in remove {
            if let Some(rec) = self.peers.get_mut(p) {
                if !matches!(rec.state, PeerState::Gone { .. }) {
                    rec.state = PeerState::Gone {
                        reason: "removed at epoch change".into(),
                    };
                }
            }
        }
        // Survivors keep their relative order; newcomers follow, by rank hint then id.
        let mut members: Vec<PeerId> = self
            .world
            .iter()
            .flat_map(|w| w.members.iter().map(|m| m.peer_id))
            .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Member))
            .collect();
        let mut newcomers: Vec<PeerId> = admit
            .iter()
            .copied()
            .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Pending))
            .collect();
        newcomers.sort_by_key(|p| (self.peers[p].rank_hint.unwrap_or(u32::MAX), *p));
        newcomers.dedup();
        members.extend(newcomers);
        if members.is_empty() {
            return Outcome::Rejected("an epoch needs at least one member".into());
        }
        self.epoch += 1;
        let world = self.world_of(&members);
        self.world = Some(world.clone());
        Outcome::Epoch(world)
    }

    fn reconfigure(&mut self, uuid: u64, listed: &[PeerId], ordered: bool) -> Outcome {
        if let Some(last) = self.last_uuid.filter(|l| uuid <= *l) {
            return Outcome::Rejected(format!(
                "reconfigure uuid {uuid} is not newer than the last one ({last}): pass a fresh, larger uuid"
            ));
        }
        if listed.is_empty() || listed.len() > eccl_protocol::MAX_WORLD_SIZE {
            return Outcome::Rejected(format!(
                "a world of {} members (1 to {})",
                listed.len(),
                eccl_protocol::MAX_WORLD_SIZE
            ));
        }
        for (i, p) in listed.iter().enumerate() {
            match self.peers.get(p).map(|r| &r.state) {
                None => return Outcome::Rejected(format!("peer {p} is not registered")),
                Some(PeerState::Gone { reason }) => {
                    return Outcome::Rejected(format!("peer {p} is gone ({reason})"))
                }
                Some(_) if listed[..i].contains(p) => {
                    return Outcome::Rejected(format!("peer {p} is named twice"))
                }
                Some(_) => {}
            }
        }
        let mut members = listed.to_vec();
        if !ordered {
            // A set: members of the current world keep their order, the others follow
            // by rank hint, then id.
            let rank = |p: &PeerId| {
                self.world
                    .as_ref()
                    .and_then(|w| w.rank_of(*p))
                    .map_or(u32::MAX, |r| r.0)
            };
            members.sort_by_key(|p| (rank(p), self.peers[p].rank_hint.unwrap_or(u32::MAX), *p));
        }
        for p in self.live_members() {
            if !members.contains(&p) {
                if let Some(rec) = self.peers.get_mut(&p) {
                    rec.state = PeerState::Gone {
                        reason: format!("left out of the world by reconfigure {uuid}"),
                    };
                }
            }
        }
        self.last_uuid = Some(uuid);
        self.epoch += 1;
        let world = self.world_of(&members);
        self.world = Some(world.clone());
        Outcome::Epoch(world)
    }

    /// The world of the current epoch made of `members` in this order; each becomes a
    /// member.
    fn world_of(&mut self, members: &[PeerId]) -> World {
        World {
            epoch: self.epoch,
            members: members
                .iter()
                .enumerate()
                .map(|(rank, p)| {
                    let rec = self.peers.get_mut(p).expect("checked by the caller");
                    rec.state = PeerState::Member;
                    Member {
                        peer_id: *p,
                        rank: eccl_protocol::Rank(rank as u32),
                        addr: rec.addr.clone(),
                        host: rec.host.clone(),
                        quic: rec.quic.clone(),
                        shm: rec.shm.clone(),
                    }
                })
                .collect(),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The uuid of the last committed reconfigure.
    pub fn last_uuid(&self) -> Option<u64> {
        self.last_uuid
    }

    /// The last agreed shared state: (epoch, revision, hash).
    pub fn state_revision(&self) -> Option<(u64, u64, [u8; 32])> {
        self.state_revision
    }

    /// The plan of the newest sync round of `epoch`, if `input` (a member's round and
    /// fingerprint) was one of its reports.
    pub fn plan_for(
        &self,
        epoch: u64,
        input: &(PeerId, u64, [u8; 32]),
    ) -> Option<&eccl_protocol::MasterReply> {
        self.last_plan
            .as_ref()
            .filter(|(e, inputs, _)| *e == epoch && inputs.contains(input))
            .map(|(_, _, p)| p)
    }

    pub fn store(&self) -> &crate::store::Store {
        &self.store
    }

    pub fn world(&self) -> Option<&World> {
        self.world.as_ref()
    }

    pub fn peer(&self, id: PeerId) -> Option<&PeerRecord> {
        self.peers.get(&id)
    }

    /// Members of the current world that are still members (not evicted since).
    pub fn live_members(&self) -> Vec<PeerId> {
        self.world
            .iter()
            .flat_map(|w| w.members.iter().map(|m| m.peer_id))
            .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Member))
            .collect()
    }

    /// Every peer that is not gone (pending or member): the ones a new leader gives a
    /// lease.
    pub fn live_peers(&self) -> Vec<PeerId> {
        self.peers
            .iter()
            .filter(|(_, r)| !matches!(r.state, PeerState::Gone { .. }))
            .map(|(p, _)| *p)
            .collect()
    }

    pub fn pending(&self) -> Vec<PeerId> {
        self.peers
            .iter()
            .filter(|(_, r)| r.state == PeerState::Pending)
            .map(|(p, _)| *p)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(r: &mut Registry, hint: Option<u32>) -> PeerId {
        match r.apply(&Command::Register {
            addr: "127.0.0.1:1".into(),
            host: "h".into(),
            quic: None,
            shm: None,
            rank_hint: hint,
            token: [7; 32],
        }) {
            Outcome::Registered(id) => id,
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn first_world_follows_rank_hints_and_epochs_grow() {
        let mut r = Registry::default();
        let a = reg(&mut r, Some(2));
        let b = reg(&mut r, Some(0));
        let c = reg(&mut r, Some(1));
        let Outcome::Epoch(w) = r.apply(&Command::CommitEpoch {
            expected_epoch: 0,
            admit: vec![a, b, c],
            remove: vec![],
        }) else {
            panic!()
        };
        assert_eq!(w.epoch, 1);
        assert_eq!(w.peer_ids(), vec![b, c, a]);
        // A stale commit is refused: one epoch number never names two worlds.
        assert!(matches!(
            r.apply(&Command::CommitEpoch {
                expected_epoch: 0,
                admit: vec![],
                remove: vec![]
            }),
            Outcome::Rejected(_)
        ));
        let d = reg(&mut r, None);
        assert!(matches!(
            r.apply(&Command::Evict {
                peer: c,
                reason: "killed".into()
            }),
            Outcome::Removed {
                was_member: true,
                ..
            }
        ));
        let Outcome::Epoch(w2) = r.apply(&Command::CommitEpoch {
            expected_epoch: 1,
            admit: vec![d, c],
            remove: vec![],
        }) else {
            panic!()
        };
        assert_eq!(w2.epoch, 2);
        // Survivors keep their order, the evicted peer does not come back (G4).
        assert_eq!(w2.peer_ids(), vec![b, a, d]);
        assert_eq!(
            w2.members.iter().map(|m| m.rank.0).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn reconfigure_makes_exactly_the_named_world_once_per_uuid() {
        let mut r = Registry::default();
        let (a, b, c) = (reg(&mut r, None), reg(&mut r, None), reg(&mut r, None));
        let rc = |uuid, members: Vec<PeerId>, ordered| Command::Reconfigure {
            uuid,
            members,
            ordered,
        };
        // The first world comes from pending peers, ranks in list order.
        let Outcome::Epoch(w) = r.apply(&rc(5, vec![c, a, b], true)) else {
            panic!()
        };
        assert_eq!((w.epoch, w.peer_ids()), (1, vec![c, a, b]));
        // A uuid not newer than the last is refused and changes nothing.
        for uuid in [5, 4] {
            assert!(
                matches!(r.apply(&rc(uuid, vec![a, b], true)), Outcome::Rejected(m) if m.contains("not newer"))
            );
        }
        assert_eq!(r.epoch(), 1);
        // A set keeps the current order; the member left out is gone for good.
        let Outcome::Epoch(w) = r.apply(&rc(6, vec![b, c], false)) else {
            panic!()
        };
        assert_eq!((w.epoch, w.peer_ids()), (2, vec![c, b]));
        assert!(matches!(r.peer(a).unwrap().state, PeerState::Gone { .. }));
        assert!(
            matches!(r.apply(&rc(7, vec![a, b], true)), Outcome::Rejected(m) if m.contains("gone"))
        );
        // A newcomer grows the world.
        let d = reg(&mut r, None);
        let Outcome::Epoch(w) = r.apply(&rc(8, vec![b, c, d], true)) else {
            panic!()
        };
        assert_eq!(w.peer_ids(), vec![b, c, d]);
        assert!(
            matches!(r.apply(&rc(9, vec![b, b], true)), Outcome::Rejected(m) if m.contains("twice"))
        );
    }

    #[test]
    fn unknown_peers_are_rejected() {
        let mut r = Registry::default();
        assert!(matches!(
            r.apply(&Command::Evict {
                peer: PeerId(42),
                reason: String::new()
            }),
            Outcome::Rejected(_)
        ));
        assert!(matches!(
            r.apply(&Command::CommitEpoch {
                expected_epoch: 0,
                admit: vec![PeerId(42)],
                remove: vec![]
            }),
            Outcome::Rejected(_)
        ));
    }
}
