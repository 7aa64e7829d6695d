//! The same-host all_reduce over device memory that every rank maps from every other
//! (CUDA IPC): no copy through the host and no link in the data path.
//!
//! A call exchanges a fixed-size record per rank over the caller's [`Exchange`] (eccl's
//! authenticated link: a handle from anyone outside the world is never opened): the
//! buffer's IPC handle and offset, and what the call is (count, dtype, op), which every rank
//! checks against every other's, so a mismatch is the same typed error everywhere, and
//! the identity of the physical GPU the rank runs on. The buffer is cut into one chunk per
//! GPU, owned by the first rank on that GPU (every rank when each has a GPU of its own):
//! ranks that share a GPU do not each run a kernel, because without MPS the kernels of two
//! processes take turns on the GPU, and a call would pay for every turn (on one H100 with
//! two processes, 256 MiB: 781 µs with a kernel per rank, most of it waiting for the other
//! process's turn). An owner's kernel reads its chunk from every rank's buffer, combines
//! the values in rank order (the same bits on every rank, G3) and writes the result
//! - into every rank's buffer directly, when the caller allows its buffer to be undefined
//!   after a failed call (`keep = false`, what torch's backends promise): one pass, each
//!   byte read once and written once per rank;
//! - or into a scratch chunk of its own (`keep = true`, G2): after a second exchange says
//!   every chunk is done, each GPU's owner copies every chunk into the buffers of the
//!   ranks on its GPU. A rank that dies before that point leaves every survivor's buffer
//!   as it was; an owner that dies while copying leaves the buffers of the ranks on its
//!   GPU partly written (they fail at the last exchange).
//!
//! The second exchange carries each rank's status (and an owner's scratch handle), so a
//! rank whose device failed tells the others instead of leaving them waiting, and no rank
//! returns (and lets its buffer be reused) while another may still write into it; with
//! `keep`, a third one after the copies keeps every scratch chunk alive until nobody reads
//! it.
//!
//! Mapped handles are cached (torch's caching allocator hands out the same allocations
//! again), at most [`MAX_MAPPINGS`] and all of them released when the world changes or an
//! exchange fails (a dead peer's mappings with it).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use eccl_protocol::{DType, ReduceOp};

use crate::device::{DevPtr, Device, DeviceError, IpcMem, GPU_ID_BYTES, IPC_HANDLE_BYTES};
use crate::kernels::MAX_PTRS;

/// Most peer allocations kept mapped between calls.
pub const MAX_MAPPINGS: usize = 64;

/// What the collectives need of the world they run in: eccl's communicator, or threads in
/// a test.
pub trait Exchange {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Changes whenever the set of ranks does (eccl's epoch).
    fn epoch(&self) -> u64;
    /// Every rank's `mine`, in rank order (every rank passes the same length).
    fn all_gather(
        &mut self,
        mine: &[u8],
    ) -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error + Send + Sync>>;
}

#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("exchanging buffer handles with the other ranks failed: {0}")]
    Exchange(Box<dyn std::error::Error + Send + Sync>),
    /// The ranks called with different arguments.
    #[error("the ranks disagree on the call: {0}")]
    Mismatch(String),
    /// Another rank's device failed during the call.
    #[error("rank {rank} failed during the call: {msg}")]
    Peer { rank: usize, msg: String },
    #[error("{0}")]
    Invalid(String),
}

const MAGIC: &[u8; 4] = b"ECIP";
const VERSION: u8 = 2;
/// Bytes of one rank's record.
const META_BYTES: usize = 4 + 1 + 3 + 8 + MEM_BYTES + GPU_ID_BYTES;
const MEM_BYTES: usize = IPC_HANDLE_BYTES + 8 + 8;
/// Bytes of one rank's status: ok flag, an owner's scratch chunk (keep), a message.
const STATUS_BYTES: usize = 1 + MEM_BYTES + STATUS_MSG_BYTES;
const STATUS_MSG_BYTES: usize = 240;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Meta {
    dtype: DType,
    op: ReduceOp,
    keep: bool,
    count: u64,
    buf: IpcMem,
    /// The physical GPU the rank runs on ([`Device::gpu_id`]).
    gpu: [u8; GPU_ID_BYTES],
}

fn put_mem(out: &mut Vec<u8>, m: &IpcMem) {
    out.extend_from_slice(&m.handle);
    out.extend_from_slice(&m.offset.to_le_bytes());
    out.extend_from_slice(&m.alloc_len.to_le_bytes());
}

