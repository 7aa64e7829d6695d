//! What members pay while newcomers catch up: their all_reduces and steps that overlap a
//! newcomer's catch-up, beside those while no fault plays out (`members` in the report).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::{Event, Op};
use crate::measure::Outcome;
use crate::report::{stats, RunLog, Stats};
use crate::schedule::FaultKind;

/// What members' calls took while newcomers caught up, beside the same at other times.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MemberCost {
    /// Members' successful all_reduces that overlap a newcomer's catch-up (its spawn to
    /// its first synced all_reduce), in ms.
    pub all_reduce_during_joins_ms: Stats,
    /// The same while no fault plays out.
    pub all_reduce_otherwise_ms: Stats,
    /// Members' steps (one commit to the next) that overlap a catch-up, in ms.
    pub step_during_joins_ms: Stats,
    /// The same while no fault plays out.
    pub step_otherwise_ms: Stats,
}

/// The members' all_reduces and steps during newcomers' catch-ups, and while no fault
/// plays out. A fault plays out from its time to the end of the longest of what was
/// measured of it (its join, recovery or stop); a fault with none of those counts from
/// its time for a lease.
pub fn member_cost(log: &RunLog) -> MemberCost {
    let played = |o: &Outcome| {
        let d = [o.join_ms, o.recovery_ms, o.stopped_ms, o.abort_ms]
            .into_iter()
            .flatten()
            .fold(log.lease_ms, f64::max);
        (o.at, o.at + d)
    };
    let joins: Vec<(usize, f64, f64)> = log
        .faults
        .iter()
        .filter(|(k, o)| *k == FaultKind::Join && o.join_ms.is_some())
        .map(|(_, o)| (o.victim, o.at, o.at + o.join_ms.unwrap_or(0.0)))
        .collect();
    let windows: Vec<(f64, f64)> = log
        .faults
        .iter()
        .map(|(_, o)| played(o))
        .chain(log.master_windows.iter().copied())
        .collect();
    let overlaps = |(a, b): (f64, f64), (c, d): (f64, f64)| a < d && c < b;
    // A member of a join: any slot but the newcomer's.
    let during_join = |slot: usize, span: (f64, f64)| {
        joins
            .iter()
            .any(|&(v, c, d)| v != slot && overlaps(span, (c, d)))
    };
    let quiet = |span: (f64, f64)| !windows.iter().any(|&w| overlaps(span, w));
    let (mut ar_join, mut ar_quiet, mut step_join, mut step_quiet) =
        (vec![], vec![], vec![], vec![]);
    let mut last_commit: BTreeMap<usize, f64> = BTreeMap::new();
    for (slot, e) in &log.events {
        match e {
            Event::Call(c) if c.op == Op::AllReduce && c.ok => {
                let span = (c.start, c.end);
                if during_join(*slot, span) {
                    ar_join.push(c.end - c.start);
                } else if quiet(span) {
                    ar_quiet.push(c.end - c.start);
                }
            }
            Event::Commit { t, .. } => {
                if let Some(prev) = last_commit.insert(*slot, *t) {
                    let span = (prev, *t);
                    if during_join(*slot, span) {
                        step_join.push(t - prev);
                    } else if quiet(span) {
                        step_quiet.push(t - prev);
                    }
                }
            }
            Event::Evicted { .. } | Event::Registered { .. } => {
                last_commit.remove(slot);
            }
            _ => {}
        }
    }
    MemberCost {
        all_reduce_during_joins_ms: stats(ar_join),
        all_reduce_otherwise_ms: stats(ar_quiet),
        step_during_joins_ms: stats(step_join),
        step_otherwise_ms: stats(step_quiet),
    }
}
