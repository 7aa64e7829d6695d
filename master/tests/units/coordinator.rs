//! The leader's soft state across a fail-over, on one in-process master.

use std::collections::BTreeMap;
use std::time::Duration;

use eccl_protocol::auth::Secret;
use eccl_protocol::{MasterMessage, SyncStrategy, TensorDigest};

use eccl_master::coordinator::*;
use eccl_master::raft::RaftRegistry;
use eccl_master::raft::{MasterNode, RaftTiming};
use eccl_master::registry::{Command, Outcome};
use eccl_master::sync::Report;
use eccl_protocol::{MasterReply, PeerId};
use std::sync::Arc;
use tokio::sync::mpsc;

async fn leader_with_two_members() -> (Arc<Coordinator>, u64, PeerId, PeerId) {
    leader_with_two_members_timed(Timing::default()).await
}

async fn leader_with_two_members_timed(timing: Timing) -> (Arc<Coordinator>, u64, PeerId, PeerId) {
    let node = MasterNode::new("127.0.0.1:1", "");
    let secret = Secret::new(b"coordinator-test-secret-0123".to_vec()).unwrap();
    let raft = RaftRegistry::start(
        1,
        node.clone(),
        BTreeMap::from([(1, node)]),
        secret,
        RaftTiming::default(),
        None,
        false,
    )
    .await
    .unwrap();
    let raft = Arc::new(raft);
    let mut ids = Vec::new();
    for i in 0..2u8 {
        let reg = Command::Register {
            addr: format!("10.0.0.{i}:7000"),
            host: format!("h{i}"),
            quic: None,
            shm: None,
            rank_hint: Some(u32::from(i)),
            token: [i; 32],
        };
        match raft.propose(reg).await.unwrap() {
            Outcome::Registered(id) => ids.push(id),
            o => panic!("unexpected {o:?}"),
        }
    }
    let commit = Command::CommitEpoch {
        expected_epoch: 0,
        admit: ids.clone(),
        remove: vec![],
    };
    raft.propose(commit).await.unwrap();
    let epoch = raft.read(|r| r.epoch());
    (Coordinator::new(raft, timing), epoch, ids[0], ids[1])
}

fn report(peer: PeerId, round: u64, revision: u64, h: u8) -> Report {
    Report {
        peer,
        round,
        revision,
        role: SyncStrategy::EnforcePopular,
        tensors: vec![TensorDigest {
            name: "w".into(),
            len: 4,
            hash: [h; 32],
            chunks: vec![[h; 32]],
        }],
    }
}

async fn answer(rx: &mut mpsc::Receiver<Outgoing>) -> (u64, MasterReply) {
    match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
        Ok(Some(Outgoing {
            msg: MasterMessage::Reply { id, body },
            ..
        })) => (id, body),
        Ok(Some(o)) => panic!("not a reply: {:?}", o.msg),
        Ok(None) | Err(_) => panic!("no reply"),
    }
}

