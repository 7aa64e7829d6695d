//! The calls a Python communicator queues, and the task that runs them in order.
//!
//! A [`Call`] owns the buffers it reads and writes. The task drops it only after the
//! library has returned, so the memory is valid for as long as any native code can
//! touch it, whether or not anyone still holds the `Work`.

use std::sync::{Arc, Mutex};

use eccl::{CollArgs, CollectiveKind, DType, Rank, ReduceOp, SharedTensor, SyncStrategy};
use tokio::sync::{mpsc, Notify};

use crate::buffer::{Claim, HostBuffer, WritableBuffer};
use crate::work::{Completer, Done, Outcome};

pub(crate) enum Call {
    UpdateTopology,
    /// Measure the links, have the master solve the ring (a new epoch).
    OptimizeTopology,
    ArePeersPending,
    Leave,
    /// Tells the other ranks of an abort made here (after the calls queued before it).
    AnnounceAbort,
    /// torch's `_reconfigure`: a world of exactly these peers.
    Reconfigure {
        uuid: u64,
        peers: Vec<u64>,
        ordered: bool,
        timeout: std::time::Duration,
    },
    /// Out of place. Each side is a list of buffers read as one, back to back (torch's
    /// list forms: one per rank); most calls pass one buffer a side, and a rank of a
    /// rooted collective none for the side it does not use (gather's output, scatter's
    /// input off the root).
    Collective {
        kind: CollectiveKind,
        op: ReduceOp,
        root: Rank,
        input: Vec<HostBuffer>,
        output: Vec<WritableBuffer>,
    },
    /// All_to_all with blocks of any sizes (elements per rank, in rank order).
    AllToAllV {
        /// Each a buffer, or a list of buffers read as one (see `Collective`).
        input: Vec<HostBuffer>,
        output: Vec<WritableBuffer>,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
    },
    /// All_gather that reads the other ranks' memory directly where every rank's source
    /// lies in eccl's shared memory (`crate::direct`); `input: None`: this rank's block
    /// of `output` is its source (NCCL's in-place form).
    SharedAllGather {
        output: WritableBuffer,
        input: Option<HostBuffer>,
    },
    /// Reduce_scatter that reads the other ranks' inputs directly where every rank's
    /// input lies in eccl's shared memory.
    SharedReduceScatter {
        op: ReduceOp,
        output: WritableBuffer,
        input: HostBuffer,
    },
    /// All_reduce, broadcast or reduce on one buffer; `on_abort` says what a failure
    /// leaves in it.
    InPlace {
        kind: CollectiveKind,
        op: ReduceOp,
        root: Rank,
        buf: WritableBuffer,
        on_abort: eccl::OnAbort,
    },
    /// All_reduce in place with quantized values on the wire (`eccl::Quantize`).
    Quantized {
        op: ReduceOp,
        buf: WritableBuffer,
        quantize: eccl::Quantize,
    },
    /// One all_reduce over several buffers of one dtype.
    Coalesced {
        op: ReduceOp,
        bufs: Vec<WritableBuffer>,
    },
    Send {
        buf: HostBuffer,
        peer: Rank,
        tag: u32,
    },
    /// A collective on device memory among ranks of one host, over CUDA IPC
    /// (`eccl_cuda::ipc`). `owner` is the Python object that owns the memory (tensors),
    /// held until the call is done.
    Device {
        /// CUDA device `cuda:N` of this rank's buffers.
        device: usize,
        call: eccl::device::DeviceCall,
        _owner: pyo3::Py<pyo3::PyAny>,
    },
    /// A send or receive of device memory to or from one rank (`eccl::device::p2p`):
    /// over CUDA IPC on one host, through host memory otherwise. `owner` as for `Device`.
    DeviceP2p {
        device: usize,
        call: eccl::device::DeviceP2p,
        _owner: pyo3::Py<pyo3::PyAny>,
    },
    /// Waits, on the communicator's task and not the caller's thread, until the work that
    /// a caller's stream queued before `event` was recorded on it is done: the calls queued
    /// after this read memory that stream wrote.
    AwaitDevice {
        event: eccl_cuda::RecordedEvent,
    },
    /// `peer: None`: from whichever rank's message comes first.
    Recv {
        buf: WritableBuffer,
        peer: Option<Rank>,
        tag: u32,
    },
    Sync {
        revision: u64,
        tensors: Vec<(String, WritableBuffer)>,
        strategy: SyncStrategy,
        /// Names promised unchanged since the last sync (`SharedTensor::unchanged`).
        unchanged: std::collections::HashSet<String>,
    },
}

