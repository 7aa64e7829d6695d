//! The store as job members drive it: any sequence of opens, closes and writes (what
//! store requests become once the leader accepts them), in any scopes and jobs, with
//! values around the 1 MiB bound. After every step the store's byte counts are exact and
//! within every bound (per scope, per job, in all; sessions), and the leader's precheck
//! agrees with what applying the write does: a write it lets through is never refused,
//! and one it refuses would have been.
#![no_main]

use eccl_master::store::{Store, StoreCommand};
use eccl_protocol::StoreWrite;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Op {
    Open { job: Option<u8>, scope: u8 },
    Close { session: u8 },
    Write { session: u8, seq: u8, write: Write },
}

#[derive(Arbitrary, Debug)]
enum Write {
    Set { key: u8, len: u16, ephemeral: bool },
    MultiSet { pairs: Vec<(u8, u16)> },
    Add { key: u8, delta: i64 },
    Append { key: u8, len: u16 },
    CompareSet { key: u8, expected: u16, desired: u16 },
    Delete { key: u8 },
}

/// A key of one to a few bytes; `k == 255` is a long key, past the bound.
fn key(k: u8) -> Vec<u8> {
    if k == 255 {
        vec![b'k'; 4097]
    } else {
        vec![b'a' + k % 8; 1 + (k / 8) as usize % 4]
    }
}

/// A value of `len * 17` bytes: up to about 1.06 MiB, across the 1 MiB bound.
fn value(len: u16) -> Vec<u8> {
    vec![len as u8; len as usize * 17]
}

fn write(w: Write) -> StoreWrite {
    match w {
        Write::Set { key: k, len, ephemeral } => StoreWrite::Set {
            key: key(k),
            value: value(len),
            ephemeral,
        },
        Write::MultiSet { pairs } => StoreWrite::MultiSet {
            pairs: pairs.into_iter().map(|(k, l)| (key(k), value(l))).collect(),
        },
        Write::Add { key: k, delta } => StoreWrite::Add { key: key(k), delta },
        Write::Append { key: k, len } => StoreWrite::Append {
            key: key(k),
            value: value(len),
        },
        Write::CompareSet {
            key: k,
            expected,
            desired,
        } => StoreWrite::CompareSet {
            key: key(k),
            expected: if expected == 0 { Vec::new() } else { value(expected) },
            desired: value(desired),
        },
        Write::Delete { key: k } => StoreWrite::Delete { key: key(k) },
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let mut store = Store::default();
    for op in ops.into_iter().take(256) {
        let cmd = match op {
            Op::Open { job, scope } => StoreCommand::Open {
                scope: match job {
                    Some(j) => format!("job{}#s{}", j % 3, scope % 4),
                    None => format!("s{}", scope % 4),
                },
                token: [1; 32],
            },
            Op::Close { session } => StoreCommand::Close {
                session: session as u64 % 16,
                reason: "fuzz".into(),
            },
            Op::Write {
                session,
                seq,
                write: w,
            } => {
                let (session, seq, op) = (session as u64 % 16, seq as u64, write(w));
                let allowed = store.precheck(session, seq, &op);
                let applied = store.apply(&StoreCommand::Write { session, seq, op });
                assert_eq!(
                    allowed.is_ok(),
                    applied.is_ok(),
                    "precheck {allowed:?}, apply {applied:?}"
                );
                store.check_bounds().unwrap();
                continue;
            }
        };
        let _ = store.apply(&cmd);
        store.check_bounds().unwrap();
    }
});
