//! Runs one rank's [`Schedule`] over the links of its world.
//!
//! Every frame is named by `(epoch, seq, kind, step)`, where `step` is the index of the
//! message on that link within the collective (the k-th message this rank sends to a
//! peer is the k-th one that peer receives from it). Frames that arrive early wait in the
//! link's stash; a frame that can never be right (another descriptor, an earlier
//! collective) fails the collective with `Mismatch`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eccl_algorithms::kernels;
use eccl_algorithms::{Buf, Prim, Region, Schedule};
use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::Descriptor;
use eccl_transport::link::{Incoming, LinkEvent, LinkTx};
use eccl_transport::pool::PooledBuf;
use futures::future::{try_join_all, BoxFuture, FutureExt};
use tokio::sync::mpsc;

use crate::abort::AbortState;
use crate::error::{Error, Result};
use crate::fault;
use crate::links::{PeerLink, PeerRx};

/// Takes the link half of rank `r` for one primitive of a step.
fn take<T>(v: &mut [Option<T>], r: u32) -> Result<T> {
    v.get_mut(r as usize).and_then(Option::take).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "schedule uses the link to rank {r} twice in a step, or a link to itself"
        ))
    })
}

/// `Op::suspect` when nobody is suspected.
pub(crate) const NO_SUSPECT: u32 = u32::MAX;

/// Frames a link may hold for later steps before we call the peer runaway.
const MAX_STASH: usize = 4096;

/// One collective call in progress.
pub(crate) struct Op<'a> {
    pub epoch: u64,
    pub seq: u64,
    pub desc: Descriptor,
    pub world: u32,
    pub timeout: Duration,
    pub frame_bytes: usize,
    pub abort: &'a Arc<AbortState>,
    /// The rank whose link failed or went silent first, for the fault report.
    pub suspect: &'a AtomicU32,
}

impl Op<'_> {
    fn elem(&self) -> usize {
        self.desc.dtype.size()
    }

    fn header(&self, kind: FrameKind, seq: u64, step: u32, desc: Descriptor) -> FrameHeader {
        FrameHeader {
            kind,
            epoch: self.epoch,
            seq,
            step,
            len: 0,
            desc,
            offset: 0,
        }
    }

    fn blame(&self, rank: u32) {
        let _ =
            self.suspect
                .compare_exchange(NO_SUSPECT, rank, Ordering::Relaxed, Ordering::Relaxed);
    }

    fn timeout_err(&self, what: String) -> Error {
        Error::Timeout {
            what,
            ms: self.timeout.as_millis() as u64,
        }
    }

    fn mismatch(&self, rank: u32, theirs: Option<Descriptor>, detail: String) -> Error {
        Error::Mismatch {
            rank: Some(rank),
            ours: Some(self.desc),
            theirs,
            detail,
        }
    }

    fn link_err(&self, rank: u32, e: impl std::fmt::Display) -> Error {
        self.blame(rank);
        Error::Aborted {
            epoch: self.epoch,
            cause: format!("link to rank {rank} failed: {e}"),
        }
    }
}

/// The caller's buffers as raw parts, so that the primitives of one step can borrow
/// disjoint regions of them at the same time.
pub(crate) struct Bufs {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
    scratch: *mut u8,
    scratch_len: usize,
    elem: usize,
}

// SAFETY: `Bufs` is only used inside `run`, which holds the borrows it was made from.
unsafe impl Send for Bufs {}
unsafe impl Sync for Bufs {}

impl Bufs {
    pub fn new(input: &[u8], output: &mut [u8], scratch: &mut [u8], elem: usize) -> Bufs {
        Bufs {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            scratch: scratch.as_mut_ptr(),
            scratch_len: scratch.len(),
            elem,
        }
    }

    fn span(&self, r: &Region) -> Result<(*mut u8, usize)> {
        let (base, len) = match r.buf {
            Buf::Input => (self.input as *mut u8, self.input_len),
            Buf::Output => (self.output, self.output_len),
            Buf::Scratch => (self.scratch, self.scratch_len),
        };
        let start = r.offset.checked_mul(self.elem);
        let bytes = r.len.checked_mul(self.elem);
        match (start, bytes) {
            (Some(s), Some(b)) if s.checked_add(b).is_some_and(|e| e <= len) => {
                Ok((base.wrapping_add(s), b))
            }
            _ => Err(Error::InvalidArgument(format!(
                "schedule region {r:?} is outside its buffer of {len} bytes"
            ))),
        }
    }

