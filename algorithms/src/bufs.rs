//! The caller's buffers as the schedule's primitives see them: raw parts, so that the
//! primitives of one step can borrow disjoint regions at the same time. This is the
//! executor's one `unsafe` place (it lives here, beside the schedules, so that Miri checks
//! it without building the peer's dependencies); a validated schedule is what makes it sound.
//!
//! [`Bufs::borrow`] decides, for every communication primitive, which slices it holds
//! while its step runs, and [`Bufs::run_local`] runs the local ones. The tests below
//! borrow every step of every schedule at once and touch every slice, so that Miri
//! (`cargo +nightly miri test -p eccl-algorithms --lib bufs`) checks the aliasing.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Mutex;

use crate::{kernels, Buf, BuildError, DType, Prim, ReduceOp, Region};

type Result<T> = std::result::Result<T, BuildError>;

/// The memory one communication primitive works on for the length of its step.
pub enum Mem<'a> {
    /// `Send`: what it sends.
    Read(&'a [u8]),
    /// `Recv`, `RecvCopySend`: where the message lands.
    Write(Out<'a>),
    /// `RecvReduce`, `RecvReduceSend`: `incoming ⊕ local`.
    Reduce(Reduce<'a>),
}

/// Where a received message is copied, piece by piece.
pub struct Out<'a> {
    data: &'a mut [u8],
    keep: Keep<'a>,
}

impl Out<'_> {
    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// `out[off..] = piece`.
    pub fn write(&mut self, off: usize, piece: &[u8]) {
        let dst = &mut self.data[off..off + piece.len()];
        self.keep.save(off, dst);
        dst.copy_from_slice(piece);
    }
}

/// The operands of a receive-reduce.
pub enum Reduce<'a> {
    /// `local` and the destination are different regions (a `RecvReduceSend` may keep
    /// no result: `out` is `None`).
    Apart {
        local: &'a [u8],
        out: Option<&'a mut [u8]>,
        keep: Keep<'a>,
    },
    /// The destination is `local` itself: one slice, read then written piece by piece.
    InPlace(&'a mut [u8], Keep<'a>),
}