impl Call {
    /// The buffers the call reads only, and those it writes.
    pub fn buffers(&self) -> (Vec<&HostBuffer>, Vec<&WritableBuffer>) {
        match self {
            Call::UpdateTopology
            | Call::OptimizeTopology
            | Call::ArePeersPending
            | Call::Leave
            | Call::AnnounceAbort
            | Call::Reconfigure { .. }
            | Call::AwaitDevice { .. }
            | Call::Device { .. }
            | Call::DeviceP2p { .. } => (vec![], vec![]),
            Call::Collective { input, output, .. } => {
                (input.iter().collect(), output.iter().collect())
            }
            Call::AllToAllV { input, output, .. } => {
                (input.iter().collect(), output.iter().collect())
            }
            Call::SharedAllGather { input, output } => (input.iter().collect(), vec![output]),
            Call::SharedReduceScatter { input, output, .. } => (vec![input], vec![output]),
            Call::InPlace { buf, .. } | Call::Recv { buf, .. } | Call::Quantized { buf, .. } => {
                (vec![], vec![buf])
            }
            Call::Coalesced { bufs, .. } => (vec![], bufs.iter().collect()),
            Call::Send { buf, .. } => (vec![buf], vec![]),
            Call::Sync { tensors, .. } => (vec![], tensors.iter().map(|(_, b)| b).collect()),
        }
    }
}

/// The dtype of a call's buffers (its first one's: they were checked to agree).
fn dtype_of(input: &[HostBuffer], output: &[WritableBuffer]) -> DType {
    input
        .first()
        .map(|b| b.dtype())
        .or(output.first().map(|b| b.read().dtype()))
        .unwrap_or(DType::U8)
}

/// A call's buffers as the byte slices the library takes.
fn slices<'a>(
    input: &'a [HostBuffer],
    output: &'a mut [WritableBuffer],
) -> (Vec<&'a [u8]>, Vec<&'a mut [u8]>) {
    (
        input.iter().map(|b| b.bytes()).collect(),
        output.iter_mut().map(|b| b.bytes_mut()).collect(),
    )
}

/// A call waiting in the communicator's queue, with what finishes its Python `Work`.
pub(crate) struct Queued {
    pub id: u64,
    pub call: Call,
    pub done: Completer,
}

/// What Python reads without waiting for the queue: the state after the last call.
#[derive(Clone, Default)]
pub(crate) struct Info {
    pub peer_id: u64,
    pub rank: Option<u32>,
    pub world_size: u32,
    pub epoch: u64,
    pub transport: String,
}

