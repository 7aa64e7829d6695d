//! The shared segment of one shm link: a sealed memfd holding two rings, one per
//! direction, and the raw accessors to it. This crate and `eccl-transport`'s
//! `shm/fds.rs` are the shm transport's `unsafe`; everything above them works with
//! safe views. It is a crate of its own so that Miri checks it without building the
//! transport's dependencies (`cargo +nightly miri test -p eccl-shm`).
//!
//! ```text
//! ring (every part page-aligned):
//!   0                control: head: u64 (frames published, written by the sender)
//!                             reader_waiting: u32, writer_waiting: u32 (own cache lines)
//!   PAGE             NSLOTS descriptors of DESC bytes: header [u8; 64], busy: u32
//!   PAGE + DESCS     NSLOTS slots of slot_bytes each
//! segment = ring 0 (dialer -> acceptor) then ring 1 (acceptor -> dialer)
//! ```
//!
//! The segment is sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`)
//! before the acceptor maps it, and the acceptor checks the seals and the size: a peer
//! cannot make an access beyond the end of the file raise SIGBUS in another process.

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

mod region;
pub use region::Region;

use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// Slots per ring: enough frames in flight to keep a ring pipeline busy, few enough that
/// a world of many local peers does not reserve gigabytes.
pub const NSLOTS: usize = 8;
const PAGE: usize = 4096;
const DESC: usize = 128;
const DESCS: usize = (NSLOTS * DESC).div_ceil(PAGE) * PAGE;

/// Smallest and largest slot: a shared-state chunk must fit (1 MiB), and a frame is at
/// most the protocol's limit.
pub const MIN_SLOT: usize = eccl_protocol::STATE_CHUNK;
pub const MAX_SLOT: usize = eccl_protocol::MAX_FRAME_PAYLOAD;

/// The shape of a segment, which both ends compute from `slot_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub slot_bytes: usize,
}

impl Geometry {
    /// The geometry for slots of `slot_bytes`, if it is a page multiple within bounds.
    pub fn new(slot_bytes: usize) -> Option<Geometry> {
        (slot_bytes.is_multiple_of(PAGE) && (MIN_SLOT..=MAX_SLOT).contains(&slot_bytes))
            .then_some(Geometry { slot_bytes })
    }

    fn ring_bytes(&self) -> usize {
        PAGE + DESCS + NSLOTS * self.slot_bytes
    }

    pub fn segment_bytes(&self) -> usize {
        2 * self.ring_bytes()
    }
}

/// The seals every segment carries before it is shared.
pub fn seals() -> SealFlag {
    SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW
}

/// Seals a segment the caller created, so that nobody can change its size any more.
pub fn seal(fd: &OwnedFd) -> std::io::Result<()> {
    fcntl(
        fd.as_raw_fd(),
        FcntlArg::F_ADD_SEALS(seals() | SealFlag::F_SEAL_SEAL),
    )?;
    Ok(())
}

/// A new memfd of `len` bytes (zeroed), sealed against resizing: what a link's segment
/// and a [`Region`] are made of.
pub fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> std::io::Result<OwnedFd> {
    let fd = nix::sys::memfd::memfd_create(
        name,
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC
            | nix::sys::memfd::MemFdCreateFlag::MFD_ALLOW_SEALING,
    )?;
    nix::unistd::ftruncate(&fd, len as libc::off_t)?;
    seal(&fd)?;
    Ok(fd)
}

/// Checks a segment received from a peer: sealed against resizing, and of the size
/// `geo` needs.
pub fn check(fd: &OwnedFd, geo: Geometry) -> Result<(), String> {
    let got = fcntl(fd.as_raw_fd(), FcntlArg::F_GET_SEALS)
        .map_err(|e| format!("cannot read the segment's seals: {e}"))?;
    if SealFlag::from_bits_truncate(got) & seals() != seals() {
        return Err("the segment is not sealed against resizing".into());
    }
    let st = nix::sys::stat::fstat(fd.as_raw_fd())
        .map_err(|e| format!("cannot stat the segment: {e}"))?;
    if st.st_size as u64 != geo.segment_bytes() as u64 {
        return Err(format!(
            "the segment has {} bytes, {} expected",
            st.st_size,
            geo.segment_bytes()
        ));
    }
    Ok(())
}

