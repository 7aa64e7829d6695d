//! Collectives: check a call, pick its algorithm, build (or reuse) its schedule and run
//! it over the links; on failure, break the epoch and tell everyone why.

use futures::future::{BoxFuture, FutureExt};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use eccl_algorithms::{buffer_lens, build_all_to_all_v, build_in_ring, choose_algo_in, Schedule};
use eccl_protocol::frame::AbortCause;
use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, PeerId, PeerRequest, Rank, ReduceOp};
use eccl_transport::pool::AlignedBuf;

use super::Communicator;
use crate::error::{Error, Result};
use crate::executor::{self, Bufs, Running};

/// What a successful collective reports (G3): the epoch it ran in and who took part, so
/// that a caller can, for example, weight an average by the members that contributed.
#[derive(Clone, Debug)]
pub struct OpInfo {
    pub epoch: u64,
    /// Number of the collective in its epoch (point-to-point: of the message on its
    /// pair and tag).
    pub seq: u64,
    pub rank: Rank,
    pub world_size: u32,
    pub members: Arc<[PeerId]>,
    pub algo: Algo,
    /// Point-to-point: the rank at the other end (the sender, for a receive from any
    /// source); `None` for collectives.
    pub peer: Option<Rank>,
}

/// What an in-place collective leaves in its buffer when it fails.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnAbort {
    /// The buffer as it was before the call (G2). Where the schedule runs in the buffer
    /// itself ([`eccl_algorithms::Schedule::in_place`]: the ring all_reduce does), each
    /// piece is saved just before its first write, while it is read anyway, and put
    /// back if the call fails or is dropped; elsewhere the call works in scratch and
    /// copies the result back on success. What retry loops (ElasticDDP,
    /// [`crate::RetryPolicy`]) rely on.
    #[default]
    Unchanged,
    /// Whatever the call had written by then (NCCL's and gloo's in-place semantics):
    /// the schedule works in the buffer itself where it can, with no scratch and nothing
    /// saved. For callers that drop the buffer's contents when a call fails, as torch's
    /// DDP does with a failed step's gradients.
    Undefined,
}

/// A call's buffers: apart, lists of blocks read as one buffer each, or one buffer in
/// place.
enum Io<'a> {
    Apart(&'a [u8], &'a mut [u8]),
    Lists(Vec<&'a [u8]>, Vec<&'a mut [u8]>),
    InPlace {
        buf: &'a mut [u8],
        on_abort: OnAbort,
    },
}

/// A schedule as built, and the same in the caller's buffer, worked out on first use.
pub(crate) struct Built {
    plain: Schedule,
    in_place: OnceLock<Option<Schedule>>,
}

impl Built {
    fn in_place(&self) -> Option<&Schedule> {
        self.in_place.get_or_init(|| self.plain.in_place()).as_ref()
    }
}

/// A collective's place: the epoch it runs in, its number there, and this rank's part.
#[derive(Clone, Copy)]
struct Slot {
    epoch: u64,
    seq: u64,
    rank: Rank,
    world: u32,
}

/// Arguments of one collective, untyped (the Python layer and eccl-bench use this form).
#[derive(Clone, Copy, Debug)]
pub struct CollArgs {
    pub kind: CollectiveKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: Rank,
    /// Element count, NCCL's convention (see [`Descriptor`]).
    pub count: usize,
}

impl CollArgs {
    /// The arguments of a collective of `kind` over buffers of `input` and `output`
    /// elements in a world of `world` ranks, with the count in NCCL's convention. A rank
    /// of a rooted collective passes `None` for a buffer it does not use (gather's output
    /// or scatter's input off the root); an in-place call passes its buffer as both.
    pub fn for_buffers(
        kind: CollectiveKind,
        dtype: DType,
        op: ReduceOp,
        root: Rank,
        input: Option<usize>,
        output: Option<usize>,
        world: u32,
    ) -> CollArgs {
        use CollectiveKind::*;
        let (i, o) = (input.unwrap_or(0), output.unwrap_or(0));
        let count = match kind {
            Broadcast | Scatter | ReduceScatter => o,
            Reduce | AllReduce | Gather | AllGather | SendRecv => i,
            AllToAll => i / world.max(1) as usize,
            Barrier => 0,
        };
        CollArgs {
            kind,
            dtype,
            op,
            root,
            count,
        }
    }
}

