//! Unit tests of `eccl_master::raft::log_store`.

use eccl_master::raft::log_store::*;
use eccl_master::raft::types::TypeConfig;
use eccl_master::registry::Command;
use eccl_master::store::StoreCommand;
use eccl_protocol::StoreWrite;
use openraft::RaftLogReader;
use openraft::{CommittedLeaderId, EntryPayload};
use openraft::{Entry, LogId};

fn write(index: u64, bytes: usize) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Command::Store(StoreCommand::Write {
            session: 1,
            seq: index,
            op: StoreWrite::Set {
                key: b"k".to_vec(),
                value: vec![7; bytes],
                ephemeral: false,
            },
        })),
    }
}

/// What replication sends in one AppendEntries is bounded by bytes (at least one
/// entry, however large), so a follower far behind is never sent a batch that
/// cannot be encoded; the log counts the bytes it holds, and purging frees them.
#[tokio::test]
async fn batches_are_bounded_by_bytes_and_the_log_counts_them() {
    let mut log = LogStore::new();
    for i in 1..=20 {
        let e = write(i, 3 << 20);
        log.insert(e);
    }
    assert!(log.bytes() > 60 << 20);
    let batch = log.limited_get_log_entries(1, 21).await.unwrap();
    let bytes: usize = batch.iter().map(entry_size).sum();
    assert!(
        !batch.is_empty() && bytes <= MAX_APPEND_BYTES,
        "{} entries, {bytes} bytes",
        batch.len()
    );
    assert_eq!(
        batch.len(),
        MAX_APPEND_BYTES / entry_size(&write(1, 3 << 20))
    );
    // The encoded batch fits in one message between masters.
    let rpc = eccl_master::raft::RaftRpc::AppendEntries(openraft::raft::AppendEntriesRequest {
        vote: openraft::Vote::new(1, 1),
        prev_log_id: None,
        entries: batch,
        leader_commit: None,
    });
    assert!(eccl_protocol::codec::encode(&rpc).is_ok());
    // One entry over the batch bound still goes alone.
    let big = write(21, MAX_APPEND_BYTES);
    let size = entry_size(&big);
    log.insert(big);
    assert_eq!(log.limited_get_log_entries(21, 22).await.unwrap().len(), 1);
    log.purge_through(20);
    assert_eq!(log.bytes(), size);
}
