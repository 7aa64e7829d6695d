//! The caller's buffers as the schedule's primitives see them: raw parts, so that the
//! primitives of one step can borrow disjoint regions at the same time. This is the
//! executor's one `unsafe` place (it lives here, beside the schedules, so that Miri checks
//! it without building the peer's dependencies); a validated schedule is what makes it sound.
//!
//! [`Bufs::borrow`] decides, for every communication primitive, which slices it holds
//! while its step runs, and [`Bufs::run_local`] runs the local ones. The tests below
//! borrow every step of every schedule at once and touch every slice, so that Miri
//! (`cargo +nightly miri test -p eccl-algorithms --lib bufs`) checks the aliasing.
//!
//! | file | job |
//! |---|---|
//! | `mod.rs` | the regions each primitive borrows, and the local primitives |
//! | `backup.rs` | an output kept as it was (G2): saved before each first write, put back unless the call succeeds |

mod backup;

use backup::Backup;
pub use backup::{Keep, Kept};

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

/// The caller's buffers as raw parts, so that the primitives of one step can borrow
/// disjoint regions of them at the same time.
pub struct Bufs {
    input: Side,
    output: Side,
    scratch: Side,
    elem: usize,
    /// The output as it was, to put back on drop (see [`Bufs::keeping`]).
    backup: Option<Backup>,
}

/// One of the call's buffers: one piece of memory, or a list of blocks that lie
/// anywhere (torch's list forms: one tensor per rank, [`Bufs::from_blocks`]), read as if
/// they lay back to back: block `k` holds the buffer's bytes `starts[k]..starts[k + 1]`.
enum Side {
    Whole {
        ptr: *mut u8,
        len: usize,
    },
    Blocks {
        ptrs: Vec<*mut u8>,
        /// `ptrs.len() + 1` offsets, from 0 to the buffer's length.
        starts: Vec<usize>,
    },
}

/// A buffer only read, as raw parts.
fn read(b: &[u8]) -> (*mut u8, usize) {
    (b.as_ptr() as *mut u8, b.len())
}

/// A buffer also written, as raw parts.
fn written(b: &mut [u8]) -> (*mut u8, usize) {
    (b.as_mut_ptr(), b.len())
}

impl Side {
    /// Memory given as (address, length): a read-only buffer's address comes from
    /// `as_ptr` (and is never written through: `get_mut` refuses the input), a written
    /// one's from `as_mut_ptr`, so that writes go through a pointer that may write.
    fn whole((ptr, len): (*mut u8, usize)) -> Side {
        Side::Whole { ptr, len }
    }

    fn blocks(blocks: impl Iterator<Item = (*mut u8, usize)>) -> Side {
        let (mut ptrs, mut starts) = (Vec::new(), vec![0]);
        for (ptr, len) in blocks {
            ptrs.push(ptr);
            starts.push(starts[starts.len() - 1] + len);
        }
        Side::Blocks { ptrs, starts }
    }

    fn len(&self) -> usize {
        match self {
            Side::Whole { len, .. } => *len,
            Side::Blocks { starts, .. } => starts[starts.len() - 1],
        }
    }

