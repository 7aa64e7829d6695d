//! Unit tests of `eccl_master::raft::state_machine`.

use eccl_master::raft::state_machine::*;
use eccl_master::raft::types::TypeConfig;
use eccl_master::registry::Command;
use eccl_master::registry::Outcome;
use openraft::storage::RaftStateMachine;
use openraft::RaftSnapshotBuilder;
use openraft::{CommittedLeaderId, Membership};
use openraft::{Entry, EntryPayload, LogId};
use std::collections::BTreeSet;
use std::io::Cursor;

/// What the raft fuzzer found first: thirteen bytes of snapshot whose peer record
/// claims a string of about 2^64 bytes made the decoder panic ("capacity overflow")
/// in the master that received them. They are refused now, as is every prefix.
#[test]
fn a_snapshot_claiming_an_impossible_string_is_refused() {
    let bytes = [
        0xf3, 0x0a, 0x25, 0xfd, 0x04, 0x24, 0x00, 0x0a, 0xff, 0xff, 0xfd, 0xfb, 0x02,
    ];
    for end in 0..=bytes.len() {
        assert!(decode_snapshot(&bytes[..end]).is_err());
    }
    let data = SmData::default();
    let good = encode_snapshot(&data).unwrap();
    assert!(decode_snapshot(&good).is_ok());
}

fn entry(index: u64, payload: EntryPayload<TypeConfig>) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload,
    }
}

#[tokio::test]
async fn snapshot_round_trips_into_a_fresh_state_machine() {
    let mut sm = StateMachineStore::new();
    let m = Membership::new(vec![BTreeSet::from([1u64])], None);
    let reg = Command::Register {
        addr: "a:1".into(),
        host: "h".into(),
        quic: None,
        shm: None,
        rank_hint: None,
        token: [7; 32],
    };
    let out = sm
        .apply(vec![
            entry(1, EntryPayload::Membership(m)),
            entry(2, EntryPayload::Normal(reg)),
            entry(3, EntryPayload::Blank),
        ])
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![
            Outcome::Nothing,
            Outcome::Registered(eccl_protocol::PeerId(1)),
            Outcome::Nothing
        ]
    );

    let snap = sm.build_snapshot().await.unwrap();
    assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(3));
    let mut fresh = StateMachineStore::new();
    fresh
        .install_snapshot(&snap.meta, snap.snapshot)
        .await
        .unwrap();
    let (applied, membership) = fresh.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(3));
    assert_eq!(membership.log_id().map(|l| l.index), Some(1));
    assert_eq!(
        fresh.handle().read().unwrap().registry,
        sm.handle().read().unwrap().registry
    );
    assert!(fresh.get_current_snapshot().await.unwrap().is_some());
    // Garbage is refused, not panicked on.
    let bad = Box::new(Cursor::new(vec![0xff; 7]));
    assert!(fresh.install_snapshot(&snap.meta, bad).await.is_err());
}
