//! Large reductions split over a few threads, for machines whose cores would otherwise sit
//! idle while one core per rank reduces (a 16-core host running two ranks). Elements are
//! independent, so any split gives the same bits as one thread (G3 holds whatever the
//! thread count). One thread, the default, is the plain loop; the peer picks the count
//! when a world forms (`ECCL_REDUCE_THREADS`, or the host's cores over the ranks on it)
//! and calls [`set_threads`].

use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(feature = "parallel")]
use std::sync::{Arc, Mutex, PoisonError};

/// Below this many bytes a reduction stays on the calling thread: handing parts to other
/// threads costs microseconds, a 256 KiB reduction tens of them.
pub const PAR_MIN_BYTES: usize = 256 << 10;

/// Parts start on 64-byte boundaries of the slice: whole elements of every dtype, and
/// no cache line written by two threads.
#[cfg(feature = "parallel")]
const PART_ALIGN: usize = 64;

static THREADS: AtomicUsize = AtomicUsize::new(1);
#[cfg(feature = "parallel")]
static POOL: Mutex<Option<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(None);

/// Sets how many threads one large reduction may use (at least 1). Changing it replaces
/// the pool; reductions running on the old one finish there.
pub fn set_threads(n: usize) {
    THREADS.store(n.max(1), Ordering::Relaxed);
}

/// How many threads one large reduction may use.
pub fn threads() -> usize {
    THREADS.load(Ordering::Relaxed)
}

/// Runs `f` over matching parts of `dst`, `a` and `b` (their common whole-element prefix
/// for elements of `size` bytes) on the reduction threads, when there are several and
/// the reduction is large enough; returns false, having done nothing, otherwise.
pub(super) fn in_parts(
    size: usize,
    dst: &mut [u8],
    a: &[u8],
    b: Option<&[u8]>,
    f: impl Fn(&mut [u8], &[u8], Option<&[u8]>) + Sync,
) -> bool {
    #[cfg(feature = "parallel")]
    {
        let n = dst
            .len()
            .min(a.len())
            .min(b.map_or(usize::MAX, <[u8]>::len))
            / size
            * size;
        if let Some((pool, part)) = plan(n) {
            use rayon::prelude::*;
            let (dst, a) = (&mut dst[..n], &a[..n]);
            let b = b.map(|b| &b[..n]);
            pool.install(|| {
                dst.par_chunks_mut(part)
                    .zip(a.par_chunks(part))
                    .enumerate()
                    .for_each(|(i, (d, x))| f(d, x, b.map(|b| &b[i * part..(i * part + d.len())])))
            });
            return true;
        }
    }
    #[cfg(not(feature = "parallel"))]
    let _ = (size, dst, a, b, f);
    false
}

/// `f` over the `chunk`-byte chunks of `data`, in order: on the reduction threads when
/// there are several and more than one chunk, else on the caller (hashing a shared
/// state's chunks, for one).
pub fn map_chunks<T: Send>(data: &[u8], chunk: usize, f: impl Fn(&[u8]) -> T + Sync) -> Vec<T> {
    #[cfg(feature = "parallel")]
    if threads() > 1 && data.len() > chunk {
        if let Some((pool, _)) = plan(data.len().max(PAR_MIN_BYTES)) {
            use rayon::prelude::*;
            return pool.install(|| data.par_chunks(chunk).map(&f).collect());
        }
    }
    data.chunks(chunk).map(f).collect()
}

/// The pool and part size for a reduction of `bytes`, or `None` to stay on this thread.
#[cfg(feature = "parallel")]
pub(super) fn plan(bytes: usize) -> Option<(Arc<rayon::ThreadPool>, usize)> {
    let threads = threads();
    if threads <= 1 || bytes < PAR_MIN_BYTES {
        return None;
    }
    let parts = threads.min(bytes / (PAR_MIN_BYTES / 2)).max(1);
    let part = bytes.div_ceil(parts).next_multiple_of(PART_ALIGN);
    let mut pool = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    if pool.as_ref().is_none_or(|(n, _)| *n != threads) {
        // A pool that cannot start (no threads left) leaves reductions on the caller.
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("eccl-reduce-{i}"))
            .build()
            .ok()?;
        *pool = Some((threads, Arc::new(built)));
    }
    pool.as_ref().map(|(_, p)| (p.clone(), part))
}