/// Runs a communicator's calls in the order they were queued, until the queue closes,
/// the communicator leaves, or `stop` asks it to (interpreter exit: a call in flight is
/// cancelled, its Work reports `AbortedError`). Then the links close in order.
pub(crate) async fn serve(
    mut comm: eccl::Communicator,
    mut queue: mpsc::UnboundedReceiver<Queued>,
    info: Arc<Mutex<Info>>,
    stop: Arc<Notify>,
) {
    // Each CUDA device's same-host collectives (mapped peer buffers are cached there).
    let mut devices = Devices::default();
    // The call the caller submitted while this task looked for one (see `next_soon`).
    let mut soon: Option<Queued> = None;
    loop {
        let queued = match soon.take() {
            Some(queued) => {
                // Taken without an await: give the worker back when the task's budget
                // is spent, as `recv().await` does, so that timers, links and the tasks
                // this worker woke run between back-to-back calls that never wait.
                tokio::task::coop::consume_budget().await;
                queued
            }
            None => tokio::select! {
                biased;
                _ = stop.notified() => break,
                queued = queue.recv() => match queued {
                    Some(queued) => queued,
                    None => break,
                },
            },
        };
        let Queued { id, mut call, done } = queued;
        if let Call::Leave = call {
            done.complete(comm.leave().await.map(|_| Done::Left));
            queue.close();
            while let Some(j) = queue.recv().await {
                j.done.complete(Err(eccl::Error::Evicted {
                    reason: "this peer left the job".into(),
                }));
            }
            return;
        }
        let out = tokio::select! {
            biased;
            out = run(&mut comm, &mut devices, id, &mut call) => out,
            // Dropping the call's future stops it; `done` then reports the stop.
            _ = stop.notified() => break,
        };
        if let Ok(mut i) = info.lock() {
            *i = Info {
                peer_id: comm.peer_id().0,
                rank: comm.rank().map(|r| r.0),
                world_size: comm.world_size(),
                epoch: comm.epoch(),
                transport: comm.transport_summary(),
            };
        }
        done.complete(out);
        // Only now, with the library done with them, may the buffers go.
        drop(call);
        match next_soon(&mut queue) {
            Next::Call(queued) => soon = Some(queued),
            Next::Closed => break,
            Next::NotYet => {}
        }
    }
    queue.close();
    // The Python side let go of this communicator or the interpreter is exiting: the
    // peer leaves on purpose. A departure is not an eviction, so the master does not
    // abort the epoch under a peer that is still reading what this one sent last; the
    // links close in order after it.
    // A master that is gone cannot be told; nothing else is left to do then.
    let _ = comm.leave().await;
}

enum Next {
    Call(Queued),
    Closed,
    NotYet,
}

/// How long this task looks for the next call before it waits for one: it spins on a
/// thread of the runtime, which the process's other communicators and links share.
const NEXT_CALL_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// The next call, if the caller submits it while this task spins for it (yielding the
/// core, for at most [`NEXT_CALL_SPIN`], and not at all where the host's ranks outnumber
/// its cores: `eccl::spin_until`). A caller that makes calls back to back (a loop of
/// small `dist.all_reduce`s) spends 10–20 µs in Python between one call's end and the
/// next one's start; without the spin the runtime's thread has parked by then and its
/// wake-up costs as much again on a VM (`examples/torch_overhead.py`: a 1 KiB call on
/// one rank 8 µs native and 30 through torch before, 3 and 13.5 after).
fn next_soon(queue: &mut mpsc::UnboundedReceiver<Queued>) -> Next {
    let queue = std::cell::RefCell::new(queue);
    let next = std::cell::RefCell::new(Next::NotYet);
    eccl::spin_until_within(
        || {
            let got = match queue.borrow_mut().try_recv() {
                Ok(queued) => Next::Call(queued),
                Err(mpsc::error::TryRecvError::Disconnected) => Next::Closed,
                Err(mpsc::error::TryRecvError::Empty) => return false,
            };
            *next.borrow_mut() = got;
            true
        },
        true,
        NEXT_CALL_SPIN,
    );
    next.into_inner()
}

/// A communicator's devices, opened on first use.
#[derive(Default)]
pub(crate) struct Devices {
    by_ordinal: std::collections::HashMap<usize, eccl::device::IpcComm<eccl_cuda::CudaDevice>>,
}

impl Devices {
    /// Device `ordinal`'s same-host collectives, opened on first use.
    fn open(
        &mut self,
        ordinal: usize,
    ) -> Result<&mut eccl::device::IpcComm<eccl_cuda::CudaDevice>, eccl::Error> {
        Ok(match self.by_ordinal.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let dev = eccl_cuda::CudaDevice::new(ordinal)
                    .map_err(|e| eccl::Error::InvalidArgument(e.to_string()))?;
                v.insert(eccl::device::IpcComm::new(Arc::new(dev)))
            }
        })
    }
}

