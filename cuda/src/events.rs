//! [`EventPool`]: CUDA events recorded on a caller's stream (torch's current stream) and
//! waited for on another thread, so that a collective is ordered after the work the
//! caller queued without blocking the caller.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result, sys};

use crate::device::{DeviceError, Result};
use crate::driver::{drv, load_driver};

/// Events recorded on a caller's stream (torch's current stream) and waited for on
/// another thread (a communicator's task): one pool per device, for every communicator
/// of the process, so a call costs a record and no event creation.
pub struct EventPool {
    ordinal: usize,
    ctx: sys::CUcontext,
    free: Mutex<Vec<usize>>,
}

// SAFETY: the context is a retained primary context, valid on any thread, and the events
// in `free` are driver handles behind a mutex.
unsafe impl Send for EventPool {}
// SAFETY: as above.
unsafe impl Sync for EventPool {}

impl EventPool {
    /// Device `ordinal`'s pool, made on first use (and kept for the life of the process,
    /// as the primary context it retains is).
    pub fn for_device(ordinal: usize) -> Result<&'static EventPool> {
        static POOLS: OnceLock<Mutex<HashMap<usize, &'static EventPool>>> = OnceLock::new();
        let mut pools = POOLS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pools.get(&ordinal) {
            return Ok(p);
        }
        load_driver()?;
        let dev = result::device::get(ordinal as i32).map_err(drv("cuDeviceGet"))?;
        // SAFETY: `dev` is a device handle the driver just gave; the retain is never
        // released (the pool lives as long as the process).
        let ctx =
            unsafe { result::primary_ctx::retain(dev) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let pool: &'static EventPool = Box::leak(Box::new(EventPool {
            ordinal,
            ctx,
            free: Mutex::new(Vec::new()),
        }));
        pools.insert(ordinal, pool);
        Ok(pool)
    }

    /// Records an event on `stream` now: [`RecordedEvent::wait`] returns once the work
    /// queued on `stream` before this call is done.
    ///
    /// # Safety
    /// `stream` is a live stream of this device's primary context (torch's
    /// `torch._C._cuda_getCurrentRawStream(ordinal)`; 0 is the legacy default stream).
    pub unsafe fn record(&'static self, stream: u64) -> Result<RecordedEvent> {
        // The caller's thread keeps the context it had (torch's current device follows
        // it): this one is made current for the record only.
        let before = result::ctx::get_current().map_err(drv("cuCtxGetCurrent"))?;
        let switch = before != Some(self.ctx);
        if switch {
            // SAFETY: `ctx` is retained for the life of the process.
            unsafe { result::ctx::set_current(self.ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        }
        let recorded = (|| {
            let pooled = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let ev = match pooled {
                Some(ev) => ev as sys::CUevent,
                None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(drv("cuEventCreate"))?,
            };
            // SAFETY: `ev` is an event of this context; `stream` as the caller promised.
            if let Err(e) = unsafe { result::event::record(ev, stream as usize as sys::CUstream) } {
                self.free
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(ev as usize);
                return Err(drv("cuEventRecord")(e));
            }
            Ok(RecordedEvent {
                pool: self,
                ev: ev as usize,
            })
        })();
        if switch {
            // SAFETY: what was current on this thread before (a context it holds, or
            // none).
            let _ = unsafe { result::ctx::set_current(before.unwrap_or(std::ptr::null_mut())) };
        }
        recorded
    }
}

/// An event of an [`EventPool`] recorded on a caller's stream; back to the pool when
/// dropped (recording it again later replaces what it waits for).
pub struct RecordedEvent {
    pool: &'static EventPool,
    ev: usize,
}

impl RecordedEvent {
    /// Waits on this thread until the work queued before the record is done: yielding
    /// its core for the first 200 µs (a stream that is nearly done), then in naps of 50
    /// µs, so that a wait through a long backward pass keeps no core spinning.
    pub fn wait(&self) -> Result<()> {
        self.wait_unless(|| false).map(|_| ())
    }

    /// [`Self::wait`], given up once `stop()` says so (asked about once a millisecond
    /// after the first 200 µs): `Ok(true)` when the work is done, `Ok(false)` when given
    /// up. A stream that never drains (a kernel waiting on something that never comes)
    /// then holds the waiting thread only until, say, the call's epoch is aborted.
    pub fn wait_unless(&self, mut stop: impl FnMut() -> bool) -> Result<bool> {
        // SAFETY: the pool's context is retained for the life of the process; this runs
        // on eccl's threads, whose current context nothing else relies on.
        unsafe { result::ctx::set_current(self.pool.ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        let start = std::time::Instant::now();
        let mut naps = 0u32;
        loop {
            // SAFETY: `ev` is a live event of that context, owned by this value.
            match unsafe { sys::cuEventQuery(self.ev as sys::CUevent) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    return Err(DeviceError::Driver {
                        call: "cuEventQuery",
                        msg: format!("{e:?}"),
                    })
                }
            }
            if start.elapsed() < std::time::Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                naps += 1;
                if naps.is_multiple_of(20) && stop() {
                    return Ok(false);
                }
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// The device (`cuda:N`) the event is on.
    pub fn ordinal(&self) -> usize {
        self.pool.ordinal
    }
}

impl Drop for RecordedEvent {
    fn drop(&mut self) {
        self.pool
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.ev);
    }
}
