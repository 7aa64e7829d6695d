//! torch's `_reconfigure` on a real master: a world of exactly the named peers, each
//! uuid once per job, the same answer for everyone; disjoint worlds side by side that
//! merge again; and nobody removed by another member's reconfigure.

use std::time::Duration;

use crate::common::*;
use eccl::{Error, PeerId, ReduceOp};
use futures::future::join_all;

const T: Duration = Duration::from_secs(10);

async fn connect(master: &str, n: u32) -> Vec<eccl::Communicator> {
    join_all((0..n).map(|_| async {
        eccl::Communicator::connect(peer_cfg(master))
            .await
            .expect("connect")
    }))
    .await
}

async fn sum_of_ranks(comms: &mut [eccl::Communicator]) -> Vec<f32> {
    join_all(comms.iter_mut().map(|c| async move {
        let mut b = [c.rank().unwrap().0 as f32 + 1.0; 4];
        c.all_reduce(&mut b, ReduceOp::Sum)
            .await
            .expect("all_reduce");
        b[0]
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconfigure_forms_exactly_the_named_world_and_refuses_used_uuids() {
    let m = start_master(&[]);
    let mut comms = connect(&m.addr, 3).await;
    // No world until the first reconfigure; ranks follow the list.
    let ids: Vec<PeerId> = comms.iter().map(|c| c.peer_id()).collect();
    let order = vec![ids[2], ids[0], ids[1]];
    let ups = join_all(
        comms
            .iter_mut()
            .map(|c| c.reconfigure(10, order.clone(), true, T)),
    )
    .await;
    let ranks: Vec<u32> = ups
        .into_iter()
        .map(|u| u.expect("reconfigure").rank.0)
        .collect();
    assert_eq!(ranks, vec![1, 2, 0]);
    assert_eq!(sum_of_ranks(&mut comms).await, vec![6.0; 3]);
    assert!(comms.iter().all(|c| c.job_id() == comms[0].job_id()));

    // A used uuid: the same typed error for everyone, the world unchanged.
    let errs = join_all(
        comms
            .iter_mut()
            .map(|c| c.reconfigure(10, order.clone(), true, T)),
    )
    .await;
    for e in errs {
        assert!(
            matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("already used")),
            "{e:?}"
        );
    }
    assert_eq!(sum_of_ranks(&mut comms).await, vec![6.0; 3]);

    // Two members name different worlds under one uuid: both hear so.
    let (a, rest) = comms.split_at_mut(1);
    let (r1, r2) = tokio::join!(
        a[0].reconfigure(11, vec![ids[0], ids[1]], true, T),
        rest[0].reconfigure(11, vec![ids[1], ids[0]], true, T)
    );
    for e in [r1, r2] {
        assert!(
            matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("different")),
            "{e:?}"
        );
    }

    // A smaller world, as a set (the current order is kept); the peer left out is not
    // removed, but its calls of the old epoch fail instead of waiting, and its next
    // update_topology() gives it the world that went on without the others: itself.
    let mut left_out = comms.remove(0);
    let ups = join_all(
        comms
            .iter_mut()
            .map(|c| c.reconfigure(12, vec![ids[1], ids[2]], false, T)),
    )
    .await;
    let ranks: Vec<u32> = ups.into_iter().map(|u| u.expect("shrink").rank.0).collect();
    assert_eq!(ranks, vec![1, 0]);
    assert_eq!(sum_of_ranks(&mut comms).await, vec![3.0; 2]);
    let mut b = [1f32];
    let e = tokio::time::timeout(T, left_out.all_reduce(&mut b, ReduceOp::Sum))
        .await
        .expect("no hang");
    assert!(matches!(e, Err(Error::Aborted { .. })), "{e:?}");
    let u = left_out.update_topology().await.expect("its own world");
    assert_eq!((u.rank.0, u.world_size), (0, 1));
    let mut b = [5f32];
    left_out.all_reduce(&mut b, ReduceOp::Sum).await.unwrap();
    assert_eq!(b[0], 5.0);
    left_out.leave().await.unwrap();

    // A newcomer grows the world back; a reconfigure naming a gone peer is refused.
    let mut fresh = connect(&m.addr, 1).await;
    comms.append(&mut fresh);
    let gone = ids[0];
    let e = comms[1].reconfigure(13, vec![ids[2], gone], true, T).await;
    assert!(
        matches!(&e, Err(Error::Aborted { cause, .. }) if cause.contains("gone")),
        "{e:?}"
    );
    let grown = vec![ids[2], ids[1], comms[2].peer_id()];
    let ups = join_all(
        comms
            .iter_mut()
            .map(|c| c.reconfigure(14, grown.clone(), true, T)),
    )
    .await;
    assert!(
        ups.iter()
            .all(|u| u.as_ref().is_ok_and(|u| u.world_size == 3)),
        "{ups:?}"
    );
    assert_eq!(sum_of_ranks(&mut comms).await, vec![6.0; 3]);

    // While a reconfigure waits for its members, a peer it does not name that asks for
    // another world under the same uuid is refused alone, and the members' goes on (the
    // master compares each request with one waiting under its uuid, not with all); a
    // list that names a peer twice is refused.
    let [c0, c1, c2] = &mut comms[..] else {
        unreachable!()
    };
    let pair = vec![ids[2], ids[1]];
    let outsider = c2.peer_id();
    let (r0, r2, r1) = tokio::join!(
        c0.reconfigure(15, pair.clone(), true, T),
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            c2.reconfigure(15, vec![outsider], true, T).await
        },
        async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            c1.reconfigure(15, pair.clone(), true, T).await
        }
    );
    assert!(
        matches!(&r2, Err(Error::InvalidArgument(m)) if m.contains("in progress for other members")),
        "{r2:?}"
    );
    for r in [r0, r1] {
        assert!(r.as_ref().is_ok_and(|u| u.world_size == 2), "{r:?}");
    }
    let e = c2.reconfigure(16, vec![outsider, outsider], true, T).await;
    assert!(
        matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("named twice")),
        "{e:?}"
    );
    assert_eq!(sum_of_ranks(&mut comms[..2]).await, vec![3.0; 2]);
}