/// A segment mapped into this process.
pub struct Mapping {
    base: NonNull<u8>,
    geo: Geometry,
    backing: Backing,
}

/// Where a mapping's memory comes from.
enum Backing {
    /// A shared mapping of a segment's memfd (every real link).
    Shared,
    /// A heap allocation of the same layout, so that the ring protocol can be run under
    /// Miri, which cannot map files (tests only).
    #[cfg(test)]
    Heap(std::alloc::Layout),
}

/// What the receiver of a ring finds at the frame it expects next.
#[derive(Debug)]
pub enum Peek {
    /// Not published yet.
    Empty,
    /// The sender claims more frames than the ring holds: a broken or hostile peer.
    Overrun,
    /// Published: the slot's index and a copy of its header.
    Frame { index: usize, header: [u8; 64] },
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics or
// through slot views whose ownership the ring protocol hands from one side to the other
// (see `Mapping::slot`), so it may be used from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as for Send.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps a segment that `check` accepted (or that this process created and sealed).
    pub fn map(fd: &OwnedFd, geo: Geometry) -> std::io::Result<Mapping> {
        let len = NonZeroUsize::new(geo.segment_bytes()).expect("segments are never empty");
        // SAFETY: a fresh shared mapping of a file whose size equals `len` and cannot
        // change (sealed); nothing else in this process refers to the address yet.
        let base = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd.as_fd(),
                0,
            )
        }?;
        Ok(Mapping {
            base: base.cast(),
            geo,
            backing: Backing::Shared,
        })
    }

    /// A zeroed heap segment of `geo`'s layout, for tests of the ring protocol between
    /// threads (and under Miri).
    #[cfg(test)]
    pub fn heap(geo: Geometry) -> Mapping {
        let layout = std::alloc::Layout::from_size_align(geo.segment_bytes(), PAGE)
            .expect("a segment's size is a page multiple");
        // SAFETY: the layout's size is not zero (a segment holds two rings).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Mapping {
            base,
            geo,
            backing: Backing::Heap(layout),
        }
    }

    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    fn ring(&self, ring: usize) -> *mut u8 {
        debug_assert!(ring < 2);
        // In bounds: ring < 2 and the segment holds two rings.
        self.base
            .as_ptr()
            .wrapping_add((ring & 1) * self.geo.ring_bytes())
    }

    fn atomic_u64(&self, p: *mut u8) -> &AtomicU64 {
        // SAFETY: `p` is an 8-aligned offset inside the live mapping (offsets below are
        // multiples of 64 from a page-aligned base); an AtomicU64 has the layout of a
        // u64 and may be shared with another process, which only touches it atomically.
        unsafe { &*(p as *const AtomicU64) }
    }

    fn atomic_u32(&self, p: *mut u8) -> &AtomicU32 {
        // SAFETY: as in `atomic_u64`, for a 4-aligned offset.
        unsafe { &*(p as *const AtomicU32) }
    }

    /// Frames the sender of `ring` has published.
    pub fn head(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring(ring))
    }

    /// Set by the receiver of `ring` before it sleeps on the data eventfd.
    pub fn reader_waiting(&self, ring: usize) -> &AtomicU32 {
        self.atomic_u32(self.ring(ring).wrapping_add(64))
    }

    /// Set by the sender of `ring` before it sleeps on the space eventfd.
    pub fn writer_waiting(&self, ring: usize) -> &AtomicU32 {
        self.atomic_u32(self.ring(ring).wrapping_add(128))
    }

    fn desc(&self, ring: usize, slot: usize) -> *mut u8 {
        self.ring(ring).wrapping_add(PAGE + (slot % NSLOTS) * DESC)
    }

    /// 1 while the slot holds a published frame the receiver has not released.
    pub fn busy(&self, ring: usize, slot: usize) -> &AtomicU32 {
        self.atomic_u32(self.desc(ring, slot).wrapping_add(64))
    }

    /// Writes a frame header into the descriptor of `slot`.
    ///
    /// # Safety
    /// The caller is the ring's sender and owns the slot (its `busy` is 0): the receiver
    /// reads a descriptor only once its frame is published, so the write races nothing.
    unsafe fn write_header(&self, ring: usize, slot: usize, header: &[u8; 64]) {
        // SAFETY: the descriptor's first 64 bytes are inside the mapping; the caller's
        // promise keeps the receiver from reading them meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), self.desc(ring, slot), 64) }
    }

    /// Reads the frame header of `slot` (a copy: what is decoded cannot change after).
    ///
    /// The caller is the ring's receiver and the frame is published.
    pub fn read_header(&self, ring: usize, slot: usize) -> [u8; 64] {
        let mut h = [0u8; 64];
        // SAFETY: inside the mapping; the sender does not write a published frame's
        // descriptor until the receiver releases it.
        unsafe { std::ptr::copy_nonoverlapping(self.desc(ring, slot), h.as_mut_ptr(), 64) };
        h
    }

    /// The bytes of `slot`.
    ///
    /// # Safety
    /// The caller must own the slot for as long as the slice lives: the ring's sender
    /// while its `busy` is 0, the receiver from taking a published frame until it
    /// releases it. The ring protocol makes these two periods disjoint, so neither side
    /// aliases a slice the other holds. (A peer that broke the protocol could only
    /// scribble on plain bytes of its own frames; it cannot move the bounds.)
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot(&self, ring: usize, slot: usize) -> &mut [u8] {
        let p = self
            .ring(ring)
            .wrapping_add(PAGE + DESCS + (slot % NSLOTS) * self.geo.slot_bytes);
        std::slice::from_raw_parts_mut(p, self.geo.slot_bytes)
    }
}

