//! [`Region`]: host memory that the processes of one host share, for what eccl places in
//! shared memory outside its links (the torch backend's `allocate_tensor` and its
//! one-sided windows). A region is a sealed memfd of any size, mapped read-write; another
//! process of the same user maps it through `/proc/<pid>/fd/<fd>` once told those two
//! numbers over an authenticated link, so nothing is left in `/dev/shm` when the
//! processes end and nobody who was not told can find it by name. Sealed against
//! shrinking and growing before anyone is told, and checked when opened: a peer cannot
//! make an access beyond the end of the file raise SIGBUS in another process.

use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use nix::sys::stat::Mode;

/// A mapped shared-memory region: this process's own, or a peer's opened by pid and fd.
pub struct Region {
    base: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    /// The process whose descriptor names the region (this one for an own region).
    pid: u32,
    /// The file's inode: two live regions never share one, so a peer that opens
    /// `/proc/<pid>/fd/<fd>` can tell whether it found the region it was told of (a
    /// descriptor closed and reused meanwhile names another).
    ino: u64,
}

// SAFETY: the mapping is plain shared memory that lives as long as the `Region`; what is
// written where is up to the users of `base`, which take their own care (counters go
// through atomics), so the handle itself may move and be shared between threads.
unsafe impl Send for Region {}
// SAFETY: as for Send.
unsafe impl Sync for Region {}

fn map(fd: &OwnedFd, len: usize) -> std::io::Result<NonNull<u8>> {
    let n = NonZeroUsize::new(len)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "an empty region"))?;
    // SAFETY: a fresh shared mapping of `len` bytes of a file sealed against shrinking
    // whose size is at least `len` (checked by both callers); nothing in this process
    // refers to the address yet.
    let base = unsafe {
        mmap(
            None,
            n,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd.as_fd(),
            0,
        )
    }?;
    Ok(base.cast())
}

impl Region {
    /// A new zeroed region of `len` bytes (rounded up to whole pages in the file).
    pub fn create(len: usize) -> std::io::Result<Region> {
        let file_len = len.max(1).div_ceil(4096) * 4096;
        let fd = crate::sealed_memfd(c"eccl-region", file_len)?;
        let ino = nix::sys::stat::fstat(fd.as_raw_fd())?.st_ino;
        let base = map(&fd, file_len)?;
        Ok(Region {
            base,
            len: file_len,
            fd,
            pid: std::process::id(),
            ino,
        })
    }

    /// Maps `len` bytes of the region that process `pid` holds as descriptor `fd`
    /// (what its [`Region::pid`] and [`Region::fd`] said). The file must be sealed
    /// against resizing and hold at least `len` bytes.
    pub fn open(pid: u32, fd: i32, len: usize) -> Result<Region, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let raw = nix::fcntl::open(
            path.as_str(),
            OFlag::O_RDWR | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| format!("cannot open {path} (process {pid}'s shared memory): {e}"))?;
        // SAFETY: `open` returned a descriptor that nothing else owns.
        let file: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) };
        let got = fcntl(file.as_raw_fd(), FcntlArg::F_GET_SEALS)
            .map_err(|e| format!("{path} is not eccl shared memory (no seals: {e})"))?;
        if SealFlag::from_bits_truncate(got) & crate::seals() != crate::seals() {
            return Err(format!("{path} is not sealed against resizing"));
        }
        let st = nix::sys::stat::fstat(file.as_raw_fd())
            .map_err(|e| format!("cannot stat {path}: {e}"))?;
        if (st.st_size as u64) < len as u64 {
            return Err(format!("{path} holds {} bytes, {len} expected", st.st_size));
        }
        let base = map(&file, len).map_err(|e| format!("cannot map {path}: {e}"))?;
        Ok(Region {
            base,
            len,
            fd: file,
            pid,
            ino: st.st_ino,
        })
    }

    /// [`Region::open`], refusing a file other than the one whose inode is `ino`.
    pub fn open_checked(pid: u32, fd: i32, len: usize, ino: u64) -> Result<Region, String> {
        let r = Region::open(pid, fd, len)?;
        if r.ino != ino {
            return Err(format!(
                "/proc/{pid}/fd/{fd} is no longer the region it was (inode {} where {ino} \
                 was announced)",
                r.ino
            ));
        }
        Ok(r)
    }

    /// The file's inode (see the field).
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// The mapping's first byte in this process.
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a region has at least one page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The descriptor another process opens the region by, with [`Region::pid`]; for an
    /// opened region, this process's own descriptor of it.
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// The process that created the region (or, for an opened one, whose descriptor it
    /// was opened by).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The 8-byte counter at `offset`, which several processes may read and write at
    /// once (atomically); None where `offset` is not 8-aligned or not inside the region.
    pub fn counter(&self, offset: usize) -> Option<&AtomicU64> {
        if !offset.is_multiple_of(8) || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: an 8-aligned offset (the base is page-aligned) with 8 bytes inside the
        // live mapping, which lives as long as `&self`; an AtomicU64 has the layout of a
        // u64, and memory shared with another process is only ever touched atomically at
        // a counter's offset by eccl's users of it.
        Some(unsafe { &*(self.base.as_ptr().add(offset) as *const AtomicU64) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the base and length of the mapping made in `create` or `open`; the
        // users of `base` hold the `Region` for as long as they use it.
        if let Err(e) = unsafe { munmap(self.base.cast(), self.len) } {
            tracing::warn!(target: "eccl::net", "munmap of a shared region failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot make or map a memfd")]
    fn a_region_opened_by_pid_and_fd_shares_its_bytes_and_counters() {
        let own = Region::create(10_000).unwrap();
        assert_eq!(own.len(), 12_288, "whole pages");
        let peer = Region::open(own.pid(), own.fd(), own.len()).unwrap();
        // SAFETY: both views are inside the mappings, which live until the end.
        unsafe { *own.base().add(5000) = 42 };
        assert_eq!(unsafe { *peer.base().add(5000) }, 42);
        own.counter(64).unwrap().store(7, Ordering::Release);
        assert_eq!(peer.ino(), own.ino());
        assert!(Region::open_checked(own.pid(), own.fd(), 4096, own.ino()).is_ok());
        let e = Region::open_checked(own.pid(), own.fd(), 4096, own.ino() + 1)
            .err()
            .unwrap();
        assert!(e.contains("no longer the region"), "{e}");
        assert_eq!(peer.counter(64).unwrap().load(Ordering::Acquire), 7);
        assert!(own.counter(3).is_none(), "unaligned");
        assert!(own.counter(12_288 - 4).is_none(), "past the end");
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot make or map a memfd")]
    fn opening_more_than_the_region_holds_or_no_region_is_refused() {
        let own = Region::create(4096).unwrap();
        let e = Region::open(own.pid(), own.fd(), 8192).err().unwrap();
        assert!(e.contains("4096 bytes, 8192 expected"), "{e}");
        let e = Region::open(own.pid(), 1_000_000, 4096).err().unwrap();
        assert!(e.contains("cannot open"), "{e}");
        // A descriptor that is no sealed memfd (this process's standard input or a file).
        let f = std::fs::File::open("/proc/self/status").unwrap();
        let e = Region::open(std::process::id(), f.as_raw_fd(), 1)
            .err()
            .unwrap();
        assert!(
            e.contains("not eccl shared memory") || e.contains("not sealed"),
            "{e}"
        );
    }
}