    /// # Safety
    /// No live mutable slice may overlap `r` (the schedule was validated: within a step
    /// no primitive reads what another writes).
    unsafe fn get(&self, r: &Region) -> Result<&[u8]> {
        let (p, n) = self.span(r)?;
        Ok(if n == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(p, n)
        })
    }

    /// # Safety
    /// `r` must not overlap any other live slice, and must not be in the input.
    // `&self` hands out `&mut`: the buffers are raw parts, and the validated schedule is
    // what keeps the regions of one step disjoint (see the Safety notes).
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self, r: &Region) -> Result<&mut [u8]> {
        if r.buf == Buf::Input {
            return Err(Error::InvalidArgument(
                "a schedule may not write its input".into(),
            ));
        }
        let (p, n) = self.span(r)?;
        Ok(if n == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(p, n)
        })
    }
}

/// What a receive waits for.
#[derive(Clone, Copy)]
pub(crate) struct Want {
    pub kind: FrameKind,
    pub seq: u64,
    pub step: u32,
    pub desc: Descriptor,
}

impl Want {
    fn names(&self, h: &FrameHeader) -> bool {
        h.kind == self.kind
            && h.seq == self.seq
            && (self.kind == FrameKind::P2p || h.step == self.step)
    }
}

/// Next frame from `rank` that `want` names, taking early arrivals from the stash.
pub(crate) async fn next_frame(
    op: &Op<'_>,
    rx: &mut PeerRx,
    rank: u32,
    want: Want,
) -> Result<Incoming> {
    if let Some(i) = rx.stash.iter().position(|f| want.names(&f.header)) {
        let f = rx.stash.remove(i).expect("index from position");
        return check_desc(op, rank, want, f);
    }
    loop {
        let f = match tokio::time::timeout(op.timeout, rx.link.next()).await {
            Err(_) => {
                op.blame(rank);
                return Err(op.timeout_err(format!("waiting for rank {rank} in {}", want.desc)));
            }
            Ok(None) => return Err(op.link_err(rank, "closed")),
            Ok(Some(LinkEvent::Failed(e))) => return Err(op.link_err(rank, e)),
            Ok(Some(LinkEvent::Frame(f))) => f,
        };
        let h = f.header;
        if h.epoch < op.epoch
            || matches!(
                h.kind,
                FrameKind::StateReq | FrameKind::StateData | FrameKind::StateDone
            )
        {
            // Left over from an earlier epoch, or from a shared-state sync that is over
            // (a late answer to a request that another source already served).
            continue;
        }
        if h.epoch > op.epoch {
            return Err(Error::Aborted {
                epoch: op.epoch,
                cause: format!("rank {rank} is already in epoch {}", h.epoch),
            });
        }
        if want.names(&h) {
            return check_desc(op, rank, want, f);
        }
        let collective = matches!(h.kind, FrameKind::Data | FrameKind::Check);
        if collective && h.seq == op.seq && h.desc != op.desc && want.kind != FrameKind::P2p {
            return Err(op.mismatch(
                rank,
                Some(h.desc),
                format!(
                    "rank {rank} called {} where this rank called {}",
                    h.desc, op.desc
                ),
            ));
        }
        let later = match h.kind {
            FrameKind::P2p => true,
            FrameKind::Data | FrameKind::Check if want.kind == FrameKind::P2p => true,
            FrameKind::Data | FrameKind::Check => {
                h.seq > want.seq
                    || (h.kind == FrameKind::Data
                        && (want.kind == FrameKind::Check || h.step > want.step))
            }
            _ => false,
        };
        if !later {
            return Err(op.mismatch(
                rank,
                Some(h.desc),
                format!("rank {rank} sent {:?} frame (collective #{}, message {}) where this rank expected collective #{} message {}", h.kind, h.seq, h.step, want.seq, want.step),
            ));
        }
        if rx.stash.len() >= MAX_STASH {
            return Err(op.mismatch(
                rank,
                Some(h.desc),
                format!("rank {rank} ran more than {MAX_STASH} frames ahead"),
            ));
        }
        rx.stash.push_back(f);
    }
}

fn check_desc(op: &Op<'_>, rank: u32, want: Want, f: Incoming) -> Result<Incoming> {
    if f.header.desc != want.desc {
        return Err(op.mismatch(
            rank,
            Some(f.header.desc),
            format!(
                "rank {rank} called {} where this rank called {}",
                f.header.desc, want.desc
            ),
        ));
    }
    Ok(f)
}

