//! Fault injection for end-to-end tests: `ECCL_FAULT_INJECT=<point>:<action>[@<n>]`
//! makes this process SIGKILL or SIGSTOP itself, or hold the thread that got there for a
//! while (`delay<ms>`: a slow member, alive throughout), the n-th time it reaches
//! `point`, so a test can hit one exact phase of the protocol (eccl-chaos `--inject`
//! sets it). Unset, each point costs one relaxed atomic load.

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
    /// `update_topology()` or `reconfigure()` has the new epoch's world; its links are
    /// not connected yet (the others are connecting to this peer).
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Signal(libc::c_int),
    Delay(std::time::Duration),
}

#[derive(Debug)]
struct Plan {
    point: Point,
    action: Action,
    nth: u32,
    seen: AtomicU32,
}

fn plan() -> Option<&'static Plan> {
    static PLAN: OnceLock<Option<Plan>> = OnceLock::new();
    PLAN.get_or_init(|| {
        let spec = std::env::var("ECCL_FAULT_INJECT").ok()?;
        let parsed = parse(&spec);
        if parsed.is_none() {
            tracing::warn!(target: "eccl::init", "ignoring ECCL_FAULT_INJECT={spec:?}: expected <first-chunk|mid-ring|update-topology|connect|sync-serve|sync-fetch>:<kill|stop|delay<ms>>[@n]");
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
    let action = match action {
        "kill" => Action::Signal(libc::SIGKILL),
        "stop" => Action::Signal(libc::SIGSTOP),
        _ => {
            let ms: u64 = action.strip_prefix("delay")?.parse().ok()?;
            Action::Delay(std::time::Duration::from_millis(ms))
        }
    };
    Some(Plan {
        point: Point::parse(point)?,
        action,
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
    let signal = match p.action {
        Action::Delay(d) => {
            eprintln!(
                "eccl: fault injection: delay {d:?} at {point:?} (#{})",
                p.nth
            );
            // The thread that got here is held, as a slow machine would hold it; the
            // process's other threads (heartbeats, listeners) go on.
            std::thread::sleep(d);
            return;
        }
        Action::Signal(s) => s,
    };
    let what = if signal == libc::SIGKILL {
        "kill"
    } else {
        "stop"
    };
    eprintln!("eccl: fault injection: {what} at {point:?} (#{})", p.nth);
    // SAFETY: kill(2) on our own pid with a valid signal number.
    unsafe {
        libc::kill(libc::getpid(), signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let p = parse("mid-ring:kill@3").unwrap();
        assert_eq!(
            (p.point, p.action, p.nth),
            (Point::MidRing, Action::Signal(libc::SIGKILL), 3)
        );
        let p = parse("sync-serve:stop").unwrap();
        assert_eq!(
            (p.point, p.action, p.nth),
            (Point::SyncServe, Action::Signal(libc::SIGSTOP), 1)
        );
        let p = parse("connect:delay300@2").unwrap();
        assert_eq!(
            (p.point, p.action, p.nth),
            (
                Point::Connect,
                Action::Delay(std::time::Duration::from_millis(300)),
                2
            )
        );
        for bad in [
            "",
            "mid-ring",
            "mid-ring:explode",
            "nowhere:kill",
            "mid-ring:kill@0",
            "mid-ring:kill@x",
            "connect:delay",
            "connect:delayx",
        ] {
            assert!(parse(bad).is_none(), "{bad}");
        }
    }
}
