//! Tests of the verdict, on hand-made event logs.

use super::*;

fn call(peer: PeerId, op: Op, start: f64, end: f64, epoch: u64, members: &[PeerId]) -> Event {
    Event::Call(Call {
        peer,
        op,
        start,
        end,
        ok: true,
        err: None,
        detail: None,
        epoch,
        members: members.to_vec(),
        revision: 0,
    })
}

/// An all_reduce of epoch 1 by members 1 and 2 that failed.
fn failed(peer: PeerId, start: f64, end: f64) -> Event {
    match call(peer, Op::AllReduce, start, end, 1, &[1, 2]) {
        Event::Call(c) => Event::Call(Call { ok: false, ..c }),
        e => e,
    }
}

fn commit(peer: PeerId, epoch: u64, revision: u64, prev: &str, hash: &str) -> Event {
    Event::Commit {
        peer,
        t: 0.0,
        epoch,
        revision,
        prev: prev.into(),
        hash: hash.into(),
    }
}

fn fin(peer: PeerId, hash: &str) -> Event {
    Event::Final {
        peer,
        t: 0.0,
        revision: 9,
        hash: hash.into(),
    }
}

pub(crate) fn log(events: Vec<(usize, Event)>) -> RunLog {
    RunLog {
        events,
        faults: Vec::new(),
        master_faults: Vec::new(),
        stopped: Vec::new(),
        slowed: Vec::new(),
        lease_ms: 800.0,
        master_windows: Vec::new(),
        initial: 2,
        finishers: [0, 1].into(),
        violations: Vec::new(),
        hangs: 0,
        hang_limit_ms: 3000.0,
        state_bytes: 16e6,
        max_stall_ms: None,
        seed: 1,
        peers: 2,
        transport: "auto".into(),
        in_flight: 1,
        duration_s: 1.0,
        t0: 0.0,
    }
}

#[test]
fn percentiles_use_the_nearest_rank() {
    let v: Vec<f64> = (1..=100).map(f64::from).collect();
    assert_eq!(percentile(&v, 50.0), Some(50.0));
    assert_eq!(percentile(&v, 99.0), Some(99.0));
    assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    assert_eq!(percentile(&[], 50.0), None);
    let s = stats([30.0, 10.0, 20.0]);
    assert_eq!((s.p50, s.p99, s.max), (Some(20.0), Some(30.0), Some(30.0)));
}

#[test]
fn a_commit_off_the_final_history_is_lost() {
    let events = vec![
        (0, commit(1, 1, 1, "z", "a1")),
        (1, commit(2, 1, 1, "z", "a1")),
        (0, commit(1, 1, 2, "a1", "a2")),
        // Worker 1 committed revision 2 in a world that then fell apart; the others
        // went on from revision 1.
        (1, commit(2, 2, 2, "a1", "b2")),
        (0, commit(1, 3, 3, "a2", "a3")),
        // A worker that died may have made any commit.
        (2, commit(3, 4, 3, "a2", "c3")),
        (0, fin(1, "a3")),
        (1, fin(2, "a3")),
    ];
    let lost = lost_steps(&events, &[0, 1].into());
    assert_eq!(lost, [(2, "b2".to_string())].into());
    assert_eq!(analyse(&log(events)).lost_steps, 1);
}

#[test]
fn only_the_epoch_a_peer_was_evicted_from_may_end_off_the_history() {
    let evicted = |peer| Event::Evicted {
        peer,
        t: 0.0,
        reason: "lease".into(),
    };
    let mut events = vec![
        (0, commit(1, 1, 1, "z", "a1")),
        (1, commit(2, 1, 1, "z", "a1")),
        // Peer 2 was stopped in the last step of revision 2's all_reduce; peer 1
        // aborted it, and went on without it.
        (1, commit(2, 1, 2, "a1", "b2")),
        (0, commit(1, 2, 2, "a1", "a2")),
        (1, evicted(2)),
        (1, commit(3, 3, 3, "a2", "a3")),
        (0, commit(1, 3, 3, "a2", "a3")),
        (0, fin(1, "a3")),
        (1, fin(3, "a3")),
    ];
    assert!(lost_steps(&events, &[0, 1].into()).is_empty());
    // Had it been evicted from a later epoch, revision 2 would be a lost step.
    events.insert(4, (1, call(2, Op::AllReduce, 0.0, 1.0, 2, &[1, 2])));
    let lost = lost_steps(&events, &[0, 1].into());
    assert_eq!(lost, [(2, "b2".to_string())].into());
}