#[tokio::test]
async fn a_member_that_missed_a_decided_sync_round_gets_the_plan_the_others_got() {
    let (coord, epoch, a, b) = leader_with_two_members().await;
    let (tx, mut rx) = mpsc::channel(16);
    let to = |id| ReplyTo {
        conn: tx.clone(),
        id,
    };
    coord.sync_report(a, epoch, report(a, 1, 3, 1), to(1)).await;
    coord.sync_report(b, epoch, report(b, 1, 0, 2), to(2)).await;
    let (_, first) = answer(&mut rx).await;
    let (_, second) = answer(&mut rx).await;
    assert_eq!(first, second);
    assert!(
        matches!(&first, MasterReply::SyncPlan { revision: 3, receivers, .. } if receivers == &vec![b]),
        "{first:?}"
    );

    // b's answer was lost (its leader died before sending it): it asks the next leader
    // for round 1 again and gets the decision at once, without a, who has moved on.
    coord.sync_report(b, epoch, report(b, 1, 0, 2), to(3)).await;
    assert_eq!(answer(&mut rx).await, (3, first));

    // Round 2 is a new round: it waits for every member.
    coord.sync_report(b, epoch, report(b, 2, 3, 1), to(4)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rx.try_recv().is_err(), "round 2 answered before a reported");
    coord.sync_report(a, epoch, report(a, 2, 3, 1), to(5)).await;
    let (_, plan) = answer(&mut rx).await;
    assert_eq!(
        answer(&mut rx).await.1,
        plan,
        "both members of round 2 get one plan"
    );
    assert!(
        matches!(plan, MasterReply::SyncPlan { revision: 3, .. }),
        "{plan:?}"
    );

    // Counters that drifted apart (a's round 3 met b's round 4) decide one round; a's
    // next report says round 4 too, but with what a holds now: a new round, not the
    // old plan.
    coord.sync_report(a, epoch, report(a, 3, 4, 5), to(6)).await;
    coord.sync_report(b, epoch, report(b, 4, 4, 5), to(7)).await;
    let _ = answer(&mut rx).await;
    let _ = answer(&mut rx).await;
    coord.sync_report(a, epoch, report(a, 4, 5, 6), to(8)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = rx.try_recv();
    assert!(
        got.is_err(),
        "a was answered with a decided round's plan: {got:?}"
    );
    coord.raft.shutdown().await;
}

/// A peer evicted only when its current connection closes: a connection it replaced, or
/// one from before this master last stepped down, closing later says nothing of the peer.
#[tokio::test]
async fn only_the_close_of_a_peers_current_connection_evicts_it() {
    use eccl_master::registry::PeerState;
    let (coord, _epoch, a, _b) = leader_with_two_members().await;
    let gone = |p: PeerId| {
        coord
            .raft
            .read(|r| r.peer(p).map(|p| matches!(p.state, PeerState::Gone { .. })))
    };
    let (old, _old_rx) = mpsc::channel(16);
    let (new, _new_rx) = mpsc::channel(16);
    coord.attach(a, &[0; 32], old.clone()).await.unwrap();
    coord.attach(a, &[0; 32], new.clone()).await.unwrap();
    coord.connection_closed(a, &old).await;
    assert_eq!(gone(a), Some(false), "evicted for a connection it replaced");
    coord.connection_closed(a, &new).await;
    assert_eq!(gone(a), Some(true), "kept though its connection closed");
}

/// A leader that did not run for longer than a lease (SIGSTOP, a frozen VM) does not
/// evict its peers for the silence its own pause made: every lease starts again.
#[tokio::test]
async fn a_leader_that_stalled_evicts_no_one_for_its_own_pause() {
    use eccl_master::registry::PeerState;
    use eccl_protocol::{StoreReply, StoreRequest};
    // Store sessions with the peers' lease (no floor), so that the stall outlasts theirs
    // as well.
    let timing = Timing {
        store_lease_floor: Duration::ZERO,
        ..Timing::default()
    };
    let (coord, _epoch, a, _b) = leader_with_two_members_timed(timing).await;
    let checker = coord.spawn_lease_checker();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (conn, _rx) = mpsc::channel(16);
    coord.attach(a, &[0; 32], conn).await.unwrap();
    // A store session (a torchrun agent's) whose keep-alives the stall holds up too.
    let (tx, mut rx) = mpsc::channel(16);
    let mut session = None;
    let open = StoreRequest::Open {
        scope: "job".into(),
    };
    coord
        .store_request(&mut session, None, open, ReplyTo { conn: tx, id: 1 })
        .await;
    assert!(
        matches!(
            answer(&mut rx).await.1,
            MasterReply::Store(StoreReply::Session { .. })
        ),
        "no session"
    );
    let id = session.expect("a session");
    // The test's runtime has one thread: blocking it stops the lease checker too, as a
    // SIGSTOP stops the master's process.
    std::thread::sleep(Timing::default().lease * 2);
    tokio::time::sleep(Duration::from_millis(250)).await;
    let state = coord.raft.read(|r| r.peer(a).map(|p| p.state.clone()));
    let open_now = coord.raft.read(|r| r.store().session(id).is_some());
    checker.abort();
    assert!(
        !matches!(state, Some(PeerState::Gone { .. })),
        "evicted for the master's own pause: {state:?}"
    );
    assert!(
        open_now,
        "the store session ended for the master's own pause"
    );
}

/// A silent connection that holds a store session is closed only after the session
/// would have lapsed: closing it ends the session, so an idle timeout under the
/// session's lease would cut it short (8 s against 10 s with the default lease,
/// before). Other connections keep the shorter rule (ten leases, at least 2 s).
#[test]
fn a_silent_connection_outlives_its_store_sessions_lease() {
    for lease_ms in [50, 200, 800, 2000, 30_000] {
        let t = Timing::new(
            Duration::from_millis(lease_ms),
            Duration::from_millis(lease_ms / 4),
        );
        assert!(
            t.store_idle_timeout() >= t.store_lease() + Duration::from_secs(1),
            "lease {lease_ms} ms: idle {:?}, store lease {:?}",
            t.store_idle_timeout(),
            t.store_lease()
        );
        assert!(
            t.store_idle_timeout() >= t.idle_timeout(),
            "lease {lease_ms} ms"
        );
        assert_eq!(t.idle_timeout(), (t.lease * 10).max(Duration::from_secs(2)));
    }
}