/// Receives one message of `total` bytes from `rank`, handing each frame's payload to
/// `piece` with its byte offset.
pub(crate) async fn recv_msg<F>(
    op: &Op<'_>,
    rx: &mut PeerRx,
    rank: u32,
    want: Want,
    total: usize,
    mut piece: F,
) -> Result<()>
where
    F: FnMut(usize, PooledBuf) -> Result<()>,
{
    let elem = want.desc.dtype.size();
    let (mut got, mut frames) = (0usize, 0usize);
    while frames == 0 || got < total {
        let f = next_frame(op, rx, rank, want).await?;
        let (off, len) = (f.header.offset as usize, f.header.len as usize);
        let fits = off % elem == 0
            && len % elem == 0
            && off.checked_add(len).is_some_and(|e| e <= total)
            && got + len <= total;
        if !fits {
            return Err(op.mismatch(
                rank,
                Some(f.header.desc),
                format!("rank {rank} sent {len} bytes at offset {off} of a {total}-byte message"),
            ));
        }
        got += len;
        frames += 1;
        piece(off, f.payload)?;
    }
    Ok(())
}

/// Runs `sched`. On error the caller breaks the epoch; buffers may hold partial results
/// (never the input, which is read-only).
pub(crate) async fn run(
    op: &Op<'_>,
    links: &mut [Option<PeerLink>],
    sched: &Schedule,
    bufs: &Bufs,
) -> Result<()> {
    let world = op.world as usize;
    let mut sent = vec![0u32; world];
    let mut recvd = vec![0u32; world];
    let elem = op.elem();
    let (dtype, rop) = (op.desc.dtype, op.desc.op);
    let half = sched.steps.len() / 2;
    for (index, step) in sched.steps.iter().enumerate() {
        if index == half && index > 0 && world > 1 {
            fault::hit(fault::Point::MidRing);
        }
        for p in step.prims.iter().filter(|p| p.is_local()) {
            // SAFETY: local primitives run one at a time; `local` checks src/dst overlap.
            unsafe { local(op, p, bufs)? };
        }
        if step.prims.iter().all(Prim::is_local) {
            continue;
        }
        let mut txs: Vec<Option<&mut LinkTx>> = Vec::with_capacity(world);
        let mut rxs: Vec<Option<&mut PeerRx>> = Vec::with_capacity(world);
        for l in links.iter_mut() {
            match l {
                Some(PeerLink { tx, rx }) => {
                    txs.push(Some(tx));
                    rxs.push(Some(rx));
                }
                None => {
                    txs.push(None);
                    rxs.push(None);
                }
            }
        }
        let mut futs: Vec<BoxFuture<'_, Result<()>>> = Vec::new();
        for p in step.prims.iter().filter(|p| !p.is_local()) {
            let next = |c: &mut Vec<u32>, r: u32| {
                let i = c[r as usize];
                c[r as usize] += 1;
                i
            };
            let want = |step: u32| Want {
                kind: FrameKind::Data,
                seq: op.seq,
                step,
                desc: op.desc,
            };
            // SAFETY (all get/get_mut below): the schedule was validated, so within a step
            // no two primitives write overlapping regions and none reads what another writes.
            match p {
                Prim::Send { peer, src } => {
                    let tx = take(&mut txs, *peer)?;
                    let h = op.header(FrameKind::Data, op.seq, next(&mut sent, *peer), op.desc);
                    let data = unsafe { bufs.get(src)? };
                    let peer = *peer;
                    futs.push(
                        async move {
                            tx.send_region(h, data, op.frame_bytes, elem, op.timeout)
                                .await
                                .map_err(|e| op.link_err(peer, e))
                        }
                        .boxed(),
                    );
                }
                Prim::Recv { peer, dst } => {
                    let rx = take(&mut rxs, *peer)?;
                    let w = want(next(&mut recvd, *peer));
                    let out = unsafe { bufs.get_mut(dst)? };
                    let peer = *peer;
                    futs.push(
                        async move {
                            recv_msg(op, rx, peer, w, out.len(), |off, b| {
                                out[off..off + b.len()].copy_from_slice(b.as_bytes());
                                Ok(())
                            })
                            .await
                        }
                        .boxed(),
                    );
                }
                Prim::RecvReduce { peer, local, dst } => {
                    let rx = take(&mut rxs, *peer)?;
                    let w = want(next(&mut recvd, *peer));
                    let out = unsafe { bufs.get_mut(dst)? };
                    let lhs = if local == dst {
                        None
                    } else {
                        Some(unsafe { bufs.get(local)? })
                    };
                    if lhs.is_some_and(|l| l.len() != out.len()) {
                        return Err(Error::InvalidArgument(
                            "schedule reduces regions of different lengths".into(),
                        ));
                    }
                    let peer = *peer;
                    futs.push(
                        async move {
                            recv_msg(op, rx, peer, w, out.len(), |off, b| {
                                let n = b.len();
                                match lhs {
                                    None => kernels::reduce_inplace_rev(
                                        dtype,
                                        rop,
                                        &mut out[off..off + n],
                                        b.as_bytes(),
                                    ),
                                    Some(l) => kernels::reduce_to(
                                        dtype,
                                        rop,
                                        &mut out[off..off + n],
                                        b.as_bytes(),
                                        &l[off..off + n],
                                    ),
                                }
                                Ok(())
                            })
                            .await
                        }
                        .boxed(),
                    );
                }
                Prim::RecvCopySend { from, to, dst } => {
                    let rx = take(&mut rxs, *from)?;
                    let tx = take(&mut txs, *to)?;
                    let w = want(next(&mut recvd, *from));
                    let h = op.header(FrameKind::Data, op.seq, next(&mut sent, *to), op.desc);
                    let out = unsafe { bufs.get_mut(dst)? };
                    let (from, to) = (*from, *to);
                    futs.push(
                        forward(op, rx, from, w, tx, to, h, out.len(), move |off, b| {
                            out[off..off + b.len()].copy_from_slice(b.as_bytes());
                            Ok(())
                        })
                        .boxed(),
                    );
                }
                Prim::RecvReduceSend {
                    from,
                    to,
                    local,
                    dst,
                } => {
                    let rx = take(&mut rxs, *from)?;
                    let tx = take(&mut txs, *to)?;
                    let w = want(next(&mut recvd, *from));
                    let h = op.header(FrameKind::Data, op.seq, next(&mut sent, *to), op.desc);
                    let lhs = unsafe { bufs.get(local)? };
                    let mut out = match dst {
                        Some(d) => Some(unsafe { bufs.get_mut(d)? }),
                        None => None,
                    };
                    if out.as_ref().is_some_and(|o| o.len() != lhs.len()) {
                        return Err(Error::InvalidArgument(
                            "schedule reduces regions of different lengths".into(),
                        ));
                    }
                    let (from, to) = (*from, *to);
                    futs.push(
                        forward(op, rx, from, w, tx, to, h, lhs.len(), move |off, b| {
                            let n = b.len();
                            // incoming ⊕ local, computed in the received buffer so it can be
                            // forwarded as is.
                            kernels::reduce_inplace(
                                dtype,
                                rop,
                                b.as_bytes_mut(),
                                &lhs[off..off + n],
                            );
                            if let Some(o) = out.as_mut() {
                                o[off..off + n].copy_from_slice(b.as_bytes());
                            }
                            Ok(())
                        })
                        .boxed(),
                    );
                }
                Prim::Copy { .. } | Prim::Reduce { .. } | Prim::Finalize { .. } => {}
            }
        }
        let all = try_join_all(futs);
        // Biased: work that finished is reported as finished even if an abort arrived
        // at the same moment (the abort then breaks the next call instead).
        tokio::select! {
            biased;
            r = all => { r?; }
            e = op.abort.wait(op.epoch) => return Err(e),
        }
        if index == 0 {
            fault::hit(fault::Point::FirstChunk);
        }
    }
    Ok(())
}

