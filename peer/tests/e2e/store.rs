//! The master's key-value store end to end: a real `eccl-master` process (or three), and
//! store clients of this process. torch's semantics, the bounds (a refused write changes
//! nothing), ephemeral keys and scopes that end with their sessions, bad credentials, no
//! master, and a leader killed under a running client.

use std::time::{Duration, Instant};

use crate::common::*;
use eccl::{Error, Secret, StoreClient};

const T: Duration = Duration::from_secs(10);

fn secret() -> Secret {
    Secret::new(SECRET).unwrap()
}

async fn open(master: &str, scope: &str) -> StoreClient {
    StoreClient::open(master, &secret(), scope, T)
        .await
        .expect("open a store session")
}

fn k(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_keeps_torchs_semantics() {
    let m = start_master(&[]);
    let a = open(&m.addr, "job").await;
    let b = open(&m.addr, "job").await;

    a.set(b"x", b"1").await.unwrap();
    assert_eq!(
        b.get(vec![k("x"), k("y")]).await.unwrap(),
        vec![Some(k("1")), None]
    );
    assert_eq!(a.add(b"n", 5).await.unwrap(), 5);
    assert_eq!(b.add(b"n", -2).await.unwrap(), 3);
    // compare_set as TCPStore: absent + non-empty expectation gives it back, sets nothing.
    assert_eq!(a.compare_set(b"c", b"e", b"d").await.unwrap(), k("e"));
    assert_eq!(a.compare_set(b"c", b"", b"d").await.unwrap(), k("d"));
    assert_eq!(b.compare_set(b"c", b"x", b"z").await.unwrap(), k("d"));
    assert_eq!(b.compare_set(b"c", b"d", b"z").await.unwrap(), k("z"));
    a.append(b"log", b"ab").await.unwrap();
    a.append(b"log", b"cd").await.unwrap();
    assert_eq!(b.get(vec![k("log")]).await.unwrap()[0], Some(k("abcd")));
    a.multi_set(vec![(k("p/1"), k("a")), (k("p/2"), k("b"))])
        .await
        .unwrap();
    assert!(b.check(vec![k("p/1"), k("p/2")]).await.unwrap());
    assert!(!b.check(vec![k("p/1"), k("p/3")]).await.unwrap());
    assert_eq!(b.list(b"p/").await.unwrap().len(), 2);
    assert!(a.delete(b"p/1").await.unwrap());
    assert!(!a.delete(b"p/1").await.unwrap());
    assert_eq!(b.num_keys().await.unwrap(), 5); // x n c log p/2

    // wait: returns once another client sets the key; times out with a typed error.
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move { b.wait_get(vec![k("late")], T).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    a.set(b"late", b"here").await.unwrap();
    assert_eq!(waiter.await.unwrap().unwrap(), vec![Some(k("here"))]);
    let t0 = Instant::now();
    let e = b
        .wait(vec![k("never")], Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { ms: 300, .. }), "{e}");
    assert!(e.to_string().contains("never"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_and_oversized_values_are_refused_and_change_nothing() {
    let m = start_master(&[]);
    let a = open(&m.addr, "job").await;
    a.set(b"k", b"v").await.unwrap();
    let big = vec![7u8; eccl_protocol::StoreLimits::MAX_VALUE + 1];
    for e in [
        a.set(b"k", &big).await.unwrap_err(),
        a.set(b"", b"v").await.unwrap_err(),
        a.set(&vec![b'a'; 5000], b"v").await.unwrap_err(),
        a.multi_set(vec![(k("ok"), k("1")), (k("k"), big.clone())])
            .await
            .unwrap_err(),
        a.add(b"k", 1).await.unwrap_err(),
    ] {
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    assert_eq!(
        a.get(vec![k("k"), k("ok")]).await.unwrap(),
        vec![Some(k("v")), None]
    );
    let e = StoreClient::open(&m.addr, &secret(), "no spaces allowed", T)
        .await
        .err()
        .unwrap();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_keys_and_scopes_end_with_their_sessions() {
    let m = start_master(&[]);
    let a = open(&m.addr, "job").await;
    let b = open(&m.addr, "job").await;
    let other = open(&m.addr, "other").await;
    a.set_ephemeral(b"agent/a", b"1").await.unwrap();
    a.set(b"kept", b"1").await.unwrap();
    other.set(b"kept", b"2").await.unwrap();
    // A session whose client vanishes (its connection drops) ends at once.
    drop(a);
    let t0 = Instant::now();
    while b.get(vec![k("agent/a")]).await.unwrap()[0].is_some() {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "ephemeral key outlived its session"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b.get(vec![k("kept")]).await.unwrap()[0], Some(k("1")));
    // The last session of a scope takes its keys along; a later job starts clean.
    b.close().await.unwrap();
    let c = open(&m.addr, "job").await;
    assert_eq!(c.num_keys().await.unwrap(), 0);
    assert_eq!(other.get(vec![k("kept")]).await.unwrap()[0], Some(k("2")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_or_no_master_fails_clearly_and_in_time() {
    let m = start_master(&[]);
    let wrong = Secret::new("another-secret-0123456789abcdef").unwrap();
    let e = StoreClient::open(&m.addr, &wrong, "job", T)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(e, Error::MasterUnavailable { .. }) && e.to_string().contains("auth"),
        "{e}"
    );
    let port = crate::common::free_port();
    let t0 = Instant::now();
    let e = StoreClient::open(
        &format!("127.0.0.1:{port}"),
        &secret(),
        "job",
        Duration::from_millis(500),
    )
    .await
    .err()
    .unwrap();
    assert!(matches!(e, Error::MasterUnavailable { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_survives_its_leaders_death() {
    let mut cl = crate::masters::Cluster::start("store");
    let list = cl.list();
    let leader = cl.leader(Duration::from_secs(10)).expect("a leader");
    let a = open(&list, "job").await;
    let b = open(&list, "job").await;
    a.set_ephemeral(b"agent/a", b"1").await.unwrap();
    for i in 0..20 {
        assert_eq!(a.add(b"n", 1).await.unwrap(), i + 1);
    }
    cl.kill(leader);
    let t0 = Instant::now();
    // Writes go on at the next leader, exactly once each, and the sessions live on.
    for i in 20..40 {
        assert_eq!(a.add(b"n", 1).await.unwrap(), i + 1);
    }
    eprintln!("first write after the leader's death: {:?}", t0.elapsed());
    assert_eq!(b.get(vec![k("n")]).await.unwrap()[0], Some(k("40")));
    // Past the new leader's grace, the sessions are still alive (they re-attached).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(b.get(vec![k("agent/a")]).await.unwrap()[0], Some(k("1")));
}
