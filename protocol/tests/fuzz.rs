//! Fuzzing every decoder that takes bytes from the network: the frame header, the
//! handshake messages, every control message, the sealed box. Two kinds of input per
//! decoder: random bytes, and valid encodings mutated (bits flipped, bytes overwritten,
//! cut short, spliced). A decoder must never panic or allocate without bound; what it
//! accepts must encode back to something it accepts as the same value.
//!
//! Cases per property: `ECCL_FUZZ_CASES` (default 2000, what CI runs). Failing inputs are
//! written to `protocol/tests/fuzz.proptest-regressions` and replayed first on every run:
//! commit that file with the fix.

use std::fmt::Debug;

use eccl_protocol::auth::{ClientAuth, LinkKeys, ServerHello, CLIENT_AUTH_LEN, SERVER_HELLO_LEN};
use eccl_protocol::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use eccl_protocol::*;
use proptest::prelude::*;
use serde::{de::DeserializeOwned, Serialize};

#[path = "support/mutate.rs"]
mod mutate;

use mutate::{apply, config, mutation};

/// Decodes `body` as a `T`; if accepted, the value must survive a round trip.
fn decodes_soundly<T>(body: &[u8])
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    if let Ok(m) = codec::decode::<T>(body) {
        let again = codec::encode(&m).expect("an accepted message encodes");
        let back: T = codec::decode(&again[4..]).expect("its encoding decodes");
        assert_eq!(back, m);
    }
}

fn digest(name: &str, chunks: usize) -> TensorDigest {
    TensorDigest {
        name: name.into(),
        len: (chunks * STATE_CHUNK) as u64,
        hash: [7; 32],
        chunks: vec![[9; 32]; chunks],
    }
}

fn world(n: u32) -> World {
    World {
        epoch: 5,
        members: (0..n)
            .map(|r| Member {
                peer_id: PeerId(100 + r as u64),
                rank: Rank(r),
                addr: format!("10.0.0.{r}:4000"),
                host: format!("host-{}", r / 2),
                quic: (r % 2 == 0).then(|| format!("10.0.0.{r}:4001")),
                shm: Some(format!("eccl-{r}")),
            })
            .collect(),
        ring: (0..n).rev().collect(),
        stripes: if n >= 2 {
            vec![(PeerId(100), PeerId(101), 4)]
        } else {
            vec![]
        },
        tuned: match n >= 3 {
            true => vec![Tuned {
                kind: CollectiveKind::AllToAll,
                up_to: u64::MAX,
                algo: Algo::Ring,
            }],
            false => vec![],
        },
    }
}

