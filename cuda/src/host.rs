//! [`HostDevice`]: the device interface over host memory, a test double for the logic
//! that runs on devices (chunking, handle exchange and validation, fault paths). It is
//! not a measurement of anything.
//!
//! All "device" memory of every `HostDevice` in the process lives in one table behind a
//! lock, addressed by made-up addresses, so ranks running as threads can export and map
//! each other's buffers as processes do with CUDA IPC, and every access is checked: an
//! address outside an allocation, a handle nobody exported, or a process mapping its own
//! allocation (which CUDA refuses too) is an error rather than a wild write.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use eccl_algorithms::kernels;
use eccl_protocol::{DType, ReduceOp};

use crate::device::{
    CopyMark, DevPtr, Device, DeviceError, IpcMem, Reach, Result, GPU_ID_BYTES, IPC_HANDLE_BYTES,
    MAX_REACH,
};

struct Alloc {
    owner: u64,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Memory {
    allocs: BTreeMap<DevPtr, Alloc>,
    next: DevPtr,
    exported: HashMap<[u8; IPC_HANDLE_BYTES], DevPtr>,
    /// Mappings each device opened (device id → base → count).
    opened: HashMap<u64, HashMap<DevPtr, usize>>,
}

impl Memory {
    /// The allocation holding `[ptr, ptr + len)`: its base.
    fn find(&self, ptr: DevPtr, len: usize) -> Result<DevPtr> {
        let (&base, a) = self
            .allocs
            .range(..=ptr)
            .next_back()
            .ok_or_else(|| bad(ptr, len))?;
        if ptr + len as u64 > base + a.bytes.len() as u64 {
            return Err(bad(ptr, len));
        }
        Ok(base)
    }

    fn read(&self, ptr: DevPtr, len: usize) -> Result<Vec<u8>> {
        let base = self.find(ptr, len)?;
        let off = (ptr - base) as usize;
        Ok(self.allocs[&base].bytes[off..off + len].to_vec())
    }

    fn write(&mut self, ptr: DevPtr, data: &[u8]) -> Result<()> {
        let base = self.find(ptr, data.len())?;
        let off = (ptr - base) as usize;
        let a = self.allocs.get_mut(&base).expect("found above");
        a.bytes[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
}

impl Memory {
    /// Checks that device `dev` may touch `[ptr, ptr + len)` from a kernel or a copy: its
    /// own allocation, or another's that it holds mapped now (CUDA IPC), as a real
    /// device's page tables would: work issued through a mapping closed earlier in the
    /// call is caught here (the double runs copies and kernels when they are issued).
    fn reachable(&self, dev: u64, ptr: DevPtr, len: usize) -> Result<()> {
        let base = self.find(ptr, len)?;
        if self.allocs[&base].owner == dev
            || self
                .opened
                .get(&dev)
                .is_some_and(|m| m.get(&base).is_some_and(|&n| n > 0))
        {
            Ok(())
        } else {
            Err(DeviceError::Invalid(format!(
                "{len} bytes at {ptr:#x}: another process's memory that this one does not \
                 hold mapped (never opened, or closed already)"
            )))
        }
    }
}

fn bad(ptr: DevPtr, len: usize) -> DeviceError {
    DeviceError::Invalid(format!(
        "{len} bytes at {ptr:#x} are not inside one allocation"
    ))
}

fn memory() -> MutexGuard<'static, Memory> {
    static MEM: OnceLock<Mutex<Memory>> = OnceLock::new();
    MEM.get_or_init(|| {
        Mutex::new(Memory {
            next: 0x7f00_0000_0000,
            ..Memory::default()
        })
    })
    .lock()
    .unwrap_or_else(|p| p.into_inner())
}

/// The id of simulated GPU `gpu`.
fn gpu_bytes(gpu: u64) -> [u8; GPU_ID_BYTES] {
    let mut id = [0u8; GPU_ID_BYTES];
    id[..8].copy_from_slice(&gpu.to_le_bytes());
    id[8..].copy_from_slice(b"hostdbl\0");
    id
}

/// Host memory behind the device interface; one per simulated process.
pub struct HostDevice {
    id: u64,
    /// The simulated physical GPU ([`HostDevice::on_gpu`]); its own by default.
    gpu: u64,
    /// The simulated GPUs it reaches (`None`: every one, as host memory does).
    reach: Option<Vec<u32>>,
    reductions: AtomicU64,
    copies: AtomicU64,
    /// Copies queued on the lanes so far.
    queued: AtomicU64,
    /// Queued copies beyond this many fail ([`HostDevice::failing_copies_after`]).
    fail_after: Option<u64>,
    /// Downloads run when queued ([`HostDevice::with_eager_downloads`]).
    eager_downloads: bool,
    /// Exports fail ([`HostDevice::failing_exports`]).
    no_exports: bool,
    /// `synchronize` fails ([`HostDevice::failing_synchronize`]).
    broken: bool,
    lanes: Mutex<Lanes>,
    /// Live [`Device::host_alloc`] memory: address → bytes.
    host: Mutex<HashMap<usize, usize>>,
}

/// The copy lanes. A queued copy runs when its mark (or a later one of its lane) is
/// waited for, or at [`Device::synchronize`]: as late as a real device may run it, so a
/// caller that reads a download's memory before waiting for it, or reuses an upload's
/// before it is done, gets stale bytes here rather than right ones by luck.
#[derive(Default)]
struct Lanes {
    next: [u64; 2],
    pending: [std::collections::VecDeque<(u64, Queued)>; 2],
}

#[derive(Clone, Copy)]
enum Queued {
    Down {
        dst: usize,
        src: DevPtr,
        bytes: usize,
    },
    Up {
        dst: DevPtr,
        src: usize,
        bytes: usize,
    },
}

impl Default for HostDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl HostDevice {
    pub fn new() -> HostDevice {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        HostDevice {
            id,
            gpu: id << 32,
            reach: None,
            reductions: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            fail_after: None,
            eager_downloads: false,
            no_exports: false,
            broken: false,
            lanes: Mutex::new(Lanes::default()),
            host: Mutex::new(HashMap::new()),
        }
    }

