//! The same-host collectives over device memory that every rank maps from every other
//! (CUDA IPC): no copy through the host and no link in the data path. all_reduce is
//! described below; all_gather, reduce_scatter, broadcast, all_to_all, gather and
//! scatter follow the same steps (records, the work of each GPU's owner, status) without
//! `keep`: the owner of each GPU copies (or, for reduce_scatter, reduces in rank order)
//! straight from every rank's buffer into the buffers of the ranks on its GPU.
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
//! again), at most [`MAX_MAPPINGS`], the least recently used closed first (never one the
//! current call uses: work it queued may read it), and all of them released when the
//! world changes or an exchange fails (a dead peer's mappings with it). Every call waits
//! for the work it queued before it returns, also when it fails part-way.
//!
//! This module holds what every call shares (the records and their exchanges, the
//! mapping cache, the scratch chunks, the page-locked stage buffers); the collectives
//! themselves are in `collectives.rs`, point-to-point in `p2p.rs`, the records' format
//! in `records.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use eccl_protocol::DType;

use crate::device::{DevPtr, Device, DeviceError, IpcMem, Reach, GPU_ID_BYTES, IPC_HANDLE_BYTES};
use crate::kernels::MAX_PTRS;

mod collectives;
mod p2p;
mod records;
pub use p2p::{PairLink, HEADER_BYTES as P2P_HEADER_BYTES};
pub use records::{count_table, counts_record, IpcKind};
use records::{get_mem, put_mem, Call, Meta, MEM_BYTES, NO_MEM, STATUS_BYTES, STATUS_MSG_BYTES};

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
    /// Another rank's device failed, before the call or during it.
    #[error("rank {rank}'s device failed: {msg}")]
    Peer { rank: usize, msg: String },
    #[error("{0}")]
    Invalid(String),
    /// A GPU of the world cannot reach another's memory (no peer access between them,
    /// or one hidden from the other's process): every rank learns it from the same
    /// records, before anything is written, and the call goes through host memory
    /// instead (`eccl::device::run`).
    #[error("GPUs of this world cannot reach each other's memory: {0}")]
    NoPeerAccess(String),
}

/// Whether `[a, a + alen)` and `[b, b + blen)` share a byte.
fn overlap(a: DevPtr, alen: usize, b: DevPtr, blen: usize) -> bool {
    alen > 0 && blen > 0 && a < b + blen as u64 && b < a + alen as u64
}

