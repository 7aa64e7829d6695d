//! An on-path attacker who flips bits after the handshake. Over TLS (data links
//! with `ECCL_TLS=1`, every control connection) the receiver gets an error and never a
//! byte that was not sent; over QUIC the damaged packet is discarded and sent again, so
//! the message arrives exact. (Plain TCP data links carry no MAC: see the README's
//! threat model.)

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::common::*;
use eccl_protocol::auth::Role;
use eccl_protocol::frame::FrameKind;
use eccl_transport::connect::{dial_quic, dial_tcp, stream_link};
use eccl_transport::control;
use eccl_transport::link::{LinkEvent, LinkObserver, Transport};
use eccl_transport::listen::Conn;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::task::JoinHandle;

/// A TCP proxy to `target` that flips one bit of the byte at offset `at` of its first
/// connection's dialer-to-acceptor stream, and relays everything else untouched.
async fn tcp_flipper(target: SocketAddr, at: u64) -> (SocketAddr, JoinHandle<()>) {
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = front.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (inbound, _) = front.accept().await.unwrap();
        let outbound = TcpStream::connect(target).await.unwrap();
        let (mut ir, mut iw) = inbound.into_split();
        let (mut or, mut ow) = outbound.into_split();
        let up = async move {
            let mut buf = vec![0u8; 64 << 10];
            let mut seen = 0u64;
            loop {
                let n = match ir.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if (seen..seen + n as u64).contains(&at) {
                    buf[(at - seen) as usize] ^= 0x10;
                }
                seen += n as u64;
                if ow.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = ow.shutdown().await;
        };
        let down = async move {
            let _ = tokio::io::copy(&mut or, &mut iw).await;
            let _ = iw.shutdown().await;
        };
        tokio::join!(up, down);
    });
    (addr, task)
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|k| (k * 7 + k / 251) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_on_a_tls_link_is_an_error_never_a_wrong_byte() {
    let mut l = listeners(false).await;
    let (proxy, task) = tcp_flipper(l.tcp_addr, 3 << 20).await;
    let dialed = dial_tcp(&proxy.to_string(), &secret(), &hello(0, 1), true, T)
        .await
        .unwrap();
    let a = next_accepted(&mut l).await;
    let Conn::Stream { read, write, .. } = a.conn else {
        panic!("a stream connection")
    };
    let seen: Arc<dyn LinkObserver> = Arc::new(Seen::default());
    let (mut tx, _rx) = stream_link(
        "a".into(),
        Transport::Tls,
        vec![dialed],
        seen.clone(),
        1 << 26,
        None,
    );
    let (_atx, mut arx) = stream_link(
        "d".into(),
        Transport::Tls,
        vec![(read, write)],
        seen,
        1 << 26,
        None,
    );
    let data = pattern(16 << 20);
    let send = async {
        // The sender may or may not notice: its bytes left intact.
        let _ = tx
            .send_region(header(FrameKind::Data, 1), &data, 256 << 10, 1, T)
            .await;
    };
    let recv = async {
        let mut got = 0usize;
        loop {
            match tokio::time::timeout(T, arx.next())
                .await
                .expect("an event in time")
            {
                Some(LinkEvent::Frame(f)) => {
                    let off = f.header.offset as usize;
                    let p = f.payload.as_bytes();
                    assert!(
                        p == &data[off..off + p.len()],
                        "a frame at {off} arrived altered"
                    );
                    got += p.len();
                }
                Some(LinkEvent::Failed(e)) => return (got, Some(e.to_string())),
                None => return (got, None),
            }
        }
    };
    let ((), (got, failed)) = tokio::join!(send, recv);
    assert!(
        failed.is_some(),
        "the tampered link must fail (received {got} bytes)"
    );
    assert!(
        got < data.len(),
        "the frame holding the flipped bit was delivered"
    );
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_bit_on_a_control_connection_is_an_error_never_a_wrong_message() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (proxy, task) = tcp_flipper(listener.local_addr().unwrap(), 50_000).await;
    let accept = async {
        let (s, _) = listener.accept().await.unwrap();
        control::accept(s, &secret()).await.unwrap()
    };
    let (proxy, sec) = (proxy.to_string(), secret());
    let connect = control::connect(&proxy, &sec, Role::PeerToMaster, T);
    let ((role, mut server), client) = tokio::join!(accept, connect);
    assert_eq!(role, Role::PeerToMaster);
    let mut client = client.unwrap();
    let msg = |i: u32| -> Vec<u32> { (0..1000).map(|k| k * 31 + i).collect() };
    let send = async {
        for i in 0..100 {
            if client.send(&msg(i)).await.is_err() {
                break;
            }
        }
        client
    };
    let recv = async {
        for i in 0..100 {
            match tokio::time::timeout(T, server.recv::<Vec<u32>>())
                .await
                .expect("in time")
            {
                Ok(m) => assert!(m == msg(i), "message {i} arrived altered"),
                Err(e) => return Some((i, e.to_string())),
            }
        }
        None
    };
    let (_client, failed) = tokio::join!(send, recv);
    let (at, _) = failed.expect("the tampered connection must fail");
    assert!(at < 100 && at > 0, "failed at message {at}");
    task.abort();
}

