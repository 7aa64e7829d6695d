//! The replicated registry: who registered, who is a member of which world, and each
//! world's current epoch. A pure state machine: `apply` is deterministic, so every master
//! that applies the same raft log holds the same registry (guarantee G6 rests on this).
//!
//! **Worlds.** A job usually has one world, formed and grown by `update_topology()`: the
//! *elastic* world, the one that admits pending peers. torch's `_reconfigure` can split a
//! job into several disjoint worlds and merge them again: a reconfigure forms a world of
//! exactly the peers it names (all of whom asked for it), and the worlds they came from
//! go on with the members that were not named, each at a new epoch of its own. Nobody is
//! ever removed by someone else's reconfigure: a member leaves a world only by asking to
//! (a reconfigure that names it, `leave`), or by failing (eviction). Every world takes
//! its epoch numbers from one counter, so an epoch number names one world (G6) and a
//! member's epochs only grow. Reconfigure uuids are unique per job (a reused one is
//! refused), with no order between them.
//!
//! Only decisions live here. Heartbeats, votes in progress and connections live in the
//! leader's memory ([`crate::coordinator`]).

use std::collections::{BTreeMap, VecDeque};

use crate::topology::{link_cost, solve_ring, CostMatrix, SOLVE_MAX};
use eccl_algorithms::model;
use eccl_protocol::{LinkMeasure, Member, PeerId, Tuned, World};
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
    /// torch's `_reconfigure`: a world of exactly `members` (ranks in list order when
    /// `ordered`) at a new epoch, if `uuid` was not used before in this job. The worlds
    /// they come from go on with their other members at new epochs of their own.
    Reconfigure {
        uuid: u64,
        members: Vec<PeerId>,
        ordered: bool,
    },
    /// `optimize_topology()`: what each member of the world at `epoch` measured of its
    /// links. The measurements are kept, and the world goes on at a new epoch (same
    /// members, same ranks) with the ring solved from them.
    Topology {
        epoch: u64,
        rows: Vec<(PeerId, Vec<LinkMeasure>)>,
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
    /// A reconfigure's world, and each world its members came from that goes on with
    /// the others: (that world's epoch before, its world now).
    Reconfigured {
        world: World,
        remainders: Vec<(u64, World)>,
    },
}

/// One of the job's worlds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorldEntry {
    pub world: World,
    /// Formed by a reconfigure (or what is left of one): it changes only by reconfigures
    /// and losses, and admits no pending peer at update_topology().
    pub by_reconfigure: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registry {
    next_peer_id: PeerId,
    peers: BTreeMap<PeerId, PeerRecord>,
    /// The last epoch number given to any world.
    epoch: u64,
    /// The job's worlds, by their current epoch.
    worlds: BTreeMap<u64, WorldEntry>,
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
    /// Reconfigure uuids used, newest last: one is refused while it is here (the newest
    /// [`MAX_USED_UUIDS`]).
    used_uuids: VecDeque<u64>,
    /// Measured links between live peers, (from, to) -> (bytes per second, one-way
    /// latency in ns, connections the measuring end asked for): what the ring is solved
    /// from, and the links striped over, at every epoch. Links of departed peers are
    /// dropped (so a job holds at most its live peers' pairs).
    links: BTreeMap<(PeerId, PeerId), (u64, u64, u16)>,
}

/// The step a ring's cost is reckoned for: one chunk of a 64 MiB all_reduce. Large
/// messages are where the ring's order matters (small ones are latency-bound and go
/// direct or by tree), and the latency still counts in every edge.
pub const RING_REFERENCE_BYTES: f64 = (64u64 << 20) as f64;