/// Waits (in `block_in_place`) for a caller's CUDA event. A device that cannot say
/// whether the caller's work is done leaves the calls queued behind the wait reading
/// memory that may not hold what the caller wrote, so the epoch is aborted here and the
/// other ranks told: this rank's later calls and the others' copies of them fail
/// (`Aborted`, which recovery handles as any failed collective) instead of taking
/// unready data. A stream that does not drain is waited for until the epoch breaks
/// (the other ranks' calls time out waiting for this one, and abort it): the call then
/// fails with the epoch's error, and nothing reads the tensors.
async fn await_device(comm: &mut eccl::Communicator, event: &eccl_cuda::RecordedEvent) -> Outcome {
    let abort = comm.abort_handle();
    match tokio::task::block_in_place(|| event.wait_unless(|| abort.broken().is_some())) {
        Ok(true) => Ok(Done::Left),
        Ok(false) => Err(abort.broken().unwrap_or_else(|| eccl::Error::Aborted {
            epoch: comm.epoch(),
            cause: "the epoch broke while the call waited for its tensors' stream".into(),
        })),
        Err(e) => {
            let cause = format!(
                "waiting for the tensors' stream on cuda:{} failed: {e}",
                event.ordinal()
            );
            abort.abort(&cause);
            comm.announce_abort().await;
            Err(eccl::Error::Aborted {
                epoch: comm.epoch(),
                cause,
            })
        }
    }
}

/// One device collective (`eccl::device::run`: over CUDA IPC, or through host memory
/// where the world's GPUs cannot reach each other): blocks this runtime worker (in
/// `block_in_place`) for the device work and the exchange rounds, which run as ordinary
/// collectives.
fn device_call(
    comm: &mut eccl::Communicator,
    devices: &mut Devices,
    device: usize,
    call: &eccl::device::DeviceCall,
) -> Outcome {
    let ipc = devices.open(device)?;
    let rt = tokio::runtime::Handle::current();
    // SAFETY: the Python side checked that the pointers are tensors of the call's sizes on
    // `device`, and the call holds those tensors (`owner`) until it is done.
    tokio::task::block_in_place(|| unsafe { eccl::device::run(comm, rt, ipc, call) })?;
    Ok(Done::Left)
}

/// One device send or receive (`eccl::device::p2p`), blocking this runtime worker as
/// `device_call` does.
fn device_p2p(
    comm: &mut eccl::Communicator,
    devices: &mut Devices,
    device: usize,
    call: &eccl::device::DeviceP2p,
) -> Outcome {
    let ipc = devices.open(device)?;
    let rt = tokio::runtime::Handle::current();
    // SAFETY: the Python side checked that the pointer is a tensor of the call's size on
    // `device`, and the call holds that tensor (`owner`) until it is done.
    tokio::task::block_in_place(|| unsafe { eccl::device::p2p(comm, rt, ipc, call) })?;
    Ok(Done::Left)
}

