//! Helpers shared by the transport tests: the job secret, frame headers, hellos,
//! listeners on loopback, and reading a message off a link.

#![allow(dead_code)]

use std::sync::Mutex;
use std::time::Duration;

use eccl_protocol::auth::Secret;
use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, LinkHello, PeerId, ReduceOp};
use eccl_transport::link::{LinkEvent, LinkObserver, LinkRx};
use eccl_transport::listen::{listen, Accepted, ListenOptions, Listeners};
use eccl_transport::TransportError;

pub const SECRET: &str = "transport-test-secret-0123456789";
pub const T: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct Seen(pub Mutex<Vec<String>>);

impl LinkObserver for Seen {
    fn on_abort(&self, _: &str, _: &FrameHeader, reason: &str) {
        self.0.lock().unwrap().push(format!("abort {reason}"));
    }
    fn on_failure(&self, _: &str, e: &TransportError) {
        self.0.lock().unwrap().push(format!("failure {e}"));
    }
}

pub fn secret() -> Secret {
    Secret::new(SECRET).unwrap()
}

pub fn header(kind: FrameKind, seq: u64) -> FrameHeader {
    FrameHeader {
        kind,
        epoch: 1,
        seq,
        index: 0,
        len: 0,
        desc: Descriptor {
            kind: CollectiveKind::AllReduce,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            algo: Algo::Ring,
            root: 0,
            count: 0,
        },
        offset: 0,
        tag: 0,
    }
}

pub fn hello(stream: u16, nstreams: u16) -> LinkHello {
    LinkHello {
        from: PeerId(1),
        to: PeerId(2),
        epoch: 1,
        stream,
        nstreams,
        proof: [0; 32],
    }
}

pub async fn listeners(require_tls: bool) -> Listeners {
    listen(ListenOptions {
        bind: "127.0.0.1".parse().unwrap(),
        secret: secret(),
        require_tls,
        shm_name: Some(format!(
            "eccl-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        )),
        quic: true,
    })
    .await
    .expect("listen")
}

pub async fn next_accepted(l: &mut Listeners) -> Accepted {
    tokio::time::timeout(T, l.accepted.recv())
        .await
        .expect("an accepted link in time")
        .expect("listener alive")
}

/// Receives one message of `total` bytes (frames at their offsets).
pub async fn recv_message(rx: &mut LinkRx, total: usize) -> Vec<u8> {
    let mut got = vec![0u8; total];
    let mut n = 0;
    let mut frames = 0;
    while frames == 0 || n < total {
        match tokio::time::timeout(T, rx.next())
            .await
            .expect("a frame in time")
        {
            Some(LinkEvent::Frame(f)) => {
                let off = f.header.offset as usize;
                got[off..off + f.payload.len()].copy_from_slice(f.payload.as_bytes());
                n += f.payload.len();
                frames += 1;
            }
            Some(LinkEvent::Failed(e)) => panic!("link failed: {e}"),
            None => panic!("link ended"),
        }
    }
    got
}