fn get_mem(b: &[u8]) -> IpcMem {
    let mut handle = [0u8; IPC_HANDLE_BYTES];
    handle.copy_from_slice(&b[..IPC_HANDLE_BYTES]);
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    IpcMem {
        handle,
        offset: u(IPC_HANDLE_BYTES),
        alloc_len: u(IPC_HANDLE_BYTES + 8),
    }
}

const NO_MEM: IpcMem = IpcMem {
    handle: [0; IPC_HANDLE_BYTES],
    offset: 0,
    alloc_len: 0,
};

impl Meta {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(META_BYTES);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&[self.dtype as u8, self.op as u8, self.keep as u8]);
        out.extend_from_slice(&self.count.to_le_bytes());
        put_mem(&mut out, &self.buf);
        out.extend_from_slice(&self.gpu);
        out
    }

    fn decode(b: &[u8]) -> Result<Meta, String> {
        if b.len() != META_BYTES || &b[..4] != MAGIC {
            return Err("not an eccl IPC record".into());
        }
        if b[4] != VERSION {
            return Err(format!("IPC record version {} (this is {VERSION})", b[4]));
        }
        let dtype = DType::from_u8(b[5]).ok_or("an unknown dtype")?;
        let op = ReduceOp::from_u8(b[6]).ok_or("an unknown op")?;
        Ok(Meta {
            dtype,
            op,
            keep: b[7] != 0,
            count: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            buf: get_mem(&b[16..16 + MEM_BYTES]),
            gpu: b[16 + MEM_BYTES..].try_into().expect("GPU_ID_BYTES"),
        })
    }
}

/// The element range `[start, end)` of rank `r`'s chunk: equal chunks, each a whole number
/// of 16-byte vectors (so aligned buffers stay aligned), the last one shorter.
pub fn chunk(count: usize, world: usize, dtype: DType, r: usize) -> (usize, usize) {
    let g = (16 / dtype.size()).max(1);
    let per = count.div_ceil(world).div_ceil(g) * g;
    let start = (r * per).min(count);
    (start, (start + per).min(count))
}

/// The ranks that reduce a chunk, in chunk order: the first rank on each physical GPU.
/// Every rank computes it from the same records, so all agree.
pub fn owners(gpus: &[[u8; GPU_ID_BYTES]]) -> Vec<usize> {
    (0..gpus.len())
        .filter(|&r| !gpus[..r].contains(&gpus[r]))
        .collect()
}

/// Where the calls' time went (wall clock, summed over calls): for finding the fixed cost
/// of a call (`eccl-bench --device` prints it).
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    pub calls: u64,
    /// Waiting for the caller's work, and exporting the buffer's handle.
    pub export: std::time::Duration,
    /// The first exchange (records of every rank).
    pub meta: std::time::Duration,
    /// Mapping peers' buffers and queuing the kernel, and waiting for it (an owner).
    pub reduce: std::time::Duration,
    /// The status exchange (a rank that shares its GPU waits here for the owner's kernel).
    pub status: std::time::Duration,
    /// `keep`: an owner's copies out of every scratch chunk, and the last exchange.
    pub copy: std::time::Duration,
}

/// The same-host collectives of one rank over one device.
pub struct IpcComm<D: Device> {
    /// Time spent per phase, over every call so far.
    pub phases: Phases,
    dev: Arc<D>,
    epoch: Option<u64>,
    /// Peer allocations mapped here: handle → base, oldest first in `order`.
    mapped: HashMap<[u8; IPC_HANDLE_BYTES], DevPtr>,
    order: VecDeque<[u8; IPC_HANDLE_BYTES]>,
    /// This rank's scratch chunk (keep mode): address, bytes, handle.
    scratch: Option<(DevPtr, usize, IpcMem)>,
}

impl<D: Device> IpcComm<D> {
    pub fn new(dev: Arc<D>) -> IpcComm<D> {
        IpcComm {
            phases: Phases::default(),
            dev,
            epoch: None,
            mapped: HashMap::new(),
            order: VecDeque::new(),
            scratch: None,
        }
    }

    pub fn device(&self) -> &Arc<D> {
        &self.dev
    }

    /// Peer allocations mapped now.
    pub fn mappings(&self) -> usize {
        self.mapped.len()
    }

    /// Unmaps every peer allocation (a world change, a failed exchange, a dead peer).
    pub fn release(&mut self) {
        for (_, base) in self.mapped.drain() {
            // SAFETY: every call synchronizes before it returns, so nothing queued uses a
            // mapping between calls, and the cache forgets the base with it.
            if let Err(e) = unsafe { self.dev.ipc_close(base) } {
                tracing::debug!("closing a peer mapping: {e}");
            }
        }
        self.order.clear();
    }

