//! The replicated registry as a running raft node: openraft started over the log and
//! state machine stores and the network between masters, proposals, reads, snapshots.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::auth::Secret;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{Config, SnapshotPolicy};

use super::types::*;
use super::SmHandle;
use super::{disk, log_store, LogStore, MasterNetwork, StateMachineStore};
use crate::registry::{Command, Outcome, Registry};

/// How long a proposal may wait to be committed and applied.
pub const PROPOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Take a snapshot (and purge the log behind it) every this many applied entries (or
/// sooner, when the entries pass `log_store::SNAPSHOT_AT_BYTES`).
pub const SNAPSHOT_EVERY: u64 = 1000;

/// Entries kept behind a snapshot, for followers a little behind (one further behind is
/// sent the snapshot). With entries of up to a store write each (4 MiB) they hold at
/// most 32 MiB: well under `log_store::SNAPSHOT_AT_BYTES`, so a purge always brings the
/// log back under it.
const KEPT_BEHIND_SNAPSHOT: u64 = 8;

/// One master's raft node and its replica of the registry.
pub struct RaftRegistry {
    pub raft: RaftNode,
    pub node_id: MasterId,
    /// The key members' link proofs come from; derived from the cluster secret, so every
    /// master has it and no peer does.
    pub(super) link_key: [u8; 32],
    /// The key cluster changes are signed with (see [`admin`](super::admin)); derived from the cluster
    /// secret too.
    pub(super) admin_key: [u8; 32],
    /// Started to be added to a running cluster: it forms nothing itself.
    pub(super) joining: bool,
    pub(super) node: MasterNode,
    pub(super) members: BTreeMap<MasterId, MasterNode>,
    pub(super) registry: SmHandle,
    pub(super) network: MasterNetwork,
    pub(super) bootstrap: Option<tokio::task::JoinHandle<()>>,
    /// Asks for a snapshot whenever the log's entries pass their byte bound.
    pub(super) snapshotter: tokio::task::JoinHandle<()>,
    /// Another handle to the log, for what it holds.
    pub(super) log: LogStore,
    /// The data directory's database, watched so that [`RaftRegistry::shutdown`] returns
    /// only once raft's tasks have let go of it (a restart in the same process can then
    /// open it again).
    pub(super) disk_closed: Option<tokio::sync::watch::Receiver<()>>,
}

impl std::fmt::Debug for RaftRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftRegistry")
            .field("node_id", &self.node_id)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

fn raft_config(timing: RaftTiming) -> anyhow::Result<Config> {
    let config = Config {
        cluster_name: "eccl-master".to_string(),
        heartbeat_interval: timing.heartbeat_ms,
        election_timeout_min: timing.election_min_ms,
        election_timeout_max: timing.election_max_ms,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(SNAPSHOT_EVERY),
        max_in_snapshot_log_to_keep: KEPT_BEHIND_SNAPSHOT,
        ..Default::default()
    };
    Ok(config.validate()?)
}

impl RaftRegistry {
    /// Starts master `node_id`, reached by other masters and clients as `node` says.
    /// `members` lists all masters including this one (its entry is set to `node`);
    /// every master must be given the same list. `secret` is the cluster's, which raft
    /// connections use and clients never hold. The caller serves incoming raft
    /// connections with [`serve_raft_listener`].
    ///
    /// A single master initializes itself and is leader when this returns.
    pub async fn start(
        node_id: MasterId,
        node: MasterNode,
        members: BTreeMap<MasterId, MasterNode>,
        secret: Secret,
        timing: RaftTiming,
        data_dir: Option<&std::path::Path>,
        join: bool,
    ) -> anyhow::Result<RaftRegistry> {
        let mut members = members;
        members.insert(node_id, node.clone());
        let config = Arc::new(raft_config(timing)?);
        let mut disk_closed = None;
        let (log, sm, restarted) = match data_dir {
            Some(dir) => {
                let disk = disk::Disk::open(dir)?;
                disk_closed = Some(disk.closed());
                let log = LogStore::open(disk.clone())?;
                let restarted = log.has_state();
                tracing::info!(target: "eccl::master", "master {node_id}: raft state in {} ({})", disk.path().display(),
                    if restarted { "restarting with its log and vote" } else { "new" });
                (log, StateMachineStore::open(disk)?, restarted)
            }
            None => (LogStore::new(), StateMachineStore::new(), false),
        };
        // The log's memory is bounded by bytes too: past SNAPSHOT_AT_BYTES it asks for a
        // snapshot, and the entries behind the snapshot are purged.
        let mut log = log;
        let too_big = Arc::new(tokio::sync::Notify::new());
        log.notify_when_too_big(too_big.clone());
        let registry = sm.handle();
        let link_key = secret.derive(b"eccl-link-key");
        let admin_key = secret.derive(eccl_protocol::ClusterChange::KEY_LABEL);
        let network = MasterNetwork::new(secret, node_id);
        let log_handle = log.reader();
        let raft = openraft::Raft::new(node_id, config, network.clone(), log, sm).await?;
        let snapshotter = {
            let raft = raft.clone();
            tokio::spawn(async move {
                loop {
                    too_big.notified().await;
                    tracing::debug!(target: "eccl::master", "master {node_id}: the raft log holds more than {} bytes: snapshot", log_store::SNAPSHOT_AT_BYTES);
                    if raft.trigger().snapshot().await.is_err() {
                        return; // raft stopped
                    }
                }
            })
        };

        let nodes = members.clone();
        let lowest = members.keys().next().copied() == Some(node_id);
        let mut bootstrap = None;
        if restarted {
            // It was part of the cluster: it rejoins with its log; nothing to form.
        } else if join {
            tracing::info!(target: "eccl::master", "master {node_id} waits to be added to a running cluster (eccl-master cluster add)");
        } else if lowest {
            initialize(&raft, nodes).await?;
        } else {
            // Fallback: if the lowest id never reaches us, form the cluster ourselves.
            let position = members.keys().position(|id| *id == node_id).unwrap_or(1) as u64;
            let delay = Duration::from_millis(
                4 * timing.election_max_ms + position * timing.election_max_ms,
            );
            let raft = raft.clone();
            bootstrap = Some(tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if matches!(raft.is_initialized().await, Ok(false)) {
                    tracing::info!(node_id, "no cluster reached this master; bootstrapping it");
                    let _ = initialize(&raft, nodes).await;
                }
            }));
        }

        let me = RaftRegistry {
            raft,
            node_id,
            link_key,
            admin_key,
            joining: join && !restarted,
            node,
            members,
            registry,
            network,
            bootstrap,
            snapshotter,
            log: log_handle,
            disk_closed,
        };
        if me.members.len() == 1 && !me.joining {
            // A one-node cluster elects itself at once; return only once it leads.
            let _ = me.wait_leader(Duration::from_secs(5)).await;
            if !me.is_leader() {
                me.shutdown().await;
                anyhow::bail!("single master {node_id} did not become leader");
            }
        }
        Ok(me)
    }

    /// Proposes `cmd` through raft; returns its outcome once it is committed and
    /// applied here. Only the leader accepts proposals.
    pub async fn propose(&self, cmd: Command) -> Result<Outcome, ProposeError> {
        match tokio::time::timeout(PROPOSE_TIMEOUT, self.raft.client_write(cmd)).await {
            Ok(Ok(resp)) => Ok(resp.data),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                let leader_addr = f
                    .leader_node
                    .map(|n| n.client)
                    .or_else(|| f.leader_id.and_then(|id| self.addr_of(id)));
                Err(ProposeError::NotLeader {
                    leader_id: f.leader_id,
                    leader_addr,
                })
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ChangeMembershipError(e)))) => {
                Err(ProposeError::Fatal(e.to_string()))
            }
            Ok(Err(RaftError::Fatal(f))) => Err(self.not_leader_or(f.to_string())),
            Err(_) => {
                Err(self
                    .not_leader_or(format!("proposal not committed within {PROPOSE_TIMEOUT:?}")))
            }
        }
    }

    /// Leadership was lost while the proposal was in flight: redirect; a stopped node
    /// or a stuck leader: fatal.
    fn not_leader_or(&self, msg: String) -> ProposeError {
        let m = self.raft.metrics().borrow().clone();
        if m.running_state.is_ok() && m.current_leader != Some(self.node_id) {
            let leader = m.current_leader;
            ProposeError::NotLeader {
                leader_id: leader,
                leader_addr: leader.and_then(|id| self.addr_of(id)),
            }
        } else {
            ProposeError::Fatal(msg)
        }
    }

    /// Reads this master's replica of the registry (the leader's is up to date with
    /// every proposal that returned).
    pub fn read<R>(&self, f: impl FnOnce(&Registry) -> R) -> R {
        let data = self.registry.read().unwrap_or_else(|e| e.into_inner());
        f(&data.registry)
    }

    /// Bytes of the raft log's entries held in memory (bounded: see
    /// `log_store::SNAPSHOT_AT_BYTES`).
    pub fn log_bytes(&self) -> usize {
        self.log.bytes()
    }

    /// The shared state machine data, for callers that keep a handle.
    pub fn handle(&self) -> SmHandle {
        self.registry.clone()
    }

    pub fn is_leader(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.state.is_leader() && m.current_leader == Some(self.node_id)
    }

    /// The raft term this master is in.
    pub fn term(&self) -> u64 {
        self.raft.metrics().borrow().current_term
    }

    /// The leader this master knows of, with its client address.
    pub fn leader(&self) -> Option<(MasterId, String)> {
        let id = self.raft.metrics().borrow().current_leader?;
        Some((id, self.addr_of(id)?))
    }

    /// Waits until some leader is known; returns its id.
    pub async fn wait_leader(&self, timeout: Duration) -> Option<MasterId> {
        let mut rx = self.raft.metrics();
        let wait = async {
            loop {
                if let Some(id) = rx.borrow_and_update().current_leader {
                    return Some(id);
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.ok().flatten()
    }

    /// The link keys of every member of `world` (see [`eccl_protocol::auth::LinkKeys`]),
    /// keyed once for all its members' answers.
    pub fn world_keys(&self, world: &eccl_protocol::World) -> eccl_protocol::auth::WorldKeys {
        eccl_protocol::auth::WorldKeys::new(&self.link_key, world)
    }

    pub fn node(&self) -> &MasterNode {
        &self.node
    }

    pub fn members(&self) -> &BTreeMap<MasterId, MasterNode> {
        &self.members
    }

    /// Whether `id` is a master of this cluster (as configured, or as raft now knows it):
    /// only those may speak raft to it.
    ///
    /// A master started with `--join` accepts any master holding the cluster secret until
    /// it has been added (it cannot know the others before the leader's first message).
    pub fn is_master(&self, id: MasterId) -> bool {
        if self.joining
            && self
                .raft
                .metrics()
                .borrow()
                .membership_config
                .membership()
                .voter_ids()
                .next()
                .is_none()
        {
            return true;
        }
        self.members.contains_key(&id)
            || self
                .raft
                .metrics()
                .borrow()
                .membership_config
                .membership()
                .get_node(&id)
                .is_some()
    }

    /// The client address of master `id`.
    pub(crate) fn addr_of(&self, id: MasterId) -> Option<String> {
        let m = self.raft.metrics();
        let from_membership = m
            .borrow()
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.client.clone());
        from_membership.or_else(|| self.members.get(&id).map(|n| n.client.clone()))
    }

    /// Stops the raft node. Other masters see it as unreachable.
    pub async fn shutdown(&self) {
        if let Some(b) = &self.bootstrap {
            b.abort();
        }
        self.snapshotter.abort();
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft core ended abnormally");
        }
        self.network.close_all();
        // Raft's storage tasks (a log flush, a snapshot being built) may still hold the
        // database for a moment after the core has stopped.
        if let Some(closed) = &self.disk_closed {
            let mut closed = closed.clone();
            // `changed()` fails once the sender, dropped after the database, is gone.
            let released = tokio::time::timeout(DISK_RELEASE_TIMEOUT, async {
                while closed.changed().await.is_ok() {}
            })
            .await;
            if released.is_err() {
                tracing::warn!(target: "eccl::master", "master {}: raft storage still open {:?} after shutdown", self.node_id, DISK_RELEASE_TIMEOUT);
            }
        }
    }
}

/// How long [`RaftRegistry::shutdown`] waits for raft's storage tasks to release the
/// data directory.
const DISK_RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// Initializes a pristine node with `nodes`; "already initialized" is fine.
async fn initialize(raft: &RaftNode, nodes: BTreeMap<MasterId, MasterNode>) -> anyhow::Result<()> {
    match raft.initialize(nodes).await {
        Ok(()) => Ok(()),
        Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => Ok(()),
        Err(e) => Err(anyhow::anyhow!("raft initialize failed: {e}")),
    }
}
