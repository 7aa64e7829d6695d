//! Measuring one fault while the run goes on. Pure: the orchestrator feeds it the
//! workers' events and process exits, and asks whether the fault has played out.
//!
//! - abort latency: from the fault until every survivor has noticed it: the first call of
//!   each survivor that ends after the fault and either fails or names members without
//!   the victim. Usually that is the call in flight at the fault (for a survivor with none
//!   in flight, its next call); but a call the victim had already done its part of may
//!   still succeed, and then the survivor learns of the fault only from its next call,
//!   which is what "aborted in N ms" should tell;
//! - recovery: from the fault until every survivor has completed an all_reduce whose
//!   members exclude the victim;
//! - join time: from a newcomer's spawn to its first successful all_reduce after its
//!   shared state synced.

use std::collections::{BTreeMap, BTreeSet};

use crate::event::PeerId;

use crate::event::{Event, Op};
use crate::schedule::FaultKind;

/// A fault as it was injected.
#[derive(Clone, Debug)]
pub struct Fault {
    pub kind: FaultKind,
    /// The worker's slot (its index in spawn order).
    pub victim: usize,
    /// The victim's peer id at the fault; none for a newcomer or a worker that had not
    /// registered yet.
    pub peer: Option<PeerId>,
    pub pid: u32,
    /// Wall-clock ms of the fault (of the spawn, for a join).
    pub at: f64,
    /// The `ECCL_FAULT_INJECT` spec, when the victim inflicted the fault on itself.
    pub injected: Option<String>,
}

/// The all_reduce that marks a survivor's recovery.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recovered {
    pub at: f64,
    pub epoch: u64,
    pub members: usize,
}

#[derive(Default)]
struct Survivor {
    noticed: Option<f64>,
    recovered: Option<Recovered>,
    /// The end of its last successful all_reduce.
    last_ok: Option<f64>,
}

/// What is still to be seen of the victim.
enum Victim {
    /// Killed: nothing.
    Gone,
    /// Stopped: that it was resumed and noticed its eviction (or exited).
    Stopped {
        resumed: Option<f64>,
        evicted: bool,
        exited: bool,
    },
    /// A newcomer: its shared-state sync and then its first all_reduce.
    Joining {
        synced: bool,
        fetched: u64,
        sources: BTreeSet<PeerId>,
        joined: Option<f64>,
        died: bool,
    },
    /// Leaving: that its process exited.
    Leaving { exited: bool },
}

pub struct Measurement {
    pub fault: Fault,
    /// A hang during which a master fault struck: the new leader gives every peer a fresh
    /// lease, the stopped victim's too, so it may resume before any master evicts it.
    /// The fault has then played out once the victim is back and every survivor has
    /// completed an all_reduce since, with or without it.
    pub lease_renewed: bool,
    /// Wall-clock ms after which an unfinished measurement is a hang.
    pub deadline: f64,
    survivors: BTreeMap<usize, Survivor>,
    victim: Victim,
}

/// What a finished (or abandoned) measurement found.
#[derive(Debug, Default, PartialEq)]
pub struct Outcome {
    /// Wall-clock ms of the fault (of the spawn, for a join).
    pub at: f64,
    /// The victim's slot (the newcomer's, for a join).
    pub victim: usize,
    pub abort_ms: Option<f64>,
    pub recovery: Option<Recovered>,
    pub recovery_ms: Option<f64>,
    pub join_ms: Option<f64>,
    pub fetched: u64,
    pub sources: Vec<PeerId>,
    pub stopped_ms: Option<f64>,
    pub evicted: bool,
    /// The newcomer died before it joined.
    pub died_joining: bool,
}

impl Measurement {
    /// `survivors` are the slots of the running workers other than the victim; only kills
    /// and hangs watch them.
    pub fn new(fault: Fault, survivors: impl IntoIterator<Item = usize>, deadline: f64) -> Self {
        let victim = match fault.kind {
            // Master faults are measured by `master_faults`, from the masters' reports;
            // a peer measurement of one would have no victim among the workers. A slow
            // peer is judged by the report (`slow_aborts`, false evictions), not measured.
            FaultKind::Kill | FaultKind::MasterKill | FaultKind::MasterHang | FaultKind::Slow => {
                Victim::Gone
            }
            // A partitioned peer runs on, but is as silent to the others as a stopped one.
            FaultKind::Hang | FaultKind::Partition => Victim::Stopped {
                resumed: None,
                evicted: false,
                exited: false,
            },
            FaultKind::Join => Victim::Joining {
                synced: false,
                fetched: 0,
                sources: BTreeSet::new(),
                joined: None,
                died: false,
            },
            FaultKind::Leave | FaultKind::LeaveDuringSync => Victim::Leaving { exited: false },
        };
        let survivors = match fault.kind {
            FaultKind::Kill | FaultKind::Hang | FaultKind::Partition => survivors
                .into_iter()
                .filter(|&s| s != fault.victim)
                .map(|s| (s, Survivor::default()))
                .collect(),
            FaultKind::Join
            | FaultKind::Leave
            | FaultKind::LeaveDuringSync
            | FaultKind::MasterKill
            | FaultKind::MasterHang
            | FaultKind::Slow => BTreeMap::new(),
        };
        Measurement {
            fault,
            lease_renewed: false,
            deadline,
            survivors,
            victim,
        }
    }

