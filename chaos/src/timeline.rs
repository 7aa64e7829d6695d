//! A run over time, for the report's JSON (`timeline`) and `--plot`: the members of each
//! epoch, the job's steps per second, every fault with its abort and recovery times,
//! and the master leader changes. Pure, like the report: a function of the run's log.

use std::collections::BTreeMap;

use eccl_plot::{Axis, Figure, Marker, Panel, Scale, Series, Span, Style, Units};
use serde::Serialize;

use crate::event::Event;
use crate::report::RunLog;

#[derive(Debug, Default, Serialize)]
pub struct Timeline {
    /// Each epoch from its first successful call: (seconds since the start, epoch,
    /// members).
    pub members: Vec<(f64, u64, usize)>,
    /// Width of a `steps_per_s` bin, in seconds.
    pub bin_s: f64,
    /// The job's steps (revisions first committed) per second: (bin start, steps/s).
    pub steps_per_s: Vec<(f64, f64)>,
    pub faults: Vec<TimedFault>,
    /// When another master took the lead after a master fault (seconds since the start).
    pub leader_changes: Vec<f64>,
}

#[derive(Debug, Serialize)]
pub struct TimedFault {
    pub kind: &'static str,
    /// Seconds since the start of the run.
    pub at_s: f64,
    /// From the fault until every survivor's call failed (kill, hang).
    pub abort_ms: Option<f64>,
    /// From the fault until every survivor completed a call of the next world.
    pub recovery_ms: Option<f64>,
    /// From a newcomer's start to its first synced all_reduce.
    pub join_ms: Option<f64>,
}

/// Steps-per-second bins of about a sixtieth of the run, between half a second and ten.
fn bin_of(duration_s: f64) -> f64 {
    (duration_s / 60.0).clamp(0.5, 10.0)
}

pub fn timeline(log: &RunLog) -> Timeline {
    let s = |t: f64| (t - log.t0) / 1e3;
    let mut epochs: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
    let mut revisions: BTreeMap<u64, f64> = BTreeMap::new();
    for (_, e) in &log.events {
        match e {
            Event::Call(c) if c.ok && c.epoch > 0 && !c.members.is_empty() => {
                let first = epochs.entry(c.epoch).or_insert((c.end, c.members.len()));
                if c.end < first.0 {
                    *first = (c.end, c.members.len());
                }
            }
            Event::Commit { t, revision, .. } => {
                let first = revisions.entry(*revision).or_insert(*t);
                *first = first.min(*t);
            }
            _ => {}
        }
    }
    let mut members: Vec<(f64, u64, usize)> = epochs
        .into_iter()
        .map(|(epoch, (t, n))| (s(t), epoch, n))
        .collect();
    members.sort_by(|a, b| a.0.total_cmp(&b.0));

    let bin_s = bin_of(log.duration_s);
    let bins = (log.duration_s / bin_s).ceil().max(1.0) as usize;
    let mut counts = vec![0u64; bins];
    for t in revisions.values() {
        let k = (s(*t) / bin_s).floor();
        if k >= 0.0 {
            counts[(k as usize).min(bins - 1)] += 1;
        }
    }
    let steps_per_s = counts
        .iter()
        .enumerate()
        .map(|(k, &n)| (k as f64 * bin_s, n as f64 / bin_s))
        .collect();

    let mut faults: Vec<TimedFault> = log
        .faults
        .iter()
        .map(|(kind, o)| TimedFault {
            kind: kind.name(),
            at_s: s(o.at),
            abort_ms: o.abort_ms,
            recovery_ms: o.recovery_ms,
            join_ms: o.join_ms,
        })
        .chain(log.master_faults.iter().map(|(kind, o)| TimedFault {
            kind: kind.name(),
            at_s: s(o.at),
            abort_ms: None,
            recovery_ms: None,
            join_ms: None,
        }))
        .collect();
    faults.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    let mut leader_changes: Vec<f64> = log
        .master_faults
        .iter()
        .filter_map(|(_, o)| Some(s(o.at + o.failover_ms?)))
        .collect();
    leader_changes.sort_by(f64::total_cmp);
    Timeline {
        members,
        bin_s,
        steps_per_s,
        faults,
        leader_changes,
    }
}