/// What a rank refuses of a gather or scatter (`call`, "to" or "from" its root): a root
/// outside the world; on the root, no `whole` buffer (world × `bytes`, named for the
/// errors), or its `part` (`bytes`) overlapping it other than as the root's own slice.
fn rooted_refusal(
    (call, dir): (&str, &str),
    (rank, root, world, bytes): (usize, usize, usize, usize),
    (whole_name, whole): (&str, DevPtr),
    (part_name, part): (&str, DevPtr),
) -> Option<String> {
    let on_root = rank == root;
    let own = whole + (rank * bytes) as u64;
    if root >= world {
        Some(format!("{call} {dir} rank {root} of a world of {world}"))
    } else if on_root && bytes > 0 && whole == 0 {
        Some(format!("{call}: the root's {whole_name} is a null pointer"))
    } else if on_root && part != own && overlap(part, bytes, whole, world * bytes) {
        Some(format!(
            "{call}: the root's {part_name} overlaps its {whole_name} other than as its own slice"
        ))
    } else {
        None
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

/// Why the ranks' GPUs cannot run a same-host call, if they cannot: each GPU's owner
/// reads every rank's buffer (and, with `keep`, every owner's scratch chunk) and writes
/// into buffers on its own GPU, so every owner must reach every GPU of the world. The
/// same answer on every rank, from the same records.
fn unreachable(metas: &[Meta]) -> Option<String> {
    if let Some(r) = metas.iter().position(|m| m.host_only) {
        return Some(format!(
            "rank {r} keeps device collectives off CUDA IPC (ECCL_CUDA_IPC=0, a world \
             across hosts, or a buffer CUDA IPC cannot export)"
        ));
    }
    let gpus: Vec<_> = metas.iter().map(|m| m.gpu).collect();
    for o in owners(&gpus) {
        for (t, m) in metas.iter().enumerate() {
            if m.gpu != metas[o].gpu && !metas[o].reach.covers(&m.gpu) {
                return Some(format!(
                    "rank {o}'s GPU cannot map rank {t}'s (no peer access between them, or \
                     rank {t}'s GPU is not visible to rank {o}'s process)"
                ));
            }
        }
    }
    None
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
    /// Peer allocations mapped here: handle → (base, the call that last used it), least
    /// recently used first in `order`.
    mapped: HashMap<[u8; IPC_HANDLE_BYTES], (DevPtr, u64)>,
    order: VecDeque<[u8; IPC_HANDLE_BYTES]>,
    /// Counts calls (begun), to tell the mappings the current call uses from older ones.
    call: u64,
    /// This rank's scratch chunk (keep mode): address, bytes, handle.
    scratch: Option<(DevPtr, usize, IpcMem)>,
    /// Scratch chunks outgrown, with the epoch in which they were: peers may still hold
    /// them mapped, and CUDA leaves freeing memory that another process maps undefined.
    /// Each is freed at the first records exchange of a later epoch: every rank of that
    /// world released its mappings of the earlier one before it sent its record (a rank
    /// that left the world meanwhile is not waited for).
    retired: Vec<(DevPtr, u64)>,
    /// `ECCL_CUDA_IPC=0`: every call of the world goes through host memory.
    host_only: bool,
    /// The current world's ranks run on more than one host: the same.
    spans_hosts: bool,
    /// Page-locked host buffers of the staged path ([`IpcComm::stage_buffers`]), each
    /// of `stage_len` bytes.
    stage: Vec<*mut u8>,
    stage_len: usize,
    /// The staged pipeline's smallest chunk.
    stage_bytes: usize,
}

/// The smallest chunk of a staged pipeline (host memory between device and links):
/// large enough that a host collective's fixed cost is small beside its bytes, small
/// enough that the copies of neighbouring chunks overlap it. A call is cut into about
/// four chunks of at least this, and at most 16 times this.
pub const STAGE_BYTES: usize = 4 << 20;

// SAFETY: the stage buffers are host memory this value owns alone (allocated and freed
// through its device), used only through `&mut self`.
unsafe impl<D: Device> Send for IpcComm<D> {}

impl<D: Device> IpcComm<D> {
    pub fn new(dev: Arc<D>) -> IpcComm<D> {
        IpcComm {
            phases: Phases::default(),
            dev,
            epoch: None,
            mapped: HashMap::new(),
            order: VecDeque::new(),
            call: 0,
            scratch: None,
            retired: Vec::new(),
            host_only: std::env::var("ECCL_CUDA_IPC").is_ok_and(|v| v.trim() == "0"),
            spans_hosts: false,
            stage: Vec::new(),
            stage_len: 0,
            stage_bytes: STAGE_BYTES,
        }
    }

    /// Sets the staged pipeline's smallest chunk (bytes, at least 1 KiB; [`STAGE_BYTES`]
    /// unless set). Every rank of a world must use the same (its chunks are collectives
    /// that pair with the others'): a knob for tests, which stage small buffers in many
    /// chunks.
    pub fn set_stage_bytes(&mut self, bytes: usize) {
        self.stage_bytes = bytes.max(1024);
    }

    /// Says whether the current world runs on more than one host (every rank of the
    /// world says the same): its calls then go through host memory, and no handle is
    /// exported.
    pub fn set_world_spans_hosts(&mut self, spans: bool) {
        self.spans_hosts = spans;
    }

    /// The staged pipeline's smallest chunk in bytes.
    pub fn stage_bytes(&self) -> usize {
        self.stage_bytes
    }

    /// `slots` page-locked host buffers of at least `bytes` each, kept for the next call
    /// (allocating page-locked memory takes milliseconds; a larger size replaces them).
    pub fn stage_buffers(&mut self, slots: usize, bytes: usize) -> Result<&[*mut u8], DeviceError> {
        if bytes > self.stage_len {
            self.free_stage();
            self.stage_len = bytes;
        }
        while self.stage.len() < slots {
            let p = self.dev.host_alloc(self.stage_len)?;
            self.stage.push(p);
        }
        Ok(&self.stage[..slots])
    }

    fn free_stage(&mut self) {
        // Nothing queued uses them: every staged call waits for its copies.
        if self.dev.synchronize().is_ok() {
            for p in self.stage.drain(..) {
                // SAFETY: allocated by `stage_buffers` with `stage_len`, no copy queued.
                unsafe { self.dev.host_free(p, self.stage_len) };
            }
        } else {
            // A device that cannot say its copies are done: leak them rather than free
            // memory a copy may still write.
            self.stage.clear();
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
        for (_, (base, _)) in self.mapped.drain() {
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
        let call = self.call;
        if let Some((base, used)) = self.mapped.get_mut(&mem.handle) {
            // Least recently used last: a mapping this call uses is never the one a
            // later open of the same call closes.
            *used = call;
            let base = *base;
            if let Some(i) = self.order.iter().position(|h| *h == mem.handle) {
                self.order.remove(i);
            }
            self.order.push_back(mem.handle);
            return Ok(base + mem.offset);
        }
        if self.mapped.len() >= MAX_MAPPINGS {
            let oldest = self.order.front().copied();
            match oldest.and_then(|h| self.mapped.get(&h).map(|&(b, used)| (h, b, used))) {
                Some((h, base, used)) if used != call => {
                    self.order.pop_front();
                    self.mapped.remove(&h);
                    // SAFETY: as in `release`: an earlier call's mapping, and every call
                    // synchronizes before it returns, so nothing queued uses it.
                    let _ = unsafe { self.dev.ipc_close(base) };
                }
                // Every mapping is this call's (a call maps at most two allocations per
                // peer, far fewer than the cache holds): refuse rather than close one
                // that work queued by this call may use.
                _ => {
                    return Err(IpcError::Invalid(format!(
                        "a call would map more than {MAX_MAPPINGS} peer allocations at once"
                    )))
                }
            }
        }
        let base = self.dev.ipc_open(mem)?;
        self.mapped.insert(mem.handle, (base, call));
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
            // Peers map the new handle from now on; the old chunk is freed once a later
            // world's ranks have released their mappings of it (`retired`).
            self.retired.push((old, self.epoch.unwrap_or(0)));
        }
        // Doubling: chunks outgrown one after another add up to less than the last one.
        let bytes = bytes.max(1 << 20).next_power_of_two();
        let ptr = self.dev.alloc(bytes)?;
        let mem = match self.dev.ipc_export(ptr) {
            Ok(mem) => mem,
            Err(e) => {
                // SAFETY: allocated just above, never exported or used.
                unsafe { self.dev.free(ptr) };
                return Err(e.into());
            }
        };
        self.scratch = Some((ptr, bytes, mem));
        Ok(mem)
    }

    fn exchange(&mut self, ex: &mut dyn Exchange, mine: &[u8]) -> Result<Vec<Vec<u8>>, IpcError> {
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

    /// The first steps of every call: checks what can be checked alone, waits for the
    /// caller's work on this device, and exchanges the records, which every rank checks
    /// against every other's (the same typed error everywhere when they disagree).
    /// `send` and `recv` are this rank's buffers and their sizes in bytes (`recv` (0, 0)
    /// for a call with one buffer); `refused` is this rank's own objection, if any.
    fn begin(
        &mut self,
        ex: &mut dyn Exchange,
        call: Call,
        send: (DevPtr, usize),
        recv: (DevPtr, usize),
        refused: Option<String>,
    ) -> Result<Vec<Meta>, IpcError> {
        let (rank, world) = (ex.rank(), ex.world());
        // More ranks than a kernel reads: through host memory (every rank knows the
        // world's size, so every rank goes there), after the records are checked.
        let too_many = world > MAX_PTRS;
        if self.epoch != Some(ex.epoch()) {
            self.release();
            self.epoch = Some(ex.epoch());
        }
        let t = std::time::Instant::now();
        self.phases.calls += 1;
        self.call += 1;
        // A device that fails before the call (its synchronize, its id, the GPUs it
        // reaches) fails this rank's call; its record says so, so that every rank fails
        // the call together rather than waiting in the exchange for this one.
        let mut failed: Option<DeviceError> = None;
        // The caller's writes to its buffers are done before any peer reads them.
        if let Err(e) = self.dev.synchronize() {
            failed = Some(e);
        }
        let gpu = self.dev.gpu_id().unwrap_or_else(|e| {
            failed.get_or_insert(e);
            [0; GPU_ID_BYTES]
        });
        let reach = self.dev.reach().unwrap_or_else(|e| {
            failed.get_or_insert(e);
            Reach::Only(Vec::new())
        });
        let mut host_only = self.host_only || self.spans_hosts || too_many;
        let skip = refused.is_some() || failed.is_some();
        let export = |dev: &D, (ptr, bytes): (DevPtr, usize)| {
            if bytes > 0 && !skip && !host_only {
                dev.ipc_export(ptr)
            } else {
                Ok(NO_MEM)
            }
        };
        // Memory that CUDA IPC cannot export (not from cuMemAlloc: torch's expandable
        // segments, a cudaMallocAsync pool) sends the call through host memory on every
        // rank (the record says so), rather than failing this rank alone before the
        // exchange, where the others would wait for it.
        let exported = export(&self.dev, send).and_then(|s| Ok((s, export(&self.dev, recv)?)));
        let (send_mem, recv_mem) = match exported {
            Ok(both) => both,
            // Any export error counts (a context error too): the staged path then meets a
            // device that does not work with an error of its own.
            Err(e) => {
                tracing::debug!(target: "eccl::cuda", "a buffer cannot be exported over CUDA IPC ({e}): this call goes through host memory on every rank");
                host_only = true;
                (NO_MEM, NO_MEM)
            }
        };
        let meta = Meta {
            call,
            refused: refused.is_some(),
            failed: failed.is_some(),
            host_only,
            send: send_mem,
            recv: recv_mem,
            gpu,
            reach,
        };
        let t1 = std::time::Instant::now();
        self.phases.export += t1 - t;
        let all = self.exchange(ex, &meta.encode())?;
        // Every rank of this world released the mappings of earlier epochs before it sent
        // its record: scratch chunks retired in them are nobody's now.
        let now = ex.epoch();
        let dev = &self.dev;
        self.retired.retain(|&(ptr, epoch)| {
            if epoch < now {
                // SAFETY: retired (no call's scratch), every call synchronizes before it
                // returns, and no rank of this world maps it any more.
                unsafe { dev.free(ptr) };
                false
            } else {
                true
            }
        });
        self.phases.meta += t1.elapsed();
        let mut metas = Vec::with_capacity(world);
        for (r, b) in all.iter().enumerate() {
            metas.push(Meta::decode(b).map_err(|e| IpcError::Invalid(format!("rank {r}: {e}")))?);
        }
        if let Some(e) = failed {
            return Err(e.into());
        }
        if let Some(why) = refused {
            return Err(IpcError::Invalid(why));
        }
        let describe = |c: &Call| {
            format!(
                "{:?} of {} {} {:?} root {} (keep={})",
                c.kind, c.count, c.dtype, c.op, c.root, c.keep
            )
        };
        for (r, m) in metas.iter().enumerate() {
            if m.call != call {
                return Err(IpcError::Mismatch(format!(
                    "rank {r} asked for {}, rank {rank} for {}",
                    describe(&m.call),
                    describe(&call)
                )));
            }
            if m.failed {
                return Err(IpcError::Peer {
                    rank: r,
                    msg: "before the call, nothing touched (that rank's own error says how)".into(),
                });
            }
            if m.refused {
                return Err(IpcError::Invalid(format!(
                    "rank {r} refused its arguments (its buffers overlap, or its root's \
                     buffer is missing)"
                )));
            }
        }
        // Asked at every call, from the records every rank has: a verdict kept from an
        // earlier call would be one device's alone, and a rank calling on another device
        // would exchange while the others did not.
        if too_many {
            return Err(IpcError::NoPeerAccess(format!(
                "the GPU to GPU path serves at most {MAX_PTRS} ranks ({world} here)"
            )));
        }
        if let Some(why) = unreachable(&metas) {
            return Err(IpcError::NoPeerAccess(why));
        }
        Ok(metas)
    }

    /// The status exchange that ends every call: this rank's outcome `local` (an owner's
    /// scratch chunk when it succeeded) against every other's. Returns every rank's
    /// status record once all succeeded.
    fn settle(
        &mut self,
        ex: &mut dyn Exchange,
        local: Result<IpcMem, IpcError>,
    ) -> Result<Vec<Vec<u8>>, IpcError> {
        let t = std::time::Instant::now();
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
        let statuses = self.exchange(ex, &status)?;
        self.phases.status += t.elapsed();
        local?;
        for (r, s) in statuses.iter().enumerate() {
            if s[0] != 0 {
                let msg = String::from_utf8_lossy(&s[1 + MEM_BYTES..])
                    .trim_end_matches('\0')
                    .to_string();
                return Err(IpcError::Peer { rank: r, msg });
            }
        }
        Ok(statuses)
    }

    /// Rank `t`'s buffer `which` of `bytes` as this process addresses it: `local` for
    /// this rank's own, else the peer's mapping.
    fn at(
        &mut self,
        metas: &[Meta],
        rank: usize,
        t: usize,
        local: DevPtr,
        which: fn(&Meta) -> IpcMem,
        bytes: usize,
    ) -> Result<DevPtr, IpcError> {
        if t == rank {
            Ok(local)
        } else {
            self.open(&which(&metas[t]), bytes as u64)
        }
    }

    /// The ranks whose buffers this rank writes: those on its GPU when it owns the GPU
    /// (the first rank on it), none otherwise.
    fn targets(metas: &[Meta], rank: usize) -> Vec<usize> {
        let gpus: Vec<_> = metas.iter().map(|m| m.gpu).collect();
        if !owners(&gpus).contains(&rank) {
            return vec![];
        }
        (0..metas.len())
            .filter(|&t| metas[t].gpu == metas[rank].gpu)
            .collect()
    }

    /// The work of a call without `keep`: `work(self, t)` for every rank `t` whose buffers
    /// this rank writes ([`Self::targets`]), a wait for the device, and the status
    /// exchange that ends the call.
    fn owners_work(
        &mut self,
        ex: &mut dyn Exchange,
        metas: &[Meta],
        rank: usize,
        mut work: impl FnMut(&mut Self, usize) -> Result<(), IpcError>,
    ) -> Result<(), IpcError> {
        let t = std::time::Instant::now();
        let queued = (|| {
            for target in Self::targets(metas, rank) {
                work(self, target)?;
            }
            Ok(NO_MEM)
        })();
        let local = self.landed(queued);
        self.phases.reduce += t.elapsed();
        self.settle(ex, local).map(drop)
    }

    /// `queued` (the outcome of queuing device work), once that work has run: also after
    /// a failure part-way, so that nothing queued lands after the status exchange lets a
    /// rank return, or after the mappings it uses are released.
    fn landed<T>(&self, queued: Result<T, IpcError>) -> Result<T, IpcError> {
        let done = self.dev.synchronize();
        queued.and_then(|v| done.map(|()| v).map_err(IpcError::from))
    }
}

impl<D: Device> Drop for IpcComm<D> {
    fn drop(&mut self) {
        self.release();
        for (ptr, _) in self.retired.drain(..) {
            // SAFETY: every call synchronizes before it returns; a peer that still maps
            // it (this rank leaves its world) is not waited for.
            unsafe { self.dev.free(ptr) };
        }
        if let Some((ptr, _, _)) = self.scratch.take() {
            // SAFETY: every call synchronizes before it returns.
            unsafe { self.dev.free(ptr) };
        }
        self.free_stage();
    }
}
