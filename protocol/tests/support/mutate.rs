//! Inputs for the fuzz tests (protocol's and master's, which include this file): valid
//! encodings changed by a few random mutations, and the case count.

#![allow(dead_code)]

use proptest::prelude::*;

pub fn cases() -> u32 {
    std::env::var("ECCL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

pub fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        ..ProptestConfig::default()
    }
}

/// One change to an input.
#[derive(Clone, Debug)]
pub enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Cut(usize),
    Insert(usize, Vec<u8>),
    Splice(usize, usize, Vec<u8>),
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        any::<usize>().prop_map(Mutation::Cut),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        // Large lengths and counts: 0xff runs read as huge varints.
        (
            any::<usize>(),
            1usize..12,
            prop::collection::vec(prop_oneof![Just(0xffu8), Just(0xfd), any::<u8>()], 1..12)
        )
            .prop_map(|(i, n, v)| Mutation::Splice(i, n, v)),
    ]
}

pub fn apply(mut b: Vec<u8>, ms: &[Mutation]) -> Vec<u8> {
    for m in ms {
        let n = b.len().max(1);
        match m {
            Mutation::Flip(i, bit) if !b.is_empty() => b[i % n] ^= 1 << bit,
            Mutation::Set(i, v) if !b.is_empty() => b[i % n] = *v,
            Mutation::Cut(i) => b.truncate(i % (b.len() + 1)),
            Mutation::Insert(i, v) => {
                let at = i % (b.len() + 1);
                b.splice(at..at, v.iter().copied());
            }
            Mutation::Splice(i, len, v) => {
                let at = i % (b.len() + 1);
                let end = (at + len).min(b.len());
                b.splice(at..end, v.iter().copied());
            }
            _ => {}
        }
    }
    b
}
