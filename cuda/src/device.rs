//! The small device interface the same-host collectives run on, and its errors.
//!
//! Device memory is named by its address ([`DevPtr`], what `torch.Tensor.data_ptr()` gives
//! and what the driver calls a `CUdeviceptr`). Every call is ordered on the device's one
//! stream, but for the queued copies between host and device, which run on two copy lanes
//! beside it (a staged pipeline's downloads, its uploads); [`Device::synchronize`] waits
//! for what was queued. Two implementations:
//! [`crate::HostDevice`], host memory, for testing the collectives' logic anywhere, and
//! `CudaDevice` (feature `cuda`), the CUDA driver.

use eccl_protocol::{DType, ReduceOp};

/// A device address.
pub type DevPtr = u64;

/// Bytes of an IPC memory handle (`CUipcMemHandle`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Bytes of a physical GPU's identity (`CUuuid`).
pub const GPU_ID_BYTES: usize = 16;

/// Most GPUs a device names in [`Reach::Only`] (what a record has room for).
pub const MAX_REACH: usize = 16;

/// The physical GPUs whose memory kernels on a device can read and write over IPC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Every GPU (host memory, the test double's default).
    Every,
    /// These (ids as [`Device::gpu_id`]): the device's own, and those the driver grants
    /// peer access from it among the GPUs the process sees; at most [`MAX_REACH`].
    Only(Vec<[u8; GPU_ID_BYTES]>),
}

impl Reach {
    pub fn covers(&self, gpu: &[u8; GPU_ID_BYTES]) -> bool {
        match self {
            Reach::Every => true,
            Reach::Only(ids) => ids.contains(gpu),
        }
    }
}

/// What one process gives another to map a buffer of its own: the handle of the
/// allocation that holds the buffer and where in it the buffer starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IpcMem {
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// The buffer's offset in the allocation.
    pub offset: u64,
    /// The allocation's size, so an importer can check a buffer lies inside it.
    pub alloc_len: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No driver, no device, or no NVRTC on this machine.
    #[error("CUDA is not available here: {0}")]
    Unavailable(String),
    /// A driver call failed.
    #[error("{call} failed: {msg}")]
    Driver { call: &'static str, msg: String },
    /// NVRTC refused the generated kernels (a bug in eccl-cuda, or a too-old NVRTC).
    #[error("the device kernels did not compile: {0}")]
    Compile(String),
    /// A pointer, size or handle that cannot be right.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// A copy queued on one of a device's copy lanes ([`Device::download_queued`],
/// [`Device::upload_queued`]); [`Device::wait_copy`] returns once it and every copy
/// queued on its lane before it are done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyMark {
    /// 0: device to host, 1: host to device.
    pub lane: u8,
    /// The copy's place in its lane, from 1.
    pub seq: u64,
}

/// What the same-host collectives need of a device.
///
/// # Safety (for the `unsafe` methods)
///
/// Pointers must be device memory of this device (or mapped from a peer with
/// [`Device::ipc_open`]) that stays allocated until the queued work is done.
pub trait Device: Send + Sync {
    /// Allocates `bytes` of device memory.
    fn alloc(&self, bytes: usize) -> Result<DevPtr>;
    /// Frees what [`Device::alloc`] returned, after the queued work.
    ///
    /// # Safety
    /// `ptr` came from `alloc` on this device and nothing uses it afterwards.
    unsafe fn free(&self, ptr: DevPtr);
    /// Queues a copy of `bytes` from `src` to `dst`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()>;
    /// Copies host bytes to the device and waits.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<()>;
    /// Copies device bytes to the host and waits.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn download(&self, dst: &mut [u8], src: DevPtr) -> Result<()>;
    /// Queues `outs[k][i] = ins[0][i] op ins[1][i] op ...` for `count` elements, then the
    /// division by `world` when `op` is `avg`.
    ///
    /// # Safety
    /// See the trait; an output may be an input (element by element, read before write).
    unsafe fn reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        ins: &[DevPtr],
        outs: &[DevPtr],
        count: usize,
        world: u32,
    ) -> Result<()>;
    /// Waits for everything queued, on the device's stream and on its copy lanes.
    fn synchronize(&self) -> Result<()>;
    /// Page-locked host memory of `bytes` (at least 1), which the copy lanes move to and
    /// from without the driver staging it (`cuMemHostAlloc`; the host double: plain
    /// memory).
    fn host_alloc(&self, bytes: usize) -> Result<*mut u8>;
    /// Frees what [`Device::host_alloc`] returned.
    ///
    /// # Safety
    /// `ptr` came from `host_alloc` on this device with the same `bytes`, and no copy
    /// that uses it is queued or to come.
    unsafe fn host_free(&self, ptr: *mut u8, bytes: usize);
    /// Queues a copy of `bytes` from the device at `src` to the host at `dst` on the
    /// download lane, which runs beside the device's stream and the upload lane, in
    /// order with the lane's earlier copies. `dst` holds the bytes once
    /// [`Device::wait_copy`] returned for the mark (not before).
    ///
    /// # Safety
    /// See the trait; `dst` is [`Device::host_alloc`] memory of at least `bytes` that
    /// nothing else reads or writes until the mark is waited for.
    unsafe fn download_queued(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<CopyMark>;
    /// Queues a copy of `bytes` from the host at `src` to the device at `dst` on the
    /// upload lane; `src` is read until [`Device::wait_copy`] returned for the mark.
    ///
    /// # Safety
    /// As [`Device::download_queued`], `src` unchanged until the mark is waited for.
    unsafe fn upload_queued(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<CopyMark>;
    /// Waits until the copy `mark` (and its lane's earlier ones) is done.
    fn wait_copy(&self, mark: CopyMark) -> Result<()>;
    /// The handle another process maps `ptr`'s allocation with.
    fn ipc_export(&self, ptr: DevPtr) -> Result<IpcMem>;
    /// Maps a peer's allocation; returns its base address here.
    fn ipc_open(&self, mem: &IpcMem) -> Result<DevPtr>;
    /// Unmaps what [`Device::ipc_open`] returned.
    ///
    /// # Safety
    /// Nothing queued or to come uses the mapping.
    unsafe fn ipc_close(&self, base: DevPtr) -> Result<()>;
    /// The identity of the physical GPU (CUDA's UUID): processes whose devices have the
    /// same id share one GPU, and the collectives then run one kernel per GPU, not one
    /// per process.
    fn gpu_id(&self) -> Result<[u8; GPU_ID_BYTES]>;
    /// The GPUs whose memory this device's kernels reach (its own among them): a world
    /// whose GPUs cannot all reach each other runs its device collectives through host
    /// memory instead (NCCL's fallback from its P2P transport to shared memory).
    fn reach(&self) -> Result<Reach>;
    /// A name for logs and errors (`cuda:0 (NVIDIA H100 80GB HBM3)`, `host`).
    fn describe(&self) -> String;
}
