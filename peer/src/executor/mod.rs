//! Runs one rank's [`Schedule`] over the links of its world.
//!
//! Every frame is named by `(epoch, seq, kind, index)`, where `index` is the index of the
//! message on that link within the collective (the k-th message this rank sends to a
//! peer is the k-th one that peer receives from it). Frames that arrive early wait in the
//! link's stash; a frame that can never be right (another descriptor, an earlier
//! collective) fails the collective with `Mismatch`.

//!
//! | file | job |
//! |---|---|
//! | `mod.rs` | the steps of a schedule and their primitives |
//! | `frames.rs` | waiting for frames, assembling messages |
//! | `control.rs` | the rooted check, abort notices, point-to-point |
//! | `eccl_algorithms::bufs` | the caller's buffers as regions (the executor's `unsafe`) |
//!
//! The executor drives links through `eccl_transport::link` only: it does not know which
//! transport carries the bytes.

mod control;
mod frames;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use eccl_algorithms::{Prim, Schedule};
use eccl_protocol::frame::{FrameHeader, FrameKind};
use eccl_protocol::Descriptor;
use eccl_transport::link::LinkTx;
use eccl_transport::link::Payload;
use futures::future::{try_join_all, BoxFuture, FutureExt};
use tokio::sync::mpsc;

pub(crate) use control::{
    broadcast_abort, check_round, close_header, probe_p2p, recv_p2p, send_p2p,
};
pub(crate) use eccl_algorithms::bufs::Bufs;
use eccl_algorithms::bufs::{self, Mem};
use frames::{recv_msg, Want};

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

/// `Running::suspect` when nobody is suspected.
pub(crate) const NO_SUSPECT: u32 = u32::MAX;

/// One collective call in progress.
pub(crate) struct Running<'a> {
    pub epoch: u64,
    pub seq: u64,
    pub desc: Descriptor,
    pub world: u32,
    pub timeout: Duration,
    pub frame_bytes: usize,
    pub abort: &'a Arc<AbortState>,
    /// The rank whose link failed or went silent first, for the fault report.
    pub suspect: &'a AtomicU32,
    /// An all_to_all with split sizes: each pair's messages are named by their own
    /// blocks ([`pair_descs`]), not by the call's descriptor.
    pub uneven: bool,
}

