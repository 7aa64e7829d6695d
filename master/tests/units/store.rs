//! Unit tests of `eccl_master::store`.

use eccl_master::store::*;
use eccl_protocol::{StoreLimits, StoreReply, StoreWrite};

fn open(s: &mut Store, scope: &str) -> u64 {
    match s.apply(&StoreCommand::Open {
        scope: scope.into(),
        token: [1; 32],
    }) {
        Ok(StoreReply::Session { session, .. }) => session,
        o => panic!("{o:?}"),
    }
}

fn write(s: &mut Store, session: u64, seq: u64, op: StoreWrite) -> Result<StoreReply, String> {
    s.apply(&StoreCommand::Write { session, seq, op })
}

fn set(key: &str, value: &str) -> StoreWrite {
    StoreWrite::Set {
        key: key.into(),
        value: value.into(),
        ephemeral: false,
    }
}

#[test]
fn torch_semantics_of_add_and_compare_set() {
    let mut s = Store::default();
    let a = open(&mut s, "job");
    let add = |d| StoreWrite::Add {
        key: b"n".to_vec(),
        delta: d,
    };
    assert_eq!(write(&mut s, a, 1, add(3)), Ok(StoreReply::Int(3)));
    assert_eq!(write(&mut s, a, 2, add(-5)), Ok(StoreReply::Int(-2)));
    // A write sent again after a fail-over is answered, not applied again.
    assert_eq!(write(&mut s, a, 2, add(-5)), Ok(StoreReply::Int(-2)));
    assert_eq!(s.scope("job").unwrap().get(b"n"), Some(&b"-2"[..]));
    let cas = |e: &str, d: &str| StoreWrite::CompareSet {
        key: b"c".to_vec(),
        expected: e.into(),
        desired: d.into(),
    };
    // Absent and a non-empty expectation: the expectation comes back, nothing set.
    assert_eq!(
        write(&mut s, a, 3, cas("x", "y")),
        Ok(StoreReply::Value(b"x".to_vec()))
    );
    assert_eq!(s.scope("job").unwrap().get(b"c"), None);
    assert_eq!(
        write(&mut s, a, 4, cas("", "v1")),
        Ok(StoreReply::Value(b"v1".to_vec()))
    );
    assert_eq!(
        write(&mut s, a, 5, cas("nope", "v2")),
        Ok(StoreReply::Value(b"v1".to_vec()))
    );
    assert_eq!(
        write(&mut s, a, 6, cas("v1", "v2")),
        Ok(StoreReply::Value(b"v2".to_vec()))
    );
    write(&mut s, a, 7, set("t", "text")).unwrap();
    let e = write(
        &mut s,
        a,
        8,
        StoreWrite::Add {
            key: b"t".to_vec(),
            delta: 1,
        },
    )
    .unwrap_err();
    assert!(e.contains("not an integer"), "{e}");
}

/// A session's memory of its writes holds no values: 64 compare-and-sets with 1 MiB
/// expectations on a missing key (which change nothing and take no store space) once
/// made every master hold 64 MiB per session, snapshots included.
#[test]
fn remembered_writes_hold_no_values() {
    let mut s = Store::default();
    let a = open(&mut s, "job");
    let big = vec![7u8; StoreLimits::MAX_VALUE];
    for seq in 1..=64 {
        let op = StoreWrite::CompareSet {
            key: b"absent".to_vec(),
            expected: big.clone(),
            desired: b"x".to_vec(),
        };
        assert_eq!(
            write(&mut s, a, seq, op),
            Ok(StoreReply::Value(big.clone()))
        );
    }
    // Sets of 1 MiB values, resent: answered from memory, not applied twice.
    for seq in 65..=80 {
        let op = StoreWrite::CompareSet {
            key: format!("k{seq}").into_bytes(),
            expected: vec![],
            desired: big.clone(),
        };
        assert_eq!(
            write(&mut s, a, seq, op.clone()),
            Ok(StoreReply::Value(big.clone()))
        );
        assert_eq!(
            write(&mut s, a, seq, op),
            Ok(StoreReply::Value(big.clone()))
        );
    }
    let encoded = bincode::serde::encode_to_vec(&s, bincode::config::standard()).unwrap();
    let values = 16 * (StoreLimits::MAX_VALUE + 4);
    assert!(
        encoded.len() < values + (64 << 10),
        "{} bytes encoded for {values} bytes of values",
        encoded.len()
    );
    // A resend of a write that changed nothing is done again (a compare that now
    // matches sets), as if the first had never arrived.
    let op = StoreWrite::CompareSet {
        key: b"absent".to_vec(),
        expected: vec![],
        desired: b"now".to_vec(),
    };
    assert_eq!(
        write(&mut s, a, 1, op),
        Ok(StoreReply::Value(b"now".to_vec()))
    );
}

#[test]
fn refused_writes_change_nothing() {
    let mut s = Store::default();
    let a = open(&mut s, "job");
    write(&mut s, a, 1, set("k", "v")).unwrap();
    let before = s.clone();
    let big = vec![0u8; StoreLimits::MAX_VALUE + 1];
    for op in [
        StoreWrite::Set {
            key: b"k".to_vec(),
            value: big.clone(),
            ephemeral: false,
        },
        StoreWrite::MultiSet {
            pairs: vec![(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), big)],
        },
        set("", "v"),
    ] {
        assert!(write(&mut s, a, 2, op.clone()).is_err(), "{op:?}");
        let mut after = s.clone();
        // Only the remembered answer differs.
        after.sessions = before.sessions.clone();
        assert_eq!(after, before);
        s = before.clone();
    }
    assert!(s
        .apply(&StoreCommand::Open {
            scope: "bad scope!".into(),
            token: [0; 32]
        })
        .is_err());
}

