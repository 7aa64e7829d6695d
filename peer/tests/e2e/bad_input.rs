//! Bad input gets a clear, typed error on every rank, promptly: mismatched calls across
//! ranks, invalid arguments, a missing master, a wrong secret, garbage on sockets. After
//! each failure the ranks recover with `update_topology()` and the next collective is
//! right, and a failed in-place call leaves the caller's buffer as it was (G2).

use std::time::{Duration, Instant};

use crate::common::*;
use eccl::{Communicator, Error, Rank, ReduceOp, Secret};
use futures::future::join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Every rank calls update_topology() and then a correct all_reduce.
async fn recover_and_check(comms: &mut [Communicator]) {
    let epochs = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
    let epochs: Vec<u64> = epochs
        .into_iter()
        .map(|t| t.expect("recover").epoch)
        .collect();
    assert!(
        epochs.windows(2).all(|w| w[0] == w[1]),
        "one epoch for all: {epochs:?}"
    );
    let n = comms.len() as f32;
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![c.rank().unwrap().0 as f32 + 1.0; 1000];
        c.all_reduce(&mut b, ReduceOp::Sum).await.map(|_| b)
    }))
    .await;
    for r in res {
        let b = r.expect("all_reduce after recovery");
        assert!(b.iter().all(|&x| x == n * (n + 1.0) / 2.0));
    }
}