    /// This device failing every queued copy after the first `n` (a device fault in
    /// the middle of a staged pipeline).
    pub fn failing_copies_after(mut self, n: u64) -> HostDevice {
        self.fail_after = Some(n);
        self
    }

    /// This device running each download as soon as it is queued (uploads still run
    /// when waited for): the other order a real device may take, in which a download
    /// into a buffer whose upload was not waited for overwrites what the upload reads.
    pub fn with_eager_downloads(mut self) -> HostDevice {
        self.eager_downloads = true;
        self
    }

    /// This device refusing to export its memory over IPC, as CUDA refuses memory that
    /// did not come from `cuMemAlloc` (torch's expandable segments, a `cudaMallocAsync`
    /// pool).
    pub fn failing_exports(mut self) -> HostDevice {
        self.no_exports = true;
        self
    }

    /// This device failing every `synchronize` (a device fault the caller's own work
    /// left behind, reported at the next call).
    pub fn failing_synchronize(mut self) -> HostDevice {
        self.broken = true;
        self
    }

    /// Copies queued on the copy lanes that have not run yet: work a call left behind
    /// when it returned.
    pub fn pending_copies(&self) -> usize {
        let l = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        l.pending[0].len() + l.pending[1].len()
    }

    /// Device allocations of this device that are live now.
    pub fn live_allocations(&self) -> usize {
        memory()
            .allocs
            .values()
            .filter(|a| a.owner == self.id)
            .count()
    }

    /// Host-device copies queued on the copy lanes so far.
    pub fn queued_copies(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    /// Checks that `[ptr, ptr + bytes)` lies in one live `host_alloc` allocation.
    fn check_host(&self, ptr: usize, bytes: usize) -> Result<()> {
        let host = self.host.lock().unwrap_or_else(|p| p.into_inner());
        if host
            .iter()
            .any(|(&base, &len)| ptr >= base && ptr + bytes <= base + len)
        {
            Ok(())
        } else {
            Err(DeviceError::Invalid(format!(
                "{bytes} bytes at host address {ptr:#x} are not inside one host_alloc \
                 allocation"
            )))
        }
    }

    fn queue(&self, lane: u8, copy: Queued) -> Result<CopyMark> {
        let before = self.queued.fetch_add(1, Ordering::Relaxed);
        if self.fail_after.is_some_and(|n| before >= n) {
            return Err(DeviceError::Invalid(format!(
                "{}: a simulated copy failure (copy {})",
                self.describe(),
                before + 1
            )));
        }
        let mut l = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        let i = lane as usize;
        l.next[i] += 1;
        let seq = l.next[i];
        if self.eager_downloads && lane == 0 {
            // In order with the lane's earlier copies, which run first.
            while let Some((_, earlier)) = l.pending[i].pop_front() {
                Self::run_copy(earlier)?;
            }
            Self::run_copy(copy)?;
        } else {
            l.pending[i].push_back((seq, copy));
        }
        Ok(CopyMark { lane, seq })
    }

    /// Runs lane `lane`'s queued copies up to `seq`, in order (the lanes' lock held
    /// throughout, so concurrent waiters cannot run one lane's copies out of order).
    fn run_lane(&self, lane: usize, seq: u64) -> Result<()> {
        let mut l = self.lanes.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let next = match l.pending[lane].front() {
                Some(&(s, _)) if s <= seq => l.pending[lane].pop_front(),
                _ => None,
            };
            let Some((_, copy)) = next else {
                return Ok(());
            };
            Self::run_copy(copy)?;
        }
    }

