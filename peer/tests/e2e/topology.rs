//! optimize_topology() against a real master: the members measure their links, the
//! master solves the ring, and the world goes on at a new epoch (same members, same
//! ranks) whose collectives follow the ring with exact results; a member lost while the
//! others probe fails their call instead of hanging it; ECCL_TOPOLOGY=optimize does the
//! same whenever the world changes.

use std::time::Duration;

use crate::common::*;
use eccl::ReduceOp;
use futures::future::join_all;

/// Every rank's all_reduce of `i64` contributions that identify rank and element:
/// the exact sum on every rank.
async fn exact_all_reduce(comms: &mut [eccl::Communicator], tag: i64) {
    let n = comms.len() as i64;
    let got = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().0 as i64;
        let mut v: Vec<i64> = (0..1000).map(|k| tag * 1_000_000 + r * 1000 + k).collect();
        c.all_reduce(&mut v, ReduceOp::Sum)
            .await
            .expect("all_reduce");
        v
    }))
    .await;
    let want: Vec<i64> = (0..1000)
        .map(|k| (0..n).map(|r| tag * 1_000_000 + r * 1000 + k).sum())
        .collect();
    for (r, v) in got.iter().enumerate() {
        assert_eq!(v, &want, "rank {r}");
    }
}

/// Broadcast and reduce from every root (they follow the ring too): exact.
async fn exact_rooted(comms: &mut [eccl::Communicator]) {
    let n = comms.len() as u32;
    for root in 0..n {
        let got = join_all(comms.iter_mut().map(|c| async move {
            let r = c.rank().unwrap().0 as i64;
            let mut b: Vec<i64> = (0..777).map(|k| k * 10 + r).collect();
            c.broadcast(&mut b, eccl::Rank(root))
                .await
                .expect("broadcast");
            let mut v: Vec<i64> = (0..777).map(|k| k * 1000 + r).collect();
            c.reduce(&mut v, ReduceOp::Sum, eccl::Rank(root))
                .await
                .expect("reduce");
            (r as u32, b, v)
        }))
        .await;
        for (r, b, v) in got {
            assert_eq!(
                b,
                (0..777).map(|k| k * 10 + root as i64).collect::<Vec<_>>(),
                "root {root} rank {r}"
            );
            if r == root {
                let want: Vec<i64> = (0..777)
                    .map(|k| (0..n as i64).map(|q| k * 1000 + q).sum())
                    .collect();
                assert_eq!(v, want, "reduce at root {root}");
            }
        }
    }
}

/// all_gather and reduce_scatter, whose blocks belong to ranks (their schedules follow
/// the ring with the blocks renumbered): every block where it belongs.
async fn exact_blocks(comms: &mut [eccl::Communicator]) {
    let n = comms.len();
    let got = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().0 as i64;
        let mine: Vec<i64> = (0..333).map(|k| r * 10_000 + k).collect();
        let mut all = vec![0i64; 333 * n];
        c.all_gather_into(&mine, &mut all)
            .await
            .expect("all_gather");
        let contrib: Vec<i64> = (0..333 * n as i64).map(|k| k * 100 + r).collect();
        let mut block = vec![0i64; 333];
        c.reduce_scatter_into(&contrib, &mut block, ReduceOp::Sum)
            .await
            .expect("reduce_scatter");
        (r, all, block)
    }))
    .await;
    let gathered: Vec<i64> = (0..n as i64)
        .flat_map(|q| (0..333).map(move |k| q * 10_000 + k))
        .collect();
    for (r, all, block) in got {
        assert_eq!(all, gathered, "all_gather at rank {r}");
        let want: Vec<i64> = (0..333)
            .map(|k| {
                let e = r * 333 + k;
                (0..n as i64).map(|q| e * 100 + q).sum()
            })
            .collect();
        assert_eq!(block, want, "reduce_scatter at rank {r}");
    }
}

