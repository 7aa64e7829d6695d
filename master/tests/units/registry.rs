//! Unit tests of `eccl_master::registry`.

use eccl_master::registry::*;
use eccl_protocol::{PeerId, World};

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

/// The world `o` committed.
fn epoch(o: Outcome) -> World {
    match o {
        Outcome::Epoch(w) => w,
        o => panic!("{o:?}"),
    }
}

/// `n` peers registered with rank hints 0..n, and their first world.
fn first_world(r: &mut Registry, n: u32) -> (Vec<PeerId>, World) {
    let p: Vec<PeerId> = (0..n).map(|i| reg(r, Some(i))).collect();
    let w = epoch(r.apply(&Command::CommitEpoch {
        expected_epoch: 0,
        admit: p.clone(),
        remove: vec![],
    }));
    (p, w)
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

fn rc(uuid: u64, members: Vec<PeerId>, ordered: bool) -> Command {
    Command::Reconfigure {
        uuid,
        members,
        ordered,
    }
}

fn reconfigured(o: Outcome) -> (World, Vec<(u64, World)>) {
    match o {
        Outcome::Reconfigured { world, remainders } => (world, remainders),
        o => panic!("{o:?}"),
    }
}

#[test]
fn reconfigure_makes_exactly_the_named_world_once_per_uuid() {
    let mut r = Registry::default();
    let (a, b, c) = (reg(&mut r, None), reg(&mut r, None), reg(&mut r, None));
    // The first world comes from pending peers, ranks in list order.
    let (w, rest) = reconfigured(r.apply(&rc(5, vec![c, a, b], true)));
    assert_eq!((w.epoch, w.peer_ids(), rest.len()), (1, vec![c, a, b], 0));
    // A used uuid is refused and changes nothing; an older one is as good as any.
    assert!(
        matches!(r.apply(&rc(5, vec![a, b], true)), Outcome::Rejected(m) if m.contains("already used"))
    );
    assert_eq!(r.epoch(), 1);
    // A set keeps the current order. The member left out is not removed: it goes on
    // in a world of its own, at an epoch of its own.
    let (w, rest) = reconfigured(r.apply(&rc(4, vec![b, c], false)));
    assert_eq!(w.peer_ids(), vec![c, b]);
    assert_eq!(rest.len(), 1);
    let (was, left) = &rest[0];
    assert_eq!((*was, left.peer_ids()), (1, vec![a]));
    assert!(w.epoch != left.epoch && w.epoch > 1 && left.epoch > 1);
    assert_eq!(r.world_of(a).map(|w| w.epoch), Some(left.epoch));
    assert_eq!(r.peer(a).unwrap().state, PeerState::Member);
    // The two worlds merge again, with a newcomer.
    let d = reg(&mut r, None);
    let (w, rest) = reconfigured(r.apply(&rc(8, vec![b, c, d, a], true)));
    assert_eq!((w.peer_ids(), rest.len()), (vec![b, c, d, a], 0));
    assert_eq!(r.worlds().count(), 1);
    assert!(
        matches!(r.apply(&rc(9, vec![b, b], true)), Outcome::Rejected(m) if m.contains("twice"))
    );
}

/// torch's split-brain shape: two disjoint halves reconfigure into two worlds, each
/// at epochs of its own, update_topology() on one changes nothing in the other, and
/// a member's reconfigure of itself alone removes nobody (the finding: one member
/// once evicted the whole world with uuid 2^64-1 and burned every later uuid).
#[test]
fn disjoint_worlds_live_side_by_side_and_nobody_is_evicted_by_anothers_reconfigure() {
    let mut r = Registry::default();
    let (p, all) = first_world(&mut r, 4);
    let (left, rest) = reconfigured(r.apply(&rc(100, vec![p[0], p[1]], true)));
    assert_eq!(rest.len(), 1);
    let right = &rest[0].1;
    assert_eq!((rest[0].0, right.peer_ids()), (all.epoch, vec![p[2], p[3]]));
    let (right2, rest) = reconfigured(r.apply(&rc(7, vec![p[2], p[3]], true)));
    assert!(rest.is_empty());
    assert_eq!(r.worlds().count(), 2);
    // Each world's own next epoch, and no other's.
    let Outcome::Epoch(l2) = r.apply(&Command::CommitEpoch {
        expected_epoch: left.epoch,
        admit: vec![],
        remove: vec![],
    }) else {
        panic!()
    };
    assert_eq!(l2.peer_ids(), left.peer_ids());
    assert_eq!(r.world_of(p[2]).unwrap(), &right2);
    // One member alone, with the largest uuid: its world goes on without it.
    let (solo, rest) = reconfigured(r.apply(&rc(u64::MAX, vec![p[0]], true)));
    assert_eq!(solo.peer_ids(), vec![p[0]]);
    assert_eq!(rest[0].1.peer_ids(), vec![p[1]]);
    assert!(p
        .iter()
        .all(|x| r.peer(*x).unwrap().state == PeerState::Member));
    // No uuid is burned: a smaller one still works, and the job merges back.
    let (merged, _) = reconfigured(r.apply(&rc(3, p.clone(), true)));
    assert_eq!(merged.peer_ids(), p);
    // Epochs only grow for every member (G6), one number one world.
    assert!(merged.epoch > solo.epoch && solo.epoch > l2.epoch);
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

/// optimize_topology()'s measurements: kept in the replicated state, the world goes on
/// at a new epoch with the same members and ranks and the ring solved from them, and a
/// later world (someone left) is solved again from what was measured.
#[test]
fn measured_links_give_the_next_epoch_a_ring_that_avoids_the_slow_ones() {
    use eccl_protocol::LinkMeasure;
    let mut r = Registry::default();
    let (p, w) = first_world(&mut r, 5);
    assert!(w.ring.is_empty(), "rank order until something is measured");
    assert!(w.tuned.is_empty());
    // Fast (10 GB/s) only between ranks two apart (0-2-4-1-3-0); every other link is
    // 100 times slower, including all of rank order's.
    let fast = |i: usize, j: usize| (i + 2) % 5 == j || (j + 2) % 5 == i;
    let rows: Vec<(PeerId, Vec<LinkMeasure>)> = (0..5)
        .map(|i| {
            let row = (0..5)
                .filter(|&j| j != i)
                .map(|j| LinkMeasure {
                    to: p[j],
                    bytes_per_s: if fast(i, j) {
                        10_000_000_000
                    } else {
                        100_000_000
                    },
                    latency_ns: 20_000,
                    streams: 0,
                })
                .collect();
            (p[i], row)
        })
        .collect();
    // Measurements of an epoch that is not current change nothing.
    assert!(matches!(
        r.apply(&Command::Topology {
            epoch: 7,
            rows: rows.clone()
        }),
        Outcome::Rejected(_)
    ));
    let Outcome::Epoch(w2) = r.apply(&Command::Topology {
        epoch: w.epoch,
        rows,
    }) else {
        panic!()
    };
    assert_eq!(w2.epoch, w.epoch + 1);
    assert_eq!(w2.peer_ids(), w.peer_ids(), "same members, same ranks");
    w2.validate().unwrap();
    let ring = &w2.ring;
    assert_eq!(ring.len(), 5);
    for k in 0..5 {
        let (a, b) = (ring[k] as usize, ring[(k + 1) % 5] as usize);
        assert!(fast(a, b), "ring {ring:?} uses the slow link {a}->{b}");
    }
    // Links off the ring are 100 times slower than its slowest: the master's model
    // sends calls that would cross them (a 64 KiB all_reduce's tree, any all_to_all)
    // around the ring.
    use eccl_protocol::{Algo, CollectiveKind};
    let algo = |w: &eccl_protocol::World, k, b| w.tuned_algo(k, b).map(|t| t.algo);
    assert_eq!(
        algo(&w2, CollectiveKind::AllReduce, 64 << 10),
        Some(Algo::Ring)
    );
    assert_eq!(
        algo(&w2, CollectiveKind::AllReduce, 1 << 30),
        Some(Algo::Ring)
    );
    assert_eq!(
        algo(&w2, CollectiveKind::AllToAll, 1 << 20),
        Some(Algo::Ring)
    );
    assert_eq!(r.links_among(&p).len(), 20);
    // Rank 2 leaves: the four left are solved again from what was measured (the
    // departed peer's links are forgotten).
    r.apply(&Command::Leave { peer: p[2] });
    let Outcome::Epoch(w3) = r.apply(&Command::CommitEpoch {
        expected_epoch: w2.epoch,
        admit: vec![],
        remove: vec![],
    }) else {
        panic!()
    };
    assert_eq!(w3.size(), 4);
    assert_eq!(w3.ring.len(), 4);
    w3.validate().unwrap();
    assert_eq!(
        r.links_among(&p).len(),
        12,
        "links of the departed peer are dropped"
    );
    // A measurement from someone outside the world is refused.
    let stranger = reg(&mut r, None);
    assert!(matches!(
        r.apply(&Command::Topology {
            epoch: w3.epoch,
            rows: vec![(stranger, vec![])]
        }),
        Outcome::Rejected(_)
    ));
}

/// A link one end measured window-bound is striped at the next epoch over the larger
/// count either end asked for (capped), for both ends alike; a later measurement that
/// asks for one connection takes it back, and a departed peer's stripes go with it.
#[test]
fn window_bound_links_are_striped_for_both_ends() {
    use eccl_protocol::{LinkMeasure, MAX_STRIPES};
    let mut r = Registry::default();
    let (p, w) = first_world(&mut r, 3);
    assert!(w.stripes.is_empty());
    let measure = |to: PeerId, streams: u16| LinkMeasure {
        to,
        bytes_per_s: 30_000_000,
        latency_ns: 50_000_000,
        streams,
    };
    let topology = |epoch, rows| Command::Topology { epoch, rows };
    // 0 -> 2 asks for 4, 2 -> 0 for 100 (capped); 0 <-> 1 no opinion (0) and one.
    let w2 = epoch(r.apply(&topology(
        w.epoch,
        vec![
            (p[0], vec![measure(p[1], 0), measure(p[2], 4)]),
            (p[1], vec![measure(p[0], 1), measure(p[2], 1)]),
            (p[2], vec![measure(p[0], 100), measure(p[1], 1)]),
        ],
    )));
    w2.validate().unwrap();
    assert_eq!(w2.stripes, vec![(p[0], p[2], MAX_STRIPES)]);
    assert_eq!(w2.stripes_between(p[2], p[0]), Some(MAX_STRIPES));
    assert_eq!(w2.stripes_between(p[0], p[1]), None);
    // Measured again with one connection wanted each way: no longer striped.
    let w3 = epoch(r.apply(&topology(
        w2.epoch,
        vec![
            (p[0], vec![measure(p[2], 1)]),
            (p[2], vec![measure(p[0], 1)]),
            (p[1], vec![]),
        ],
    )));
    assert!(w3.stripes.is_empty(), "{:?}", w3.stripes);
    // Striped again, then one end leaves: the next world has no stripes of it.
    let w4 = epoch(r.apply(&topology(
        w3.epoch,
        vec![
            (p[1], vec![measure(p[2], 4)]),
            (p[0], vec![]),
            (p[2], vec![]),
        ],
    )));
    assert_eq!(w4.stripes, vec![(p[1], p[2], 4)]);
    r.apply(&Command::Leave { peer: p[1] });
    let w5 = epoch(r.apply(&Command::CommitEpoch {
        expected_epoch: w4.epoch,
        admit: vec![],
        remove: vec![],
    }));
    assert!(w5.stripes.is_empty(), "{:?}", w5.stripes);
}
