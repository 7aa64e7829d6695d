//! eccl's device layer.
//!
//! - [`kernels`]: the reduction kernels as CUDA C, generated from the dtype and operator
//!   tables, with the CPU kernels' exact semantics;
//! - [`Device`]: the small interface the same-host collectives run on, with
//!   [`HostDevice`] (host memory; a test double for the logic) and, with the `cuda`
//!   feature, `CudaDevice` (the CUDA driver through cudarc, loaded at run time, so nothing
//!   CUDA is needed to build and a machine without it gets `DeviceError::Unavailable`);
//! - [`ipc`]: the same-host collectives over memory every rank maps from every other
//!   (its `records`: what the ranks exchange for them);
//! - `events` (feature `cuda`): events recorded on a caller's stream, waited for elsewhere.

pub mod device;
#[cfg(feature = "cuda")]
pub mod driver;
#[cfg(feature = "cuda")]
pub mod events;
pub mod host;
pub mod ipc;
pub mod kernels;

pub use device::{CopyMark, DevPtr, Device, DeviceError, IpcMem, Reach, MAX_REACH};
#[cfg(feature = "cuda")]
pub use driver::{compile, compile_cached, device_count, kernel_cache_dir, load_nvrtc, CudaDevice};
#[cfg(feature = "cuda")]
pub use events::{EventPool, RecordedEvent};
pub use host::HostDevice;
pub use ipc::{Exchange, IpcComm, IpcError, IpcKind};