#[test]
fn different_states_in_one_epoch_and_revision_diverge() {
    let sync = |peer, epoch, hash: &str, lib: &str| Event::Sync {
        peer,
        t: 0.0,
        epoch,
        revision: 5,
        hash: hash.into(),
        lib_hash: lib.into(),
        bytes_received: 0,
        sources: vec![],
    };
    let agree = vec![
        (0, sync(1, 3, "a", "x")),
        (1, sync(2, 3, "a", "x")),
        (0, sync(1, 4, "b", "y")),
    ];
    assert!(
        divergences(&agree).is_empty(),
        "different epochs may differ"
    );
    let ours = vec![(0, sync(1, 3, "a", "x")), (1, sync(2, 3, "b", "x"))];
    assert_eq!(divergences(&ours).len(), 1);
    let lib = vec![(0, sync(1, 3, "a", "x")), (1, sync(2, 3, "a", "y"))];
    assert_eq!(divergences(&lib).len(), 1);
    let commits = vec![
        (0, commit(1, 3, 6, "a", "c")),
        (1, commit(2, 3, 6, "a", "d")),
    ];
    assert_eq!(divergences(&commits).len(), 1);
    let finals = vec![(0, fin(1, "a")), (1, fin(2, "b"))];
    assert_eq!(divergences(&finals).len(), 1);
}

#[test]
fn a_peer_that_left_a_world_must_not_come_back() {
    let fine = vec![
        (0, call(1, Op::AllReduce, 0.0, 1.0, 1, &[1, 2, 3])),
        (0, call(1, Op::AllReduce, 2.0, 3.0, 2, &[1, 2])),
        (0, call(1, Op::AllReduce, 4.0, 5.0, 3, &[1, 2, 4])),
    ];
    assert!(ghosts(&fine).is_empty(), "{:?}", ghosts(&fine));
    let mut back = fine.clone();
    back.push((1, call(2, Op::AllReduce, 6.0, 7.0, 5, &[1, 2, 3])));
    assert_eq!(ghosts(&back).len(), 1, "{:?}", ghosts(&back));
    let mut evicted = fine.clone();
    evicted.push((
        3,
        Event::Evicted {
            peer: 4,
            t: 4.5,
            reason: "lease".into(),
        },
    ));
    evicted.push((0, call(1, Op::Sync, 4.6, 5.5, 3, &[1, 2, 4])));
    assert_eq!(ghosts(&evicted).len(), 1, "{:?}", ghosts(&evicted));
    let split = vec![
        (0, call(1, Op::Sync, 0.0, 1.0, 1, &[1, 2])),
        (1, call(2, Op::Sync, 0.0, 1.0, 1, &[2, 3])),
    ];
    assert_eq!(ghosts(&split).len(), 1);
}

#[test]
fn long_calls_are_hangs_unless_forming_the_world_or_stopped() {
    let mut l = log(vec![
        // World formation may take as long as the slowest process start.
        (0, call(1, Op::UpdateTopology, 0.0, 9000.0, 1, &[1, 2])),
        (0, call(1, Op::UpdateTopology, 9000.0, 13000.0, 2, &[1, 2])),
        (1, call(2, Op::AllReduce, 20000.0, 26000.0, 2, &[1, 2])),
        (1, call(2, Op::AllReduce, 26000.0, 26100.0, 2, &[1, 2])),
    ]);
    l.stopped = vec![(1, 21000.0, 25000.0)];
    let r = analyse(&l);
    assert_eq!(r.hangs, 1, "{:?}", r.violations);
    assert!(
        r.violations[0].contains("update_topology took 4000 ms"),
        "{:?}",
        r.violations
    );
}

