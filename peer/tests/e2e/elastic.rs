//! Elastic membership and shared state over real sockets and a real `eccl-master`
//! process: shared-state sync with every strategy, a newcomer admitted at a step
//! boundary, retry helpers after a member vanishes, and `TooFewPeers`.

use std::time::Duration;

use crate::common::*;
use eccl::{Communicator, Error, ReduceOp, RetryPolicy, SharedTensor, SyncInfo, SyncStrategy};
use futures::future::join_all;

/// A state of three tensors, one of them spanning several 1 MiB chunks.
struct State {
    big: Vec<f32>,
    small: Vec<i64>,
    empty: Vec<u8>,
}

impl State {
    fn new(seed: u32) -> State {
        State {
            big: (0..700_000).map(|i| (i as u32 ^ seed) as f32).collect(),
            small: (0..100).map(|i| i * seed as i64).collect(),
            empty: vec![],
        }
    }
    fn tensors(&mut self) -> Vec<SharedTensor<'_>> {
        vec![
            SharedTensor::new("big", &mut self.big[..]),
            SharedTensor::new("small", &mut self.small[..]),
            SharedTensor::new("empty", &mut self.empty[..]),
        ]
    }
}

async fn sync_all(
    comms: &mut [Communicator],
    states: &mut [State],
    revs: &[u64],
    strategies: &[SyncStrategy],
) -> Vec<eccl::Result<SyncInfo>> {
    join_all(
        comms
            .iter_mut()
            .zip(states.iter_mut())
            .enumerate()
            .map(|(i, (c, s))| async move {
                let mut t = s.tensors();
                c.sync_shared_state(revs[i], &mut t, strategies[i]).await
            }),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_state_goes_to_the_popular_content_at_the_highest_revision() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    let ep = SyncStrategy::EnforcePopular;
    // Ranks 0 and 1 hold revision 5; rank 2 is a newcomer with zeros at revision 0.
    let mut states = vec![State::new(7), State::new(7), State::new(0)];
    states[2].big.iter_mut().for_each(|x| *x = 0.0);
    let res = sync_all(&mut comms, &mut states, &[5, 5, 0], &[ep; 3]).await;
    let infos: Vec<SyncInfo> = res.into_iter().map(|r| r.expect("sync")).collect();
    assert!(infos
        .iter()
        .all(|i| i.revision == 5 && i.hash == infos[0].hash));
    assert_eq!(states[2].big, State::new(7).big);
    assert_eq!(states[2].small, State::new(7).small);
    let big_bytes = 700_000 * 4u64;
    let small_bytes = 100 * 8u64;
    assert_eq!(infos[2].bytes_received, big_bytes + small_bytes);
    assert_eq!(
        infos[0].bytes_sent + infos[1].bytes_sent,
        big_bytes + small_bytes
    );
    // Three chunks of "big" were spread over both sources.
    let (p0, p1) = (comms[0].peer_id(), comms[1].peer_id());
    assert_eq!(infos[2].sources, vec![p0.min(p1), p0.max(p1)]);
    assert_eq!(
        infos[2].updated,
        vec!["big".to_string(), "small".to_string()]
    );

    // One chunk differs on rank 1 alone: the two others win, and only that chunk moves.
    states[1].big[300_000] = -1.0;
    let res = sync_all(&mut comms, &mut states, &[6, 6, 6], &[ep; 3]).await;
    let infos: Vec<SyncInfo> = res.into_iter().map(|r| r.expect("sync")).collect();
    assert_eq!(infos[1].bytes_received, 1 << 20);
    assert_eq!(states[1].big, State::new(7).big);
    assert!(infos.iter().all(|i| i.hash == infos[0].hash));

    // Nothing differs: nothing moves.
    let res = sync_all(&mut comms, &mut states, &[6, 6, 6], &[ep; 3]).await;
    assert!(res.iter().all(|r| r
        .as_ref()
        .is_ok_and(|i| i.bytes_received == 0 && i.bytes_sent == 0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_only_and_receive_only_strategies() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    use SyncStrategy::*;
    // A send-only member's content wins even against a higher revision.
    let mut states = vec![State::new(1), State::new(2), State::new(2)];
    let res = sync_all(
        &mut comms,
        &mut states,
        &[1, 9, 9],
        &[SendOnly, EnforcePopular, EnforcePopular],
    )
    .await;
    assert!(
        res.iter()
            .all(|r| r.as_ref().is_ok_and(|i| i.revision == 1)),
        "{res:?}"
    );
    assert!(states.iter().all(|s| s.big == State::new(1).big));

    // A receive-only member's content never counts, however new.
    let mut states = vec![State::new(3), State::new(4), State::new(4)];
    let res = sync_all(
        &mut comms,
        &mut states,
        &[99, 2, 2],
        &[ReceiveOnly, EnforcePopular, EnforcePopular],
    )
    .await;
    assert!(
        res.iter()
            .all(|r| r.as_ref().is_ok_and(|i| i.revision == 2)),
        "{res:?}"
    );
    assert!(states.iter().all(|s| s.big == State::new(4).big));

    // A send-only member that loses to another send-only member is told so; the
    // others still finish.
    let mut states = vec![State::new(5), State::new(6), State::new(5)];
    let res = sync_all(
        &mut comms,
        &mut states,
        &[3, 2, 0],
        &[SendOnly, SendOnly, EnforcePopular],
    )
    .await;
    assert!(res[0].is_ok() && res[2].is_ok(), "{res:?}");
    assert!(
        matches!(res[1], Err(Error::InvalidArgument(_))),
        "{:?}",
        res[1]
    );
    assert_eq!(
        states[1].big,
        State::new(6).big,
        "a refused sync leaves the tensors alone"
    );
    assert_eq!(states[2].big, State::new(5).big);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_state_of_another_shape_is_refused_without_hanging() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 2).await;
    let (a, b) = comms.split_at_mut(1);
    let mut x = [1.0f32; 10];
    let mut y = vec![2.0f32; 11];
    let t0 = std::time::Instant::now();
    let (ra, rb) = tokio::join!(
        async {
            let mut t = [SharedTensor::new("w", &mut x[..])];
            a[0].sync_shared_state(2, &mut t, SyncStrategy::EnforcePopular)
                .await
        },
        async {
            let mut t = [SharedTensor::new("w", &mut y[..])];
            b[0].sync_shared_state(1, &mut t, SyncStrategy::EnforcePopular)
                .await
        }
    );
    assert!(ra.is_ok(), "{ra:?}");
    assert!(
        matches!(rb, Err(Error::InvalidArgument(ref m)) if m.contains("bytes")),
        "{rb:?}"
    );
    assert_eq!(y, vec![2.0f32; 11]);
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Duplicate names are the caller's mistake, found before anything is sent.
    let mut p = vec![0u8; 4];
    let mut q = vec![0u8; 4];
    let mut t = [
        SharedTensor::bytes("w", &mut p),
        SharedTensor::bytes("w", &mut q),
    ];
    let r = comms[0]
        .sync_shared_state(0, &mut t, SyncStrategy::EnforcePopular)
        .await;
    assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newcomer_joins_at_a_step_boundary_and_catches_up() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 2).await;
    let master = m.addr.clone();
    let newcomer = tokio::spawn(async move {
        let mut c = Communicator::connect(peer_cfg(&master))
            .await
            .expect("connect");
        let t = c.update_topology().await.expect("admitted");
        assert_eq!(t.links_kept, 0);
        let mut s = State::new(0);
        let info = {
            let mut ts = s.tensors();
            c.sync_shared_state(0, &mut ts, SyncStrategy::EnforcePopular)
                .await
                .expect("sync")
        };
        let mut v = vec![1i64; 1000];
        let op = c
            .all_reduce(&mut v, ReduceOp::Sum)
            .await
            .expect("all_reduce");
        (t, info, s.big == State::new(9).big, v, op.world_size, c)
    });
    // The members see the newcomer only when all of them ask, and then admit it together.
    let mut pending = false;
    for _ in 0..200 {
        let r = join_all(comms.iter_mut().map(|c| c.are_peers_pending())).await;
        let r: Vec<bool> = r.into_iter().map(|x| x.expect("pending?")).collect();
        assert!(r.iter().all(|x| *x == r[0]), "one answer for all: {r:?}");
        if r[0] {
            pending = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(pending, "the newcomer never showed as pending");
    let ts = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
    // The clean epoch's link between the two members carries on; only the newcomer's
    // links are new.
    assert!(
        ts.iter().all(|t| t
            .as_ref()
            .is_ok_and(|t| t.changed && t.world_size == 3 && t.links_kept == 1)),
        "{ts:?}"
    );
    let mut states = vec![State::new(9), State::new(9)];
    let res = sync_all(
        &mut comms,
        &mut states,
        &[4, 4],
        &[SyncStrategy::EnforcePopular; 2],
    )
    .await;
    assert!(res.iter().all(|r| r.is_ok()), "{res:?}");
    let sums = join_all(comms.iter_mut().map(|c| async move {
        let mut v = vec![1i64; 1000];
        c.all_reduce(&mut v, ReduceOp::Sum).await.map(|_| v)
    }))
    .await;
    let (t, info, same, v, n, _c) = newcomer.await.unwrap();
    assert!(t.changed && t.world_size == 3);
    assert_eq!(info.revision, 4);
    assert!(same, "the newcomer holds the members' state");
    assert_eq!((v[0], n), (3, 3));
    assert!(sums.iter().all(|s| s.as_ref().is_ok_and(|v| v[0] == 3)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_helpers_continue_over_the_survivors() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    // Rank 2 vanishes without a word (its sockets close, as when a process dies).
    drop(comms.pop());
    let policy = RetryPolicy {
        min_world: 2,
        ..Default::default()
    };
    let res = join_all(comms.iter_mut().map(|c| {
        let policy = policy.clone();
        async move {
            let mut v = vec![c.peer_id().0 as f64; 4096];
            let info = c
                .all_reduce_with_retry(&mut v, ReduceOp::Sum, &policy)
                .await?;
            Ok::<_, Error>((v, info))
        }
    }))
    .await;
    for r in &res {
        let (v, info) = r.as_ref().expect("retried over the survivors");
        assert!(info.epoch >= 2, "the retry ran in a new epoch");
        assert_eq!(info.world_size, 2);
        // G3: the sum is over exactly the members the call reports.
        let expect: f64 = info.members.iter().map(|p| p.0 as f64).sum();
        assert!(v.iter().all(|x| *x == expect));
    }
    // Below the minimum, the helper says so with the real numbers.
    drop(comms.pop());
    let strict = RetryPolicy {
        min_world: 2,
        ..Default::default()
    };
    let mut v = vec![1.0f32; 16];
    let r = comms[0]
        .all_reduce_with_retry(&mut v, ReduceOp::Sum, &strict)
        .await;
    match r {
        // The lone survivor may still complete one last all_reduce on its own epoch if
        // the abort has not arrived yet; then the next one must fail.
        Err(Error::TooFewPeers { have: 1, need: 2 }) => {}
        other => panic!("expected TooFewPeers, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_moved_on_sends_the_others_to_update_topology() {
    // One member's collective failed and it went to update_topology(); another's
    // succeeded and it asks whether peers are pending, or starts a shared-state sync.
    // Neither may wait for the other forever.
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 2).await;
    let (a, b) = comms.split_at_mut(1);
    let t0 = std::time::Instant::now();
    let (ta, pb) = tokio::join!(a[0].update_topology(), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let pending = b[0].are_peers_pending().await;
        let mut x = vec![0u8; 8];
        let mut t = [SharedTensor::bytes("x", &mut x)];
        let sync = b[0]
            .sync_shared_state(0, &mut t, SyncStrategy::EnforcePopular)
            .await;
        let topo = b[0].update_topology().await;
        (pending, sync, topo)
    });
    let (pending, sync, topo) = pb;
    assert!(matches!(pending, Ok(true)), "{pending:?}");
    assert!(matches!(sync, Err(Error::Aborted { .. })), "{sync:?}");
    assert!(ta.is_ok() && topo.is_ok(), "{ta:?} {topo:?}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_promised_unchanged_are_not_hashed_again() {
    // Two members, one behind: the first sync hashes everything and brings the second up
    // to date; a second sync with every tensor promised unchanged hashes nothing and
    // agrees on the same state (the receiver's promise covers what it received); a
    // tensor changed since, and not promised, is hashed and travels.
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 2).await;
    let mut states = [State::new(1), State::new(2)];
    let strategies = [SyncStrategy::EnforcePopular; 2];
    let first = sync_all(&mut comms, &mut states, &[2, 1], &strategies).await;
    let first: Vec<SyncInfo> = first.into_iter().map(|r| r.expect("first sync")).collect();
    let total = (states[0].big.len() * 4 + states[0].small.len() * 8) as u64;
    assert!(first.iter().all(|i| i.hashed_bytes == total), "{first:?}");
    assert_eq!(states[1].big, states[0].big);
    let again = join_all(
        comms
            .iter_mut()
            .zip(states.iter_mut())
            .map(|(c, s)| async move {
                let mut t: Vec<SharedTensor<'_>> =
                    s.tensors().into_iter().map(|t| t.unchanged(true)).collect();
                c.sync_shared_state(2, &mut t, SyncStrategy::EnforcePopular)
                    .await
            }),
    )
    .await;
    for (i, r) in again.iter().enumerate() {
        let r = r.as_ref().expect("second sync");
        assert_eq!(r.hashed_bytes, 0, "member {i}");
        assert_eq!(r.bytes_received, 0, "member {i}");
        assert_eq!(r.hash, first[0].hash, "member {i}");
    }
    // Member 0 changes "small" at a higher revision and says so (no promise for it).
    states[0].small[3] = -7;
    let third = join_all(comms.iter_mut().zip(states.iter_mut()).enumerate().map(
        |(i, (c, s))| async move {
            let mut t: Vec<SharedTensor<'_>> = s
                .tensors()
                .into_iter()
                .map(|t| {
                    let same = !(i == 0 && t.name == "small");
                    t.unchanged(same)
                })
                .collect();
            c.sync_shared_state(3 - i as u64, &mut t, SyncStrategy::EnforcePopular)
                .await
        },
    ))
    .await;
    let third: Vec<SyncInfo> = third.into_iter().map(|r| r.expect("third sync")).collect();
    assert_eq!(
        third[0].hashed_bytes, 800,
        "only the changed tensor is hashed"
    );
    assert_eq!(third[1].hashed_bytes, 0);
    assert_eq!(third[1].updated, vec!["small".to_string()]);
    assert_eq!(states[1].small, states[0].small);
    assert_eq!(third[0].hash, third[1].hash);
    assert!(
        third.iter().all(|i| i.hash_ms >= 0.0 && i.plan_ms > 0.0),
        "{third:?}"
    );
}

/// After an aborted epoch (a mismatch breaks it) the links between the members carry on
/// into the next: every member keeps its two links over TCP and over shared memory, and
/// the next all_reduce is exact over them (frames of the broken epoch are dropped by
/// their epoch number).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_carry_on_after_an_aborted_epoch() {
    for transport in [eccl::TransportChoice::Tcp, eccl::TransportChoice::Shm] {
        let m = start_master(&[]);
        let cfgs: Vec<_> = (0..3u32)
            .map(|r| {
                let mut c = peer_cfg(&m.addr);
                c.rank_hint = Some(r);
                c.min_world = 3;
                c.transport = transport;
                c
            })
            .collect();
        let mut comms = join_all(cfgs.into_iter().map(|c| async move {
            let mut comm = Communicator::connect(c).await.unwrap();
            comm.update_topology().await.unwrap();
            comm
        }))
        .await;
        let res = join_all(comms.iter_mut().enumerate().map(|(i, c)| async move {
            let mut b = vec![1.0f32; 100_000 + i];
            c.all_reduce(&mut b, ReduceOp::Sum).await
        }))
        .await;
        assert!(res.iter().all(|r| r.is_err()), "{res:?}");
        let next = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
        for t in &next {
            let t = t.as_ref().expect("the next epoch");
            assert!(t.changed, "{t:?}");
            assert_eq!(t.links_kept, 2, "{transport:?}: {t:?}");
        }
        let res = join_all(comms.iter_mut().map(|c| async move {
            let mut b = vec![2.0f32; 300_000];
            c.all_reduce(&mut b, ReduceOp::Sum)
                .await
                .map(|_| (b[0], b[299_999]))
        }))
        .await;
        for r in res {
            assert_eq!(
                r.expect("exact over the kept links"),
                (6.0, 6.0),
                "{transport:?}"
            );
        }
    }
}

/// Several calls in flight (`Communicator::in_flight`): four all_reduces submitted before
/// the first finishes come back exact and in order; then rank 2's second call disagrees
/// in size, and every call from there on fails on every rank (none waits), the first
/// still succeeds, and after `update_topology` the same four succeed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_run_in_order_and_a_fault_ends_every_one() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    for odd in [false, true, false] {
        let res = four_in_flight(&mut comms, odd).await;
        for (rank, calls) in res.iter().enumerate() {
            for (j, call) in calls.iter().enumerate() {
                let call = call.as_ref().expect("the call ran");
                if odd && j >= 1 {
                    assert!(
                        call.is_err(),
                        "rank {rank} call {j} after the fault: {call:?}"
                    );
                    continue;
                }
                let v = call.as_ref().expect("exact");
                assert_eq!(v.len(), 1000 * (j + 1));
                let want = (0..3).map(|r| (r * 10 + j) as f32).sum::<f32>();
                assert!(v.iter().all(|&x| x == want), "rank {rank} call {j}");
            }
        }
        if odd {
            for t in join_all(comms.iter_mut().map(|c| c.update_topology())).await {
                t.expect("the next epoch");
            }
        }
    }
}

/// Each rank submits four all_reduces (of 1000, 2000, 3000 and 4000 elements; with `odd`,
/// rank 2's second is one longer) before waiting for any.
async fn four_in_flight(
    comms: &mut [Communicator],
    odd: bool,
) -> Vec<Vec<eccl::Result<eccl::Result<Vec<f32>>>>> {
    use futures::FutureExt;
    join_all(comms.iter_mut().enumerate().map(|(rank, c)| {
        c.in_flight(move |q| async move {
            let calls: Vec<_> = (0..4usize)
                .map(|j| {
                    let len = 1000 * (j + 1) + usize::from(odd && rank == 2 && j == 1);
                    q.submit(move |c| {
                        async move {
                            let mut v = vec![(rank * 10 + j) as f32; len];
                            c.all_reduce(&mut v, ReduceOp::Sum).await.map(|_| v)
                        }
                        .boxed()
                    })
                })
                .collect();
            tokio::time::timeout(Duration::from_secs(20), join_all(calls))
                .await
                .expect("no call in flight waits past a fault")
        })
    }))
    .await
}
