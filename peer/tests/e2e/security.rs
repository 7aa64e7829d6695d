//! Attacks, each run against a real `eccl-master` process and real peers: what a holder
//! of the job secret (or a stranger) can no longer do to the master or to a job. Each
//! test is named after the finding it answers.

use std::time::{Duration, Instant};

use crate::common::*;
use eccl::{Communicator, Error, ReduceOp, Secret};
use eccl_protocol::auth::Role;
use eccl_protocol::{
    MasterMessage, MasterReply, PeerRequest, RegisterRequest, Request, StoreLimits, StoreReply,
    StoreRequest, StoreWrite, PROTOCOL_VERSION,
};
use eccl_transport::control;
use futures::future::join_all;
use tokio::io::AsyncWriteExt;

fn secret() -> Secret {
    Secret::new(SECRET).unwrap()
}

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// A control connection that registered, and the peer id it got.
async fn registered(
    addr: &str,
    host: &str,
) -> (control::ControlConn, Option<eccl::PeerId>, MasterReply) {
    registered_as(addr, host, &secret()).await
}

async fn registered_with(
    addr: &str,
    secret: &Secret,
) -> (control::ControlConn, Option<eccl::PeerId>, MasterReply) {
    registered_as(addr, "h", secret).await
}

async fn registered_as(
    addr: &str,
    host: &str,
    secret: &Secret,
) -> (control::ControlConn, Option<eccl::PeerId>, MasterReply) {
    let mut c = control::connect(addr, secret, Role::PeerToMaster, Duration::from_secs(5))
        .await
        .unwrap();
    let reg = RegisterRequest {
        listen_port: 1,
        quic_port: None,
        shm_name: None,
        advertise_host: None,
        host: host.to_string(),
        rank_hint: None,
        protocol_version: PROTOCOL_VERSION,
    };
    c.send(&Request {
        id: 1,
        body: PeerRequest::Register(reg),
    })
    .await
    .unwrap();
    let reply = loop {
        match c.recv::<MasterMessage>().await.unwrap() {
            MasterMessage::Reply { id: 1, body } => break body,
            _ => continue,
        }
    };
    let id = match &reply {
        MasterReply::Registered { peer_id, .. } => Some(*peer_id),
        _ => None,
    };
    (c, id, reply)
}

/// Eight authenticated connections announce control messages of 16 MiB (the limit) and
/// send a few bytes of each: the master reads bodies as they arrive, so its memory
/// grows by a few KiB per connection, not by what was announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_announcements_cost_the_master_almost_nothing() {
    let m = start_master(&[]);
    let pid = m.proc.0.id();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss(pid);
    let mut held = Vec::new();
    for _ in 0..8 {
        let tcp = tokio::net::TcpStream::connect(&m.addr).await.unwrap();
        let mut tls = eccl_transport::tls::connect(tcp, &secret(), Role::PeerToMaster, &m.addr)
            .await
            .unwrap();
        let len = (eccl_protocol::MAX_CONTROL_MSG as u32).to_le_bytes();
        tls.write_all(&len).await.unwrap();
        tls.write_all(&[0u8; 1000]).await.unwrap();
        tls.flush().await.unwrap();
        held.push(tls);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grew = rss(pid).saturating_sub(before);
    assert!(grew < 16 << 20, "the master grew by {} MiB", grew >> 20);
    // An announcement over the limit ends its connection at once.
    let tcp = tokio::net::TcpStream::connect(&m.addr).await.unwrap();
    let mut tls = eccl_transport::tls::connect(tcp, &secret(), Role::PeerToMaster, &m.addr)
        .await
        .unwrap();
    tls.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(
        Duration::from_secs(2),
        tokio::io::AsyncReadExt::read(&mut tls, &mut b),
    )
    .await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
    // And the master serves the job meanwhile.
    let mut comms = world(&m.addr, 2).await;
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![1.0f32; 1000];
        c.all_reduce(&mut b, ReduceOp::Sum).await.map(|_| b[0])
    }))
    .await;
    assert!(res.into_iter().all(|r| r.unwrap() == 2.0));
    drop(held);
}