/// A valid encoding (without its length prefix) of every control message variant.
fn corpus() -> Vec<(&'static str, Vec<u8>)> {
    let body = |m: &dyn erased::Enc| m.enc();
    let reg = RegisterRequest {
        listen_port: 4000,
        quic_port: Some(4001),
        shm_name: Some("eccl-1-2".into()),
        advertise_host: Some("10.0.0.1".into()),
        host: "node-a:boot:ns".into(),
        rank_hint: Some(3),
        protocol_version: PROTOCOL_VERSION,
    };
    let p = PeerId(7);
    let requests = vec![
        PeerRequest::Register(reg.clone()),
        PeerRequest::UpdateTopology {
            peer_id: p,
            epoch: 3,
            min_world: 2,
            aborted: true,
            fresh: vec![PeerId(2)],
        },
        PeerRequest::ArePeersPending {
            peer_id: p,
            epoch: 3,
        },
        PeerRequest::Heartbeat { peer_id: p },
        PeerRequest::Attach {
            peer_id: p,
            token: [8; 32],
        },
        PeerRequest::ReportFault {
            peer_id: p,
            epoch: 3,
            suspect: Some(PeerId(9)),
            reason: "link failed".into(),
        },
        PeerRequest::Leave { peer_id: p },
        PeerRequest::SyncState {
            peer_id: p,
            epoch: 3,
            round: 2,
            revision: 1,
            strategy: SyncStrategy::ReceiveOnly,
            tensors: vec![digest("w", 3), digest("b", 0)],
        },
        PeerRequest::ClusterStatus,
        PeerRequest::ClusterChange {
            change: eccl_protocol::ClusterChange::Add {
                id: 4,
                client: "10.0.0.4:48148".into(),
                raft: "10.0.0.4:48149".into(),
            },
            membership: 5,
            proof: [7; 32],
        },
        PeerRequest::ClusterChange {
            change: eccl_protocol::ClusterChange::Remove { id: 2 },
            membership: 9,
            proof: [8; 32],
        },
        PeerRequest::Store(StoreRequest::Open {
            scope: "job-1".into(),
        }),
        PeerRequest::Store(StoreRequest::Attach {
            session: 3,
            token: [9; 32],
        }),
        PeerRequest::Store(StoreRequest::Write {
            seq: 4,
            op: StoreWrite::CompareSet {
                key: b"k".to_vec(),
                expected: vec![],
                desired: b"v".to_vec(),
            },
        }),
        PeerRequest::Store(StoreRequest::Write {
            seq: 5,
            op: StoreWrite::MultiSet {
                pairs: vec![(b"a".to_vec(), b"1".to_vec())],
            },
        }),
        PeerRequest::Store(StoreRequest::Wait {
            keys: vec![b"a".to_vec(), b"b".to_vec()],
            timeout_ms: 100,
        }),
        PeerRequest::Topology {
            peer_id: p,
            epoch: 3,
            links: vec![LinkMeasure {
                to: PeerId(9),
                bytes_per_s: 1 << 30,
                latency_ns: 50_000,
                streams: 4,
            }],
        },
    ];
    let keys = LinkKeys {
        accept: [3; 32],
        dial: vec![(PeerId(9), [4; 32]), (PeerId(11), [5; 32])],
    };
    let replies = vec![
        MasterReply::Registered {
            peer_id: p,
            lease_ms: 2000,
            heartbeat_ms: 250,
            token: [6; 32],
        },
        MasterReply::World {
            world: world(4).into(),
            keys,
            changed: true,
            reuse_links: false,
            renew: vec![PeerId(3)],
        },
        MasterReply::Unchanged { epoch: 9 },
        MasterReply::PeersPending(true),
        MasterReply::SyncPlan {
            revision: 2,
            target: vec![digest("w", 2)],
            sources: vec![PeerId(1), PeerId(2)],
            receivers: vec![PeerId(3)],
        },
        MasterReply::Ok,
        MasterReply::Error {
            code: ErrorCode::Aborted,
            message: "epoch 3 aborted".into(),
        },
        MasterReply::NotLeader {
            leader: Some("10.0.0.2:7000".into()),
        },
        MasterReply::Cluster(eccl_protocol::ClusterStatus {
            me: 1,
            leader: Some(2),
            term: 5,
            membership: 12,
            members: vec![eccl_protocol::MasterInfo {
                id: 2,
                client: "10.0.0.2:48148".into(),
                raft: "10.0.0.2:48149".into(),
                voter: true,
            }],
            peers: 3,
            epoch: 7,
        }),
        MasterReply::Store(StoreReply::Values(vec![Some(b"x".to_vec()), None])),
        MasterReply::Store(StoreReply::Session {
            session: 1,
            token: [2; 32],
            lease_ms: 800,
        }),
    ];
    let mut out = Vec::new();
    for (i, r) in requests.into_iter().enumerate() {
        out.push((
            "request",
            body(&Request {
                id: i as u64,
                body: r,
            }),
        ));
    }
    for (i, r) in replies.into_iter().enumerate() {
        out.push((
            "message",
            body(&MasterMessage::Reply {
                id: i as u64,
                body: r,
            }),
        ));
    }
    out.push((
        "message",
        body(&MasterMessage::Event(MasterEvent::AbortEpoch {
            epoch: 3,
            cause: "rank 2 evicted".into(),
            evicted: Some(PeerId(4)),
        })),
    ));
    out.push((
        "message",
        body(&MasterMessage::Event(MasterEvent::Evicted {
            reason: "lease".into(),
        })),
    ));
    out.push((
        "hello",
        body(&LinkHello {
            from: PeerId(1),
            to: PeerId(2),
            epoch: 9,
            stream: 1,
            nstreams: 4,
            proof: [6; 32],
        }),
    ));
    out.push(("register", body(&reg)));
    out.push(("world", body(&world(3))));
    out.push((
        "verbs",
        body(&VerbsHello {
            qp_num: 0x11,
            lid: 0,
            gid: Some([0xfe; 16]),
            recv_slots: 64,
            slot_bytes: 1 << 20,
        }),
    ));
    out
}

