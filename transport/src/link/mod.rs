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
//!
//! This module names no transport: each one implements [`SendHalf`] and [`RecvHalf`]
//! (and [`Loan`] for bytes it lends), splits regions into frames with [`Frames`], and
//! hands its halves over as a [`LinkTx`] and a [`LinkRx`]; [`crate::mesh`] is where a
//! transport is chosen and its links are made.

pub mod stream;
pub mod tcp_info;

use std::sync::Arc;
use std::time::Duration;

use eccl_protocol::frame::FrameHeader;

pub mod frames;

pub use frames::Frames;

use futures::future::BoxFuture;

use crate::pool::{AlignedBuf, PooledBuf};
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

/// Received bytes a transport lends where they lie (a slot of the sender's
/// shared-memory ring; a device buffer), handed back to it when dropped.
pub trait Loan: Send + 'static {
    fn as_bytes(&self) -> &[u8];
    /// The receiver holds the loan alone, so it may compute in it.
    fn as_bytes_mut(&mut self) -> &mut [u8];
}

/// The payload of a received frame, on loan from the link until dropped.
pub enum Payload {
    /// A buffer of a stream link's pool.
    Pooled(PooledBuf),
    /// Bytes the transport lends where they lie ([`Loan`]).
    Lent(Box<dyn Loan>),
    /// A copy that owns its bytes (a frame kept for later releases its slot).
    Owned(AlignedBuf),
}

impl Payload {
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Pooled(b) => b.as_bytes(),
            Payload::Lent(l) => l.as_bytes(),
            Payload::Owned(b) => b.as_bytes(),
        }
    }

    /// The receiver owns the payload until it drops it, so it may compute in it.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Payload::Pooled(b) => b.as_bytes_mut(),
            Payload::Lent(l) => l.as_bytes_mut(),
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

/// A transport's sending half. A transport implements this and [`RecvHalf`] and hands
/// them over as a [`LinkTx`] and a [`LinkRx`] ([`LinkTx::new`], [`LinkRx::new`]): that is
/// all the rest of eccl learns of it.
pub trait SendHalf: Send + 'static {
    fn peer(&self) -> &str;

    /// Whether an interrupted send left the link unusable (a byte stream that lost its
    /// place). A transport that publishes whole frames only never is.
    fn is_poisoned(&self) -> bool {
        false
    }

    /// See [`LinkTx::send_region`].
    fn send_region<'a>(
        &'a mut self,
        header: FrameHeader,
        payload: &'a [u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>>;

    /// See [`LinkTx::send_frame`].
    fn send_frame<'a>(
        &'a mut self,
        header: FrameHeader,
        payload: &'a [u8],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>>;

    /// See [`LinkTx::close`].
    fn close(self: Box<Self>, header: FrameHeader) -> BoxFuture<'static, ()>;

    /// See [`LinkTx::window_stats`].
    fn window_stats(&self) -> Option<tcp_info::WindowStats> {
        None
    }
}

/// A transport's receiving half (see [`SendHalf`]).
pub trait RecvHalf: Send + 'static {
    fn peer(&self) -> &str;

    /// Next event; `None` once the link has failed and that was reported.
    fn next(&mut self) -> BoxFuture<'_, Option<LinkEvent>>;

    /// A ready event, without waiting.
    fn try_next(&mut self) -> Option<LinkEvent>;
}

/// Bytes a link may move without its task giving the runtime a turn.
const PACE_BYTES: usize = 8 << 20;

/// Makes a task that moves data without ever waiting (shared memory keeps up with a
/// long collective: every frame is ready, every slot free) yield now and then. A tokio
/// worker polls its timers and I/O only when it parks or between tasks every so many
/// turns; a task that never returns to the scheduler starves every timer of the process,
/// and four DDP ranks on two cores lost their leases in one 64 MiB all_reduce (the
/// heartbeat's timer did not fire for a second). `yield_now` lets the worker poll its
/// drivers before it resumes the task: a few microseconds per 8 MiB.
#[derive(Default)]
struct Pace {
    since_wait: usize,
}

impl Pace {
    fn passed(&mut self, bytes: usize) {
        self.since_wait = self.since_wait.saturating_add(bytes);
    }

    /// Yields once `PACE_BYTES` have passed since the last wait or turn.
    async fn turn_if_due(&mut self) {
        if self.since_wait >= PACE_BYTES {
            tokio::task::yield_now().await;
            self.since_wait = 0;
        }
    }

    /// The task is about to wait anyway.
    fn waited(&mut self) {
        self.since_wait = 0;
    }
}

/// Sending half of a link.
pub struct LinkTx {
    half: Box<dyn SendHalf>,
    transport: Transport,
    pace: Pace,
}

impl LinkTx {
    /// A transport's sending half as a link's.
    pub fn new(half: impl SendHalf, transport: Transport) -> LinkTx {
        LinkTx {
            half: Box::new(half),
            transport,
            pace: Pace::default(),
        }
    }

