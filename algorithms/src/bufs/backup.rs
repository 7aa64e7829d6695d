//! Keeping the caller's buffer as it was (G2) while a schedule works in it: each output
//! byte is saved just before its first write, and put back unless the call succeeds.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use super::{Bufs, Result, Side};
use crate::{Buf, BuildError, Region};

/// A copy of the output as it was when the call started, made piece by piece just before
/// each piece's first write (when the data is about to be read anyway: a receive-reduce
/// in place reads its piece from the cache afterwards), and put back when a [`Kept`] is
/// dropped without [`Kept::keep_result`]: an in-place call that fails, or that is dropped
/// half-way, leaves the caller's buffer as it was (G2) without working in scratch and
/// copying the whole result back on success.
pub(super) struct Backup {
    ptr: *mut u8,
    len: usize,
    /// Byte ranges of the output saved so far: start -> end, disjoint.
    saved: Mutex<BTreeMap<usize, usize>>,
}

// SAFETY: the backup's bytes are written only by `save`, each range once by the caller
// that marked it saved under the lock (so threads never write the same bytes), and read
// only by `Bufs::restore` through `&mut`; plain bytes that any thread may touch.
unsafe impl Send for Backup {}
// SAFETY: as for Send.
unsafe impl Sync for Backup {}

impl Backup {
    /// Saves the parts of output bytes `at..at + cur.len()` that were not saved before;
    /// `cur` is that memory as it is now.
    fn save(&self, at: usize, cur: &[u8]) {
        let end = at + cur.len();
        assert!(end <= self.len, "a write past the output's backup");
        let gaps = {
            let mut saved = self.saved.lock().unwrap_or_else(|e| e.into_inner());
            let gaps = gaps(&saved, at..end);
            for g in &gaps {
                insert(&mut saved, g.clone());
            }
            gaps
        };
        for g in gaps {
            let src = &cur[g.start - at..g.end - at];
            // SAFETY: `ptr` is a live allocation of `len` bytes that only this `Backup`
            // writes (it borrows it mutably for its whole life); `g` lies within it
            // (asserted above), and each byte is written once, by the caller that marked
            // it saved under the lock, so no two writes overlap.
            unsafe { copy_streaming(src, self.ptr.add(g.start)) };
        }
    }
}

/// Copies `src` to `dst` with stores that bypass the cache where the CPU has them: a
/// backup is read back only when a call fails, so it should neither evict the data the
/// call is working on nor cost a read of each line it overwrites.
///
/// # Safety
/// `dst` is valid for `src.len()` bytes of writes and does not overlap `src`.
unsafe fn copy_streaming(src: &[u8], dst: *mut u8) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        if src.len() >= 4096 {
            // Up to the first 16-byte boundary of `dst`, then whole 16-byte blocks, then
            // the tail.
            let head = dst.align_offset(16).min(src.len());
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
            let blocks = (src.len() - head) / 16;
            let (s, d) = (src.as_ptr().add(head), dst.add(head));
            for i in 0..blocks {
                // SAFETY (of the block): `d + 16 i` is 16-byte aligned and within `dst`'s
                // `len` bytes, `s + 16 i` within `src` (unaligned loads); SSE2 is part of
                // every x86_64 CPU.
                let v = _mm_loadu_si128(s.add(16 * i) as *const __m128i);
                _mm_stream_si128(d.add(16 * i) as *mut __m128i, v);
            }
            let done = head + 16 * blocks;
            std::ptr::copy_nonoverlapping(src.as_ptr().add(done), dst.add(done), src.len() - done);
            // Streaming stores are weakly ordered: make them visible before anything that
            // follows (a restore on another thread takes the lock after this).
            _mm_sfence();
            return;
        }
    }
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}

/// The parts of `r` that `set` does not cover.
fn gaps(set: &BTreeMap<usize, usize>, r: Range<usize>) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut pos = r.start;
    if let Some((_, &e)) = set.range(..=r.start).next_back() {
        pos = pos.max(e);
    }
    for (&s, &e) in set.range(r.start..r.end) {
        if pos >= r.end {
            break;
        }
        if s > pos {
            out.push(pos..s);
        }
        pos = pos.max(e);
    }
    if pos < r.end {
        out.push(pos..r.end);
    }
    out
}