/// Reconfigure uuids remembered as used: what one job member can make the masters hold
/// by reconfiguring itself over and over.
pub const MAX_USED_UUIDS: usize = 4096;

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

    /// Forgets all but the [`MAX_GONE`] most recent departed peers, and worlds with no
    /// member left. Deterministic, so every replica prunes alike.
    fn prune(&mut self) {
        let peers = &self.peers;
        self.worlds.retain(|_, e| {
            e.world
                .members
                .iter()
                .any(|m| matches!(peers.get(&m.peer_id), Some(r) if r.state == PeerState::Member))
        });
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
        // Measured links of departed (or forgotten) peers go with them.
        let peers = &self.peers;
        let live = |p: &PeerId| matches!(peers.get(p), Some(r) if !matches!(r.state, PeerState::Gone { .. }));
        self.links.retain(|(a, b), _| live(a) && live(b));
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
            Command::Topology { epoch, rows } => self.topology(*epoch, rows),
        }
    }

    /// Keeps what the members of the world at `epoch` measured and commits its next
    /// epoch, same members and ranks, with the ring solved from the measurements.
    fn topology(&mut self, epoch: u64, rows: &[(PeerId, Vec<LinkMeasure>)]) -> Outcome {
        let Some(entry) = self.worlds.get(&epoch) else {
            return Outcome::Rejected(format!(
                "epoch {epoch} is not a world's current epoch (the last given is {})",
                self.epoch
            ));
        };
        let world = &entry.world;
        for (from, row) in rows {
            if world.rank_of(*from).is_none() {
                return Outcome::Rejected(format!("peer {from} is not a member of epoch {epoch}"));
            }
            for m in row {
                if m.to != *from && world.rank_of(m.to).is_some() {
                    let link = self.links.entry((*from, m.to)).or_insert((0, 0, 1));
                    // No opinion (0) keeps the connections the link has; a count is capped.
                    let streams = match m.streams {
                        0 => link.2,
                        n => n.min(eccl_protocol::MAX_STRIPES),
                    };
                    *link = (m.bytes_per_s, m.latency_ns, streams);
                }
            }
        }
        let members: Vec<PeerId> = world
            .members
            .iter()
            .map(|m| m.peer_id)
            .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Member))
            .collect();
        let by_reconfigure = entry.by_reconfigure;
        self.worlds.remove(&epoch);
        Outcome::Epoch(self.new_world(&members, by_reconfigure))
    }

    /// The ring through `members` (ranks in this order) from the measured links, or
    /// rank order (empty) if none of their links was measured or the world is too
    /// large to solve. A link not measured costs what the worst measured one does; two
    /// members on one host without a measurement cost what the best one does (shared
    /// memory).
    /// Also the algorithms collectives take in that world ([`World::tuned`]): up to
    /// [`eccl_algorithms::model::MODEL_MAX_WORLD`] members, from a model of the measured
    /// links (the ring is turned so that the rootless trees sit on fast links too); in a
    /// larger world, the ring at every size for every kind that has one where some
    /// measured link costs more than [`eccl_protocol::KEEP_TO_RING`] times the ring's
    /// slowest.
    fn solve_ring(&self, members: &[PeerId]) -> (Vec<u32>, Vec<Tuned>) {
        let n = members.len();
        if !(3..=SOLVE_MAX).contains(&n) {
            return (Vec::new(), Vec::new());
        }
        let chunk = RING_REFERENCE_BYTES / n as f64;
        let link = |i: usize, j: usize| self.links.get(&(members[i], members[j]));
        let measured = |i: usize, j: usize| {
            link(i, j).map(|&(bw, ns, _)| link_cost(bw as f64, ns as f64 * 1e-9, chunk))
        };
        let known: Vec<f64> = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .filter_map(|(i, j)| measured(i, j))
            .filter(|c| c.is_finite())
            .collect();
        if known.is_empty() {
            return (Vec::new(), Vec::new());
        }
        let worst = known.iter().copied().fold(0.0, f64::max);
        let best = known.iter().copied().fold(f64::INFINITY, f64::min);
        let host = |i: usize| self.peers.get(&members[i]).map(|r| r.host.as_str());
        let same_host = |i: usize, j: usize| host(i).is_some() && host(i) == host(j);
        let m = CostMatrix::from_fn(n, |i, j| {
            measured(i, j).unwrap_or(if same_host(i, j) { best } else { worst })
        });
        let ring = solve_ring(&m);
        let order: Vec<u32> = ring.order.iter().map(|&k| k as u32).collect();
        if n <= model::MODEL_MAX_WORLD {
            // A link not measured is as the slowest measured one (the fastest between
            // two members on one host), as for the ring.
            let usable: Vec<(f64, f64)> = (0..n)
                .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
                .filter_map(|(i, j)| link(i, j))
                .map(|&(bw, ns, _)| (bw as f64, ns as f64 * 1e-9))
                .filter(|&(bw, _)| bw > 0.0)
                .collect();
            let slowest = usable
                .iter()
                .fold((f64::INFINITY, 0.0f64), |a, b| (a.0.min(b.0), a.1.max(b.1)));
            let fastest = usable
                .iter()
                .fold((0.0f64, f64::INFINITY), |a, b| (a.0.max(b.0), a.1.min(b.1)));
            let links = model::Links::from_fn(n, |i, j| match link(i, j) {
                Some(&(bw, ns, _)) => (bw as f64, ns as f64 * 1e-9),
                None if same_host(i, j) => fastest,
                None => slowest,
            });
            let order = model::rotate_for_trees(&order, &links);
            let tuned = model::tune(Some(&order), &links);
            return (order, tuned);
        }
        // Unusable links (no bandwidth measured: an infinite cost) count as the slowest.
        let slowest = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .filter_map(|(i, j)| measured(i, j))
            .fold(worst, f64::max);
        let tuned = match slowest > eccl_protocol::KEEP_TO_RING * ring.bottleneck {
            true => model::keep_to_ring(),
            false => Vec::new(),
        };
        (order, tuned)
    }

    /// The links among `members` striped over more than one connection: for each pair,
    /// the larger count either end asked for.
    fn stripes_among(&self, members: &[PeerId]) -> Vec<(PeerId, PeerId, u16)> {
        let mut pairs: BTreeMap<(PeerId, PeerId), u16> = BTreeMap::new();
        for (&(a, b), &(_, _, n)) in &self.links {
            if n > 1 && members.contains(&a) && members.contains(&b) {
                let e = pairs.entry((a.min(b), a.max(b))).or_insert(0);
                *e = (*e).max(n);
            }
        }
        pairs.into_iter().map(|((a, b), n)| (a, b, n)).collect()
    }

    /// What was measured of the links among `members`: `(from, to, bytes per second,
    /// latency in ns)`.
    pub fn links_among(&self, members: &[PeerId]) -> Vec<(PeerId, PeerId, u64, u64)> {
        self.links
            .iter()
            .filter(|((a, b), _)| members.contains(a) && members.contains(b))
            .map(|((a, b), &(bw, ns, _))| (*a, *b, bw, ns))
            .collect()
    }

    fn remove(&mut self, peer: PeerId, reason: String) -> Outcome {
        let epoch = self.world_of(peer).map_or(self.epoch, |w| w.epoch);
        let Some(rec) = self.peers.get_mut(&peer) else {
            return Outcome::Rejected(format!("unknown peer {peer}"));
        };
        if matches!(rec.state, PeerState::Gone { .. }) {
            return Outcome::Removed {
                peer,
                was_member: false,
                epoch,
            };
        }
        let was_member = rec.state == PeerState::Member;
        rec.state = PeerState::Gone { reason };
        Outcome::Removed {
            peer,
            was_member,
            epoch,
        }
    }

    /// The next epoch of the world whose epoch is `expected` (its live members in their
    /// order, then the pending peers of `admit` if it is the elastic world), or the
    /// elastic world's first epoch when `expected` is 0 and there is none (a
    /// compare-and-set: a stale leader cannot commit over a newer epoch).
    fn commit_epoch(&mut self, expected: u64, admit: &[PeerId], remove: &[PeerId]) -> Outcome {
        let entry = if expected == 0 {
            if self.elastic().is_some() {
                return Outcome::Rejected(
                    "a world is formed already: commit its next epoch instead".into(),
                );
            }
            None
        } else {
            match self.worlds.get(&expected) {
                Some(e) => Some(e.clone()),
                None => {
                    return Outcome::Rejected(format!(
                        "epoch {expected} is not a world's current epoch (the last given is {})",
                        self.epoch
                    ))
                }
            }
        };
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
        let mut members: Vec<PeerId> = entry
            .iter()
            .flat_map(|e| e.world.members.iter().map(|m| m.peer_id))
            .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Member))
            .collect();
        let by_reconfigure = entry.as_ref().is_some_and(|e| e.by_reconfigure);
        if !by_reconfigure {
            let mut newcomers: Vec<PeerId> = admit
                .iter()
                .copied()
                .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Pending))
                .collect();
            newcomers.sort_by_key(|p| (self.peers[p].rank_hint.unwrap_or(u32::MAX), *p));
            newcomers.dedup();
            members.extend(newcomers);
        }
        if members.is_empty() {
            return Outcome::Rejected("an epoch needs at least one member".into());
        }
        self.worlds.remove(&expected);
        let world = self.new_world(&members, by_reconfigure);
        Outcome::Epoch(world)
    }

    fn reconfigure(&mut self, uuid: u64, listed: &[PeerId], ordered: bool) -> Outcome {
        if self.used_uuids.contains(&uuid) {
            return Outcome::Rejected(format!(
                "reconfigure uuid {uuid} was already used in this job: pass a fresh one"
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
            // A set: members keep the order of the worlds they come from (older worlds
            // first), the others follow by rank hint, then id.
            let place = |p: &PeerId| {
                self.world_of(*p)
                    .and_then(|w| w.rank_of(*p).map(|r| (w.epoch, r.0)))
                    .unwrap_or((u64::MAX, u32::MAX))
            };
            members.sort_by_key(|p| (place(p), self.peers[p].rank_hint.unwrap_or(u32::MAX), *p));
        }
        // The worlds the named members come from go on with the others, each at a new
        // epoch; nobody is removed.
        let from: Vec<u64> = {
            let mut f: Vec<u64> = members
                .iter()
                .filter_map(|p| self.world_of(*p).map(|w| w.epoch))
                .collect();
            f.sort_unstable();
            f.dedup();
            f
        };
        let mut remainders = Vec::new();
        for epoch in from {
            let Some(old) = self.worlds.remove(&epoch) else {
                continue;
            };
            let rest: Vec<PeerId> = old
                .world
                .members
                .iter()
                .map(|m| m.peer_id)
                .filter(|p| !members.contains(p))
                .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Member))
                .collect();
            if !rest.is_empty() {
                let w = self.new_world(&rest, old.by_reconfigure);
                remainders.push((epoch, w));
            }
        }
        self.used_uuids.push_back(uuid);
        while self.used_uuids.len() > MAX_USED_UUIDS {
            self.used_uuids.pop_front();
        }
        let world = self.new_world(&members, true);
        Outcome::Reconfigured { world, remainders }
    }

    /// A world of `members` in this order at the next epoch number; each becomes a
    /// member of it.
    fn new_world(&mut self, members: &[PeerId], by_reconfigure: bool) -> World {
        self.epoch += 1;
        let (ring, tuned) = self.solve_ring(members);
        let world = World {
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
            ring,
            stripes: self.stripes_among(members),
            tuned,
        };
        if !world.ring.is_empty() {
            tracing::info!(target: "eccl::master", "epoch {}: ring {:?} solved from measured links; algorithms {}", world.epoch, world.ring,
                model::describe(&world.tuned));
        }
        self.worlds.insert(
            self.epoch,
            WorldEntry {
                world: world.clone(),
                by_reconfigure,
            },
        );
        world
    }

    /// The last epoch number given to any world.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether reconfigure `uuid` was used in this job already.
    pub fn uuid_used(&self, uuid: u64) -> bool {
        self.used_uuids.contains(&uuid)
    }

    /// The world `peer` is a member of now.
    pub fn world_of(&self, peer: PeerId) -> Option<&World> {
        if !matches!(self.peers.get(&peer), Some(r) if r.state == PeerState::Member) {
            return None;
        }
        self.worlds
            .values()
            .map(|e| &e.world)
            .find(|w| w.rank_of(peer).is_some())
    }

    /// The job's worlds, oldest epoch first.
    pub fn worlds(&self) -> impl Iterator<Item = &WorldEntry> {
        self.worlds.values()
    }

    /// The world update_topology() grows (the one not formed by a reconfigure).
    pub fn elastic(&self) -> Option<&World> {
        self.worlds
            .values()
            .find(|e| !e.by_reconfigure)
            .map(|e| &e.world)
    }

    /// Members of the world at `epoch` that are still members (not evicted since).
    pub fn live_members_of(&self, epoch: u64) -> Vec<PeerId> {
        self.worlds
            .get(&epoch)
            .iter()
            .flat_map(|e| e.world.members.iter().map(|m| m.peer_id))
            .filter(|p| matches!(self.peers.get(p), Some(r) if r.state == PeerState::Member))
            .collect()
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

    /// The newest world (the only one, unless reconfigures split the job).
    pub fn world(&self) -> Option<&World> {
        self.worlds.values().next_back().map(|e| &e.world)
    }

    pub fn peer(&self, id: PeerId) -> Option<&PeerRecord> {
        self.peers.get(&id)
    }

    /// Members of every world that are still members (not evicted since).
    pub fn live_members(&self) -> Vec<PeerId> {
        self.peers
            .iter()
            .filter(|(_, r)| r.state == PeerState::Member)
            .map(|(p, _)| *p)
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

    /// Peers registered so far: the live ones and the departed ones still remembered
    /// (the newest [`MAX_GONE`]).
    pub fn peers_seen(&self) -> usize {
        self.peers.len()
    }

    pub fn pending(&self) -> Vec<PeerId> {
        self.peers
            .iter()
            .filter(|(_, r)| r.state == PeerState::Pending)
            .map(|(p, _)| *p)
            .collect()
    }
}
