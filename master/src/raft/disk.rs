//! A master's raft state on disk (`--data-dir`): one redb database holding the log, the
//! vote, the committed log id and the last snapshot. Every write is one redb transaction
//! committed with `Durability::Immediate` (fsynced) before openraft hears it is done, so a
//! master that crashes and restarts comes back with everything it acknowledged.
//!
//! The log store and the state machine keep working copies in memory; this is their
//! durable copy, read once at start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use openraft::{AnyError, Entry, LogId, SnapshotMeta, StorageError, StorageIOError, Vote};
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::types::{MasterId, MasterNode, TypeConfig};

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const LAST_PURGED: &str = "last_purged";
const SNAPSHOT_META: &str = "snapshot_meta";
const SNAPSHOT_DATA: &str = "snapshot_data";
/// The shape of what the database holds: the log's commands and the snapshots carry the
/// protocol's types (the world, digests, requests), so a database is read only by a build
/// of the protocol version that wrote it. Written when the database is first made.
const FORMAT: &str = "format";

/// What [`FORMAT`] holds for this build.
fn format() -> String {
    format!(
        "eccl-master raft state, protocol version {}",
        eccl_protocol::PROTOCOL_VERSION
    )
}

/// The file inside a data directory.
pub const FILE: &str = "raft.redb";

/// The durable raft state of one master.
pub struct Disk {
    db: Database,
    path: PathBuf,
    /// Dropped after `db` (fields drop in order): its receivers learn that the database
    /// is closed and its file lock released, not merely that the last handle went away.
    closed: tokio::sync::watch::Sender<()>,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk").field("path", &self.path).finish()
    }
}

/// What a data directory held at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub entries: BTreeMap<u64, Entry<TypeConfig>>,
    pub last_purged: Option<LogId<MasterId>>,
    pub vote: Option<Vote<MasterId>>,
    pub committed: Option<LogId<MasterId>>,
}

