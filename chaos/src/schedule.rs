//! The fault schedule, drawn from the seed before the run starts, so that a run that
//! fails can be replayed with the same seed (as TigerBeetle and FoundationDB do).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL a peer.
    Kill,
    /// SIGSTOP a peer, holding its sockets open, and SIGCONT it after `--hang-ms`.
    Hang,
    /// Start a new peer.
    Join,
    /// Ask a peer to leave cleanly.
    Leave,
    /// SIGKILL the leading master; restart it from its data directory a few seconds later.
    MasterKill,
    /// SIGSTOP the leading master past an election, then SIGCONT it.
    MasterHang,
    /// SIGSTOP a peer for less than half a lease (`--slow-ms`), then SIGCONT it: a slow
    /// peer, which must never be evicted nor cause an abort.
    Slow,
    /// Cut a peer off the network for `--hang-ms` while its process runs: its links and
    /// its master connection go silent (the peers run in network namespaces; the veth
    /// is taken down and brought back up). The master evicts it when its lease runs
    /// out, and the survivors recover as for a kill.
    Partition,
    /// Start a newcomer and have a member leave from the middle of a shared-state sync
    /// (the worker drops the call a millisecond in, whether it is planning or serving
    /// the newcomer, and leaves): the newcomer's fetch goes on from the others.
    LeaveDuringSync,
}

impl FaultKind {
    pub const ALL: [FaultKind; 9] = [
        FaultKind::Kill,
        FaultKind::Hang,
        FaultKind::Join,
        FaultKind::Leave,
        FaultKind::MasterKill,
        FaultKind::MasterHang,
        FaultKind::Slow,
        FaultKind::Partition,
        FaultKind::LeaveDuringSync,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Hang => "hang",
            FaultKind::Join => "join",
            FaultKind::Leave => "leave",
            FaultKind::MasterKill => "master-kill",
            FaultKind::MasterHang => "master-hang",
            FaultKind::Slow => "slow",
            FaultKind::Partition => "partition",
            FaultKind::LeaveDuringSync => "leave-during-sync",
        }
    }

    /// A fault of the master cluster rather than of a peer.
    pub fn is_master(self) -> bool {
        matches!(self, FaultKind::MasterKill | FaultKind::MasterHang)
    }
}

/// Parses `--faults`: a comma list of kill, hang, join, leave, master-kill, master-hang,
/// slow, partition, leave-during-sync, or `none`.
pub fn parse_faults(s: &str) -> Result<Vec<FaultKind>, String> {
    if s.trim() == "none" {
        return Ok(Vec::new());
    }
    let mut kinds = Vec::new();
    for word in s.split(',').map(str::trim) {
        let kind = FaultKind::ALL
            .into_iter()
            .find(|k| k.name() == word)
            .ok_or_else(|| format!("unknown fault {word:?} (kill, hang, join, leave, master-kill, master-hang, slow, partition, leave-during-sync, or none)"))?;
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    Ok(kinds)
}

/// One fault of the schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Planned {
    /// Pause after the previous fault was measured, in milliseconds.
    pub gap_ms: f64,
    pub kind: FaultKind,
    /// Picks the victim: `running[victim % running.len()]`, oldest first.
    pub victim: u32,
}

/// Enough faults to fill `duration_ms` if each were measured at once. Gaps are spread
/// uniformly over ±50% around `interval_ms`, so that faults do not fall into step with
/// the training loop.
pub fn plan(seed: u64, kinds: &[FaultKind], duration_ms: f64, interval_ms: f64) -> Vec<Planned> {
    if interval_ms <= 0.0 {
        return Vec::new();
    }
    draw(seed, kinds, duration_ms, |rng| {
        interval_ms * rng.gen_range(0.5..1.5)
    })
}

/// `--churn`'s schedule: the same draws as [`plan`], with each pause uniform over
/// `[min_ms, max_ms]` and counted from the previous fault's strike, not from its end.
pub fn plan_churn(
    seed: u64,
    kinds: &[FaultKind],
    duration_ms: f64,
    (min_ms, max_ms): (u64, u64),
) -> Vec<Planned> {
    if max_ms == 0 {
        return Vec::new();
    }
    draw(seed, kinds, duration_ms, |rng| {
        rng.gen_range(min_ms..=max_ms) as f64
    })
}

