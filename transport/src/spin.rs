//! How long a thread that would sleep until another thread of this host acts spins
//! first: the wake-up it saves costs tens of microseconds on a VM, the spin costs a core.
//! One policy, set per world from how many of the job's peers share this host, for the
//! shared-memory waits and for a Python `Work.wait()`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Microseconds a plain waiter spins (a shared-memory wait); see [`plan_spin`].
static SPIN_US: AtomicU64 = AtomicU64::new(SPIN_IDLE_CORES_US);
/// Microseconds a yielding waiter spins (a Python `Work.wait()`); see [`plan_spin`].
static YIELDING_SPIN_US: AtomicU64 = AtomicU64::new(SPIN_IDLE_CORES_US);
/// When every local peer can have a core: long enough to catch a peer on another core
/// mid-message (a 1 KiB hop takes a few microseconds; a 1 MiB frame a few dozen).
const SPIN_IDLE_CORES_US: u64 = 100;
/// When local peers outnumber the cores, spinning takes the core from the very peer we
/// wait for: sleep almost at once. A yielding waiter does not spin at all then
/// (measured: even 2 µs of it cost 4 ranks on 2 cores 30 µs a call).
const SPIN_SHARED_CORES_US: u64 = 2;

/// Sets how long waiting sides spin, from how many peers of one job share this host:
/// `ECCL_SHM_SPIN_US` if set (for both kinds of waiter), else long when each can have a
/// core and short (none for a yielding waiter) when they outnumber the cores. The link
/// manager calls it for every world.
pub fn plan_spin(local_peers: usize) {
    let (plain, yielding) = match std::env::var("ECCL_SHM_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(us) => (us.min(100_000), us.min(100_000)),
        None => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if local_peers <= cores {
                (SPIN_IDLE_CORES_US, SPIN_IDLE_CORES_US)
            } else {
                (SPIN_SHARED_CORES_US, 0)
            }
        }
    };
    SPIN_US.store(plain, Ordering::Relaxed);
    YIELDING_SPIN_US.store(yielding, Ordering::Relaxed);
}

/// Spins until `ready()` holds, for at most as long as [`plan_spin`] chose for this
/// host; whether it held. `yielding`: between looks the thread offers its core to any
/// other thread that can run there (`sched_yield`), for a waiter whose own process's
/// threads do the work it waits for (a Python `Work.wait()` waits for eccl's runtime).
pub fn spin_until(ready: impl Fn() -> bool, yielding: bool) -> bool {
    spin_until_within(ready, yielding, Duration::MAX)
}

/// [`spin_until`], for at most `cap` (a waiter on a thread that others share, which must
/// not hold it for as long as a thread of its own may).
pub fn spin_until_within(ready: impl Fn() -> bool, yielding: bool, cap: Duration) -> bool {
    let us = if yielding {
        &YIELDING_SPIN_US
    } else {
        &SPIN_US
    };
    let us = us
        .load(Ordering::Relaxed)
        .min(u64::try_from(cap.as_micros()).unwrap_or(u64::MAX));
    if us == 0 {
        return ready();
    }
    let until = Instant::now() + Duration::from_micros(us);
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= until {
            return ready();
        }
        if yielding {
            std::thread::yield_now();
        }
    }
}
