//! The raft state machine: the [`Registry`], the last applied log id and the last
//! applied membership, kept together under one lock so that a snapshot and a reader
//! always see a consistent triple.

use std::io::Cursor;
use std::sync::{Arc, Mutex, RwLock};

use openraft::storage::RaftStateMachine;
use openraft::{
    AnyError, Entry, EntryPayload, LogId, RaftSnapshotBuilder, Snapshot, SnapshotMeta,
    StorageError, StorageIOError, StoredMembership,
};

use super::disk::{blocking, Disk};
pub use super::snapshot::{decode_snapshot, encode_snapshot, SmData};
use super::types::MasterNode;
use super::types::{MasterId, TypeConfig};
use crate::registry::Outcome;

/// Shared read access to the state machine, for the leader's reads that need not go
/// through raft. On a follower it lags the leader by the replication delay.
pub type SmHandle = Arc<RwLock<SmData>>;

#[derive(Debug)]
struct StoredSnapshot {
    meta: SnapshotMeta<MasterId, MasterNode>,
    data: Vec<u8>,
}

/// The state machine store handed to openraft. Cloning shares the same state.
#[derive(Debug, Clone, Default)]
pub struct StateMachineStore {
    data: SmHandle,
    current: Arc<Mutex<Option<StoredSnapshot>>>,
    snapshot_seq: Arc<std::sync::atomic::AtomicU64>,
    /// Where snapshots are kept across restarts (with a data directory).
    disk: Option<Arc<Disk>>,
}

impl StateMachineStore {
    pub fn new() -> StateMachineStore {
        StateMachineStore::default()
    }

    /// A state machine whose snapshots are kept on `disk`, starting from the last one
    /// there (openraft then applies the committed log entries after it).
    pub fn open(disk: Arc<Disk>) -> anyhow::Result<StateMachineStore> {
        let sm = StateMachineStore {
            disk: Some(disk.clone()),
            ..StateMachineStore::default()
        };
        let loaded = disk.load_snapshot().map_err(|e| {
            anyhow::anyhow!("cannot read the snapshot in {}: {e}", disk.path().display())
        })?;
        if let Some((meta, bytes)) = loaded {
            let mut data = decode_snapshot(&bytes).map_err(|e| {
                anyhow::anyhow!("the snapshot in {} is damaged: {e}", disk.path().display())
            })?;
            data.last_applied = meta.last_log_id;
            data.membership = meta.last_membership.clone();
            *sm.write_data() = data;
            *sm.current() = Some(StoredSnapshot { meta, data: bytes });
        }
        Ok(sm)
    }

    /// Keeps a snapshot on disk, when there is one, before it counts as taken.
    async fn persist(
        &self,
        meta: &SnapshotMeta<MasterId, MasterNode>,
        bytes: &[u8],
    ) -> Result<(), StorageError<MasterId>> {
        if let Some(d) = &self.disk {
            let (m, b) = (meta.clone(), bytes.to_vec());
            blocking(d, move |d| d.save_snapshot(&m, &b))
                .await
                .map_err(|e| {
                    StorageError::from(StorageIOError::write_snapshot(Some(meta.signature()), e))
                })?;
        }
        Ok(())
    }

    /// The shared state, for reads outside raft.
    pub fn handle(&self) -> SmHandle {
        self.data.clone()
    }

    fn read_data(&self) -> std::sync::RwLockReadGuard<'_, SmData> {
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write_data(&self) -> std::sync::RwLockWriteGuard<'_, SmData> {
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Option<StoredSnapshot>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<MasterId>> {
        // Copy under the read lock, encode outside it.
        let data = self.read_data().clone();
        let bytes = encode_snapshot(&data)?;
        let seq = self
            .snapshot_seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let snapshot_id = match data.last_applied {
            Some(l) => format!("{}-{}-{seq}", l.leader_id, l.index),
            None => format!("--{seq}"),
        };
        let meta = SnapshotMeta {
            last_log_id: data.last_applied,
            last_membership: data.membership,
            snapshot_id,
        };
        self.persist(&meta, &bytes).await?;
        *self.current() = Some(StoredSnapshot {
            meta: meta.clone(),
            data: bytes.clone(),
        });
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(
        &mut self,
    ) -> Result<
        (
            Option<LogId<MasterId>>,
            StoredMembership<MasterId, MasterNode>,
        ),
        StorageError<MasterId>,
    > {
        let d = self.read_data();
        Ok((d.last_applied, d.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError<MasterId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut d = self.write_data();
        let mut out = Vec::new();
        for entry in entries {
            d.last_applied = Some(entry.log_id);
            let outcome = match entry.payload {
                EntryPayload::Blank => Outcome::Nothing,
                EntryPayload::Normal(cmd) => d.registry.apply(&cmd),
                EntryPayload::Membership(m) => {
                    d.membership = StoredMembership::new(Some(entry.log_id), m);
                    Outcome::Nothing
                }
            };
            out.push(outcome);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<MasterId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<MasterId, MasterNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<MasterId>> {
        let bytes = snapshot.into_inner();
        let mut data = decode_snapshot(&bytes).map_err(|_| {
            StorageIOError::read_snapshot(
                Some(meta.signature()),
                AnyError::error("undecodable snapshot"),
            )
        })?;
        self.persist(meta, &bytes).await?;
        // The meta is authoritative for what the snapshot covers.
        data.last_applied = meta.last_log_id;
        data.membership = meta.last_membership.clone();
        *self.write_data() = data;
        *self.current() = Some(StoredSnapshot {
            meta: meta.clone(),
            data: bytes,
        });
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<MasterId>> {
        Ok(self.current().as_ref().map(|s| Snapshot {
            meta: s.meta.clone(),
            snapshot: Box::new(Cursor::new(s.data.clone())),
        }))
    }
}