    pub fn observe(&mut self, slot: usize, ev: &Event) {
        let at = self.fault.at;
        if let Some(s) = self.survivors.get_mut(&slot) {
            if let Some(c) = ev.call().filter(|c| c.end >= at) {
                let without_victim = !self.fault.peer.is_some_and(|p| c.members.contains(&p));
                if !c.ok || without_victim {
                    s.noticed.get_or_insert(c.end);
                }
                if c.op == Op::AllReduce && c.ok {
                    s.last_ok = Some(c.end);
                }
                if c.op == Op::AllReduce && c.ok && without_victim {
                    s.recovered.get_or_insert(Recovered {
                        at: c.end,
                        epoch: c.epoch,
                        members: c.members.len(),
                    });
                }
            }
            return;
        }
        if slot != self.fault.victim {
            return;
        }
        match (&mut self.victim, ev) {
            (Victim::Stopped { evicted, .. }, Event::Evicted { .. }) => *evicted = true,
            (
                Victim::Joining {
                    synced,
                    fetched,
                    sources,
                    ..
                },
                Event::Sync {
                    bytes_received,
                    sources: from,
                    ..
                },
            ) => {
                *synced = true;
                *fetched += bytes_received;
                sources.extend(from);
            }
            (
                Victim::Joining {
                    synced: true,
                    joined,
                    ..
                },
                Event::Call(c),
            ) if c.op == Op::AllReduce && c.ok => {
                joined.get_or_insert(c.end);
            }
            _ => {}
        }
    }

    /// The stopped victim was sent SIGCONT.
    pub fn resumed(&mut self, at: f64) {
        if let Victim::Stopped { resumed, .. } = &mut self.victim {
            resumed.get_or_insert(at);
        }
    }

    /// A survivor died, stopped or left: there is nothing more to wait for from it.
    pub fn drop_survivor(&mut self, slot: usize) {
        self.survivors.remove(&slot);
    }

    /// The victim's process exited.
    pub fn victim_exited(&mut self) {
        match &mut self.victim {
            Victim::Gone => {}
            Victim::Stopped { exited, .. } => *exited = true,
            Victim::Joining { died, .. } => *died = true,
            Victim::Leaving { exited } => *exited = true,
        }
    }

    /// Whether the stopped victim has been resumed.
    pub fn resumed_yet(&self) -> bool {
        self.resumed_at().is_some()
    }

    /// When the stopped victim was resumed, if it was.
    fn resumed_at(&self) -> Option<f64> {
        match self.victim {
            Victim::Stopped { resumed, .. } => resumed,
            _ => None,
        }
    }

    /// A hang that a master fault's fresh leases may have excused from its eviction:
    /// the victim is back and every survivor has completed an all_reduce since.
    fn went_on_with_the_victim(&self) -> bool {
        let Some(back) = self.resumed_at().filter(|_| self.lease_renewed) else {
            return false;
        };
        self.survivors
            .values()
            .all(|s| s.last_ok.is_some_and(|t| t > back))
    }

    pub fn is_done(&self) -> bool {
        if self.went_on_with_the_victim() {
            return true;
        }
        let survivors = self
            .survivors
            .values()
            .all(|s| s.noticed.is_some() && s.recovered.is_some());
        let victim = match &self.victim {
            Victim::Gone => true,
            Victim::Stopped {
                resumed,
                evicted,
                exited,
            } => *exited || (resumed.is_some() && *evicted),
            Victim::Joining { joined, died, .. } => joined.is_some() || *died,
            Victim::Leaving { exited } => *exited,
        };
        survivors && victim
    }

