//! Receive buffers for one stream of a link, reused frame after frame so that the hot
//! path does not allocate.
//!
//! The pool is also the flow control of a stream: its reader task takes a buffer before
//! it reads a payload, so at most `capacity` frames wait unconsumed; beyond that TCP's
//! own window stops the sender. Each stream has its own pool, so a stream whose frames
//! are waiting for a later step can never starve the stream that carries the frame the
//! executor needs now.

use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A buffer aligned to 8 bytes, so a payload of any element type can be viewed as a
/// typed slice without copying.
#[derive(Default)]
pub struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBuf {
    pub fn with_len(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::default();
        b.set_len(len);
        b
    }

    /// Sets the length in bytes, growing the storage if needed (contents unspecified).
    pub fn set_len(&mut self, len: usize) {
        let words = len.div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    pub fn capacity(&self) -> usize {
        self.words.len() * 8
    }
}

pub struct Pool {
    free: Mutex<Vec<AlignedBuf>>,
    permits: Arc<Semaphore>,
    /// Buffers larger than this are not kept after use, so one huge frame does not pin
    /// memory for the life of the link.
    keep_max: usize,
}

impl Pool {
    pub fn new(capacity: usize, keep_max: usize) -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(capacity.max(1))),
            keep_max,
        })
    }

    /// Whether every buffer is on loan (the next [`Pool::get`] waits).
    pub fn is_exhausted(&self) -> bool {
        self.permits.available_permits() == 0
    }

    /// Waits for a free slot, then returns a buffer of `len` bytes.
    pub async fn get(self: &Arc<Self>, len: usize) -> PooledBuf {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("pool semaphore is never closed");
        let mut buf = self
            .free
            .lock()
            .map(|mut f| f.pop())
            .unwrap_or_default()
            .unwrap_or_default();
        buf.set_len(len);
        PooledBuf {
            buf: Some(buf),
            pool: self.clone(),
            _permit: permit,
        }
    }
}

/// A buffer on loan from a [`Pool`]; dropping it returns it.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
}

impl PooledBuf {
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.as_bytes())
    }
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut().map_or(&mut [], |b| b.as_bytes_mut())
    }
    pub fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            if b.capacity() <= self.pool.keep_max {
                if let Ok(mut f) = self.pool.free.lock() {
                    f.push(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn buffers_are_reused_and_bounded() {
        let pool = Pool::new(2, 1 << 20);
        let a = pool.get(100).await;
        let ptr = a.as_bytes().as_ptr();
        let _b = pool.get(10).await;
        // A third buffer waits until one is returned.
        let third = tokio::time::timeout(std::time::Duration::from_millis(50), pool.get(5)).await;
        assert!(third.is_err());
        drop(a);
        let c = pool.get(64).await;
        assert_eq!(c.as_bytes().as_ptr(), ptr);
        assert_eq!(c.len(), 64);
        assert_eq!(c.as_bytes().as_ptr() as usize % 8, 0);
    }
}