/// torch's split-brain shape and the finding that one member could evict the world:
/// four peers in one world; two halves reconfigure at once with their own uuids into two
/// worlds that live side by side (each exact on its own), then merge back; and a member
/// that reconfigures itself alone with uuid 2^64-1 removes nobody and burns no uuid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disjoint_worlds_split_and_merge_and_nobody_is_evicted_by_another() {
    let m = start_master(&[]);
    let mut comms = connect(&m.addr, 4).await;
    let ids: Vec<PeerId> = comms.iter().map(|c| c.peer_id()).collect();
    let ups = join_all(
        comms
            .iter_mut()
            .map(|c| c.reconfigure(1, ids.clone(), true, T)),
    )
    .await;
    assert!(ups.iter().all(|u| u.is_ok()), "{ups:?}");
    assert_eq!(sum_of_ranks(&mut comms).await, vec![10.0; 4]);
    // The halves at once, each naming itself, uuids with no order between them.
    let (left, right) = comms.split_at_mut(2);
    let (l, r) = tokio::join!(
        join_all(
            left.iter_mut()
                .map(|c| c.reconfigure(900, ids[..2].to_vec(), true, T))
        ),
        join_all(
            right
                .iter_mut()
                .map(|c| c.reconfigure(7, ids[2..].to_vec(), true, T))
        ),
    );
    assert!(
        l.iter()
            .chain(r.iter())
            .all(|u| u.as_ref().is_ok_and(|u| u.world_size == 2)),
        "{l:?} {r:?}"
    );
    let el = left[0].epoch();
    let er = right[0].epoch();
    assert!(el != er, "one epoch number for two worlds");
    let (sl, sr) = tokio::join!(sum_of_ranks(left), sum_of_ranks(right));
    assert_eq!((sl, sr), (vec![3.0; 2], vec![3.0; 2]));
    // They merge back.
    let ups = join_all(
        comms
            .iter_mut()
            .map(|c| c.reconfigure(50, ids.clone(), true, T)),
    )
    .await;
    assert!(
        ups.iter()
            .all(|u| u.as_ref().is_ok_and(|u| u.world_size == 4)),
        "{ups:?}"
    );
    assert_eq!(sum_of_ranks(&mut comms).await, vec![10.0; 4]);
    // One member alone, with the largest uuid: the other three are not evicted; their
    // next update_topology() gives them the world that went on without it.
    let solo = comms[3]
        .reconfigure(u64::MAX, vec![ids[3]], true, T)
        .await
        .expect("a world of one");
    assert_eq!(solo.world_size, 1);
    let mut rest: Vec<_> = comms.drain(..3).collect();
    let ups = join_all(rest.iter_mut().map(|c| c.update_topology())).await;
    assert!(
        ups.iter()
            .all(|u| u.as_ref().is_ok_and(|u| u.world_size == 3)),
        "{ups:?}"
    );
    assert_eq!(sum_of_ranks(&mut rest).await, vec![6.0; 3]);
    // And no uuid was burned: a smaller one merges all four again.
    rest.append(&mut comms);
    let ups = join_all(
        rest.iter_mut()
            .map(|c| c.reconfigure(2, ids.clone(), true, T)),
    )
    .await;
    assert!(
        ups.iter()
            .all(|u| u.as_ref().is_ok_and(|u| u.world_size == 4)),
        "{ups:?}"
    );
    assert_eq!(sum_of_ranks(&mut rest).await, vec![10.0; 4]);
}
