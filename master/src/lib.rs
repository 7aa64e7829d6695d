//! eccl master: the openraft-replicated registry of peers and epochs, and the leader's
//! coordination of `update_topology()` rounds.
//!
//! [`start`] runs a master inside the calling tokio runtime (the embedded default is a
//! one-node raft cluster); the `eccl-master` binary wraps it.

// Without the `server` feature (on by default) the crate is the registry, the store, the
// sync planner and the raft messages and snapshots: what the fuzzers (fuzz/) decode,
// built without the transports, the disk store and the command line.
#[cfg(feature = "server")]
pub mod cluster_cli;
#[cfg(feature = "server")]
pub mod connection;
#[cfg(feature = "server")]
pub mod coordinator;
pub mod raft;
pub mod registry;
#[cfg(feature = "server")]
pub mod secret;
#[cfg(feature = "server")]
pub mod server;
pub mod store;
pub mod sync;
pub mod topology;

#[cfg(feature = "server")]
mod start;
#[cfg(feature = "server")]
pub use start::{start, ClusterOptions, MasterHandle, MasterOptions};

use std::collections::BTreeMap;

#[cfg(feature = "server")]
pub use coordinator::{Coordinator, Timing};
#[cfg(feature = "server")]
pub use raft::RaftRegistry;
pub use raft::{MasterNode, RaftTiming};

/// Parses a list of masters as `--masters` takes it: `id=CLIENT/RAFT` entries separated
/// by commas; the raft address may be just `:PORT` on the client address's host.
pub fn parse_masters(s: &str) -> Result<BTreeMap<u64, MasterNode>, String> {
    let mut m = BTreeMap::new();
    for part in s.split(',').filter(|p| !p.trim().is_empty()) {
        let (id, addrs) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not id=CLIENT/RAFT"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| format!("{id:?} is not a node id"))?;
        let (client, raft) = addrs.split_once('/').ok_or_else(|| {
            format!("{part:?} is not id=CLIENT/RAFT (each master has a client and a raft address)")
        })?;
        let (client, raft) = (client.trim(), raft.trim());
        let raft = match raft.strip_prefix(':') {
            Some(port) => {
                let host = client
                    .rsplit_once(':')
                    .map(|(h, _)| h)
                    .ok_or_else(|| format!("{client:?} is not host:port"))?;
                format!("{host}:{port}")
            }
            None => raft.to_string(),
        };
        if m.insert(id, MasterNode::new(client, raft)).is_some() {
            return Err(format!("master {id} is listed twice"));
        }
    }
    if m.is_empty() {
        return Err("no masters given".into());
    }
    Ok(m)
}
