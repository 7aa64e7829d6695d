//! The verdict on a run, computed from everything the workers reported. Pure: every check
//! is a function of the event log and can be tested without a process.
//!
//! - a hang is a call that took longer than the lease plus a margin, except calls of a
//!   worker while it was itself stopped and each initial worker's first
//!   `update_topology()` (world formation); a call that the stops of several other
//!   peers overlap (`--churn`) may take one more lease per stop after the first, the time
//!   to notice each; a membership call (`update_topology`, sync)
//!   that overlaps a master fault may also take [`MASTER_FAULT_ALLOWANCE_MS`] more, the
//!   time to elect the next leader and for the peer to find it (an all_reduce may not);
//! - a divergence is two members of one epoch holding different states at the same
//!   revision (after a sync or a commit), or final states that differ;
//! - a lost step is a commit made by a worker that lived to the end which is not on the
//!   history of the final state (walked back from the final hash through `prev`). A commit
//!   in the epoch a peer was evicted from is not held to this: a peer stopped in the last
//!   step of an all_reduce may, when it wakes, finish the call its survivors aborted (its
//!   result is exact, G3; no collective can make the last message atomic), and when it
//!   registers again the next sync replaces its state;
//! - a ghost (G4) is a peer that left a world, or was evicted, and is a member again;
//! - a false eviction is a peer evicted although no fault was injected into it (it was
//!   never stopped before it heard of its eviction).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::event::PeerId;
use serde::Serialize;

use crate::event::{Call, Event, Op};
use crate::master_faults::MasterOutcome;
use crate::measure::Outcome;
use crate::schedule::FaultKind;

/// What the orchestrator hands over at the end of a run.
pub struct RunLog {
    /// Every event, with the slot of the worker that reported it.
    pub events: Vec<(usize, Event)>,
    /// Every fault, with what its measurement found.
    pub faults: Vec<(FaultKind, Outcome)>,
    /// Every master fault, with what its measurement found.
    pub master_faults: Vec<(FaultKind, MasterOutcome)>,
    /// When each stopped worker was stopped: (slot, from, to).
    pub stopped: Vec<(usize, f64, f64)>,
    /// When each slow worker was stopped (under half a lease): (slot, from, to). Not
    /// among `stopped`: its eviction is a false one.
    pub slowed: Vec<(usize, f64, f64)>,
    /// The lease, in milliseconds.
    pub lease_ms: f64,
    /// When each master fault played out: (from, to).
    pub master_windows: Vec<(f64, f64)>,
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
    /// The shared state's size: a sync may take the hang limit plus the time to move it
    /// at the slowest rate this run's syncs measured ([`sync_allowance_ms`]).
    pub state_bytes: f64,
    /// `--churn`: the longest the job may go without a new step (ms).
    pub max_stall_ms: Option<f64>,
    pub seed: u64,
    pub peers: u32,
    pub duration_s: f64,
    /// The workers' `--transport`.
    pub transport: String,
    /// All-reduces in flight per step (`--in-flight`).
    pub in_flight: u32,
    /// Wall-clock ms of the run's start (the timeline's zero).
    pub t0: f64,
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
    pub master_kill: u64,
    pub master_hang: u64,
    pub slow: u64,
    pub partition: u64,
    pub leave_during_sync: u64,
}

