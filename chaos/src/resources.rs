//! Memory and file descriptors of a run's long-lived processes: the masters and every
//! worker that lives through the run, sampled from `/proc` every few seconds. A process
//! whose resident memory or open descriptors grew from the start of the run to its end
//! by more than 5 % (plus a small allowance for what a world of other members holds) is
//! a violation: a leak that a ten-minute or hour-long soak would make plain. Runs shorter
//! than [`MIN_JUDGED_S`] are reported, not judged (the first seconds allocate pools and
//! connect links).

use serde::Serialize;

/// Runs shorter than this are not judged: their start and end windows overlap warm-up.
pub const MIN_JUDGED_S: f64 = 60.0;
/// Allowed growth, beyond [`GROWTH`] of the start: resident memory (KiB).
const RSS_SLACK_KIB: u64 = 16 << 10;
/// Allowed growth, beyond [`GROWTH`] of the start: descriptors (a few links more).
const FD_SLACK: u64 = 16;
const GROWTH: f64 = 1.05;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub t: f64,
    pub rss_kib: u64,
    pub fds: u64,
}

/// One process's samples.
#[derive(Debug)]
pub struct Track {
    pub name: String,
    pub pid: u32,
    pub samples: Vec<Sample>,
}

/// What the report says of one long-lived process.
#[derive(Debug, Serialize, PartialEq)]
pub struct Usage {
    pub name: String,
    pub pid: u32,
    /// Medians over the start window (after warm-up) and the end window of the run.
    pub rss_kib_start: u64,
    pub rss_kib_end: u64,
    pub rss_kib_max: u64,
    pub fds_start: u64,
    pub fds_end: u64,
    pub fds_max: u64,
    /// Grew past the allowance (only in runs of at least [`MIN_JUDGED_S`]).
    pub grew: bool,
}

pub struct Sampler {
    every_ms: f64,
    next: f64,
    pub tracks: Vec<Track>,
}

impl Sampler {
    pub fn new(t0: f64, every_ms: f64) -> Sampler {
        Sampler {
            every_ms,
            next: t0,
            tracks: Vec::new(),
        }
    }

    /// Samples `procs` (name, pid) if a sample is due at `now`.
    pub fn tick(&mut self, now: f64, procs: impl IntoIterator<Item = (String, u32)>) {
        if now < self.next {
            return;
        }
        self.next = now + self.every_ms;
        for (name, pid) in procs {
            let Some((rss_kib, fds)) = read(pid) else {
                continue;
            };
            let s = Sample {
                t: now,
                rss_kib,
                fds,
            };
            match self.tracks.iter_mut().find(|t| t.pid == pid) {
                Some(t) => t.samples.push(s),
                None => self.tracks.push(Track {
                    name,
                    pid,
                    samples: vec![s],
                }),
            }
        }
    }

    /// The latest sample of every process sampled at the last tick.
    pub fn latest(&self) -> impl Iterator<Item = (&str, Sample)> {
        let last = self
            .tracks
            .iter()
            .filter_map(|t| t.samples.last())
            .map(|s| s.t)
            .fold(f64::MIN, f64::max);
        self.tracks.iter().filter_map(move |t| {
            let s = t.samples.last()?;
            (s.t == last).then_some((t.name.as_str(), *s))
        })
    }

    /// The usage of every process that lived from the start window of the run
    /// (`from`..`to`) to its end window; judged when the run is long enough.
    pub fn usage(&self, from: f64, to: f64) -> Vec<Usage> {
        self.tracks
            .iter()
            .filter_map(|t| usage(t, from, to))
            .collect()
    }
}

