//! The verdict on a run, computed from everything the workers reported. Pure: every check
//! is a function of the event log and can be tested without a process.
//!
//! - a hang is a call that took longer than the lease plus a margin, except calls of a
//!   worker while it was itself stopped and each initial worker's first
//!   `update_topology()` (world formation);
//! - a divergence is two members of one epoch holding different states at the same
//!   revision (after a sync or a commit), or final states that differ;
//! - a lost step is a commit made by a worker that lived to the end which is not on the
//!   history of the final state (walked back from the final hash through `prev`). A commit
//!   in the epoch a peer was evicted from is not held to this: a peer stopped in the last
//!   step of an all_reduce may, when it wakes, finish the call its survivors aborted (its
//!   result is exact, G3; no collective can make the last message atomic), and when it
//!   registers again the next sync replaces its state;
//! - a ghost (G4) is a peer that left a world, or was evicted, and is a member again.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::event::PeerId;
use serde::Serialize;

use crate::event::{Call, Event, Op};
use crate::measure::Outcome;
use crate::schedule::FaultKind;

/// What the orchestrator hands over at the end of a run.
pub struct RunLog {
    /// Every event, with the slot of the worker that reported it.
    pub events: Vec<(usize, Event)>,
    /// Every fault, with what its measurement found.
    pub faults: Vec<(FaultKind, Outcome)>,
    /// When each stopped worker was stopped: (slot, from, to).
    pub stopped: Vec<(usize, f64, f64)>,
    /// Slots below this are the initial workers.
    pub initial: usize,
    /// Workers alive at the end, told to stop at the final revision.
    pub finishers: BTreeSet<usize>,
    /// Violations found while running (measurements that timed out, bad exits).
    pub violations: Vec<String>,
    /// How many of those were hangs.
    pub hangs: u64,
    /// A call longer than this (ms) is a hang.
    pub hang_limit_ms: f64,
    pub seed: u64,
    pub peers: u32,
    pub duration_s: f64,
    /// The workers' `--transport`.
    pub transport: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

#[derive(Debug, Default, Serialize)]
pub struct FaultCounts {
    pub kill: u64,
    pub hang: u64,
    pub join: u64,
    pub leave: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct ByFault {
    pub kill: Stats,
    pub hang: Stats,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub faults: FaultCounts,
    pub collectives_ok: u64,
    pub collectives_aborted: u64,
    pub wrong_results: u64,
    pub hangs: u64,
    pub divergences: u64,
    pub lost_steps: u64,
    pub abort_latency_ms: ByFault,
    pub recovery_ms: ByFault,
    pub join_ms: Stats,
    pub violations: Vec<String>,
    pub steps: u64,
    pub duration_s: f64,
    pub seed: u64,
    pub peers: u32,
    pub transport: String,
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

pub fn stats(samples: impl IntoIterator<Item = f64>) -> Stats {
    let mut v: Vec<f64> = samples.into_iter().collect();
    v.sort_by(f64::total_cmp);
    Stats {
        p50: percentile(&v, 50.0),
        p99: percentile(&v, 99.0),
        max: v.last().copied(),
    }
}

pub fn analyse(log: &RunLog) -> Report {
    let mut violations = log.violations.clone();
    let calls = || {
        log.events
            .iter()
            .filter_map(|(slot, e)| Some((*slot, e.call()?)))
    };

    let hung = hung_calls(log);
    let divergent = divergences(&log.events);
    let lost = lost_steps(&log.events, &log.finishers);
    let wrong: Vec<String> = log
        .events
        .iter()
        .filter_map(|(slot, e)| match e {
            Event::Wrong {
                peer,
                epoch,
                revision,
                elements,
                ..
            } => Some(format!(
                "wrong result: peer {peer} (worker {slot}), all_reduce for revision {revision} in epoch {epoch}: {elements} elements differ from the closed form"
            )),
            _ => None,
        })
        .collect();
    violations.extend(hung.iter().cloned());
    violations.extend(wrong.iter().cloned());
    violations.extend(divergent.iter().cloned());
    violations.extend(lost.iter().map(|(rev, hash)| {
        format!(
            "lost step: revision {rev} (state {}) is not on the final history",
            &hash[..12.min(hash.len())]
        )
    }));
    violations.extend(ghosts(&log.events));

    let mut faults = FaultCounts::default();
    for (kind, _) in &log.faults {
        *match kind {
            FaultKind::Kill => &mut faults.kill,
            FaultKind::Hang => &mut faults.hang,
            FaultKind::Join => &mut faults.join,
            FaultKind::Leave => &mut faults.leave,
        } += 1;
    }
    let of = |kind: FaultKind, f: fn(&Outcome) -> Option<f64>| {
        stats(
            log.faults
                .iter()
                .filter(|(k, _)| *k == kind)
                .filter_map(|(_, o)| f(o)),
        )
    };
    let counted = || calls().filter(|(_, c)| c.op.is_counted());
    let steps = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Final { revision, .. } | Event::Commit { revision, .. } => Some(*revision),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    Report {
        faults,
        collectives_ok: counted().filter(|(_, c)| c.ok).count() as u64,
        collectives_aborted: counted().filter(|(_, c)| !c.ok).count() as u64,
        wrong_results: wrong.len() as u64,
        hangs: log.hangs + hung.len() as u64,
        divergences: divergent.len() as u64,
        lost_steps: lost.len() as u64,
        abort_latency_ms: ByFault {
            kill: of(FaultKind::Kill, |o| o.abort_ms),
            hang: of(FaultKind::Hang, |o| o.abort_ms),
        },
        recovery_ms: ByFault {
            kill: of(FaultKind::Kill, |o| o.recovery_ms),
            hang: of(FaultKind::Hang, |o| o.recovery_ms),
        },
        join_ms: of(FaultKind::Join, |o| o.join_ms),
        violations,
        steps,
        duration_s: log.duration_s,
        seed: log.seed,
        peers: log.peers,
        transport: log.transport.clone(),
    }
}

/// Calls longer than the limit, except those of a worker while it was stopped and each
/// initial worker's first `update_topology()`.
fn hung_calls(log: &RunLog) -> Vec<String> {
    let mut formed = BTreeSet::new();
    let mut hung = Vec::new();
    for (slot, e) in &log.events {
        let Some(c) = e.call() else { continue };
        let forming = *slot < log.initial && c.op == Op::UpdateTopology && formed.insert(*slot);
        let while_stopped = log
            .stopped
            .iter()
            .any(|&(s, from, to)| s == *slot && c.start < to && c.end > from);
        let ms = c.end - c.start;
        if ms > log.hang_limit_ms && !forming && !while_stopped {
            hung.push(format!(
                "hang: peer {} (worker {slot}) {} took {ms:.0} ms in epoch {} (limit {:.0} ms){}",
                c.peer,
                op_name(c.op),
                c.epoch,
                log.hang_limit_ms,
                c.err
                    .as_ref()
                    .map(|e| format!(", then failed with {e}"))
                    .unwrap_or_default()
            ));
        }
    }
    hung
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::UpdateTopology => "update_topology",
        Op::Sync => "sync_shared_state",
        Op::AllReduce => "all_reduce",
        Op::Barrier => "barrier",
        Op::Leave => "leave",
    }
}

/// States that differ where they must agree: within one epoch at one revision (the
/// workers' own hashes after a sync or commit, and the library's sync hashes, separately),
/// and among the final states.
fn divergences(events: &[(usize, Event)]) -> Vec<String> {
    let mut ours: BTreeMap<(u64, u64), BTreeSet<&str>> = BTreeMap::new();
    let mut lib: BTreeMap<(u64, u64), BTreeSet<&str>> = BTreeMap::new();
    let mut finals = BTreeSet::new();
    for (_, e) in events {
        match e {
            Event::Sync {
                epoch,
                revision,
                hash,
                lib_hash,
                ..
            } => {
                ours.entry((*epoch, *revision)).or_default().insert(hash);
                lib.entry((*epoch, *revision)).or_default().insert(lib_hash);
            }
            Event::Commit {
                epoch,
                revision,
                hash,
                ..
            } => {
                ours.entry((*epoch, *revision)).or_default().insert(hash);
            }
            Event::Final { hash, .. } => {
                finals.insert(hash.as_str());
            }
            _ => {}
        }
    }
    let mut found = Vec::new();
    for (what, groups) in [("states", &ours), ("library sync hashes", &lib)] {
        for ((epoch, revision), hashes) in groups {
            if hashes.len() > 1 {
                found.push(format!(
                    "divergence: members of epoch {epoch} hold {} different {what} at revision {revision}",
                    hashes.len()
                ));
            }
        }
    }
    if finals.len() > 1 {
        found.push(format!(
            "divergence: the workers ended with {} different final states",
            finals.len()
        ));
    }
    found
}

/// Commits (revision, hash) made by `finishers` that are not on the history of a final
/// state. Without a final state there is no history to judge by (and the missing finals
/// are violations of their own).
fn lost_steps(events: &[(usize, Event)], finishers: &BTreeSet<usize>) -> BTreeSet<(u64, String)> {
    let mut prev_of: HashMap<&str, &str> = HashMap::new();
    let mut history: BTreeSet<&str> = BTreeSet::new();
    // The last epoch each peer id took part in, and which of them were evicted.
    let mut last_epoch: HashMap<PeerId, u64> = HashMap::new();
    let mut evicted: BTreeSet<PeerId> = BTreeSet::new();
    for (_, e) in events {
        match e {
            Event::Commit {
                peer,
                prev,
                hash,
                epoch,
                ..
            } => {
                prev_of.insert(hash, prev);
                let last = last_epoch.entry(*peer).or_insert(*epoch);
                *last = (*last).max(*epoch);
            }
            Event::Call(c) => {
                let last = last_epoch.entry(c.peer).or_insert(c.epoch);
                *last = (*last).max(c.epoch);
            }
            Event::Evicted { peer, .. } => {
                evicted.insert(*peer);
            }
            Event::Final { hash, .. } => {
                history.insert(hash);
            }
            _ => {}
        }
    }
    if history.is_empty() {
        return BTreeSet::new();
    }
    let mut todo: Vec<&str> = history.iter().copied().collect();
    while let Some(h) = todo.pop() {
        if let Some(&prev) = prev_of.get(h) {
            if history.insert(prev) {
                todo.push(prev);
            }
        }
    }
    let evicted_from =
        |peer: &PeerId, epoch: &u64| evicted.contains(peer) && last_epoch.get(peer) == Some(epoch);
    events
        .iter()
        .filter(|(slot, _)| finishers.contains(slot))
        .filter_map(|(_, e)| match e {
            Event::Commit {
                peer,
                epoch,
                revision,
                hash,
                ..
            } if !history.contains(hash.as_str()) && !evicted_from(peer, epoch) => {
                Some((*revision, hash.clone()))
            }
            _ => None,
        })
        .collect()
}

/// G4: a peer that left a world (it died, was evicted or left) never becomes a member
/// again, and a peer that learned of its eviction is in no call that started later.
/// Also: all successful calls of one epoch name the same members.
fn ghosts(events: &[(usize, Event)]) -> Vec<String> {
    let ok_calls = || events.iter().filter_map(|(_, e)| e.call()).filter(|c| c.ok);
    let mut found = Vec::new();

    let mut worlds: BTreeMap<u64, &Call> = BTreeMap::new();
    for c in ok_calls() {
        let first = worlds.entry(c.epoch).or_insert(c);
        if sorted(&first.members) != sorted(&c.members) {
            found.push(format!(
                "epoch {} has two member lists: {:?} (peer {}) and {:?} (peer {})",
                c.epoch, first.members, first.peer, c.members, c.peer
            ));
        }
    }
    let mut seen = BTreeSet::new();
    let mut gone: BTreeMap<PeerId, u64> = BTreeMap::new();
    for (&epoch, c) in &worlds {
        let members: BTreeSet<PeerId> = c.members.iter().copied().collect();
        for &p in seen.difference(&members) {
            gone.entry(p).or_insert(epoch);
        }
        for p in &members {
            if let Some(left_in) = gone.get(p) {
                found.push(format!(
                    "ghost (G4): peer {p}, gone from the world in epoch {left_in}, is a member of epoch {epoch}"
                ));
            }
        }
        seen.extend(members);
    }

    for (_, e) in events {
        let Event::Evicted { peer, t, .. } = e else {
            continue;
        };
        if let Some(c) = ok_calls().find(|c| c.start > *t && c.members.contains(peer)) {
            found.push(format!(
                "ghost (G4): peer {peer} was evicted but is a member of peer {}'s {} in epoch {}",
                c.peer,
                op_name(c.op),
                c.epoch
            ));
        }
    }
    found
}

fn sorted(v: &[PeerId]) -> Vec<PeerId> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0}"))
}