/// Receives a message piece by piece, lets `piece` transform each one in place, and
/// forwards it to `to` while the next piece is still arriving.
#[allow(clippy::too_many_arguments)]
async fn forward<'a, F>(
    op: &'a Op<'a>,
    rx: &'a mut PeerRx,
    from: u32,
    want: Want,
    tx: &'a mut LinkTx,
    to: u32,
    header: FrameHeader,
    total: usize,
    mut piece: F,
) -> Result<()>
where
    F: FnMut(usize, &mut PooledBuf) -> Result<()> + Send + 'a,
{
    let (ftx, mut frx) = mpsc::unbounded_channel::<(usize, PooledBuf)>();
    let recv = async move {
        recv_msg(op, rx, from, want, total, move |off, mut b| {
            piece(off, &mut b)?;
            let _ = ftx.send((off, b));
            Ok(())
        })
        .await
    };
    let send = async move {
        while let Some((off, b)) = frx.recv().await {
            let mut h = header;
            h.offset = off as u64;
            tx.send_frame(h, b.as_bytes(), op.timeout)
                .await
                .map_err(|e| op.link_err(to, e))?;
        }
        Ok(())
    };
    tokio::try_join!(recv, send).map(|_| ())
}

/// # Safety
/// No other slice of the buffers may be live.
unsafe fn local(op: &Op<'_>, p: &Prim, bufs: &Bufs) -> Result<()> {
    let (dtype, rop) = (op.desc.dtype, op.desc.op);
    match p {
        Prim::Copy { src, dst } => {
            if src.overlaps(dst) {
                return Err(Error::InvalidArgument(
                    "schedule copies between overlapping regions".into(),
                ));
            }
            bufs.get_mut(dst)?.copy_from_slice(bufs.get(src)?);
        }
        Prim::Reduce { src, dst } => {
            if src.overlaps(dst) {
                return Err(Error::InvalidArgument(
                    "schedule reduces overlapping regions".into(),
                ));
            }
            kernels::reduce_inplace(dtype, rop, bufs.get_mut(dst)?, bufs.get(src)?);
        }
        Prim::Finalize { region } => {
            kernels::finalize(dtype, rop, bufs.get_mut(region)?, op.world as usize)
        }
        _ => {}
    }
    Ok(())
}

