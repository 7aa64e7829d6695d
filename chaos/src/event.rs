//! What a worker reports, one JSON object a line on its stdout, and the orchestrator reads
//! back. Times are wall-clock milliseconds since the Unix epoch: every process of a run
//! shares one host and one clock, so the orchestrator can set a worker's call against the
//! moment it injected a fault.

use std::time::{SystemTime, UNIX_EPOCH};

/// A peer's id as the event log records it: eccl's `PeerId`, as the number it wraps
/// (what the JSON lines carry and the analysis compares).
pub type PeerId = u64;

use serde::{Deserialize, Serialize};

/// Now, in milliseconds since the Unix epoch.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    UpdateTopology,
    Sync,
    AllReduce,
    /// Only in the final round, so that no worker leaves while another still fetches state.
    Barrier,
    Leave,
}

impl Op {
    /// The collectives the report counts as ok or aborted.
    pub fn is_counted(self) -> bool {
        matches!(self, Op::Sync | Op::AllReduce)
    }
}

/// One call into the library and how it ended.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Call {
    pub peer: PeerId,
    pub op: Op,
    pub start: f64,
    pub end: f64,
    pub ok: bool,
    /// The error's variant (`Aborted`, `Evicted`, ...), when the call failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub err: Option<String>,
    /// The error's message, when the call failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub epoch: u64,
    /// The members of the call's epoch; for all_reduce, the members its `OpInfo` names.
    pub members: Vec<PeerId>,
    /// The worker's state revision when the call returned.
    pub revision: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Event {
    /// The worker registered with the master under a new peer id.
    Registered {
        peer: PeerId,
        t: f64,
    },
    /// `Communicator::connect` failed; the worker tries again.
    ConnectFailed {
        t: f64,
        err: String,
    },
    Call(Call),
    /// A successful `sync_shared_state`. `hash` is the worker's own blake3 of its state
    /// after the call, `lib_hash` the one the library reported.
    Sync {
        peer: PeerId,
        t: f64,
        epoch: u64,
        revision: u64,
        hash: String,
        lib_hash: String,
        bytes_received: u64,
        sources: Vec<PeerId>,
    },
    /// The worker folded an all_reduce result into its state: revision - 1 -> revision.
    Commit {
        peer: PeerId,
        t: f64,
        epoch: u64,
        revision: u64,
        prev: String,
        hash: String,
    },
    /// An all_reduce returned elements that differ from the closed form; not committed.
    Wrong {
        peer: PeerId,
        t: f64,
        epoch: u64,
        revision: u64,
        elements: usize,
    },
    /// A failed in-place all_reduce left the worker's buffer changed (G2 broken):
    /// `elements` differ from what the worker passed in.
    Touched {
        peer: PeerId,
        t: f64,
        epoch: u64,
        revision: u64,
        elements: usize,
    },
    /// A call failed with `Evicted`; the worker registers again under a new id.
    Evicted {
        peer: PeerId,
        t: f64,
        reason: String,
    },
    /// The worker, told `leave-in-sync`, dropped a shared-state sync still running after
    /// a few milliseconds and leaves from there.
    LeavingInSync {
        peer: PeerId,
        t: f64,
    },
    /// The worker left the job on request and exits.
    Left {
        peer: PeerId,
        t: f64,
    },
    /// The worker reached the stop revision, synced, and exits.
    Final {
        peer: PeerId,
        t: f64,
        revision: u64,
        hash: String,
    },
}

impl Event {
    pub fn call(&self) -> Option<&Call> {
        match self {
            Event::Call(c) => Some(c),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_events_read_back_with_their_tag() {
        let ev = Event::Call(Call {
            peer: 3,
            op: Op::AllReduce,
            start: 1.0,
            end: 2.5,
            ok: false,
            err: Some("Aborted".into()),
            detail: Some("peer 4 died".into()),
            epoch: 7,
            members: vec![3, 4],
            revision: 12,
        });
        let line = serde_json::to_string(&ev).unwrap();
        assert!(
            line.starts_with(r#"{"ev":"call","peer":3,"op":"all_reduce""#),
            "{line}"
        );
        let back: Event = serde_json::from_str(&line).unwrap();
        let call = back.call().unwrap();
        assert_eq!(
            (call.op, call.epoch, call.err.as_deref()),
            (Op::AllReduce, 7, Some("Aborted"))
        );
    }
}
