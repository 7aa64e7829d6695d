//! Faults of the master cluster (`--masters N`): `master-kill` SIGKILLs the leader and
//! restarts it from its data directory a few seconds later; `master-hang` SIGSTOPs the
//! leader past an election and continues it. Each is measured from the masters' own
//! reports of who leads: how long the cluster was leaderless (until another master leads
//! in a newer term — its first act is a lease decision: every live peer gets a fresh
//! lease), and when the victim was back and following the new leader. Peers' collectives
//! must not notice: an all_reduce aborted while a master fault plays out is a violation.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::event::Call;
use crate::event::Op;
use crate::master::MasterReport;
use crate::schedule::FaultKind;

/// How long a killed master stays down before it restarts from its data directory.
pub const RESTART_AFTER_MS: f64 = 3_000.0;
/// A master fault that has not played out this long after the victim came back is a hang.
const TIMEOUT_MS: f64 = 15_000.0;

/// The latest report of every master.
#[derive(Default)]
pub struct MasterView {
    latest: BTreeMap<u64, MasterReport>,
}

impl MasterView {
    pub fn observe(&mut self, r: MasterReport) {
        self.latest.insert(r.node, r);
    }

    /// The master that says it leads, in the newest term, among those `up` allows.
    pub fn leader(&self, up: impl Fn(u64) -> bool) -> Option<(u64, u64)> {
        self.latest
            .values()
            .filter(|r| r.leader == Some(r.node) && up(r.node))
            .map(|r| (r.node, r.term))
            .max_by_key(|(_, term)| *term)
    }
}

/// What a master fault found.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MasterOutcome {
    /// Wall-clock ms of the fault.
    pub at: f64,
    /// From the fault to another master leading (and granting fresh leases); `None` if
    /// the victim did not lead or no leader came.
    pub failover_ms: Option<f64>,
    /// From the fault until the victim, back, follows a leader of the new term.
    pub rejoined_ms: Option<f64>,
}

pub struct MasterFault {
    pub kind: FaultKind,
    /// Index of the victim in the master set; its node id is `index + 1`.
    pub index: usize,
    pub pid: u32,
    pub at: f64,
    pub was_leader: bool,
    pub term_before: u64,
    /// When the victim is restarted (kill) or continued (hang).
    pub back_due: f64,
    pub back_at: Option<f64>,
    pub new_leader: Option<(u64, f64)>,
    pub rejoined_at: Option<f64>,
    /// All_reduce calls that were aborted while the fault played out: (start, end,
    /// what the call said).
    pub aborted: Vec<(f64, f64, String)>,
    /// Membership calls (update_topology, sync) that failed and were retried.
    pub retried: u64,
}

impl MasterFault {
    pub fn node(&self) -> u64 {
        self.index as u64 + 1
    }

    pub fn observe_report(&mut self, r: &MasterReport) {
        let node = self.node();
        if self.new_leader.is_none()
            && r.node != node
            && r.leader == Some(r.node)
            && r.term > self.term_before
        {
            self.new_leader = Some((r.node, r.t));
        }
        let new_term = self.new_leader.map(|_| self.term_before + 1);
        if self.back_at.is_some()
            && self.rejoined_at.is_none()
            && r.node == node
            && r.leader.is_some()
            && r.leader != Some(node)
            && new_term.is_none_or(|t| r.term >= t)
        {
            self.rejoined_at = Some(r.t);
        }
    }

    pub fn observe_call(&mut self, slot: usize, c: &Call) {
        if c.ok || c.end < self.at {
            return;
        }
        if c.op == Op::AllReduce {
            self.aborted.push((
                c.start,
                c.end,
                format!(
                    "peer {} (worker {slot}) all_reduce in epoch {}: {}",
                    c.peer,
                    c.epoch,
                    c.detail.as_deref().or(c.err.as_deref()).unwrap_or("failed")
                ),
            ));
        } else {
            self.retried += 1;
        }
    }

    pub fn deadline(&self) -> f64 {
        self.back_due + TIMEOUT_MS
    }

    pub fn is_done(&self) -> bool {
        self.back_at.is_some()
            && self.rejoined_at.is_some()
            && (self.new_leader.is_some() || !self.was_leader)
    }

    pub fn outcome(&self) -> MasterOutcome {
        MasterOutcome {
            at: self.at,
            failover_ms: self.new_leader.map(|(_, t)| t - self.at),
            rejoined_ms: self.rejoined_at.map(|t| t - self.at),
        }
    }

    /// One line, e.g. `master-kill master 1 (pid 42, leader in term 1): master 3 leads
    /// after 412 ms; back and following after 3210 ms; 0 all_reduce aborted`.
    pub fn describe(&self) -> String {
        let o = self.outcome();
        let head = format!(
            "{:<5} master {} (pid {}, {})",
            self.kind.name(),
            self.node(),
            self.pid,
            if self.was_leader {
                format!("leader in term {}", self.term_before)
            } else {
                "a follower".into()
            }
        );
        let led = match (self.new_leader, o.failover_ms) {
            (Some((n, _)), Some(ms)) => format!("master {n} leads after {ms:.0} ms"),
            _ if !self.was_leader => "no election needed".into(),
            _ => "no new leader".into(),
        };
        let back = match o.rejoined_ms {
            Some(ms) => format!("back and following after {ms:.0} ms"),
            None => "did not come back as a follower".into(),
        };
        format!(
            "{head}: {led}; {back}; {} all_reduce aborted, {} membership calls retried",
            self.aborted.len(),
            self.retried
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(node: u64, t: f64, leader: Option<u64>, term: u64) -> MasterReport {
        MasterReport {
            node,
            t,
            leader,
            term,
        }
    }

    #[test]
    fn the_leader_is_the_newest_self_declared_one() {
        let mut v = MasterView::default();
        v.observe(report(1, 0.0, Some(1), 1));
        v.observe(report(2, 0.0, Some(1), 1));
        assert_eq!(v.leader(|_| true), Some((1, 1)));
        v.observe(report(3, 1.0, Some(3), 2));
        assert_eq!(v.leader(|_| true), Some((3, 2)));
        assert_eq!(
            v.leader(|n| n != 3),
            Some((1, 1)),
            "a stopped master is skipped"
        );
    }

    #[test]
    fn a_kill_plays_out_when_another_leads_and_the_victim_follows() {
        let mut f = MasterFault {
            kind: FaultKind::MasterKill,
            index: 0,
            pid: 1,
            at: 100.0,
            was_leader: true,
            term_before: 1,
            back_due: 3100.0,
            back_at: None,
            new_leader: None,
            rejoined_at: None,
            aborted: Vec::new(),
            retried: 0,
        };
        f.observe_report(&report(2, 150.0, None, 2));
        f.observe_report(&report(2, 400.0, Some(2), 2));
        assert_eq!(f.outcome().failover_ms, Some(300.0));
        assert!(!f.is_done());
        f.back_at = Some(3100.0);
        // The restarted master first knows only its old term.
        f.observe_report(&report(1, 3150.0, Some(1), 1));
        assert!(!f.is_done());
        f.observe_report(&report(1, 3300.0, Some(2), 2));
        assert!(f.is_done());
        assert_eq!(f.outcome().rejoined_ms, Some(3200.0));
    }
}
