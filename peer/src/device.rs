//! Device memory collectives on eccl's worlds: the same-host all_reduce of
//! [`eccl_cuda::ipc`] with its handle exchange and status rounds carried by this
//! communicator's collectives (so only members of the world, over authenticated links,
//! ever see a handle, and a dead peer fails the call as any collective fails), and
//! [`run`], which takes a world whose GPUs cannot reach each other's memory through host
//! memory instead.

pub use eccl_cuda::{self as cuda, CopyMark, DevPtr, Device, DeviceError, IpcComm, IpcError};

use eccl_protocol::{CollectiveKind, DType, Rank, ReduceOp};

use crate::{CollArgs, Communicator, Error, OnAbort};

/// A collective on device memory of this rank's device.
#[derive(Clone, Debug)]
pub enum DeviceCall {
    /// `count` elements in place at `buf`; `keep`: left as they were if the call fails
    /// (G2).
    AllReduce {
        buf: DevPtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        keep: bool,
    },
    /// `count` elements at `send` from every rank into `recv` (world × count, rank
    /// order); `send` may be `recv`'s slice at this rank's offset.
    AllGather {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
    },
    /// Every rank's `send` (world × count) reduced, slice r into rank r's `recv`
    /// (`count` elements); `recv` may be `send`'s slice at this rank's offset.
    ReduceScatter {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    },
    /// `count` elements in place at `buf`, from rank `root`.
    Broadcast {
        buf: DevPtr,
        count: usize,
        dtype: DType,
        root: usize,
    },
    /// `send_counts[t]` elements of `send` (blocks in rank order) to rank t, and
    /// `recv_counts[s]` elements from rank s into `recv` (blocks in rank order): torch's
    /// `all_to_all_single` with its split sizes; the two buffers must not overlap.
    AllToAll {
        send: DevPtr,
        recv: DevPtr,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        dtype: DType,
    },
    /// Every rank's `send` (`count`) into rank `root`'s `recv` (world × count, rank
    /// order); `recv` is 0 off the root and may be the root's slice of it there.
    Gather {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
        root: usize,
    },
    /// Block t of rank `root`'s `send` (world × count) into rank t's `recv` (`count`);
    /// `send` is 0 off the root.
    Scatter {
        send: DevPtr,
        recv: DevPtr,
        count: usize,
        dtype: DType,
        root: usize,
    },
}

/// The communicator's error for a device call's failure.
pub fn to_error(e: IpcError) -> Error {
    match e {
        // The communicator's own error (an abort, an eviction) keeps its type, so a
        // caller's recovery treats it as any failed collective.
        IpcError::Exchange(e) => match e.downcast::<Error>() {
            Ok(e) => *e,
            Err(e) => Error::InvalidArgument(e.to_string()),
        },
        IpcError::Mismatch(detail) => Error::Mismatch {
            rank: None,
            ours: None,
            theirs: None,
            detail,
        },
        IpcError::Peer { rank, msg } => Error::Aborted {
            epoch: 0,
            cause: format!("rank {rank}'s device failed: {msg}"),
        },
        other => Error::InvalidArgument(other.to_string()),
    }
}

