//! Fault injection for end-to-end tests: `ECCL_FAULT_INJECT=<point>:<action>[@<n>]`
//! makes this process SIGKILL or SIGSTOP itself the n-th time it reaches `point`, so a
//! test can hit one exact phase of the protocol (eccl-chaos `--inject` sets it). Unset,
//! each point costs one relaxed atomic load.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Point {
    /// A collective finished its first step (its first chunk is on the wire).
    FirstChunk,
    /// A collective is halfway through its steps.
    MidRing,
    /// The vote of `update_topology()` reached the master; the answer has not.
    UpdateTopology,
    /// `update_topology()` has the new epoch's world; its links are not connected yet
    /// (the others are connecting to this peer).
    Connect,
    /// A shared-state source sent its first chunk.
    SyncServe,
    /// A shared-state receiver got its first chunk.
    SyncFetch,
}

impl Point {
    fn parse(s: &str) -> Option<Point> {
        Some(match s {
            "first-chunk" => Point::FirstChunk,
            "mid-ring" => Point::MidRing,
            "update-topology" => Point::UpdateTopology,
            "connect" => Point::Connect,
            "sync-serve" => Point::SyncServe,
            "sync-fetch" => Point::SyncFetch,
            _ => return None,
        })
    }
}

#[derive(Debug)]
struct Plan {
    point: Point,
    signal: libc::c_int,
    nth: u32,
    seen: AtomicU32,
}

fn plan() -> Option<&'static Plan> {
    static PLAN: OnceLock<Option<Plan>> = OnceLock::new();
    PLAN.get_or_init(|| {
        let spec = std::env::var("ECCL_FAULT_INJECT").ok()?;
        let parsed = parse(&spec);
        if parsed.is_none() {
            tracing::warn!(target: "eccl::init", "ignoring ECCL_FAULT_INJECT={spec:?}: expected <first-chunk|mid-ring|update-topology|connect|sync-serve|sync-fetch>:<kill|stop>[@n]");
        }
        parsed
    })
    .as_ref()
}

fn parse(spec: &str) -> Option<Plan> {
    let (point, rest) = spec.trim().split_once(':')?;
    let (action, nth) = match rest.split_once('@') {
        Some((a, n)) => (a, n.parse().ok().filter(|n| *n > 0)?),
        None => (rest, 1),
    };
    let signal = match action {
        "kill" => libc::SIGKILL,
        "stop" => libc::SIGSTOP,
        _ => return None,
    };
    Some(Plan {
        point: Point::parse(point)?,
        signal,
        nth,
        seen: AtomicU32::new(0),
    })
}

/// Called at each injection point.
pub(crate) fn hit(point: Point) {
    let Some(p) = plan() else { return };
    if p.point != point || p.seen.fetch_add(1, Ordering::Relaxed) + 1 != p.nth {
        return;
    }
    let what = if p.signal == libc::SIGKILL {
        "kill"
    } else {
        "stop"
    };
    eprintln!("eccl: fault injection: {what} at {point:?} (#{})", p.nth);
    // SAFETY: kill(2) on our own pid with a valid signal number.
    unsafe {
        libc::kill(libc::getpid(), p.signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let p = parse("mid-ring:kill@3").unwrap();
        assert_eq!(
            (p.point, p.signal, p.nth),
            (Point::MidRing, libc::SIGKILL, 3)
        );
        let p = parse("sync-serve:stop").unwrap();
        assert_eq!(
            (p.point, p.signal, p.nth),
            (Point::SyncServe, libc::SIGSTOP, 1)
        );
        for bad in [
            "",
            "mid-ring",
            "mid-ring:explode",
            "nowhere:kill",
            "mid-ring:kill@0",
            "mid-ring:kill@x",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}