/// With fractions, where the order of the sum changes the bits: every rank the same.
async fn identical_all_reduce(comms: &mut [eccl::Communicator]) {
    let got = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().0 as f32;
        let mut v: Vec<f32> = (0..4099)
            .map(|k| ((k as f32 + 0.37) * (r + 1.3)).sin())
            .collect();
        c.all_reduce(&mut v, ReduceOp::Sum)
            .await
            .expect("all_reduce");
        v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>()
    }))
    .await;
    for (r, v) in got.iter().enumerate() {
        assert_eq!(v, &got[0], "rank {r} differs from rank 0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_solved_ring_takes_effect_at_the_next_epoch_with_exact_results_before_and_after() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 4).await;
    let epoch = comms[0].epoch();
    let ranks: Vec<_> = comms.iter().map(|c| (c.peer_id(), c.rank())).collect();
    assert!(
        comms[0].world().unwrap().ring.is_empty(),
        "rank order before any measurement"
    );
    exact_all_reduce(&mut comms, 1).await;

    let ups = join_all(comms.iter_mut().map(|c| c.optimize_topology())).await;
    let ups: Vec<_> = ups
        .into_iter()
        .map(|u| u.expect("optimize_topology"))
        .collect();
    for u in &ups {
        assert_eq!(u.epoch, epoch + 1, "{u:?}");
        assert_eq!(u.ring, ups[0].ring, "every member has the same ring");
        assert_eq!(
            u.links.len(),
            3,
            "a measurement to each other member: {u:?}"
        );
        for (_, l) in &u.links {
            assert!(l.bytes_per_s > 1_000_000 && l.latency_ns > 0, "{u:?}");
        }
    }
    let mut ring = ups[0].ring.clone();
    assert_eq!(ring.len(), 4, "{:?}", ups[0]);
    ring.sort_unstable();
    assert_eq!(ring, vec![0, 1, 2, 3]);
    // Same members, same ranks: nothing above the communicator changes.
    assert_eq!(
        comms
            .iter()
            .map(|c| (c.peer_id(), c.rank()))
            .collect::<Vec<_>>(),
        ranks
    );
    for c in &comms {
        assert_eq!(c.world().unwrap().ring, ups[0].ring);
    }
    exact_all_reduce(&mut comms, 2).await;
    identical_all_reduce(&mut comms).await;
    exact_rooted(&mut comms).await;
    exact_blocks(&mut comms).await;

    // Measured again (the matrix is kept and replaced), and a world that changes keeps
    // a ring solved from what was measured: a member leaves, the others go on.
    let again = join_all(comms.iter_mut().map(|c| c.optimize_topology())).await;
    assert!(
        again
            .iter()
            .all(|u| u.as_ref().is_ok_and(|u| u.epoch == epoch + 2)),
        "{again:?}"
    );
    let last = comms.pop().unwrap();
    last.leave().await.expect("leave");
    for w in join_all(comms.iter_mut().map(|c| c.update_topology())).await {
        w.expect("world of three");
    }
    let w = comms[0].world().unwrap().clone();
    assert_eq!(w.size(), 3);
    assert_eq!(
        w.ring.len(),
        3,
        "the ring is solved again for the smaller world: {w:?}"
    );
    exact_all_reduce(&mut comms, 3).await;
    identical_all_reduce(&mut comms).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lost_while_the_others_probe_fails_their_call_and_the_rest_goes_on() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 4).await;
    let lost = comms.pop().unwrap();
    let res = tokio::time::timeout(Duration::from_secs(30), async {
        let probing = join_all(comms.iter_mut().map(|c| c.optimize_topology()));
        let dies = async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            // Gone without a word: its links and its master connection close.
            drop(lost);
        };
        futures::join!(probing, dies).0
    })
    .await
    .expect("the others' optimize_topology() returned (no hang)");
    for r in &res {
        assert!(r.is_err(), "{r:?}");
        assert!(r.as_ref().unwrap_err().is_retryable(), "{r:?}");
    }
    for w in join_all(comms.iter_mut().map(|c| c.update_topology())).await {
        w.expect("world of three");
    }
    let ups = join_all(comms.iter_mut().map(|c| c.optimize_topology())).await;
    assert!(ups.iter().all(|u| u.is_ok()), "{ups:?}");
    exact_all_reduce(&mut comms, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eccl_topology_optimize_measures_whenever_the_world_changes() {
    let m = start_master(&[]);
    let mut comms = world_with(&m.addr, 3, |c| c.optimize_topology = true).await;
    for c in &comms {
        let w = c.world().unwrap();
        assert_eq!(
            w.ring.len(),
            3,
            "measured and solved as the world formed: {w:?}"
        );
    }
    exact_all_reduce(&mut comms, 5).await;
    identical_all_reduce(&mut comms).await;
}