impl Loaded {
    /// Whether this master has been part of a cluster before (a vote or a log).
    pub fn is_fresh(&self) -> bool {
        self.vote.is_none() && self.entries.is_empty() && self.last_purged.is_none()
    }
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, AnyError> {
    bincode::serde::encode_to_vec(v, bincode::config::standard()).map_err(|e| AnyError::new(&e))
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AnyError> {
    // A damaged record is an error, not a panic or a huge allocation.
    let (v, used) = eccl_protocol::codec::decode_slice(bytes).map_err(|e| AnyError::new(&e))?;
    if used != bytes.len() {
        return Err(AnyError::error(format!(
            "{} trailing bytes in a stored record",
            bytes.len() - used
        )));
    }
    Ok(v)
}

fn any(e: impl std::error::Error + 'static) -> AnyError {
    AnyError::new(&e)
}

/// A storage error for a failed write of the log (`what` says which part).
pub fn write_err(e: AnyError) -> StorageError<MasterId> {
    StorageError::from(StorageIOError::write_logs(e))
}

impl Disk {
    /// Opens (or creates) the database in `dir`, which is created with mode 0700.
    pub fn open(dir: &Path) -> anyhow::Result<Arc<Disk>> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| {
                anyhow::anyhow!("cannot create the data directory {}: {e}", dir.display())
            })?;
        let path = dir.join(FILE);
        let db = Database::create(&path)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
        // Create the tables, so that reads find them, and record the format of a new
        // database; an existing one must be of this build's.
        let tx = db.begin_write()?;
        tx.open_table(LOG)?;
        {
            let mut meta = tx.open_table(META)?;
            let found = meta.get(FORMAT)?.map(|v| v.value().to_vec());
            let empty = meta.is_empty()? && tx.open_table(LOG)?.is_empty()?;
            let want = format();
            match found {
                Some(f) if f == want.as_bytes() => {}
                None if empty => {
                    meta.insert(FORMAT, want.as_bytes())?;
                }
                found => {
                    let what = match found {
                        Some(f) => format!("\"{}\"", String::from_utf8_lossy(&f)),
                        None => {
                            "no format (an eccl-master from before data directories recorded one)"
                                .into()
                        }
                    };
                    anyhow::bail!(
                        "{} was written with {what}, and this eccl-master reads \"{want}\" only: \
                         start it with an empty --data-dir (the job's state comes back from the \
                         other masters, or from the peers' next registration), or run the build \
                         that wrote it",
                        path.display()
                    );
                }
            }
        }
        tx.commit()?;
        let (closed, _) = tokio::sync::watch::channel(());
        Ok(Arc::new(Disk { db, path, closed }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A receiver whose `changed()` fails once this database is closed.
    pub fn closed(&self) -> tokio::sync::watch::Receiver<()> {
        self.closed.subscribe()
    }

    /// Everything the log store needs at start.
    pub fn load(&self) -> Result<Loaded, AnyError> {
        let tx = self.db.begin_read().map_err(any)?;
        let log = tx.open_table(LOG).map_err(any)?;
        let mut entries = BTreeMap::new();
        for row in log.iter().map_err(any)? {
            let (k, v) = row.map_err(any)?;
            entries.insert(k.value(), decode(v.value())?);
        }
        let meta = tx.open_table(META).map_err(any)?;
        fn opt<T: DeserializeOwned>(
            meta: &redb::ReadOnlyTable<&'static str, &'static [u8]>,
            key: &str,
        ) -> Result<Option<T>, AnyError> {
            match meta.get(key).map_err(any)? {
                Some(v) => decode(v.value()).map(Some),
                None => Ok(None),
            }
        }
        Ok(Loaded {
            entries,
            last_purged: opt(&meta, LAST_PURGED)?,
            vote: opt(&meta, VOTE)?,
            committed: opt::<Option<LogId<MasterId>>>(&meta, COMMITTED)?.flatten(),
        })
    }

    /// Runs `f` in one write transaction and commits it (fsynced).
    fn write(
        &self,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<(), AnyError>,
    ) -> Result<(), AnyError> {
        let tx = self.db.begin_write().map_err(any)?;
        f(&tx)?;
        tx.commit().map_err(any)
    }

    fn put_meta(&self, key: &str, bytes: &[u8]) -> Result<(), AnyError> {
        self.write(|tx| {
            tx.open_table(META)
                .map_err(any)?
                .insert(key, bytes)
                .map_err(any)?;
            Ok(())
        })
    }

    pub fn save_vote(&self, vote: &Vote<MasterId>) -> Result<(), AnyError> {
        self.put_meta(VOTE, &encode(vote)?)
    }

    pub fn save_committed(&self, committed: &Option<LogId<MasterId>>) -> Result<(), AnyError> {
        self.put_meta(COMMITTED, &encode(committed)?)
    }

    /// Appends entries (already encoded, by index).
    pub fn append(&self, rows: &[(u64, Vec<u8>)]) -> Result<(), AnyError> {
        self.write(|tx| {
            let mut t = tx.open_table(LOG).map_err(any)?;
            for (i, bytes) in rows {
                t.insert(*i, bytes.as_slice()).map_err(any)?;
            }
            Ok(())
        })
    }

    /// Deletes the entries from `index` on.
    pub fn truncate(&self, index: u64) -> Result<(), AnyError> {
        self.write(|tx| {
            let mut t = tx.open_table(LOG).map_err(any)?;
            t.retain_in(index.., |_, _| false).map_err(any)?;
            Ok(())
        })
    }

    /// Deletes the entries up to `log_id` and records it as the last purged.
    pub fn purge(&self, log_id: &LogId<MasterId>) -> Result<(), AnyError> {
        let bytes = encode(log_id)?;
        self.write(|tx| {
            let mut t = tx.open_table(LOG).map_err(any)?;
            t.retain_in(..=log_id.index, |_, _| false).map_err(any)?;
            tx.open_table(META)
                .map_err(any)?
                .insert(LAST_PURGED, bytes.as_slice())
                .map_err(any)?;
            Ok(())
        })
    }

    /// Keeps `data` as the last snapshot, described by `meta`.
    pub fn save_snapshot(
        &self,
        meta: &SnapshotMeta<MasterId, MasterNode>,
        data: &[u8],
    ) -> Result<(), AnyError> {
        let m = encode(meta)?;
        self.write(|tx| {
            let mut t = tx.open_table(META).map_err(any)?;
            t.insert(SNAPSHOT_META, m.as_slice()).map_err(any)?;
            t.insert(SNAPSHOT_DATA, data).map_err(any)?;
            Ok(())
        })
    }

    /// The last snapshot kept, if any.
    pub fn load_snapshot(
        &self,
    ) -> Result<Option<(SnapshotMeta<MasterId, MasterNode>, Vec<u8>)>, AnyError> {
        let tx = self.db.begin_read().map_err(any)?;
        let t = tx.open_table(META).map_err(any)?;
        let meta = t.get(SNAPSHOT_META).map_err(any)?;
        let data = t.get(SNAPSHOT_DATA).map_err(any)?;
        match (meta, data) {
            (Some(m), Some(d)) => Ok(Some((decode(m.value())?, d.value().to_vec()))),
            _ => Ok(None),
        }
    }
}

/// Encodes an entry for [`Disk::append`].
pub fn encode_entry(e: &Entry<TypeConfig>) -> Result<(u64, Vec<u8>), AnyError> {
    Ok((e.log_id.index, encode(e)?))
}

/// Runs a blocking disk operation off the async threads.
pub async fn blocking<T: Send + 'static>(
    disk: &Arc<Disk>,
    f: impl FnOnce(&Disk) -> Result<T, AnyError> + Send + 'static,
) -> Result<T, AnyError> {
    let disk = disk.clone();
    match tokio::task::spawn_blocking(move || f(&disk)).await {
        Ok(r) => r,
        Err(e) => Err(AnyError::error(format!("disk task failed: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("eccl-disk-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn set_meta(d: &Path, key: &str, value: Option<&[u8]>) {
        let db = Database::create(d.join(FILE)).unwrap();
        let tx = db.begin_write().unwrap();
        {
            let mut t = tx.open_table(META).unwrap();
            match value {
                Some(v) => {
                    t.insert(key, v).unwrap();
                }
                None => {
                    t.remove(key).unwrap();
                }
            }
        }
        tx.commit().unwrap();
    }

    /// A new database records this build's format and opens again; one written by
    /// another protocol version, or by a build from before formats were recorded, is
    /// refused with both formats named, and its contents are left alone.
    #[test]
    fn a_database_of_another_format_is_refused_by_name() {
        let d = dir("format");
        let disk = Disk::open(&d).unwrap();
        disk.save_vote(&Vote::new(3, 1)).unwrap();
        drop(disk);
        let disk = Disk::open(&d).expect("the same build opens its own database");
        assert_eq!(disk.load().unwrap().vote, Some(Vote::new(3, 1)));
        drop(disk);

        set_meta(
            &d,
            FORMAT,
            Some(b"eccl-master raft state, protocol version 2"),
        );
        let e = Disk::open(&d).unwrap_err().to_string();
        assert!(
            e.contains("protocol version 2") && e.contains(&format()),
            "{e}"
        );
        assert!(e.contains("--data-dir"), "{e}");

        set_meta(&d, FORMAT, None);
        let e = Disk::open(&d).unwrap_err().to_string();
        assert!(e.contains("no format"), "{e}");
        // Still there for the build that wrote it.
        set_meta(&d, FORMAT, Some(format().as_bytes()));
        assert_eq!(
            Disk::open(&d).unwrap().load().unwrap().vote,
            Some(Vote::new(3, 1))
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