/// Runs `call` among the world's ranks: over CUDA IPC, GPU to GPU ([`IpcComm`]), where
/// they all run on this host and reach each other's memory; otherwise (a world across
/// hosts, `ECCL_CUDA_IPC=0` on a rank, more than 8 ranks, no peer access between two
/// GPUs, or one hidden from another's process by `CUDA_VISIBLE_DEVICES`; every rank
/// learns it from the same records, before anything is written) through host memory
/// over the world's links: all_reduce, broadcast, all_gather and reduce_scatter as a
/// pipeline of chunks ([`staged_pipeline`]), the others whole. After a failed call the
/// outputs are as over IPC: an all_reduce with `keep` leaves its buffer as it was, other
/// outputs are undefined (a root's broadcast buffer is never written).
/// `ECCL_DEBUG=INFO` says which path, once per world.
///
/// Blocks the calling thread: call it outside the runtime `rt` belongs to, or inside
/// `tokio::task::block_in_place` on one of its workers.
///
/// # Safety
/// The pointers are device memory of `ipc`'s device holding what the call says, and
/// nothing else uses them until this returns.
pub unsafe fn run<D: Device>(
    comm: &mut Communicator,
    rt: tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
) -> Result<(), Error> {
    let epoch = comm.epoch();
    // A world across hosts goes through host memory (every rank sees the same members,
    // so every rank says so in its record, and none exports a handle).
    ipc.set_world_spans_hosts(spans_hosts(comm));
    let direct = {
        let mut ex = CommExchange::new(comm, rt.clone());
        // SAFETY: the caller's promise.
        unsafe {
            match call.clone() {
                DeviceCall::AllReduce {
                    buf,
                    count,
                    dtype,
                    op,
                    keep,
                } => ipc.all_reduce(&mut ex, buf, count, dtype, op, keep),
                DeviceCall::AllGather {
                    send,
                    recv,
                    count,
                    dtype,
                } => ipc.all_gather(&mut ex, send, recv, count, dtype),
                DeviceCall::ReduceScatter {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => ipc.reduce_scatter(&mut ex, send, recv, count, dtype, op),
                DeviceCall::Broadcast {
                    buf,
                    count,
                    dtype,
                    root,
                } => ipc.broadcast(&mut ex, buf, count, dtype, root),
                DeviceCall::AllToAll {
                    send,
                    recv,
                    send_counts,
                    recv_counts,
                    dtype,
                } => ipc.all_to_all(&mut ex, send, recv, &send_counts, &recv_counts, dtype),
                DeviceCall::Gather {
                    send,
                    recv,
                    count,
                    dtype,
                    root,
                } => ipc.gather(&mut ex, send, recv, count, dtype, root),
                DeviceCall::Scatter {
                    send,
                    recv,
                    count,
                    dtype,
                    root,
                } => ipc.scatter(&mut ex, send, recv, count, dtype, root),
            }
        }
    };
    match direct {
        Err(IpcError::NoPeerAccess(why)) => {
            static SAID: std::sync::Mutex<Option<u64>> = std::sync::Mutex::new(None);
            let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
            if *said != Some(epoch) {
                *said = Some(epoch);
                tracing::info!(
                    "eccl: {}: {why}; device collectives of epoch {epoch} go through host \
                     memory",
                    ipc.device().describe()
                );
            }
            drop(said);
            // SAFETY: the caller's promise.
            unsafe { staged(comm, &rt, ipc, call) }
        }
        other => other.map_err(to_error),
    }
}

/// Whether the current world's members run on more than one host.
fn spans_hosts(comm: &Communicator) -> bool {
    comm.world().is_some_and(|w| {
        w.members
            .first()
            .is_some_and(|m0| w.members.iter().any(|m| m.host != m0.host))
    })
}

impl DeviceCall {
    /// The call's collective, as logs and errors name it.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceCall::AllReduce { .. } => "all_reduce",
            DeviceCall::AllGather { .. } => "all_gather",
            DeviceCall::ReduceScatter { .. } => "reduce_scatter",
            DeviceCall::Broadcast { .. } => "broadcast",
            DeviceCall::AllToAll { .. } => "all_to_all",
            DeviceCall::Gather { .. } => "gather",
            DeviceCall::Scatter { .. } => "scatter",
        }
    }

    /// Whether a buffer the call moves something through on every rank has the null
    /// address (a rooted call's buffer that only the root has is checked with the
    /// others' records, on every rank alike).
    pub fn has_null_pointer(&self) -> bool {
        let (count, ptrs) = match self.clone() {
            DeviceCall::AllReduce { buf, count, .. } | DeviceCall::Broadcast { buf, count, .. } => {
                (count, [buf, buf])
            }
            DeviceCall::AllGather {
                send, recv, count, ..
            }
            | DeviceCall::ReduceScatter {
                send, recv, count, ..
            } => (count, [send, recv]),
            DeviceCall::AllToAll {
                send,
                recv,
                send_counts,
                recv_counts,
                ..
            } => {
                return (send_counts.iter().sum::<usize>() > 0 && send == 0)
                    || (recv_counts.iter().sum::<usize>() > 0 && recv == 0);
            }
            DeviceCall::Gather { send, count, .. } => (count, [send, send]),
            DeviceCall::Scatter { recv, count, .. } => (count, [recv, recv]),
        };
        count > 0 && ptrs.contains(&0)
    }

    /// The host collective that does this call's work on rank `rank` of a world of
    /// `world` ranks: its arguments, the buffer it reads and the one it writes (address,
    /// elements: none where a rooted call's rank has no such buffer), and whether it runs
    /// in place (the two are one buffer). None for an all_to_all, whose blocks may differ
    /// in size ([`staged_all_to_all`]).
    #[allow(clippy::type_complexity)]
    fn host_form(
        &self,
        world: u32,
        rank: usize,
    ) -> Option<(CollArgs, (DevPtr, usize), (DevPtr, usize), bool)> {
        let n = world as usize;
        let args = |kind, dtype, op, root: usize, input, output| {
            CollArgs::for_buffers(
                kind,
                dtype,
                op,
                Rank(root as u32),
                Some(input),
                Some(output),
                world,
            )
        };
        Some(match self.clone() {
            DeviceCall::AllReduce {
                buf,
                count,
                dtype,
                op,
                ..
            } => (
                args(CollectiveKind::AllReduce, dtype, op, 0, count, count),
                (buf, count),
                (buf, count),
                true,
            ),
            DeviceCall::Broadcast {
                buf,
                count,
                dtype,
                root,
            } => (
                args(
                    CollectiveKind::Broadcast,
                    dtype,
                    ReduceOp::Sum,
                    root,
                    count,
                    count,
                ),
                (buf, count),
                (buf, count),
                true,
            ),
            DeviceCall::AllGather {
                send,
                recv,
                count,
                dtype,
            } => (
                args(
                    CollectiveKind::AllGather,
                    dtype,
                    ReduceOp::Sum,
                    0,
                    count,
                    n * count,
                ),
                (send, count),
                (recv, n * count),
                false,
            ),
            DeviceCall::ReduceScatter {
                send,
                recv,
                count,
                dtype,
                op,
            } => (
                args(
                    CollectiveKind::ReduceScatter,
                    dtype,
                    op,
                    0,
                    n * count,
                    count,
                ),
                (send, n * count),
                (recv, count),
                false,
            ),
            DeviceCall::AllToAll { .. } => return None,
            DeviceCall::Gather {
                send,
                recv,
                count,
                dtype,
                root,
            } => {
                let out = if rank == root { n * count } else { 0 };
                (
                    args(
                        CollectiveKind::Gather,
                        dtype,
                        ReduceOp::Sum,
                        root,
                        count,
                        out,
                    ),
                    (send, count),
                    (recv, out),
                    false,
                )
            }
            DeviceCall::Scatter {
                send,
                recv,
                count,
                dtype,
                root,
            } => {
                let inp = if rank == root { n * count } else { 0 };
                (
                    args(
                        CollectiveKind::Scatter,
                        dtype,
                        ReduceOp::Sum,
                        root,
                        inp,
                        count,
                    ),
                    (send, inp),
                    (recv, count),
                    false,
                )
            }
        })
    }
}

