//! The master cluster under faults and changes, with real `eccl-master` processes: the
//! leader killed during an `update_topology` vote, during a shared-state sync round and
//! while a peer is hung (the next leader evicts it); a SIGSTOPped leader that wakes after a
//! new one was elected commits nothing and evicts no one; masters added and removed at
//! runtime with `eccl-master cluster`, and a recorded change played again is refused.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::masters::{cfg, members, Cluster};
use eccl::{Communicator, ReduceOp, Secret, SharedTensor, SyncStrategy};
use futures::future::join_all;

/// One request to the master at `addr` on a control connection of its own.
async fn ask(addr: &str, body: eccl_protocol::PeerRequest) -> eccl_protocol::MasterReply {
    use eccl_protocol::{auth::Role, MasterMessage, Request};
    let secret = Secret::new(SECRET).unwrap();
    let mut c =
        eccl_transport::control::connect(addr, &secret, Role::PeerToMaster, Duration::from_secs(5))
            .await
            .unwrap();
    c.send(&Request { id: 1, body }).await.unwrap();
    loop {
        if let MasterMessage::Reply { id: 1, body } = c.recv::<MasterMessage>().await.unwrap() {
            return body;
        }
    }
}

async fn exact_all_reduce(comms: &mut [Communicator]) {
    let n = comms.len() as f32;
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut x = vec![1.5f32; 4096];
        c.all_reduce(&mut x, ReduceOp::Sum).await.map(|_| x)
    }))
    .await;
    for r in res {
        let x = r.expect("all_reduce");
        assert!(x.iter().all(|v| *v == 1.5 * n));
    }
}

