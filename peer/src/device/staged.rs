//! The staged pipeline: every collective of device memory (all_reduce, broadcast,
//! all_gather, reduce_scatter, all_to_all, gather, scatter) through host memory in chunks
//! whose copies overlap the host collectives (see [`staged_pipeline`]).

use eccl_protocol::{CollectiveKind, Rank, ReduceOp};

use super::{CopyMark, DevPtr, Device, DeviceCall, DeviceError, IpcComm};
use crate::{CollArgs, Communicator, Error, OnAbort};

/// Copy lanes waited for and a keep-mode scratch buffer freed on every way out of a
/// staged call, so no queued copy writes the caller's buffer (or reads a stage buffer)
/// after the call returned.
struct Settle<'a, D: Device> {
    dev: &'a D,
    scratch: Option<DevPtr>,
}

impl<D: Device> Drop for Settle<'_, D> {
    fn drop(&mut self) {
        if let Err(e) = self.dev.synchronize() {
            // A device that cannot say its copies are done: the scratch buffer is
            // leaked rather than freed under a copy that may still write it.
            tracing::warn!(
                "eccl: {}: waiting for staged copies: {e}",
                self.dev.describe()
            );
            return;
        }
        if let Some(p) = self.scratch.take() {
            // SAFETY: allocated by the staged call, nothing queued uses it (waited above).
            unsafe { self.dev.free(p) };
        }
    }
}

/// Every collective of device memory through host memory as a pipeline of
/// chunks (about four, of 4 to 64 MiB: [`IpcComm::stage_bytes`]; in three slots of
/// page-locked buffers): while the host collective of chunk i runs over the links, the
/// download lane copies chunks i+1 and i+2 to the host and the upload lane copies chunk
/// i-1's result back, so the copies in both directions overlap the links. Each chunk is
/// one host collective (every rank reached this with the same call: the records said
/// so): of an all_reduce, a slice of the buffer; of an all_gather or a reduce_scatter,
/// the same slice of every rank's block (one copy down and one per rank up, or the
/// other way round); of a gather or a scatter, the same, with the root's every-rank side;
/// of an all_to_all, the same slice of every block (as far as the block reaches: the
/// chunks are cut from `a2a_block` elements, the call's widest block, from every rank's
/// counts), one copy per rank each way, the host collective an all_to_all with split
/// sizes that moves each slice as it is (nothing padded); of a broadcast, a slice the root copies down
/// and the others up. With `keep` (all_reduce) and more than one chunk the results go to
/// a device scratch buffer, copied over `buf` once every chunk succeeded (G2: a failed
/// call leaves `buf` as it was); a single chunk is uploaded only after its collective
/// succeeded, so it needs none. A device error on this rank aborts the epoch (the other
/// ranks, waiting in a chunk's collective for this one, fail at once instead of at
/// their timeout) and fails the call with `Aborted`, naming it.
///
/// # Safety
/// As [`run`].
pub(super) unsafe fn staged_pipeline<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
    a2a_block: usize,
) -> Result<(), Error> {
    // SAFETY: the caller's promise.
    match unsafe { pipeline(comm, rt, ipc, call, a2a_block) } {
        Ok(()) => Ok(()),
        Err(Fail::Collective(e)) => Err(e),
        Err(Fail::Device(e)) => {
            let epoch = comm.epoch();
            let cause = format!(
                "{}: a staged {}'s device step failed: {e}",
                ipc.device().describe(),
                call.name()
            );
            comm.abort_handle().abort(&cause);
            rt.block_on(comm.announce_abort());
            Err(Error::Aborted { epoch, cause })
        }
    }
}

/// How a staged pipeline failed: in a host collective (the epoch's error, as every rank
/// sees it) or on this rank's device.
enum Fail {
    Collective(Error),
    Device(DeviceError),
}

impl From<DeviceError> for Fail {
    fn from(e: DeviceError) -> Fail {
        Fail::Device(e)
    }
}

/// One chunk of a staged pipeline: its host collective, the copies down into its slot's
/// input buffer before it and up from its slot's output buffer after it (device
/// address, offset in the slot's buffer, bytes).
struct Piece {
    args: CollArgs,
    in_len: usize,
    out_len: usize,
    down: Vec<(DevPtr, usize, usize)>,
    up: Vec<(DevPtr, usize, usize)>,
    /// An all_to_all's chunk: the elements of each rank's slice this rank sends and
    /// receives (its host collective is [`Communicator::all_to_all_v`]).
    split: Option<(Vec<usize>, Vec<usize>)>,
}