/// `call` through host memory: all_reduce, broadcast, all_gather and reduce_scatter as a
/// pipeline ([`staged_pipeline`]); the others whole: copy in, the host collective, copy
/// out (nothing is written to the device if the host collective fails).
///
/// # Safety
/// As [`run`].
unsafe fn staged<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
) -> Result<(), Error> {
    if matches!(
        call,
        DeviceCall::AllReduce { .. }
            | DeviceCall::AllGather { .. }
            | DeviceCall::ReduceScatter { .. }
            | DeviceCall::Broadcast { .. }
    ) {
        // SAFETY: the caller's promise.
        return unsafe { staged_pipeline(comm, rt, ipc, call) };
    }
    let dev = ipc.device().as_ref();
    let rank = comm.rank().map_or(0, |r| r.idx());
    let Some((args, (src, n_in), (dst, n_out), in_place)) = call.host_form(comm.world_size(), rank)
    else {
        let DeviceCall::AllToAll {
            send,
            recv,
            send_counts,
            recv_counts,
            dtype,
        } = call
        else {
            return Err(Error::InvalidArgument(format!("{call:?} has no host form")));
        };
        // SAFETY: as above.
        return unsafe {
            staged_all_to_all(
                comm,
                rt,
                dev,
                (*send, send_counts),
                (*recv, recv_counts),
                *dtype,
            )
        };
    };
    let size = args.dtype.size();
    let dev_err = |e: DeviceError| Error::InvalidArgument(format!("{}: {e}", dev.describe()));
    let mut input = vec![0u8; n_in * size];
    if !input.is_empty() {
        // SAFETY: `run`'s caller promises `src` holds the call's input, `n_in` elements.
        unsafe { dev.download(&mut input, src) }.map_err(dev_err)?;
    }
    let output = if in_place {
        rt.block_on(comm.collective_inplace_with(args, &mut input, OnAbort::Undefined))?;
        input
    } else {
        let mut output = vec![0u8; n_out * size];
        rt.block_on(comm.collective(args, &input, &mut output))?;
        output
    };
    if !output.is_empty() {
        // SAFETY: as above, `dst` holds `n_out` elements the call writes.
        unsafe { dev.upload(dst, &output) }.map_err(dev_err)?;
    }
    Ok(())
}

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

