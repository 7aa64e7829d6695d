//! A data link to one peer, whatever carries its bytes. The executor drives [`LinkTx`]
//! and [`LinkRx`] and never learns which transport is underneath.
//!
//! A link moves *frames*: a 64-byte header naming the collective, the step and the byte
//! offset of the payload in the step's region, then the payload. How a payload reaches
//! the receiver is the transport's business:
//!
//! | transport | sending | receiving |
//! |---|---|---|
//! | `tcp`, `tls`, `quic` ([`stream`]) | written to byte streams (several per link) | reader tasks fill pooled buffers |
//! | `shm` ([`crate::shm`]) | copied into a slot of a ring in shared memory | the slot is read where it lies, then released |
//! | `verbs` ([`crate::verbs`], feature `verbs`) | copied into a registered slot, sent as an RDMA send | copied out of a posted receive buffer, which is posted again |
//!
//! A received frame's [`Payload`] is borrowed from the transport: a pooled buffer or a
//! slot of the sender's ring, which the receiver reduces from directly and releases by
//! dropping it. That is the shape later transports fit too: a CUDA IPC link exposes a
//! slot in the peer's device memory, a verbs link a registered region written by RDMA.

pub mod stream;

use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::frame::FrameHeader;

pub mod frames;

pub use frames::Frames;

use crate::pool::{AlignedBuf, PooledBuf};
use crate::shm::{ShmRx, ShmTx, Slot};
use crate::TransportError;

/// What carries a link's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Plain TCP (authenticated at set-up, not encrypted).
    Tcp,
    /// TCP with TLS 1.3 (`ECCL_TLS=1`).
    Tls,
    /// Shared memory between two processes of one host.
    Shm,
    /// QUIC (TLS 1.3 over UDP).
    Quic,
    /// RDMA verbs (reliable-connected queue pairs), with the `verbs` feature.
    Verbs,
}

impl Transport {
    pub const fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Tls => "tls",
            Transport::Shm => "shm",
            Transport::Quic => "quic",
            Transport::Verbs => "verbs",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The payload of a received frame, on loan from the link until dropped.
pub enum Payload {
    /// A buffer of a stream link's pool.
    Pooled(PooledBuf),
    /// A slot of the sender's shared-memory ring.
    Shm(Slot),
    /// A copy that owns its bytes (a frame kept for later releases its slot).
    Owned(AlignedBuf),
}

impl Payload {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Pooled(b) => b.as_bytes(),
            Payload::Shm(s) => s.as_bytes(),
            Payload::Owned(b) => b.as_bytes(),
        }
    }

    /// The receiver owns the payload until it drops it, so it may compute in it.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Payload::Pooled(b) => b.as_bytes_mut(),
            Payload::Shm(s) => s.as_bytes_mut(),
            Payload::Owned(b) => b.as_bytes_mut(),
        }
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same bytes in memory of their own, giving the loan back to the link: a frame
    /// that waits for a later step must not hold a slot or a pool permit the sender
    /// needs to deliver the frame the receiver waits for now.
    pub fn detach(self) -> Payload {
        match self {
            Payload::Owned(_) => self,
            other => {
                let mut b = AlignedBuf::with_len(other.len());
                b.as_bytes_mut().copy_from_slice(other.as_bytes());
                Payload::Owned(b)
            }
        }
    }
}

/// A received frame.
pub struct Incoming {
    pub header: FrameHeader,
    pub payload: Payload,
}

/// What a link's receiving half delivers.
pub enum LinkEvent {
    Frame(Incoming),
    /// The link is gone: the peer closed it or died, a read failed, or it sent a bad
    /// header. Frames it sent before are delivered first.
    Failed(Arc<TransportError>),
}

/// Told about control events as soon as a link sees them, whatever the executor is
/// waiting on at the time.
pub trait LinkObserver: Send + Sync + 'static {
    /// The peer sent an `Abort` frame.
    fn on_abort(&self, peer: &str, header: &FrameHeader, reason: &str);
    /// The link failed.
    fn on_failure(&self, peer: &str, error: &TransportError);
}

/// Sending half of a link.
pub struct LinkTx {
    kind: TxKind,
    transport: Transport,
}

enum TxKind {
    Stream(stream::StreamTx),
    Shm(ShmTx),
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::VerbsTx),
}

impl LinkTx {
    pub(crate) fn stream(tx: stream::StreamTx, transport: Transport) -> LinkTx {
        LinkTx {
            kind: TxKind::Stream(tx),
            transport,
        }
    }