    /// Where bytes `s..s + n` (`n > 0`, within the buffer) lie, if one piece holds them all.
    fn at(&self, s: usize, n: usize) -> Option<*mut u8> {
        match self {
            Side::Whole { ptr, .. } => Some(ptr.wrapping_add(s)),
            Side::Blocks { ptrs, starts } => {
                // The last block that starts at or before `s` (empty blocks before it skipped).
                let k = starts.partition_point(|&x| x <= s).checked_sub(1)?;
                let end = *starts.get(k + 1)?;
                (s + n <= end).then(|| ptrs[k].wrapping_add(s - starts[k]))
            }
        }
    }
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
            input: Side::whole(read(input)),
            output: Side::whole(written(output)),
            scratch: Side::whole(written(scratch)),
            elem,
            backup: None,
        }
    }

    /// Like [`Bufs::new`], with the input and the output each given as a list of
    /// blocks, read as if they lay back to back in list order (a list of one is a whole
    /// buffer; of none, an empty one). The blocks may lie anywhere and differ in length;
    /// every region of the schedule must lie within one block ([`Bufs::check_fits`]),
    /// as the schedules of the list forms do when each rank's block is one buffer.
    pub fn from_blocks(
        input: &[&[u8]],
        output: &mut [&mut [u8]],
        scratch: &mut [u8],
        elem: usize,
    ) -> Bufs {
        Bufs {
            input: Side::blocks(input.iter().map(|b| read(b))),
            output: Side::blocks(output.iter_mut().map(|b| written(b))),
            scratch: Side::whole(written(scratch)),
            elem,
            backup: None,
        }
    }

    /// Whether every region of `sched` lies within its buffer and, where that buffer is
    /// a list of blocks, within one of them: the error names the first that does not.
    pub fn check_fits(&self, sched: &crate::Schedule) -> Result<()> {
        for p in sched.steps.iter().flat_map(|s| &s.prims) {
            for r in p.reads().chain(p.writes()) {
                self.span(&r)?;
            }
        }
        Ok(())
    }

    fn span(&self, r: &Region) -> Result<(*mut u8, usize)> {
        let side = match r.buf {
            Buf::Input => &self.input,
            Buf::Output => &self.output,
            Buf::Scratch => &self.scratch,
        };
        let len = side.len();
        let start = r.offset.checked_mul(self.elem);
        let bytes = r.len.checked_mul(self.elem);
        match (start, bytes) {
            // (An empty region is never read or written: `get` hands out `&[]`.)
            (Some(s), Some(0)) if s <= len => Ok((std::ptr::null_mut(), 0)),
            (Some(s), Some(b)) if s.checked_add(b).is_some_and(|e| e <= len) => {
                side.at(s, b).map(|p| (p, b)).ok_or_else(|| {
                    BuildError::InvalidArgument(format!(
                        "schedule region {r:?} crosses from one block of its list into the next"
                    ))
                })
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
                    keep: Keep::NONE,
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
    use crate::{available_algos, build, Algo, CollectiveKind, Descriptor};

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
        each_schedule(
            worlds,
            counts,
            &[ReduceOp::Sum, ReduceOp::Avg],
            |desc, rank, world| {
                let Ok(s) = build(desc, rank, world) else {
                    return;
                };
                s.validate_for(rank, world).unwrap();
                exercise(&s, desc, world);
                checked += 1;
            },
        );
        assert!(checked > 100, "only {checked} schedules");
    }

    /// Calls `f(desc, rank, world)` for every collective kind (point-to-point aside), each
    /// of its algorithms, worlds of 1 to `worlds` ranks, each of `counts` and `ops` (f32,
    /// the root in the middle), and every rank.
    pub(crate) fn each_schedule(
        worlds: u32,
        counts: &[u64],
        ops: &[ReduceOp],
        mut f: impl FnMut(&Descriptor, u32, u32),
    ) {
        for kind in CollectiveKind::ALL
            .into_iter()
            .filter(|k| *k != CollectiveKind::SendRecv)
        {
            for &algo in available_algos(kind) {
                for world in 1..=worlds {
                    for &count in counts {
                        for &op in ops {
                            let desc = Descriptor {
                                kind,
                                dtype: DType::F32,
                                op,
                                algo,
                                root: world / 2,
                                count,
                            };
                            for rank in 0..world {
                                f(&desc, rank, world);
                            }
                        }
                    }
                }
            }
        }
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

    pub(crate) fn exercise_bufs(s: &crate::Schedule, desc: &Descriptor, world: u32, bufs: &Bufs) {
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

    /// The list forms (all_gather's and gather's output, reduce_scatter's and scatter's
    /// input, both of all_to_all's) given as one separate buffer per rank: every
    /// schedule the tuner may pick, in rank order and around a solved ring (whose blocks
    /// are renumbered), keeps every region within one rank's block, and every step is
    /// borrowed and used as the executor does (under Miri, across allocations). The
    /// peer falls back to a packed copy for the others (all_to_all's relaying ring,
    /// which is only ever forced).
    #[test]
    fn list_forms_borrow_their_blocks_in_place() {
        let (worlds, counts): (u32, &[u64]) = if cfg!(miri) {
            (4, &[3])
        } else {
            (8, &[0, 1, 5, 17])
        };
        let mut fitted = 0;
        each_schedule(worlds, counts, &[ReduceOp::Sum], |desc, rank, world| {
            use crate::CollectiveKind::*;
            let sides = match desc.kind {
                AllGather | Gather => (false, true),
                ReduceScatter | Scatter => (true, false),
                AllToAll => (true, true),
                _ => return,
            };
            let ring: Vec<u32> = (0..world)
                .rev()
                .cycle()
                .skip(1)
                .take(world as usize)
                .collect();
            for ring in [None, Some(&ring[..])] {
                if let Ok(s) = crate::build_in_ring(desc, rank, world, ring) {
                    fitted += list_form(&s, desc, rank, world, sides) as usize;
                }
            }
        });
        assert!(fitted > 100, "only {fitted} schedules");
    }

    /// One schedule of [`list_forms_borrow_their_blocks_in_place`]: whether it fitted.
    fn list_form(
        s: &crate::Schedule,
        desc: &Descriptor,
        rank: u32,
        world: u32,
        sides: (bool, bool),
    ) -> bool {
        let elem = desc.dtype.size();
        let blocks = |list: bool, len: usize| -> Vec<Vec<u8>> {
            let (n, each) = if list && len > 0 {
                (world as usize, len / world as usize)
            } else {
                (1, len)
            };
            (0..n).map(|k| vec![k as u8; each * elem]).collect()
        };
        let input = blocks(sides.0, s.input_len);
        let mut output = blocks(sides.1, s.output_len);
        let mut scratch = vec![0u8; s.scratch_len * elem];
        let ins: Vec<&[u8]> = input.iter().map(|b| &b[..]).collect();
        let mut outs: Vec<&mut [u8]> = output.iter_mut().map(|b| &mut b[..]).collect();
        let bufs = Bufs::from_blocks(&ins, &mut outs, &mut scratch, elem);
        let fits = bufs.check_fits(s);
        let pickable = desc.kind != CollectiveKind::AllToAll || desc.algo == Algo::Direct;
        if let (true, Err(e)) = (pickable, &fits) {
            panic!("{desc} rank {rank}/{world}: {e}");
        }
        if fits.is_ok() {
            exercise_bufs(s, desc, world, &bufs);
        }
        fits.is_ok()
    }

    #[test]
    fn a_region_across_two_blocks_is_refused() {
        let (a, b) = ([1u8; 8], [2u8; 8]);
        let mut out = [0u8; 4];
        let bufs = Bufs::from_blocks(&[&a, &b], &mut [&mut out], &mut [], 4);
        let send = |offset, len| Prim::Send {
            peer: 1,
            src: Region::input(offset, len),
        };
        // SAFETY: each borrow is dropped before the next.
        unsafe {
            match bufs.borrow(&send(2, 2)).unwrap() {
                Mem::Read(d) => assert_eq!(d, &[2u8; 8]),
                _ => unreachable!(),
            }
            match bufs.borrow(&send(1, 1)).unwrap() {
                Mem::Read(d) => assert_eq!(d, &[1u8; 4]),
                _ => unreachable!(),
            }
            assert!(bufs.borrow(&send(1, 2)).is_err(), "across blocks");
            assert!(bufs.borrow(&send(3, 2)).is_err(), "past the end");
            assert!(bufs.borrow(&send(4, 0)).is_ok(), "empty at the end");
        }
        // Empty blocks between others are skipped.
        let (e, c) = ([0u8; 0], [3u8; 4]);
        let bufs = Bufs::from_blocks(&[&a, &e, &c], &mut [], &mut [], 4);
        // SAFETY: as above.
        unsafe {
            match bufs.borrow(&send(2, 1)).unwrap() {
                Mem::Read(d) => assert_eq!(d, &[3u8; 4]),
                _ => unreachable!(),
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