impl Communicator {
    /// Runs one collective, out of place, on byte buffers. `input` and `output` hold
    /// exactly the elements [`buffer_lens`] names for this rank; on ranks that do not
    /// read the input (or write the output) of a rooted collective, any length is
    /// accepted and ignored.
    pub async fn collective(
        &mut self,
        args: CollArgs,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<OpInfo> {
        self.run_collective(args, Io::Apart(input, output)).await
    }

    /// [`Communicator::collective`] with the input and the output each given as a list
    /// of buffers, read as if they lay back to back in list order: torch's list forms
    /// (`all_gather` into one tensor per rank, `scatter` from one per rank, ...), as gloo
    /// takes them. Where each rank's block is one buffer of the list, the schedule reads
    /// and writes the buffers where they are; a list cut otherwise (or a schedule that
    /// moves several ranks' blocks in one message) goes through one packed copy. A list
    /// of one buffer is that buffer; an empty list, an empty buffer (a rank that does not
    /// use that side of a rooted collective).
    pub async fn collective_lists(
        &mut self,
        args: CollArgs,
        inputs: &[&[u8]],
        outputs: &mut [&mut [u8]],
    ) -> Result<OpInfo> {
        if inputs.len() <= 1 && outputs.len() <= 1 {
            let input = inputs.first().copied().unwrap_or_default();
            let output = match outputs.first_mut() {
                Some(b) => &mut **b,
                None => &mut [],
            };
            return self.run_collective(args, Io::Apart(input, output)).await;
        }
        let outs = outputs.iter_mut().map(|b| &mut **b).collect();
        self.run_collective(args, Io::Lists(inputs.to_vec(), outs))
            .await
    }

    /// Runs a collective in place on `buf`; a failed call leaves `buf` as it was (G2,
    /// [`OnAbort::Unchanged`]); see [`Communicator::collective_inplace_with`] for the
    /// trade without the saved copy.
    pub async fn collective_inplace(&mut self, args: CollArgs, buf: &mut [u8]) -> Result<OpInfo> {
        self.collective_inplace_with(args, buf, OnAbort::Unchanged)
            .await
    }

    /// Runs a collective in place on `buf`, leaving it as [`OnAbort`] says if the call
    /// fails. With [`OnAbort::Undefined`] the schedule works in `buf` itself wherever
    /// that gives the same result ([`eccl_algorithms::Schedule::in_place`]: the ring
    /// all_reduce does) and saves nothing; elsewhere it works in scratch as with
    /// [`OnAbort::Unchanged`].
    pub async fn collective_inplace_with(
        &mut self,
        args: CollArgs,
        buf: &mut [u8],
        on_abort: OnAbort,
    ) -> Result<OpInfo> {
        self.run_collective(args, Io::InPlace { buf, on_abort })
            .await
    }

    /// All_to_all whose blocks differ in size (MPI's `alltoallv`, torch's
    /// `all_to_all_single` with split sizes, a dropless MoE layer's dispatch):
    /// `send_counts[j]` elements of `input` go to rank `j` and `recv_counts[j]` elements
    /// of `output` come from it, each buffer's blocks in rank order with nothing between
    /// them. Every pair moves exactly its own two blocks, directly (nothing padded to the
    /// widest, no relaying). The two ends of each pair must agree on both its blocks: a
    /// pair that does not fails with [`Error::Mismatch`] at both ends (naming the sizes)
    /// and ends the epoch, as any mismatch does. A call that is wrong on its own
    /// (counts not one per rank, buffers of other lengths, a block to itself that differs
    /// from the one from itself) fails with [`Error::InvalidArgument`] and ends the epoch
    /// too, so nobody waits for it. `output` is undefined after a failed call.
    pub async fn all_to_all_v(
        &mut self,
        dtype: DType,
        input: &[u8],
        send_counts: &[usize],
        output: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<OpInfo> {
        self.all_to_all_v_lists(dtype, &[input], send_counts, &mut [output], recv_counts)
            .await
    }

    /// [`Communicator::all_to_all_v`] with the input and the output each given as a
    /// list of buffers read as one, back to back (torch's list form: one tensor per
    /// rank, each of its block's size, read and written where it is).
    pub async fn all_to_all_v_lists(
        &mut self,
        dtype: DType,
        inputs: &[&[u8]],
        send_counts: &[usize],
        outputs: &mut [&mut [u8]],
        recv_counts: &[usize],
    ) -> Result<OpInfo> {
        let in_bytes = list_bytes("input", inputs.iter().map(|b| b.len()))?;
        let out_bytes = list_bytes("output", outputs.iter().map(|b| b.len()))?;
        let slot @ Slot {
            epoch,
            seq,
            rank,
            world,
        } = self.next_slot()?;
        let elem = dtype.size();
        // The call's own descriptor (abort notices, errors): its frames are named by
        // each pair's blocks instead (the executor's `pair_descs`).
        let desc = Descriptor {
            kind: CollectiveKind::AllToAll,
            dtype,
            op: ReduceOp::Sum,
            algo: Algo::Direct,
            root: 0,
            count: send_counts
                .iter()
                .fold(0u64, |a, &n| a.saturating_add(n as u64)),
        };
        let sched = build_all_to_all_v(dtype, rank.0, world, send_counts, recv_counts)
            .map_err(|e| match e {
                eccl_algorithms::BuildError::InvalidArgument(m) => Error::InvalidArgument(m),
                other => Error::InvalidArgument(other.to_string()),
            })
            .and_then(|s| {
                let (i, o) = (s.input_len * elem, s.output_len * elem);
                s.validate()
                    .map_err(|e| Error::InvalidArgument(format!("internal schedule error: {e}")))?;
                if in_bytes != i || out_bytes != o {
                    return Err(Error::InvalidArgument(format!(
                        "all_to_all with split sizes: the counts call for {i} bytes of input and {o} of output ({dtype}), the buffers hold {in_bytes} and {out_bytes}"
                    )));
                }
                Ok(s)
            });
        let sched = match sched {
            Ok(s) => s,
            Err(e) => return Err(self.fail(epoch, seq, desc, e).await),
        };
        if let Some(e) = self.abort.check_call(epoch, Some(seq)) {
            return Err(e);
        }
        let (timeout, frame_bytes) = (self.cfg.timeout, self.cfg.frame_bytes);
        let c = self
            .cur
            .as_mut()
            .expect("world checked at the start of the call");
        let op = Running {
            epoch,
            seq,
            desc,
            world,
            timeout,
            frame_bytes,
            abort: &self.abort,
            suspect: &self.suspect,
            uneven: true,
        };
        match run_on_lists(&op, &mut c.links, &sched, inputs, outputs, &mut [], elem).await {
            Ok(()) => Ok(self.succeeded(slot, Algo::Direct)),
            Err(e) => Err(self.fail(epoch, seq, desc, e).await),
        }
    }

    /// The next collective's place in the current epoch (its sequence number taken), or
    /// why there is none: this peer was evicted, or it has no world yet.
    fn next_slot(&mut self) -> Result<Slot> {
        if let Some(e) = self.evicted_error() {
            return Err(e);
        }
        let c = self.cur.as_mut().ok_or_else(|| {
            Error::InvalidArgument("no world yet: call update_topology() first".into())
        })?;
        let slot = Slot {
            epoch: c.world.epoch,
            seq: c.seq,
            rank: c.rank,
            world: c.size(),
        };
        c.seq += 1;
        Ok(slot)
    }

    /// A collective in `slot` that succeeded: counted done, and what it reports.
    fn succeeded(&mut self, slot: Slot, algo: Algo) -> OpInfo {
        let c = self.cur.as_mut().expect("world present");
        if c.done == slot.seq {
            c.done = slot.seq + 1;
        }
        OpInfo {
            epoch: slot.epoch,
            seq: slot.seq,
            rank: slot.rank,
            world_size: slot.world,
            members: c.members.clone(),
            algo,
            peer: None,
        }
    }

    fn run_collective<'a>(
        &'a mut self,
        args: CollArgs,
        mut io: Io<'a>,
    ) -> BoxFuture<'a, Result<OpInfo>> {
        async move {
        let forced = self.cfg.algo;
        let (timeout, frame_bytes) = (self.cfg.timeout, self.cfg.frame_bytes);
        let slot @ Slot { epoch, seq, rank, world } = self.next_slot()?;
        let elem = args.dtype.size();
        let bytes = args.count.saturating_mul(elem);
        let c = self.cur.as_ref().expect("a world: next_slot found one");
        let tuned = c.world.tuned_algo(args.kind, bytes as u64);
        let choice = choose_algo_in(args.kind, bytes, world, forced, tuned);
        let desc = Descriptor {
            kind: args.kind,
            dtype: args.dtype,
            op: if args.kind.reduces() {
                args.op
            } else {
                ReduceOp::Sum
            },
            algo: choice.algo,
            root: args.root.0,
            count: args.count as u64,
        };
        // A call that is wrong on its own says so, even if the epoch is already broken.
        let (in_bytes, out_bytes) = match &io {
            Io::Apart(i, o) => (i.len(), o.len()),
            Io::Lists(i, o) => (
                list_bytes("input", i.iter().map(|b| b.len()))?,
                list_bytes("output", o.iter().map(|b| b.len()))?,
            ),
            // One buffer serves as whichever of the two this rank uses.
            Io::InPlace { buf, .. } => {
                let (i, o) = buffer_lens(args.kind, args.count, world, rank.0, args.root.0);
                let len = |n: usize| if n == 0 { 0 } else { buf.len() };
                (len(i), len(o))
            }
        };
        let (in_len, out_len) = match validate(&args, world, rank, in_bytes, out_bytes) {
            Ok(l) => l,
            Err(e) => return Err(self.fail(epoch, seq, desc, e).await),
        };
        if let Some(e) = self.abort.check_call(epoch, Some(seq)) {
            return Err(e);
        }
        let result = async {
            let key = (desc, rank.0, world);
            let built = match self.schedules.get(&key) {
                Some(s) => s.clone(),
                None => {
                    // The master's ring order, if it solved one (all_reduce, broadcast,
                    // reduce and barrier follow it).
                    let ring = self.cur.as_ref().map(|c| c.world.ring.clone()).unwrap_or_default();
                    let ring = (!ring.is_empty()).then_some(&ring[..]);
                    let s = build_in_ring(&desc, rank.0, world, ring).map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    s.validate().map_err(|e| Error::InvalidArgument(format!("internal schedule error: {e}")))?;
                    let s = Arc::new(Built { plain: s, in_place: OnceLock::new() });
                    if self.schedules.len() > 256 {
                        self.schedules.clear();
                    }
                    self.schedules.insert(key, s.clone());
                    s
                }
            };
            // In place, the schedule works in the caller's buffer wherever it can: as it is
            // where a failure may leave anything there, else with each byte saved before
            // its first write and put back if the call fails (G2).
            let direct = match &io {
                Io::InPlace { .. } => built.in_place(),
                _ => None,
            };
            if self.last_algo.insert(args.kind, choice.algo) != Some(choice.algo) {
                tracing::info!(target: "eccl::coll", "{} bytes on {world} ranks: {}", args.count * elem, choice.reason);
            }
            let sched = direct.unwrap_or(&built.plain);
            self.scratch.set_len(sched.scratch_len * elem);
            let c = self.cur.as_mut().expect("world checked at the start of the call");
            let op = Running { epoch, seq, desc, world, timeout, frame_bytes, abort: &self.abort, suspect: &self.suspect, uneven: false };
            if args.kind.is_rooted() && world > 1 {
                executor::check_round(&op, &mut c.links).await?;
            }
            let scratch = self.scratch.as_bytes_mut();
            match &mut io {
                Io::Apart(input, output) => {
                    let bufs = Bufs::new(&input[..in_len * elem], &mut output[..out_len * elem], scratch, elem);
                    executor::run(&op, &mut c.links, sched, &bufs).await
                }
                Io::Lists(inputs, outputs) => {
                    // A side this rank does not use (a rooted call's) is left out, as
                    // `Apart` cuts it to nothing.
                    let ins: &[&[u8]] = if in_len == 0 { &[] } else { inputs };
                    let outs: &mut [&mut [u8]] = if out_len == 0 { &mut [] } else { outputs };
                    run_on_lists(&op, &mut c.links, sched, ins, outs, scratch, elem).await
                }
                Io::InPlace { buf, on_abort: OnAbort::Undefined } if direct.is_some() => {
                    // The rewritten schedule reads no input: the buffer is its output.
                    let bufs = Bufs::new(&[], &mut buf[..sched.output_len * elem], scratch, elem);
                    executor::run(&op, &mut c.links, sched, &bufs).await
                }
                Io::InPlace { buf, .. } if direct.is_some() => {
                    let backup = &mut self.inplace;
                    backup.set_len(sched.output_len * elem);
                    let out = &mut buf[..sched.output_len * elem];
                    let kept = Bufs::keeping(&[], out, scratch, elem, backup.as_bytes_mut())
                        .map_err(|e| Error::InvalidArgument(format!("internal: {e}")))?;
                    // Dropping `kept` puts back every byte written (also when this call
                    // is dropped half-way); only a call that succeeded keeps them.
                    let r = executor::run(&op, &mut c.links, sched, &kept).await;
                    if r.is_ok() {
                        kept.keep_result();
                    } else {
                        tracing::debug!(target: "eccl::coll", "{desc} failed: {} bytes of the buffer put back as they were", kept.saved_bytes());
                        drop(kept);
                    }
                    if backup.capacity() > 256 << 20 {
                        *backup = AlignedBuf::default();
                    }
                    r
                }
                Io::InPlace { buf, .. } => {
                    // In scratch, copied back only on success (G2).
                    let tmp = &mut self.inplace;
                    tmp.set_len(out_len * elem);
                    let bufs = Bufs::new(&buf[..in_len * elem], tmp.as_bytes_mut(), scratch, elem);
                    // `bufs` is not used past the run: the copy below is the only access.
                    let r = executor::run(&op, &mut c.links, sched, &bufs).await;
                    if r.is_ok() {
                        // In one piece, with no await: a call dropped half-way through
                        // the copy would leave the buffer neither as it was nor done (G2).
                        buf[..out_len * elem].copy_from_slice(tmp.as_bytes());
                    }
                    if tmp.capacity() > 256 << 20 {
                        *tmp = AlignedBuf::default();
                    }
                    r
                }
            }
        }
        .await;
        match result {
            Ok(()) => Ok(self.succeeded(slot, choice.algo)),
            Err(e) => Err(self.fail(epoch, seq, desc, e).await),
        }
    }
        .boxed()
    }

