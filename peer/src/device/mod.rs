//! Device memory collectives on eccl's worlds: the same-host all_reduce of
//! [`eccl_cuda::ipc`] with its handle exchange and status rounds carried by this
//! communicator's collectives (so only members of the world, over authenticated links,
//! ever see a handle, and a dead peer fails the call as any collective fails), and
//! [`run`], which takes a world whose GPUs cannot reach each other's memory through host
//! memory instead.

pub use eccl_cuda::{self as cuda, CopyMark, DevPtr, Device, DeviceError, IpcComm, IpcError};

use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, Rank, ReduceOp};

use crate::{CollArgs, Communicator, Error};

mod staged;
use staged::staged_pipeline;

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
/// over the world's links, as a pipeline of chunks ([`staged_pipeline`]). After a failed
/// call the
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
            // Said once per epoch and cause: a world whose GPUs cannot reach each other
            // sends every call this way, a buffer CUDA IPC cannot export only its own
            // calls (the next call may go GPU to GPU again).
            static SAID: std::sync::Mutex<(u64, Vec<String>)> =
                std::sync::Mutex::new((u64::MAX, Vec::new()));
            let mut said = SAID.lock().unwrap_or_else(|p| p.into_inner());
            if said.0 != epoch {
                *said = (epoch, Vec::new());
            }
            if said.1.len() < 16 && !said.1.contains(&why) {
                tracing::info!(
                    "eccl: {}: {why}; such device collectives of epoch {epoch} go through \
                     host memory",
                    ipc.device().describe()
                );
                said.1.push(why);
            }
            drop(said);
            // SAFETY: the caller's promise.
            unsafe { staged(comm, &rt, ipc, call) }
        }
        other => other.map_err(to_error),
    }
}

/// One side of a point-to-point call on device memory.
#[derive(Clone, Debug)]
pub struct DeviceP2p {
    /// `count` elements of `dtype` at `buf`, this rank's device memory.
    pub buf: DevPtr,
    pub count: usize,
    pub dtype: DType,
    /// The other rank.
    pub peer: Rank,
    /// Matched as a host send's and receive's tag is (the call's messages use it).
    pub tag: u32,
    /// `true`: send `buf` to `peer`; `false`: receive into `buf` from `peer`.
    pub send: bool,
}

/// A send or receive of device memory to or from one rank (`eccl_cuda::ipc`'s
/// `send_to` and `recv_from`), through page-locked host memory as a pipeline of chunks:
/// the copies between device and host overlap the link. A send is eager, as a host
/// send is: it returns once its bytes are handed to the link. A receive of another size
/// or dtype than the send fails with `Mismatch`; a peer that dies fails the other as any
/// call on its link fails. After a failed receive the buffer is undefined; a send never
/// writes its buffer.
///
/// Blocks the calling thread, as [`run`].
///
/// # Safety
/// `buf` is `count` elements of `dtype` of `ipc`'s device memory, not used by anything
/// else until this returns (unchanged, for a send).
pub unsafe fn p2p<D: Device>(
    comm: &mut Communicator,
    rt: tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceP2p,
) -> Result<(), Error> {
    // A peer outside the world (or this rank) is refused by the first message's
    // send or receive, before anything moves.
    let bytes = call.count * call.dtype.size();
    let mut link = CommPair {
        comm,
        rt,
        peer: call.peer,
        tag: call.tag,
        received: 0,
    };
    // SAFETY: the caller's promise.
    let done = unsafe {
        if call.send {
            ipc.send_to(&mut link, call.buf, bytes, call.dtype)
        } else {
            ipc.recv_from(&mut link, call.buf, bytes, call.dtype)
        }
    };
    let CommPair {
        comm, rt, received, ..
    } = link;
    let e = match done {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    // What ends the epoch on every rank: a send and a receive that disagree, as a host
    // receive of another size does (the ranks' recoveries then agree on it); a device
    // that failed in the middle of a transfer, and a receive whose chunks stopped coming
    // (the rest of the transfer would be taken for the next call's). A link's failure has
    // ended it already; a receive whose first message did not come in time fails on this
    // rank alone, as a host receive does.
    let ends_epoch = match &e {
        IpcError::Exchange(_) => received > 0,
        _ => true,
    };
    let e = to_error(e);
    if !ends_epoch
        || !matches!(
            e,
            Error::Timeout { .. } | Error::Mismatch { .. } | Error::InvalidArgument(_)
        )
    {
        return Err(e);
    }
    let desc = Descriptor {
        kind: CollectiveKind::SendRecv,
        dtype: call.dtype,
        op: ReduceOp::Sum,
        algo: Algo::Direct,
        root: 0,
        count: call.count as u64,
    };
    let epoch = comm.epoch();
    Err(rt.block_on(comm.fail(epoch, 0, desc, e)))
}

/// [`eccl_cuda::ipc::PairLink`] over a communicator's point-to-point messages with one
/// rank and one tag (blocking, as [`CommExchange`]).
struct CommPair<'a> {
    comm: &'a mut Communicator,
    rt: tokio::runtime::Handle,
    peer: Rank,
    tag: u32,
    /// Messages received so far.
    received: usize,
}

impl eccl_cuda::ipc::PairLink for CommPair<'_> {
    fn peer(&self) -> usize {
        self.peer.idx()
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.rt
            .block_on(self.comm.send_bytes(DType::U8, bytes, self.peer, self.tag))
            .map(drop)
            .map_err(|e| Box::new(e) as _)
    }

    fn recv(&mut self, out: &mut [u8]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.rt
            .block_on(self.comm.recv_bytes(DType::U8, out, self.peer, self.tag))
            .map(|_| self.received += 1)
            .map_err(|e| Box::new(e) as _)
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
}

/// `call` through host memory, as a pipeline of chunks ([`staged_pipeline`]); an
/// all_to_all first learns every rank's counts ([`staged_all_to_all`]).
///
/// # Safety
/// As [`run`].
unsafe fn staged<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
) -> Result<(), Error> {
    if matches!(call, DeviceCall::AllToAll { .. }) {
        // SAFETY: the caller's promise.
        return unsafe { staged_all_to_all(comm, rt, ipc, call) };
    }
    // SAFETY: the caller's promise.
    unsafe { staged_pipeline(comm, rt, ipc, call, 0) }
}

/// An all_to_all through host memory. Every rank first learns every rank's counts (one
/// small all_gather, in step on every rank: they all took this path from the same
/// records), so counts that disagree are the same `Mismatch` on every rank before
/// anything moves, as on the direct path. Then every rank runs it as a pipeline of
/// chunks ([`staged_pipeline`]: the same slice of every block per chunk, as far as the
/// block reaches), cut from the widest block of the call (in the table every rank
/// shares, so every rank runs as many chunks), each chunk one host all_to_all with split
/// sizes ([`Communicator::all_to_all_v`]): every pair moves its own slices, nothing
/// padded (the collective engine's flow control, not point-to-point sends whose whole
/// blocks a link could not hold).
///
/// # Safety
/// As [`run`]: `send` holds the sum of its counts, and `recv` of its counts, elements.
unsafe fn staged_all_to_all<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    ipc: &mut IpcComm<D>,
    call: &DeviceCall,
) -> Result<(), Error> {
    let DeviceCall::AllToAll {
        send_counts,
        recv_counts,
        ..
    } = call
    else {
        return Err(Error::InvalidArgument(format!(
            "{call:?} is not an all_to_all"
        )));
    };
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
    // SAFETY: the caller's promise.
    unsafe { staged_pipeline(comm, rt, ipc, call, widest) }
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
