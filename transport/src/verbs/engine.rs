//! The engine thread of a verbs link: it owns the device context, the protection
//! domain, the completion queue, the reliable-connected queue pair and the two registered
//! rings, sets the queue pair up with the peer's [`VerbsHello`], then moves frames
//! between the rings and the link's async halves ([`super::link`]) until the link ends.

use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eccl_protocol::frame::{FrameHeader, FRAME_HEADER_LEN};
use eccl_protocol::VerbsHello;
use tokio::sync::{mpsc, oneshot};

use super::link::{verbs_err, Control, VerbsOptions};
use super::status::completion_failure;
use crate::link::{Incoming, LinkEvent, Payload};
use crate::pool::AlignedBuf;
use crate::TransportError;

/// A receive's work-request id has this bit set; a send's has not.
const RECV_BIT: u64 = 1 << 63;
/// Completions taken per poll.
const POLL_BATCH: usize = 32;
/// How long frames announced by the peer's close may take to arrive after it.
const CLOSE_DRAIN: Duration = Duration::from_secs(2);

pub(super) type Hello = oneshot::Sender<Result<VerbsHello, TransportError>>;
pub(super) type Ready = oneshot::Sender<Result<(), TransportError>>;
pub(super) type Remote = (VerbsHello, Ready);

pub(super) struct Engine {
    pub(super) peer: String,
    pub(super) opts: VerbsOptions,
    pub(super) events: mpsc::Sender<LinkEvent>,
    pub(super) failed: Arc<Mutex<Option<Arc<TransportError>>>>,
}

/// The set-up answer the async side still waits for: an error goes there, with its cause.
#[derive(Default)]
struct Pending {
    hello: Option<Hello>,
    ready: Option<Ready>,
}