    /// All-reduces several buffers of one dtype as one collective (one descriptor, one
    /// schedule, like gloo's `allreduce_coalesced`): they are packed into one buffer,
    /// reduced, and copied back only on success, so a failure leaves every one of them
    /// as it was (G2).
    pub async fn all_reduce_coalesced(
        &mut self,
        dtype: DType,
        op: ReduceOp,
        bufs: &mut [&mut [u8]],
    ) -> Result<OpInfo> {
        let elem = dtype.size();
        if let Some(b) = bufs.iter().find(|b| b.len() % elem != 0) {
            return Err(Error::InvalidArgument(format!(
                "a buffer of {} bytes is not a whole number of {dtype} elements",
                b.len()
            )));
        }
        let input = packed(bufs.iter().map(|b| &**b));
        let total = input.as_bytes().len();
        let mut output = AlignedBuf::with_len(total);
        let args = CollArgs {
            kind: CollectiveKind::AllReduce,
            dtype,
            op,
            root: Rank(0),
            count: total / elem,
        };
        let info = self
            .collective(args, input.as_bytes(), output.as_bytes_mut())
            .await?;
        unpack(output.as_bytes(), bufs);
        Ok(info)
    }

    /// Breaks the epoch after a failed call and tells the other ranks why, so that none
    /// of them waits for this one.
    pub(crate) async fn fail(&mut self, epoch: u64, seq: u64, desc: Descriptor, e: Error) -> Error {
        if let Some(first) = self.abort.check(epoch) {
            // The caller's own mistake is the more useful answer to give it.
            return if matches!(e, Error::InvalidArgument(_)) {
                e
            } else {
                first
            };
        }
        let cause = match &e {
            Error::Mismatch { .. } => AbortCause::Mismatch,
            Error::InvalidArgument(_) => AbortCause::InvalidArgument,
            Error::Timeout { .. } => AbortCause::Timeout,
            _ => AbortCause::LinkFailure,
        };
        self.abort.raise(epoch, e.clone());
        let suspect = self.suspect.swap(executor::NO_SUSPECT, Ordering::Relaxed);
        if let Some(c) = self.cur.as_mut() {
            let reason = format!("rank {}: {e}", c.rank);
            executor::broadcast_abort(epoch, seq, desc, cause, &reason, &mut c.links).await;
            // A broken link or a silent peer is the master's business: it evicts the
            // peer if its lease agrees, and aborts the epoch on everyone otherwise.
            if matches!(cause, AbortCause::LinkFailure | AbortCause::Timeout) {
                let suspect = c.world.member(Rank(suspect)).map(|m| m.peer_id);
                let report = PeerRequest::ReportFault {
                    peer_id: self.peer_id,
                    epoch,
                    suspect,
                    reason: e.to_string(),
                };
                if let Err(err) = self.master.notify(report).await {
                    tracing::warn!(target: "eccl::coll", "could not report the fault to the master: {err}");
                }
            }
        }
        e
    }
}

