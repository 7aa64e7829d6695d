//! [`CudaDevice`]: the device interface over the CUDA driver (cudarc, loaded at run time),
//! and NVRTC compilation of the generated kernels.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::mem::MaybeUninit;
use std::os::unix::fs::DirBuilderExt;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result, sys};
use cudarc::nvrtc;
use eccl_protocol::{DType, ReduceOp};

use crate::device::{
    CopyMark, DevPtr, Device, DeviceError, IpcMem, Reach, Result, GPU_ID_BYTES, IPC_HANDLE_BYTES,
    MAX_REACH,
};
use crate::kernels::{self, MAX_PTRS};

pub(crate) fn drv(call: &'static str) -> impl FnOnce(result::DriverError) -> DeviceError {
    move |e| DeviceError::Driver {
        call,
        msg: format!("{e:?}"),
    }
}

/// Where NVRTC may be when it is not on the loader's path: pip's CUDA wheels (torch pulls
/// them in) and the toolkit's usual homes. `ECCL_NVRTC_LIB` names the file outright.
fn nvrtc_candidates() -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("ECCL_NVRTC_LIB") {
        out.push(p.into());
    }
    let mut dirs: Vec<std::path::PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(std::path::PathBuf::from(v).join("lib"));
        }
    }
    if let Ok(exe) = std::env::current_exe() {
        // A venv's bin/python or a binary in target/: look beside and above it.
        for up in exe.ancestors().skip(1).take(4) {
            dirs.push(up.join("lib"));
            dirs.push(up.join(".venv/lib"));
        }
    }
    dirs.push("/opt/torch/.venv/lib".into());
    for d in dirs {
        let Ok(pys) = std::fs::read_dir(&d) else {
            continue;
        };
        for py in pys.flatten() {
            let nv = py.path().join("site-packages/nvidia");
            for sub in ["cu13/lib", "cuda_nvrtc/lib", "cu12/lib"] {
                let Ok(files) = std::fs::read_dir(nv.join(sub)) else {
                    continue;
                };
                for f in files.flatten() {
                    let name = f.file_name().to_string_lossy().into_owned();
                    if name.starts_with("libnvrtc.so") {
                        out.push(f.path());
                    }
                }
            }
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
    ] {
        out.push(std::path::Path::new(d).join("libnvrtc.so"));
    }
    out
}

/// The UUID of device `ordinal` (the physical GPU, whatever the process calls it).
fn uuid_of(ordinal: usize) -> Result<[u8; GPU_ID_BYTES]> {
    let dev = result::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
    let mut id = MaybeUninit::<sys::CUuuid>::uninit();
    // SAFETY: an out-parameter for a valid device.
    unsafe { sys::cuDeviceGetUuid_v2(id.as_mut_ptr(), dev) }
        .result()
        .map_err(drv("cuDeviceGetUuid"))?;
    // SAFETY: initialized by the successful call above.
    let id = unsafe { id.assume_init() };
    let mut uuid = [0u8; GPU_ID_BYTES];
    for (d, s) in uuid.iter_mut().zip(id.bytes.iter()) {
        *d = *s as u8;
    }
    Ok(uuid)
}

/// Makes NVRTC loadable by cudarc, or says why not.
pub fn load_nvrtc() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        // SAFETY: loading NVRTC runs its initializers, which have no preconditions.
        if unsafe { nvrtc::sys::is_culib_present() } {
            return Ok(());
        }
        let tried = nvrtc_candidates();
        for path in &tried {
            // SAFETY: as above. RTLD_GLOBAL keeps it findable by its soname, which is how
            // cudarc opens it next; the handle is leaked so it stays loaded.
            let lib = unsafe {
                libloading::os::unix::Library::open(
                    Some(path),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            };
            if let Ok(lib) = lib {
                std::mem::forget(lib);
                // SAFETY: as above.
                if unsafe { nvrtc::sys::is_culib_present() } {
                    tracing::info!("eccl-cuda: NVRTC from {}", path.display());
                    return Ok(());
                }
            }
        }
        Err(format!(
            "no libnvrtc found (set ECCL_NVRTC_LIB to its path; tried the loader's path and {} \
             places such as pip's nvidia wheels)",
            tried.len()
        ))
    })
    .clone()
    .map_err(DeviceError::Unavailable)
}

/// NVRTC's flags for the kernels: IEEE semantics, no fast math (see `kernels`).
fn compile_options(arch: &str) -> nvrtc::CompileOptions {
    nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        use_fast_math: Some(false),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("eccl_kernels.cu".into()),
        ..Default::default()
    }
}

