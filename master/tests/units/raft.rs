use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use eccl_protocol::auth::Secret;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use eccl_master::raft::*;
use eccl_master::registry::{Command, Outcome};

fn secret() -> Secret {
    Secret::new(b"raft-test-secret-0123456789".to_vec()).unwrap()
}

fn register(i: u32) -> Command {
    Command::Register {
        addr: format!("10.0.0.{i}:7000"),
        host: format!("h{i}"),
        quic: None,
        shm: None,
        rank_hint: Some(i),
        token: [i as u8; 32],
    }
}

async fn register_three_and_commit(r: &RaftRegistry, expected_epoch: u64) -> u64 {
    let mut ids = Vec::new();
    for i in 0..3 {
        match r.propose(register(i)).await.unwrap() {
            Outcome::Registered(id) => ids.push(id),
            o => panic!("unexpected {o:?}"),
        }
    }
    match r
        .propose(Command::CommitEpoch {
            expected_epoch,
            admit: ids,
            remove: vec![],
        })
        .await
        .unwrap()
    {
        Outcome::Epoch(w) => {
            assert_eq!(w.epoch, expected_epoch + 1);
            w.epoch
        }
        o => panic!("unexpected {o:?}"),
    }
}

#[tokio::test]
async fn single_node_leads_at_once_and_applies_proposals() {
    let node = MasterNode::new("127.0.0.1:1", "");
    let members = BTreeMap::from([(7u64, node.clone())]);
    let r = RaftRegistry::start(
        7,
        node,
        members,
        secret(),
        RaftTiming::default(),
        None,
        false,
    )
    .await
    .unwrap();
    assert!(r.is_leader());
    assert_eq!(r.leader(), Some((7, "127.0.0.1:1".to_string())));
    assert_eq!(r.wait_leader(Duration::from_millis(10)).await, Some(7));

    let epoch = register_three_and_commit(&r, 0).await;
    assert_eq!(epoch, 1);
    let (e, members, pending) = r.read(|reg| {
        (
            reg.epoch(),
            reg.world().map(|w| w.members.len()),
            reg.pending(),
        )
    });
    assert_eq!((e, members, pending.len()), (1, Some(3), 0));
    // A stale compare-and-set is refused by the state machine, not by raft.
    let stale = r
        .propose(Command::CommitEpoch {
            expected_epoch: 0,
            admit: vec![],
            remove: vec![],
        })
        .await
        .unwrap();
    assert!(matches!(stale, Outcome::Rejected(_)), "{stale:?}");

    r.shutdown().await;
    assert!(matches!(
        r.propose(register(9)).await,
        Err(ProposeError::Fatal(_))
    ));
}

struct Node {
    reg: Arc<RaftRegistry>,
    listener: JoinHandle<()>,
}

impl Node {
    fn node_id(&self) -> u64 {
        self.reg.node_id
    }
}

/// Master `id`'s node: its raft listener's address, and a client address that names it.
fn node_at(id: u64, raft: &TcpListener) -> MasterNode {
    MasterNode::new(
        format!("client-of-{id}:48148"),
        raft.local_addr().unwrap().to_string(),
    )
}

async fn start_node(id: u64, listener: TcpListener, members: &BTreeMap<u64, MasterNode>) -> Node {
    let reg = RaftRegistry::start(
        id,
        members[&id].clone(),
        members.clone(),
        secret(),
        RaftTiming::default(),
        None,
        false,
    )
    .await
    .unwrap();
    let reg = Arc::new(reg);
    let r = reg.clone();
    let is_master = Arc::new(move |m| r.is_master(m));
    let listener = tokio::spawn(serve_raft_listener(
        listener,
        reg.raft.clone(),
        secret(),
        is_master,
    ));
    Node { reg, listener }
}

/// A loopback listener for a master that dies and comes back at the same address: below
/// the ephemeral range, so that no connection of this binary's tests takes its port
/// while it is down.
async fn listen_below_ephemeral() -> TcpListener {
    let port = eccl_transport::listen::port_to_listen_later([127, 0, 0, 1].into()).unwrap();
    TcpListener::bind(("127.0.0.1", port)).await.unwrap()
}

async fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Watches every replica's epoch and fails if one ever goes backwards (G6).
fn watch_epochs(handles: Vec<SmHandle>, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut seen = vec![0u64; handles.len()];
        while !stop.load(Ordering::Relaxed) {
            for (h, s) in handles.iter().zip(seen.iter_mut()) {
                let e = h.read().unwrap().registry.epoch();
                assert!(e >= *s, "a replica's epoch went back from {s} to {e}");
                *s = e;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_masters_replicate_redirect_and_fail_over() {
    let mut listeners = Vec::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let l = listen_below_ephemeral().await;
        members.insert(id, node_at(id, &l));
        listeners.push((id, l));
    }
    let mut nodes = BTreeMap::new();
    for (id, l) in listeners {
        nodes.insert(id, start_node(id, l, &members).await);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_epochs(
        nodes.values().map(|n| n.reg.handle()).collect(),
        stop.clone(),
    );

    // One leader, known to all.
    let t0 = Instant::now();
    let mut leaders = Vec::new();
    for n in nodes.values() {
        leaders.push(
            n.reg
                .wait_leader(Duration::from_secs(5))
                .await
                .expect("a leader is elected"),
        );
    }
    wait_until(
        "all masters agree on the leader",
        Duration::from_secs(5),
        || {
            let l: Vec<_> = nodes
                .values()
                .map(|n| n.reg.leader().map(|l| l.0))
                .collect();
            l.iter().all(|x| x.is_some() && *x == l[0])
        },
    )
    .await;
    let leader_id = nodes[&1].reg.leader().unwrap().0;
    eprintln!("leader {leader_id} elected after {:?}", t0.elapsed());
    let leader = &nodes[&leader_id].reg;
    assert!(leader.is_leader());
    assert_eq!(nodes.values().filter(|n| n.reg.is_leader()).count(), 1);

    // Proposals on the leader reach every replica.
    let epoch = register_three_and_commit(leader, 0).await;
    let want = leader.read(|r| r.clone());
    wait_until("replicas converge", Duration::from_secs(5), || {
        nodes.values().all(|n| n.reg.read(|r| *r == want))
    })
    .await;

    // A follower redirects to the leader.
    let follower_id = *nodes.keys().find(|id| **id != leader_id).unwrap();
    match nodes[&follower_id].reg.propose(register(5)).await {
        Err(ProposeError::NotLeader {
            leader_id: l,
            leader_addr,
        }) => {
            assert_eq!(l, Some(leader_id));
            // The leader's client address: what a follower tells a client.
            assert_eq!(
                leader_addr.as_deref(),
                Some(members[&leader_id].client.as_str())
            );
        }
        other => panic!("expected a redirect, got {other:?}"),
    }

    // The leader dies; the other two elect a new one quickly.
    let dead = nodes.remove(&leader_id).unwrap();
    dead.listener.abort();
    dead.reg.shutdown().await;
    let t_kill = Instant::now();
    let mut new_leader_id = None;
    wait_until("a new leader", Duration::from_secs(5), || {
        new_leader_id = nodes
            .values()
            .find(|n| n.reg.is_leader())
            .map(|n| n.node_id());
        new_leader_id.is_some()
    })
    .await;
    let new_leader_id = new_leader_id.unwrap();
    let failover = t_kill.elapsed();
    eprintln!("new leader {new_leader_id} after {failover:?}");
    assert_ne!(new_leader_id, leader_id);
    assert!(
        failover < Duration::from_secs(2),
        "fail-over took {failover:?}"
    );

    // The committed epoch survived (G6), and the next one follows it.
    let new_leader = &nodes[&new_leader_id].reg;
    assert_eq!(new_leader.read(|r| r.epoch()), epoch);
    let stale = new_leader
        .propose(Command::CommitEpoch {
            expected_epoch: epoch - 1,
            admit: vec![],
            remove: vec![],
        })
        .await;
    assert!(matches!(stale, Ok(Outcome::Rejected(_))), "{stale:?}");
    let epoch2 = register_three_and_commit(new_leader, epoch).await;
    assert_eq!(epoch2, epoch + 1);
    let want = new_leader.read(|r| r.clone());
    wait_until("survivors converge", Duration::from_secs(5), || {
        nodes.values().all(|n| n.reg.read(|r| *r == want))
    })
    .await;

    // Snapshot and purge the log on the leader, so that a restarted master must be
    // caught up with a snapshot.
    new_leader.raft.trigger().snapshot().await.unwrap();
    let applied = new_leader
        .raft
        .metrics()
        .borrow()
        .last_applied
        .map(|l| l.index);
    // At or past `applied`: an entry applied meanwhile (the leader's blank entry after
    // its election) makes the snapshot newer, never older.
    wait_until("snapshot built", Duration::from_secs(5), || {
        new_leader.raft.metrics().borrow().snapshot.map(|l| l.index) >= applied
    })
    .await;
    new_leader
        .raft
        .trigger()
        .purge_log(applied.unwrap())
        .await
        .unwrap();
    wait_until("log purged", Duration::from_secs(5), || {
        new_leader.raft.metrics().borrow().purged.map(|l| l.index) == applied
    })
    .await;

    // The dead master comes back as a fresh node at the same address and catches up
    // without disturbing the leader.
    let listener = TcpListener::bind(&members[&leader_id].raft).await.unwrap();
    let back = start_node(leader_id, listener, &members).await;
    let back_handle = back.reg.handle();
    let stop2 = Arc::new(AtomicBool::new(false));
    let watcher2 = watch_epochs(vec![back_handle], stop2.clone());
    wait_until(
        "restarted master catches up",
        Duration::from_secs(5),
        || back.reg.read(|r| *r == want),
    )
    .await;
    assert_eq!(back.reg.leader().map(|l| l.0), Some(new_leader_id));
    assert!(
        back.reg.raft.metrics().borrow().snapshot.is_some(),
        "caught up by a snapshot"
    );
    nodes.insert(leader_id, back);
    let epoch3 = register_three_and_commit(&nodes[&new_leader_id].reg, epoch2).await;
    let want = nodes[&new_leader_id].reg.read(|r| r.clone());
    assert_eq!(want.epoch(), epoch3);
    wait_until("all three converge again", Duration::from_secs(5), || {
        nodes.values().all(|n| n.reg.read(|r| *r == want))
    })
    .await;

    stop.store(true, Ordering::Relaxed);
    stop2.store(true, Ordering::Relaxed);
    watcher.await.unwrap();
    watcher2.await.unwrap();
    for n in nodes.into_values() {
        n.listener.abort();
        n.reg.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_cannot_join_and_the_cluster_forms_without_the_lowest_id() {
    // Masters 2 and 3 are up, master 1 (the designated bootstrapper) never starts:
    // the others bootstrap after their grace period.
    let mut members = BTreeMap::new();
    let mut listeners = Vec::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        members.insert(id, node_at(id, &l));
        listeners.push((id, l));
    }
    let mut nodes = Vec::new();
    for (id, l) in listeners {
        if id == 1 {
            drop(l);
            continue;
        }
        nodes.push(start_node(id, l, &members).await);
    }
    let t0 = Instant::now();
    let leader = nodes[0]
        .reg
        .wait_leader(Duration::from_secs(5))
        .await
        .expect("cluster forms without master 1");
    eprintln!("leader {leader} after {:?}", t0.elapsed());
    let l = nodes.iter().find(|n| n.reg.node_id == leader).unwrap();
    assert_eq!(register_three_and_commit(&l.reg, 0).await, 1);

    // A dialer with the wrong secret is refused by the raft listener.
    let bad = Secret::new(b"another-secret-0123456789".to_vec()).unwrap();
    let res = eccl_transport::control::connect(
        &members[&leader].raft,
        &bad,
        eccl_protocol::auth::Role::MasterToMaster,
        Duration::from_secs(1),
    )
    .await;
    assert!(res.is_err());
    for n in nodes {
        n.listener.abort();
        n.reg.shutdown().await;
    }
}

/// What a holder of the cluster secret who is not a master, or a master speaking in
/// another's name, can do to the raft listener: nothing. Unknown ids are dropped before
/// any request; a vote in another master's name and an append-entries with term
/// 2^64-1 (which once made openraft panic on `term + 1`) end the connection
/// unanswered; the leader and its term stay, and the cluster goes on committing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_probes_are_refused_and_the_cluster_goes_on() {
    use eccl_protocol::auth::Role;
    use eccl_transport::control;
    use openraft::raft::{AppendEntriesRequest, VoteRequest};
    use openraft::Vote;

    let mut members = BTreeMap::new();
    let mut listeners = Vec::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        members.insert(id, node_at(id, &l));
        listeners.push((id, l));
    }
    let mut nodes = BTreeMap::new();
    for (id, l) in listeners {
        nodes.insert(id, start_node(id, l, &members).await);
    }
    let leader = nodes[&1]
        .reg
        .wait_leader(Duration::from_secs(5))
        .await
        .unwrap();
    wait_until(
        "every master knows the leader",
        Duration::from_secs(5),
        || {
            nodes
                .values()
                .all(|n| n.reg.leader().map(|l| l.0) == Some(leader))
        },
    )
    .await;
    let term = nodes[&leader].reg.raft.metrics().borrow().current_term;
    let target = nodes.keys().copied().find(|id| *id != leader).unwrap();
    let probe = |from: u64, rpc: RaftRpc| {
        let addr = members[&target].raft.clone();
        async move {
            let mut c = control::connect(
                &addr,
                &secret(),
                Role::MasterToMaster,
                Duration::from_secs(2),
            )
            .await
            .expect("the cluster secret opens the raft listener");
            c.send(&RaftHello { from }).await.unwrap();
            let _ = c.send(&rpc).await;
            tokio::time::timeout(Duration::from_secs(2), c.recv::<RaftRpcReply>()).await
        }
    };
    // A node outside the cluster asks for votes, at a term that would win.
    let vote = |term, id| RaftRpc::Vote(VoteRequest::new(Vote::new(term, id), None));
    let r = probe(99, vote(term + 5, 99)).await;
    assert!(
        matches!(r, Ok(Err(_))),
        "an unknown master is answered nothing: {r:?}"
    );
    // A master's connection asks in another master's name.
    let r = probe(target % 3 + 1, vote(term + 5, leader)).await;
    assert!(
        matches!(r, Ok(Err(_))),
        "a vote in another's name is answered nothing: {r:?}"
    );
    // An append-entries at term 2^64-1 in the sender's own name.
    let append = RaftRpc::AppendEntries(AppendEntriesRequest {
        vote: Vote::new(u64::MAX, leader),
        prev_log_id: None,
        entries: vec![],
        leader_commit: None,
    });
    let r = probe(leader, append).await;
    assert!(
        matches!(r, Ok(Err(_))),
        "an absurd term is answered nothing: {r:?}"
    );
    // Nothing moved: the same leader at the same term, and it still commits.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in nodes.values() {
        assert_eq!(n.reg.leader().map(|l| l.0), Some(leader));
        assert!(n.reg.raft.metrics().borrow().current_term < TERM_LIMIT);
    }
    assert_eq!(
        nodes[&leader].reg.raft.metrics().borrow().current_term,
        term
    );
    assert_eq!(register_three_and_commit(&nodes[&leader].reg, 0).await, 1);
    for n in nodes.into_values() {
        n.listener.abort();
        n.reg.shutdown().await;
    }
}

/// Finding: the raft listener turned masters away once 16 connections sat silent in
/// their handshake. With 40 silent connections held open on each follower's raft
/// listener, the leader stops: the two followers, which never spoke to each other
/// before, connect, elect one of them and commit (the oldest silent handshake makes
/// room, as on the client listener).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_do_not_keep_masters_apart() {
    let mut members = BTreeMap::new();
    let mut listeners = Vec::new();
    for id in 1..=3u64 {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        members.insert(id, node_at(id, &l));
        listeners.push((id, l));
    }
    let mut nodes = BTreeMap::new();
    for (id, l) in listeners {
        nodes.insert(id, start_node(id, l, &members).await);
    }
    let leader = nodes[&1]
        .reg
        .wait_leader(Duration::from_secs(5))
        .await
        .unwrap();
    let followers: Vec<u64> = nodes.keys().copied().filter(|id| *id != leader).collect();
    let mut silent = Vec::new();
    for f in &followers {
        for _ in 0..40 {
            silent.push(
                tokio::net::TcpStream::connect(&members[f].raft)
                    .await
                    .unwrap(),
            );
        }
    }
    let old = nodes.remove(&leader).unwrap();
    old.listener.abort();
    old.reg.shutdown().await;
    // An election needs the followers' raft listeners (election timeouts are 150-300 ms;
    // a handshake slot held by a silent connection was freed only after 5 s).
    wait_until(
        "a follower leads, beside 80 silent connections",
        Duration::from_secs(3),
        || nodes.values().any(|n| n.reg.is_leader()),
    )
    .await;
    let new = nodes
        .values()
        .find(|n| n.reg.is_leader())
        .unwrap()
        .reg
        .clone();
    let e = new.read(|r| r.epoch());
    assert_eq!(register_three_and_commit(&new, e).await, e + 1);
    drop(silent);
    for n in nodes.into_values() {
        n.listener.abort();
        n.reg.shutdown().await;
    }
}