#[test]
fn ephemeral_keys_and_scopes_end_with_their_sessions() {
    let mut s = Store::default();
    let a = open(&mut s, "job");
    let b = open(&mut s, "job");
    let other = open(&mut s, "other");
    write(
        &mut s,
        a,
        1,
        StoreWrite::Set {
            key: b"agent/a".to_vec(),
            value: b"1".to_vec(),
            ephemeral: true,
        },
    )
    .unwrap();
    write(&mut s, a, 2, set("shared", "x")).unwrap();
    write(&mut s, other, 1, set("shared", "y")).unwrap();
    s.apply(&StoreCommand::Close {
        session: a,
        reason: "lease".into(),
    })
    .unwrap();
    let job = s.scope("job").unwrap();
    assert_eq!(job.get(b"agent/a"), None);
    assert_eq!(job.get(b"shared"), Some(&b"x"[..]));
    assert!(write(&mut s, a, 3, set("k", "v")).is_err());
    // The last session of a scope takes the scope's keys with it; others stay.
    s.apply(&StoreCommand::Close {
        session: b,
        reason: "closed".into(),
    })
    .unwrap();
    assert!(s.scope("job").is_none());
    assert_eq!(s.scope("other").unwrap().get(b"shared"), Some(&b"y"[..]));
}

#[test]
fn the_store_as_a_whole_is_bounded_across_scopes() {
    let mut s = Store::default();
    let value = vec![0u8; StoreLimits::MAX_VALUE];
    let per_scope = (StoreLimits::MAX_SCOPE_BYTES / StoreLimits::MAX_VALUE as u64) - 1;
    let scopes = StoreLimits::MAX_STORE_BYTES / StoreLimits::MAX_SCOPE_BYTES;
    let mut refused = 0;
    for sc in 0..=scopes {
        // Each scope of its own job: a job's scopes together hold no more than a
        // scope's worth (MAX_JOB_BYTES), which is tested below.
        let a = open(&mut s, &job_scope(Some(&format!("j{sc}")), "s"));
        for i in 0..per_scope {
            let op = StoreWrite::Set {
                key: format!("k{i}").into_bytes(),
                value: value.clone(),
                ephemeral: false,
            };
            if write(&mut s, a, i, op).is_err() {
                refused += 1;
            }
        }
    }
    // The last scope finds the store (nearly) full: most of its writes are refused.
    assert!(refused >= per_scope - 4, "{refused}");
    let total = s.bytes();
    assert!(total <= StoreLimits::MAX_STORE_BYTES);
}

/// Store jobs: one job's scopes are apart from every other's (the same name is two
/// scopes), and all of one job's scopes together hold at most MAX_JOB_BYTES, so
/// one job cannot take the store's room from the others.
#[test]
fn jobs_have_scopes_of_their_own_and_a_bound_together() {
    let mut s = Store::default();
    let a = open(&mut s, "rdzv");
    let b = open(&mut s, &job_scope(Some("other"), "rdzv"));
    write(&mut s, a, 1, set("addr", "mine")).unwrap();
    assert_eq!(s.scope_of(b).unwrap().get(b"addr"), None);
    write(&mut s, b, 1, set("addr", "theirs")).unwrap();
    assert_eq!(s.scope_of(a).unwrap().get(b"addr"), Some(&b"mine"[..]));
    let value = vec![0u8; StoreLimits::MAX_VALUE];
    let mut refused = None;
    for i in 0..(MAX_JOB_BYTES / StoreLimits::MAX_VALUE as u64 + 2) {
        // A fresh scope of job "other" for every eight values.
        let sess = open(&mut s, &job_scope(Some("other"), &format!("s{}", i / 8)));
        let op = StoreWrite::Set {
            key: format!("k{i}").into_bytes(),
            value: value.clone(),
            ephemeral: false,
        };
        if let Err(e) = write(&mut s, sess, 1, op) {
            refused = Some(e);
            break;
        }
    }
    let e = refused.expect("the job's bound refused a write");
    assert!(e.contains("at most"), "{e}");
    // The first job still writes.
    let big = StoreWrite::Set {
        key: b"big".to_vec(),
        value,
        ephemeral: false,
    };
    write(&mut s, a, 2, big).unwrap();
    assert!(job_scope(Some("x"), "y").contains('#') && StoreLimits::check_scope("x#y").is_err());
}

#[test]
fn list_returns_a_prefix_in_order() {
    let mut s = Store::default();
    let a = open(&mut s, "job");
    for (seq, k) in ["agent/b", "agent/a", "agents", "b"]
        .into_iter()
        .enumerate()
    {
        write(&mut s, a, seq as u64, set(k, k)).unwrap();
    }
    let keys: Vec<_> = s
        .scope("job")
        .unwrap()
        .list(b"agent/", usize::MAX)
        .unwrap()
        .into_iter()
        .map(|(k, _)| String::from_utf8(k).unwrap())
        .collect();
    assert_eq!(keys, ["agent/a", "agent/b"]);
}
