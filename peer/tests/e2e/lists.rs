//! Collectives on lists of buffers (`Communicator::collective_lists`,
//! `all_to_all_v_lists`: torch's list forms, one buffer per rank) over a real world:
//! each kind gives the bits of the same call on one buffer, whether the lists are cut
//! one buffer per rank (read and written where they lie) or anyhow (one packed copy),
//! with every algorithm of the kind; a rank that dies mid-call fails the others
//! promptly (their lists were written in place) and the world goes on.

use std::time::{Duration, Instant};

use crate::common::*;
use eccl::{Algo, CollArgs, CollectiveKind, Communicator, DType, Error, Rank, ReduceOp};
use futures::future::join_all;

const N: usize = 3;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Rank `r`'s input for a call of `len` elements: every element names its rank and place.
fn input(r: usize, len: usize) -> Vec<u8> {
    f32_bytes(
        &(0..len)
            .map(|i| (r * 1_000_000 + i % 999_983) as f32)
            .collect::<Vec<_>>(),
    )
}

/// Cuts `buf` into pieces of the byte lengths `cuts` (the last takes the rest).
fn cut(buf: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0;
    for &n in cuts {
        out.push(buf[at..at + n].to_vec());
        at += n;
    }
    out.push(buf[at..].to_vec());
    out
}

/// How a side of a call is cut into a list: one buffer per rank, or at odd places.
#[derive(Clone, Copy, Debug)]
enum Cut {
    PerRank,
    Odd,
}

impl Cut {
    fn cuts(self, bytes: usize) -> Vec<usize> {
        match self {
            Cut::PerRank if bytes > 0 => vec![bytes / N; N - 1],
            Cut::PerRank => vec![],
            // Three pieces that cross the ranks' blocks (4-byte aligned or not).
            Cut::Odd => vec![bytes / 5, bytes / 3 + 1]
                .into_iter()
                .filter(|&n| n <= bytes / 2)
                .collect(),
        }
    }
}

/// Runs `kind` (count elements in NCCL's convention) on every rank twice: on one buffer
/// a side, then with both sides as lists cut by `how`; both give the same bytes.
async fn same_as_one_buffer(
    comms: &mut [Communicator],
    kind: CollectiveKind,
    count: usize,
    how: Cut,
) {
    let root = 1u32;
    let lens = |r: usize| eccl_algorithms::buffer_lens(kind, count, N as u32, r as u32, root);
    let args = CollArgs {
        kind,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: Rank(root),
        count,
    };
    let whole = join_all(comms.iter_mut().enumerate().map(|(r, c)| async move {
        let (i, o) = lens(r);
        let inp = input(r, i);
        let mut out = vec![0u8; o * 4];
        c.collective(args, &inp, &mut out).await.map(|_| out)
    }))
    .await;
    let lists = join_all(comms.iter_mut().enumerate().map(|(r, c)| async move {
        let (i, o) = lens(r);
        let inp = input(r, i);
        let ins = if i == 0 {
            vec![]
        } else {
            cut(&inp, &how.cuts(i * 4))
        };
        let mut outs = if o == 0 {
            vec![]
        } else {
            cut(&vec![0xEEu8; o * 4], &how.cuts(o * 4))
        };
        let in_refs: Vec<&[u8]> = ins.iter().map(|b| &b[..]).collect();
        let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|b| &mut b[..]).collect();
        c.collective_lists(args, &in_refs, &mut out_refs).await?;
        Ok::<_, Error>(outs.concat())
    }))
    .await;
    for (r, (a, b)) in whole.into_iter().zip(lists).enumerate() {
        let a = a.unwrap_or_else(|e| panic!("{kind} rank {r}, one buffer: {e}"));
        let b = b.unwrap_or_else(|e| panic!("{kind} rank {r}, lists cut {how:?}: {e}"));
        assert!(
            a == b,
            "{kind} rank {r}, lists cut {how:?}: the bytes differ"
        );
    }
}