/// Finding: the in-memory raft log could hold GiBs (1,000 entries of up to 16 MiB kept
/// behind each snapshot). 300 store writes of 1 MiB: the log asks for a snapshot once
/// its entries pass 64 MiB and is purged behind it, so what it holds stays bounded (a
/// log bounded by entry count alone held all 300 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_bounded_by_bytes() {
    use eccl_master::store::StoreCommand;
    use eccl_protocol::StoreWrite;
    let node = MasterNode::new("127.0.0.1:1", "");
    let members = BTreeMap::from([(1u64, node.clone())]);
    let r = RaftRegistry::start(
        1,
        node,
        members,
        secret(),
        RaftTiming::default(),
        None,
        false,
    )
    .await
    .unwrap();
    let session = match r
        .propose(Command::Store(StoreCommand::Open {
            scope: "s".into(),
            token: [1; 32],
        }))
        .await
        .unwrap()
    {
        Outcome::Store(Ok(eccl_protocol::StoreReply::Session { session, .. })) => session,
        o => panic!("{o:?}"),
    };
    let mut most = 0;
    for seq in 1..=300 {
        let op = StoreWrite::Set {
            key: b"k".to_vec(),
            value: vec![seq as u8; 1 << 20],
            ephemeral: false,
        };
        let out = r
            .propose(Command::Store(StoreCommand::Write { session, seq, op }))
            .await
            .unwrap();
        assert!(matches!(out, Outcome::Store(Ok(_))), "{out:?}");
        most = most.max(r.log_bytes());
    }
    let bound = 2 * log_store::SNAPSHOT_AT_BYTES;
    assert!(most < bound, "the log held {} MiB", most >> 20);
    wait_until(
        "the log purged behind a snapshot",
        Duration::from_secs(5),
        || r.log_bytes() < log_store::SNAPSHOT_AT_BYTES,
    )
    .await;
    r.shutdown().await;
}

