//! Device memory collectives on eccl's worlds: the same-host all_reduce of
//! [`eccl_cuda::ipc`] with its handle exchange and status rounds carried by this
//! communicator's collectives (so only members of the world, over authenticated links,
//! ever see a handle, and a dead peer fails the call as any collective fails), and
//! [`run`], which takes a world whose GPUs cannot reach each other's memory through host
//! memory instead.

pub use eccl_cuda::{self as cuda, DevPtr, Device, DeviceError, IpcComm, IpcError};

use eccl_protocol::{CollectiveKind, DType, Rank, ReduceOp};

use crate::{CollArgs, Communicator, Error, OnAbort};

/// A collective on device memory of this rank's device.
#[derive(Clone, Copy, Debug)]
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

/// Runs `call` among the world's ranks, which all run on this host: over CUDA IPC, GPU to
/// GPU ([`IpcComm`]), or, where a GPU of the world cannot reach another's memory (no
/// peer access between them, or one hidden from another's process by
/// `CUDA_VISIBLE_DEVICES`; every rank learns it from the same records, before anything
/// is written), through host memory over the world's links: this rank's buffer is copied
/// to the host, the host collective runs, and the result is copied back (nothing is
/// written to the device if the host collective fails). `ECCL_DEBUG=INFO` says which,
/// once per world.
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
    let direct = {
        let mut ex = CommExchange::new(comm, rt.clone());
        // SAFETY: the caller's promise.
        unsafe {
            match *call {
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
            unsafe { staged(comm, &rt, ipc.device().as_ref(), call) }
        }
        other => other.map_err(to_error),
    }
}

impl DeviceCall {
    /// Whether a buffer the call moves something through has the null address.
    pub fn has_null_pointer(&self) -> bool {
        let (count, ptrs) = match *self {
            DeviceCall::AllReduce { buf, count, .. } | DeviceCall::Broadcast { buf, count, .. } => {
                (count, [buf, buf])
            }
            DeviceCall::AllGather {
                send, recv, count, ..
            }
            | DeviceCall::ReduceScatter {
                send, recv, count, ..
            } => (count, [send, recv]),
        };
        count > 0 && ptrs.contains(&0)
    }

    /// The host collective that does this call's work in a world of `world` ranks: its
    /// arguments, the buffer it reads and the one it writes (address, elements), and
    /// whether it runs in place (the two are one buffer).
    fn host_form(&self, world: u32) -> (CollArgs, (DevPtr, usize), (DevPtr, usize), bool) {
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
        match *self {
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
        }
    }
}

/// `call` through host memory: copy in, the host collective, copy out (nothing is
/// written to the device if the host collective fails).
///
/// # Safety
/// As [`run`].
unsafe fn staged<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    dev: &D,
    call: &DeviceCall,
) -> Result<(), Error> {
    let (args, (src, n_in), (dst, n_out), in_place) = call.host_form(comm.world_size());
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