/// The picture of a run: members per epoch over steps per second, each fault a marker
/// with its abort (and a newcomer's join) shaded, then its recovery, and the leader
/// changes.
pub fn figure(t: &Timeline, title: String) -> Figure {
    let mut markers: Vec<Marker> = t
        .faults
        .iter()
        .map(|f| Marker {
            x: f.at_s,
            kind: "fault".into(),
            label: f.kind.into(),
        })
        .collect();
    markers.extend(t.leader_changes.iter().map(|&x| Marker {
        x,
        kind: "new master leader".into(),
        label: String::new(),
    }));
    let mut spans = Vec::new();
    for f in &t.faults {
        let abort = f.abort_ms.map(|ms| f.at_s + ms / 1e3);
        if let Some(end) = abort {
            spans.push(Span {
                from: f.at_s,
                to: end,
                kind: "abort".into(),
            });
        }
        if let Some(ms) = f.recovery_ms {
            spans.push(Span {
                from: abort.unwrap_or(f.at_s),
                to: f.at_s + ms / 1e3,
                kind: "recovery".into(),
            });
        }
        if let Some(ms) = f.join_ms {
            spans.push(Span {
                from: f.at_s,
                to: f.at_s + ms / 1e3,
                kind: "join".into(),
            });
        }
    }
    let members = t.members.iter().map(|&(x, _, n)| (x, n as f64)).collect();
    // Each bin's rate drawn at the bin's middle.
    let rate = t
        .steps_per_s
        .iter()
        .map(|&(x, r)| (x + t.bin_s / 2.0, r))
        .collect();
    Figure {
        title,
        x: Axis::new("seconds since the start", Scale::Linear, Units::Plain),
        panels: vec![
            Panel {
                y: Axis::new("members of the epoch", Scale::Linear, Units::Count),
                series: vec![Series {
                    label: "members".into(),
                    points: members,
                    style: Style::Steps,
                }],
            },
            Panel {
                y: Axis::new("steps per second", Scale::Linear, Units::Plain),
                series: vec![Series {
                    label: format!("steps/s ({} s bins)", eccl_plot::number(t.bin_s)),
                    points: rate,
                    style: Style::Line,
                }],
            },
        ],
        markers,
        spans,
        size: (1100, 720),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Call, Op};
    use crate::master_faults::MasterOutcome;
    use crate::measure::Outcome;
    use crate::schedule::FaultKind;

    fn call(peer: u64, end: f64, epoch: u64, members: Vec<u64>) -> Event {
        Event::Call(Call {
            peer,
            op: Op::AllReduce,
            start: end - 1.0,
            end,
            ok: true,
            err: None,
            detail: None,
            epoch,
            members,
            revision: 0,
        })
    }

    fn commit(peer: u64, t: f64, revision: u64) -> Event {
        Event::Commit {
            peer,
            t,
            epoch: 1,
            revision,
            prev: String::new(),
            hash: String::new(),
        }
    }

    #[test]
    fn epochs_steps_faults_and_leaders_land_where_they_happened() {
        let t0 = 1_000_000.0;
        let mut log = crate::report::tests::log(vec![
            (0, call(1, t0 + 500.0, 1, vec![1, 2, 3])),
            (1, call(2, t0 + 400.0, 1, vec![1, 2, 3])),
            (0, call(1, t0 + 5_200.0, 2, vec![1, 2])),
            // Two workers commit each revision; a step counts once, at its first commit.
            (0, commit(1, t0 + 1_100.0, 1)),
            (1, commit(2, t0 + 1_150.0, 1)),
            (0, commit(1, t0 + 1_300.0, 2)),
            (0, commit(1, t0 + 6_000.0, 3)),
        ]);
        log.t0 = t0;
        log.duration_s = 30.0;
        log.faults = vec![(
            FaultKind::Kill,
            Outcome {
                at: t0 + 5_000.0,
                abort_ms: Some(40.0),
                recovery_ms: Some(150.0),
                ..Outcome::default()
            },
        )];
        log.master_faults = vec![(
            FaultKind::MasterKill,
            MasterOutcome {
                at: t0 + 10_000.0,
                failover_ms: Some(700.0),
                rejoined_ms: None,
            },
        )];
        let t = timeline(&log);
        assert_eq!(t.members, vec![(0.4, 1, 3), (5.2, 2, 2)]);
        assert_eq!(t.bin_s, 0.5);
        assert_eq!(t.steps_per_s.len(), 60);
        assert_eq!(t.steps_per_s[2], (1.0, 4.0), "two steps in [1.0, 1.5)");
        assert_eq!(t.steps_per_s[12], (6.0, 2.0));
        assert_eq!(t.steps_per_s.iter().map(|p| p.1).sum::<f64>() * 0.5, 3.0);
        assert_eq!(
            t.faults
                .iter()
                .map(|f| (f.kind, f.at_s))
                .collect::<Vec<_>>(),
            vec![("kill", 5.0), ("master-kill", 10.0)]
        );
        assert_eq!(t.leader_changes, vec![10.7]);

        let fig = figure(&t, "run".into());
        assert_eq!(fig.markers.len(), 2 + 1);
        // In milliseconds, rounded: the seconds are sums of floats.
        let spans: Vec<(&str, i64, i64)> = fig
            .spans
            .iter()
            .map(|s| {
                let ms = |v: f64| (v * 1e3).round() as i64;
                (s.kind.as_str(), ms(s.from), ms(s.to))
            })
            .collect();
        assert_eq!(spans, vec![("abort", 5000, 5040), ("recovery", 5040, 5150)]);
    }
}
