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

/// Bytes of entries one AppendEntries carries (at least one entry, whatever its size):
/// a batch stays well under the control-message limit, so a lagging follower is always
/// sent something it can take. One entry is at most a store write
/// (`StoreLimits::MAX_WRITE_BYTES`, 4 MiB) and its envelope.
pub const MAX_APPEND_BYTES: usize = 8 << 20;

/// Bytes of entries held in memory that make the log ask for a snapshot (after which the
/// entries behind it are purged), whatever the entry count.
pub const SNAPSHOT_AT_BYTES: usize = 64 << 20;

/// Bytes of entries held past which the leader takes no store write until a snapshot
/// has caught up: the hard bound on the log's memory.
pub const REFUSE_WRITES_AT_BYTES: usize = 2 * SNAPSHOT_AT_BYTES;

#[derive(Debug, Default)]
struct LogInner {
    last_purged: Option<LogId<MasterId>>,
    /// Each entry with its encoded size.
    entries: BTreeMap<u64, (Entry<TypeConfig>, usize)>,
    /// Sum of the sizes in `entries`.
    bytes: usize,
    committed: Option<LogId<MasterId>>,
    vote: Option<Vote<MasterId>>,
}

impl LogInner {
    fn insert(&mut self, e: Entry<TypeConfig>, size: usize) {
        if let Some((_, old)) = self.entries.insert(e.log_id.index, (e, size)) {
            self.bytes -= old;
        }
        self.bytes += size;
    }

    /// Drops the entries from `index` on (`after` false: up to and including it).
    fn drop_entries(&mut self, index: u64, after: bool) {
        let gone = if after {
            self.entries.split_off(&index)
        } else {
            let keep = self.entries.split_off(&index.saturating_add(1));
            std::mem::replace(&mut self.entries, keep)
        };
        self.bytes -= gone.values().map(|(_, s)| s).sum::<usize>();
    }
}

/// An entry's encoded size, as it travels between masters.
pub fn entry_size(e: &Entry<TypeConfig>) -> usize {
    bincode::serde::encode_to_vec(e, bincode::config::standard())
        .map_or(usize::MAX / 4, |v| v.len())
}

/// The raft log, vote and committed index of one master, in memory. Cloning gives
/// another handle to the same log (openraft reads through a clone while it appends).
#[derive(Debug, Clone, Default)]
pub struct LogStore {
    inner: Arc<Mutex<LogInner>>,
    disk: Option<Arc<Disk>>,
    /// Told when the entries held pass [`SNAPSHOT_AT_BYTES`]; the raft registry then
    /// asks for a snapshot, which purges them.
    too_big: Option<Arc<tokio::sync::Notify>>,
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
        let mut inner = LogInner {
            last_purged: l.last_purged,
            committed: l.committed,
            vote: l.vote,
            ..Default::default()
        };
        for (_, e) in l.entries {
            let size = entry_size(&e);
            inner.insert(e, size);
        }
        Ok(LogStore {
            inner: Arc::new(Mutex::new(inner)),
            disk: Some(disk),
            too_big: None,
        })
    }

    /// A handle that reads the log's counts ([`LogStore::bytes`], [`LogStore::len`]) and
    /// holds nothing else: not the data directory, which must be released when raft
    /// stops (a handle with the disk kept every shutdown waiting for it).
    pub fn reader(&self) -> LogStore {
        LogStore {
            inner: self.inner.clone(),
            disk: None,
            too_big: None,
        }
    }

    /// Notifies `n` whenever the entries held pass [`SNAPSHOT_AT_BYTES`].
    pub fn notify_when_too_big(&mut self, n: Arc<tokio::sync::Notify>) {
        self.too_big = Some(n);
    }

    /// Bytes of the entries held (encoded); for tests and metrics.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Whether this master has taken part in a cluster before (it has a vote or a log).
    pub fn has_state(&self) -> bool {
        let inner = self.lock();
        inner.vote.is_some() || !inner.entries.is_empty() || inner.last_purged.is_some()
    }

    /// Puts `e` into the log as appending it would, without the flush callback raft's
    /// storage API needs (a log built by hand: tests, tools).
    #[doc(hidden)]
    pub fn insert(&self, e: Entry<TypeConfig>) {
        let size = entry_size(&e);
        self.lock().insert(e, size);
    }

    /// Drops the entries up to and including `index`, as purging does.
    #[doc(hidden)]
    pub fn purge_through(&self, index: u64) {
        self.lock().drop_entries(index, false);
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
        Ok(inner
            .entries
            .range(range)
            .map(|(_, (e, _))| e.clone())
            .collect())
    }

    /// The entries from `start` on, as many as fit in [`MAX_APPEND_BYTES`] (at least one):
    /// what replication sends in one AppendEntries.
    async fn limited_get_log_entries(
        &mut self,
        start: u64,
        end: u64,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<MasterId>> {
        let inner = self.lock();
        let mut bytes = 0usize;
        let mut out = Vec::new();
        for (_, (e, size)) in inner.entries.range(start..end) {
            if !out.is_empty() && bytes + size > MAX_APPEND_BYTES {
                break;
            }
            bytes += size;
            out.push(e.clone());
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<MasterId>> {
        let inner = self.lock();
        let last = inner
            .entries
            .last_key_value()
            .map(|(_, (e, _))| e.log_id)
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
        let sizes: Vec<usize> = if let Some(d) = &self.disk {
            let rows = entries
                .iter()
                .map(disk::encode_entry)
                .collect::<Result<Vec<_>, _>>()
                .map_err(disk::write_err)?;
            let sizes = rows.iter().map(|(_, r)| r.len()).collect();
            if let Err(e) = blocking(d, move |d| d.append(&rows)).await {
                let io = std::io::Error::other(e.to_string());
                callback.log_io_completed(Err(io));
                return Err(disk::write_err(e));
            }
            sizes
        } else {
            entries.iter().map(entry_size).collect()
        };
        let too_big = {
            let mut inner = self.lock();
            for (e, size) in entries.into_iter().zip(sizes) {
                inner.insert(e, size);
            }
            inner.bytes > SNAPSHOT_AT_BYTES
        };
        if too_big {
            if let Some(n) = &self.too_big {
                n.notify_one();
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
        self.lock().drop_entries(log_id.index, true);
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
        inner.drop_entries(log_id.index, false);
        Ok(())
    }
}