    pub(crate) fn shm(tx: ShmTx) -> LinkTx {
        LinkTx {
            kind: TxKind::Shm(tx),
            transport: Transport::Shm,
        }
    }

    #[cfg(feature = "verbs")]
    pub(crate) fn verbs(tx: crate::verbs::VerbsTx) -> LinkTx {
        LinkTx {
            kind: TxKind::Verbs(tx),
            transport: Transport::Verbs,
        }
    }

    pub fn peer(&self) -> &str {
        match &self.kind {
            TxKind::Stream(t) => t.peer(),
            TxKind::Shm(t) => t.peer(),
            #[cfg(feature = "verbs")]
            TxKind::Verbs(t) => t.peer(),
        }
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Whether an interrupted send left the link unusable (a byte stream that lost its
    /// place); shared memory publishes whole frames only and never is.
    pub fn is_poisoned(&self) -> bool {
        match &self.kind {
            TxKind::Stream(t) => t.is_poisoned(),
            TxKind::Shm(_) => false,
            #[cfg(feature = "verbs")]
            TxKind::Verbs(_) => false, // whole frames only, as shared memory
        }
    }

    /// Sends `payload` as frames of at most `frame_bytes` bytes (a multiple of `align`),
    /// each with `header` and its own `offset`/`len`. An empty payload is sent as one
    /// empty frame, so every send is seen by the receiver. Every frame must make
    /// progress within `timeout`.
    pub async fn send_region(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        match &mut self.kind {
            TxKind::Stream(t) => {
                t.send_region(header, payload, frame_bytes, align, timeout)
                    .await
            }
            TxKind::Shm(t) => {
                t.send_region(header, payload, frame_bytes, align, timeout)
                    .await
            }
            #[cfg(feature = "verbs")]
            TxKind::Verbs(t) => {
                t.send_region(header, payload, frame_bytes, align, timeout)
                    .await
            }
        }
    }

    /// Sends one frame with `payload` as it is (control frames: abort, check; chunks of
    /// shared state; a frame forwarded along a chain).
    pub async fn send_frame(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        match &mut self.kind {
            TxKind::Stream(t) => t.send_frame(header, payload, timeout).await,
            TxKind::Shm(t) => t.send_frame(header, payload, timeout).await,
            #[cfg(feature = "verbs")]
            TxKind::Verbs(t) => t.send_frame(header, payload, timeout).await,
        }
    }

    /// Tells the peer we close the link on purpose, then shuts it down.
    pub async fn close(self, header: FrameHeader) {
        match self.kind {
            TxKind::Stream(t) => t.close(header).await,
            TxKind::Shm(t) => t.close(header).await,
            #[cfg(feature = "verbs")]
            TxKind::Verbs(t) => t.close(header).await,
        }
    }
}

/// Receiving half of a link.
pub struct LinkRx {
    kind: RxKind,
}

enum RxKind {
    Stream(stream::StreamRx),
    Shm(ShmRx),
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::VerbsRx),
}

impl LinkRx {
    pub(crate) fn stream(rx: stream::StreamRx) -> LinkRx {
        LinkRx {
            kind: RxKind::Stream(rx),
        }
    }

    pub(crate) fn shm(rx: ShmRx) -> LinkRx {
        LinkRx {
            kind: RxKind::Shm(rx),
        }
    }

    #[cfg(feature = "verbs")]
    pub(crate) fn verbs(rx: crate::verbs::VerbsRx) -> LinkRx {
        LinkRx {
            kind: RxKind::Verbs(rx),
        }
    }

    pub fn peer(&self) -> &str {
        match &self.kind {
            RxKind::Stream(r) => r.peer(),
            RxKind::Shm(r) => r.peer(),
            #[cfg(feature = "verbs")]
            RxKind::Verbs(r) => r.peer(),
        }
    }

    /// Next event; `None` once the link has failed and that was reported.
    pub async fn next(&mut self) -> Option<LinkEvent> {
        match &mut self.kind {
            RxKind::Stream(r) => r.next().await,
            RxKind::Shm(r) => r.next().await,
            #[cfg(feature = "verbs")]
            RxKind::Verbs(r) => r.next().await,
        }
    }

    /// A ready event, without waiting.
    pub fn try_next(&mut self) -> Option<LinkEvent> {
        match &mut self.kind {
            RxKind::Stream(r) => r.try_next(),
            RxKind::Shm(r) => r.try_next(),
            #[cfg(feature = "verbs")]
            RxKind::Verbs(r) => r.try_next(),
        }
    }
}