/// The usage of `track` over a run from `from` to `to`, if it lived through it: sampled
/// in its first tenth (a newcomer that starts later grows as it takes on the state), in
/// the start window (the second tenth up to the first quarter, after warm-up) and in the
/// end window (the last tenth).
pub fn usage(track: &Track, from: f64, to: f64) -> Option<Usage> {
    let span = to - from;
    if track.samples.first()?.t > from + 0.1 * span {
        return None;
    }
    let window = |a: f64, b: f64| -> Vec<Sample> {
        track
            .samples
            .iter()
            .filter(|s| s.t >= from + a * span && s.t <= from + b * span)
            .copied()
            .collect()
    };
    let start = window(0.1, 0.25);
    let end = window(0.9, 1.0);
    if start.is_empty() || end.is_empty() {
        return None;
    }
    let median = |v: &[Sample], f: fn(&Sample) -> u64| {
        let mut x: Vec<u64> = v.iter().map(f).collect();
        x.sort_unstable();
        x[x.len() / 2]
    };
    let (rss0, rss1) = (median(&start, |s| s.rss_kib), median(&end, |s| s.rss_kib));
    let (fd0, fd1) = (median(&start, |s| s.fds), median(&end, |s| s.fds));
    let judged = span >= MIN_JUDGED_S * 1e3;
    let over = |a: u64, b: u64, slack: u64| b as f64 > a as f64 * GROWTH + slack as f64;
    Some(Usage {
        name: track.name.clone(),
        pid: track.pid,
        rss_kib_start: rss0,
        rss_kib_end: rss1,
        rss_kib_max: track.samples.iter().map(|s| s.rss_kib).max().unwrap_or(0),
        fds_start: fd0,
        fds_end: fd1,
        fds_max: track.samples.iter().map(|s| s.fds).max().unwrap_or(0),
        grew: judged && (over(rss0, rss1, RSS_SLACK_KIB) || over(fd0, fd1, FD_SLACK)),
    })
}

/// Resident memory (KiB) and open descriptors of `pid`, from `/proc`.
pub fn read(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn track(points: &[(f64, u64, u64)]) -> Track {
        Track {
            name: "master".into(),
            pid: 7,
            samples: points
                .iter()
                .map(|&(t, rss_kib, fds)| Sample { t, rss_kib, fds })
                .collect(),
        }
    }

    #[test]
    fn growth_past_five_percent_and_the_allowance_is_caught_in_a_long_run_only() {
        // 100 s run: start window 10..25 s, end window 90..100 s.
        let flat = track(&[(5e3, 10_000, 20), (15e3, 200_000, 30), (95e3, 205_000, 31)]);
        let u = usage(&flat, 0.0, 100e3).unwrap();
        assert_eq!(
            (u.rss_kib_start, u.rss_kib_end, u.fds_end),
            (200_000, 205_000, 31)
        );
        assert!(!u.grew, "warm-up before the start window does not count");
        let leak = track(&[(5e3, 9_000, 9), (15e3, 200_000, 30), (95e3, 260_000, 30)]);
        assert!(usage(&leak, 0.0, 100e3).unwrap().grew);
        let fds = track(&[(5e3, 9_000, 9), (15e3, 200_000, 30), (95e3, 200_000, 60)]);
        assert!(usage(&fds, 0.0, 100e3).unwrap().grew);
        // The same growth over 30 s is reported, not judged.
        let short = track(&[(2e3, 200_000, 30), (4e3, 200_000, 30), (29e3, 260_000, 60)]);
        assert!(!usage(&short, 0.0, 30e3).unwrap().grew);
        // A process not alive at both ends has no verdict, nor one started late (a
        // newcomer allocates the state it joins for).
        assert!(usage(&track(&[(15e3, 1, 1)]), 0.0, 100e3).is_none());
        let late = track(&[(12e3, 8_000, 20), (20e3, 300_000, 30), (95e3, 300_000, 30)]);
        assert!(usage(&late, 0.0, 100e3).is_none());
    }

    #[test]
    fn this_process_can_be_read() {
        let (rss, fds) = read(std::process::id()).unwrap();
        assert!(rss > 0 && fds >= 3, "{rss} {fds}");
    }
}