const KINDS: [CollectiveKind; 5] = [
    CollectiveKind::AllGather,
    CollectiveKind::ReduceScatter,
    CollectiveKind::AllToAll,
    CollectiveKind::Gather,
    CollectiveKind::Scatter,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_give_the_bits_of_one_buffer_with_every_algorithm() {
    let m = start_master(&[]);
    // The tuner's choice, then each algorithm forced (all_to_all's ring relays several
    // ranks' blocks in one message: its lists go through the packed copy).
    for algo in [None, Some(Algo::Ring), Some(Algo::Direct)] {
        let mut comms = world_with(&m.addr, N as u32, |c| c.algo = algo).await;
        for kind in KINDS {
            if algo.is_some_and(|a| !eccl_algorithms::available_algos(kind).contains(&a)) {
                continue;
            }
            // Larger than a frame and a link's buffers; a few elements; none.
            for count in [(1 << 20) + 7, 5, 0] {
                for how in [Cut::PerRank, Cut::Odd] {
                    same_as_one_buffer(&mut comms, kind, count, how).await;
                }
            }
        }
        for c in comms {
            c.leave().await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_with_split_sizes_on_lists_of_each_blocks_size() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, N as u32).await;
    let size = |s: usize, t: usize| [[0, 3 << 20, 1], [(1 << 20) + 3, 7, 0], [2, 0, 2 << 20]][s][t];
    let res = join_all(comms.iter_mut().enumerate().map(|(r, c)| async move {
        let sends: Vec<usize> = (0..N).map(|t| size(r, t)).collect();
        let recvs: Vec<usize> = (0..N).map(|s| size(s, r)).collect();
        let inp = input(r, sends.iter().sum());
        let ins = cut(
            &inp,
            &sends[..N - 1].iter().map(|n| n * 4).collect::<Vec<_>>(),
        );
        let mut outs: Vec<Vec<u8>> = recvs.iter().map(|n| vec![0u8; n * 4]).collect();
        let in_refs: Vec<&[u8]> = ins.iter().map(|b| &b[..]).collect();
        let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|b| &mut b[..]).collect();
        c.all_to_all_v_lists(DType::F32, &in_refs, &sends, &mut out_refs, &recvs)
            .await
            .map(|_| outs)
    }))
    .await;
    for (t, outs) in res.into_iter().enumerate() {
        let outs = outs.unwrap_or_else(|e| panic!("rank {t}: {e}"));
        for (s, got) in outs.iter().enumerate() {
            let from: usize = (0..t).map(|u| size(s, u)).sum();
            let all: usize = (0..N).map(|u| size(s, u)).sum();
            let want = &input(s, all)[from * 4..(from + size(s, t)) * 4];
            assert!(
                got[..] == *want,
                "rank {t}: the block from rank {s} differs"
            );
        }
    }
    for c in comms {
        c.leave().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_dies_during_a_list_all_gather_fails_the_others_promptly() {
    let m = start_master(&[]);
    let comms = world(&m.addr, N as u32).await;
    let count = 4 << 20;
    let args = CollArgs {
        kind: CollectiveKind::AllGather,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        root: Rank(0),
        count,
    };
    let t = Instant::now();
    let res = join_all(comms.into_iter().enumerate().map(|(r, mut c)| async move {
        if r == 2 {
            // As a process that dies mid-call: its links just close.
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(c);
            return None;
        }
        let inp = input(r, count);
        let mut outs = vec![vec![0u8; count * 4]; N];
        let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|b| &mut b[..]).collect();
        let res = c.collective_lists(args, &[&inp], &mut out_refs).await;
        // Where the call wrote (an output is undefined after a failure): the schedule's
        // first step copies this rank's input into its own block, so a list written in
        // place holds it, where a packed copy would have left every block untouched.
        let own_block_written = outs[r] == inp;
        Some((c, res, own_block_written))
    }))
    .await;
    let mut survivors = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        match x {
            None => assert_eq!(r, 2),
            Some((c, Err(Error::Aborted { .. } | Error::Timeout { .. }), written)) => {
                assert!(written, "rank {r}: the list was not written in place");
                survivors.push(c)
            }
            Some((_, other, _)) => panic!("rank {r}: {:?}", other.map(|_| "succeeded")),
        }
    }
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t.elapsed()
    );
    for s in join_all(survivors.iter_mut().map(|c| c.update_topology())).await {
        s.expect("recover");
    }
    // The two go on, with lists (typed: one slice of f32 per rank).
    let res = join_all(survivors.iter_mut().enumerate().map(|(r, c)| async move {
        let inp = vec![r as f32 + 0.5; 1000];
        let (mut a, mut b) = (vec![0f32; 1000], vec![0f32; 1000]);
        c.typed_lists(
            CollectiveKind::AllGather,
            ReduceOp::Sum,
            Rank(0),
            &[&inp],
            &mut [&mut a, &mut b],
        )
        .await
        .map(|_| (a, b))
    }))
    .await;
    for x in res {
        let (a, b) = x.expect("after recovery");
        assert!(a == vec![0.5; 1000] && b == vec![1.5; 1000]);
    }
    for c in survivors {
        c.leave().await.unwrap();
    }
}
