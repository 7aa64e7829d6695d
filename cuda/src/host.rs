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
    DevPtr, Device, DeviceError, IpcMem, Reach, Result, GPU_ID_BYTES, IPC_HANDLE_BYTES, MAX_REACH,
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
        }
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
        Ok(())
    }

    fn ipc_export(&self, ptr: DevPtr) -> Result<IpcMem> {
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