    pub fn peer(&self) -> &str {
        self.half.peer()
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Whether an interrupted send left the link unusable (a byte stream that lost its
    /// place); shared memory and verbs publish whole frames only and never are.
    pub fn is_poisoned(&self) -> bool {
        self.half.is_poisoned()
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
        // Before anything is sent: dropping this future during the turn loses nothing.
        self.pace.turn_if_due().await;
        self.pace.passed(payload.len());
        self.half
            .send_region(header, payload, frame_bytes, align, timeout)
            .await
    }

    /// Sends one frame with `payload` as it is (control frames: abort, check; chunks of
    /// shared state; a frame forwarded along a chain).
    pub async fn send_frame(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        self.half.send_frame(header, payload, timeout).await
    }

    /// How long the link's TCP connections had data in flight and how much of it the
    /// TCP window held them back; `None` for a link without TCP connections (shared
    /// memory, QUIC, verbs).
    pub fn window_stats(&self) -> Option<tcp_info::WindowStats> {
        self.half.window_stats()
    }

    /// Tells the peer we close the link on purpose, then shuts it down.
    pub async fn close(self, header: FrameHeader) {
        self.half.close(header).await
    }
}

/// The message `rx` holds now, if any, without waiting and without parking the thread.
///
/// Not `Receiver::try_recv`: when it meets a send still in progress, tokio's `try_recv`
/// parks the calling thread on that thread's own parker until the send completes. On a
/// thread that drives a future with `Runtime::block_on` (`#[tokio::main]`, eccl-bench,
/// the blocking API) that parker is also the one the future's wake-ups unpark, so the
/// park can swallow a wake-up meant for another of the future's waits (another link's
/// frame): the future is then never polled again and the call stalls until its timeout.
/// Seen as a collective that hung for 30 s about once in a hundred runs of four ranks on a
/// loaded machine, each time with the awaited frame read by the link's reader and left
/// in its channel. Polled once with a waker that does nothing, a send in progress is
/// simply not there yet; the caller then awaits `recv()`, which registers its own waker.
pub fn ready_now<T>(rx: &mut tokio::sync::mpsc::Receiver<T>) -> Option<T> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match rx.poll_recv(&mut cx) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => None,
    }
}

/// Receiving half of a link.
pub struct LinkRx {
    half: Box<dyn RecvHalf>,
    pace: Pace,
    /// The link reported its end (failed or closed).
    ended: bool,
}

impl LinkRx {
    /// A transport's receiving half as a link's.
    pub fn new(half: impl RecvHalf) -> LinkRx {
        LinkRx {
            half: Box::new(half),
            pace: Pace::default(),
            ended: false,
        }
    }

    pub fn peer(&self) -> &str {
        self.half.peer()
    }

    /// Next event; `None` once the link has failed and that was reported.
    pub async fn next(&mut self) -> Option<LinkEvent> {
        // The turn is given before a frame is taken, never after: a caller that drops
        // this future (a `select!`, a timeout) must not lose a frame taken for it.
        self.pace.turn_if_due().await;
        // A frame that is there already costs no boxed future.
        if let Some(ev) = self.half.try_next() {
            match &ev {
                LinkEvent::Frame(f) => self.pace.passed(f.header.len as usize),
                LinkEvent::Failed(_) => self.ended = true,
            }
            return Some(ev);
        }
        self.pace.waited();
        let ev = self.half.next().await;
        if !matches!(ev, Some(LinkEvent::Frame(_))) {
            self.ended = true;
        }
        ev
    }

    /// A ready event, without waiting (and without arranging to be woken: await
    /// [`LinkRx::next`] for that).
    pub fn try_next(&mut self) -> Option<LinkEvent> {
        let ev = self.half.try_next();
        if matches!(ev, Some(LinkEvent::Failed(_))) {
            self.ended = true;
        }
        ev
    }

    /// Whether the link has reported its end (it failed or closed): it cannot carry on
    /// into another epoch.
    pub fn has_ended(&self) -> bool {
        self.ended
    }
}

/// What the transport's unit tests share: a data frame's header and an observer that
/// records what it is told.
#[cfg(test)]
pub(crate) mod test_util {
    use super::{LinkObserver, TransportError};
    use eccl_protocol::frame::{FrameHeader, FrameKind};
    use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, ReduceOp};
    use std::sync::Mutex;

    /// The header of a data frame of `len` bytes (epoch 1, an all_reduce of 4 f32).
    pub fn data_header(len: u32) -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Data,
            epoch: 1,
            seq: 0,
            index: 0,
            len,
            desc: Descriptor {
                kind: CollectiveKind::AllReduce,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                algo: Algo::Ring,
                root: 0,
                count: 4,
            },
            offset: 0,
            tag: 0,
        }
    }

    /// Records the aborts and failures a link reports.
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
}