/// Object-safe encoding for the corpus above.
mod erased {
    pub trait Enc {
        fn enc(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Enc for T {
        fn enc(&self) -> Vec<u8> {
            eccl_protocol::codec::encode(self).unwrap()[4..].to_vec()
        }
    }
}

/// Every decoder a control-message body can reach, by the corpus entry's kind.
fn decode_as(kind: &str, b: &[u8]) {
    match kind {
        "request" => decodes_soundly::<Request>(b),
        "message" => {
            decodes_soundly::<MasterMessage>(b);
            if let Ok(MasterMessage::Reply {
                body: MasterReply::World { world, .. },
                ..
            }) = codec::decode(b)
            {
                let _ = world.validate();
            }
        }
        "hello" => decodes_soundly::<LinkHello>(b),
        "register" => decodes_soundly::<RegisterRequest>(b),
        "verbs" => {
            decodes_soundly::<VerbsHello>(b);
            if let Ok(h) = codec::decode::<VerbsHello>(b) {
                if h.validate().is_ok() {
                    assert!(h.qp_num >= 2 && h.qp_num < 1 << 24 && h.recv_slots > 0);
                }
            }
        }
        "world" => {
            decodes_soundly::<World>(b);
            if let Ok(w) = codec::decode::<World>(b) {
                if w.validate().is_ok() {
                    for m in &w.members {
                        assert_eq!(w.member(m.rank).map(|x| x.peer_id), Some(m.peer_id));
                    }
                }
            }
        }
        _ => unreachable!("corpus kinds are listed above"),
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn frame_headers_from_random_bytes(b in prop::array::uniform32(any::<u8>()), c in prop::array::uniform32(any::<u8>()), kind in 0u8..10, magic in any::<bool>()) {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[..32].copy_from_slice(&b);
        h[32..].copy_from_slice(&c);
        if magic {
            h[..4].copy_from_slice(b"ECF1");
            h[4] = kind;
        }
        if let Ok(f) = FrameHeader::decode(&h) {
            prop_assert!(f.len as usize <= MAX_FRAME_PAYLOAD);
            prop_assert_eq!(FrameHeader::decode(&f.encode()), Ok(f));
        }
    }

    #[test]
    fn frame_headers_mutated(seq in any::<u64>(), len in 0u32..=(MAX_FRAME_PAYLOAD as u32), offset in any::<u64>(), ms in prop::collection::vec(mutation(), 1..4)) {
        let h = FrameHeader {
            kind: FrameKind::Data,
            epoch: 2,
            seq,
            index: 3,
            len,
            desc: Descriptor {
                kind: CollectiveKind::AllReduce,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                algo: Algo::Ring,
                root: 0,
                count: 1 << 20,
            },
            offset,
            tag: 0,
        };
        let b = apply(h.encode().to_vec(), &ms);
        if let Ok(arr) = <[u8; FRAME_HEADER_LEN]>::try_from(b.as_slice()) {
            if let Ok(f) = FrameHeader::decode(&arr) {
                prop_assert_eq!(FrameHeader::decode(&f.encode()), Ok(f));
            }
        }
    }

    #[test]
    fn handshake_messages(b in prop::collection::vec(any::<u8>(), CLIENT_AUTH_LEN), magic in any::<bool>()) {
        let mut b = b;
        if magic {
            b[..8].copy_from_slice(b"ECCLAUTH");
        }
        let sh: [u8; SERVER_HELLO_LEN] = b[..SERVER_HELLO_LEN].try_into().unwrap();
        if let Ok(m) = ServerHello::decode(&sh) {
            prop_assert_eq!(ServerHello::decode(&m.encode()).ok().map(|x| x.nonce), Some(m.nonce));
        }
        let ca: [u8; CLIENT_AUTH_LEN] = b[..].try_into().unwrap();
        if let Ok(m) = ClientAuth::decode(&ca) {
            prop_assert_eq!(ClientAuth::decode(&m.encode()).ok().map(|x| x.nonce), Some(m.nonce));
        }
    }

    #[test]
    fn control_messages_from_random_bytes(b in prop::collection::vec(any::<u8>(), 0..512)) {
        for kind in ["request", "message", "hello", "register", "world"] {
            decode_as(kind, &b);
        }
        let _ = codec::check_len(b.get(..4).and_then(|p| p.try_into().ok()).unwrap_or([0; 4]));
    }

    #[test]
    fn control_messages_mutated(which in any::<prop::sample::Index>(), ms in prop::collection::vec(mutation(), 1..6)) {
        let corpus = corpus();
        let (kind, body) = &corpus[which.index(corpus.len())];
        decode_as(kind, &apply(body.clone(), &ms));
    }

    #[test]
    fn sealed_boxes(ms in prop::collection::vec(mutation(), 1..4), garbage in prop::collection::vec(any::<u8>(), 0..128)) {
        let mut k = seal::OpenKey::generate().unwrap();
        let sealed = seal::seal(&k.public(), b"secret", b"ctx").unwrap();
        let bad = apply(sealed.clone(), &ms);
        if bad != sealed {
            prop_assert!(k.open(&bad, b"ctx").is_err());
        }
        let mut k = seal::OpenKey::generate().unwrap();
        prop_assert!(k.open(&garbage, b"ctx").is_err());
        let _ = seal::seal(&garbage, b"x", b"ctx");
    }
}

/// The mutated corpus starts valid: every entry decodes as its kind.
#[test]
fn the_corpus_is_valid() {
    for (kind, body) in corpus() {
        let ok = match kind {
            "request" => codec::decode::<Request>(&body).is_ok(),
            "message" => codec::decode::<MasterMessage>(&body).is_ok(),
            "hello" => codec::decode::<LinkHello>(&body).is_ok(),
            "register" => codec::decode::<RegisterRequest>(&body).is_ok(),
            "world" => codec::decode::<World>(&body).is_ok_and(|w| w.validate().is_ok()),
            "verbs" => codec::decode::<VerbsHello>(&body).is_ok_and(|h| h.validate().is_ok()),
            _ => false,
        };
        assert!(ok, "{kind} entry does not decode");
    }
}

/// A verbs hello that would misconfigure a queue pair is refused with its reason.
#[test]
fn verbs_hellos_out_of_range_are_refused() {
    let good = VerbsHello {
        qp_num: 0x123,
        lid: 7,
        gid: None,
        recv_slots: 16,
        slot_bytes: 1 << 16,
    };
    assert_eq!(good.validate(), Ok(()));
    let bad = [
        (
            VerbsHello {
                qp_num: 1,
                ..good.clone()
            },
            "queue pair number",
        ),
        (
            VerbsHello {
                qp_num: 1 << 24,
                ..good.clone()
            },
            "queue pair number",
        ),
        (
            VerbsHello {
                lid: 0,
                ..good.clone()
            },
            "neither a LID nor a GID",
        ),
        (
            VerbsHello {
                recv_slots: 0,
                ..good.clone()
            },
            "receive slots",
        ),
        (
            VerbsHello {
                recv_slots: VerbsHello::MAX_SLOTS + 1,
                ..good.clone()
            },
            "receive slots",
        ),
        (
            VerbsHello {
                slot_bytes: 8,
                ..good.clone()
            },
            "bytes per slot",
        ),
        (
            VerbsHello {
                slot_bytes: u32::MAX,
                ..good.clone()
            },
            "bytes per slot",
        ),
    ];
    for (h, why) in bad {
        let e = h.validate().unwrap_err();
        assert!(e.contains(why), "{h:?}: {e}");
    }
}