#[test]
fn handle_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<RaftRegistry>();
    check::<SmHandle>();
}

/// A master started with a data directory comes back from a crash (here: a shutdown and
/// a new process's worth of state: nothing but the directory is shared) with its
/// registry: the peers, their credentials, the epoch; past a snapshot too, since more
/// entries than `SNAPSHOT_EVERY` were written. Its shutdown releases the directory at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_restarts_from_its_data_dir_with_its_registry() {
    let dir = std::env::temp_dir().join(format!("eccl-raft-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let node = MasterNode::new("127.0.0.1:1", "");
    let members = BTreeMap::from([(7u64, node.clone())]);
    let start = || {
        RaftRegistry::start(
            7,
            node.clone(),
            members.clone(),
            secret(),
            RaftTiming::default(),
            Some(&dir),
            false,
        )
    };
    let r = start().await.unwrap();
    let epoch = register_three_and_commit(&r, 0).await;
    // Refused compare-and-sets are log entries like any other: enough of them for a
    // snapshot and a purge of the log behind it.
    for _ in 0..SNAPSHOT_EVERY + 50 {
        let o = r
            .propose(Command::CommitEpoch {
                expected_epoch: 0,
                admit: vec![],
                remove: vec![],
            })
            .await
            .unwrap();
        assert!(matches!(o, Outcome::Rejected(_)));
    }
    let before = r.read(|reg| reg.clone());
    // Shutting down releases the directory at once: nothing of the master's own keeps it
    // open (a handle on the log once held it, and every shutdown waited 10 s).
    let stopping = Instant::now();
    r.shutdown().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(3),
        "shutdown took {:?}",
        stopping.elapsed()
    );
    drop(r);

    let r = start().await.unwrap();
    r.wait_leader(Duration::from_secs(5))
        .await
        .expect("leads again");
    // The registry comes back once the restarted node has applied its log.
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.read(|reg| reg.clone()) != before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(r.read(|reg| reg.clone()), before);
    assert_eq!(r.read(|reg| reg.epoch()), epoch);
    let o = r.propose(register(9)).await.unwrap();
    assert!(matches!(o, Outcome::Registered(_)), "{o:?}");
    r.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