    fn open(&mut self, mem: &IpcMem, bytes: u64) -> Result<DevPtr, IpcError> {
        if mem
            .offset
            .checked_add(bytes)
            .is_none_or(|end| end > mem.alloc_len)
        {
            return Err(IpcError::Invalid(format!(
                "a peer's buffer ({bytes} bytes at offset {}) is not inside its allocation \
                 of {} bytes",
                mem.offset, mem.alloc_len
            )));
        }
        if let Some(&base) = self.mapped.get(&mem.handle) {
            return Ok(base + mem.offset);
        }
        if self.mapped.len() >= MAX_MAPPINGS {
            if let Some(old) = self.order.pop_front() {
                if let Some(base) = self.mapped.remove(&old) {
                    // SAFETY: as in `release`: no call is using it (it is not this call's:
                    // a call maps at most two allocations per peer).
                    let _ = unsafe { self.dev.ipc_close(base) };
                }
            }
        }
        let base = self.dev.ipc_open(mem)?;
        self.mapped.insert(mem.handle, base);
        self.order.push_back(mem.handle);
        Ok(base + mem.offset)
    }

    fn ensure_scratch(&mut self, bytes: usize) -> Result<IpcMem, IpcError> {
        if let Some((_, have, mem)) = &self.scratch {
            if *have >= bytes {
                return Ok(*mem);
            }
        }
        if let Some((old, _, _)) = self.scratch.take() {
            // SAFETY: every call synchronizes before it returns; peers map the new handle
            // from now on (their old mapping keeps the memory until they release it).
            unsafe { self.dev.free(old) };
        }
        let bytes = bytes.max(1 << 20);
        let ptr = self.dev.alloc(bytes)?;
        let mem = self.dev.ipc_export(ptr)?;
        self.scratch = Some((ptr, bytes, mem));
        Ok(mem)
    }

    fn gather(&mut self, ex: &mut dyn Exchange, mine: &[u8]) -> Result<Vec<Vec<u8>>, IpcError> {
        match ex.all_gather(mine) {
            Ok(all) if all.len() == ex.world() && all.iter().all(|a| a.len() == mine.len()) => {
                Ok(all)
            }
            Ok(_) => {
                self.release();
                Err(IpcError::Invalid(
                    "the exchange answered the wrong shape".into(),
                ))
            }
            Err(e) => {
                self.release();
                Err(IpcError::Exchange(e))
            }
        }
    }