/// Fields no real peer sends: a vote with min_world 2^32-1 (it would hold the first
/// world forever), an 8 MB host name, a rank hint past any world.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_fields_are_refused_and_the_first_world_still_forms() {
    let m = start_master(&[]);
    let (_, _, reply) = registered(&m.addr, &"a".repeat(8 << 20)).await;
    assert!(
        matches!(&reply, MasterReply::Error { message, .. } if message.contains("host identity")),
        "{reply:?}"
    );
    let (mut c, id, _) = registered(&m.addr, "host-x").await;
    let id = id.unwrap();
    let vote = PeerRequest::UpdateTopology {
        peer_id: id,
        epoch: 0,
        min_world: u32::MAX,
        aborted: false,
        fresh: vec![],
    };
    c.send(&Request { id: 2, body: vote }).await.unwrap();
    let reply = loop {
        match c.recv::<MasterMessage>().await.unwrap() {
            MasterMessage::Reply { id: 2, body } => break body,
            _ => continue,
        }
    };
    assert!(
        matches!(&reply, MasterReply::Error { message, .. } if message.contains("min_world")),
        "{reply:?}"
    );
    drop(c);
    // The peer's own library refuses it before sending anything.
    let mut cfg = peer_cfg(&m.addr);
    cfg.min_world = u32::MAX;
    assert!(
        matches!(Communicator::connect(cfg).await, Err(Error::InvalidArgument(m)) if m.contains("min_world"))
    );
    // And a real first world forms.
    let comms = world(&m.addr, 2).await;
    assert_eq!(comms[0].world_size(), 2);
}

/// Twice as many silent connections as the master lets authenticate at once: a real
/// peer still registers, well before the silent ones' handshake timeout (5 s) would
/// have freed a slot for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_silent_connections_does_not_lock_a_peer_out() {
    let m = start_master(&[]);
    let mut flood = Vec::new();
    for _ in 0..2 * eccl_transport::admission::MAX_PENDING {
        flood.push(tokio::net::TcpStream::connect(&m.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    let comm = Communicator::connect(peer_cfg(&m.addr))
        .await
        .expect("a real peer registers");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(3), "registering took {took:?}");
    drop(comm);
    drop(flood);
}
/// A process that holds the job secret but is not the member it claims to be
/// dials a member's link port as that other member, for the next epoch, ahead of the
/// real one. Its proof is not the master's, so it is refused; the real link is made and
/// the next collective is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_impostor_racing_a_real_rank_is_refused() {
    use eccl::PeerId;
    use eccl_protocol::LinkHello;
    use tokio::io::AsyncReadExt;

    let m = start_master(&[]);
    let mut cfgs = Vec::new();
    for r in 0..2u32 {
        let mut c = peer_cfg(&m.addr);
        c.rank_hint = Some(r);
        c.min_world = 2;
        c.transport = eccl::TransportChoice::Tcp;
        cfgs.push(c);
    }
    let mut comms = join_all(cfgs.into_iter().map(|c| async move {
        let mut comm = Communicator::connect(c).await.unwrap();
        comm.update_topology().await.unwrap();
        comm
    }))
    .await;
    comms.sort_by_key(|c| c.peer_id());
    let w = comms[0].world().unwrap().clone();
    let (dialer, acceptor) = (comms[0].peer_id(), comms[1].peer_id());
    let acceptor_addr = w
        .members
        .iter()
        .find(|m| m.peer_id == acceptor)
        .unwrap()
        .addr
        .clone();
    // Break epoch 1 (different counts). The link between the two carries on into epoch
    // 2; an impostor claiming the dialer's identity for it must be closed, never used.
    let res = join_all(comms.iter_mut().enumerate().map(|(i, c)| async move {
        let mut b = vec![1.0f32; 10 + i];
        c.all_reduce(&mut b, ReduceOp::Sum).await
    }))
    .await;
    assert!(res.iter().all(|r| r.is_err()), "{res:?}");
    // The impostor: the job secret, the dialer's identity, a proof of its own making.
    let hello = LinkHello {
        from: PeerId(dialer.0),
        to: acceptor,
        epoch: w.epoch + 1,
        stream: 0,
        nstreams: 1,
        proof: [0x42; 32],
    };
    let secret = Secret::new(SECRET).unwrap();
    let (mut imp_r, _imp_w) = eccl_transport::connect::dial_tcp(
        &acceptor_addr,
        &secret,
        &hello,
        false,
        Duration::from_secs(5),
    )
    .await
    .expect("the job secret opens the link port");
    let epochs = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
    assert!(epochs.iter().all(|e| e.is_ok()), "{epochs:?}");
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![3.0f32; 100_000];
        c.all_reduce(&mut b, ReduceOp::Sum).await.map(|_| b[0])
    }))
    .await;
    assert!(
        res.into_iter().all(|r| r.unwrap() == 6.0),
        "exact over the real link"
    );
    // The impostor's connection was dropped, never used.
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), imp_r.read(&mut buf)).await;
    assert!(
        matches!(n, Ok(Ok(0)) | Ok(Err(_))),
        "the impostor must be dropped: {n:?}"
    );
}

