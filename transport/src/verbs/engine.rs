//! The engine thread of a verbs link: it owns the device context, the protection
//! domain, the completion queue, the reliable-connected queue pair and the two registered
//! rings, sets the queue pair up with the peer's [`VerbsHello`], then moves frames
//! between the rings and the link's async halves ([`super::link`]) until the link ends.

use std::io;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

pub(super) type Hello = oneshot::Sender<Result<VerbsHello, TransportError>>;
pub(super) type Remote = (VerbsHello, oneshot::Sender<Result<(), TransportError>>);

pub(super) struct Engine {
    pub(super) peer: String,
    pub(super) opts: VerbsOptions,
    pub(super) events: mpsc::Sender<LinkEvent>,
    pub(super) failed: Arc<Mutex<Option<Arc<TransportError>>>>,
}

impl Engine {
    pub(super) fn run(
        self,
        hello: Hello,
        remote: std_mpsc::Receiver<Remote>,
        frames: mpsc::Receiver<Vec<u8>>,
        control: std_mpsc::Receiver<Control>,
    ) {
        let err = match self.serve(hello, remote, frames, &control) {
            Ok(()) => return,
            Err(e) => Arc::new(e),
        };
        tracing::debug!(target: "eccl::net", "verbs link to {} down: {err}", self.peer);
        if let Ok(mut f) = self.failed.lock() {
            *f = Some(err.clone());
        }
        let _ = self.events.blocking_send(LinkEvent::Failed(err));
    }