fn assert_all_mismatch<T: std::fmt::Debug>(what: &str, res: &[eccl::Result<T>], t: Instant) {
    for (r, x) in res.iter().enumerate() {
        assert!(
            matches!(x, Err(Error::Mismatch { .. })),
            "{what}: rank {r} got {x:?}"
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "{what}: took {:?}",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_calls_fail_on_every_rank_and_leave_input_intact() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;

    for len in [64usize, 300_000] {
        let t = Instant::now();
        let res = join_all(comms.iter_mut().map(|c| async move {
            let r = c.rank().unwrap().idx();
            let orig: Vec<f32> = (0..len + (r == 1) as usize)
                .map(|i| i as f32 * 0.5 + r as f32)
                .collect();
            let mut b = orig.clone();
            let out = c.all_reduce(&mut b, ReduceOp::Sum).await;
            assert_eq!(
                b, orig,
                "G2: a failed in-place call must not touch the buffer"
            );
            out
        }))
        .await;
        assert_all_mismatch(&format!("count {len} vs {}", len + 1), &res, t);
        recover_and_check(&mut comms).await;
    }

    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        if c.rank() == Some(Rank(0)) {
            let mut b = vec![1.0f64; 100];
            c.all_reduce(&mut b, ReduceOp::Sum).await
        } else {
            let mut b = vec![1.0f32; 100];
            c.all_reduce(&mut b, ReduceOp::Sum).await
        }
    }))
    .await;
    assert_all_mismatch("dtype", &res, t);
    recover_and_check(&mut comms).await;

    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let op = if c.rank() == Some(Rank(2)) {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let mut b = vec![1i32; 100];
        c.all_reduce(&mut b, op).await
    }))
    .await;
    assert_all_mismatch("op", &res, t);
    recover_and_check(&mut comms).await;

    // Ranks that disagree on the root never exchange data with each other in a
    // broadcast; the descriptor check still fails all of them.
    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let root = if c.rank() == Some(Rank(0)) {
            Rank(0)
        } else {
            Rank(1)
        };
        let mut b = vec![7u8; 4096];
        c.broadcast(&mut b, root).await
    }))
    .await;
    assert_all_mismatch("root", &res, t);
    recover_and_check(&mut comms).await;

    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![7i64; 10];
        if c.rank() == Some(Rank(1)) {
            c.broadcast(&mut b, Rank(0)).await
        } else {
            c.all_reduce(&mut b, ReduceOp::Sum).await
        }
    }))
    .await;
    assert_all_mismatch("different collectives", &res, t);
    recover_and_check(&mut comms).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_arguments_are_typed_errors_and_never_hang() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;

    // The same invalid call everywhere: InvalidArgument everywhere, before any data.
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![1i32; 10];
        c.all_reduce(&mut b, ReduceOp::Avg).await
    }))
    .await;
    for r in &res {
        assert!(
            matches!(r, Err(Error::InvalidArgument(m)) if m.contains("avg")),
            "{r:?}"
        );
    }
    recover_and_check(&mut comms).await;

    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![1u8; 10];
        let sum = c.all_reduce(&mut b, ReduceOp::Sum).await.map(|_| b[0]);
        assert_eq!(sum.expect("a valid all_reduce"), 3);
        c.broadcast(&mut b, Rank(3)).await
    }))
    .await;
    for r in &res {
        assert!(
            matches!(r, Err(Error::InvalidArgument(m)) if m.contains("root")),
            "{r:?}"
        );
    }
    recover_and_check(&mut comms).await;

    // A rank-local mistake (wrong output length on one rank): that rank gets
    // InvalidArgument, the others a Mismatch naming it, all quickly.
    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        let input = vec![1.0f32; 10];
        let mut out = vec![0.0f32; if c.rank() == Some(Rank(2)) { 29 } else { 30 }];
        c.all_gather_into(&input, &mut out).await
    }))
    .await;
    assert!(
        matches!(res[2], Err(Error::InvalidArgument(_))),
        "{:?}",
        res[2]
    );
    assert!(
        matches!(res[0], Err(Error::Mismatch { .. })),
        "{:?}",
        res[0]
    );
    assert!(
        matches!(res[1], Err(Error::Mismatch { .. })),
        "{:?}",
        res[1]
    );
    assert!(t.elapsed() < Duration::from_secs(6));
    recover_and_check(&mut comms).await;

    // Tags are matched, not queued behind each other: rank 1 takes tag 6 before tag 5.
    let res = join_all(comms.iter_mut().map(|c| async move {
        match c.rank() {
            Some(Rank(0)) => {
                c.send(&[5u8; 16], Rank(1), 5).await?;
                c.send(&[6u8; 16], Rank(1), 6).await.map(|_| vec![])
            }
            Some(Rank(1)) => {
                let (mut five, mut six) = (vec![0u8; 16], vec![0u8; 16]);
                c.recv(&mut six, Rank(0), 6).await?;
                c.recv(&mut five, Rank(0), 5).await?;
                Ok([five, six].concat())
            }
            _ => Ok(vec![]),
        }
    }))
    .await;
    let got = res[1].as_ref().expect("tagged messages in another order");
    assert_eq!(got[..16], [5u8; 16]);
    assert_eq!(got[16..], [6u8; 16]);
    assert!(res[0].is_ok() && res[2].is_ok(), "{res:?}");

    // A message whose size differs from the receive with its tag: Mismatch, promptly.
    let t = Instant::now();
    let res = join_all(comms.iter_mut().map(|c| async move {
        match c.rank() {
            Some(Rank(0)) => c.send(&[1u8; 16], Rank(1), 7).await.map(|_| ()),
            Some(Rank(1)) => c.recv(&mut [0u8; 8], Rank(0), 7).await.map(|_| ()),
            _ => Ok(()),
        }
    }))
    .await;
    assert!(
        matches!(res[1], Err(Error::Mismatch { .. })),
        "{:?}",
        res[1]
    );
    assert!(t.elapsed() < Duration::from_secs(6));
    recover_and_check(&mut comms).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_master_and_wrong_secret() {
    // Nothing listens on this port.
    let port = crate::common::free_port();
    let mut c = peer_cfg(&format!("127.0.0.1:{port}"));
    c.connect_timeout = Duration::from_millis(800);
    let t = Instant::now();
    let r = Communicator::connect(c).await;
    assert!(
        matches!(r, Err(Error::MasterUnavailable { .. })),
        "{:?}",
        r.err()
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "bounded wait, took {:?}",
        t.elapsed()
    );

    let m = start_master(&[]);
    let mut c = peer_cfg(&m.addr);
    c.secret = Some(Secret::new("not-the-job-secret-at-all").unwrap());
    let t = Instant::now();
    let r = Communicator::connect(c).await;
    match r {
        Err(Error::MasterUnavailable { reason, .. }) => {
            assert!(reason.contains("authentic"), "{reason}")
        }
        other => panic!("wrong secret must be refused: {:?}", other.err()),
    }
    assert!(t.elapsed() < Duration::from_secs(3));

    let mut c = peer_cfg(&m.addr);
    c.secret = None;
    assert!(matches!(
        Communicator::connect(c).await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_strangers_on_sockets_are_refused() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 2).await;
    let link_addr = comms[1].world().unwrap().members[1].addr.clone();

    // A stranger that sends garbage to the master and to a peer's link port, and one
    // that connects and says nothing: none of them reaches the registry or a link.
    let mut silent = tokio::net::TcpStream::connect(&link_addr).await.unwrap();
    // The master waits for a TLS client hello, a link port for the dialer's mode byte:
    // neither tells a stranger anything before it is dropped (the master's TLS stack
    // says "decode error" in one alert record, as TLS does).
    for addr in [m.addr.clone(), link_addr.clone()] {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let _ = s.write_all(&[0x5a; 300]).await;
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
        let alert_only = rest.is_empty() || (rest.len() == 7 && rest[0] == 21);
        assert!(
            matches!(n, Ok(Ok(_)) | Ok(Err(_))) && alert_only,
            "the stranger must be disconnected, learning nothing: {n:?} {rest:?}"
        );
    }
    // The job goes on.
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![2.0f32; 50_000];
        c.all_reduce(&mut b, ReduceOp::Sum).await.map(|_| b[0])
    }))
    .await;
    for r in res {
        assert_eq!(r.unwrap(), 4.0);
    }
    let _ = silent.write_all(b"x").await;

    // A stranger cannot register or join: the master refuses it before any message.
    let mut c = peer_cfg(&m.addr);
    c.secret = Some(Secret::new("guessing-the-secret-0000").unwrap());
    match Communicator::connect(c).await {
        Err(Error::MasterUnavailable { reason, .. }) => {
            assert!(reason.contains("authentic"), "{reason}")
        }
        other => panic!(
            "a stranger must be refused authentication: {:?}",
            other.err()
        ),
    }
    assert_eq!(comms[0].world_size(), 2);
}