#[derive(Debug, Default, Serialize)]
pub struct ByFault {
    pub kill: Stats,
    pub hang: Stats,
    pub partition: Stats,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub faults: FaultCounts,
    pub collectives_ok: u64,
    pub collectives_aborted: u64,
    /// Successful all_reduces per committed step and member: `--in-flight` or a little
    /// more (the calls of a step that failed after some of them succeeded).
    pub all_reduces_per_commit: Option<f64>,
    /// All_reduces whose result differs from the closed form, and failed ones that left
    /// their buffer changed (G2).
    pub wrong_results: u64,
    pub hangs: u64,
    pub divergences: u64,
    pub lost_steps: u64,
    pub abort_latency_ms: ByFault,
    pub recovery_ms: ByFault,
    pub join_ms: Stats,
    /// What the members' all_reduces and steps took while newcomers caught up, and
    /// otherwise.
    pub members: crate::members::MemberCost,
    /// From a master fault to another master leading (its first act: fresh leases).
    pub master_failover_ms: Stats,
    pub false_evictions: u64,
    /// The longest time between two new steps of the job (the first commit of a
    /// revision higher than every one before), in ms; none before two steps.
    pub longest_stall_ms: Option<f64>,
    pub violations: Vec<String>,
    pub steps: u64,
    pub duration_s: f64,
    pub seed: u64,
    pub peers: u32,
    pub transport: String,
    /// All-reduces in flight per step (`--in-flight`).
    pub in_flight: u32,
    /// The run over time (`--plot` draws it).
    pub timeline: crate::timeline::Timeline,
    /// Memory and descriptors of the processes that lived through the run.
    pub resources: Vec<crate::resources::Usage>,
    /// What a sync may take beyond the hang limit in this run ([`sync_allowance_ms`]).
    pub sync_allowance_ms: f64,
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
            Event::Touched {
                peer,
                epoch,
                revision,
                elements,
                ..
            } => Some(format!(
                "G2: peer {peer} (worker {slot}), a failed all_reduce for revision {revision} in epoch {epoch} left {elements} elements of its buffer changed"
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
    let falsely = false_evictions(log);
    violations.extend(falsely.iter().cloned());
    violations.extend(slow_aborts(log));
    let stall = longest_stall(&log.events, log.t0 + log.duration_s * 1e3);
    if let (Some(limit), Some((ms, at))) = (log.max_stall_ms, stall) {
        if ms > limit {
            violations.push(format!(
                "stall: no new step for {ms:.0} ms, until {:.2} s into the run (limit {limit:.0} ms)",
                (at - log.t0) / 1e3
            ));
        }
    }

    let mut faults = FaultCounts::default();
    for (kind, _) in &log.faults {
        *match kind {
            FaultKind::Kill => &mut faults.kill,
            FaultKind::Hang => &mut faults.hang,
            FaultKind::Join => &mut faults.join,
            FaultKind::Leave => &mut faults.leave,
            FaultKind::MasterKill => &mut faults.master_kill,
            FaultKind::MasterHang => &mut faults.master_hang,
            FaultKind::Slow => &mut faults.slow,
            FaultKind::Partition => &mut faults.partition,
            FaultKind::LeaveDuringSync => &mut faults.leave_during_sync,
        } += 1;
    }
    faults.slow += log.slowed.len() as u64;
    for (kind, _) in &log.master_faults {
        *match kind {
            FaultKind::MasterHang => &mut faults.master_hang,
            _ => &mut faults.master_kill,
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
    let commits = log
        .events
        .iter()
        .filter(|(_, e)| matches!(e, Event::Commit { .. }))
        .count();
    let all_reduces_ok = calls()
        .filter(|(_, c)| c.op == Op::AllReduce && c.ok)
        .count();
    Report {
        faults,
        all_reduces_per_commit: (commits > 0).then(|| all_reduces_ok as f64 / commits as f64),
        collectives_ok: counted().filter(|(_, c)| c.ok).count() as u64,
        collectives_aborted: counted().filter(|(_, c)| !c.ok).count() as u64,
        wrong_results: wrong.len() as u64,
        hangs: log.hangs + hung.len() as u64,
        divergences: divergent.len() as u64,
        lost_steps: lost.len() as u64,
        abort_latency_ms: ByFault {
            kill: of(FaultKind::Kill, |o| o.abort_ms),
            hang: of(FaultKind::Hang, |o| o.abort_ms),
            partition: of(FaultKind::Partition, |o| o.abort_ms),
        },
        recovery_ms: ByFault {
            kill: of(FaultKind::Kill, |o| o.recovery_ms),
            hang: of(FaultKind::Hang, |o| o.recovery_ms),
            partition: of(FaultKind::Partition, |o| o.recovery_ms),
        },
        join_ms: of(FaultKind::Join, |o| o.join_ms),
        members: crate::members::member_cost(log),
        master_failover_ms: stats(log.master_faults.iter().filter_map(|(_, o)| o.failover_ms)),
        false_evictions: falsely.len() as u64,
        longest_stall_ms: stall.map(|(ms, _)| ms),
        violations,
        steps,
        duration_s: log.duration_s,
        seed: log.seed,
        peers: log.peers,
        transport: log.transport.clone(),
        in_flight: log.in_flight,
        timeline: crate::timeline::timeline(log),
        resources: Vec::new(),
        sync_allowance_ms: sync_allowance_ms(log),
    }
}

/// The longest time between two new steps of the job (or from the last one to `end`, the
/// end of the run: a job that stops making progress commits nothing more), and when it
/// ended: the job's progress is the highest revision any worker has committed, and a
/// step is new when it raises that. PCCL's churn test fails when nothing completes for 5
/// minutes; eccl's asks for seconds.
pub fn longest_stall(events: &[(usize, Event)], end: f64) -> Option<(f64, f64)> {
    let mut commits: Vec<(f64, u64)> = events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Commit { t, revision, .. } => Some((*t, *revision)),
            _ => None,
        })
        .collect();
    commits.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut best: Option<(f64, f64)> = None;
    let mut last: Option<(f64, u64)> = None;
    for (t, rev) in commits {
        match last {
            Some((_, top)) if rev <= top => {}
            Some((since, _)) => {
                if best.is_none_or(|(ms, _)| t - since > ms) {
                    best = Some((t - since, t));
                }
                last = Some((t, rev));
            }
            None => last = Some((t, rev)),
        }
    }
    if let (Some((since, _)), Some((ms, _))) = (last, best) {
        if end - since > ms {
            best = Some((end - since, end));
        }
    }
    best
}

/// Calls longer than the limit, except those of a worker while it was stopped and each
/// initial worker's first `update_topology()`.
/// What a membership call overlapping a master fault may take beyond the hang limit: an
/// election (up to about 2 s when a returning master disrupts the next one), and the
/// peer's heartbeat timeout and search for the new leader.
pub const MASTER_FAULT_ALLOWANCE_MS: f64 = 5_000.0;

/// The rate a sync is assumed to move the state at when no sync of the run moved any
/// (bytes per ms: 100 MB/s, a slow link).
const DEFAULT_SYNC_RATE: f64 = 100e3;
/// Syncs that moved less than this are not timed for the rate (their time is latency).
const MIN_TIMED_SYNC_BYTES: u64 = 1 << 20;

/// What a `sync_shared_state` may take beyond the hang limit (ms): twice the time to
/// move the whole state at the slowest rate any sync of this run measured (bytes
/// received over the call's time, for syncs that moved at least a MiB), or at 100 MB/s
/// when none did. A large state is then not a hang, while a sync that moves nothing for
/// that long still is; every other call keeps the plain limit.
pub fn sync_allowance_ms(log: &RunLog) -> f64 {
    let mut last_sync: std::collections::HashMap<usize, &Call> = Default::default();
    let mut slowest: Option<f64> = None;
    for (slot, e) in &log.events {
        match e {
            Event::Call(c) if c.op == Op::Sync && c.ok => {
                last_sync.insert(*slot, c);
            }
            // The worker reports a sync's call, then what it moved.
            Event::Sync { bytes_received, .. } if *bytes_received >= MIN_TIMED_SYNC_BYTES => {
                if let Some(c) = last_sync.remove(slot) {
                    let rate = *bytes_received as f64 / (c.end - c.start).max(1.0);
                    slowest = Some(slowest.map_or(rate, |s: f64| s.min(rate)));
                }
            }
            _ => {}
        }
    }
    2.0 * log.state_bytes / slowest.unwrap_or(DEFAULT_SYNC_RATE)
}

fn hung_calls(log: &RunLog) -> Vec<String> {
    let sync_allowance = sync_allowance_ms(log);
    let mut formed = BTreeSet::new();
    let mut hung = Vec::new();
    for (slot, e) in &log.events {
        let Some(c) = e.call() else { continue };
        let forming = *slot < log.initial && c.op == Op::UpdateTopology && formed.insert(*slot);
        let while_stopped = log
            .stopped
            .iter()
            .any(|&(s, from, to)| s == *slot && c.start < to && c.end > from);
        let membership = matches!(c.op, Op::UpdateTopology | Op::Sync);
        let in_master_fault = log
            .master_windows
            .iter()
            .any(|&(from, to)| c.start < to && c.end > from);
        let others_stopped = log
            .stopped
            .iter()
            .any(|&(s, from, to)| s != *slot && c.start < to && c.end > from);
        // A new leader grants every peer a fresh lease, a stopped one's too: a call that
        // waits on a stopped peer while a master fault plays out may wait that much longer
        // before the peer is evicted or resumes.
        let master_fault = in_master_fault && (membership || others_stopped);
        // Each stopped peer is noticed only when its lease runs out: a call that two or
        // more stops overlap (under --churn) may wait out one lease per stop after the
        // first before its world settles. One at a time, this adds nothing.
        let stops: BTreeSet<usize> = log
            .stopped
            .iter()
            .filter(|&&(s, from, to)| s != *slot && c.start < to && c.end > from)
            .map(|&(s, _, _)| s)
            .collect();
        let overlapping = log.lease_ms * stops.len().saturating_sub(1) as f64;
        let limit = overlapping
            + if master_fault {
                log.hang_limit_ms + MASTER_FAULT_ALLOWANCE_MS
            } else {
                log.hang_limit_ms
            }
            + if c.op == Op::Sync {
                sync_allowance
            } else {
                0.0
            };
        let ms = c.end - c.start;
        if ms > limit && !forming && !while_stopped {
            hung.push(format!(
                "hang: peer {} (worker {slot}) {} took {ms:.0} ms in epoch {} (limit {:.0} ms){}",
                c.peer,
                op_name(c.op),
                c.epoch,
                limit,
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

/// Failed calls while a peer was slow (stopped under half a lease) or within a lease after
/// it woke: a slow peer must cost the others time, never an abort. Faults play one at a
/// time, so nothing else can have caused them.
pub(crate) fn slow_aborts(log: &RunLog) -> Vec<String> {
    // Under --churn another fault may strike while a slow peer is stopped: a call it
    // failed is not the slow peer's doing. As for master faults, a fault explains a call
    // that overlaps it widened by the hang limit (a lease and the margin) on both sides;
    // a join fails no call, and one slow peer does not excuse another.
    let reach = log.hang_limit_ms;
    let explained: Vec<(f64, f64)> = log
        .faults
        .iter()
        .filter(|(k, _)| !matches!(k, FaultKind::Join | FaultKind::Slow))
        .map(|(_, o)| (o.at, o.at + o.stopped_ms.unwrap_or(0.0)))
        .chain(log.stopped.iter().map(|&(_, from, to)| (from, to)))
        .chain(log.master_windows.iter().copied())
        .collect();
    let other_fault = |start: f64, end: f64| {
        explained
            .iter()
            .any(|&(from, to)| from - reach <= end && to + reach >= start)
    };
    let mut found = Vec::new();
    for &(victim, from, to) in &log.slowed {
        for (slot, e) in &log.events {
            let Some(c) = e.call() else { continue };
            if !c.ok
                && c.op.is_counted()
                && c.end > from
                && c.start < to + log.lease_ms
                && !other_fault(c.start, c.end)
            {
                found.push(format!(
                    "slow peer caused an abort: worker {victim} was stopped {:.0} ms (under \
                     half a lease) and peer {} (worker {slot}) failed a {} in epoch {}",
                    to - from,
                    c.peer,
                    op_name(c.op),
                    c.epoch
                ));
            }
        }
    }
    found
}

/// Evictions of peers that were never stopped before they heard of them: only a hung
/// peer may be evicted (a killed one says nothing, and a peer's links breaking must not
/// cost it its place).
fn false_evictions(log: &RunLog) -> Vec<String> {
    log.events
        .iter()
        .filter_map(|(slot, e)| match e {
            Event::Evicted { peer, t, reason } => Some((*slot, *peer, *t, reason)),
            _ => None,
        })
        .filter(|(slot, _, t, _)| {
            !log.stopped
                .iter()
                .any(|&(s, from, _)| s == *slot && from < *t)
        })
        .map(|(slot, peer, _, reason)| {
            format!(
                "false eviction: peer {peer} (worker {slot}) was evicted though no fault was injected into it: {reason}"
            )
        })
        .collect()
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
        (
            "partition",
            r.faults.partition,
            &r.abort_latency_ms.partition,
            &r.recovery_ms.partition,
        ),
    ] {
        if name == "partition" && n == 0 {
            continue;
        }
        out += &format!(
            "  {name:<9}{n:>3}{}{}\n",
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
    let m = &r.members;
    if m.all_reduce_during_joins_ms.p50.is_some() {
        let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        out += &format!(
            "# members while newcomers caught up: all_reduce p50 {} / max {} ms (otherwise {} / {}), step p50 {} / max {} ms (otherwise {} / {})\n",
            ms(m.all_reduce_during_joins_ms.p50),
            ms(m.all_reduce_during_joins_ms.max),
            ms(m.all_reduce_otherwise_ms.p50),
            ms(m.all_reduce_otherwise_ms.max),
            ms(m.step_during_joins_ms.p50),
            ms(m.step_during_joins_ms.max),
            ms(m.step_otherwise_ms.p50),
            ms(m.step_otherwise_ms.max),
        );
    }
    if r.faults.leave_during_sync > 0 {
        out += &format!(
            "  leave-during-sync {}   (a member left from the middle of a sync; each with a newcomer, counted under join)\n",
            r.faults.leave_during_sync
        );
    }
    if r.faults.slow > 0 {
        out += &format!(
            "  slow {:>7}   (stopped under half a lease: no abort, no eviction may follow)\n",
            r.faults.slow
        );
    }
    if r.faults.master_kill + r.faults.master_hang > 0 {
        out += &format!(
            "  master-kill {}, master-hang {}: failover (ms) p50 {} p99 {} max {}\n",
            r.faults.master_kill,
            r.faults.master_hang,
            fmt_ms(r.master_failover_ms.p50),
            fmt_ms(r.master_failover_ms.p99),
            fmt_ms(r.master_failover_ms.max)
        );
    }
    out += &format!(
        "# collectives ok {}, aborted {}; wrong results {}; hangs {}; divergences {}; lost steps {}; false evictions {}\n",
        r.collectives_ok, r.collectives_aborted, r.wrong_results, r.hangs, r.divergences, r.lost_steps, r.false_evictions
    );
    if let Some(ms) = r.longest_stall_ms {
        out += &format!(
            "# steps {}; longest wait for a new step {ms:.0} ms
",
            r.steps
        );
    }
    if let Some(most) = r.resources.iter().max_by_key(|u| u.rss_kib_end) {
        let grew = r.resources.iter().filter(|u| u.grew).count();
        let fds = r.resources.iter().map(|u| u.fds_end).max().unwrap_or(0);
        out += &format!(
            "# resources of {} long-lived processes (start -> end of the run): largest RSS {} ({} -> {} MiB), most fds {fds}{}\n",
            r.resources.len(),
            most.name,
            most.rss_kib_start >> 10,
            most.rss_kib_end >> 10,
            if r.duration_s >= crate::resources::MIN_JUDGED_S {
                format!("; {grew} grew past 5 %")
            } else {
                "; not judged (a run under a minute)".into()
            }
        );
    }
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
#[path = "report_tests.rs"]
pub(crate) mod tests;