/// Compiles every generated kernel to PTX for `arch` (`compute_90`, ...); needs NVRTC but
/// no GPU.
pub fn compile(arch: &str) -> Result<String> {
    load_nvrtc()?;
    let ptx = nvrtc::compile_ptx_with_opts(kernels::source(), compile_options(arch))
        .map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
    Ok(ptx.to_src())
}

/// Where compiled kernels are kept between processes: `ECCL_KERNEL_CACHE` (a folder, or
/// `off`), else `$XDG_CACHE_HOME/eccl/kernels`, else `~/.cache/eccl/kernels`.
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    match std::env::var("ECCL_KERNEL_CACHE") {
        Ok(v) if v == "off" || v == "0" => None,
        Ok(v) if !v.trim().is_empty() => Some(v.into()),
        _ => std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache")))
            .map(|c| c.join("eccl").join("kernels")),
    }
}

/// The cache file of the kernels for `arch`: named by a hash of everything the PTX
/// depends on (the generated source, the flags, the architecture, NVRTC's version), so a
/// change to any of them compiles afresh and nothing is ever invalidated by hand.
fn cache_file(dir: &std::path::Path, arch: &str) -> std::path::PathBuf {
    use std::hash::{Hash, Hasher};
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; NVRTC is loaded (the caller checked).
    let _ = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        kernels::source(),
        format!("{:?}", compile_options(arch)),
        arch,
        major,
        minor,
    )
        .hash(&mut h);
    env!("CARGO_PKG_VERSION").hash(&mut h);
    dir.join(format!("{arch}-{:016x}.ptx", h.finish()))
}

/// [`compile`] through the on-disk cache ([`kernel_cache_dir`]): NVRTC runs once per
/// machine (a few seconds) instead of once per process. A cache that cannot be read or
/// written is only logged; `fresh` skips reading it (a cached PTX the driver refused).
pub fn compile_cached(arch: &str, fresh: bool) -> Result<String> {
    load_nvrtc()?;
    let Some(dir) = kernel_cache_dir() else {
        return compile(arch);
    };
    let file = cache_file(&dir, arch);
    if !fresh {
        if let Ok(ptx) = std::fs::read_to_string(&file) {
            tracing::info!("eccl-cuda: kernels for {arch} from {}", file.display());
            return Ok(ptx);
        }
    }
    let ptx = compile(arch)?;
    // Written whole to a private name, then renamed: a reader sees all of it or nothing.
    let tmp = dir.join(format!(".{}.{}", std::process::id(), arch));
    let stored = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .and_then(|()| std::fs::write(&tmp, &ptx))
        .and_then(|()| std::fs::rename(&tmp, &file));
    match stored {
        Ok(()) => tracing::info!("eccl-cuda: kernels for {arch} cached in {}", file.display()),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            tracing::info!(
                "eccl-cuda: not caching the kernels in {}: {e}",
                dir.display()
            );
        }
    }
    Ok(ptx)
}

pub(crate) fn load_driver() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        // SAFETY: loading libcuda runs its initializers, which have no preconditions.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver (libcuda) on this machine".into());
        }
        result::init().map_err(|e| format!("cuInit: {e:?}"))
    })
    .clone()
    .map_err(DeviceError::Unavailable)
}

