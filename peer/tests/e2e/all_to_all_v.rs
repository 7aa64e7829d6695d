//! All_to_all with split sizes (`Communicator::all_to_all_v`) over a real world: blocks
//! of any sizes arrive exactly, larger than a link buffers and empty ones alike; a pair
//! whose ends disagree on a block fails at both ends with a mismatch that names the
//! sizes, a call wrong on its own fails its rank with `InvalidArgument` and the others
//! at once, and the world goes on after each.

use std::time::{Duration, Instant};

use crate::common::*;
use eccl::{Communicator, Error};
use futures::future::join_all;

const N: usize = 3;

/// Up to 12 MiB a block, some empty, some one element: more than a link buffers, so
/// whole-block sends from every rank at once would wait for each other.
fn big(s: usize, t: usize) -> usize {
    [
        [0, 3 << 20, 1 << 20],
        [(3 << 20) - 5, 7, 0],
        [1, 0, 2 << 20],
    ][s][t]
}

/// Every element says where it comes from: rank `s`'s element `i`.
fn values(s: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (s * 10_000_000 + i % 1_000_000) as f32)
        .collect()
}

/// Runs one all_to_all_v on every rank with `size(s, t)` elements from `s` to `t` and
/// checks every output block against its sender's input.
async fn exact(comms: &mut [Communicator], size: &(dyn Fn(usize, usize) -> usize + Sync)) {
    let n = comms.len();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().idx();
        let sends: Vec<usize> = (0..n).map(|t| size(r, t)).collect();
        let recvs: Vec<usize> = (0..n).map(|s| size(s, r)).collect();
        let input = values(r, sends.iter().sum());
        let mut out = vec![-1.0f32; recvs.iter().sum()];
        c.all_to_all_v_into(&input, &sends, &mut out, &recvs)
            .await
            .map(|_| out)
    }))
    .await;
    for (t, out) in res.into_iter().enumerate() {
        let out = out.unwrap_or_else(|e| panic!("rank {t}: {e}"));
        let want: Vec<f32> = (0..n)
            .flat_map(|s| {
                let from: usize = (0..t).map(|u| size(s, u)).sum();
                let all: usize = (0..n).map(|u| size(s, u)).sum();
                values(s, all)[from..from + size(s, t)].to_vec()
            })
            .collect();
        assert!(out == want, "rank {t}: the blocks it received differ");
    }
}

/// The failure reached every rank well before the collective timeout.
fn assert_prompt(t: Instant) {
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t.elapsed()
    );
}

async fn recover(comms: &mut [Communicator]) {
    for t in join_all(comms.iter_mut().map(|c| c.update_topology())).await {
        t.expect("recover");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_of_any_size_arrive_exactly_and_disagreements_fail_both_ends() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, N as u32).await;
    exact(&mut comms, &big).await;
    let small = |s: usize, t: usize| (s * 3 + t * 5) % 4;
    exact(&mut comms, &small).await;
    // All empty: still a call every rank takes part in.
    exact(&mut comms, &|_, _| 0).await;

    // Rank 2 expects 4 elements from rank 0, which sends it 3: both ends of that pair
    // fail naming the sizes, the third fails too (the epoch ends), promptly.
    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().idx();
        let sends = vec![3; N];
        let mut recvs = vec![3; N];
        if r == 2 {
            recvs[0] = 4;
        }
        let input = values(r, 3 * N);
        let mut out = vec![0f32; recvs.iter().sum()];
        c.all_to_all_v_into(&input, &sends, &mut out, &recvs).await
    }))
    .await;
    // (A rank may hear the other end's abort notice, which says the same from there,
    // before it compares the frame itself.)
    for (r, x) in res.iter().enumerate() {
        match x {
            Err(Error::Mismatch { detail, .. }) if r == 0 || r == 2 => assert!(
                detail.contains("all_to_all split sizes differ")
                    && detail.contains("sends this rank 3 elements")
                    && detail.contains(&format!("rank {}", 2 - r)),
                "rank {r}: {detail}"
            ),
            Err(Error::Mismatch { .. } | Error::Aborted { .. }) if r == 1 => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert_prompt(t);
    recover(&mut comms).await;
    exact(&mut comms, &small).await;

    // Rank 1 passes two counts in a world of three: it fails with InvalidArgument, the
    // others at once rather than at their timeout.
    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().idx();
        let n = if r == 1 { N - 1 } else { N };
        let input = vec![1f32; 2 * n];
        let mut out = vec![0f32; 2 * n];
        c.all_to_all_v_into(&input, &vec![2; n], &mut out, &vec![2; n])
            .await
    }))
    .await;
    for (r, x) in res.iter().enumerate() {
        match x {
            Err(Error::InvalidArgument(m)) if r == 1 => {
                assert!(m.contains("one count per rank (3)"), "rank 1: {m}")
            }
            // (Told by rank 1's abort notice, as for any call wrong on one rank.)
            Err(Error::Mismatch { detail, .. }) if r != 1 => {
                assert!(detail.contains("rank 1: invalid argument: all_to_all with split sizes needs one count per rank"), "rank {r}: {detail}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert_prompt(t);
    recover(&mut comms).await;
    exact(&mut comms, &big).await;

    // Rank 0 calls the even all_to_all, the others the one with split sizes, blocks of
    // the same length: not the same call, so every rank fails saying so.
    let res = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().idx();
        let input = vec![1f32; 2 * N];
        let mut out = vec![0f32; 2 * N];
        if r == 0 {
            c.all_to_all_into(&input, &mut out).await
        } else {
            c.all_to_all_v_into(&input, &[2; N], &mut out, &[2; N])
                .await
        }
    }))
    .await;
    for (r, x) in res.iter().enumerate() {
        match x {
            Err(Error::Mismatch { detail, .. }) => {
                assert!(
                    detail.contains("all_to_all with split sizes"),
                    "rank {r}: {detail}"
                )
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    recover(&mut comms).await;
    exact(&mut comms, &small).await;
    for c in comms {
        c.leave().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_dies_while_the_others_wait_for_its_blocks_fails_them_promptly() {
    let m = start_master(&[]);
    let comms = world(&m.addr, N as u32).await;
    let t = Instant::now();
    let res = join_all(comms.into_iter().map(|mut c| async move {
        let r = c.rank().unwrap().idx();
        if r == 2 {
            // As a process that dies mid-step: no call, no leave, its links just close.
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(c);
            return None;
        }
        let sends: Vec<usize> = (0..N).map(|t| big(r, t)).collect();
        let recvs: Vec<usize> = (0..N).map(|s| big(s, r)).collect();
        let input = values(r, sends.iter().sum());
        let mut out = vec![0f32; recvs.iter().sum()];
        let res = c.all_to_all_v_into(&input, &sends, &mut out, &recvs).await;
        Some((c, res))
    }))
    .await;
    let mut survivors = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        match x {
            None => assert_eq!(r, 2),
            Some((c, Err(Error::Aborted { .. } | Error::Timeout { .. }))) => survivors.push(c),
            Some((_, other)) => panic!("rank {r}: {other:?}"),
        }
    }
    assert_eq!(survivors.len(), 2);
    assert_prompt(t);
    recover(&mut survivors).await;
    assert_eq!(survivors[0].world_size(), 2);
    exact(&mut survivors, &|s, t| big(s, 2 - t) + 3).await;
    for c in survivors {
        c.leave().await.unwrap();
    }
}
