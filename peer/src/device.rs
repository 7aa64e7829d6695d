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

/// `call` through host memory: copy in, the host collective, copy out.
///
/// # Safety
/// As [`run`].
unsafe fn staged<D: Device>(
    comm: &mut Communicator,
    rt: &tokio::runtime::Handle,
    dev: &D,
    call: &DeviceCall,
) -> Result<(), Error> {
    let world = comm.world_size();
    let dev_err = |e: DeviceError| Error::InvalidArgument(format!("{}: {e}", dev.describe()));
    // SAFETY (the downloads and uploads below): `run`'s caller promises the buffers hold
    // what the call says; the sizes are the call's.
    let down = |ptr: DevPtr, bytes: usize| -> Result<Vec<u8>, Error> {
        let mut host = vec![0u8; bytes];
        if bytes > 0 {
            unsafe { dev.download(&mut host, ptr) }.map_err(dev_err)?;
        }
        Ok(host)
    };
    let up = |ptr: DevPtr, host: &[u8]| -> Result<(), Error> {
        if !host.is_empty() {
            unsafe { dev.upload(ptr, host) }.map_err(dev_err)?;
        }
        Ok(())
    };
    let on = |kind, dtype, op, root: usize, input, output| {
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
    match *call {
        DeviceCall::AllReduce {
            buf,
            count,
            dtype,
            op,
            ..
        } => {
            let mut host = down(buf, count * dtype.size())?;
            let args = on(CollectiveKind::AllReduce, dtype, op, 0, count, count);
            rt.block_on(comm.collective_inplace_with(args, &mut host, OnAbort::Undefined))?;
            up(buf, &host)
        }
        DeviceCall::Broadcast {
            buf,
            count,
            dtype,
            root,
        } => {
            let mut host = down(buf, count * dtype.size())?;
            let args = on(
                CollectiveKind::Broadcast,
                dtype,
                ReduceOp::Sum,
                root,
                count,
                count,
            );
            rt.block_on(comm.collective_inplace_with(args, &mut host, OnAbort::Undefined))?;
            up(buf, &host)
        }
        DeviceCall::AllGather {
            send,
            recv,
            count,
            dtype,
        } => {
            let n = world as usize;
            let input = down(send, count * dtype.size())?;
            let mut output = vec![0u8; n * count * dtype.size()];
            let args = on(
                CollectiveKind::AllGather,
                dtype,
                ReduceOp::Sum,
                0,
                count,
                n * count,
            );
            rt.block_on(comm.collective(args, &input, &mut output))?;
            up(recv, &output)
        }
        DeviceCall::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            op,
        } => {
            let n = world as usize;
            let input = down(send, n * count * dtype.size())?;
            let mut output = vec![0u8; count * dtype.size()];
            let args = on(
                CollectiveKind::ReduceScatter,
                dtype,
                op,
                0,
                n * count,
                count,
            );
            rt.block_on(comm.collective(args, &input, &mut output))?;
            up(recv, &output)
        }
    }
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