/// A UDP proxy that flips one bit in every `every`-th datagram of more than 1000 bytes
/// going from the dialer to `target`; returns its address and how many it flipped.
async fn udp_flipper(
    target: SocketAddr,
    every: u64,
) -> (SocketAddr, Arc<AtomicU64>, JoinHandle<()>) {
    let front = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let back = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    back.connect(target).await.unwrap();
    let addr = front.local_addr().unwrap();
    let flipped = Arc::new(AtomicU64::new(0));
    let count = flipped.clone();
    let task = tokio::spawn(async move {
        let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
        let mut client = None;
        let mut big = 0u64;
        loop {
            tokio::select! {
                r = front.recv_from(&mut a) => {
                    let Ok((n, from)) = r else { break };
                    client = Some(from);
                    if n > 1000 {
                        big += 1;
                        if big.is_multiple_of(every) {
                            a[n / 2] ^= 0x01;
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    let _ = back.send(&a[..n]).await;
                }
                r = back.recv(&mut b) => {
                    let Ok(n) = r else { break };
                    if let Some(c) = client {
                        let _ = front.send_to(&b[..n], c).await;
                    }
                }
            }
        }
    });
    (addr, flipped, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_bits_on_quic_are_dropped_and_resent_and_the_message_is_exact() {
    let dialer = listeners(false).await;
    let mut acceptor = listeners(false).await;
    let (proxy, flipped, task) = udp_flipper(acceptor.quic_addr.unwrap(), 64).await;
    let q = dial_quic(
        dialer.quic.as_ref().unwrap(),
        proxy,
        &secret(),
        &hello(0, 1),
        T,
    )
    .await
    .unwrap();
    let a = next_accepted(&mut acceptor).await;
    let Conn::Quic(qa) = a.conn else {
        panic!("a QUIC connection")
    };
    let seen: Arc<dyn LinkObserver> = Arc::new(Seen::default());
    let (ds, dc) = q.into_parts();
    let (as_, ac) = qa.into_parts();
    let (mut tx, _rx) = stream_link(
        "a".into(),
        Transport::Quic,
        ds,
        seen.clone(),
        1 << 26,
        Some(dc),
    );
    let (_atx, mut arx) = stream_link("d".into(), Transport::Quic, as_, seen, 1 << 26, Some(ac));
    let data = pattern(8 << 20);
    let send = tx.send_region(header(FrameKind::Data, 1), &data, 1 << 20, 1, T);
    let (sent, got) = tokio::join!(send, recv_message(&mut arx, data.len()));
    sent.unwrap();
    assert!(got == data, "the message arrived altered");
    assert!(
        flipped.load(Ordering::Relaxed) > 0,
        "the proxy flipped nothing"
    );
    task.abort();
    drop((dialer, acceptor));
}
