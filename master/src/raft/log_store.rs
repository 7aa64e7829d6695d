//! The raft log store (storage-v2 `RaftLogStorage` + `RaftLogReader`).
//!
//! The log, vote and committed id live in memory; with a data directory every change is
//! also written to [`Disk`] (fsynced) before openraft is told it is done, and read back
//! at start. Without one, a restarted master starts with an empty log and an empty vote
//! and rejoins as a fresh node (see `raft/mod.rs` for what that gives up).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogId, LogState, RaftLogReader, StorageError, Vote};

use super::disk::{self, blocking, Disk};
use super::types::{MasterId, TypeConfig};

#[derive(Debug, Default)]
struct LogInner {
    last_purged: Option<LogId<MasterId>>,
    entries: BTreeMap<u64, Entry<TypeConfig>>,
    committed: Option<LogId<MasterId>>,
    vote: Option<Vote<MasterId>>,
}

/// The raft log, vote and committed index of one master, in memory. Cloning gives
/// another handle to the same log (openraft reads through a clone while it appends).
#[derive(Debug, Clone, Default)]
pub struct LogStore {
    inner: Arc<Mutex<LogInner>>,
    disk: Option<Arc<Disk>>,
}

impl LogStore {
    /// A log in memory only.
    pub fn new() -> LogStore {
        LogStore::default()
    }

    /// A log kept on `disk`, starting from what it holds.
    pub fn open(disk: Arc<Disk>) -> anyhow::Result<LogStore> {
        let l = disk.load().map_err(|e| {
            anyhow::anyhow!("cannot read the raft log in {}: {e}", disk.path().display())
        })?;
        Ok(LogStore {
            inner: Arc::new(Mutex::new(LogInner {
                last_purged: l.last_purged,
                entries: l.entries,
                committed: l.committed,
                vote: l.vote,
            })),
            disk: Some(disk),
        })
    }

    /// Whether this master has taken part in a cluster before (it has a vote or a log).
    pub fn has_state(&self) -> bool {
        let inner = self.lock();
        inner.vote.is_some() || !inner.entries.is_empty() || inner.last_purged.is_some()
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        // No code panics while holding the lock; recover the data if one ever did.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of entries held (not purged); for tests and metrics.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<MasterId>> {
        let inner = self.lock();
        Ok(inner.entries.range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<MasterId>> {
        let inner = self.lock();
        let last = inner
            .entries
            .last_key_value()
            .map(|(_, e)| e.log_id)
            .or(inner.last_purged);
        Ok(LogState {
            last_purged_log_id: inner.last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<MasterId>) -> Result<(), StorageError<MasterId>> {
        if let Some(d) = &self.disk {
            let v = *vote;
            blocking(d, move |d| d.save_vote(&v))
                .await
                .map_err(|e| StorageError::from(openraft::StorageIOError::write_vote(e)))?;
        }
        self.lock().vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<MasterId>>, StorageError<MasterId>> {
        Ok(self.lock().vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<MasterId>>,
    ) -> Result<(), StorageError<MasterId>> {
        if let Some(d) = &self.disk {
            blocking(d, move |d| d.save_committed(&committed))
                .await
                .map_err(disk::write_err)?;
        }
        self.lock().committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<MasterId>>, StorageError<MasterId>> {
        Ok(self.lock().committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<MasterId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<_> = entries.into_iter().collect();
        if let Some(d) = &self.disk {
            let rows = entries
                .iter()
                .map(disk::encode_entry)
                .collect::<Result<Vec<_>, _>>()
                .map_err(disk::write_err)?;
            if let Err(e) = blocking(d, move |d| d.append(&rows)).await {
                let io = std::io::Error::other(e.to_string());
                callback.log_io_completed(Err(io));
                return Err(disk::write_err(e));
            }
        }
        {
            let mut inner = self.lock();
            for e in entries {
                inner.entries.insert(e.log_id.index, e);
            }
        }
        // Flushed: on disk (fsynced) when there is one, else in the map.
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<MasterId>) -> Result<(), StorageError<MasterId>> {
        // Delete conflicting entries: `log_id.index` and everything after it.
        if let Some(d) = &self.disk {
            let index = log_id.index;
            blocking(d, move |d| d.truncate(index))
                .await
                .map_err(disk::write_err)?;
        }
        let mut inner = self.lock();
        let _ = inner.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<MasterId>) -> Result<(), StorageError<MasterId>> {
        // Delete applied entries up to and including `log_id.index`.
        if let Some(d) = &self.disk {
            blocking(d, move |d| d.purge(&log_id))
                .await
                .map_err(disk::write_err)?;
        }
        let mut inner = self.lock();
        if inner.last_purged.is_none_or(|p| p.index < log_id.index) {
            inner.last_purged = Some(log_id);
        }
        let keep = inner.entries.split_off(&log_id.index.saturating_add(1));
        inner.entries = keep;
        Ok(())
    }
}
