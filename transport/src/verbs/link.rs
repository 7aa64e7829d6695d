//! The verbs link itself: one engine thread per link owns the device context, the
//! protection domain, the completion queue, the reliable-connected queue pair and two
//! registered rings (sends, receives); the link's async halves talk to it by channels.
//!
//! The ibverbs crate (0.9) ties a queue pair's lifetime to its domain and queues by
//! borrows, and its completion queue is polled, not waited on; a thread that holds them
//! all on its stack and polls fits both. Frames are copied into a send slot (the caller's
//! buffer is free as soon as `send_region` returns, which G2 needs) and out of a receive
//! slot, which is posted again at once.

use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use eccl_protocol::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use eccl_protocol::{codec, VerbsHello};
use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::engine::Engine;
use crate::link::{Frames, LinkEvent, LinkObserver, LinkRx, LinkTx, RecvHalf, SendHalf, Transport};
use crate::TransportError;

/// How a verbs link is made.
#[derive(Clone, Debug)]
pub struct VerbsOptions {
    /// The device to use by name (`ibv_devices`); the first one when `None`.
    pub device: Option<String>,
    /// Receive buffers posted, and send buffers in flight at most.
    pub slots: u32,
    /// Bytes per buffer: a frame's header and payload.
    pub slot_bytes: u32,
    /// The GID table index to route with (as `NCCL_IB_GID_INDEX`); the port's first
    /// entry when `None`.
    pub gid_index: Option<u32>,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            device: None,
            slots: 64,
            slot_bytes: (1 << 20) + FRAME_HEADER_LEN as u32,
            gid_index: None,
        }
    }
}

pub(super) fn verbs_err(peer: &str, what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Verbs {
        peer: peer.to_string(),
        reason: format!("{what}: {e}"),
    }
}

pub(super) fn probe() -> Result<Vec<String>, String> {
    let list = ibverbs::devices().map_err(|e| match e.raw_os_error() {
        Some(libc::ENOSYS) => "this kernel offers no RDMA (ibv_get_device_list: ENOSYS)".into(),
        _ => format!("ibv_get_device_list failed: {e}"),
    })?;
    Ok(list
        .iter()
        .map(|d| {
            d.name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "(unnamed)".into())
        })
        .collect())
}

/// Makes a verbs link over `control`, a stream to the peer that eccl's handshake has
/// authenticated and that carried the link's hello. Both sides call this; each sends
/// its [`VerbsHello`] and reads the other's, then the queue pairs are connected.
pub async fn establish<S>(
    mut control: S,
    peer: String,
    opts: VerbsOptions,
    observer: Arc<dyn LinkObserver>,
    timeout: Duration,
) -> Result<(LinkTx, LinkRx), TransportError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    VerbsHello::check_ring(opts.slots, opts.slot_bytes)
        .map_err(|e| verbs_err(&peer, "options", e))?;
    let (hello_tx, hello_rx) = oneshot::channel();
    let (remote_tx, remote_rx) = std_mpsc::sync_channel(1);
    let (frames_tx, frames_rx) = mpsc::channel::<Vec<u8>>(opts.slots as usize);
    let (events_tx, events_rx) = mpsc::channel::<LinkEvent>(opts.slots as usize);
    let (ctl_tx, ctl_rx) = std_mpsc::channel::<Control>();
    let failed: Arc<Mutex<Option<Arc<TransportError>>>> = Arc::default();
    let engine = Engine {
        peer: peer.clone(),
        opts: opts.clone(),
        events: events_tx.clone(),
        failed: failed.clone(),
    };
    std::thread::Builder::new()
        .name("eccl-verbs".into())
        .spawn(move || engine.run(hello_tx, remote_rx, frames_rx, ctl_rx))
        .map_err(|e| verbs_err(&peer, "starting the link's thread", e))?;

    let exchange = async {
        let local = hello_rx
            .await
            .map_err(|_| verbs_err(&peer, "set-up", "the link's thread ended"))??;
        let bytes = codec::encode(&local).map_err(|e| TransportError::Codec {
            peer: peer.clone(),
            source: e,
        })?;
        control
            .write_all(&bytes)
            .await
            .map_err(|e| TransportError::io(&peer, e))?;
        let remote: VerbsHello = crate::connect::read_message(&mut control, &peer).await?;
        remote
            .validate()
            .map_err(|reason| TransportError::BadHello {
                peer: peer.clone(),
                reason,
            })?;
        Ok::<_, TransportError>(remote)
    };
    let remote = within(timeout, exchange, &ctl_tx, &peer).await?;
    let remote_slot_bytes = remote.slot_bytes;
    let (ready_tx, ready_rx) = oneshot::channel();
    let _ = remote_tx.send((remote, ready_tx));
    // Our queue pair is ready to receive; the peer's may not be yet (a packet to a queue
    // pair that is not connected is dropped, and retries run out): each side says
    // "ready" on the control stream and waits for the other's before it sends.
    let ready = async {
        ready_rx
            .await
            .map_err(|_| verbs_err(&peer, "set-up", "the link's thread ended"))??;
        let io = |e| TransportError::io(&peer, e);
        control.write_all(b"R").await.map_err(io)?;
        control.flush().await.map_err(io)?;
        let mut b = [0u8; 1];
        control.read_exact(&mut b).await.map_err(io)?;
        if b != *b"R" {
            return Err(verbs_err(
                &peer,
                "set-up",
                "the peer did not say it was ready",
            ));
        }
        Ok(())
    };
    within(timeout, ready, &ctl_tx, &peer).await?;

    let (read, write) = tokio::io::split(control);
    let watcher = tokio::spawn(read_control(read, peer.clone(), observer, ctl_tx.clone()));
    // Dropping both halves stops the watcher, which closes the stream: the peer sees EOF.
    let watcher = Arc::new(AbortOnDrop(watcher.abort_handle()));
    // A frame must fit the smaller of the two sides' slots (ours is where it is copied,
    // the peer's where it lands).
    let slot = opts.slot_bytes.min(remote_slot_bytes) as usize;
    let tx = VerbsTx {
        peer: peer.clone(),
        frames: frames_tx,
        control: Box::new(write),
        failed,
        max_payload: slot - FRAME_HEADER_LEN,
        sent: 0,
        _watcher: watcher.clone(),
    };
    let rx = VerbsRx {
        peer,
        events: events_rx,
        _stop: StopOnDrop(ctl_tx),
        _watcher: watcher,
    };
    Ok((LinkTx::new(tx, Transport::Verbs), LinkRx::new(rx)))
}