/// G2 where the ring all_reduce runs in the caller's buffer (each piece saved before its
/// first write). Four ranks in a ring, rank 3 never calls: rank 1 reduces rank 0's first
/// chunk into its buffer, rank 2 rank 1's, and then the ring waits on rank 3. Rank 2's
/// call is dropped there (the drop puts its bytes back) and its communicator with it;
/// then rank 3 goes, and the calls of ranks 0 and 1 fail. Every buffer holds exactly
/// what it held before; then the survivors go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_in_place_all_reduce_puts_back_what_it_wrote() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 4).await;
    comms.sort_by_key(|c| c.rank().unwrap().0);
    let n = 1 << 20;
    let orig = |r: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (i % 1000) as f32 + r as f32 * 0.25)
            .collect()
    };
    let idle = comms.pop().expect("rank 3");
    let mut dropped = comms.pop().expect("rank 2");
    let (survivors, gone) = tokio::join!(
        join_all(comms.iter_mut().map(|c| async move {
            let r = c.rank().unwrap().idx();
            let mut b = orig(r);
            let out = c.all_reduce(&mut b, ReduceOp::Sum).await;
            (r, out, b == orig(r))
        })),
        async {
            let mut b = orig(2);
            let t = tokio::time::timeout(
                Duration::from_millis(500),
                dropped.all_reduce(&mut b, ReduceOp::Sum),
            )
            .await;
            let unchanged = b == orig(2);
            drop(dropped);
            drop(idle);
            (t, unchanged)
        }
    );
    let (t, unchanged) = gone;
    assert!(t.is_err(), "rank 2's call must wait for rank 3: {t:?}");
    assert!(
        unchanged,
        "rank 2: G2: the dropped in-place call left its buffer changed"
    );
    for (r, out, unchanged) in &survivors {
        assert!(out.is_err(), "rank {r}: {out:?}");
        assert!(
            unchanged,
            "rank {r}: G2: the failed in-place call left its buffer changed"
        );
    }
    let epochs = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
    assert!(
        epochs
            .iter()
            .all(|e| e.as_ref().is_ok_and(|t| t.world_size == 2)),
        "{epochs:?}"
    );
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![1.5f32; n];
        c.all_reduce(&mut b, ReduceOp::Sum)
            .await
            .map(|_| b.iter().all(|x| *x == 3.0))
    }))
    .await;
    assert!(res.iter().all(|r| matches!(r, Ok(true))), "{res:?}");
}