impl Mapping {
    /// Whether the sender of `ring` may write frame number `next` (its slot is free).
    pub fn slot_free(&self, ring: usize, next: u64) -> bool {
        let index = (next % NSLOTS as u64) as usize;
        // SeqCst (an Acquire too): the sender's re-check after raising `writer_waiting`
        // must not be ordered before that store, or it and the receiver's `release`
        // could each miss the other's write and the sender sleep through a free slot.
        self.busy(ring, index).load(Ordering::SeqCst) == 0
    }

    /// Publishes frame number `next` of `ring` if its slot is free: copies `data` into the
    /// slot and `header` into its descriptor, marks the slot busy and moves the head past
    /// it. Returns false, having touched nothing, while the receiver still holds the slot.
    /// Nothing here blocks or awaits, so a frame is published whole or not at all.
    ///
    /// # Safety
    /// The caller is the only sender of `ring` in this process, `next` counts the frames
    /// it has published, and `data` fits a slot.
    pub unsafe fn try_publish(
        &self,
        ring: usize,
        next: u64,
        header: &[u8; 64],
        data: &[u8],
    ) -> bool {
        let index = (next % NSLOTS as u64) as usize;
        let busy = self.busy(ring, index);
        // Acquire: the receiver's reads of the slot happened before it released it.
        if busy.load(Ordering::Acquire) != 0 {
            return false;
        }
        // SAFETY: `busy` is 0 and this is the ring's only sender, so it owns the slot
        // (see `slot`) until it publishes it below.
        let dst = unsafe { self.slot(ring, index) };
        dst[..data.len()].copy_from_slice(data);
        // SAFETY: as for the slot: this sender owns the descriptor until it publishes.
        unsafe { self.write_header(ring, index, header) };
        busy.store(1, Ordering::Relaxed);
        // Release (SeqCst, paired with the receiver's `reader_waiting` check): the slot
        // and header writes above happen before the receiver sees the new head.
        self.head(ring).store(next + 1, Ordering::SeqCst);
        true
    }

    /// What the receiver of `ring` finds at frame number `next`.
    pub fn peek(&self, ring: usize, next: u64) -> Peek {
        // Acquire: pairs with the head's store in `try_publish`.
        let head = self.head(ring).load(Ordering::Acquire);
        if head <= next {
            return Peek::Empty;
        }
        if head - next > NSLOTS as u64 {
            return Peek::Overrun;
        }
        let index = (next % NSLOTS as u64) as usize;
        Peek::Frame {
            index,
            header: self.read_header(ring, index),
        }
    }