/// Faults drawn from `seed` until their gaps (from `gap`) pass `duration_ms`: for each,
/// its gap, then its kind, then its victim.
fn draw(
    seed: u64,
    kinds: &[FaultKind],
    duration_ms: f64,
    mut gap: impl FnMut(&mut StdRng) -> f64,
) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut faults = Vec::new();
    let mut at = 0.0;
    if kinds.is_empty() {
        return faults;
    }
    loop {
        let gap_ms = gap(&mut rng);
        at += gap_ms;
        if at > duration_ms {
            return faults;
        }
        faults.push(Planned {
            gap_ms,
            kind: kinds[rng.gen_range(0..kinds.len())],
            victim: rng.gen(),
        });
    }
}

/// Parses `--churn-ms`: `MIN-MAX` milliseconds, `0 < MIN <= MAX`.
pub fn parse_range_ms(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("{s:?}: give MIN-MAX milliseconds, as in 500-2000");
    let (a, b) = s.split_once('-').ok_or_else(bad)?;
    let (a, b): (u64, u64) = (
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    );
    if a == 0 || a > b {
        return Err(format!("{s:?}: MIN must be positive and at most MAX"));
    }
    Ok((a, b))
}

/// The fault actually injected, given `running` peers that are neither stopped nor on
/// their way out and `live` processes in all: a kill, hang or leave that would leave
/// fewer than `min_live` running peers becomes a join, and a join beyond `cap` live
/// peers becomes a leave.
pub fn adjust(
    kind: FaultKind,
    running: usize,
    live: usize,
    cap: usize,
    min_live: usize,
) -> FaultKind {
    match kind {
        FaultKind::Kill
        | FaultKind::Hang
        | FaultKind::Leave
        | FaultKind::Partition
        | FaultKind::LeaveDuringSync
            if running <= min_live =>
        {
            FaultKind::Join
        }
        FaultKind::Join if live >= cap => FaultKind::Leave,
        k => k,
    }
}

/// Points of the library where `ECCL_FAULT_INJECT` can fire.
pub const INJECT_POINTS: [&str; 6] = [
    "first-chunk",
    "mid-ring",
    "update-topology",
    "connect",
    "sync-serve",
    "sync-fetch",
];

/// Which worker an `--inject` applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectTarget {
    /// Initial worker K (0-based).
    Initial(u32),
    /// The first worker started by a join.
    FirstNewcomer,
}

/// `--inject K=SPEC`: a worker that faults itself at an exact point of the library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inject {
    pub target: InjectTarget,
    /// The value of `ECCL_FAULT_INJECT`: `point:action[@n]`.
    pub spec: String,
}