/// Adds `g` (disjoint from what `set` holds) and joins it to the ranges it touches.
fn insert(set: &mut BTreeMap<usize, usize>, g: Range<usize>) {
    if g.is_empty() {
        return;
    }
    let (mut start, mut end) = (g.start, g.end);
    if let Some((&s, &e)) = set.range(..start).next_back() {
        if e == start {
            set.remove(&s);
            start = s;
        }
    }
    if let Some(e) = set.remove(&end) {
        end = e;
    }
    set.insert(start, end);
}

/// Where a primitive's written slice lies in the output, when the output is backed up.
#[derive(Clone, Copy)]
pub struct Keep<'a>(Option<(&'a Backup, usize)>);

impl Keep<'_> {
    /// A slice whose writes are not saved (scratch, or an output nobody keeps).
    pub const NONE: Keep<'static> = Keep(None);

    /// Saves `cur`, the bytes at `off` of this slice, before they are written.
    pub(super) fn save(&self, off: usize, cur: &[u8]) {
        if let Some((b, at)) = self.0 {
            b.save(at + off, cur);
        }
    }
}

impl Bufs {
    /// Like [`Bufs::new`], and the output is left as it was unless the call ends with
    /// [`Kept::keep_result`]: each output byte is copied to `backup` just before its
    /// first write, and dropping the [`Kept`] copies back what was saved. `backup` must be
    /// at least as long as `output`.
    pub fn keeping<'b>(
        input: &'b [u8],
        output: &'b mut [u8],
        scratch: &'b mut [u8],
        elem: usize,
        backup: &'b mut [u8],
    ) -> Result<Kept<'b>> {
        if backup.len() < output.len() {
            return Err(BuildError::InvalidArgument(format!(
                "a backup of {} bytes for an output of {}",
                backup.len(),
                output.len()
            )));
        }
        let mut bufs = Bufs::new(input, output, scratch, elem);
        bufs.backup = Some(Backup {
            ptr: backup.as_mut_ptr(),
            len: output.len(),
            saved: Mutex::new(BTreeMap::new()),
        });
        Ok(Kept {
            bufs,
            _borrows: std::marker::PhantomData,
        })
    }

    pub(super) fn keep(&self, r: &Region) -> Keep<'_> {
        match (&self.backup, r.buf) {
            (Some(b), Buf::Output) => Keep(Some((b, r.offset * self.elem))),
            _ => Keep(None),
        }
    }

    /// Bytes of the output saved so far (for tests and the debug log).
    pub fn saved_bytes(&self) -> usize {
        self.backup.as_ref().map_or(0, |b| {
            let s = b.saved.lock().unwrap_or_else(|e| e.into_inner());
            s.iter().map(|(s, e)| e - s).sum()
        })
    }

    /// Puts back every saved byte of the output.
    fn restore(&mut self) {
        let Some(b) = self.backup.take() else { return };
        let Side::Whole { ptr: output, .. } = self.output else {
            unreachable!("only `keeping` sets a backup, and on a whole output")
        };
        let saved = b.saved.into_inner().unwrap_or_else(|e| e.into_inner());
        for (s, e) in saved {
            // SAFETY: `&mut self`: no slice of the buffers is alive; the backup and the
            // output are live allocations (borrowed for the `Kept`'s life) of at least
            // `b.len` bytes, `s..e` lies within it (checked when saved), and they are
            // different allocations.
            unsafe { std::ptr::copy_nonoverlapping(b.ptr.add(s), output.add(s), e - s) };
        }
    }
}

/// A [`Bufs`] whose output is put back as it was when dropped, unless
/// [`Kept::keep_result`] says the call succeeded.
pub struct Kept<'b> {
    bufs: Bufs,
    _borrows: std::marker::PhantomData<&'b mut [u8]>,
}