    /// All-reduces `count` elements at `buf` in place across the exchange's ranks, all on
    /// this host. `keep`: leave `buf` as it was if the call fails (G2), at the cost of a
    /// scratch chunk and a second pass.
    ///
    /// # Safety
    /// `buf` is `count` elements of device memory on this rank's device, not used by
    /// anything else until the call returns.
    pub unsafe fn all_reduce(
        &mut self,
        ex: &mut dyn Exchange,
        buf: DevPtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        keep: bool,
    ) -> Result<(), IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        if !op.valid_for(dtype) {
            return Err(IpcError::Invalid(format!(
                "{op:?} is not defined for {dtype}"
            )));
        }
        if world > MAX_PTRS {
            return Err(IpcError::Invalid(format!(
                "the same-host path serves at most {MAX_PTRS} ranks ({world} here)"
            )));
        }
        if self.epoch != Some(ex.epoch()) {
            self.release();
            self.epoch = Some(ex.epoch());
        }
        let size = dtype.size();
        let bytes = count * size;
        let mut t = std::time::Instant::now();
        let mut lap = |slot: &mut std::time::Duration| {
            let now = std::time::Instant::now();
            *slot += now - t;
            t = now;
        };
        self.phases.calls += 1;
        // The caller's writes to `buf` are done before any peer reads it.
        self.dev.synchronize()?;
        let meta = Meta {
            dtype,
            op,
            keep,
            count: count as u64,
            buf: if bytes > 0 {
                self.dev.ipc_export(buf)?
            } else {
                NO_MEM
            },
            gpu: self.dev.gpu_id()?,
        };
        lap(&mut self.phases.export);
        let all = self.gather(ex, &meta.encode())?;
        lap(&mut self.phases.meta);
        let mut metas = Vec::with_capacity(world);
        for (r, b) in all.iter().enumerate() {
            metas.push(Meta::decode(b).map_err(|e| IpcError::Invalid(format!("rank {r}: {e}")))?);
        }
        for (r, m) in metas.iter().enumerate() {
            if (m.dtype, m.op, m.keep, m.count) != (dtype, op, keep, count as u64) {
                return Err(IpcError::Mismatch(format!(
                    "rank {r} asked for {} {} {:?} (keep={}), rank {rank} for {count} {dtype} \
                     {op:?} (keep={keep})",
                    m.count, m.dtype, m.op, m.keep
                )));
            }
        }
        if world == 1 || bytes == 0 {
            return Ok(());
        }
        let owners = owners(&metas.iter().map(|m| m.gpu).collect::<Vec<_>>());
        let mine = owners.iter().position(|&o| o == rank);
        let local = match mine {
            Some(k) => self.reduce_phase(&metas, rank, buf, chunk(count, owners.len(), dtype, k)),
            None => Ok(NO_MEM),
        };
        lap(&mut self.phases.reduce);
        let mut status = vec![0u8; STATUS_BYTES];
        match &local {
            Ok(scratch) => {
                let mut m = Vec::with_capacity(MEM_BYTES);
                put_mem(&mut m, scratch);
                status[1..1 + MEM_BYTES].copy_from_slice(&m);
            }
            Err(e) => {
                status[0] = 1;
                let msg = e.to_string();
                let n = msg.len().min(STATUS_MSG_BYTES);
                status[1 + MEM_BYTES..1 + MEM_BYTES + n].copy_from_slice(&msg.as_bytes()[..n]);
            }
        }
        let statuses = self.gather(ex, &status)?;
        lap(&mut self.phases.status);
        local?;
        for (r, s) in statuses.iter().enumerate() {
            if s[0] != 0 {
                let msg = String::from_utf8_lossy(&s[1 + MEM_BYTES..])
                    .trim_end_matches('\0')
                    .to_string();
                return Err(IpcError::Peer { rank: r, msg });
            }
        }
        if keep && mine.is_some() {
            // The owner of each GPU writes the result into the buffers of the ranks on its
            // GPU (its own among them), so ranks that share a GPU queue nothing.
            let here: Vec<usize> = (0..world)
                .filter(|&r| metas[r].gpu == metas[rank].gpu)
                .collect();
            for (k, &o) in owners.iter().enumerate() {
                let (start, end) = chunk(count, owners.len(), dtype, k);
                if end == start {
                    continue;
                }
                let len = (end - start) * size;
                let src = if o == rank {
                    self.scratch.as_ref().expect("reduce_phase made it").0
                } else {
                    let m = get_mem(&statuses[o][1..1 + MEM_BYTES]);
                    self.open(&m, len as u64)?
                };
                for &t in &here {
                    let dst = if t == rank {
                        buf
                    } else {
                        self.open(&metas[t].buf, bytes as u64)?
                    };
                    self.dev.copy(dst + (start * size) as u64, src, len)?;
                }
            }
            self.dev.synchronize()?;
        }
        if keep {
            // No rank returns before its buffer is written, and no owner frees or rewrites
            // its scratch while another still copies from it.
            self.gather(ex, &[1])?;
            lap(&mut self.phases.copy);
        }
        Ok(())
    }

    /// Elements `[start, end)` from every rank's `buf`, combined (the call is
    /// `metas[rank]`, which every rank's record matches), written into every rank's buffer
    /// or, with `keep`, into this rank's scratch chunk, whose handle it returns.
    unsafe fn reduce_phase(
        &mut self,
        metas: &[Meta],
        rank: usize,
        buf: DevPtr,
        (start, end): (usize, usize),
    ) -> Result<IpcMem, IpcError> {
        let Meta {
            dtype,
            op,
            keep,
            count,
            ..
        } = metas[rank];
        let count = count as usize;
        let size = dtype.size();
        let world = metas.len();
        let scratch = if keep {
            self.ensure_scratch((end - start) * size)?
        } else {
            NO_MEM
        };
        if end > start {
            let mut bases = Vec::with_capacity(world);
            for (s, m) in metas.iter().enumerate() {
                bases.push(if s == rank {
                    buf
                } else {
                    self.open(&m.buf, (count * size) as u64)?
                });
            }
            let off = (start * size) as u64;
            let ins: Vec<DevPtr> = bases.iter().map(|b| b + off).collect();
            let outs: Vec<DevPtr> = if keep {
                vec![self.scratch.as_ref().expect("made above").0]
            } else {
                ins.clone()
            };
            self.dev
                .reduce(dtype, op, &ins, &outs, end - start, world as u32)?;
        }
        self.dev.synchronize()?;
        Ok(scratch)
    }
}

impl<D: Device> Drop for IpcComm<D> {
    fn drop(&mut self) {
        self.release();
        if let Some((ptr, _, _)) = self.scratch.take() {
            // SAFETY: every call synchronizes before it returns.
            unsafe { self.dev.free(ptr) };
        }
    }
}