#[test]
fn only_a_stopped_peer_may_be_evicted() {
    let evicted = |peer, t| Event::Evicted {
        peer,
        t,
        reason: "lease".into(),
    };
    let mut l = log(vec![(1, evicted(2, 5000.0)), (0, evicted(1, 9000.0))]);
    // Worker 1 was stopped before its eviction; worker 0 never was.
    l.stopped = vec![(1, 1000.0, 4500.0), (0, 9500.0, 12000.0)];
    let r = analyse(&l);
    assert_eq!(r.false_evictions, 1, "{:?}", r.violations);
    assert!(
        r.violations
            .iter()
            .any(|v| v.contains("false eviction: peer 1 (worker 0)")),
        "{:?}",
        r.violations
    );
}

#[test]
fn a_slow_peer_may_cost_time_but_no_abort_or_eviction() {
    // Worker 1 was slow from 1,000 to 1,300 ms. A call that succeeded late is fine; one
    // that failed within a lease of its waking is a violation, one long after is not this
    // check's; and its eviction is a false one (it was never stopped as a hang).
    let mut l = log(vec![
        (0, call(1, Op::AllReduce, 900.0, 1400.0, 1, &[1, 2])),
        (0, failed(1, 1500.0, 1700.0)),
        (0, failed(1, 5000.0, 5100.0)),
        (
            1,
            Event::Evicted {
                peer: 2,
                t: 1200.0,
                reason: "lease".into(),
            },
        ),
    ]);
    l.slowed = vec![(1, 1000.0, 1300.0)];
    let r = analyse(&l);
    assert_eq!(r.faults.slow, 1);
    let slow: Vec<_> = r
        .violations
        .iter()
        .filter(|v| v.contains("slow peer"))
        .collect();
    assert_eq!(slow.len(), 1, "{:?}", r.violations);
    assert!(slow[0].contains("worker 1 was stopped 300 ms"), "{slow:?}");
    assert_eq!(r.false_evictions, 1, "{:?}", r.violations);
}

/// Under --churn another fault (here a member leaving from the middle of a sync) may
/// strike while a slow peer is stopped: the calls it failed are its doing, not the slow
/// peer's; a failure no other fault comes near is still the slow peer's.
#[test]
fn a_call_that_another_fault_failed_is_not_the_slow_peers_doing() {
    let mut l = log(vec![
        (0, failed(1, 1500.0, 1700.0)),
        (0, failed(1, 20_000.0, 20_100.0)),
    ]);
    l.slowed = vec![(1, 1000.0, 1300.0), (1, 19_800.0, 20_100.0)];
    l.faults.push((
        FaultKind::LeaveDuringSync,
        crate::measure::Outcome {
            at: 2000.0,
            victim: 3,
            ..Default::default()
        },
    ));
    let r = analyse(&l);
    let slow: Vec<_> = r
        .violations
        .iter()
        .filter(|v| v.contains("slow peer"))
        .collect();
    assert_eq!(slow.len(), 1, "{:?}", r.violations);
    assert!(slow[0].contains("stopped 300 ms"), "{slow:?}");
    assert!(
        !r.violations.iter().any(|v| v.contains("1500")),
        "{:?}",
        r.violations
    );
}

#[test]
fn membership_calls_may_wait_out_a_master_fault_but_collectives_may_not() {
    let mut l = log(vec![
        (0, call(1, Op::Sync, 10_000.0, 14_000.0, 2, &[1, 2])),
        (1, call(2, Op::AllReduce, 10_000.0, 14_000.0, 2, &[1, 2])),
        (0, call(1, Op::Sync, 30_000.0, 34_000.0, 2, &[1, 2])),
    ]);
    l.master_windows = vec![(9_000.0, 13_000.0)];
    let r = analyse(&l);
    assert_eq!(r.hangs, 2, "{:?}", r.violations);
    assert!(r
        .violations
        .iter()
        .any(|v| v.contains("all_reduce took 4000 ms")));
    assert!(r
        .violations
        .iter()
        .any(|v| v.contains("sync_shared_state took 4000 ms")));
}

fn commit_at(peer: PeerId, t: f64, revision: u64) -> Event {
    Event::Commit {
        peer,
        t,
        epoch: 1,
        revision,
        prev: String::new(),
        hash: format!("h{revision}"),
    }
}