impl Reduce<'_> {
    pub fn len(&self) -> usize {
        match self {
            Reduce::Apart { local, .. } => local.len(),
            Reduce::InPlace(b, _) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `piece = piece ⊕ local[off..]` for an incoming piece at `off`, then stores the
    /// result at `off` when the primitive keeps one.
    pub fn combine_into(&mut self, dtype: DType, op: ReduceOp, off: usize, piece: &mut [u8]) {
        let n = piece.len();
        match self {
            Reduce::Apart { local, out, keep } => {
                kernels::reduce_inplace(dtype, op, piece, &local[off..off + n]);
                if let Some(o) = out {
                    keep.save(off, &o[off..off + n]);
                    o[off..off + n].copy_from_slice(piece);
                }
            }
            Reduce::InPlace(b, keep) => {
                // Saved first: the reduction then reads the piece from the cache.
                keep.save(off, &b[off..off + n]);
                kernels::reduce_inplace(dtype, op, piece, &b[off..off + n]);
                b[off..off + n].copy_from_slice(piece);
            }
        }
    }

    /// `out[off..] = incoming ⊕ local[off..]` for an incoming piece at `off`.
    pub fn combine_from(&mut self, dtype: DType, op: ReduceOp, off: usize, piece: &[u8]) {
        let n = piece.len();
        match self {
            Reduce::Apart {
                local,
                out: Some(o),
                keep,
            } => {
                keep.save(off, &o[off..off + n]);
                kernels::reduce_to(dtype, op, &mut o[off..off + n], piece, &local[off..off + n])
            }
            // A receive-reduce that keeps nothing only forwards (`combine_into`).
            Reduce::Apart { out: None, .. } => {}
            Reduce::InPlace(b, keep) => {
                keep.save(off, &b[off..off + n]);
                kernels::reduce_inplace_rev(dtype, op, &mut b[off..off + n], piece)
            }
        }
    }
}

/// A copy of the output as it was when the call started, made piece by piece just before
/// each piece's first write (when the data is about to be read anyway: a receive-reduce
/// in place reads its piece from the cache afterwards), and put back when a [`Bufs`] is
/// dropped without [`Bufs::keep_result`]: an in-place call that fails, or that is dropped
/// half-way, leaves the caller's buffer as it was (G2) without working in scratch and
/// copying the whole result back on success.
struct Backup {
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
    /// Saves `cur`, the bytes at `off` of this slice, before they are written.
    fn save(&self, off: usize, cur: &[u8]) {
        if let Some((b, at)) = self.0 {
            b.save(at + off, cur);
        }
    }
}

/// The caller's buffers as raw parts, so that the primitives of one step can borrow
/// disjoint regions of them at the same time.
pub struct Bufs {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
    scratch: *mut u8,
    scratch_len: usize,
    elem: usize,
    /// The output as it was, to put back on drop (see [`Bufs::keeping`]).
    backup: Option<Backup>,
}

// SAFETY: a `Bufs` is made from borrows that outlive it (`Bufs::new` takes them and
// `run` drops the `Bufs` before they end) and hands out slices only under the rules of
// `get`/`get_mut`; the pointers are to plain bytes that any thread may read or write.
unsafe impl Send for Bufs {}
// SAFETY: as for Send; concurrent primitives of one step touch disjoint regions.
unsafe impl Sync for Bufs {}

impl Bufs {
    pub fn new(input: &[u8], output: &mut [u8], scratch: &mut [u8], elem: usize) -> Bufs {
        Bufs {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            scratch: scratch.as_mut_ptr(),
            scratch_len: scratch.len(),
            elem,
            backup: None,
        }
    }

    /// Like [`Bufs::new`], and the output is left as it was unless the call ends with
    /// [`Bufs::keep_result`]: each output byte is copied to `backup` just before its
    /// first write, and dropping the `Bufs` copies back what was saved. `backup` must be
    /// at least as long as `output`.
    pub fn keeping<'b>(
        input: &[u8],
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

    fn keep(&self, r: &Region) -> Keep<'_> {
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
        let saved = b.saved.into_inner().unwrap_or_else(|e| e.into_inner());
        for (s, e) in saved {
            // SAFETY: `&mut self`: no slice of the buffers is alive; the backup and the
            // output are live allocations (borrowed for the `Kept`'s life) of at least
            // `b.len` bytes, `s..e` lies within it (checked when saved), and they are
            // different allocations.
            unsafe { std::ptr::copy_nonoverlapping(b.ptr.add(s), self.output.add(s), e - s) };
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

impl Bufs {
    fn span(&self, r: &Region) -> Result<(*mut u8, usize)> {
        let (base, len) = match r.buf {
            Buf::Input => (self.input as *mut u8, self.input_len),
            Buf::Output => (self.output, self.output_len),
            Buf::Scratch => (self.scratch, self.scratch_len),
        };
        let start = r.offset.checked_mul(self.elem);
        let bytes = r.len.checked_mul(self.elem);
        match (start, bytes) {
            (Some(s), Some(b)) if s.checked_add(b).is_some_and(|e| e <= len) => {
                Ok((base.wrapping_add(s), b))
            }
            _ => Err(BuildError::InvalidArgument(format!(
                "schedule region {r:?} is outside its buffer of {len} bytes"
            ))),
        }
    }

    /// # Safety
    /// No live mutable slice may overlap `r` (the schedule was validated: within a step
    /// no primitive reads what another writes).
    unsafe fn get(&self, r: &Region) -> Result<&[u8]> {
        let (p, n) = self.span(r)?;
        Ok(if n == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(p, n)
        })
    }

    /// # Safety
    /// `r` must not overlap any other live slice, and must not be in the input.
    // `&self` hands out `&mut`: the buffers are raw parts, and the validated schedule is
    // what keeps the regions of one step disjoint (see the Safety notes).
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self, r: &Region) -> Result<&mut [u8]> {
        if r.buf == Buf::Input {
            return Err(BuildError::InvalidArgument(
                "a schedule may not write its input".into(),
            ));
        }
        let (p, n) = self.span(r)?;
        Ok(if n == 0 {
            &mut []
        } else {
            std::slice::from_raw_parts_mut(p, n)
        })
    }

    /// The slices communication primitive `p` holds while its step runs.
    ///
    /// # Safety
    /// `p` is a primitive of a step of a validated schedule, and no slice of the buffers
    /// from an earlier step (or from `run_local`) is still alive. Validation keeps every
    /// region a communication primitive writes apart from every region any other
    /// primitive of the step touches, and a receive-reduce's `local` either apart from
    /// its destination or equal to it (then it gets one slice, [`Reduce::InPlace`]); so
    /// the slices of one step's primitives never alias.
    pub unsafe fn borrow(&self, p: &Prim) -> Result<Mem<'_>> {
        let reduce = |local: &Region, dst: Option<&Region>| -> Result<Mem<'_>> {
            if let Some(d) = dst.filter(|d| d.len != local.len) {
                return Err(BuildError::InvalidArgument(format!(
                    "schedule reduces regions of different lengths ({local:?}, {d:?})"
                )));
            }
            Ok(Mem::Reduce(match dst {
                Some(d) if d == local => Reduce::InPlace(self.get_mut(d)?, self.keep(d)),
                Some(d) => Reduce::Apart {
                    local: self.get(local)?,
                    out: Some(self.get_mut(d)?),
                    keep: self.keep(d),
                },
                None => Reduce::Apart {
                    local: self.get(local)?,
                    out: None,
                    keep: Keep(None),
                },
            }))
        };
        match p {
            Prim::Send { src, .. } => Ok(Mem::Read(self.get(src)?)),
            Prim::Recv { dst, .. } | Prim::RecvCopySend { dst, .. } => Ok(Mem::Write(Out {
                data: self.get_mut(dst)?,
                keep: self.keep(dst),
            })),
            Prim::RecvReduce { local, dst, .. } => reduce(local, Some(dst)),
            Prim::RecvReduceSend { local, dst, .. } => reduce(local, dst.as_ref()),
            Prim::Copy { .. } | Prim::Reduce { .. } | Prim::Finalize { .. } => {
                Err(BuildError::InvalidArgument(format!(
                    "{p:?} is local: it runs before its step's links"
                )))
            }
        }
    }

    /// Runs local primitive `p` (others are refused).
    ///
    /// # Safety
    /// No slice of the buffers is alive.
    pub unsafe fn run_local(
        &self,
        p: &Prim,
        dtype: DType,
        op: ReduceOp,
        world: usize,
    ) -> Result<()> {
        match p {
            Prim::Copy { src, dst } | Prim::Reduce { src, dst } if src.overlaps(dst) => {
                Err(BuildError::InvalidArgument(format!(
                    "schedule combines overlapping regions ({src:?}, {dst:?})"
                )))
            }
            Prim::Copy { src, dst } | Prim::Reduce { src, dst } if src.len != dst.len => {
                Err(BuildError::InvalidArgument(format!(
                    "schedule combines regions of different lengths ({src:?}, {dst:?})"
                )))
            }
            Prim::Copy { src, dst } => {
                self.keep(dst).save(0, self.get(dst)?);
                self.get_mut(dst)?.copy_from_slice(self.get(src)?);
                Ok(())
            }
            Prim::Reduce { src, dst } => {
                self.keep(dst).save(0, self.get(dst)?);
                kernels::reduce_inplace(dtype, op, self.get_mut(dst)?, self.get(src)?);
                Ok(())
            }
            Prim::Finalize { region } => {
                self.keep(region).save(0, self.get(region)?);
                kernels::finalize(dtype, op, self.get_mut(region)?, world);
                Ok(())
            }
            _ => Err(BuildError::InvalidArgument(format!(
                "{p:?} is not a local primitive"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{available_algos, build, CollectiveKind, Descriptor};

    use super::*;

    /// Every step of every schedule, borrowed as the executor borrows it: the local
    /// primitives run, then every communication primitive of the step holds its slices
    /// at once, and each is used (written, read, combined) in turn, twice over. Under
    /// Miri an aliasing `&mut` or a read past a buffer is an error; natively it checks
    /// that every region of every schedule fits its buffer.
    #[test]
    fn every_schedule_borrows_disjoint_memory() {
        let (worlds, counts): (u32, &[u64]) = if cfg!(miri) {
            (4, &[5])
        } else {
            (7, &[0, 1, 5, 17])
        };
        let mut checked = 0;
        for kind in CollectiveKind::ALL
            .into_iter()
            .filter(|k| *k != CollectiveKind::SendRecv)
        {
            for &algo in available_algos(kind) {
                for world in 1..=worlds {
                    for &count in counts {
                        for op in [ReduceOp::Sum, ReduceOp::Avg] {
                            let root = world / 2;
                            let desc = Descriptor {
                                kind,
                                dtype: DType::F32,
                                op,
                                algo,
                                root,
                                count,
                            };
                            for rank in 0..world {
                                let Ok(s) = build(&desc, rank, world) else {
                                    continue;
                                };
                                s.validate_for(rank, world).unwrap();
                                exercise(&s, &desc, world);
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100, "only {checked} schedules");
    }

    fn exercise(s: &crate::Schedule, desc: &Descriptor, world: u32) {
        let elem = desc.dtype.size();
        let input: Vec<u8> = (0..s.input_len * elem).map(|i| i as u8).collect();
        let mut output = vec![0u8; s.output_len * elem];
        let mut scratch = vec![0u8; s.scratch_len * elem];
        let bufs = Bufs::new(&input, &mut output, &mut scratch, elem);
        exercise_bufs(s, desc, world, &bufs);
        drop(bufs);
        assert_eq!(output.len(), s.output_len * elem);
    }

    fn exercise_bufs(s: &crate::Schedule, desc: &Descriptor, world: u32, bufs: &Bufs) {
        for step in &s.steps {
            for p in step.prims.iter().filter(|p| p.is_local()) {
                // SAFETY: nothing else is borrowed.
                unsafe {
                    bufs.run_local(p, desc.dtype, desc.op, world as usize)
                        .unwrap()
                };
            }
            // SAFETY: a validated schedule, and the local slices are gone.
            let mut mems: Vec<Mem<'_>> = step
                .prims
                .iter()
                .filter(|p| !p.is_local())
                .map(|p| unsafe { bufs.borrow(p).unwrap() })
                .collect();
            for _ in 0..2 {
                for m in mems.iter_mut() {
                    match m {
                        Mem::Read(d) => {
                            assert!(d.iter().map(|b| *b as usize).sum::<usize>() < usize::MAX)
                        }
                        Mem::Write(d) => d.write(0, &vec![1; d.len()]),
                        Mem::Reduce(r) => {
                            let n = r.len();
                            let mut piece = vec![0u8; n];
                            r.combine_into(desc.dtype, desc.op, 0, &mut piece);
                            r.combine_from(desc.dtype, desc.op, 0, &piece);
                        }
                    }
                }
            }
        }
    }

    /// Every schedule that runs in place, run in a buffer kept as it was: every write
    /// goes through the backup (so dropping the `Bufs` puts back the caller's bytes,
    /// whatever was written), and `keep_result` keeps what the schedule wrote.
    #[test]
    fn a_kept_buffer_is_put_back_unless_the_call_succeeds() {
        let (worlds, counts): (u32, &[u64]) = if cfg!(miri) {
            (3, &[5])
        } else {
            (6, &[1, 5, 17, 64])
        };
        let mut checked = 0;
        for kind in CollectiveKind::ALL
            .into_iter()
            .filter(|k| *k != CollectiveKind::SendRecv)
        {
            for &algo in available_algos(kind) {
                for world in 1..=worlds {
                    for &count in counts {
                        let desc = Descriptor {
                            kind,
                            dtype: DType::F32,
                            op: ReduceOp::Avg,
                            algo,
                            root: world / 2,
                            count,
                        };
                        for rank in 0..world {
                            let Some(s) = build(&desc, rank, world).ok().and_then(|s| s.in_place())
                            else {
                                continue;
                            };
                            let elem = desc.dtype.size();
                            let orig: Vec<u8> =
                                (0..s.output_len * elem).map(|i| (i * 7) as u8).collect();
                            let mut scratch = vec![0u8; s.scratch_len * elem];
                            let mut backup = vec![0u8; orig.len()];
                            for keep in [false, true] {
                                let mut out = orig.clone();
                                let written = {
                                    let kept = Bufs::keeping(
                                        &[],
                                        &mut out,
                                        &mut scratch,
                                        elem,
                                        &mut backup,
                                    )
                                    .unwrap();
                                    exercise_bufs(&s, &desc, world, &kept);
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
                                    exercise_bufs(&s, &desc, world, &bufs);
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
                        }
                    }
                }
            }
        }
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

    #[test]
    fn regions_outside_their_buffer_and_local_misuse_are_errors() {
        let input = [0u8; 8];
        let (mut out, mut scr) = ([0u8; 8], [0u8; 0]);
        let bufs = Bufs::new(&input, &mut out, &mut scr, 4);
        let send = |r| Prim::Send { peer: 1, src: r };
        // SAFETY: each borrow ends before the next (they are errors or dropped).
        unsafe {
            assert!(
                bufs.borrow(&send(Region::input(1, 2))).is_err(),
                "past the end"
            );
            assert!(
                bufs.borrow(&send(Region::input(usize::MAX, 2))).is_err(),
                "overflow"
            );
            assert!(
                bufs.borrow(&Prim::Recv {
                    peer: 1,
                    dst: Region::input(0, 1)
                })
                .is_err(),
                "writes the input"
            );
            let copy = Prim::Copy {
                src: Region::new(Buf::Output, 0, 2),
                dst: Region::new(Buf::Output, 1, 1),
            };
            assert!(
                bufs.run_local(&copy, DType::F32, ReduceOp::Sum, 2).is_err(),
                "different lengths"
            );
            assert!(
                bufs.borrow(&copy).is_err(),
                "a local primitive is not borrowed"
            );
            assert!(bufs
                .run_local(&send(Region::input(0, 1)), DType::F32, ReduceOp::Sum, 2)
                .is_err());
        }
    }
}