    fn run_copy(copy: Queued) -> Result<()> {
        match copy {
            Queued::Down { dst, src, bytes } => {
                let data = memory().read(src, bytes)?;
                // SAFETY: `download_queued`'s caller keeps `dst` (checked to lie in
                // a live host allocation) for this copy until its mark is waited for.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, bytes) };
            }
            Queued::Up { dst, src, bytes } => {
                // SAFETY: `upload_queued`'s caller keeps `src` (checked to lie in a
                // live host allocation) unchanged until its mark is waited for.
                let data = unsafe { std::slice::from_raw_parts(src as *const u8, bytes) };
                memory().write(dst, data)?;
            }
        }
        Ok(())
    }

    /// A simulated process on simulated GPU `gpu`: devices made with the same `gpu` share
    /// one GPU, as processes on one CUDA device do.
    pub fn on_gpu(gpu: u32) -> HostDevice {
        HostDevice {
            gpu: gpu as u64,
            ..HostDevice::new()
        }
    }

    /// This device reaching only its own GPU and the simulated GPUs `others` (as GPUs
    /// without peer access between them, or hidden from the process by
    /// `CUDA_VISIBLE_DEVICES`, would).
    pub fn reaching(mut self, others: &[u32]) -> HostDevice {
        self.reach = Some(others.to_vec());
        self
    }

    /// Reduction kernels run on this device so far.
    pub fn reductions(&self) -> u64 {
        self.reductions.load(Ordering::Relaxed)
    }

    /// Device-to-device copies queued on this device so far.
    pub fn copies(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// Peer mappings this device holds open now.
    pub fn open_mappings(&self) -> usize {
        memory()
            .opened
            .get(&self.id)
            .map_or(0, |m| m.values().sum())
    }
}

impl Device for HostDevice {
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        let mut m = memory();
        let base = m.next;
        // 256-byte aligned like cuMemAlloc, with a gap so an overrun never lands in the
        // next allocation.
        m.next += (bytes as u64).div_ceil(256) * 256 + 4096;
        m.allocs.insert(
            base,
            Alloc {
                owner: self.id,
                bytes: vec![0; bytes],
            },
        );
        Ok(base)
    }

    unsafe fn free(&self, ptr: DevPtr) {
        let mut m = memory();
        m.allocs.remove(&ptr);
        m.exported.retain(|_, b| *b != ptr);
    }

    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        let mut m = memory();
        m.reachable(self.id, src, bytes)?;
        m.reachable(self.id, dst, bytes)?;
        let data = m.read(src, bytes)?;
        m.write(dst, &data)
    }

    unsafe fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        memory().write(dst, src)
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        dst.copy_from_slice(&memory().read(src, dst.len())?);
        Ok(())
    }

