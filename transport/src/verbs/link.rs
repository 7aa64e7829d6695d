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
use std::time::{Duration, Instant};

use eccl_protocol::frame::{FrameHeader, FrameKind, FRAME_HEADER_LEN};
use eccl_protocol::{codec, VerbsHello};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::engine::Engine;
use crate::link::{LinkEvent, LinkObserver, LinkRx, LinkTx};
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
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            device: None,
            slots: 64,
            slot_bytes: (1 << 20) + FRAME_HEADER_LEN as u32,
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
    let remote = match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let _ = ctl_tx.send(Control::Stop);
            return Err(e);
        }
        Err(_) => {
            let _ = ctl_tx.send(Control::Stop);
            return Err(TransportError::Timeout(peer));
        }
    };
    let (ready_tx, ready_rx) = oneshot::channel();
    let _ = remote_tx.send((remote, ready_tx));
    match tokio::time::timeout(timeout, ready_rx).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => return Err(e),
        Ok(Err(_)) => return Err(verbs_err(&peer, "set-up", "the link's thread ended")),
        Err(_) => {
            let _ = ctl_tx.send(Control::Stop);
            return Err(TransportError::Timeout(peer));
        }
    }

    let (read, write) = tokio::io::split(control);
    tokio::spawn(read_control(read, peer.clone(), observer, ctl_tx.clone()));
    let max_payload = opts.slot_bytes as usize - FRAME_HEADER_LEN;
    let tx = VerbsTx {
        peer: peer.clone(),
        frames: frames_tx,
        control: Box::new(write),
        failed,
        max_payload,
    };
    let rx = VerbsRx {
        peer,
        events: events_rx,
        _stop: StopOnDrop(ctl_tx),
    };
    Ok((LinkTx::verbs(tx), LinkRx::verbs(rx)))
}

/// What the async side tells the engine besides frames.
pub(super) enum Control {
    /// The peer closed the link on purpose: deliver what has arrived, then report it.
    PeerClosed,
    /// The peer's control stream failed (it died): report that.
    PeerLost(TransportError),
    /// This side is done with the link.
    Stop,
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
            let _ = engine.send(Control::PeerClosed);
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
}

impl VerbsTx {
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    fn failure(&self) -> TransportError {
        match self.failed.lock().ok().and_then(|f| f.clone()) {
            Some(e) => verbs_err(&self.peer, "link failed earlier", e),
            None => TransportError::Closed {
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
        let mut msg = Vec::with_capacity(FRAME_HEADER_LEN + part.len());
        msg.extend_from_slice(&h.encode());
        msg.extend_from_slice(part);
        match tokio::time::timeout(timeout, self.frames.send(msg)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(self.failure()),
            Err(_) => Err(TransportError::Timeout(self.peer.clone())),
        }
    }

    pub(crate) async fn send_region(
        &mut self,
        header: FrameHeader,
        payload: &[u8],
        frame_bytes: usize,
        align: usize,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        let align = align.max(1);
        let frame =
            (frame_bytes.clamp(align, self.max_payload.max(align)) / align * align).max(align);
        if payload.is_empty() {
            return self.push(header, &[], timeout).await;
        }
        for (i, part) in payload.chunks(frame).enumerate() {
            let mut h = header;
            h.offset = (i * frame) as u64;
            h.len = part.len() as u32;
            self.push(h, part, timeout).await?;
        }
        Ok(())
    }

    pub(crate) async fn send_frame(
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
        if payload.len() > self.max_payload {
            return Err(verbs_err(
                &self.peer,
                "send",
                format!(
                    "a {}-byte frame does not fit a {}-byte slot",
                    payload.len(),
                    self.max_payload
                ),
            ));
        }
        self.push(h, payload, timeout).await
    }

    /// Waits (briefly) until the engine has sent every queued frame, then tells the peer
    /// on the control stream: what preceded the close arrives before it.
    pub(crate) async fn close(mut self, header: FrameHeader) {
        let deadline = Instant::now() + Duration::from_millis(500);
        while self.frames.capacity() < self.frames.max_capacity() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut h = header;
        h.kind = FrameKind::Close;
        let _ = self.send_frame(h, &[], Duration::from_millis(200)).await;
        let _ = tokio::time::timeout(Duration::from_millis(200), self.control.shutdown()).await;
    }
}

/// Receiving half of a verbs link.
pub(crate) struct VerbsRx {
    peer: String,
    events: mpsc::Receiver<LinkEvent>,
    _stop: StopOnDrop,
}

impl VerbsRx {
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    pub(crate) async fn next(&mut self) -> Option<LinkEvent> {
        self.events.recv().await
    }

    pub(crate) fn try_next(&mut self) -> Option<LinkEvent> {
        self.events.try_recv().ok()
    }
}