/// A set-up step, bounded by `timeout`; when it fails, the engine thread is stopped.
async fn within<T>(
    timeout: Duration,
    step: impl std::future::Future<Output = Result<T, TransportError>>,
    engine: &std_mpsc::Sender<Control>,
    peer: &str,
) -> Result<T, TransportError> {
    let r = tokio::time::timeout(timeout, step)
        .await
        .unwrap_or_else(|_| Err(TransportError::Timeout(peer.to_string())));
    if r.is_err() {
        let _ = engine.send(Control::Stop);
    }
    r
}

/// What the async side tells the engine besides frames.
pub(super) enum Control {
    /// The peer closed the link on purpose after sending this many data frames: deliver
    /// them all, then report the close.
    PeerClosed(u64),
    /// The peer's control stream failed (it died): report that.
    PeerLost(TransportError),
    /// This side is done with the link.
    Stop,
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct StopOnDrop(std_mpsc::Sender<Control>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Control::Stop);
    }
}

/// Aborts and the closing frame arrive on the control stream, as over shared memory.
async fn read_control<R: AsyncRead + Unpin>(
    mut r: R,
    peer: String,
    observer: Arc<dyn LinkObserver>,
    engine: std_mpsc::Sender<Control>,
) {
    loop {
        let mut hb = [0u8; FRAME_HEADER_LEN];
        if let Err(e) = r.read_exact(&mut hb).await {
            let e = TransportError::io(&peer, e);
            observer.on_failure(&peer, &e);
            let _ = engine.send(Control::PeerLost(e));
            return;
        }
        let h = match FrameHeader::decode(&hb) {
            Ok(h) if matches!(h.kind, FrameKind::Abort | FrameKind::Close) && h.len <= 4096 => h,
            _ => {
                let e = verbs_err(
                    &peer,
                    "control stream",
                    "a frame that is not abort or close",
                );
                observer.on_failure(&peer, &e);
                let _ = engine.send(Control::PeerLost(e));
                return;
            }
        };
        let mut reason = vec![0u8; h.len as usize];
        if let Err(e) = r.read_exact(&mut reason).await {
            let _ = engine.send(Control::PeerLost(TransportError::io(&peer, e)));
            return;
        }
        if h.kind == FrameKind::Close {
            let _ = engine.send(Control::PeerClosed(h.offset));
            return;
        }
        observer.on_abort(&peer, &h, &String::from_utf8_lossy(&reason));
    }
}

