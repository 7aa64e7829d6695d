//! `eccl._eccl.SharedMemory`: a shared-memory region ([`eccl_shm::Region`]) as Python
//! sees it: a writable buffer (what `torch.frombuffer` makes tensors of, the region then
//! living as long as they do) and counters that other processes of the host update and
//! wait on. The torch backend's `allocate_tensor` places tensors in such regions and its
//! one-sided windows are built of them (`eccl/torch_window.py`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyOSError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::invalid;

#[pyclass(module = "eccl._eccl", frozen, weakref)]
pub(crate) struct SharedMemory {
    /// Always Some until Drop takes it (to the pool or away).
    region: Option<eccl_shm::Region>,
    /// Made here (not opened from a peer) and never told to another process: it may go
    /// back to the pool when dropped.
    poolable: AtomicBool,
}

/// Regions of this process that no tensor uses any more, by size, for the next of the
/// same size: a fresh region costs a page fault per page on first touch, which FSDP2's
/// buffers (allocated anew every step) would pay every step. Regions another process
/// was told of are never pooled (it may still have them mapped).
struct Pool {
    free: HashMap<usize, Vec<eccl_shm::Region>>,
    bytes: usize,
    /// Regions kept (each holds a file descriptor).
    count: usize,
}

/// Most regions the pool keeps, whatever their size: each holds a file descriptor.
const POOL_REGIONS: usize = 256;

/// Most bytes the pool keeps (`ECCL_SHM_POOL_MB`, 1024 by default; 0 turns it off).
fn pool_cap() -> usize {
    static CAP: OnceLock<usize> = OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("ECCL_SHM_POOL_MB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1024)
            .saturating_mul(1 << 20)
    })
}

fn pool() -> MutexGuard<'static, Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        Mutex::new(Pool {
            free: HashMap::new(),
            bytes: 0,
            count: 0,
        })
    })
    .lock()
    .unwrap_or_else(|p| p.into_inner())
}

/// This process's regions that a `SharedMemory` holds now, by base address: where
/// the collectives look up whether a buffer lies in shared memory (`crate::direct`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct OwnRegion {
    pub base: usize,
    pub len: usize,
    pub pid: u32,
    pub fd: i32,
    pub ino: u64,
}