/// What a staged call is cut into: its pieces, whether they run in place (one host
/// buffer per slot), and the most any piece's input and output take (out of place, a
/// slot holds both, the output after the input).
struct Plan {
    pieces: Vec<Piece>,
    in_place: bool,
    in_cap: usize,
    out_cap: usize,
}

/// The plan of `call` for rank `me` of a world of `n`. `least`: the smallest chunk;
/// `a2a_block`: an all_to_all's widest block in elements, the same on every rank (from
/// the table of every rank's counts).
fn plan(call: &DeviceCall, me: usize, n: usize, least: usize, a2a_block: usize) -> Plan {
    // About four chunks of a call's largest host buffer: every chunk is a collective
    // whose fixed cost (a ring's 2(n-1) latencies) the copies it overlaps must
    // outweigh, so a few large ones rather than many small ones; at most 16 times the
    // smallest, so three slots of page-locked memory stay bounded (192 MiB by default;
    // an all_gather's or reduce_scatter's slot holds its input and output).
    let chunk_of = |total: usize| total.div_ceil(4).clamp(least, least.saturating_mul(16));
    // One buffer, in place: all_reduce (every rank's chunks go down and come back up),
    // broadcast (the root's go down, the others' come up: `root`).
    let in_place = match *call {
        DeviceCall::AllReduce {
            buf,
            count,
            dtype,
            op,
            ..
        } => Some((CollectiveKind::AllReduce, buf, count, dtype, op, None)),
        DeviceCall::Broadcast {
            buf,
            count,
            dtype,
            root,
        } => Some((
            CollectiveKind::Broadcast,
            buf,
            count,
            dtype,
            ReduceOp::Sum,
            Some(root),
        )),
        _ => None,
    };
    if let Some((kind, buf, count, dtype, op, root)) = in_place {
        let size = dtype.size();
        let total = count * size;
        let chunk = chunk_of(total).div_ceil(size) * size;
        let pieces = (0..total.div_ceil(chunk))
            .map(|k| {
                let (off, len) = (k * chunk, chunk.min(total - k * chunk));
                let here = || vec![(buf + off as u64, 0, len)];
                Piece {
                    args: CollArgs::for_buffers(
                        kind,
                        dtype,
                        op,
                        Rank(root.unwrap_or(0) as u32),
                        Some(len / size),
                        Some(len / size),
                        n as u32,
                    ),
                    in_len: len,
                    out_len: len,
                    down: if root.is_none_or(|r| r == me) {
                        here()
                    } else {
                        Vec::new()
                    },
                    up: if root == Some(me) { Vec::new() } else { here() },
                    split: None,
                }
            })
            .collect();
        return Plan {
            pieces,
            in_place: true,
            in_cap: chunk,
            out_cap: 0,
        };
    }
    // Two buffers: all_gather (one rank's slice down, every rank's slices up),
    // reduce_scatter (every rank's slices down, one up), gather (one down; every rank's
    // up at the root), scatter (every rank's down at the root; one up) and all_to_all
    // (every block's slice down and up, as far as each block reaches).
    // (kind, send, recv, dtype, op, root, the host block in elements, this rank's
    // blocks to send and to receive in elements: one each where the rank moves its
    // own block only, none where it moves nothing that way).
    let (kind, send, recv, dtype, op, root, block, sends, recvs) = match *call {
        DeviceCall::AllToAll {
            send,
            recv,
            ref send_counts,
            ref recv_counts,
            dtype,
        } => (
            CollectiveKind::AllToAll,
            send,
            recv,
            dtype,
            ReduceOp::Sum,
            0,
            a2a_block,
            send_counts.clone(),
            recv_counts.clone(),
        ),
        DeviceCall::AllGather {
            send,
            recv,
            count,
            dtype,
        } => (
            CollectiveKind::AllGather,
            send,
            recv,
            dtype,
            ReduceOp::Sum,
            0,
            count,
            vec![count],
            vec![count; n],
        ),
        DeviceCall::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            op,
        } => (
            CollectiveKind::ReduceScatter,
            send,
            recv,
            dtype,
            op,
            0,
            count,
            vec![count; n],
            vec![count],
        ),
        DeviceCall::Gather {
            send,
            recv,
            count,
            dtype,
            root,
        } => (
            CollectiveKind::Gather,
            send,
            recv,
            dtype,
            ReduceOp::Sum,
            root,
            count,
            vec![count],
            if me == root {
                vec![count; n]
            } else {
                Vec::new()
            },
        ),
        DeviceCall::Scatter {
            send,
            recv,
            count,
            dtype,
            root,
        } => (
            CollectiveKind::Scatter,
            send,
            recv,
            dtype,
            ReduceOp::Sum,
            root,
            count,
            if me == root {
                vec![count; n]
            } else {
                Vec::new()
            },
            vec![count],
        ),
        _ => {
            return Plan {
                pieces: Vec::new(),
                in_place: true,
                in_cap: 0,
                out_cap: 0,
            }
        }
    };
    let size = dtype.size();
    // A block of the host collective, and the slice of every block one chunk takes: the
    // blocks cut into as many chunks as the whole would be, of equal size (whole
    // elements) but the last. The count of chunks follows from what every rank knows
    // alike (the world, the block, the kind), so every rank runs as many collectives.
    let nb = block * size;
    // A slot holds a chunk's input and output: an all_to_all's are both every rank's
    // slices, so its chunks are cut from twice the buffer (half as large), and its three
    // slots stay within what the others' take.
    let both = matches!(kind, CollectiveKind::AllToAll);
    let largest = n * nb * if both { 2 } else { 1 };
    let k = largest.div_ceil(chunk_of(largest)).max(1);
    let per = nb.div_ceil(k).div_ceil(size).max(1) * size;
    // Where each block starts in its buffer (blocks in rank order, back to back).
    let starts = |counts: &[usize]| -> Vec<usize> {
        counts
            .iter()
            .scan(0, |at, c| {
                let here = *at;
                *at += c * size;
                Some(here)
            })
            .collect()
    };
    let (send_at, recv_at) = (starts(&sends), starts(&recvs));
    // The copies of chunk [off, off + len) of each block: (device address, offset in
    // the slot's buffer, bytes), the part of the slice the block holds (all of it but
    // where an all_to_all's block is shorter than the widest), the slices back to back
    // in the slot in rank order; with each slice's elements and their sum in bytes. Both
    // ends of a pair cut its block alike (the same count, `per` and chunk), so the
    // sender's slice is the receiver's.
    let copies = |base: DevPtr, counts: &[usize], at: &[usize], off: usize, len: usize| {
        let (mut v, mut elems, mut slot) = (Vec::new(), Vec::new(), 0);
        for (&c, &a) in counts.iter().zip(at) {
            let here = (c * size).saturating_sub(off).min(len);
            if here > 0 {
                v.push((base + (a + off) as u64, slot, here));
            }
            elems.push(here / size);
            slot += here;
        }
        (v, elems, slot)
    };
    let pieces = (0..nb.div_ceil(per))
        .map(|k| {
            let (off, len) = (k * per, per.min(nb - k * per));
            let (down, send_elems, in_len) = copies(send, &sends, &send_at, off, len);
            let (mut up, recv_elems, out_len) = copies(recv, &recvs, &recv_at, off, len);
            if matches!(kind, CollectiveKind::AllGather | CollectiveKind::Gather) {
                // In place (this rank's block of `recv` is its `send`), its own slice
                // would come back up onto the bytes it went down from: left out, as the
                // IPC path leaves that copy out.
                up.retain(|&(dst, _, _)| !down.iter().any(|&(src, _, _)| src == dst));
            }
            Piece {
                args: CollArgs::for_buffers(
                    kind,
                    dtype,
                    op,
                    Rank(root as u32),
                    Some(in_len / size),
                    Some(out_len / size),
                    n as u32,
                ),
                in_len,
                out_len,
                down,
                up,
                split: both.then_some((send_elems, recv_elems)),
            }
        })
        .collect();
    Plan {
        pieces,
        in_place: false,
        in_cap: sends.len() * per,
        out_cap: recvs.len() * per,
    }
}

