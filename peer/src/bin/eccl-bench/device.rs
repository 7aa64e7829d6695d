//! `--device cuda`: the benchmark's buffer on a GPU, all_reduced among the ranks of one
//! host over CUDA IPC (`eccl::device`).

use eccl::{CollArgs, Communicator};
use eccl_cuda::{DevPtr, Device};

/// What `--device` named.
#[derive(Debug, Clone, Copy)]
pub enum DeviceArg {
    /// `cuda`: the rank's GPU is its rank modulo the GPUs present.
    Cuda,
    CudaN(usize),
}

pub fn device_arg(s: &str) -> Result<DeviceArg, String> {
    match s.split_once(':') {
        None if s == "cuda" => Ok(DeviceArg::Cuda),
        Some(("cuda", n)) => n
            .parse()
            .map(DeviceArg::CudaN)
            .map_err(|_| format!("{s:?}: expected cuda or cuda:N")),
        _ => Err(format!("{s:?}: expected cuda or cuda:N")),
    }
}

fn dev_err(e: impl std::fmt::Display) -> eccl::Error {
    eccl::Error::InvalidArgument(format!("device: {e}"))
}

/// A `--device` run's state: the rank's device, its same-host collectives, and the
/// buffer of the size being measured.
pub struct OnDevice {
    ipc: eccl::device::IpcComm<eccl_cuda::CudaDevice>,
    buf: Option<(DevPtr, usize)>,
}

impl OnDevice {
    pub fn open(arg: DeviceArg, rank: usize) -> eccl::Result<OnDevice> {
        let n = eccl_cuda::device_count();
        let ordinal = match arg {
            DeviceArg::CudaN(i) => i,
            DeviceArg::Cuda if n > 0 => rank % n,
            DeviceArg::Cuda => 0,
        };
        let dev = eccl_cuda::CudaDevice::new(ordinal).map_err(dev_err)?;
        Ok(OnDevice {
            ipc: eccl::device::IpcComm::new(std::sync::Arc::new(dev)),
            buf: None,
        })
    }

    pub fn describe(&self) -> String {
        self.ipc.device().describe()
    }

    /// Makes the device buffer hold `input` (allocated at its size on first use).
    pub fn load(&mut self, input: &[u8]) -> eccl::Result<()> {
        let p = match self.buf {
            Some((p, len)) if len == input.len() => p,
            _ => {
                self.release();
                let p = self.ipc.device().alloc(input.len()).map_err(dev_err)?;
                self.buf = Some((p, input.len()));
                p
            }
        };
        // SAFETY: `p` holds `input.len()` bytes, and no call is running on it.
        unsafe { self.ipc.device().upload(p, input) }.map_err(dev_err)
    }

    /// Copies the device buffer into `out` (as long as the buffer).
    pub fn read(&self, out: &mut [u8]) -> eccl::Result<()> {
        let (p, len) = self.buf.ok_or_else(|| dev_err("no buffer loaded"))?;
        // SAFETY: `p` holds `len` bytes; every call synchronized before it returned.
        unsafe { self.ipc.device().download(&mut out[..len], p) }.map_err(dev_err)
    }

    /// One all_reduce of the device buffer, in place; `keep`: G2 (see `IpcComm`).
    pub fn all_reduce(
        &mut self,
        comm: &mut Communicator,
        a: &CollArgs,
        keep: bool,
    ) -> eccl::Result<()> {
        let (buf, _) = self.buf.ok_or_else(|| dev_err("no buffer loaded"))?;
        let rt = tokio::runtime::Handle::current();
        let ipc = &mut self.ipc;
        let call = eccl::device::DeviceCall::AllReduce {
            buf,
            count: a.count,
            dtype: a.dtype,
            op: a.op,
            keep,
        };
        // Over CUDA IPC, or through host memory where the GPUs cannot reach each other,
        // the world spans hosts, or ECCL_CUDA_IPC=0 (the staged pipeline).
        tokio::task::block_in_place(|| {
            // SAFETY: `buf` is a live allocation of `count` elements on this rank's
            // device, used by nothing else during the call.
            unsafe { eccl::device::run(comm, rt, ipc, &call) }
        })
    }

    /// Starts counting the calls' phases afresh.
    pub fn reset_phases(&mut self) {
        self.ipc.phases = Default::default();
    }

    /// Where the calls since `reset_phases` spent their time, one line.
    pub fn phases_line(&self, bytes: usize) -> String {
        let p = self.ipc.phases;
        let us = |x: std::time::Duration| x.as_secs_f64() * 1e6 / p.calls.max(1) as f64;
        format!(
            "# {bytes} B phases (us per call, rank 0): wait+export {:.1}, records {:.1}, \
             map+reduce {:.1}, status {:.1}, copies {:.1}",
            us(p.export),
            us(p.meta),
            us(p.reduce),
            us(p.status),
            us(p.copy)
        )
    }

    /// Frees the device buffer.
    pub fn release(&mut self) {
        if let Some((p, _)) = self.buf.take() {
            // SAFETY: every call synchronized before it returned; nothing uses `p` now.
            unsafe { self.ipc.device().free(p) };
        }
    }
}

impl Drop for OnDevice {
    fn drop(&mut self) {
        self.release();
    }
}