/// The number of CUDA devices, 0 without a driver.
pub fn device_count() -> usize {
    if load_driver().is_err() {
        return 0;
    }
    result::device::get_count().map_or(0, |n| n.max(0) as usize)
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Ptrs([u64; MAX_PTRS]);

struct Kernels {
    _module: sys::CUmodule,
    funcs: HashMap<String, sys::CUfunction>,
}

/// One CUDA device through its primary context (the one torch uses), with a stream of
/// its own for eccl's work.
pub struct CudaDevice {
    ordinal: usize,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    name: String,
    uuid: [u8; GPU_ID_BYTES],
    max_blocks: u32,
    arch: String,
    kernels: Mutex<Option<Kernels>>,
    /// What [`Device::reach`] answers, found on first use.
    reach: OnceLock<Reach>,
    /// The copy lanes: downloads, uploads ([`CopyMark::lane`]).
    lanes: [Lane; 2],
}

/// A copy lane: a stream of its own and an event recorded after each copy.
struct Lane {
    stream: sys::CUstream,
    state: Mutex<LaneState>,
}

#[derive(Default)]
struct LaneState {
    /// The last mark given.
    next: u64,
    /// Events of copies not yet waited for, oldest first.
    pending: std::collections::VecDeque<(u64, sys::CUevent)>,
    /// Events to record again.
    free: Vec<sys::CUevent>,
}

impl Lane {
    fn new() -> Result<Lane> {
        Ok(Lane {
            stream: result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(drv("cuStreamCreate"))?,
            state: Mutex::new(LaneState::default()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a copy on the lane (`queue`, given the lane's stream) and records an
    /// event after it: the copy's mark. The lane's lock is held across both, so another
    /// thread's copy cannot come between a copy and its event.
    fn enqueue(
        &self,
        lane: u8,
        queue: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<CopyMark> {
        let mut st = self.state();
        queue(self.stream)?;
        let ev = match st.free.pop() {
            Some(e) => e,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(drv("cuEventCreate"))?,
        };
        // SAFETY: a live event and the lane's live stream, in the current context.
        if let Err(e) = unsafe { result::event::record(ev, self.stream) } {
            st.free.push(ev);
            return Err(drv("cuEventRecord")(e));
        }
        st.next += 1;
        let seq = st.next;
        st.pending.push_back((seq, ev));
        Ok(CopyMark { lane, seq })
    }

    /// Waits for copy `seq` and the lane's earlier copies; their events go back to the
    /// free list.
    fn wait(&self, seq: u64) -> Result<()> {
        let mut st = self.state();
        let mut last = None;
        while st.pending.front().is_some_and(|&(s, _)| s <= seq) {
            let (_, ev) = st.pending.pop_front().expect("a front");
            if let Some(prev) = last.replace(ev) {
                st.free.push(prev);
            }
        }
        let Some(ev) = last else {
            return Ok(()); // waited for already
        };
        // SAFETY: a live event recorded on the lane's stream.
        let r = unsafe { result::event::synchronize(ev) }.map_err(drv("cuEventSynchronize"));
        st.free.push(ev);
        r
    }

    /// Waits for the lane's stream; drops the pending marks (they are done).
    fn synchronize(&self) -> Result<()> {
        // The lock keeps new copies out meanwhile: the marks pending now are done after.
        let mut st = self.state();
        // SAFETY: the lane's live stream.
        unsafe { result::stream::synchronize(self.stream) }.map_err(drv("cuStreamSynchronize"))?;
        let done: Vec<_> = st.pending.drain(..).map(|(_, e)| e).collect();
        st.free.extend(done);
        Ok(())
    }

    /// Waits for the lane and destroys its stream and events (the device's drop).
    fn destroy(&mut self) {
        // SAFETY: the stream and events are the lane's own and are destroyed once, after
        // their work.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.stream);
            let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
            for ev in st
                .free
                .drain(..)
                .chain(st.pending.drain(..).map(|(_, e)| e))
            {
                let _ = result::event::destroy(ev);
            }
        }
    }
}

// SAFETY: the context, stream, module and functions are driver handles, valid on any
// thread once the context is made current there (every method does), and the driver
// serializes concurrent use of them.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the kernel table is behind a mutex.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Opens device `ordinal` (`cuda:N`).
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        load_driver()?;
        let dev = result::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
        // SAFETY: `dev` is a device handle the driver just gave.
        let ctx =
            unsafe { result::primary_ctx::retain(dev) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` is the retained primary context.
        unsafe { result::ctx::set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(drv("cuStreamCreate"))?;
        let attr = |a| {
            // SAFETY: reading an attribute of a valid device.
            unsafe { result::device::get_attribute(dev, a) }.map_err(drv("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute as A;
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let name = result::device::get_name(dev).unwrap_or_else(|_| "?".into());
        let uuid = uuid_of(ordinal)?;
        Ok(CudaDevice {
            ordinal,
            ctx,
            stream,
            name,
            uuid,
            // Eight blocks of 256 threads per multiprocessor keep every SM's load queue
            // full on a streaming kernel; the grid strides over the rest.
            max_blocks: (sms.max(1) as u32) * 8,
            arch: format!("compute_{major}{minor}"),
            kernels: Mutex::new(None),
            reach: OnceLock::new(),
            lanes: [Lane::new()?, Lane::new()?],
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver stream eccl's work on this device is queued on.
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    fn current(&self) -> Result<()> {
        // SAFETY: `ctx` is retained for the life of `self`.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(drv("cuCtxSetCurrent"))
    }

    /// Compiles (first use) and loads the kernels; returns the one for `name`.
    fn kernel(&self, name: &str) -> Result<sys::CUfunction> {
        let mut k = self.kernels.lock().unwrap_or_else(|p| p.into_inner());
        if k.is_none() {
            let t = std::time::Instant::now();
            let load = |ptx: String| -> Result<sys::CUmodule> {
                let image = CString::new(ptx).map_err(|e| DeviceError::Compile(e.to_string()))?;
                // SAFETY: `image` is NUL-terminated PTX (NVRTC's, or the cache's copy of
                // it, which the driver checks like any other).
                unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
                    .map_err(drv("cuModuleLoadData"))
            };
            let module = match load(compile_cached(&self.arch, false)?) {
                Ok(m) => m,
                Err(e) => {
                    // A cached file the driver refuses (damaged by hand): compile afresh.
                    tracing::info!("eccl-cuda: the cached kernels did not load ({e}); compiling");
                    load(compile_cached(&self.arch, true)?)?
                }
            };
            let mut funcs = HashMap::new();
            for (d, o) in kernels::pairs() {
                let n = kernels::kernel_name(d, o);
                let cname = CString::new(n.clone()).expect("no NUL in kernel names");
                // SAFETY: `module` was loaded above and holds every generated kernel.
                let f = unsafe { result::module::get_function(module, cname) }
                    .map_err(drv("cuModuleGetFunction"))?;
                funcs.insert(n, f);
            }
            tracing::info!(
                "eccl-cuda: {} kernels ready for {} in {:?}",
                funcs.len(),
                self.arch,
                t.elapsed()
            );
            *k = Some(Kernels {
                _module: module,
                funcs,
            });
        }
        k.as_ref()
            .and_then(|k| k.funcs.get(name).copied())
            .ok_or_else(|| DeviceError::Invalid(format!("no kernel {name}")))
    }

    /// Times `f` on the stream with events, in milliseconds.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        self.current()?;
        let a = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(drv("cuEventCreate"))?;
        let b = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(drv("cuEventCreate"))?;
        // SAFETY: events and stream are live handles of the current context; the events
        // are destroyed once, whatever `f` returns.
        unsafe {
            let timed = (|| {
                result::event::record(a, self.stream).map_err(drv("cuEventRecord"))?;
                f()?;
                result::event::record(b, self.stream).map_err(drv("cuEventRecord"))?;
                result::event::synchronize(b).map_err(drv("cuEventSynchronize"))?;
                result::event::elapsed(a, b).map_err(drv("cuEventElapsedTime"))
            })();
            let _ = result::event::destroy(a);
            let _ = result::event::destroy(b);
            timed
        }
    }

    /// Page-locked host memory of `bytes` (for staging and the copy-rate check).
    pub fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.current()?;
        // SAFETY: a plain allocation call.
        unsafe { result::malloc_host(bytes, 0) }
            .map(|p| p as *mut u8)
            .map_err(drv("cuMemHostAlloc"))
    }

    /// # Safety
    /// `p` came from [`CudaDevice::alloc_pinned`] and nothing uses it afterwards.
    pub unsafe fn free_pinned(&self, p: *mut u8) {
        let _ = self.current();
        let _ = result::free_host(p as *mut c_void);
    }

    /// Queues a host-to-device copy (`src` pinned for it to run asynchronously).
    ///
    /// # Safety
    /// `src` holds `bytes` and outlives the copy; `dst` as in [`Device`].
    pub unsafe fn queue_h2d(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<()> {
        self.current()?;
        sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, self.stream)
            .result()
            .map_err(drv("cuMemcpyHtoDAsync"))
    }

    /// Queues a device-to-host copy.
    ///
    /// # Safety
    /// `dst` holds `bytes` and outlives the copy; `src` as in [`Device`].
    pub unsafe fn queue_d2h(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<()> {
        self.current()?;
        sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, self.stream)
            .result()
            .map_err(drv("cuMemcpyDtoHAsync"))
    }

    /// Whether this device can map memory of device `other` (always for itself).
    pub fn can_access_peer(&self, other: usize) -> Result<bool> {
        if other == self.ordinal {
            return Ok(true);
        }
        let a = result::device::get(self.ordinal as i32).map_err(drv("cuDeviceGet"))?;
        let b = result::device::get(other as i32).map_err(drv("cuDeviceGet"))?;
        let mut ok = 0;
        // SAFETY: two valid device handles and an out-parameter.
        unsafe { sys::cuDeviceCanAccessPeer(&mut ok, a, b) }
            .result()
            .map_err(drv("cuDeviceCanAccessPeer"))?;
        Ok(ok != 0)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.current().is_ok() {
            // SAFETY: the stream is ours and is destroyed once, after its work.
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
            for lane in &mut self.lanes {
                lane.destroy();
            }
        }
        if let Ok(dev) = result::device::get(self.ordinal as i32) {
            // SAFETY: releases the reference `new` retained.
            let _ = unsafe { result::primary_ctx::release(dev) };
        }
    }
}

impl Device for CudaDevice {
    fn alloc(&self, bytes: usize) -> Result<DevPtr> {
        self.current()?;
        // SAFETY: a plain allocation in the current context.
        unsafe { result::malloc_sync(bytes.max(1)) }.map_err(drv("cuMemAlloc"))
    }

    unsafe fn free(&self, ptr: DevPtr) {
        if self.current().is_ok() {
            // Every stream, the copy lanes too: no queued copy may still use `ptr`.
            let _ = self.synchronize();
            let _ = result::free_sync(ptr);
        }
    }

    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
        self.current()?;
        result::memcpy_dtod_async(dst, src, bytes, self.stream).map_err(drv("cuMemcpyDtoDAsync"))
    }

    unsafe fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.current()?;
        result::memcpy_htod_async(dst, src, self.stream).map_err(drv("cuMemcpyHtoDAsync"))?;
        self.synchronize()
    }

    unsafe fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.current()?;
        result::memcpy_dtoh_async(dst, src, self.stream).map_err(drv("cuMemcpyDtoHAsync"))?;
        self.synchronize()
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
        if ins.is_empty() || ins.len() > MAX_PTRS || outs.len() > MAX_PTRS {
            return Err(DeviceError::Invalid(format!(
                "a reduction takes 1 to {MAX_PTRS} inputs and at most {MAX_PTRS} outputs"
            )));
        }
        if !op.valid_for(dtype) {
            return Err(DeviceError::Invalid(format!(
                "{op:?} is not defined for {dtype}"
            )));
        }
        if count == 0 {
            return Ok(());
        }
        // The context first: a module loads into the thread's current context.
        self.current()?;
        let f = self.kernel(&kernels::kernel_name(dtype, op))?;
        let mut pin = Ptrs([0; MAX_PTRS]);
        pin.0[..ins.len()].copy_from_slice(ins);
        let mut pout = Ptrs([0; MAX_PTRS]);
        pout.0[..outs.len()].copy_from_slice(outs);
        let mut nin = ins.len() as i32;
        let mut nout = outs.len() as i32;
        let mut n = count as u64;
        let mut w: f64 = if op == ReduceOp::Avg {
            world as f64
        } else {
            0.0
        };
        let mut params: [*mut c_void; 6] = [
            &mut pin as *mut Ptrs as *mut c_void,
            &mut nin as *mut i32 as *mut c_void,
            &mut pout as *mut Ptrs as *mut c_void,
            &mut nout as *mut i32 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut w as *mut f64 as *mut c_void,
        ];
        let grid = kernels::grid(dtype, count, self.max_blocks);
        result::launch_kernel(
            f,
            (grid, 1, 1),
            (kernels::BLOCK, 1, 1),
            0,
            self.stream,
            &mut params,
        )
        .map_err(drv("cuLaunchKernel"))
    }

    fn synchronize(&self) -> Result<()> {
        self.current()?;
        // SAFETY: the stream is live for the life of `self`.
        let main =
            unsafe { result::stream::synchronize(self.stream) }.map_err(drv("cuStreamSynchronize"));
        // Every stream is waited for, whatever failed: a caller freeing memory after an
        // error must not have copies still running on a lane.
        let lanes: Vec<_> = self.lanes.iter().map(Lane::synchronize).collect();
        main?;
        lanes.into_iter().collect()
    }

    fn host_alloc(&self, bytes: usize) -> Result<*mut u8> {
        self.current()?;
        // SAFETY: a plain page-locked allocation, portable to every context.
        unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map(|p| p.cast::<u8>())
            .map_err(drv("cuMemHostAlloc"))
    }

    unsafe fn host_free(&self, ptr: *mut u8, _bytes: usize) {
        if self.current().is_ok() {
            let _ = result::free_host(ptr.cast::<c_void>());
        }
    }

    unsafe fn download_queued(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<CopyMark> {
        self.current()?;
        self.lanes[0].enqueue(0, |stream| {
            // SAFETY: the caller's promise for `dst` and `src`; the lane's live stream.
            unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast::<c_void>(), src, bytes, stream) }
                .result()
                .map_err(drv("cuMemcpyDtoHAsync"))
        })
    }

    unsafe fn upload_queued(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<CopyMark> {
        self.current()?;
        self.lanes[1].enqueue(1, |stream| {
            // SAFETY: the caller's promise for `dst` and `src`; the lane's live stream.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast::<c_void>(), bytes, stream) }
                .result()
                .map_err(drv("cuMemcpyHtoDAsync"))
        })
    }

    fn wait_copy(&self, mark: CopyMark) -> Result<()> {
        self.current()?;
        self.lanes
            .get(mark.lane as usize)
            .ok_or_else(|| DeviceError::Invalid(format!("no copy lane {}", mark.lane)))?
            .wait(mark.seq)
    }

    fn ipc_export(&self, ptr: DevPtr) -> Result<IpcMem> {
        self.current()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: out-parameters; the driver checks `ptr`.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(drv("cuMemGetAddressRange"))?;
        // Only cuMemAlloc memory may be exported (not torch's expandable segments, made
        // with cuMemCreate, nor a cudaMallocAsync pool), and cuIpcGetMemHandle is not
        // documented to refuse the others: ask first, as NCCL does. A driver that cannot
        // answer leaves it to cuIpcGetMemHandle.
        let mut capable: u32 = 0;
        // SAFETY: `capable` outlives the call and holds the attribute's value (a boolean
        // the driver writes as an int).
        let asked = unsafe {
            sys::cuPointerGetAttribute(
                (&mut capable as *mut u32).cast::<c_void>(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                ptr,
            )
        };
        if asked == sys::CUresult::CUDA_SUCCESS && capable == 0 {
            return Err(DeviceError::Invalid(
                "the memory is not from cuMemAlloc: CUDA IPC cannot export it".into(),
            ));
        }
        let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: `base` is the start of a live allocation (the driver just said so).
        unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) }
            .result()
            .map_err(drv("cuIpcGetMemHandle"))?;
        // SAFETY: initialized by the successful call above.
        let h = unsafe { h.assume_init() };
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        for (d, s) in handle.iter_mut().zip(h.reserved.iter()) {
            *d = *s as u8;
        }
        Ok(IpcMem {
            handle,
            offset: ptr - base,
            alloc_len: size as u64,
        })
    }

    fn ipc_open(&self, mem: &IpcMem) -> Result<DevPtr> {
        self.current()?;
        // SAFETY: the handle type is plain bytes.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(mem.handle.iter()) {
            *d = *s as _;
        }
        let mut ptr = 0u64;
        // SAFETY: an out-parameter and a handle the driver validates.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(drv("cuIpcOpenMemHandle"))?;
        Ok(ptr)
    }

    unsafe fn ipc_close(&self, base: DevPtr) -> Result<()> {
        self.current()?;
        sys::cuIpcCloseMemHandle(base)
            .result()
            .map_err(drv("cuIpcCloseMemHandle"))
    }

    fn gpu_id(&self) -> Result<[u8; GPU_ID_BYTES]> {
        Ok(self.uuid)
    }

    fn reach(&self) -> Result<Reach> {
        if let Some(r) = self.reach.get() {
            return Ok(r.clone());
        }
        // Every GPU this process sees whose memory kernels here may map (peer access):
        // a GPU hidden by CUDA_VISIBLE_DEVICES is never in the list.
        let mut ids = vec![self.uuid];
        for other in 0..device_count() {
            if other == self.ordinal || ids.len() >= MAX_REACH {
                continue;
            }
            // A GPU the driver cannot answer for is one this device does not reach: the
            // world then goes through host memory rather than failing every call.
            match self.can_access_peer(other).and_then(|ok| {
                if ok {
                    uuid_of(other).map(Some)
                } else {
                    Ok(None)
                }
            }) {
                Ok(Some(id)) => ids.push(id),
                Ok(None) => {}
                Err(e) => tracing::debug!("eccl-cuda: cuda:{other} left out of the reach: {e}"),
            }
        }
        tracing::debug!(
            "eccl-cuda: {} reaches {} GPU(s) of {} visible",
            self.describe(),
            ids.len(),
            device_count()
        );
        Ok(self.reach.get_or_init(|| Reach::Only(ids)).clone())
    }

    fn describe(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.name)
    }
}