/// Parses `K=point:action[@n]`, where K is a worker index or `join`, the action `kill` or
/// `stop`, and n the occurrence of the point that fires (from 1).
pub fn parse_inject(s: &str) -> Result<Inject, String> {
    let (who, spec) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not K=point:action[@n]"))?;
    let target = match who.trim() {
        "join" => InjectTarget::FirstNewcomer,
        k => InjectTarget::Initial(
            k.parse()
                .map_err(|_| format!("{k:?} is neither a worker index nor `join`"))?,
        ),
    };
    let (point, rest) = spec
        .split_once(':')
        .ok_or_else(|| format!("{spec:?} is not point:action[@n]"))?;
    if !INJECT_POINTS.contains(&point) {
        return Err(format!(
            "unknown injection point {point:?} ({})",
            INJECT_POINTS.join(", ")
        ));
    }
    let (action, nth) = rest.split_once('@').unwrap_or((rest, "1"));
    if !matches!(action, "kill" | "stop") {
        return Err(format!(
            "unknown injection action {action:?} (kill or stop)"
        ));
    }
    match nth.parse::<u32>() {
        Ok(n) if n >= 1 => {}
        _ => return Err(format!("{nth:?} is not an occurrence (1, 2, ...)")),
    }
    Ok(Inject {
        target,
        spec: spec.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let kinds = FaultKind::ALL;
        let a = plan(7, &kinds, 60_000.0, 3000.0);
        assert_eq!(a, plan(7, &kinds, 60_000.0, 3000.0));
        assert_ne!(a, plan(8, &kinds, 60_000.0, 3000.0));
        assert!(a.len() >= 10, "{} faults in a minute at 3 s", a.len());
    }

    #[test]
    fn churn_draws_its_pauses_within_the_range_and_fills_the_run() {
        let kinds = [FaultKind::Kill, FaultKind::Join];
        let a = plan_churn(7, &kinds, 60_000.0, (500, 2000));
        assert_eq!(a, plan_churn(7, &kinds, 60_000.0, (500, 2000)));
        assert!(a.iter().all(|p| (500.0..=2000.0).contains(&p.gap_ms)));
        let total: f64 = a.iter().map(|p| p.gap_ms).sum();
        assert!(total <= 60_000.0 && total > 58_000.0, "{total}");
        assert!(a.len() >= 30, "{} faults in a minute at 0.5-2 s", a.len());
        assert!(plan_churn(7, &[], 60_000.0, (500, 2000)).is_empty());
    }

    #[test]
    fn churn_ranges_parse_and_bad_ones_say_why() {
        assert_eq!(parse_range_ms("500-2000"), Ok((500, 2000)));
        assert_eq!(parse_range_ms("100-100"), Ok((100, 100)));
        for bad in ["", "500", "2000-500", "0-10", "a-b", "-5"] {
            assert!(parse_range_ms(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn gaps_stay_near_the_interval_and_fill_the_duration() {
        let p = plan(1, &[FaultKind::Kill, FaultKind::Join], 100_000.0, 2000.0);
        assert!(p.iter().all(|f| (1000.0..3000.0).contains(&f.gap_ms)));
        let total: f64 = p.iter().map(|f| f.gap_ms).sum();
        assert!(total <= 100_000.0 && total > 100_000.0 - 3000.0, "{total}");
        assert!(p
            .iter()
            .all(|f| matches!(f.kind, FaultKind::Kill | FaultKind::Join)));
        assert!(
            p.iter().any(|f| f.kind == FaultKind::Kill)
                && p.iter().any(|f| f.kind == FaultKind::Join)
        );
    }

    #[test]
    fn no_kinds_no_faults() {
        assert!(plan(3, &[], 60_000.0, 1000.0).is_empty());
    }

    #[test]
    fn faults_parse_as_a_set() {
        assert_eq!(parse_faults("none"), Ok(vec![]));
        assert_eq!(
            parse_faults("kill, join,kill"),
            Ok(vec![FaultKind::Kill, FaultKind::Join])
        );
        assert!(parse_faults("kill,explode")
            .unwrap_err()
            .contains("explode"));
    }

    #[test]
    fn two_running_peers_are_kept_and_the_world_is_capped() {
        use FaultKind::*;
        assert_eq!(adjust(Kill, 3, 3, 6, 2), Kill);
        assert_eq!(adjust(Kill, 2, 3, 6, 2), Join);
        assert_eq!(adjust(Hang, 2, 2, 6, 2), Join);
        assert_eq!(adjust(Leave, 2, 2, 6, 2), Join);
        assert_eq!(adjust(Join, 5, 5, 6, 2), Join);
        assert_eq!(adjust(Join, 5, 6, 6, 2), Leave);
        // --min-live 4: a kill that would leave three becomes a join.
        assert_eq!(adjust(Kill, 4, 4, 12, 4), Join);
        assert_eq!(adjust(Kill, 5, 5, 12, 4), Kill);
    }

    #[test]
    fn injections_name_a_worker_a_point_and_an_action() {
        assert_eq!(
            parse_inject("1=first-chunk:kill@5"),
            Ok(Inject {
                target: InjectTarget::Initial(1),
                spec: "first-chunk:kill@5".into()
            })
        );
        assert_eq!(
            parse_inject("join=sync-fetch:stop").map(|i| i.target),
            Ok(InjectTarget::FirstNewcomer)
        );
        for bad in [
            "first-chunk:kill",
            "x=mid-ring:kill",
            "1=mid-air:kill",
            "1=mid-ring:explode",
            "1=mid-ring:kill@0",
        ] {
            assert!(parse_inject(bad).is_err(), "{bad}");
        }
    }
}