async fn run(
    comm: &mut eccl::Communicator,
    devices: &mut Devices,
    id: u64,
    call: &mut Call,
) -> Outcome {
    let _claim = {
        let (reads, writes) = call.buffers();
        Claim::take(id, &reads, &writes)?
    };
    let world = comm.world_size();
    match call {
        Call::UpdateTopology => comm.update_topology().await.map(Done::World),
        Call::OptimizeTopology => comm.optimize_topology().await.map(Done::Topology),
        Call::ArePeersPending => comm.are_peers_pending().await.map(Done::Pending),
        Call::AnnounceAbort => {
            comm.announce_abort().await;
            Ok(Done::Left)
        }
        Call::Reconfigure {
            uuid,
            peers,
            ordered,
            timeout,
        } => {
            let members = peers.iter().map(|p| eccl::PeerId(*p)).collect();
            comm.reconfigure(*uuid, members, *ordered, *timeout)
                .await
                .map(Done::World)
        }
        Call::Leave => unreachable!("handled by serve"),
        Call::Collective {
            kind,
            op,
            root,
            input,
            output,
        } => {
            let args = CollArgs::for_buffers(
                *kind,
                dtype_of(input, output),
                *op,
                *root,
                (!input.is_empty()).then(|| input.iter().map(|b| b.count()).sum()),
                (!output.is_empty()).then(|| output.iter().map(|b| b.read().count()).sum()),
                world,
            );
            let (ins, mut outs) = slices(input, output);
            comm.collective_lists(args, &ins, &mut outs)
                .await
                .map(Done::Op)
        }
        Call::AllToAllV {
            input,
            output,
            send_counts,
            recv_counts,
        } => {
            let dtype = dtype_of(input, output);
            let (ins, mut outs) = slices(input, output);
            comm.all_to_all_v_lists(dtype, &ins, send_counts, &mut outs, recv_counts)
                .await
                .map(Done::Op)
        }
        Call::SharedAllGather { output, input } => {
            let dtype = input
                .as_ref()
                .map_or_else(|| output.read().dtype(), |b| b.dtype());
            let inp = input.as_ref().map(|b| b.bytes());
            crate::direct::all_gather(comm, output.bytes_mut(), inp, dtype)
                .await
                .map(Done::Flag)
        }
        Call::SharedReduceScatter { op, output, input } => crate::direct::reduce_scatter(
            comm,
            output.bytes_mut(),
            input.bytes(),
            input.dtype(),
            *op,
        )
        .await
        .map(Done::Flag),
        Call::InPlace {
            kind,
            op,
            root,
            buf,
            on_abort,
        } => {
            let b = buf.read();
            let args = CollArgs::for_buffers(
                *kind,
                b.dtype(),
                *op,
                *root,
                Some(b.count()),
                Some(b.count()),
                world,
            );
            comm.collective_inplace_with(args, buf.bytes_mut(), *on_abort)
                .await
                .map(Done::Op)
        }
        Call::Quantized { op, buf, quantize } => {
            let dtype = buf.read().dtype();
            comm.all_reduce_quantized_bytes(dtype, buf.bytes_mut(), *op, *quantize)
                .await
                .map(Done::Op)
        }
        Call::Coalesced { op, bufs } => {
            let dtype = bufs.first().map_or(DType::F32, |b| b.read().dtype());
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| b.bytes_mut()).collect();
            comm.all_reduce_coalesced(dtype, *op, &mut slices)
                .await
                .map(Done::Op)
        }
        Call::Device { device, call, .. } => device_call(comm, devices, *device, call),
        Call::DeviceP2p { device, call, .. } => device_p2p(comm, devices, *device, call),
        Call::AwaitDevice { event } => await_device(comm, event).await,
        Call::Send { buf, peer, tag } => comm
            .send_bytes(buf.dtype(), buf.bytes(), *peer, *tag)
            .await
            .map(Done::Op),
        Call::Recv { buf, peer, tag } => {
            let dtype = buf.read().dtype();
            match peer {
                Some(p) => comm.recv_bytes(dtype, buf.bytes_mut(), *p, *tag).await,
                None => comm.recv_any_bytes(dtype, buf.bytes_mut(), *tag).await,
            }
            .map(Done::Op)
        }
        Call::Sync {
            revision,
            tensors,
            strategy,
            unchanged,
        } => {
            let mut ts: Vec<SharedTensor<'_>> = tensors
                .iter_mut()
                .map(|(n, b)| {
                    SharedTensor::bytes(n.clone(), b.bytes_mut()).unchanged(unchanged.contains(n))
                })
                .collect();
            comm.sync_shared_state(*revision, &mut ts, *strategy)
                .await
                .map(Done::Sync)
        }
    }
}