/// Runs `sched` on buffers given as lists of blocks ([`Bufs::from_blocks`]): where each
/// message of the schedule lies within one block, the blocks are read and written where
/// they are; otherwise each side goes through one packed copy (the output's copied out
/// only if the call succeeded).
async fn run_on_lists(
    op: &Running<'_>,
    links: &mut [Option<crate::links::PeerLink>],
    sched: &Schedule,
    ins: &[&[u8]],
    outs: &mut [&mut [u8]],
    scratch: &mut [u8],
    elem: usize,
) -> Result<()> {
    let bufs = Bufs::from_blocks(ins, outs, scratch, elem);
    let why = match bufs.check_fits(sched) {
        Ok(()) => return executor::run(op, links, sched, &bufs).await,
        Err(why) => why,
    };
    drop(bufs);
    tracing::debug!(target: "eccl::coll", "{}: the lists go through a packed copy ({why})", op.desc);
    let input = packed(ins.iter().copied());
    let mut output = AlignedBuf::with_len(outs.iter().map(|b| b.len()).sum());
    let bufs = Bufs::new(input.as_bytes(), output.as_bytes_mut(), scratch, elem);
    executor::run(op, links, sched, &bufs).await?;
    unpack(output.as_bytes(), outs);
    Ok(())
}