/// [`staged_pipeline`]'s pipeline.
///
/// # Safety
/// As [`run`].
unsafe fn pipeline<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
    a2a_block: usize,
) -> Result<(), Fail> {
    let n = comm.world_size() as usize;
    let dev_arc = ipc.device().clone();
    let dev = dev_arc.as_ref();
    let mut settle = Settle { dev, scratch: None };
    let me = comm.rank().map_or(0, |r| r.idx());
    let mut plan = plan(call, me, n, ipc.stage_bytes(), a2a_block);
    if plan.pieces.is_empty() {
        return Ok(()); // nothing to move (every rank: the records agreed on the counts)
    }
    if let DeviceCall::AllReduce {
        buf,
        count,
        dtype,
        keep: true,
        ..
    } = *call
    {
        if plan.pieces.len() > 1 {
            // G2: the results go to a scratch buffer, copied over `buf` at the end.
            let scratch = dev.alloc(count * dtype.size())?;
            settle.scratch = Some(scratch);
            for (dst, _, _) in plan.pieces.iter_mut().flat_map(|p| p.up.iter_mut()) {
                *dst = scratch + (*dst - buf);
            }
        }
    }
    let Plan {
        pieces: plan,
        in_place,
        in_cap,
        out_cap,
    } = plan;
    let chunks = plan.len();
    let slots = chunks.min(3);
    // A slot: its input, then (out of place) its output, in one buffer.
    let stage = ipc.stage_buffers(slots, in_cap + out_cap)?.to_vec();
    let input = |s: usize| stage[s];
    let output = |s: usize| {
        if in_place {
            stage[s]
        } else {
            // SAFETY: the slot's buffer holds `in_cap + out_cap` bytes.
            unsafe { stage[s].add(in_cap) }
        }
    };
    // Each piece's copies go in order on their lane: the last one's mark covers them.
    let down = |i: usize| -> Result<Option<CopyMark>, Fail> {
        let mut last = None;
        for &(src, at, len) in &plan[i].down {
            // SAFETY: `src` lies in the call's buffers (the caller's promise); the slot's
            // input buffer holds `in_cap` >= `at + len` bytes and is ours until the mark
            // is waited for.
            last = Some(unsafe { dev.download_queued(input(i % slots).add(at), src, len) }?);
        }
        Ok(last)
    };
    let mut downs = Vec::with_capacity(chunks);
    let mut ups: Vec<Option<CopyMark>> = Vec::with_capacity(chunks);
    for i in 0..slots {
        downs.push(down(i)?);
    }
    for i in 0..chunks {
        let slot = i % slots;
        let p = &plan[i];
        if let Some(m) = downs[i] {
            dev.wait_copy(m)?;
        }
        // SAFETY: the slot's buffers hold `in_cap` and `out_cap` bytes (or `in_cap`, in
        // place), at least the piece's lengths; chunk i's download into the
        // input is done, and no copy uses them until the uploads queued below.
        let done = unsafe {
            if in_place {
                let bytes = std::slice::from_raw_parts_mut(input(slot), p.in_len);
                rt.block_on(comm.collective_inplace_with(p.args, bytes, OnAbort::Undefined))
            } else {
                let inp = std::slice::from_raw_parts(input(slot), p.in_len);
                let out = std::slice::from_raw_parts_mut(output(slot), p.out_len);
                match &p.split {
                    Some((sends, recvs)) => {
                        rt.block_on(comm.all_to_all_v(p.args.dtype, inp, sends, out, recvs))
                    }
                    None => rt.block_on(comm.collective(p.args, inp, out)),
                }
            }
        };
        done.map_err(Fail::Collective)?;
        let mut last = None;
        for &(dst, at, len) in &p.up {
            // SAFETY: `dst` lies in the call's output (or our scratch); the slot's output
            // buffer is left alone until the mark is waited for.
            last = Some(unsafe { dev.upload_queued(dst, output(slot).add(at), len) }?);
        }
        ups.push(last);
        // The previous chunk's slot, once its uploads are done, takes the chunk after
        // those already downloading.
        if i >= 1 && i - 1 + slots < chunks {
            if let Some(m) = ups[i - 1] {
                dev.wait_copy(m)?;
            }
            downs.push(down(i - 1 + slots)?);
        }
    }
    if let Some(last) = ups.iter().rev().flatten().next() {
        dev.wait_copy(*last)?;
    }
    if let (
        Some(scratch),
        DeviceCall::AllReduce {
            buf, count, dtype, ..
        },
    ) = (settle.scratch, call)
    {
        // SAFETY: both hold the call's bytes; every upload into `scratch` is done.
        unsafe { dev.copy(*buf, scratch, count * dtype.size()) }?;
    }
    dev.synchronize()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use eccl_protocol::DType;

    /// Every chunk's copies down tile the chunk's input exactly (each byte once, nothing
    /// padded) and its copies up its output, the copies down and up take each block's
    /// bytes exactly once over the chunks, every rank cuts the call into as many chunks,
    /// and in every chunk what rank s sends rank t is what t expects from s.
    #[test]
    fn an_uneven_all_to_all_is_cut_into_tiled_chunks_of_its_widest_block() {
        // What rank s sends rank t, in f32 elements: one block empty, one the widest.
        let table = [[5usize, 0, 1700], [900, 3, 0], [0, 1101, 2]];
        let n = table.len();
        let widest = *table.iter().flatten().max().unwrap();
        let (send, recv) = (1u64 << 40, 1u64 << 41);
        let mut chunks = Vec::new();
        let mut splits = Vec::new();
        for (me, row) in table.iter().enumerate() {
            let send_counts = row.to_vec();
            let recv_counts: Vec<usize> = (0..n).map(|s| table[s][me]).collect();
            let call = DeviceCall::AllToAll {
                send,
                recv,
                send_counts: send_counts.clone(),
                recv_counts: recv_counts.clone(),
                dtype: DType::F32,
            };
            let plan = plan(&call, me, n, 1024, widest);
            assert!(!plan.in_place);
            chunks.push(plan.pieces.len());
            let mut sent = vec![0u32; send_counts.iter().sum::<usize>() * 4];
            let mut got = vec![0u32; recv_counts.iter().sum::<usize>() * 4];
            let mut mine = Vec::new();
            for p in &plan.pieces {
                assert!(p.in_len <= plan.in_cap && p.out_len <= plan.out_cap);
                let (s, r) = p
                    .split
                    .clone()
                    .expect("an all_to_all's chunk has split sizes");
                assert_eq!(s.iter().sum::<usize>() * 4, p.in_len, "rank {me}");
                assert_eq!(r.iter().sum::<usize>() * 4, p.out_len, "rank {me}");
                let mut tiles = vec![0u32; p.in_len];
                for &(src, at, len) in &p.down {
                    tiles[at..at + len].iter_mut().for_each(|t| *t += 1);
                    let from = (src - send) as usize;
                    sent[from..from + len].iter_mut().for_each(|b| *b += 1);
                }
                assert!(tiles.iter().all(|&t| t == 1), "rank {me}: copies down tile");
                let mut tiles = vec![0u32; p.out_len];
                for &(dst, at, len) in &p.up {
                    tiles[at..at + len].iter_mut().for_each(|t| *t += 1);
                    let to = (dst - recv) as usize;
                    got[to..to + len].iter_mut().for_each(|b| *b += 1);
                }
                assert!(tiles.iter().all(|&t| t == 1), "rank {me}: copies up tile");
                mine.push((s, r));
            }
            splits.push(mine);
            assert!(
                sent.iter().all(|&b| b == 1),
                "rank {me}: every byte sent once"
            );
            assert!(
                got.iter().all(|&b| b == 1),
                "rank {me}: every byte received once"
            );
        }
        assert!(
            chunks.iter().all(|&c| c == chunks[0] && c > 1),
            "{chunks:?}"
        );
        for k in 0..chunks[0] {
            for (s, row) in splits.iter().enumerate() {
                for (t, col) in splits.iter().enumerate() {
                    assert_eq!(row[k].0[t], col[k].1[s], "chunk {k}: rank {s} to rank {t}");
                }
            }
        }
    }

    /// A gather's and a scatter's root moves every rank's slice of a chunk, the others
    /// their own, in as many chunks on every rank.
    #[test]
    fn gather_and_scatter_chunks_move_the_roots_every_block() {
        let (n, count, root) = (3, 5001, 1);
        for scatter in [false, true] {
            let mut chunks = Vec::new();
            for me in 0..n {
                let (send, recv) = (1u64 << 40, 1u64 << 41);
                let dtype = DType::F32;
                let call = match scatter {
                    false => DeviceCall::Gather {
                        send,
                        recv,
                        count,
                        dtype,
                        root,
                    },
                    true => DeviceCall::Scatter {
                        send,
                        recv,
                        count,
                        dtype,
                        root,
                    },
                };
                let plan = plan(&call, me, n, 1024, 0);
                chunks.push(plan.pieces.len());
                let every = if me == root { n } else { 0 };
                let (downs, ups) = if scatter { (every, 1) } else { (1, every) };
                let (mut down, mut up) = (0, 0);
                for p in &plan.pieces {
                    assert_eq!(p.down.len(), downs, "scatter {scatter} rank {me}");
                    assert_eq!(p.up.len(), ups, "scatter {scatter} rank {me}");
                    assert!(p.split.is_none());
                    down += p.down.iter().map(|d| d.2).sum::<usize>();
                    up += p.up.iter().map(|u| u.2).sum::<usize>();
                }
                assert_eq!(down, downs * count * 4);
                assert_eq!(up, ups * count * 4);
            }
            assert!(
                chunks.iter().all(|&c| c == chunks[0] && c > 1),
                "{chunks:?}"
            );
        }
    }
}