#[test]
fn a_stall_is_the_longest_wait_for_a_new_step_and_fails_a_churn_run() {
    // Two workers commit every step; the job's progress pauses from 3 s to 9.5 s. A
    // worker catching up on old revisions (a newcomer after its sync) is not progress.
    let mut events = Vec::new();
    for (i, t) in [1_000.0, 2_000.0, 3_000.0, 9_500.0, 10_000.0]
        .into_iter()
        .enumerate()
    {
        events.push((0, commit_at(1, t, i as u64 + 1)));
        events.push((1, commit_at(2, t + 50.0, i as u64 + 1)));
    }
    events.push((2, commit_at(3, 6_000.0, 2)));
    assert_eq!(longest_stall(&events, 10_500.0), Some((6_500.0, 9_500.0)));
    // A job that stops committing stalls until the end of the run.
    assert_eq!(longest_stall(&events, 30_000.0), Some((20_000.0, 30_000.0)));
    let mut l = log(events);
    l.duration_s = 10.5; // t0 0: the run ends at 10.5 s
    let r = analyse(&l);
    assert_eq!(r.longest_stall_ms, Some(6_500.0));
    assert!(!r.violations.iter().any(|v| v.starts_with("stall")));
    l.max_stall_ms = Some(5_000.0);
    let r = analyse(&l);
    assert!(
        r.violations
            .iter()
            .any(|v| v.contains("no new step for 6500 ms") && v.contains("9.50 s")),
        "{:?}",
        r.violations
    );
    l.max_stall_ms = Some(7_000.0);
    assert!(!analyse(&l)
        .violations
        .iter()
        .any(|v| v.starts_with("stall")));
    assert_eq!(longest_stall(&[], 1_000.0), None);
}

#[test]
fn each_overlapping_stop_after_the_first_allows_one_more_lease() {
    // Lease 800 ms, limit 3000 ms. A call that two other peers' stops overlap may take
    // 3800 ms; one overlapped by a single stop, or by none, only 3000.
    let mut l = log(vec![
        (
            0,
            call(1, Op::UpdateTopology, 10_000.0, 13_500.0, 3, &[1, 2]),
        ),
        (
            0,
            call(1, Op::UpdateTopology, 20_000.0, 23_500.0, 4, &[1, 2]),
        ),
        (
            0,
            call(1, Op::UpdateTopology, 30_000.0, 33_900.0, 5, &[1, 2]),
        ),
    ]);
    l.initial = 0; // no call is a world formation
    l.stopped = vec![
        (2, 9_500.0, 11_800.0),
        (3, 10_200.0, 12_500.0),
        (2, 19_500.0, 21_800.0),
        (2, 29_500.0, 31_800.0),
        (3, 30_100.0, 32_400.0),
    ];
    let r = analyse(&l);
    let hung: Vec<&String> = r
        .violations
        .iter()
        .filter(|v| v.starts_with("hang"))
        .collect();
    assert_eq!(hung.len(), 2, "{hung:?}");
    assert!(
        hung[0].contains("took 3500 ms in epoch 4 (limit 3000 ms)"),
        "{hung:?}"
    );
    assert!(
        hung[1].contains("took 3900 ms in epoch 5 (limit 3800 ms)"),
        "{hung:?}"
    );
}

fn sync_event(peer: PeerId, bytes_received: u64) -> Event {
    Event::Sync {
        peer,
        t: 0.0,
        epoch: 1,
        revision: 1,
        hash: "h".into(),
        lib_hash: "h".into(),
        bytes_received,
        sources: vec![1],
    }
}