    /// What is still missing, for the violation of a measurement that timed out.
    pub fn pending(&self) -> String {
        let mut missing = Vec::new();
        let not_noticed: Vec<usize> = self
            .survivors
            .iter()
            .filter(|(_, s)| s.noticed.is_none())
            .map(|(&slot, _)| slot)
            .collect();
        let not_recovered: Vec<usize> = self
            .survivors
            .iter()
            .filter(|(_, s)| s.recovered.is_none())
            .map(|(&slot, _)| slot)
            .collect();
        if !not_noticed.is_empty() {
            missing.push(format!(
                "workers {not_noticed:?} had not noticed (no call failed or excluded the victim)"
            ));
        }
        if !not_recovered.is_empty() {
            missing.push(format!(
                "workers {not_recovered:?} had no all_reduce without the victim"
            ));
        }
        match &self.victim {
            Victim::Stopped {
                resumed: Some(_),
                evicted: false,
                exited: false,
            } => missing.push("the resumed victim was never told it was evicted".into()),
            Victim::Joining { synced: false, .. } => {
                missing.push("the newcomer never synced its state".into())
            }
            Victim::Joining { joined: None, .. } => {
                missing.push("the newcomer never completed an all_reduce".into())
            }
            Victim::Leaving { exited: false } => missing.push("the leaver did not exit".into()),
            _ => {}
        }
        missing.join("; ")
    }