    /// Hands slot `index` of `ring` back to its sender; the receiver must not touch the
    /// slot after this.
    pub fn release(&self, ring: usize, index: usize) {
        // Release (SeqCst, paired with the sender's `writer_waiting` check).
        self.busy(ring, index).store(0, Ordering::SeqCst);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        match self.backing {
            Backing::Shared => {
                let len = self.geo.segment_bytes();
                // SAFETY: the base and length of the mapping made in `map`; no view of it
                // outlives the `Mapping`, which every view holds through an `Arc`.
                if let Err(e) = unsafe { munmap(self.base.cast(), len) } {
                    tracing::warn!(target: "eccl::net", "munmap of a shm segment failed: {e}");
                }
            }
            #[cfg(test)]
            // SAFETY: allocated in `heap` with this layout; no view outlives the mapping.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.base.as_ptr(), layout) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_bounds() {
        assert!(Geometry::new(1 << 20).is_some());
        assert!(Geometry::new(4096).is_none(), "a state chunk must fit");
        assert!(Geometry::new((1 << 20) + 1).is_none(), "whole pages");
        assert!(Geometry::new(128 << 20).is_none());
        let g = Geometry::new(1 << 20).unwrap();
        assert_eq!(g.segment_bytes(), 2 * (4096 + DESCS + NSLOTS * (1 << 20)));
    }

    /// The ring protocol between two threads, as a sender and a receiver in two
    /// processes run it: every frame arrives once, in order, with its bytes. Under Miri
    /// this also checks that the orderings make every slot access race-free (with the
    /// sender's Acquire load of `busy` made Relaxed, Miri reports a data race here).
    #[test]
    fn the_ring_hands_frames_from_one_thread_to_another() {
        let m = std::sync::Arc::new(Mapping::heap(Geometry::new(MIN_SLOT).unwrap()));
        let frames: u64 = if cfg!(miri) { 40 } else { 5000 };
        let body = |n: u64| -> Vec<u8> { (0..n % 97 + 1).map(|i| (n + i) as u8).collect() };
        let sender = {
            let m = m.clone();
            std::thread::spawn(move || {
                for n in 0..frames {
                    let data = body(n);
                    let mut h = [0u8; 64];
                    h[..8].copy_from_slice(&n.to_le_bytes());
                    h[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
                    // SAFETY: this thread is ring 1's only sender, publishing in order;
                    // a frame of at most 97 bytes fits a slot.
                    while !unsafe { m.try_publish(1, n, &h, &data) } {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0;
        while next < frames {
            match m.peek(1, next) {
                Peek::Empty => std::thread::yield_now(),
                Peek::Overrun => panic!("overrun at frame {next}"),
                Peek::Frame { index, header } => {
                    let n = u64::from_le_bytes(header[..8].try_into().unwrap());
                    let len = u64::from_le_bytes(header[8..16].try_into().unwrap()) as usize;
                    assert_eq!(n, next);
                    // SAFETY: the receiver owns a published slot until it releases it.
                    let got = unsafe { &m.slot(1, index)[..len] };
                    assert_eq!(got, &body(n)[..], "frame {n}");
                    m.release(1, index);
                    next += 1;
                }
            }
        }
        sender.join().unwrap();
        assert!(matches!(m.peek(1, next), Peek::Empty));
        // A head moved past what the ring holds is seen as such, not read.
        m.head(0).store(NSLOTS as u64 + 1, Ordering::SeqCst);
        assert!(matches!(m.peek(0, 0), Peek::Overrun));
    }

    fn memfd(len: usize, sealed: bool) -> OwnedFd {
        use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
        let fd = memfd_create(c"t", MemFdCreateFlag::MFD_ALLOW_SEALING).unwrap();
        nix::unistd::ftruncate(&fd, len as libc::off_t).unwrap();
        if sealed {
            seal(&fd).unwrap();
        }
        fd
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot create or map a memfd")]
    fn a_segment_must_be_sealed_and_of_the_right_size() {
        let g = Geometry::new(1 << 20).unwrap();
        assert!(check(&memfd(g.segment_bytes(), true), g).is_ok());
        let e = check(&memfd(g.segment_bytes(), false), g).unwrap_err();
        assert!(e.contains("sealed"), "{e}");
        let e = check(&memfd(g.segment_bytes() - 4096, true), g).unwrap_err();
        assert!(e.contains("bytes"), "{e}");
        // Sealed means sealed: the creator cannot shrink it under a mapping either.
        let fd = memfd(g.segment_bytes(), true);
        assert!(nix::unistd::ftruncate(&fd, 4096).is_err());
        let m = Mapping::map(&fd, g).unwrap();
        m.head(1).store(7, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            Mapping::map(&fd, g)
                .unwrap()
                .head(1)
                .load(std::sync::atomic::Ordering::SeqCst),
            7
        );
    }
}