/// Peak resident memory of process `pid` (VmHWM), in bytes.
fn peak(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// A raw store client: an authenticated connection with a session open in `scope`.
struct RawStore {
    conn: control::ControlConn,
    next: u64,
    /// The session and its credential.
    session: (u64, [u8; 32]),
}

impl RawStore {
    async fn open(addr: &str, scope: &str) -> RawStore {
        RawStore::open_with(addr, &secret(), scope).await
    }

    async fn open_with(addr: &str, secret: &Secret, scope: &str) -> RawStore {
        let conn = control::connect(addr, secret, Role::PeerToMaster, Duration::from_secs(5))
            .await
            .unwrap();
        let mut s = RawStore {
            conn,
            next: 1,
            session: (0, [0; 32]),
        };
        let r = s
            .ask(StoreRequest::Open {
                scope: scope.into(),
            })
            .await;
        match r {
            MasterReply::Store(StoreReply::Session { session, token, .. }) => {
                s.session = (session, token)
            }
            r => panic!("{r:?}"),
        }
        s
    }

    async fn send(&mut self, req: StoreRequest) -> u64 {
        let id = self.next;
        self.next += 1;
        self.conn
            .send(&Request {
                id,
                body: PeerRequest::Store(req),
            })
            .await
            .unwrap();
        id
    }

    async fn reply(&mut self, id: u64) -> MasterReply {
        loop {
            match tokio::time::timeout(Duration::from_secs(10), self.conn.recv::<MasterMessage>())
                .await
                .expect("the master answers within 10 s")
                .unwrap()
            {
                MasterMessage::Reply { id: got, body } if got == id => return body,
                _ => continue,
            }
        }
    }

    async fn ask(&mut self, req: StoreRequest) -> MasterReply {
        let id = self.send(req).await;
        self.reply(id).await
    }

    async fn set(&mut self, seq: u64, key: &str, value: Vec<u8>) -> MasterReply {
        self.ask(StoreRequest::Write {
            seq,
            op: StoreWrite::Set {
                key: key.into(),
                value,
                ephemeral: false,
            },
        })
        .await
    }
}

fn refused_with(r: &MasterReply, words: &str) -> bool {
    matches!(r, MasterReply::Error { message, .. } if message.contains(words))
}

/// Finding: store read amplification. A `check` naming one 1 MiB key 4,096 times, a
/// `wait` on it beside 100 writes, a `get` naming it 64 times and a `list` of 20 MiB: the
/// master copies no value to answer a check or a wait, refuses a reply larger than
/// `StoreLimits::MAX_REPLY_BYTES` before building it, and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_reads_cannot_make_the_master_copy_gigabytes() {
    // A long lease: this raw client sends no keep-alives between its requests.
    let m = start_master(&["--lease-ms", "60000", "--heartbeat-ms", "1000"]);
    let pid = m.proc.0.id();
    let mut s = RawStore::open(&m.addr, "amplify").await;
    let mut seq = 0;
    for i in 0..20 {
        seq += 1;
        let r = s.set(seq, &format!("k{i}"), vec![i as u8; 1 << 20]).await;
        assert_eq!(r, MasterReply::Store(StoreReply::Done));
    }
    let before = peak(pid);
    let many = vec![b"k0".to_vec(); StoreLimits::MAX_BATCH];
    let r = s.ask(StoreRequest::Check { keys: many.clone() }).await;
    assert_eq!(r, MasterReply::Store(StoreReply::Bool(true)));
    // A wait that stays pending (one key is missing) while 100 writes land.
    let mut waiting = many.clone();
    *waiting.last_mut().unwrap() = b"missing".to_vec();
    let w = s
        .send(StoreRequest::Wait {
            keys: waiting,
            timeout_ms: 3000,
        })
        .await;
    let mut other = RawStore::open(&m.addr, "other").await;
    for i in 0..100 {
        other.set(i + 1, "x", vec![1]).await;
    }
    let grew = peak(pid).saturating_sub(before);
    assert!(
        grew < 64 << 20,
        "the master's peak grew by {} MiB",
        grew >> 20
    );
    let r = s.reply(w).await;
    assert!(refused_with(&r, "timed out"), "{r:?}");
    // Replies past the bound are refused, and the connection serves the next request.
    let r = s
        .ask(StoreRequest::Get {
            keys: vec![b"k0".to_vec(); 64],
        })
        .await;
    assert!(refused_with(&r, "per reply"), "{r:?}");
    let r = s.ask(StoreRequest::List { prefix: vec![] }).await;
    assert!(refused_with(&r, "per reply"), "{r:?}");
    let r = s.ask(StoreRequest::KeepAlive).await;
    assert_eq!(r, MasterReply::Ok);
    // What fits is answered.
    let r = s
        .ask(StoreRequest::Get {
            keys: vec![b"k1".to_vec(); 4],
        })
        .await;
    assert_eq!(
        r,
        MasterReply::Store(StoreReply::Values(vec![Some(vec![1u8; 1 << 20]); 4]))
    );
}