    unsafe fn reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        ins: &[DevPtr],
        outs: &[DevPtr],
        count: usize,
        world: u32,
    ) -> Result<()> {
        if ins.is_empty() {
            return Err(DeviceError::Invalid("a reduction of no inputs".into()));
        }
        self.reductions.fetch_add(1, Ordering::Relaxed);
        let len = count * dtype.size();
        let mut m = memory();
        for &p in ins.iter().chain(outs) {
            m.reachable(self.id, p, len)?;
        }
        let mut acc = m.read(ins[0], len)?;
        for &p in &ins[1..] {
            kernels::reduce_inplace(dtype, op, &mut acc, &m.read(p, len)?);
        }
        kernels::finalize(dtype, op, &mut acc, world as usize);
        for &p in outs {
            m.write(p, &acc)?;
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        if self.broken {
            return Err(DeviceError::Driver {
                call: "cuCtxSynchronize",
                msg: "an illegal memory access was encountered (the host double's fault)".into(),
            });
        }
        self.run_lane(0, u64::MAX)?;
        self.run_lane(1, u64::MAX)
    }

    fn host_alloc(&self, bytes: usize) -> Result<*mut u8> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), 64)
            .map_err(|e| DeviceError::Invalid(format!("host_alloc of {bytes} bytes: {e}")))?;
        // SAFETY: a layout of non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(DeviceError::Invalid(format!(
                "host_alloc of {bytes} bytes failed"
            )));
        }
        self.host
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(p as usize, bytes.max(1));
        Ok(p)
    }

    unsafe fn host_free(&self, ptr: *mut u8, bytes: usize) {
        let known = self
            .host
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(ptr as usize));
        assert_eq!(
            known,
            Some(bytes.max(1)),
            "host_free of {ptr:?} ({bytes} bytes), which host_alloc did not give"
        );
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), 64).expect("as allocated");
        // SAFETY: allocated by `host_alloc` with this layout (checked above), freed once.
        unsafe { std::alloc::dealloc(ptr, layout) };
    }

    unsafe fn download_queued(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<CopyMark> {
        self.check_host(dst as usize, bytes)?;
        memory().find(src, bytes)?;
        self.queue(
            0,
            Queued::Down {
                dst: dst as usize,
                src,
                bytes,
            },
        )
    }

    unsafe fn upload_queued(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<CopyMark> {
        self.check_host(src as usize, bytes)?;
        memory().find(dst, bytes)?;
        self.queue(
            1,
            Queued::Up {
                dst,
                src: src as usize,
                bytes,
            },
        )
    }

    fn wait_copy(&self, mark: CopyMark) -> Result<()> {
        if mark.lane > 1 {
            return Err(DeviceError::Invalid(format!("no copy lane {}", mark.lane)));
        }
        self.run_lane(mark.lane as usize, mark.seq)
    }

    fn ipc_export(&self, ptr: DevPtr) -> Result<IpcMem> {
        if self.no_exports {
            return Err(DeviceError::Invalid(format!(
                "{}: memory that cannot be exported over IPC (a simulated allocator)",
                self.describe()
            )));
        }
        let mut m = memory();
        let base = m.find(ptr, 0)?;
        let alloc_len = m.allocs[&base].bytes.len() as u64;
        let handle = match m.exported.iter().find(|(_, b)| **b == base) {
            Some((h, _)) => *h,
            None => {
                let mut h = [0u8; IPC_HANDLE_BYTES];
                rand::Rng::fill(&mut rand::thread_rng(), &mut h[..]);
                m.exported.insert(h, base);
                h
            }
        };
        Ok(IpcMem {
            handle,
            offset: ptr - base,
            alloc_len,
        })
    }

    fn ipc_open(&self, mem: &IpcMem) -> Result<DevPtr> {
        let mut m = memory();
        let base = *m
            .exported
            .get(&mem.handle)
            .ok_or_else(|| DeviceError::Invalid("an IPC handle nobody exported".into()))?;
        if m.allocs[&base].owner == self.id {
            return Err(DeviceError::Invalid(
                "a process cannot map its own allocation over IPC".into(),
            ));
        }
        *m.opened
            .entry(self.id)
            .or_default()
            .entry(base)
            .or_default() += 1;
        Ok(base)
    }

    unsafe fn ipc_close(&self, base: DevPtr) -> Result<()> {
        let mut m = memory();
        let mine = m.opened.entry(self.id).or_default();
        match mine.get_mut(&base) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                mine.remove(&base);
            }
            None => {
                return Err(DeviceError::Invalid(format!(
                    "{base:#x} is not a mapping of this device"
                )))
            }
        }
        Ok(())
    }

    fn gpu_id(&self) -> Result<[u8; GPU_ID_BYTES]> {
        Ok(gpu_bytes(self.gpu))
    }

    fn reach(&self) -> Result<Reach> {
        Ok(match &self.reach {
            None => Reach::Every,
            Some(others) => {
                let mut ids = vec![gpu_bytes(self.gpu)];
                ids.extend(others.iter().map(|&g| gpu_bytes(g as u64)));
                ids.truncate(MAX_REACH);
                Reach::Only(ids)
            }
        })
    }

    fn describe(&self) -> String {
        format!("host double #{}", self.id)
    }
}
