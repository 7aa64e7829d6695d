//! Point-to-point messages between in-process communicators on a real master: receive
//! from any source (torch's `recv(src=None)`), tags that do not wait for each other.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use eccl::{Error, Rank};
use futures::future::join_all;
use tokio::sync::Notify;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_from_any_source_takes_messages_as_they_come_and_names_the_sender() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    // Rank 1 sends its tag-5 messages once rank 0 has taken rank 2's (a signal, not a
    // sleep: the order under test must not depend on how busy the host is).
    let first_taken = Arc::new(Notify::new());
    let res = join_all(comms.iter_mut().map(|c| {
        let first_taken = first_taken.clone();
        async move {
            match c.rank().unwrap().0 {
                0 => {
                    let mut got = Vec::new();
                    for _ in 0..3 {
                        let mut b = [0f32; 4];
                        let info = c.recv_any(&mut b, 5).await.expect("recv_any");
                        got.push((info.peer.expect("a sender").0, b[0]));
                        first_taken.notify_one();
                    }
                    // The message with another tag, sent first, waited for its own receive.
                    let mut b = [0f32; 4];
                    let info = c.recv(&mut b, Rank(1), 9).await.expect("recv tag 9");
                    assert_eq!((info.peer, b), (Some(Rank(1)), [9.0; 4]));
                    got
                }
                1 => {
                    c.send(&[9f32; 4], Rank(0), 9).await.expect("send tag 9");
                    first_taken.notified().await;
                    c.send(&[1f32; 4], Rank(0), 5).await.expect("send");
                    c.send(&[11f32; 4], Rank(0), 5).await.expect("send");
                    vec![]
                }
                _ => {
                    c.send(&[2f32; 4], Rank(0), 5).await.expect("send");
                    vec![]
                }
            }
        }
    }))
    .await;
    // Rank 2's message came first; rank 1's two came in the order it sent them.
    assert_eq!(res[0], vec![(2, 2.0), (1, 1.0), (1, 11.0)]);

    // A message of another size than the receive asks for is a mismatch on the
    // receiver, not silent garbage; the next world works.
    let res = join_all(comms.iter_mut().map(|c| async move {
        match c.rank().unwrap().0 {
            0 => {
                let mut b = [0f32; 3];
                c.recv_any(&mut b, 1).await.map(|_| ())
            }
            2 => c.send(&[2f32; 4], Rank(0), 1).await.map(|_| ()),
            _ => Ok(()),
        }
    }))
    .await;
    assert!(
        matches!(res[0], Err(Error::Mismatch { .. })),
        "{:?}",
        res[0]
    );
    for w in join_all(comms.iter_mut().map(|c| c.update_topology())).await {
        w.expect("next world");
    }
    let res = join_all(comms.iter_mut().map(|c| async move {
        match c.rank().unwrap().0 {
            0 => {
                let mut b = [0i64; 2];
                let info = c.recv_any(&mut b, 0).await.expect("recv_any");
                (info.peer.map(|p| p.0), b[0])
            }
            1 => {
                c.send(&[1i64; 2], Rank(0), 0).await.expect("send");
                (None, 0)
            }
            _ => (None, 0),
        }
    }))
    .await;
    assert_eq!(res[0], (Some(1), 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_that_times_out_fails_alone_and_the_world_goes_on() {
    let m = start_master(&[]);
    let mut comms = world_with(&m.addr, 2, |c| c.timeout = Duration::from_millis(800)).await;
    let epoch = comms[0].world().unwrap().epoch;
    // Nobody sends: rank 0's receives (from rank 1, and from anyone) time out.
    let mut b = [0i32; 2];
    let e = comms[0].recv(&mut b, Rank(1), 3).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    let e = comms[0].recv_any(&mut b, 3).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    // The same world goes on: the message sent now is the next receive's, and a
    // collective works without update_topology().
    let res = join_all(comms.iter_mut().map(|c| async move {
        let r = c.rank().unwrap().0;
        if r == 1 {
            c.send(&[5i32, 6], Rank(0), 3).await.expect("send");
        } else {
            let mut b = [0i32; 2];
            c.recv(&mut b, Rank(1), 3)
                .await
                .expect("recv after the timeout");
            assert_eq!(b, [5, 6]);
        }
        let mut x = [r as i32 + 1];
        c.all_reduce(&mut x, eccl::ReduceOp::Sum)
            .await
            .expect("all_reduce");
        (x[0], c.world().unwrap().epoch)
    }))
    .await;
    assert_eq!(res, vec![(3, epoch), (3, epoch)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_send_each_other_more_than_a_link_holds_before_receiving_both_finish() {
    // Three ranks in a ring, each sending 24 MiB to the next before receiving from the
    // one before (a symmetric isend/irecv, torch's batch_isend_irecv): over shared memory
    // a link holds 8 frames of 1 MiB, so each send waited for a receive that came only
    // after it, until the timeout. A send that waits now keeps what arrives meanwhile.
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    const N: usize = 6 << 20; // f32 values: 24 MiB
    let res = join_all(comms.iter_mut().map(|c| async move {
        let (me, n) = (c.rank().unwrap().0, c.world_size());
        let out = vec![me as f32; N];
        c.send(&out, Rank((me + 1) % n), 3).await?;
        let mut got = vec![0f32; N];
        c.recv(&mut got, Rank((me + n - 1) % n), 3).await?;
        Ok::<_, Error>(got)
    }))
    .await;
    for (r, got) in res.into_iter().enumerate() {
        let got = got.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let from = (r + 2) % 3;
        assert!(
            got.iter().all(|&x| x == from as f32),
            "rank {r} got another rank's data"
        );
    }
}