impl Kept<'_> {
    /// The call succeeded: the output keeps what it holds.
    pub fn keep_result(mut self) {
        self.bufs.backup = None;
    }
}

impl std::ops::Deref for Kept<'_> {
    type Target = Bufs;
    fn deref(&self) -> &Bufs {
        &self.bufs
    }
}

impl Drop for Kept<'_> {
    fn drop(&mut self) {
        self.bufs.restore();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bufs::tests::{each_schedule, exercise_bufs};
    use crate::{build, ReduceOp};

    /// Every schedule that runs in place, run in a buffer kept as it was: every write
    /// goes through the backup (so dropping the `Kept` puts back the caller's bytes,
    /// whatever was written), and `keep_result` keeps what the schedule wrote.
    #[test]
    fn a_kept_buffer_is_put_back_unless_the_call_succeeds() {
        let (worlds, counts): (u32, &[u64]) = if cfg!(miri) {
            (3, &[5])
        } else {
            (6, &[1, 5, 17, 64])
        };
        let mut checked = 0;
        each_schedule(worlds, counts, &[ReduceOp::Avg], |desc, rank, world| {
            let Some(s) = build(desc, rank, world).ok().and_then(|s| s.in_place()) else {
                return;
            };
            let elem = desc.dtype.size();
            let orig: Vec<u8> = (0..s.output_len * elem).map(|i| (i * 7) as u8).collect();
            let mut scratch = vec![0u8; s.scratch_len * elem];
            let mut backup = vec![0u8; orig.len()];
            for keep in [false, true] {
                let mut out = orig.clone();
                let written = {
                    let kept =
                        Bufs::keeping(&[], &mut out, &mut scratch, elem, &mut backup).unwrap();
                    exercise_bufs(&s, desc, world, &kept);
                    let saved = kept.saved_bytes();
                    assert!(saved <= orig.len());
                    if keep {
                        kept.keep_result();
                    }
                    saved
                };
                if keep {
                    // What a run without a backup writes.
                    let mut plain = orig.clone();
                    let bufs = Bufs::new(&[], &mut plain, &mut scratch, elem);
                    exercise_bufs(&s, desc, world, &bufs);
                    drop(bufs);
                    assert_eq!(out, plain, "{desc:?} rank {rank}: the result kept");
                } else {
                    assert_eq!(
                        out, orig,
                        "{desc:?} rank {rank}: put back ({written} bytes saved)"
                    );
                }
            }
            checked += 1;
        });
        assert!(checked > 50, "only {checked} schedules");
    }

    /// The saved ranges against a byte map: any sequence of writes saves exactly the
    /// bytes not saved before, and the ranges stay disjoint and joined.
    #[test]
    fn saved_ranges_match_a_byte_map() {
        use rand::{Rng, SeedableRng};
        let cases = if cfg!(miri) { 20 } else { 2000 };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..cases {
            let len = rng.gen_range(1..120usize);
            let mut set = BTreeMap::new();
            let mut map = vec![false; len];
            for _ in 0..rng.gen_range(0..12) {
                let a = rng.gen_range(0..len);
                let b = rng.gen_range(a..=len);
                let want: Vec<usize> = (a..b).filter(|i| !map[*i]).collect();
                let got: Vec<usize> = gaps(&set, a..b).into_iter().flatten().collect();
                assert_eq!(got, want, "gaps of {a}..{b} in {set:?}");
                for g in gaps(&set, a..b) {
                    insert(&mut set, g);
                }
                map[a..b].iter_mut().for_each(|m| *m = true);
                let mut prev_end = None;
                for (&s, &e) in &set {
                    assert!(s < e && prev_end.is_none_or(|p| p < s), "{set:?}");
                    prev_end = Some(e);
                }
                let covered: Vec<bool> = (0..len)
                    .map(|i| set.range(..=i).next_back().is_some_and(|(_, e)| *e > i))
                    .collect();
                assert_eq!(covered, map);
            }
        }
    }
}