impl Engine {
    pub(super) fn run(
        self,
        hello: Hello,
        remote: std_mpsc::Receiver<Remote>,
        mut frames: mpsc::Receiver<Vec<u8>>,
        control: std_mpsc::Receiver<Control>,
    ) {
        let mut pending = Pending {
            hello: Some(hello),
            ready: None,
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            self.serve(&mut pending, &remote, &mut frames, &control)
        }));
        let err = match result {
            Ok(Ok(())) => return,
            Ok(Err(e)) => Arc::new(e),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                Arc::new(verbs_err(&self.peer, "the verbs library panicked", what))
            }
        };
        tracing::debug!(target: "eccl::net", "verbs link to {} down: {err}", self.peer);
        // Recorded before `frames` is dropped, so a sender that finds the channel closed
        // reads the cause, not a clean close.
        if let Ok(mut f) = self.failed.lock() {
            *f = Some(err.clone());
        }
        if let Some(h) = pending.hello.take() {
            let _ = h.send(Err(verbs_err(&self.peer, "set-up", &err)));
        } else if let Some(r) = pending.ready.take() {
            let _ = r.send(Err(verbs_err(&self.peer, "set-up", &err)));
        }
        drop(frames);
        let _ = self.events.blocking_send(LinkEvent::Failed(err));
    }

    /// Sets the queue pair up, then moves frames until the link ends. `Ok` when this
    /// side is done with it; the error that ended it otherwise.
    fn serve(
        &self,
        pending: &mut Pending,
        remote: &std_mpsc::Receiver<Remote>,
        frames: &mut mpsc::Receiver<Vec<u8>>,
        control: &std_mpsc::Receiver<Control>,
    ) -> Result<(), TransportError> {
        let peer = &self.peer;
        let (slots, slot) = (self.opts.slots as usize, self.opts.slot_bytes as usize);
        let setup = |what: &str, e: io::Error| verbs_err(peer, what, e);
        let list = ibverbs::devices().map_err(|e| setup("listing RDMA devices", e))?;
        let want = self.opts.device.as_deref();
        let dev = list
            .iter()
            .find(|d| {
                want.is_none() || d.name().map(|n| n.to_string_lossy()) == want.map(Into::into)
            })
            .ok_or_else(|| {
                verbs_err(
                    peer,
                    "set-up",
                    format!("no RDMA device {}", want.unwrap_or("at all")),
                )
            })?;
        let ctx = dev.open().map_err(|e| setup("opening the device", e))?;
        let pd = ctx
            .alloc_pd()
            .map_err(|e| setup("allocating a protection domain", e))?;
        let cq = ctx
            .create_cq(2 * slots as i32, 0)
            .map_err(|e| setup("creating a completion queue", e))?;
        // Registered before the hello goes out, so the peer never waits on our memlock.
        let mut recv_mr = pd
            .allocate::<u8>(slots * slot)
            .map_err(|e| setup("registering the receive ring", e))?;
        let mut send_mr = pd
            .allocate::<u8>(slots * slot)
            .map_err(|e| setup("registering the send ring", e))?;
        let mut builder = pd.create_qp(&cq, &cq, ibverbs::ibv_qp_type::IBV_QPT_RC);
        builder
            .set_max_send_wr(slots as u32)
            .set_max_recv_wr(slots as u32)
            .set_retry_count(7)
            .set_rnr_retry(7) // a receiver that is behind re-posts its buffers soon
            .set_min_rnr_timer(12) // 0.64 ms between receiver-not-ready retries
            .set_timeout(14)
            .set_path_mtu(3); // 1024 bytes: what every RoCE and InfiniBand port carries
        match self.opts.gid_index {
            Some(g) => {
                builder.set_gid_index(g);
            }
            None => {
                if let Some(g) = ctx.gid_table().first() {
                    builder.set_gid_index(g.gid_index);
                }
            }
        }
        let prepared = builder
            .build()
            .map_err(|e| setup("creating the queue pair", e))?;
        let ep = prepared.endpoint();
        let local = VerbsHello {
            qp_num: ep.num,
            lid: ep.lid,
            gid: ep.gid.map(|g| {
                let mut raw = [0u8; 16];
                raw[..8].copy_from_slice(&g.subnet_prefix().to_be_bytes());
                raw[8..].copy_from_slice(&g.interface_id().to_be_bytes());
                raw
            }),
            recv_slots: self.opts.slots,
            slot_bytes: self.opts.slot_bytes,
        };
        let local_qp = local.qp_num;
        if let Some(h) = pending.hello.take() {
            if h.send(Ok(local)).is_err() {
                return Ok(());
            }
        }
        let Ok((theirs, ready)) = remote.recv() else {
            return Ok(()); // the async side gave up (timeout, bad hello)
        };
        pending.ready = Some(ready);
        let remote_ep = ibverbs::QueuePairEndpoint {
            num: theirs.qp_num,
            lid: theirs.lid,
            gid: theirs.gid.map(|raw| ibverbs_sys::ibv_gid { raw }.into()),
        };
        let mut qp = prepared
            .handshake(remote_ep)
            .map_err(|e| setup("connecting the queue pair", e))?;
        for i in 0..slots {
            // SAFETY: receive slot `i` is the range [i*slot, (i+1)*slot) of `recv_mr`,
            // which lives until this function returns (after the queue pair, declared
            // later, is destroyed); it is read only after its completion and posted
            // again only after that read.
            unsafe { qp.post_receive(&mut recv_mr, i * slot..(i + 1) * slot, RECV_BIT | i as u64) }
                .map_err(|e| setup("posting receives", e))?;
        }
        if let Some(r) = pending.ready.take() {
            let _ = r.send(Ok(()));
        }
        tracing::info!(target: "eccl::net", "verbs link to {peer} up on {} (QP {} -> {})",
            dev.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            local_qp, theirs.qp_num);

        // Sends in flight at most: our slots, and the receives the peer keeps posted.
        let window = slots.min(theirs.recv_slots as usize);
        let mut free: Vec<usize> = (0..window).rev().collect();
        let mut wcs = [ibverbs::ibv_wc::default(); POLL_BATCH];
        // Frames received but not yet taken by the receiver, with their slots: a slot is
        // posted again only once its frame is handed over, so a slow receiver holds the
        // peer back (receiver-not-ready) instead of blocking this thread's sends.
        let mut undelivered: VecDeque<(u64, Incoming)> = VecDeque::new();
        let mut received = 0u64;
        let mut closed_after: Option<(u64, Instant)> = None;
        let (mut stopping, mut sender_gone) = (false, false);
        let mut idle = 0u32;
        loop {
            let mut busy = false;
            let done = cq
                .poll(&mut wcs)
                .map_err(|e| setup("polling completions", e))?;
            for wc in done.iter() {
                busy = true;
                let id = wc.wr_id();
                let i = (id & !RECV_BIT) as usize;
                if let Some((status, vendor)) = wc.error() {
                    let what = if id & RECV_BIT != 0 {
                        "a receive"
                    } else {
                        "a send"
                    };
                    return Err(completion_failure(peer, status, vendor, what));
                }
                if id & RECV_BIT == 0 {
                    free.push(i);
                    continue;
                }
                let msg = &recv_mr[i * slot..i * slot + wc.len().min(slot)];
                undelivered.push_back((id, self.incoming(msg)?));
                received += 1;
            }
            while let Some((id, frame)) = undelivered.pop_front() {
                match self.events.try_send(LinkEvent::Frame(frame)) {
                    Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
                    Err(mpsc::error::TrySendError::Full(LinkEvent::Frame(f))) => {
                        undelivered.push_front((id, f));
                        break;
                    }
                    Err(mpsc::error::TrySendError::Full(_)) => unreachable!("a frame was sent"),
                }
                busy = true;
                let i = (id & !RECV_BIT) as usize;
                // SAFETY: as for the first post of slot `i`; its bytes were copied out
                // when the frame was made, so the device may overwrite them.
                unsafe { qp.post_receive(&mut recv_mr, i * slot..(i + 1) * slot, id) }
                    .map_err(|e| setup("posting a receive", e))?;
            }
            while let Some(&i) = free.last() {
                match frames.try_recv() {
                    Ok(msg) => {
                        // `push` refuses frames longer than the smaller slot of the two.
                        let n = msg.len().min(slot);
                        send_mr[i * slot..i * slot + n].copy_from_slice(&msg[..n]);
                        free.pop();
                        busy = true;
                        // SAFETY: send slot `i` is not in `free` until its completion
                        // arrives, so nothing writes it while the device reads it, and
                        // `send_mr` outlives the queue pair.
                        unsafe { qp.post_send(&mut send_mr, i * slot..i * slot + n, i as u64) }
                            .map_err(|e| setup("posting a send", e))?;
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        sender_gone = true;
                        break;
                    }
                }
            }
            loop {
                match control.try_recv() {
                    Ok(Control::Stop) | Err(std_mpsc::TryRecvError::Disconnected) => {
                        stopping = true;
                        break;
                    }
                    Ok(Control::PeerClosed(n)) => closed_after = Some((n, Instant::now())),
                    Ok(Control::PeerLost(e)) => return Err(e),
                    Err(std_mpsc::TryRecvError::Empty) => break,
                }
            }
            // Both halves dropped and every send of ours completed.
            if stopping && sender_gone && free.len() == window {
                return Ok(());
            }
            if let Some((n, at)) = closed_after {
                if received >= n && undelivered.is_empty() {
                    return Err(TransportError::Closed { peer: peer.clone() });
                }
                if at.elapsed() > CLOSE_DRAIN {
                    return Err(verbs_err(
                        peer,
                        "close",
                        format!("the peer closed after {n} frames; {received} arrived"),
                    ));
                }
            }
            if busy {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle < 1000 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }

    /// A received message as the frame the executor sees; a malformed one fails the link.
    fn incoming(&self, msg: &[u8]) -> Result<Incoming, TransportError> {
        let peer = &self.peer;
        let Some(hb) = msg.get(..FRAME_HEADER_LEN) else {
            return Err(verbs_err(
                peer,
                "receive",
                "a message shorter than a frame header",
            ));
        };
        let hb: &[u8; FRAME_HEADER_LEN] = hb.try_into().expect("sliced to the header's length");
        let header = match FrameHeader::decode(hb) {
            Ok(h) => h,
            Err(e) => {
                return Err(TransportError::Header {
                    peer: peer.clone(),
                    source: e,
                })
            }
        };
        let body = &msg[FRAME_HEADER_LEN..];
        if header.len as usize != body.len() {
            return Err(verbs_err(
                peer,
                "receive",
                format!(
                    "a frame announcing {} payload bytes carried {}",
                    header.len,
                    body.len()
                ),
            ));
        }
        let mut b = AlignedBuf::with_len(body.len());
        b.as_bytes_mut().copy_from_slice(body);
        Ok(Incoming {
            header,
            payload: Payload::Owned(b),
        })
    }
}
