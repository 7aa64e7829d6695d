//! The run's master faults: strike the leader, bring it back when due, close the fault.

use crate::event::now_ms;
use crate::master_faults::{MasterFault, RESTART_AFTER_MS};
use crate::schedule::FaultKind;

use super::Run;

impl Run<'_> {
    /// Brings a master fault's victim back when due, and closes the fault once it has
    /// played out (or timed out).
    pub(super) fn master_fault_due(&mut self) -> anyhow::Result<()> {
        let now = now_ms();
        let Some(m) = &mut self.master_open else {
            return Ok(());
        };
        if m.back_at.is_none() && now >= m.back_due {
            match m.kind {
                FaultKind::MasterKill => self.fleet.masters.spawn(m.index)?,
                _ => self.fleet.masters.pause(m.index, false)?,
            }
            m.back_at = Some(now);
        }
        if !(m.is_done() || now > m.deadline()) {
            return Ok(());
        }
        let Some(m) = self.master_open.take() else {
            return Ok(());
        };
        self.say(m.at, &m.describe());
        // Under --churn a worker fault may strike while the master fault plays out: a
        // collective it aborted is not the master fault's doing. A fault explains a call
        // that overlaps it, widened by a lease and the hang margin on both sides: from
        // before the call began (its world still held the victim) to after a stopped
        // victim resumed (its next call learns of its eviction).
        let now = now_ms();
        let windows: Vec<(f64, f64)> = self
            .faults
            .iter()
            .filter(|(k, _)| *k != FaultKind::Join)
            .map(|(_, o)| (o.at, o.at + o.stopped_ms.unwrap_or(0.0)))
            .chain(
                self.open
                    .iter()
                    .filter(|o| o.fault.kind != FaultKind::Join)
                    .map(|o| (o.fault.at, now)),
            )
            .chain(self.stopped.iter().map(|&(_, from, to)| (from, to)))
            .collect();
        let reach = self.args.lease_ms as f64 + super::HANG_MARGIN_MS;
        let unexplained: Vec<&String> = m
            .aborted
            .iter()
            .filter(|(start, end, _)| {
                !windows
                    .iter()
                    .any(|&(from, to)| from - reach <= *end && to + reach >= *start)
            })
            .map(|(_, _, a)| a)
            .collect();
        for a in unexplained {
            self.violation(
                now,
                format!(
                    "collective aborted by a master fault alone ({}): {a}",
                    m.kind.name()
                ),
            );
        }
        if !m.is_done() {
            self.hangs += 1;
            let text = format!(
                "hang: the {} of master {} at {:.2} s had not played out {:.0} s later ({})",
                m.kind.name(),
                m.node(),
                (m.at - self.t0) / 1e3,
                (now - m.at) / 1e3,
                m.describe()
            );
            self.violation(now, text);
        }
        self.master_faults.push((m.kind, m.outcome()));
        self.master_windows.push((m.at, now));
        Ok(())
    }

    /// Strikes a master fault at the leader (or, with no leader known, the master the plan
    /// picks).
    pub(super) fn strike_master(&mut self, kind: FaultKind, pick: u32) -> anyhow::Result<()> {
        let n = self.fleet.masters.len();
        let leader = self.masters.leader(|_| true);
        let index = match leader {
            Some((node, _)) => node as usize - 1,
            None => pick as usize % n,
        };
        let node = index as u64 + 1;
        let term_before = leader.map_or(0, |(_, t)| t);
        // The next leader grants every peer a fresh lease, a stopped one's too: a hang
        // that has not resumed yet may end without an eviction.
        for m in &mut self.open {
            if m.fault.kind == FaultKind::Hang && !m.resumed_yet() {
                m.lease_renewed = true;
            }
        }
        let Some(pid) = self.fleet.masters.pid(index) else {
            return Ok(());
        };
        let now = now_ms();
        let back_due = match kind {
            FaultKind::MasterKill => {
                self.fleet.masters.kill(index);
                now + RESTART_AFTER_MS
            }
            _ => {
                self.fleet.masters.pause(index, true)?;
                now + self.hang_ms
            }
        };
        self.master_open = Some(MasterFault {
            kind,
            index,
            pid,
            at: now,
            was_leader: leader.is_some_and(|(l, _)| l == node),
            term_before,
            back_due,
            back_at: None,
            new_leader: None,
            rejoined_at: None,
            aborted: Vec::new(),
            retried: 0,
        });
        Ok(())
    }
}