/// all_reduce, all_gather, reduce_scatter and broadcast through host memory as a pipeline of
/// chunks (about four, of 4 to 64 MiB: [`IpcComm::stage_bytes`]; in three slots of
/// page-locked buffers): while the host collective of chunk i runs over the links, the
/// download lane copies chunks i+1 and i+2 to the host and the upload lane copies chunk
/// i-1's result back, so the copies in both directions overlap the links. Each chunk is
/// one host collective (every rank reached this with the same call: the records said
/// so): of an all_reduce, a slice of the buffer; of an all_gather or a reduce_scatter,
/// the same slice of every rank's block (one copy down and one per rank up, or the
/// other way round); of a broadcast, a slice the root copies down and the others up. With `keep` (all_reduce) and more than one chunk the results go to
/// a device scratch buffer, copied over `buf` once every chunk succeeded (G2: a failed
/// call leaves `buf` as it was); a single chunk is uploaded only after its collective
/// succeeded, so it needs none. A device error on this rank aborts the epoch (the other
/// ranks, waiting in a chunk's collective for this one, fail at once instead of at
/// their timeout) and fails the call with `Aborted`, naming it.
///
/// # Safety
/// As [`run`].
unsafe fn staged_pipeline<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
) -> Result<(), Error> {
    // SAFETY: the caller's promise.
    match unsafe { pipeline(comm, rt, ipc, call) } {
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

/// The plan of `call` for rank `me` of a world of `n` (all_reduce: writing its results
/// at `dst`). `least`: the smallest chunk.
fn plan(call: &DeviceCall, me: usize, n: usize, least: usize, dst: DevPtr) -> Plan {
    // About four chunks of a call's largest host buffer: every chunk is a collective
    // whose fixed cost (a ring's 2(n-1) latencies) the copies it overlaps must
    // outweigh, so a few large ones rather than many small ones; at most 16 times the
    // smallest, so three slots of page-locked memory stay bounded (192 MiB by default;
    // an all_gather's or reduce_scatter's slot holds its input and output).
    let chunk_of = |total: usize| total.div_ceil(4).clamp(least, least.saturating_mul(16));
    match *call {
        DeviceCall::AllReduce {
            buf,
            count,
            dtype,
            op,
            ..
        } => {
            let size = dtype.size();
            let total = count * size;
            let chunk = chunk_of(total).div_ceil(size) * size;
            let pieces = (0..total.div_ceil(chunk))
                .map(|k| {
                    let (off, len) = (k * chunk, chunk.min(total - k * chunk));
                    Piece {
                        args: CollArgs::for_buffers(
                            CollectiveKind::AllReduce,
                            dtype,
                            op,
                            Rank(0),
                            Some(len / size),
                            Some(len / size),
                            n as u32,
                        ),
                        in_len: len,
                        out_len: len,
                        down: vec![(buf + off as u64, 0, len)],
                        up: vec![(dst + off as u64, 0, len)],
                    }
                })
                .collect();
            Plan {
                pieces,
                in_place: true,
                in_cap: chunk,
                out_cap: 0,
            }
        }
        DeviceCall::Broadcast {
            buf,
            count,
            dtype,
            root,
        } => {
            // The root's chunks go down and nothing comes back to it; the others' come
            // up and nothing goes down.
            let size = dtype.size();
            let total = count * size;
            let chunk = chunk_of(total).div_ceil(size) * size;
            let pieces = (0..total.div_ceil(chunk))
                .map(|k| {
                    let (off, len) = (k * chunk, chunk.min(total - k * chunk));
                    let here = vec![(buf + off as u64, 0, len)];
                    Piece {
                        args: CollArgs::for_buffers(
                            CollectiveKind::Broadcast,
                            dtype,
                            ReduceOp::Sum,
                            Rank(root as u32),
                            Some(len / size),
                            Some(len / size),
                            n as u32,
                        ),
                        in_len: len,
                        out_len: len,
                        down: if me == root { here.clone() } else { Vec::new() },
                        up: if me == root { Vec::new() } else { here },
                    }
                })
                .collect();
            Plan {
                pieces,
                in_place: true,
                in_cap: chunk,
                out_cap: 0,
            }
        }
        DeviceCall::AllGather {
            send,
            recv,
            count,
            dtype,
        }
        | DeviceCall::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            ..
        } => {
            let gather = matches!(call, DeviceCall::AllGather { .. });
            let (kind, op) = match *call {
                DeviceCall::ReduceScatter { op, .. } => (CollectiveKind::ReduceScatter, op),
                _ => (CollectiveKind::AllGather, ReduceOp::Sum),
            };
            let size = dtype.size();
            // A rank's block, and the slice of every block one chunk takes: the blocks
            // cut into as many chunks as the whole would be, of equal size (whole
            // elements) but the last.
            let nb = count * size;
            let k = (n * nb).div_ceil(chunk_of(n * nb)).max(1);
            let per = nb.div_ceil(k).div_ceil(size).max(1) * size;
            let pieces = (0..nb.div_ceil(per))
                .map(|k| {
                    let (off, len) = (k * per, per.min(nb - k * per));
                    let blocks: Vec<_> = (0..n)
                        .map(|r| ((r * nb + off) as u64, r * len, len))
                        .collect();
                    let (small, big) = (len / size, n * len / size);
                    if gather {
                        Piece {
                            args: CollArgs::for_buffers(
                                kind,
                                dtype,
                                op,
                                Rank(0),
                                Some(small),
                                Some(big),
                                n as u32,
                            ),
                            in_len: len,
                            out_len: n * len,
                            down: vec![(send + off as u64, 0, len)],
                            up: blocks.iter().map(|&(d, h, l)| (recv + d, h, l)).collect(),
                        }
                    } else {
                        Piece {
                            args: CollArgs::for_buffers(
                                kind,
                                dtype,
                                op,
                                Rank(0),
                                Some(big),
                                Some(small),
                                n as u32,
                            ),
                            in_len: n * len,
                            out_len: len,
                            down: blocks.iter().map(|&(d, h, l)| (send + d, h, l)).collect(),
                            up: vec![(recv + off as u64, 0, len)],
                        }
                    }
                })
                .collect();
            let (in_cap, out_cap) = if gather {
                (per, n * per)
            } else {
                (n * per, per)
            };
            Plan {
                pieces,
                in_place: false,
                in_cap,
                out_cap,
            }
        }
        _ => Plan {
            pieces: Vec::new(),
            in_place: true,
            in_cap: 0,
            out_cap: 0,
        },
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
) -> Result<(), Fail> {
    let n = comm.world_size() as usize;
    let dev_arc = ipc.device().clone();
    let dev = dev_arc.as_ref();
    let mut settle = Settle { dev, scratch: None };
    let me = comm.rank().map_or(0, |r| r.idx());
    let mut plan = plan(call, me, n, ipc.stage_bytes(), 0);
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
            let total = count * dtype.size();
            let scratch = dev.alloc(total)?;
            settle.scratch = Some(scratch);
            plan = self::plan(call, me, n, ipc.stage_bytes(), scratch);
        } else {
            plan = self::plan(call, me, n, ipc.stage_bytes(), buf);
        }
    } else if let DeviceCall::AllReduce { buf, .. } = *call {
        plan = self::plan(call, me, n, ipc.stage_bytes(), buf);
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
            // input buffer holds `chunk` >= `at + len` bytes and is ours until the mark
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
        // SAFETY: the slot's buffers hold `chunk` bytes each; chunk i's download into the
        // input is done, and no copy uses them until the uploads queued below.
        let done = unsafe {
            if in_place {
                let bytes = std::slice::from_raw_parts_mut(input(slot), p.in_len);
                rt.block_on(comm.collective_inplace_with(p.args, bytes, OnAbort::Undefined))
            } else {
                let inp = std::slice::from_raw_parts(input(slot), p.in_len);
                let out = std::slice::from_raw_parts_mut(output(slot), p.out_len);
                rt.block_on(comm.collective(p.args, inp, out))
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

/// An all_to_all through host memory. Every rank first learns every rank's counts (one
/// small all_gather, in step on every rank: they all took this path from the same
/// records), so counts that disagree are the same `Mismatch` on every rank before
/// anything moves, as on the direct path. The blocks then go through one host
/// all_to_all, each padded to the largest block of the call (the collective engine's
/// flow control, not point-to-point sends whose whole blocks a link could not hold), and
/// the received blocks are copied out (nothing is written to the device if an exchange
/// fails).
///
/// # Safety
/// As [`run`]: `send` holds the sum of its counts, and `recv` of its counts, elements.
unsafe fn staged_all_to_all<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    dev: &D,
    (send, send_counts): (DevPtr, &[usize]),
    (recv, recv_counts): (DevPtr, &[usize]),
    dtype: DType,
) -> Result<(), Error> {
    let n = comm.world_size() as usize;
    // The direct path's first record refused counts of another length on every rank
    // before any rank came here; this only keeps the indexing below safe.
    if send_counts.len() != n || recv_counts.len() != n {
        return Err(Error::InvalidArgument(format!(
            "all_to_all: {} send and {} receive counts for a world of {n}",
            send_counts.len(),
            recv_counts.len()
        )));
    }
    let records = {
        use eccl_cuda::Exchange;
        let mine = cuda::ipc::counts_record(send_counts, recv_counts);
        CommExchange::new(comm, rt.clone())
            .all_gather(&mine)
            .map_err(|e| to_error(IpcError::Exchange(e)))?
    };
    // sends[s][t]: what rank s sends rank t (what t expects from s, checked).
    let sends = cuda::ipc::count_table(&records).map_err(to_error)?;
    let widest = sends.iter().flatten().copied().max().unwrap_or(0);
    if widest == 0 {
        return Ok(());
    }
    let size = dtype.size();
    let dev_err = |e: DeviceError| Error::InvalidArgument(format!("{}: {e}", dev.describe()));
    let mut input = vec![0u8; send_counts.iter().sum::<usize>() * size];
    if !input.is_empty() {
        // SAFETY: the caller's promise.
        unsafe { dev.download(&mut input, send) }.map_err(dev_err)?;
    }
    let slot = widest * size;
    let mut padded = vec![0u8; n * slot];
    let mut at = 0;
    for (t, c) in send_counts.iter().enumerate() {
        padded[t * slot..t * slot + c * size].copy_from_slice(&input[at..at + c * size]);
        at += c * size;
    }
    let mut received = vec![0u8; n * slot];
    let args = CollArgs::for_buffers(
        CollectiveKind::AllToAll,
        dtype,
        ReduceOp::Sum,
        Rank(0),
        Some(n * widest),
        Some(n * widest),
        n as u32,
    );
    rt.block_on(comm.collective(args, &padded, &mut received))?;
    let mut output = Vec::with_capacity(recv_counts.iter().sum::<usize>() * size);
    for (s, c) in recv_counts.iter().enumerate() {
        output.extend_from_slice(&received[s * slot..s * slot + c * size]);
    }
    if !output.is_empty() {
        // SAFETY: the caller's promise.
        unsafe { dev.upload(recv, &output) }.map_err(dev_err)?;
    }
    Ok(())
}

/// [`eccl_cuda::Exchange`] over a communicator, for code that runs on a tokio worker
/// thread of a multi-threaded runtime (each round blocks that thread on the collective;
/// run device calls in `tokio::task::block_in_place`) or outside any runtime with a
/// handle to one.
pub struct CommExchange<'a> {
    comm: &'a mut Communicator,
    rt: tokio::runtime::Handle,
}

impl<'a> CommExchange<'a> {
    pub fn new(comm: &'a mut Communicator, rt: tokio::runtime::Handle) -> CommExchange<'a> {
        CommExchange { comm, rt }
    }
}

impl eccl_cuda::Exchange for CommExchange<'_> {
    fn rank(&self) -> usize {
        self.comm.rank().map_or(0, |r| r.idx())
    }

    fn world(&self) -> usize {
        self.comm.world_size() as usize
    }

    fn epoch(&self) -> u64 {
        self.comm.epoch()
    }

    fn all_gather(
        &mut self,
        mine: &[u8],
    ) -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error + Send + Sync>> {
        let world = self.world();
        let mut out = vec![0u8; mine.len() * world];
        let args = CollArgs {
            kind: CollectiveKind::AllGather,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            root: Rank(0),
            count: mine.len(),
        };
        self.rt
            .block_on(self.comm.collective(args, mine, &mut out))
            .map_err(Box::new)?;
        Ok(out
            .chunks(mine.len().max(1))
            .map(<[u8]>::to_vec)
            .take(world)
            .collect())
    }
}