/// The check that precedes rooted collectives: every rank sends its descriptor to every
/// other rank and waits for theirs, so that ranks that disagree on the root (and so would
/// not exchange any data with each other) still fail with `Mismatch` instead of passing.
pub(crate) async fn check_round(op: &Op<'_>, links: &mut [Option<PeerLink>]) -> Result<()> {
    let h = op.header(FrameKind::Check, op.seq, 0, op.desc);
    let want = Want {
        kind: FrameKind::Check,
        seq: op.seq,
        step: 0,
        desc: op.desc,
    };
    let futs = links
        .iter_mut()
        .enumerate()
        .filter_map(|(r, l)| l.as_mut().map(|l| (r as u32, l)))
        .map(|(r, l)| async move {
            let PeerLink { tx, rx } = l;
            let send = async {
                tx.send_frame(h, &[], op.timeout)
                    .await
                    .map_err(|e| op.link_err(r, e))
            };
            let recv = async { next_frame(op, rx, r, want).await.map(|_| ()) };
            tokio::try_join!(send, recv).map(|_| ())
        });
    let all = try_join_all(futs);
    tokio::select! {
        biased;
        r = all => r.map(|_| ()),
        e = op.abort.wait(op.epoch) => Err(e),
    }
}

/// Tells every peer that this rank aborted collective `seq` (best effort, briefly
/// bounded: the peers may be gone).
pub(crate) async fn broadcast_abort(
    epoch: u64,
    seq: u64,
    desc: Descriptor,
    cause: eccl_protocol::frame::AbortCause,
    reason: &str,
    links: &mut [Option<PeerLink>],
) {
    let h = FrameHeader {
        kind: FrameKind::Abort,
        epoch,
        seq,
        step: cause as u32,
        len: 0,
        desc,
        offset: 0,
    };
    let reason = reason.as_bytes();
    let reason = &reason[..reason.len().min(1024)];
    let futs = links
        .iter_mut()
        .flatten()
        .filter(|l| !l.tx.is_poisoned())
        .map(|l| l.tx.send_frame(h, reason, Duration::from_millis(200)));
    let _ = futures::future::join_all(futs).await;
}

/// A point-to-point message.
pub(crate) async fn send_p2p(
    op: &Op<'_>,
    link: &mut PeerLink,
    rank: u32,
    data: &[u8],
) -> Result<()> {
    let h = op.header(FrameKind::P2p, op.seq, 0, op.desc);
    let send = link
        .tx
        .send_region(h, data, op.frame_bytes, op.elem(), op.timeout);
    tokio::select! {
        biased;
        r = send => r.map_err(|e| op.link_err(rank, e)),
        e = op.abort.wait(op.epoch) => Err(e),
    }
}

pub(crate) async fn recv_p2p(
    op: &Op<'_>,
    link: &mut PeerLink,
    rank: u32,
    out: &mut [u8],
) -> Result<()> {
    let want = Want {
        kind: FrameKind::P2p,
        seq: op.seq,
        step: 0,
        desc: op.desc,
    };
    let total = out.len();
    let recv = recv_msg(op, &mut link.rx, rank, want, total, |off, b| {
        out[off..off + b.len()].copy_from_slice(b.as_bytes());
        Ok(())
    });
    tokio::select! {
        biased;
        r = recv => r,
        e = op.abort.wait(op.epoch) => Err(e),
    }
}