    /// Sets the queue pair up, then moves frames until the link ends. `Ok` when this
    /// side stopped it; the error that ended it otherwise.
    fn serve(
        &self,
        hello: Hello,
        remote: std_mpsc::Receiver<Remote>,
        mut frames: mpsc::Receiver<Vec<u8>>,
        control: &std_mpsc::Receiver<Control>,
    ) -> Result<(), TransportError> {
        let peer = &self.peer;
        let (slots, slot) = (self.opts.slots as usize, self.opts.slot_bytes as usize);
        let setup = |what: &str, e: io::Error| verbs_err(peer, what, e);
        let list = match ibverbs::devices() {
            Ok(l) => l,
            Err(e) => {
                let e = setup("listing RDMA devices", e);
                let _ = hello.send(Err(verbs_err(peer, "set-up", &e)));
                return Err(e);
            }
        };
        let want = self.opts.device.as_deref();
        let Some(dev) = list.iter().find(|d| {
            want.is_none() || d.name().map(|n| n.to_string_lossy()) == want.map(Into::into)
        }) else {
            let e = verbs_err(
                peer,
                "set-up",
                format!("no RDMA device {}", want.unwrap_or("at all")),
            );
            let _ = hello.send(Err(verbs_err(peer, "set-up", &e)));
            return Err(e);
        };
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                let e = setup("opening the device", e);
                let _ = hello.send(Err(verbs_err(peer, "set-up", &e)));
                return Err(e);
            }
        };
        let pd = ctx
            .alloc_pd()
            .map_err(|e| setup("allocating a protection domain", e))?;
        let cq = ctx
            .create_cq(2 * slots as i32, 0)
            .map_err(|e| setup("creating a completion queue", e))?;
        let mut builder = pd.create_qp(&cq, &cq, ibverbs::ibv_qp_type::IBV_QPT_RC);
        builder
            .set_max_send_wr(slots as u32)
            .set_max_recv_wr(slots as u32)
            .set_retry_count(7)
            .set_rnr_retry(7) // a receiver that is behind re-posts its buffers soon
            .set_timeout(14);
        if let Some(g) = ctx.gid_table().first() {
            builder.set_gid_index(g.gid_index);
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
        if hello.send(Ok(local)).is_err() {
            return Ok(());
        }
        let Ok((theirs, ready)) = remote.recv() else {
            return Ok(()); // the async side gave up (timeout, bad hello)
        };
        if theirs.slot_bytes < self.opts.slot_bytes {
            let e = verbs_err(
                peer,
                "set-up",
                format!(
                    "the peer's {}-byte receive slots are smaller than ours ({})",
                    theirs.slot_bytes, self.opts.slot_bytes
                ),
            );
            let _ = ready.send(Err(verbs_err(peer, "set-up", &e)));
            return Err(e);
        }
        let remote_ep = ibverbs::QueuePairEndpoint {
            num: theirs.qp_num,
            lid: theirs.lid,
            gid: theirs.gid.map(|raw| ibverbs_sys::ibv_gid { raw }.into()),
        };
        let mut recv_mr = pd
            .allocate::<u8>(slots * slot)
            .map_err(|e| setup("registering the receive ring", e))?;
        let mut send_mr = pd
            .allocate::<u8>(slots * slot)
            .map_err(|e| setup("registering the send ring", e))?;
        let mut qp = match prepared.handshake(remote_ep) {
            Ok(qp) => qp,
            Err(e) => {
                let e = setup("connecting the queue pair", e);
                let _ = ready.send(Err(verbs_err(peer, "set-up", &e)));
                return Err(e);
            }
        };
        for i in 0..slots {
            // SAFETY: receive slot `i` is the range [i*slot, (i+1)*slot) of `recv_mr`,
            // which lives until this function returns (after the queue pair, declared
            // later, is destroyed); it is read only after its completion and posted
            // again only after that read.
            unsafe { qp.post_receive(&mut recv_mr, i * slot..(i + 1) * slot, RECV_BIT | i as u64) }
                .map_err(|e| setup("posting receives", e))?;
        }
        let _ = ready.send(Ok(()));
        tracing::info!(target: "eccl::net", "verbs link to {peer} up on {} (QP {} -> {})",
            dev.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            local_qp, theirs.qp_num);

        let mut free: Vec<usize> = (0..slots).rev().collect();
        let mut wcs = [ibverbs::ibv_wc::default(); POLL_BATCH];
        let mut peer_closed = false;
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
                let event = self.incoming(msg);
                // SAFETY: as for the first post of slot `i`; its bytes were copied out
                // above, so the device may overwrite them.
                unsafe { qp.post_receive(&mut recv_mr, i * slot..(i + 1) * slot, id) }
                    .map_err(|e| setup("posting a receive", e))?;
                let bad = matches!(event, LinkEvent::Failed(_));
                if self.events.blocking_send(event).is_err() {
                    return Ok(()); // nobody receives any more
                }
                if bad {
                    return Ok(());
                }
            }
            while let Some(&i) = free.last() {
                match frames.try_recv() {
                    Ok(msg) => {
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
                        if free.len() == slots {
                            return Ok(()); // the sender is gone and every send completed
                        }
                        break;
                    }
                }
            }
            match control.try_recv() {
                Ok(Control::Stop) | Err(std_mpsc::TryRecvError::Disconnected) => {
                    if free.len() == slots || peer_closed {
                        return Ok(());
                    }
                }
                Ok(Control::PeerClosed) => peer_closed = true,
                Ok(Control::PeerLost(e)) => return Err(e),
                Err(std_mpsc::TryRecvError::Empty) => {}
            }
            if peer_closed && !busy {
                // Sends the peer finished before closing have been polled above.
                return Err(TransportError::Closed { peer: peer.clone() });
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

    /// A received message as the event the executor sees.
    fn incoming(&self, msg: &[u8]) -> LinkEvent {
        let peer = &self.peer;
        let Some(hb) = msg.get(..FRAME_HEADER_LEN) else {
            return LinkEvent::Failed(Arc::new(verbs_err(
                peer,
                "receive",
                "a message shorter than a frame header",
            )));
        };
        let hb: &[u8; FRAME_HEADER_LEN] = hb.try_into().expect("sliced to the header's length");
        let header = match FrameHeader::decode(hb) {
            Ok(h) => h,
            Err(e) => {
                return LinkEvent::Failed(Arc::new(TransportError::Header {
                    peer: peer.clone(),
                    source: e,
                }))
            }
        };
        let body = &msg[FRAME_HEADER_LEN..];
        if header.len as usize != body.len() {
            return LinkEvent::Failed(Arc::new(verbs_err(
                peer,
                "receive",
                format!(
                    "a frame announcing {} payload bytes carried {}",
                    header.len,
                    body.len()
                ),
            )));
        }
        let mut b = AlignedBuf::with_len(body.len());
        b.as_bytes_mut().copy_from_slice(body);
        LinkEvent::Frame(Incoming {
            header,
            payload: Payload::Owned(b),
        })
    }
}