impl Running<'_> {
    /// Resolves once an abort breaks this call (a collective: this one or one before it
    /// on the aborting rank; a point-to-point message: any abort of the epoch).
    async fn aborted(&self) -> Error {
        let seq = (self.desc.kind != eccl_protocol::CollectiveKind::SendRecv).then_some(self.seq);
        self.abort.wait(self.epoch, seq).await
    }

    fn elem(&self) -> usize {
        self.desc.dtype.size()
    }

    fn header(&self, kind: FrameKind, seq: u64, index: u32, desc: Descriptor) -> FrameHeader {
        FrameHeader {
            kind,
            epoch: self.epoch,
            seq,
            index,
            len: 0,
            desc,
            offset: 0,
            tag: 0,
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

/// Runs `sched`. On error the caller breaks the epoch; buffers may hold partial results
/// (never the input, which is read-only).
/// Bytes of local work (copies, reductions) after which a step yields to the runtime.
const LOCAL_YIELD_BYTES: usize = 8 << 20;

pub(crate) async fn run(
    op: &Running<'_>,
    links: &mut [Option<PeerLink>],
    sched: &Schedule,
    bufs: &Bufs,
) -> Result<()> {
    let world = op.world as usize;
    let mut sent = vec![0u32; world];
    let mut recvd = vec![0u32; world];
    let pairs = op.uneven.then(|| pair_descs(op, sched));
    let (dtype, rop) = (op.desc.dtype, op.desc.op);
    let half = sched.steps.len() / 2;
    for (index, step) in sched.steps.iter().enumerate() {
        if index == half && index > 0 && world > 1 {
            fault::hit(fault::Point::MidRing);
        }
        let mut local_elems = 0;
        for p in step.prims.iter().filter(|p| p.is_local()) {
            // SAFETY: local primitives run one at a time, before the step's others
            // borrow anything; `run_local` checks src/dst overlap.
            unsafe { bufs.run_local(p, dtype, rop, world)? };
            local_elems += match p {
                Prim::Copy { dst, .. } | Prim::Reduce { dst, .. } => dst.len,
                Prim::Finalize { region } => region.len,
                _ => 0,
            };
        }
        if local_elems * dtype.size() >= LOCAL_YIELD_BYTES {
            // A long copy or reduction in this task: let the worker poll its timers and
            // I/O before going on (see `eccl_transport::link`'s pacing).
            tokio::task::yield_now().await;
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
            let (from, to) = ends(p);
            let recv = match from {
                Some(r) => {
                    let index = recvd[r as usize];
                    recvd[r as usize] += 1;
                    let want = Want {
                        kind: FrameKind::Data,
                        seq: op.seq,
                        index,
                        desc: pairs.as_ref().map_or(op.desc, |p| p[r as usize].want.0),
                        tag: pairs.as_ref().map_or(0, |p| p[r as usize].want.1),
                    };
                    Some((take(&mut rxs, r)?, r, want))
                }
                None => None,
            };
            let send = match to {
                Some(r) => {
                    let (desc, tag) = pairs.as_ref().map_or((op.desc, 0), |p| p[r as usize].send);
                    let mut h = op.header(FrameKind::Data, op.seq, sent[r as usize], desc);
                    h.tag = tag;
                    sent[r as usize] += 1;
                    Some((take(&mut txs, r)?, r, h))
                }
                None => None,
            };
            // SAFETY: the schedule was validated and the local primitives' slices are
            // gone (see `Bufs::borrow`).
            let mem = unsafe { bufs.borrow(p)? };
            futs.push(prim(op, recv, mem, send).boxed());
        }
        let all = try_join_all(futs);
        // Biased: work that finished is reported as finished even if an abort arrived
        // at the same moment (the abort then breaks the next call instead).
        tokio::select! {
            biased;
            r = all => { r?; }
            e = op.aborted() => return Err(e),
        }
        if index == 0 {
            fault::hit(fault::Point::FirstChunk);
        }
    }
    Ok(())
}

/// How an all_to_all with split sizes names the frames of one pair: what this rank
/// sends the peer and what it wants from it, each a descriptor and a data frame's tag.
pub(crate) struct PairNames {
    pub send: (Descriptor, u32),
    pub want: (Descriptor, u32),
}

/// The operator of a pair's descriptor: an even all_to_all's is always `Sum`, so a rank
/// that passed split sizes and one that did not never take each other's frames.
pub(crate) const SPLIT_OP: eccl_protocol::ReduceOp = eccl_protocol::ReduceOp::Prod;

/// For an all_to_all with split sizes, what each peer's frames are named by: the
/// descriptor's `count` is the block the frame's sender sends, its `root` and the
/// frame's `tag` the low and high 32 bits of the block it expects back; what this rank
/// wants from a peer is the same seen from the other end. Both ends compare both blocks,
/// so a pair whose ends disagree on either fails with a mismatch at both ends, as ranks
/// that call different collectives do.
fn pair_descs(op: &Running<'_>, sched: &Schedule) -> Vec<PairNames> {
    let mut len = vec![(0usize, 0usize); op.world as usize];
    for p in sched.steps.iter().flat_map(|s| &s.prims) {
        match *p {
            Prim::Send { peer, src } => len[peer as usize].0 = src.len,
            Prim::Recv { peer, dst } => len[peer as usize].1 = dst.len,
            _ => {}
        }
    }
    let named = |count: usize, back: usize| {
        let back = back as u64;
        let desc = Descriptor {
            count: count as u64,
            root: back as u32,
            op: SPLIT_OP,
            ..op.desc
        };
        (desc, (back >> 32) as u32)
    };
    len.into_iter()
        .map(|(send, recv)| PairNames {
            send: named(send, recv),
            want: named(recv, send),
        })
        .collect()
}

/// The links a network primitive uses: the rank it receives from, the rank it sends to.
fn ends(p: &Prim) -> (Option<u32>, Option<u32>) {
    match *p {
        Prim::Send { peer, .. } => (None, Some(peer)),
        Prim::Recv { peer, .. } | Prim::RecvReduce { peer, .. } => (Some(peer), None),
        Prim::RecvCopySend { from, to, .. } | Prim::RecvReduceSend { from, to, .. } => {
            (Some(from), Some(to))
        }
        Prim::Copy { .. } | Prim::Reduce { .. } | Prim::Finalize { .. } => (None, None),
    }
}

/// Where a receiving primitive's pieces go.
enum Land<'a> {
    /// Copied into the output (`Recv`, `RecvCopySend`).
    Copy(bufs::Out<'a>),
    /// Combined with local data (`RecvReduce`, `RecvReduceSend`).
    Reduce(bufs::Reduce<'a>),
}

impl Land<'_> {
    /// Lands the piece at byte `off`. A piece that goes on (`forwarding`) must hold
    /// what is forwarded afterwards: a reduction is computed in it.
    fn piece(&mut self, op: &Running<'_>, off: usize, b: &mut Payload, forwarding: bool) {
        let (dtype, rop) = (op.desc.dtype, op.desc.op);
        match self {
            Land::Copy(out) => out.write(off, b.as_bytes()),
            Land::Reduce(r) if forwarding => r.combine_into(dtype, rop, off, b.as_bytes_mut()),
            Land::Reduce(r) => r.combine_from(dtype, rop, off, b.as_bytes()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Land::Copy(out) => out.len(),
            Land::Reduce(r) => r.len(),
        }
    }
}

/// One network primitive, every kind an instance of the same step (NCCL's `prims`
/// shape): receive a message piece by piece from `recv`'s rank, land each piece in
/// `mem` (copy or reduce), and forward it to `send`'s rank while the next piece is still
/// arriving; or, with nothing to receive, send `mem` as it is.
async fn prim(
    op: &Running<'_>,
    recv: Option<(&mut PeerRx, u32, Want)>,
    mem: Mem<'_>,
    send: Option<(&mut LinkTx, u32, FrameHeader)>,
) -> Result<()> {
    let mut land = match (mem, &recv) {
        (Mem::Read(data), None) => {
            let Some((tx, to, h)) = send else {
                return Err(Error::InvalidArgument(
                    "internal: a primitive that neither receives nor sends".into(),
                ));
            };
            tracing::trace!(target: "eccl::coll", "to rank {to}: {:?} #{} message {} ({} B)", h.kind, h.seq, h.index, data.len());
            return tx
                .send_region(h, data, op.frame_bytes, op.elem(), op.timeout)
                .await
                .map_err(|e| op.link_err(to, e));
        }
        (Mem::Write(out), Some(_)) => Land::Copy(out),
        (Mem::Reduce(r), Some(_)) => Land::Reduce(r),
        (_, _) => {
            return Err(Error::InvalidArgument(
                "internal: a primitive borrowed the wrong kind of memory".into(),
            ))
        }
    };
    let (rx, from, want) = recv.expect("matched above");
    let total = land.len();
    let Some((tx, to, header)) = send else {
        return recv_msg(op, rx, from, want, total, None, |off, mut b| {
            land.piece(op, off, &mut b, false);
            Ok(())
        })
        .await;
    };
    // Each landed piece goes on as it is, while the next one arrives.
    let (ftx, mut frx) = mpsc::unbounded_channel::<(usize, Payload)>();
    let receive = recv_msg(op, rx, from, want, total, None, move |off, mut b| {
        land.piece(op, off, &mut b, true);
        let _ = ftx.send((off, b));
        Ok(())
    });
    let forward = async move {
        while let Some((off, b)) = frx.recv().await {
            let mut h = header;
            h.offset = off as u64;
            tx.send_frame(h, b.as_bytes(), op.timeout)
                .await
                .map_err(|e| op.link_err(to, e))?;
        }
        Ok(())
    };
    tokio::try_join!(receive, forward).map(|_| ())
}
