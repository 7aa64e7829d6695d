//! Fuzzing what a master decodes from another master's connection (the raft listener,
//! after the cluster secret): the hello, every raft request and reply, and the registry
//! commands inside log entries; and `RaftRpc::refuse` on whatever decodes. See
//! `protocol/tests/fuzz.rs` for the method and `ECCL_FUZZ_CASES`.

#[path = "../../../protocol/tests/support/mutate.rs"]
mod mutate;

use eccl_master::raft::types::{RaftHello, RaftRpc, RaftRpcReply, TypeConfig, TERM_LIMIT};
use eccl_master::registry::Command;
use eccl_protocol::{codec, PeerId};
use mutate::{apply, config, mutation};
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, VoteRequest, VoteResponse};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
use proptest::prelude::*;
use serde::{de::DeserializeOwned, Serialize};

fn body<T: Serialize>(m: &T) -> Vec<u8> {
    codec::encode(m).unwrap()[4..].to_vec()
}

/// Decodes; what is accepted re-encodes to bytes that decode to the same encoding.
fn decodes_soundly<T: Serialize + DeserializeOwned>(b: &[u8]) -> Option<T> {
    let m: T = codec::decode(b).ok()?;
    let once = body(&m);
    let back: T = codec::decode(&once).expect("its encoding decodes");
    assert_eq!(body(&back), once);
    Some(m)
}

fn log_id(term: u64, index: u64) -> LogId<u64> {
    LogId::new(CommittedLeaderId::new(term, 1), index)
}

fn corpus() -> Vec<(&'static str, Vec<u8>)> {
    let entry = |i: u64, c: Command| Entry::<TypeConfig> {
        log_id: log_id(3, i),
        payload: EntryPayload::Normal(c),
    };
    let entries = vec![
        entry(
            5,
            Command::Register {
                addr: "10.0.0.1:7000".into(),
                host: "h1".into(),
                quic: Some("10.0.0.1:7001".into()),
                shm: None,
                rank_hint: Some(0),
                token: [9; 32],
            },
        ),
        entry(
            6,
            Command::CommitEpoch {
                expected_epoch: 1,
                admit: vec![PeerId(1), PeerId(2)],
                remove: vec![PeerId(3)],
            },
        ),
        entry(
            7,
            Command::Evict {
                peer: PeerId(2),
                reason: "lease".into(),
            },
        ),
        entry(8, Command::Leave { peer: PeerId(1) }),
        entry(
            9,
            Command::StateRevision {
                epoch: 2,
                inputs: vec![(PeerId(1), 4, [2; 32])],
                revision: 3,
                hash: [1; 32],
                plan: eccl_protocol::MasterReply::SyncPlan {
                    revision: 3,
                    target: Vec::new(),
                    sources: vec![PeerId(1)],
                    receivers: vec![PeerId(2)],
                },
            },
        ),
        Entry {
            log_id: log_id(3, 10),
            payload: EntryPayload::Blank,
        },
    ];
    let append = RaftRpc::AppendEntries(AppendEntriesRequest {
        vote: Vote::new_committed(3, 1),
        prev_log_id: Some(log_id(2, 4)),
        entries,
        leader_commit: Some(log_id(3, 6)),
    });
    let vote = RaftRpc::Vote(VoteRequest::new(Vote::new(4, 2), Some(log_id(3, 9))));
    vec![
        ("hello", body(&RaftHello { from: 2 })),
        ("rpc", body(&append)),
        ("rpc", body(&vote)),
        (
            "reply",
            body(&RaftRpcReply::AppendEntries(Ok(
                AppendEntriesResponse::Success,
            ))),
        ),
        (
            "reply",
            body(&RaftRpcReply::Vote(Ok(VoteResponse::new(
                Vote::new(4, 2),
                Some(log_id(3, 9)),
                true,
            )))),
        ),
    ]
}

fn decode_as(kind: &str, b: &[u8]) {
    match kind {
        "hello" => {
            decodes_soundly::<RaftHello>(b);
        }
        "rpc" => {
            if let Some(rpc) = decodes_soundly::<RaftRpc>(b) {
                let _ = rpc.refuse(1);
            }
        }
        "reply" => {
            decodes_soundly::<RaftRpcReply>(b);
        }
        _ => unreachable!("corpus kinds are listed above"),
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn raft_messages_from_random_bytes(b in prop::collection::vec(any::<u8>(), 0..512)) {
        for kind in ["hello", "rpc", "reply"] {
            decode_as(kind, &b);
        }
    }

    #[test]
    fn raft_messages_mutated(which in any::<prop::sample::Index>(), ms in prop::collection::vec(mutation(), 1..6)) {
        let corpus = corpus();
        let (kind, b) = &corpus[which.index(corpus.len())];
        decode_as(kind, &apply(b.clone(), &ms));
    }

    /// Terms that no real cluster reaches, or log ids newer than the sender's own term,
    /// are refused whatever else the request says.
    #[test]
    fn absurd_terms_are_refused(term in TERM_LIMIT..=u64::MAX, ok_term in 1u64..1000, later in 1u64..1000) {
        let vote = RaftRpc::Vote(VoteRequest::new(Vote::new(term, 1), None));
        prop_assert!(vote.refuse(1).is_some());
        let ahead = RaftRpc::Vote(VoteRequest::new(Vote::new(ok_term, 1), Some(log_id(ok_term + later, 1))));
        prop_assert!(ahead.refuse(1).is_some());
        let fine = RaftRpc::Vote(VoteRequest::new(Vote::new(ok_term, 1), Some(log_id(ok_term, 1))));
        prop_assert!(fine.refuse(1).is_none());
        prop_assert!(fine.refuse(2).is_some(), "in another master's name");
    }
}

#[test]
fn the_corpus_is_valid_and_acceptable() {
    for (kind, b) in corpus() {
        match kind {
            "hello" => assert!(decodes_soundly::<RaftHello>(&b).is_some()),
            "rpc" => {
                let rpc = decodes_soundly::<RaftRpc>(&b).expect("decodes");
                let from = match &rpc {
                    RaftRpc::Vote(_) => 2,
                    _ => 1,
                };
                assert_eq!(rpc.refuse(from), None, "{rpc:?}");
            }
            _ => assert!(decodes_soundly::<RaftRpcReply>(&b).is_some()),
        }
    }
}