fn fmt_stats(s: &Stats) -> String {
    format!(
        "{:>7}{:>7}{:>7}",
        fmt_ms(s.p50),
        fmt_ms(s.p99),
        fmt_ms(s.max)
    )
}

/// The table printed at the end of a run.
pub fn summary(r: &Report) -> String {
    let mut out = format!(
        "\n# eccl-chaos: seed {}, {} peers, {:.1} s, {} steps, transport {}\n",
        r.seed, r.peers, r.duration_s, r.steps, r.transport
    );
    out += "#               abort latency (ms)     recovery (ms)\n";
    out += "# fault  count    p50    p99    max    p50    p99    max\n";
    for (name, n, abort, recovery) in [
        (
            "kill",
            r.faults.kill,
            &r.abort_latency_ms.kill,
            &r.recovery_ms.kill,
        ),
        (
            "hang",
            r.faults.hang,
            &r.abort_latency_ms.hang,
            &r.recovery_ms.hang,
        ),
    ] {
        out += &format!(
            "  {name:<5}{n:>7}{}{}\n",
            fmt_stats(abort),
            fmt_stats(recovery)
        );
    }
    out += &format!(
        "  join {:>7}{}   (time to join)\n  leave{:>7}\n",
        r.faults.join,
        fmt_stats(&r.join_ms),
        r.faults.leave
    );
    out += &format!(
        "# collectives ok {}, aborted {}; wrong results {}; hangs {}; divergences {}; lost steps {}\n",
        r.collectives_ok, r.collectives_aborted, r.wrong_results, r.hangs, r.divergences, r.lost_steps
    );
    if r.violations.is_empty() {
        out += "# violations: none\n";
    } else {
        out += &format!("# violations: {}\n", r.violations.len());
        for v in &r.violations {
            out += &format!("#   {v}\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
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

    fn log(events: Vec<(usize, Event)>) -> RunLog {
        RunLog {
            events,
            faults: Vec::new(),
            stopped: Vec::new(),
            initial: 2,
            finishers: [0, 1].into(),
            violations: Vec::new(),
            hangs: 0,
            hang_limit_ms: 3000.0,
            seed: 1,
            peers: 2,
            transport: "auto".into(),
            duration_s: 1.0,
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
}
