//! torch's `_reconfigure` on a real master: a world of exactly the named peers, once per
//! uuid, the same answer for everyone.

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
async fn reconfigure_forms_exactly_the_named_world_and_refuses_old_uuids() {
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

    // A reused or older uuid: the same typed error for everyone, the world unchanged.
    for uuid in [10, 3] {
        let errs = join_all(
            comms
                .iter_mut()
                .map(|c| c.reconfigure(uuid, order.clone(), true, T)),
        )
        .await;
        for e in errs {
            assert!(
                matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("not newer")),
                "{e:?}"
            );
        }
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

    // A smaller world, as a set (the current order is kept); the peer left out is out of
    // the job and its calls fail instead of waiting.
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
    assert!(
        matches!(e, Err(Error::Aborted { .. } | Error::Evicted { .. })),
        "{e:?}"
    );

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
}