#[test]
fn a_sync_may_take_the_time_to_move_the_state_at_the_runs_slowest_rate() {
    // A 1 GB state; a newcomer moved it in 2.5 s (400 MB/s, 400e3 bytes per ms).
    let events = vec![
        (1, call(2, Op::Sync, 0.0, 2_500.0, 1, &[1, 2])),
        (1, sync_event(2, 1_000_000_000)),
        // A member waited 7 s in its sync meanwhile: within 3 s + 2 x 2.5 s = 8 s.
        (0, call(1, Op::Sync, 0.0, 7_000.0, 1, &[1, 2])),
        // A sync stuck for 9 s is a hang all the same.
        (0, call(1, Op::Sync, 10_000.0, 19_000.0, 2, &[1, 2])),
        // Collectives keep the plain limit.
        (0, call(1, Op::AllReduce, 20_000.0, 24_000.0, 2, &[1, 2])),
    ];
    let mut l = log(events);
    l.state_bytes = 1e9;
    assert_eq!(sync_allowance_ms(&l), 5_000.0);
    let hung = hung_calls(&l);
    assert_eq!(hung.len(), 2, "{hung:?}");
    assert!(
        hung[0].contains("sync_shared_state took 9000 ms"),
        "{hung:?}"
    );
    assert!(hung[1].contains("all_reduce took 4000 ms"), "{hung:?}");
    // With no sync that moved a MiB, the state is assumed to move at 100 MB/s.
    let mut quiet = log(vec![(1, sync_event(2, 10))]);
    quiet.state_bytes = 16e6;
    assert_eq!(sync_allowance_ms(&quiet), 320.0);
}

#[test]
fn members_calls_and_steps_are_split_by_whether_a_newcomer_was_catching_up() {
    let at = |peer, t| Event::Commit {
        peer,
        t,
        epoch: 1,
        revision: 0,
        prev: String::new(),
        hash: String::new(),
    };
    let events = vec![
        // Before the join: quiet.
        (0, call(1, Op::AllReduce, 0.0, 10.0, 1, &[1, 2])),
        (0, at(1, 10.0)),
        (0, call(1, Op::AllReduce, 20.0, 30.0, 1, &[1, 2])),
        (0, at(1, 30.0)),
        // The newcomer (slot 2) catches up from 1000 to 1500: the member's call that
        // overlaps it and its step count as during, the newcomer's own call not at all.
        (0, call(1, Op::AllReduce, 1400.0, 1480.0, 2, &[1, 2])),
        (0, at(1, 1480.0)),
        (2, call(3, Op::AllReduce, 1490.0, 1500.0, 2, &[1, 2, 3])),
        // After the join has played out (its lease-long window too): quiet again.
        (0, call(1, Op::AllReduce, 2600.0, 2612.0, 3, &[1, 2, 3])),
        (0, at(1, 2612.0)),
        (0, call(1, Op::AllReduce, 2620.0, 2634.0, 3, &[1, 2, 3])),
        (0, at(1, 2634.0)),
    ];
    let mut l = log(events);
    l.faults.push((
        FaultKind::Join,
        Outcome {
            at: 1000.0,
            victim: 2,
            join_ms: Some(500.0),
            ..Outcome::default()
        },
    ));
    let m = crate::members::member_cost(&l);
    assert_eq!(m.all_reduce_during_joins_ms.max, Some(80.0), "{m:?}");
    assert_eq!(m.all_reduce_during_joins_ms.p50, Some(80.0), "{m:?}");
    assert_eq!(m.all_reduce_otherwise_ms.max, Some(14.0), "{m:?}");
    assert_eq!(m.all_reduce_otherwise_ms.p50, Some(10.0), "{m:?}");
    // 30 -> 1480 overlaps the catch-up; 1480 -> 2612 too (it starts in the window);
    // 10 -> 30 and 2612 -> 2634 are quiet.
    assert_eq!(m.step_during_joins_ms.max, Some(1450.0), "{m:?}");
    assert_eq!(m.step_otherwise_ms.max, Some(22.0), "{m:?}");
    assert_eq!(m.step_otherwise_ms.p50, Some(20.0), "{m:?}");
}

#[test]
fn a_failed_call_that_changed_its_buffer_breaks_g2() {
    let touched = Event::Touched {
        peer: 2,
        t: 0.0,
        epoch: 1,
        revision: 3,
        elements: 17,
    };
    let r = analyse(&log(vec![(0, failed(1, 0.0, 5.0)), (1, touched)]));
    assert_eq!(r.wrong_results, 1);
    assert!(
        r.violations
            .iter()
            .any(|v| v.starts_with("G2: peer 2") && v.contains("17 elements")),
        "{:?}",
        r.violations
    );
    let clean = analyse(&log(vec![(0, failed(1, 0.0, 5.0))]));
    assert_eq!(clean.wrong_results, 0);
}