/// Finding: writes without a byte bound. A write larger than
/// `StoreLimits::MAX_WRITE_BYTES` (a multi-set of 5 MiB) is refused before it reaches the
/// masters' log, as is a write the scope would refuse; the store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_writes_never_reach_the_log() {
    let m = start_master(&["--lease-ms", "60000", "--heartbeat-ms", "1000"]);
    let mut s = RawStore::open(&m.addr, "big").await;
    let pairs = (0..5)
        .map(|i| (format!("p{i}").into_bytes(), vec![0u8; 1 << 20]))
        .collect();
    let r = s
        .ask(StoreRequest::Write {
            seq: 1,
            op: StoreWrite::MultiSet { pairs },
        })
        .await;
    assert!(refused_with(&r, "split it"), "{r:?}");
    s.set(2, "text", b"abc".to_vec()).await;
    let r = s
        .ask(StoreRequest::Write {
            seq: 3,
            op: StoreWrite::Add {
                key: b"text".to_vec(),
                delta: 1,
            },
        })
        .await;
    assert!(refused_with(&r, "not an integer"), "{r:?}");
    assert_eq!(
        s.set(4, "ok", vec![7; 1000]).await,
        MasterReply::Store(StoreReply::Done)
    );
}

/// Finding: idle authenticated connections held forever. A connection that says
/// nothing is closed after ten leases (at least 2 s); one that speaks stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed() {
    let m = start_master(&["--lease-ms", "200", "--heartbeat-ms", "50"]);
    let mut idle = control::connect(
        &m.addr,
        &secret(),
        Role::PeerToMaster,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let mut s = RawStore::open(&m.addr, "talks").await;
    let t0 = Instant::now();
    // A client that speaks as real ones do (a keep-alive every lease / 4) meanwhile.
    let talker = tokio::spawn(async move {
        for _ in 0..80 {
            assert_eq!(s.ask(StoreRequest::KeepAlive).await, MasterReply::Ok);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    // Not before ten leases; the upper bound only tells "closed" from "never closed"
    // (a busy host delays the master's sweep, so it is generous).
    let r = tokio::time::timeout(Duration::from_secs(10), idle.recv::<MasterMessage>()).await;
    assert!(matches!(r, Ok(Err(_))), "{r:?}");
    let after = t0.elapsed();
    assert!(
        after >= Duration::from_millis(1900) && after < Duration::from_secs(8),
        "closed after {after:?}"
    );
    talker.await.unwrap();
}

/// Finding: every heartbeat had an answer, most of its cost to the master (a write and
/// the loopback's delivery, `eccl-chaos load`). A request with id
/// [`eccl_protocol::NOTIFICATION`] renews the lease and is answered with nothing, not
/// even an error; after two and a half leases of notifications alone the peer was
/// never evicted (no event) and an awaited heartbeat is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notified_heartbeats_renew_the_lease_unanswered() {
    let m = start_master(&["--lease-ms", "1000", "--heartbeat-ms", "250"]);
    let (c, me, reply) = registered(&m.addr, "h").await;
    let me = me.unwrap_or_else(|| panic!("not registered: {reply:?}"));
    let control::ControlConn { mut rx, mut tx, .. } = c;
    let (got, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Ok(msg) = rx.recv::<MasterMessage>().await {
            if got.send(msg).is_err() {
                break;
            }
        }
    });
    let note = |body| Request {
        id: eccl_protocol::NOTIFICATION,
        body,
    };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(2500) {
        tx.send(&note(PeerRequest::Heartbeat { peer_id: me }))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A notification in another peer's name is refused without an answer as well.
    let other = eccl::PeerId(me.0 + 1000);
    tx.send(&note(PeerRequest::Heartbeat { peer_id: other }))
        .await
        .unwrap();
    tx.send(&Request {
        id: 9,
        body: PeerRequest::Heartbeat { peer_id: me },
    })
    .await
    .unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(5), heard.recv())
        .await
        .expect("no answer to the awaited heartbeat")
        .expect("the connection closed");
    let answer = match msg {
        MasterMessage::Reply { id, body } => (id, body),
        // The only event a peer outside any world can get is its eviction: the
        // notifications did not renew its lease.
        MasterMessage::Event(e) => panic!("{e:?}: the notifications kept no lease"),
    };
    assert_eq!(
        answer,
        (9, MasterReply::Ok),
        "the first answer on the connection"
    );
    reader.abort();
}

/// Finding: store scopes did not separate jobs. Masters that keep another job's store
/// (`--store-job other=FILE`) take that job's secret for its scopes only: the same scope
/// name is two scopes, a session of one job cannot be attached to with the other's
/// secret, the other job's secret opens nothing but its store, and a third secret
/// opens nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_jobs_store_is_apart() {
    let dir = std::env::temp_dir().join(format!("eccl-store-job-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("other");
    let other_secret = "another-jobs-secret-0123456789abcdef";
    std::fs::write(&file, other_secret).unwrap();
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let spec = format!("other={}", file.display());
    let m = start_master(&[
        "--lease-ms",
        "60000",
        "--heartbeat-ms",
        "1000",
        "--store-job",
        &spec,
    ]);
    let other = Secret::new(other_secret).unwrap();
    let mut a = RawStore::open(&m.addr, "rdzv").await;
    let mut b = RawStore::open_with(&m.addr, &other, "rdzv").await;
    let done = MasterReply::Store(StoreReply::Done);
    assert_eq!(a.set(1, "addr", b"mine".to_vec()).await, done);
    let get = |k: &str| StoreRequest::Get {
        keys: vec![k.as_bytes().to_vec()],
    };
    assert_eq!(
        b.ask(get("addr")).await,
        MasterReply::Store(StoreReply::Values(vec![None]))
    );
    assert_eq!(b.set(1, "addr", b"theirs".to_vec()).await, done);
    assert_eq!(
        a.ask(get("addr")).await,
        MasterReply::Store(StoreReply::Values(vec![Some(b"mine".to_vec())]))
    );
    assert_eq!(
        b.ask(StoreRequest::List { prefix: vec![] }).await,
        MasterReply::Store(StoreReply::Pairs(vec![(
            b"addr".to_vec(),
            b"theirs".to_vec()
        )]))
    );
    // The other job's secret cannot attach to this job's session, even with its token.
    let mut c = RawStore::open_with(&m.addr, &other, "x").await;
    let (session, token) = a.session;
    let r = c.ask(StoreRequest::Attach { session, token }).await;
    assert!(refused_with(&r, "has ended"), "{r:?}");
    // Nor register as a peer of the job the masters serve.
    let (_, id, reply) = registered_with(&m.addr, &other).await;
    assert!(id.is_none(), "{reply:?}");
    assert!(refused_with(&reply, "opens that job's store"), "{reply:?}");
    // A secret of neither job opens nothing.
    let third = Secret::new("a-third-jobs-secret-0123456789abcd").unwrap();
    let r = control::connect(&m.addr, &third, Role::PeerToMaster, Duration::from_secs(5)).await;
    assert!(r.is_err(), "a third secret was taken");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding: what many connections hold while large messages arrive. 24 authenticated
/// connections each announce a 16 MiB message and send 8 MiB of it: the master reads
/// large messages within one shared budget (128 MiB; the connections past it are closed
/// instead of read), so it grows by less than the 192 MiB sent, and goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_on_many_connections_stay_within_the_budget() {
    let m = start_master(&[]);
    let pid = m.proc.0.id();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = rss(pid);
    let chunk = vec![0u8; 1 << 20];
    let mut held = Vec::new();
    for _ in 0..24 {
        let tcp = tokio::net::TcpStream::connect(&m.addr).await.unwrap();
        let mut tls = eccl_transport::tls::connect(tcp, &secret(), Role::PeerToMaster, &m.addr)
            .await
            .unwrap();
        let len = (eccl_protocol::MAX_CONTROL_MSG as u32).to_le_bytes();
        let _ = tls.write_all(&len).await;
        for _ in 0..8 {
            if tls.write_all(&chunk).await.is_err() {
                break; // closed by the master: past the budget
            }
        }
        let _ = tls.flush().await;
        held.push(tls);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grew = rss(pid).saturating_sub(before);
    assert!(
        grew < 150 << 20,
        "the master grew by {} MiB for 192 MiB of unfinished messages",
        grew >> 20
    );
    let mut comms = world(&m.addr, 2).await;
    let res = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![1.0f32; 1000];
        c.all_reduce(&mut b, ReduceOp::Sum).await.map(|_| b[0])
    }))
    .await;
    assert!(res.into_iter().all(|r| r.unwrap() == 2.0));
    drop(held);
}