/// `update_topology` on every member until all of them are in one world (a retryable
/// error means: vote again), within `limit`.
async fn converge(comms: &mut [Communicator], limit: Duration) {
    let start = Instant::now();
    loop {
        let res = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
        let epochs: Vec<u64> = comms.iter().map(|c| c.epoch()).collect();
        if res.iter().all(|r| r.is_ok()) && epochs.iter().all(|e| *e == epochs[0]) {
            return;
        }
        for r in &res {
            if let Err(e) = r {
                assert!(e.is_retryable(), "not retryable: {e}");
            }
        }
        assert!(
            start.elapsed() < limit,
            "no common world after {limit:?}: {res:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_dies_during_an_update_topology_vote() {
    let mut cl = Cluster::start("vote");
    let list = cl.list();
    let leader = cl.leader(Duration::from_secs(10)).expect("a leader");
    let mut comms = members(&list, 3).await;
    let epoch = comms[0].epoch();
    // Two members vote; the leader dies before the third does.
    let (first, last) = comms.split_at_mut(2);
    let voting = join_all(first.iter_mut().map(|c| c.update_topology()));
    let late = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        cl.kill(leader);
        tokio::time::sleep(Duration::from_millis(200)).await;
        last[0].update_topology().await
    };
    let (early, late) = tokio::join!(voting, late);
    // The next leader finishes the round, or every member hears a retryable error and
    // votes again; either way they end in one world with all three.
    for r in early.iter().chain(std::iter::once(&late)) {
        if let Err(e) = r {
            assert!(e.is_retryable(), "not retryable: {e}");
        }
    }
    converge(&mut comms, Duration::from_secs(20)).await;
    assert!(comms.iter().all(|c| c.world_size() == 3));
    assert!(comms[0].epoch() >= epoch);
    exact_all_reduce(&mut comms).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_dies_during_a_shared_state_sync() {
    let mut cl = Cluster::start("sync");
    let list = cl.list();
    let leader = cl.leader(Duration::from_secs(10)).expect("a leader");
    let mut comms = members(&list, 3).await;
    // Rank 0 holds revision 3 of a 2 MiB state; the others hold nothing yet.
    let mut states: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 2 << 20]).collect();
    states[0]
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 251) as u8);
    let revisions = [3u64, 0, 0];
    let start = Instant::now();
    let mut killed = false;
    loop {
        let pairs = comms.iter_mut().zip(states.iter_mut()).zip(revisions);
        let syncs = join_all(pairs.enumerate().map(|(k, ((c, s), rev))| async move {
            if k == 2 {
                // The last member reports after the leader died.
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
            let mut t = [SharedTensor::bytes("state", s)];
            c.sync_shared_state(rev, &mut t, SyncStrategy::EnforcePopular)
                .await
        }));
        let kill = async {
            if !killed {
                tokio::time::sleep(Duration::from_millis(200)).await;
                cl.kill(leader);
                killed = true;
            }
        };
        let (res, ()) = tokio::join!(syncs, kill);
        if res.iter().all(|r| r.is_ok()) {
            break;
        }
        for r in &res {
            if let Err(e) = r {
                assert!(e.is_retryable(), "not retryable: {e}");
            }
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{res:?}");
        converge(&mut comms, Duration::from_secs(20)).await;
    }
    assert!(states.iter().all(|s| s == &states[0]), "one state (G5)");
    assert_eq!(states[0][1000], (1000 % 251) as u8);
    exact_all_reduce(&mut comms).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_leader_evicts_a_peer_that_hung_while_the_leader_died() {
    let mut cl = Cluster::start("hung");
    let list = cl.list();
    let leader = cl.leader(Duration::from_secs(10)).expect("a leader");
    // The third member is a process we can stop: eccl-bench waiting in an all_reduce that
    // the others never join.
    let bench = Proc(
        Command::new(bench_bin())
            .args(["all_reduce", "--master", &list, "--world-size", "3"])
            .args(["-b", "8", "-e", "8", "-n", "1", "-w", "0"])
            .env("ECCL_SECRET", SECRET)
            .env("ECCL_TIMEOUT_MS", "60000")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start eccl-bench"),
    );
    let mut comms = join_all((0..2).map(|r| {
        let list = list.clone();
        async move {
            let mut c = cfg(&list);
            c.rank_hint = Some(r);
            c.min_world = 3;
            let mut comm = Communicator::connect(c).await.expect("connect");
            comm.update_topology().await.expect("first world");
            comm
        }
    }))
    .await;
    assert!(comms.iter().all(|c| c.world_size() == 3));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped_at = Instant::now();
    assert!(Command::new("kill")
        .args(["-STOP", &bench.0.id().to_string()])
        .status()
        .unwrap()
        .success());
    cl.kill(leader);
    // The next leader gives every peer a fresh lease (2 s), then evicts the silent one;
    // the two others form a world without it.
    converge(&mut comms, Duration::from_secs(20)).await;
    let took = stopped_at.elapsed();
    assert!(
        comms.iter().all(|c| c.world_size() == 2),
        "the hung peer is gone"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    eprintln!("hung peer evicted by the next leader; world of 2 after {took:?}");
    exact_all_reduce(&mut comms).await;
    drop(bench);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_leader_commits_nothing_and_evicts_no_one() {
    let mut cl = Cluster::start("stale");
    let list = cl.list();
    let old = cl.leader(Duration::from_secs(10)).expect("a leader");
    let mut comms = members(&list, 2).await;
    cl.stop(old);
    let new = cl
        .leader_other_than(Some(old), Duration::from_secs(10))
        .expect("a new leader while the old one is stopped");
    // The peers find the new leader, and it admits a newcomer.
    let newcomer = tokio::spawn({
        let list = list.clone();
        async move {
            let mut c = Communicator::connect(cfg(&list)).await.expect("connect");
            c.update_topology().await.expect("admitted");
            c
        }
    });
    // Members vote until the newcomer's vote is in the round with theirs.
    let start = Instant::now();
    while comms[0].world_size() < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "newcomer never admitted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        converge(&mut comms, Duration::from_secs(20)).await;
    }
    comms.push(newcomer.await.unwrap());
    comms.sort_by_key(|c| c.rank());
    let epoch = comms[0].epoch();
    assert!(comms
        .iter()
        .all(|c| c.world_size() == 3 && c.epoch() == epoch));

    // The old leader wakes up long after every lease it knew of ran out. It must not
    // evict anyone (it cannot commit) and steps down.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    cl.cont(old);
    let woke = Instant::now();
    while woke.elapsed() < Duration::from_secs(3) {
        exact_all_reduce(&mut comms).await;
    }
    let (up, down) = cl.leadership_lines(old);
    assert!(
        down >= up,
        "the stale leader stepped down ({up} up, {down} down)"
    );
    assert_eq!(cl.leader(Duration::from_secs(1)), Some(new));
    // Nobody was evicted or aborted: the world is the one the new leader made.
    let res = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
    for r in res {
        let u = r.expect("no one was evicted");
        assert!(!u.changed, "the world did not change");
    }
    assert!(comms
        .iter()
        .all(|c| c.epoch() == epoch && c.world_size() == 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_are_added_and_removed_at_runtime() {
    let mut cl = Cluster::start("admin");
    let list = cl.list();
    let leader = cl.leader(Duration::from_secs(10)).expect("a leader");

    let out = cl.cli(&list, &["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("leader: {}", leader + 1)), "{text}");
    assert_eq!(text.matches(" voter ").count(), 3, "{text}");
    let membership_before: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("membership: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("a membership line: {text}"));

    let four = cl.start_joiner();
    let (client, raft) = (cl.clients[four].clone(), cl.rafts[four].clone());
    // The job secret alone cannot change the cluster.
    let wrong = cl.dir.join("wrong-secret");
    std::fs::write(&wrong, "not-the-cluster-secret-0123456789abcdef").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
    let add = |secret: &std::path::Path| {
        let secret = secret.to_str().unwrap().to_string();
        cl.cli(
            &list,
            &[
                "add",
                "--id",
                "4",
                "--client",
                &client,
                "--raft",
                &raft,
                "--cluster-secret-file",
                &secret,
            ],
        )
    };
    let out = add(&wrong);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not signed with this cluster's secret"),
        "{err}"
    );

    let out = add(&cl.cluster_secret());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches(" voter ").count(), 4, "{text}");

    // The add exactly as the CLI sent it (signed for the membership it saw), played
    // again by whoever recorded it: refused as signed for an older membership, before
    // anything else is looked at, and nothing changes.
    let change = eccl_protocol::ClusterChange::Add {
        id: 4,
        client: client.clone(),
        raft: raft.clone(),
    };
    let key = Secret::read_file(&cl.cluster_secret())
        .unwrap()
        .derive(eccl_protocol::ClusterChange::KEY_LABEL);
    let replay = eccl_protocol::PeerRequest::ClusterChange {
        proof: change.proof(&key, membership_before),
        change,
        membership: membership_before,
    };
    match ask(&cl.clients[leader], replay).await {
        eccl_protocol::MasterReply::Error { message, .. } => assert!(
            message.contains(&format!("signed for membership {membership_before}"))
                && message.contains("replay"),
            "{message}"
        ),
        other => panic!("a replayed change was answered {other:?}"),
    }
    let out = cl.cli(&list, &["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches(" voter ").count(), 4, "{text}");

    // Peers that know only the new master are served through it.
    let only_four = cl.clients[four].clone();
    let mut comms = members(&only_four, 2).await;
    exact_all_reduce(&mut comms).await;

    // The leader dies; the three left elect one, and the dead one is removed.
    cl.kill(leader);
    let id = (leader + 1).to_string();
    let out = cl.cli(
        &list,
        &[
            "remove",
            "--id",
            &id,
            "--cluster-secret-file",
            cl.cluster_secret().to_str().unwrap(),
        ],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text.matches(" voter ").count(), 3, "{text}");
    assert!(!text.contains(&cl.clients[leader]), "{text}");
    converge(&mut comms, Duration::from_secs(20)).await;
    exact_all_reduce(&mut comms).await;
}