fn live() -> MutexGuard<'static, BTreeMap<usize, OwnRegion>> {
    static LIVE: OnceLock<Mutex<BTreeMap<usize, OwnRegion>>> = OnceLock::new();
    LIVE.get_or_init(|| Mutex::new(BTreeMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// The live region of this process holding `len` bytes at `addr`, and their offset in it
/// (never one a forked child inherited: its descriptor names the parent's file).
pub(crate) fn find_own(addr: usize, len: usize) -> Option<(OwnRegion, usize)> {
    let live = live();
    let (_, r) = live.range(..=addr).next_back()?;
    let end = addr.checked_add(len)?;
    (end <= r.base + r.len && r.pid == std::process::id()).then_some((*r, addr - r.base))
}

/// Other processes' regions this process mapped for the collectives, by (pid, fd): a
/// descriptor announced with another inode than the mapping's names a new file (the
/// owner closed the old one), and replaces it. Each mapping holds the peer's pages, so
/// the least recently used go first beyond [`PEER_MAPPINGS`] or the pool's byte cap.
struct PeerMaps {
    by_key: HashMap<(u32, i32), Arc<eccl_shm::Region>>,
    /// Least recently used first.
    order: VecDeque<(u32, i32)>,
    bytes: usize,
    /// (pid, inode) of regions that could not be mapped: not tried again.
    failed: std::collections::HashSet<(u32, u64)>,
}

const PEER_MAPPINGS: usize = 64;

/// Process `pid`'s region announced as descriptor `fd` with inode `ino`, at least `len`
/// bytes, mapped here (once; later calls reuse the mapping).
pub(crate) fn peer_region(
    pid: u32,
    fd: i32,
    len: usize,
    ino: u64,
) -> Result<Arc<eccl_shm::Region>, String> {
    static MAPS: OnceLock<Mutex<PeerMaps>> = OnceLock::new();
    let maps = MAPS.get_or_init(|| {
        Mutex::new(PeerMaps {
            by_key: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            failed: std::collections::HashSet::new(),
        })
    });
    let key = (pid, fd);
    {
        let mut m = maps.lock().unwrap_or_else(|p| p.into_inner());
        if m.failed.contains(&(pid, ino)) {
            return Err(format!(
                "process {pid}'s region {ino} could not be mapped before"
            ));
        }
        if let Some(r) = m
            .by_key
            .get(&key)
            .filter(|r| r.ino() == ino && r.len() >= len)
        {
            let r = r.clone();
            m.order.retain(|k| *k != key);
            m.order.push_back(key);
            return Ok(r);
        }
    }
    let region = match eccl_shm::Region::open_checked(pid, fd, len, ino) {
        Ok(r) => Arc::new(r),
        Err(e) => {
            tracing::info!(target: "eccl::coll", "shared collectives: {e}; calls with this buffer go over the links");
            let mut m = maps.lock().unwrap_or_else(|p| p.into_inner());
            if m.failed.len() < 4096 {
                m.failed.insert((pid, ino));
            }
            return Err(e);
        }
    };
    let mut m = maps.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(old) = m.by_key.insert(key, region.clone()) {
        m.bytes -= old.len();
        m.order.retain(|k| *k != key);
    }
    m.bytes += region.len();
    m.order.push_back(key);
    let cap = pool_cap().max(region.len());
    while m.order.len() > PEER_MAPPINGS || m.bytes > cap {
        let Some(old) = m.order.pop_front() else {
            break;
        };
        if let Some(r) = m.by_key.remove(&old) {
            m.bytes -= r.len();
        }
    }
    Ok(region)
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        let Some(region) = self.region.take() else {
            return;
        };
        {
            let mut live = live();
            let base = region.base() as usize;
            if live.get(&base).is_some_and(|r| r.ino == region.ino()) {
                live.remove(&base);
            }
        }
        if !self.poolable.load(Ordering::Acquire) || region.pid() != std::process::id() {
            return;
        }
        let mut p = pool();
        if p.bytes + region.len() <= pool_cap() && p.count < POOL_REGIONS {
            p.bytes += region.len();
            p.count += 1;
            p.free.entry(region.len()).or_default().push(region);
        }
    }
}

impl SharedMemory {
    fn region(&self) -> &eccl_shm::Region {
        self.region
            .as_ref()
            .expect("a SharedMemory holds its region until dropped")
    }

    fn counter(&self, offset: usize) -> PyResult<&AtomicU64> {
        self.region().counter(offset).ok_or_else(|| {
            invalid(format!(
                "no counter at byte {offset} of a region of {} bytes (8-aligned, inside)",
                self.region().len()
            ))
        })
    }
}

#[pymethods]
impl SharedMemory {
    /// A region of at least `nbytes` bytes (whole pages) of this process: one that a
    /// dropped `SharedMemory` of the same size left in the pool (its bytes as they were:
    /// uninitialized, as `torch.empty`'s), else a new zeroed one (`OSError` where the
    /// system has no memory or descriptors left).
    #[new]
    fn new(nbytes: usize) -> PyResult<Self> {
        let len = nbytes.max(1).div_ceil(4096) * 4096;
        let pooled = {
            let mut p = pool();
            let mut got = None;
            while let Some(region) = p.free.get_mut(&len).and_then(|v| v.pop()) {
                p.bytes -= len;
                p.count -= 1;
                // A forked child inherits its parent's pool, whose pages it shares with
                // the parent: those are dropped (unmapped here), never handed out.
                if region.pid() == std::process::id() {
                    got = Some(region);
                    break;
                }
            }
            got
        };
        let region = match pooled {
            Some(region) => region,
            None => eccl_shm::Region::create(nbytes).map_err(|e| {
                PyOSError::new_err(format!("cannot make {nbytes} bytes of shared memory: {e}"))
            })?,
        };
        live().insert(
            region.base() as usize,
            OwnRegion {
                base: region.base() as usize,
                len: region.len(),
                pid: region.pid(),
                fd: region.fd(),
                ino: region.ino(),
            },
        );
        Ok(SharedMemory {
            region: Some(region),
            poolable: AtomicBool::new(true),
        })
    }

    /// Maps `nbytes` of the region that process `pid` holds as descriptor `fd` (its
    /// `pid` and `fd`, told over an authenticated link).
    #[staticmethod]
    fn open(pid: u32, fd: i32, nbytes: usize) -> PyResult<Self> {
        let region = eccl_shm::Region::open(pid, fd, nbytes).map_err(invalid)?;
        Ok(SharedMemory {
            region: Some(region),
            poolable: AtomicBool::new(false),
        })
    }

    /// Marks this region as told to another process: it is unmapped when dropped, never
    /// handed out again (the other process may still have it mapped).
    fn share(&self) {
        self.poolable.store(false, Ordering::Release);
    }

    /// The process another process opens this region by, with `fd`.
    #[getter]
    fn pid(&self) -> u32 {
        self.region().pid()
    }

    #[getter]
    fn fd(&self) -> i32 {
        self.region().fd()
    }

    /// Bytes mapped.
    #[getter]
    fn nbytes(&self) -> usize {
        self.region().len()
    }

    /// The mapping's address in this process (what a tensor's `data_ptr()` is compared
    /// with to find the region holding it).
    #[getter]
    fn address(&self) -> u64 {
        self.region().base() as u64
    }

    /// Stores `value` in the counter at byte `offset`, after every write this thread made
    /// before (a release).
    fn store(&self, offset: usize, value: u64) -> PyResult<()> {
        self.counter(offset)?.store(value, Ordering::Release);
        Ok(())
    }

    /// Adds `value` to the counter at byte `offset` after every write this thread made
    /// before (a release, atomic: threads adding at once each count); returns the sum.
    fn add(&self, offset: usize, value: u64) -> PyResult<u64> {
        Ok(self
            .counter(offset)?
            .fetch_add(value, Ordering::AcqRel)
            .wrapping_add(value))
    }

    /// The counter at byte `offset`; what was written before the store of that value is
    /// visible after (an acquire).
    fn load(&self, offset: usize) -> PyResult<u64> {
        Ok(self.counter(offset)?.load(Ordering::Acquire))
    }

    /// Waits, the GIL released, until the counter at byte `offset` is at least `value`
    /// or `timeout_s` seconds have passed; returns the counter as last read (an acquire).
    /// Spins briefly where the host has cores to spare, then sleeps in steps of at most
    /// a millisecond.
    fn wait_at_least(
        &self,
        py: Python<'_>,
        offset: usize,
        value: u64,
        timeout_s: f64,
    ) -> PyResult<u64> {
        let counter = self.counter(offset)?;
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::MAX);
        Ok(py.detach(|| {
            let ready = || counter.load(Ordering::Acquire) >= value;
            if eccl::spin_until_within(ready, true, timeout.min(Duration::from_micros(50))) {
                return counter.load(Ordering::Acquire);
            }
            let start = Instant::now();
            let mut step = Duration::from_micros(20);
            loop {
                let now = counter.load(Ordering::Acquire);
                let waited = start.elapsed();
                if now >= value || waited >= timeout {
                    return now;
                }
                std::thread::sleep(step.min(timeout - waited));
                step = (step * 2).min(Duration::from_millis(1));
            }
        }))
    }

    /// The region's bytes as a writable buffer.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (base, len) = (slf.get().region().base(), slf.get().region().len());
        // SAFETY: `view` is the buffer Python asks this object to fill; the memory is
        // the region's live mapping, which the view keeps alive through `obj` (FillInfo
        // takes a reference to `slf`), and shared memory is writable by design.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                base as *mut c_void,
                len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __repr__(&self) -> String {
        format!(
            "SharedMemory(pid={}, fd={}, nbytes={})",
            self.region().pid(),
            self.region().fd(),
            self.region().len()
        )
    }
}