/// Sending half of a verbs link.
pub(crate) struct VerbsTx {
    peer: String,
    frames: mpsc::Sender<Vec<u8>>,
    control: Box<dyn AsyncWrite + Send + Unpin>,
    failed: Arc<Mutex<Option<Arc<TransportError>>>>,
    max_payload: usize,
    /// Data frames handed to the engine; the closing frame carries the count.
    sent: u64,
    _watcher: Arc<AbortOnDrop>,
}

impl VerbsTx {
    fn failure(&self) -> TransportError {
        match self.failed.lock().ok().and_then(|f| f.clone()) {
            Some(e) if !matches!(*e, TransportError::Closed { .. }) => {
                verbs_err(&self.peer, "link failed earlier", e)
            }
            _ => TransportError::Closed {
                peer: self.peer.clone(),
            },
        }
    }

    async fn push(
        &mut self,
        h: FrameHeader,
        part: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        if part.len() > self.max_payload {
            return Err(verbs_err(
                &self.peer,
                "send",
                format!(
                    "a {}-byte frame does not fit a {}-byte slot",
                    part.len(),
                    self.max_payload
                ),
            ));
        }
        let mut msg = Vec::with_capacity(FRAME_HEADER_LEN + part.len());
        msg.extend_from_slice(&h.encode());
        msg.extend_from_slice(part);
        match tokio::time::timeout(timeout, self.frames.send(msg)).await {
            Ok(Ok(())) => {
                self.sent += 1;
                Ok(())
            }
            Ok(Err(_)) => Err(self.failure()),
            Err(_) => Err(TransportError::Timeout(self.peer.clone())),
        }
    }

    async fn region(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        let frames = Frames::new(header, payload, frame_bytes, align, self.max_payload);
        for (h, part) in frames.iter() {
            self.push(h, part, timeout).await?;
        }
        Ok(())
    }

    async fn frame(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), TransportError> {
        let mut h = header;
        h.len = payload.len() as u32;
        if matches!(header.kind, FrameKind::Abort | FrameKind::Close) {
            let write = async {
                self.control.write_all(&h.encode()).await?;
                self.control.write_all(payload).await?;
                self.control.flush().await
            };
            return match tokio::time::timeout(timeout, write).await {
                Ok(r) => r.map_err(|e| TransportError::io(&self.peer, e)),
                Err(_) => Err(TransportError::Timeout(self.peer.clone())),
            };
        }
        self.push(h, payload, timeout).await
    }

    /// Waits (briefly) until the engine has sent every queued frame, then tells the peer
    /// on the control stream: what preceded the close arrives before it.
    async fn shut(mut self: Box<Self>, header: FrameHeader) {
        // The close may overtake frames still on their way over RDMA: it carries how
        // many there were, and the peer reports it once they have all arrived.
        let mut h = header;
        h.kind = FrameKind::Close;
        h.offset = self.sent;
        let _ = self.frame(h, &[], Duration::from_millis(200)).await;
        let _ = tokio::time::timeout(Duration::from_millis(200), self.control.shutdown()).await;
    }
}

/// Receiving half of a verbs link.
pub(crate) struct VerbsRx {
    peer: String,
    events: mpsc::Receiver<LinkEvent>,
    _stop: StopOnDrop,
    _watcher: Arc<AbortOnDrop>,
}

impl VerbsRx {
    async fn wait(&mut self) -> Option<LinkEvent> {
        self.events.recv().await
    }

    fn ready(&mut self) -> Option<LinkEvent> {
        crate::link::ready_now(&mut self.events)
    }
}

impl SendHalf for VerbsTx {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn send_region<'a>(
        &'a mut self,
        header: FrameHeader,
        payload: &'a [u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.region(header, payload, frame_bytes, align, timeout))
    }

    fn send_frame<'a>(
        &'a mut self,
        header: FrameHeader,
        payload: &'a [u8],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.frame(header, payload, timeout))
    }

    fn close(self: Box<Self>, header: FrameHeader) -> BoxFuture<'static, ()> {
        Box::pin(self.shut(header))
    }
}

impl RecvHalf for VerbsRx {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn next(&mut self) -> BoxFuture<'_, Option<LinkEvent>> {
        Box::pin(self.wait())
    }

    fn try_next(&mut self) -> Option<LinkEvent> {
        self.ready()
    }
}