/// `bufs` back to back in one buffer of their own.
fn packed<'a>(bufs: impl Iterator<Item = &'a [u8]> + Clone) -> AlignedBuf {
    let mut out = AlignedBuf::with_len(bufs.clone().map(<[u8]>::len).sum());
    let mut at = 0;
    for b in bufs {
        out.as_bytes_mut()[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
    out
}

/// `from`, cut into `into`'s buffers in order (the inverse of [`packed`]).
fn unpack(from: &[u8], into: &mut [&mut [u8]]) {
    let mut at = 0;
    for b in into.iter_mut() {
        let n = b.len();
        b.copy_from_slice(&from[at..at + n]);
        at += n;
    }
}

/// Checks a call's arguments against this rank's part; returns the element counts of
/// input and output the schedule uses.
fn validate(
    a: &CollArgs,
    world: u32,
    rank: Rank,
    in_bytes: usize,
    out_bytes: usize,
) -> Result<(usize, usize)> {
    let elem = a.dtype.size();
    if a.kind == CollectiveKind::SendRecv {
        return Err(Error::InvalidArgument(
            "send/recv is not a collective; use send() and recv()".into(),
        ));
    }
    if a.kind.reduces() && !a.op.valid_for(a.dtype) {
        return Err(Error::InvalidArgument(format!(
            "{} is not defined for {} (avg needs a floating type, band/bor/bxor an integer type)",
            a.op, a.dtype
        )));
    }
    if a.kind.is_rooted() && a.root.0 >= world {
        return Err(Error::InvalidArgument(format!(
            "root {} is not a rank of this world of {world}",
            a.root
        )));
    }
    if !in_bytes.is_multiple_of(elem) || !out_bytes.is_multiple_of(elem) {
        return Err(Error::InvalidArgument(format!(
            "buffer lengths must be whole {} elements",
            a.dtype
        )));
    }
    let (need_in, need_out) = buffer_lens(a.kind, a.count, world, rank.0, a.root.0);
    let check = |what: &str, got: usize, need: usize| {
        if got == need || (need == 0 && a.kind.is_rooted()) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{} on rank {rank} of {world}: {what} has {got} elements, expected {need}",
                a.kind,
            )))
        }
    };
    check("input", in_bytes / elem, need_in)?;
    check("output", out_bytes / elem, need_out)?;
    Ok((need_in, need_out))
}

/// The bytes of a list of buffers, or why it has none: an input list may name one buffer
/// many times, and a sum past `usize` would otherwise wrap and pass the size checks.
fn list_bytes(side: &str, mut lens: impl Iterator<Item = usize>) -> Result<usize> {
    lens.try_fold(0usize, usize::checked_add).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "the {side} list's buffers add up to more bytes than memory has"
        ))
    })
}