    pub fn outcome(&self) -> Outcome {
        let at = self.fault.at;
        let all = |f: &dyn Fn(&Survivor) -> Option<f64>| -> Option<f64> {
            let times: Option<Vec<f64>> = self.survivors.values().map(f).collect();
            times?.into_iter().reduce(f64::max)
        };
        let abort_ms = all(&|s| s.noticed).map(|t| t - at);
        let recovery = self
            .survivors
            .values()
            .map(|s| s.recovered)
            .collect::<Option<Vec<_>>>()
            .and_then(|r| r.into_iter().reduce(|a, b| if b.at > a.at { b } else { a }));
        let mut out = Outcome {
            at,
            victim: self.fault.victim,
            abort_ms,
            recovery,
            recovery_ms: recovery.map(|r| r.at - at),
            ..Outcome::default()
        };
        match &self.victim {
            Victim::Gone => {}
            Victim::Stopped {
                resumed, evicted, ..
            } => {
                out.stopped_ms = resumed.map(|t| t - at);
                out.evicted = *evicted;
            }
            Victim::Joining {
                fetched,
                sources,
                joined,
                died,
                ..
            } => {
                out.join_ms = joined.map(|t| t - at);
                out.fetched = *fetched;
                out.sources = sources.iter().copied().collect();
                out.died_joining = *died && joined.is_none();
            }
            Victim::Leaving { .. } => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Call;

    fn fault(kind: FaultKind, victim: usize, peer: Option<PeerId>) -> Fault {
        Fault {
            kind,
            victim,
            peer,
            pid: 1,
            at: 1000.0,
            injected: None,
        }
    }

    fn call(op: Op, start: f64, end: f64, ok: bool, epoch: u64, members: &[PeerId]) -> Event {
        Event::Call(Call {
            peer: 0,
            op,
            start,
            end,
            ok,
            err: (!ok).then(|| "Aborted".into()),
            detail: None,
            epoch,
            members: members.to_vec(),
            revision: 0,
        })
    }

    #[test]
    fn a_kill_is_measured_from_the_slowest_survivor() {
        let mut m = Measurement::new(fault(FaultKind::Kill, 1, Some(11)), [0, 1, 2], 20_000.0);
        // A call that ended before the fault does not count.
        m.observe(
            0,
            &call(Op::AllReduce, 900.0, 990.0, true, 3, &[10, 11, 12]),
        );
        m.observe(
            0,
            &call(Op::AllReduce, 995.0, 1012.0, false, 3, &[10, 11, 12]),
        );
        m.observe(
            2,
            &call(Op::AllReduce, 990.0, 1030.0, false, 3, &[10, 11, 12]),
        );
        assert!(!m.is_done());
        m.observe(
            0,
            &call(Op::UpdateTopology, 1012.0, 1050.0, true, 4, &[10, 12]),
        );
        m.observe(0, &call(Op::AllReduce, 1060.0, 1070.0, true, 4, &[10, 12]));
        assert!(!m.is_done(), "worker 2 has not recovered");
        m.observe(2, &call(Op::AllReduce, 1060.0, 1085.0, true, 4, &[10, 12]));
        assert!(m.is_done());
        let o = m.outcome();
        assert_eq!(o.abort_ms, Some(30.0));
        assert_eq!(o.recovery_ms, Some(85.0));
        assert_eq!(o.recovery.map(|r| (r.epoch, r.members)), Some((4, 2)));
    }

    #[test]
    fn a_call_the_victim_finished_its_part_of_is_not_the_abort() {
        let mut m = Measurement::new(fault(FaultKind::Hang, 1, Some(11)), [0, 1], 20_000.0);
        m.observe(0, &call(Op::AllReduce, 990.0, 1001.0, true, 3, &[10, 11]));
        m.observe(
            0,
            &call(Op::UpdateTopology, 1001.0, 1002.0, true, 3, &[10, 11]),
        );
        m.observe(0, &call(Op::Sync, 1002.0, 3050.0, false, 3, &[10, 11]));
        m.observe(0, &call(Op::AllReduce, 3100.0, 3110.0, true, 4, &[10]));
        assert_eq!(m.outcome().abort_ms, Some(2050.0));
    }

    #[test]
    fn an_all_reduce_that_still_includes_the_victim_is_no_recovery() {
        let mut m = Measurement::new(fault(FaultKind::Kill, 1, Some(11)), [0, 1], 20_000.0);
        m.observe(0, &call(Op::AllReduce, 1001.0, 1002.0, true, 3, &[10, 11]));
        assert!(!m.is_done());
        assert!(
            m.pending().contains("no all_reduce without the victim"),
            "{}",
            m.pending()
        );
        m.drop_survivor(0);
        assert!(m.is_done(), "nobody is left to wait for");
        assert_eq!(m.outcome().abort_ms, None);
    }

    #[test]
    fn a_hang_a_new_leaders_fresh_lease_covered_ends_when_the_world_went_on_with_it() {
        let mut m = Measurement::new(fault(FaultKind::Hang, 0, Some(10)), [0, 1], 20_000.0);
        m.lease_renewed = true;
        // The survivor waits on the stopped victim, which no master evicts.
        m.observe(1, &call(Op::AllReduce, 900.0, 3300.0, true, 3, &[10, 11]));
        assert!(!m.is_done(), "the victim has not resumed");
        m.resumed(3290.0);
        assert!(
            m.is_done(),
            "the survivor completed an all_reduce after the resume"
        );
        // Without the fresh lease, the same is no end: the victim must be evicted.
        let mut plain = Measurement::new(fault(FaultKind::Hang, 0, Some(10)), [0, 1], 20_000.0);
        plain.observe(1, &call(Op::AllReduce, 900.0, 3300.0, true, 3, &[10, 11]));
        plain.resumed(3290.0);
        assert!(!plain.is_done());
    }

    #[test]
    fn a_hang_waits_for_the_victim_to_resume_and_learn_of_its_eviction() {
        let mut m = Measurement::new(fault(FaultKind::Hang, 0, Some(10)), [0, 1], 20_000.0);
        m.observe(1, &call(Op::AllReduce, 900.0, 3100.0, false, 3, &[10, 11]));
        m.observe(1, &call(Op::AllReduce, 3200.0, 3250.0, true, 4, &[11, 12]));
        assert!(!m.is_done());
        m.resumed(4500.0);
        m.observe(0, &call(Op::AllReduce, 900.0, 4510.0, false, 3, &[10, 11]));
        assert!(!m.is_done());
        m.observe(
            0,
            &Event::Evicted {
                peer: 10,
                t: 4511.0,
                reason: "lease".into(),
            },
        );
        assert!(m.is_done());
        let o = m.outcome();
        assert_eq!(
            (o.abort_ms, o.recovery_ms, o.stopped_ms, o.evicted),
            (Some(2100.0), Some(2250.0), Some(3500.0), true)
        );
    }

    #[test]
    fn a_join_counts_from_the_spawn_to_the_first_all_reduce_after_a_sync() {
        let mut m = Measurement::new(fault(FaultKind::Join, 5, None), [0, 1, 5], 20_000.0);
        m.observe(
            5,
            &call(Op::AllReduce, 1100.0, 1110.0, true, 4, &[10, 11, 15]),
        );
        assert!(!m.is_done(), "no sync yet");
        let sync = |bytes| Event::Sync {
            peer: 15,
            t: 1300.0,
            epoch: 5,
            revision: 40,
            hash: String::new(),
            lib_hash: String::new(),
            bytes_received: bytes,
            sources: vec![10, 11],
        };
        m.observe(5, &sync(1 << 20));
        m.observe(5, &sync(0));
        m.observe(
            5,
            &call(Op::AllReduce, 1300.0, 1410.0, true, 5, &[10, 11, 15]),
        );
        assert!(m.is_done());
        let o = m.outcome();
        assert_eq!(
            (o.join_ms, o.fetched, o.sources),
            (Some(410.0), 1 << 20, vec![10, 11])
        );
    }

    #[test]
    fn a_newcomer_that_dies_ends_its_join() {
        let mut m = Measurement::new(fault(FaultKind::Join, 5, None), [], 20_000.0);
        m.victim_exited();
        assert!(m.is_done());
        assert!(m.outcome().died_joining);
    }
}
