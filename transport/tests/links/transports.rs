//! Every transport's links, end to end in one process: frames in order and intact over
//! slot and stream reuse, abort frames seen at once, clean and unclean ends reported
//! after the frames sent before them, the job secret required (and its absence named),
//! and garbage refused without harm to the listener.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use eccl_protocol::auth::{AuthError, Secret};
use eccl_protocol::frame::FrameKind;
use eccl_transport::connect::{dial_quic, dial_shm, dial_tcp};
use eccl_transport::link::{LinkEvent, LinkObserver, LinkRx, LinkTx, Transport};
use eccl_transport::listen::Conn;
use eccl_transport::{shm, TransportError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A link over `t` from a dialer to an acceptor: (dialer's halves, acceptor's halves).
async fn pair(t: Transport, observer: Arc<Seen>) -> ((LinkTx, LinkRx), (LinkTx, LinkRx)) {
    let mut l = listeners(false).await;
    let obs: Arc<dyn LinkObserver> = observer;
    match t {
        Transport::Tcp | Transport::Tls => {
            let addr = l.tcp_addr.to_string();
            let mut dialed = Vec::new();
            for s in 0..2 {
                dialed.push(
                    dial_tcp(&addr, &secret(), &hello(s, 2), t == Transport::Tls, T)
                        .await
                        .unwrap(),
                );
            }
            let mut accepted = Vec::new();
            for _ in 0..2 {
                let a = next_accepted(&mut l).await;
                assert_eq!(a.conn.transport(), t);
                match a.conn {
                    Conn::Stream { read, write, .. } => {
                        accepted.push((a.hello.stream, read, write))
                    }
                    _ => panic!("a stream connection"),
                }
            }
            accepted.sort_by_key(|(s, _, _)| *s);
            let accepted = accepted.into_iter().map(|(_, r, w)| (r, w)).collect();
            let d = eccl_transport::connect::stream_link(
                "acceptor".into(),
                t,
                dialed,
                obs.clone(),
                1 << 26,
                None,
            );
            let a = eccl_transport::connect::stream_link(
                "dialer".into(),
                t,
                accepted,
                obs,
                1 << 26,
                None,
            );
            (d, a)
        }
        Transport::Shm => {
            let name = l.shm_name.clone().unwrap();
            let (sec, h) = (secret(), hello(0, 1));
            let dial = dial_shm(&name, &sec, &h, 1 << 20, "acceptor".into(), obs.clone(), T);
            let accept = async {
                let a = next_accepted(&mut l).await;
                match a.conn {
                    Conn::Shm(s) => shm::accept_link(s, "dialer".into(), obs.clone(), T)
                        .await
                        .unwrap(),
                    _ => panic!("a shm connection"),
                }
            };
            let (d, a) = tokio::join!(dial, accept);
            (d.unwrap(), a)
        }
        Transport::Quic => {
            let ep = l.quic.clone().unwrap();
            let addr = l.quic_addr.unwrap();
            let q = dial_quic(&ep, addr, &secret(), &hello(0, 3), T)
                .await
                .unwrap();
            let a = next_accepted(&mut l).await;
            let Conn::Quic(qa) = a.conn else {
                panic!("a QUIC connection")
            };
            assert_eq!(qa.streams.len(), 3);
            let (ds, dc) = q.into_parts();
            let (as_, ac) = qa.into_parts();
            let d = eccl_transport::connect::stream_link(
                "acceptor".into(),
                t,
                ds,
                obs.clone(),
                1 << 26,
                Some(dc),
            );
            let a = eccl_transport::connect::stream_link(
                "dialer".into(),
                t,
                as_,
                obs,
                1 << 26,
                Some(ac),
            );
            // Keep the listeners' endpoint (it carries both connections) alive.
            std::mem::forget(l);
            (d, a)
        }
        Transport::Verbs => verbs_pair(obs).await,
    }
}

/// Both ends of a verbs link set up over a loopback TCP stream (the peer's dial path
/// authenticates that stream first; `establish` takes it from there).
#[cfg(feature = "verbs")]
async fn verbs_pair(obs: Arc<dyn LinkObserver>) -> ((LinkTx, LinkRx), (LinkTx, LinkRx)) {
    use eccl_transport::verbs::{establish, VerbsOptions};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (d, a) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    let opts = VerbsOptions::default();
    let (d, a) = tokio::join!(
        establish(d.unwrap(), "acceptor".into(), opts.clone(), obs.clone(), T),
        establish(a.unwrap().0, "dialer".into(), opts, obs, T)
    );
    (d.unwrap(), a.unwrap())
}

#[cfg(not(feature = "verbs"))]
async fn verbs_pair(_: Arc<dyn LinkObserver>) -> ((LinkTx, LinkRx), (LinkTx, LinkRx)) {
    panic!("verbs links need the `verbs` feature")
}

async fn round_trip(t: Transport) {
    let seen = Arc::new(Seen::default());
    let ((mut dtx, mut drx), (mut atx, mut arx)) = pair(t, seen.clone()).await;
    // Messages larger than a slot (so slots are reused) and odd-sized ones, both ways.
    for (i, len) in [0usize, 1, 4095, 3 << 20, 11 << 20].into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|k| (k * 31 + i) as u8).collect();
        let h = header(FrameKind::Data, i as u64);
        let send = dtx.send_region(h, &data, 1 << 20, 4, T);
        let recv = recv_message(&mut arx, len);
        let (s, got) = tokio::join!(send, recv);
        s.unwrap();
        assert!(got == data, "{t}: message {i} of {len} bytes intact");
        let back = atx.send_region(h, &data, 256 << 10, 1, T);
        let recv = recv_message(&mut drx, len);
        let (s, got) = tokio::join!(back, recv);
        s.unwrap();
        assert!(got == data, "{t}: reply {i} intact");
    }
    // An abort is seen by the other side's observer without anyone reading the link.
    atx.send_frame(header(FrameKind::Abort, 9), b"stop now", T)
        .await
        .unwrap();
    tokio::time::timeout(T, async {
        while !seen.0.lock().unwrap().iter().any(|s| s == "abort stop now") {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the abort reaches the observer");
    // A clean close ends the link after the frames sent before it; both sides close,
    // and each close returns once both are done (QUIC keeps the connection till then).
    dtx.send_region(header(FrameKind::Data, 10), &[5u8; 100], 1 << 20, 1, T)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let dialer_side = dtx.close(header(FrameKind::Close, 0));
    let acceptor_side = async {
        assert_eq!(recv_message(&mut arx, 100).await, vec![5u8; 100]);
        match tokio::time::timeout(T, arx.next())
            .await
            .expect("the end in time")
        {
            Some(LinkEvent::Failed(e)) => {
                assert!(matches!(*e, TransportError::Closed { .. }), "{t}: {e}")
            }
            Some(LinkEvent::Frame(f)) => panic!("{t}: a frame after close: {:?}", f.header),
            None => {}
        }
        atx.close(header(FrameKind::Close, 0)).await;
    };
    tokio::join!(dialer_side, acceptor_side);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{t}: closing took {:?}",
        started.elapsed()
    );
    drop(drx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_links_round_trip() {
    round_trip(Transport::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_links_round_trip() {
    round_trip(Transport::Tls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_links_round_trip() {
    round_trip(Transport::Shm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_links_round_trip() {
    round_trip(Transport::Quic).await;
}

/// Runs where `ibv_devices` lists a device; says why it skipped elsewhere.
#[cfg(feature = "verbs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_links_round_trip() {
    match eccl_transport::verbs::probe() {
        Ok(devices) if !devices.is_empty() => round_trip(Transport::Verbs).await,
        Ok(_) => eprintln!("verbs_links_round_trip skipped: RDMA works but no device is listed"),
        Err(why) => eprintln!("verbs_links_round_trip skipped: {why}"),
    }
}

/// Without a device, setting a verbs link up fails at once with a typed error naming
/// the cause (no panic, no hang), and the other side's wait for its hello ends too.
#[cfg(feature = "verbs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_link_without_a_device_fails_with_its_cause() {
    use eccl_transport::verbs::{establish, probe, VerbsOptions};
    if probe().is_ok_and(|d| !d.is_empty()) {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (d, a) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    let obs: Arc<dyn LinkObserver> = Arc::new(Seen::default());
    let opts = VerbsOptions::default();
    let started = std::time::Instant::now();
    let (d, a) = tokio::join!(
        establish(d.unwrap(), "acceptor".into(), opts.clone(), obs.clone(), T),
        establish(
            a.unwrap().0,
            "dialer".into(),
            opts,
            obs,
            Duration::from_secs(2)
        )
    );
    let e = d.err().expect("no link without a device");
    let text = e.to_string();
    assert!(matches!(e, TransportError::Verbs { .. }), "{text}");
    assert!(text.contains("acceptor") && text.contains("RDMA"), "{text}");
    assert!(a.is_err(), "the other side gets no link either");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// Options a queue pair could not be made with are refused before anything starts.
#[cfg(feature = "verbs")]
#[tokio::test]
async fn verbs_options_out_of_range_are_refused() {
    use eccl_transport::verbs::{establish, VerbsOptions};
    let obs: Arc<dyn LinkObserver> = Arc::new(Seen::default());
    for (opts, why) in [
        (
            VerbsOptions {
                slots: 0,
                ..Default::default()
            },
            "0 receive slots",
        ),
        (
            VerbsOptions {
                slot_bytes: 64,
                ..Default::default()
            },
            "64 bytes per slot",
        ),
        (
            VerbsOptions {
                slots: 1 << 20,
                ..Default::default()
            },
            "slots (1 to",
        ),
    ] {
        let (a, _b) = tokio::io::duplex(64);
        let e = establish(a, "p".into(), opts, obs.clone(), T)
            .await
            .err()
            .expect("refused");
        assert!(
            matches!(e, TransportError::Verbs { .. }) && e.to_string().contains(why),
            "{e}"
        );
    }
}

/// A peer that vanishes (its process killed: every descriptor closed) fails the shm link
/// after the frames it published, and a sender blocked on a full ring is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_shm_peer_fails_the_link_after_its_frames() {
    let seen = Arc::new(Seen::default());
    let ((mut dtx, drx), (atx, mut arx)) = pair(Transport::Shm, seen.clone()).await;
    dtx.send_region(header(FrameKind::Data, 1), &[7u8; 5000], 1 << 20, 1, T)
        .await
        .unwrap();
    drop((dtx, drx));
    assert_eq!(recv_message(&mut arx, 5000).await, vec![7u8; 5000]);
    match tokio::time::timeout(T, arx.next())
        .await
        .expect("the end in time")
    {
        Some(LinkEvent::Failed(_)) | None => {}
        Some(LinkEvent::Frame(_)) => panic!("no frame after the end"),
    }
    // The other direction: fill the vanished peer's ring; the send fails, never hangs.
    let mut atx = atx;
    let big = vec![1u8; 1 << 20];
    let r = tokio::time::timeout(Duration::from_secs(3), async {
        for i in 0..64 {
            atx.send_region(header(FrameKind::Data, i), &big, 1 << 20, 1, T)
                .await?;
        }
        Ok::<(), TransportError>(())
    })
    .await
    .expect("a full ring to a dead peer fails promptly");
    assert!(r.is_err(), "sending to a dead peer must fail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_refused_on_every_transport_and_says_why() {
    let mut l = listeners(false).await;
    let wrong = Secret::new("not-the-secret-of-this-job-00000").unwrap();
    let h = hello(0, 1);
    let is_auth = |e: &TransportError| {
        matches!(
            e,
            TransportError::Auth {
                source: AuthError::Rejected | AuthError::BadProof,
                ..
            }
        ) && e.to_string().contains("secret")
    };
    for tls in [false, true] {
        match dial_tcp(&l.tcp_addr.to_string(), &wrong, &h, tls, T).await {
            Err(e) => assert!(is_auth(&e), "tls={tls}: {e}"),
            Ok(_) => panic!("tls={tls}: a wrong secret got a link"),
        }
    }
    let obs: Arc<dyn LinkObserver> = Arc::new(Seen::default());
    match dial_shm(
        l.shm_name.as_ref().unwrap(),
        &wrong,
        &h,
        1 << 20,
        "x".into(),
        obs,
        T,
    )
    .await
    {
        Err(e) => assert!(is_auth(&e), "shm: {e}"),
        Ok(_) => panic!("shm: a wrong secret got a link"),
    }
    let ep = l.quic.clone().unwrap();
    match dial_quic(&ep, l.quic_addr.unwrap(), &wrong, &h, T).await {
        Err(e) => assert!(is_auth(&e), "quic: {e}"),
        Ok(_) => panic!("quic: a wrong secret got a link"),
    }
    // Nothing reached the caller of the listeners.
    assert!(l.accepted.try_recv().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_truncation_and_plaintext_are_refused_and_the_listeners_go_on() {
    let mut l = listeners(true).await;
    let tcp = l.tcp_addr;
    // Garbage instead of a mode byte; a TLS mode byte then garbage records; a TLS mode
    // byte then nothing; and plaintext at a peer that requires TLS.
    for bytes in [
        &[0x5au8; 300][..],
        &[b'T', 0x16, 3, 3, 0xff, 0xff, 1, 2, 3][..],
        &[b'T'][..],
        &[b'P'][..],
    ] {
        let mut s = tokio::net::TcpStream::connect(tcp).await.unwrap();
        s.write_all(bytes).await.unwrap();
        let _ = s.shutdown().await;
        let mut rest = Vec::new();
        let _ = tokio::time::timeout(T, s.read_to_end(&mut rest)).await;
    }
    let plain = dial_tcp(&tcp.to_string(), &secret(), &hello(0, 1), false, T).await;
    assert!(
        plain.is_err(),
        "plaintext must be refused where TLS is required"
    );
    // Garbage and truncated datagrams at the QUIC endpoint.
    let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let q = l.quic_addr.unwrap();
    for len in [1usize, 7, 1200, 1500, 6000] {
        let junk: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        udp.send_to(&junk, q).await.unwrap();
    }
    // Garbage on the shm socket.
    {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(
            l.shm_name.as_ref().unwrap().as_bytes(),
        )
        .unwrap();
        let mut s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        use std::io::Write;
        let _ = s.write_all(&[0x42; 100]);
    }
    // Every listener still takes a real link.
    let h = hello(0, 1);
    dial_tcp(&tcp.to_string(), &secret(), &h, true, T)
        .await
        .expect("a TLS link after the garbage");
    assert_eq!(next_accepted(&mut l).await.conn.transport(), Transport::Tls);
    let ep = l.quic.clone().unwrap();
    let q = dial_quic(&ep, l.quic_addr.unwrap(), &secret(), &h, T)
        .await
        .expect("a QUIC link after the garbage");
    assert_eq!(
        next_accepted(&mut l).await.conn.transport(),
        Transport::Quic
    );
    drop(q);
    let obs: Arc<dyn LinkObserver> = Arc::new(Seen::default());
    let name = l.shm_name.clone().unwrap();
    let sec = secret();
    let dial = dial_shm(&name, &sec, &h, 1 << 20, "a".into(), obs.clone(), T);
    let accept = async {
        let a = next_accepted(&mut l).await;
        let Conn::Shm(s) = a.conn else { panic!("shm") };
        shm::accept_link(s, "d".into(), obs.clone(), T).await
    };
    let (d, a) = tokio::join!(dial, accept);
    d.expect("a shm link after the garbage");
    a.expect("accepted");
}

/// A man in the middle who terminates TLS on both sides and relays every byte between
/// the two sessions (he needs no secret to relay) cannot splice them: each end binds its
/// proof to its own session's keying material, so the acceptor refuses the relayed one
/// and the dialer learns that authentication failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_between_two_tls_sessions_is_refused() {
    use eccl_transport::tls;
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    let mut l = listeners(false).await;
    let target = l.tcp_addr;
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let mitm = tokio::spawn(async move {
        let (mut inbound, _) = relay.accept().await.unwrap();
        let mut mode = [0u8; 1];
        inbound.read_exact(&mut mode).await.unwrap();
        let tls_in = TlsAcceptor::from(tls::server_config().unwrap())
            .accept(inbound)
            .await
            .unwrap();
        let mut outbound = tokio::net::TcpStream::connect(target).await.unwrap();
        outbound.write_all(&mode).await.unwrap();
        let tls_out = TlsConnector::from(tls::client_config().unwrap())
            .connect(ServerName::try_from("eccl").unwrap(), outbound)
            .await
            .unwrap();
        // Relay both ways, passing each end on as a proxy does.
        let (mut ir, mut iw) = tokio::io::split(tls_in);
        let (mut or, mut ow) = tokio::io::split(tls_out);
        let up = async {
            let _ = tokio::io::copy(&mut ir, &mut ow).await;
            let _ = ow.shutdown().await;
        };
        let down = async {
            let _ = tokio::io::copy(&mut or, &mut iw).await;
            let _ = iw.shutdown().await;
        };
        tokio::join!(up, down);
    });
    match dial_tcp(&relay_addr.to_string(), &secret(), &hello(0, 1), true, T).await {
        Err(e) => assert!(
            matches!(e, TransportError::Auth { .. }),
            "the relayed handshake must fail authentication: {e}"
        ),
        Ok(_) => panic!("a spliced TLS session got a link"),
    }
    assert!(
        l.accepted.try_recv().is_err(),
        "nothing reached the acceptor's caller"
    );
    mitm.abort();
}

/// Finding: QUIC buffered tens of MiB per connection before eccl's handshake (64
/// streams of 32 MiB windows each). A stranger whose connection is not authenticated
/// gets one stream (the one the handshake reads, and refuses garbage on) and a 64 KiB
/// connection window: a second stream, where it could park data unread, is never
/// granted; a real link is set up as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_gets_one_stream_and_a_small_window_before_the_handshake() {
    use eccl_transport::quic;
    let l = listeners(false).await;
    let ep = quic::endpoint("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = ep
        .connect_with(
            quic::client_config("test").unwrap(),
            l.quic_addr.unwrap(),
            "eccl",
        )
        .unwrap()
        .await
        .unwrap();
    let (mut w, _r) = conn.open_bi().await.unwrap();
    // The mode byte of a QUIC link, then nothing: the acceptor waits for the handshake.
    w.write_all(b"Q").await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(1), async {
        let (mut w2, _r2) = conn.open_bi().await?;
        w2.write_all(&vec![0u8; 1 << 20]).await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })
    .await;
    assert!(
        second.is_err(),
        "a second stream took 1 MiB before any handshake: {second:?}"
    );
    drop(conn);
    // A real link over the same listener still comes up, with its streams.
    let obs = Arc::new(Seen::default());
    let (a, b) = pair(Transport::Quic, obs).await;
    drop((a, b));
}

/// Finding: the shm listener's abstract socket has no file permissions, and it took
/// any local user's connection to the job secret's handshake. A process of another
/// user (uid 65534 here) is closed on before a byte is read or sent; the job's own user
/// is served. Needs root to start the other user's process (CI runs as root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_process_is_refused_on_the_shm_socket() {
    use std::os::unix::process::CommandExt;
    if !nix_is_root() {
        eprintln!("not run: starting another user's process needs root");
        return;
    }
    let l = listeners(false).await;
    let name = l.shm_name.clone().unwrap();
    // The stranger connects, says it is a plain link and waits for the handshake's
    // first message; it prints how many bytes it got (0 once the socket is closed on it,
    // whether its send or its receive sees that first).
    let script = format!(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect('\\0{name}')\n\
         try:\n s.sendall(b'P'); s.settimeout(5); print(len(s.recv(100)))\n\
         except OSError: print(0)"
    );
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .args(["-c", &script])
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "the stranger was answered"
    );
    // The job's own user still gets a link.
    let obs = Arc::new(Seen::default());
    let (a, b) = pair(Transport::Shm, obs).await;
    drop((a, b));
}

fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|v| v.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
