//! Running a schedule in the caller's buffer: the input and the output are one buffer.
//!
//! A schedule reads the input and writes the output as if they were apart. Run in place
//! (NCCL's `sendbuff == recvbuff`), the input's elements are the output's, so a schedule
//! is only correct there if it never reads an input element after that element of the
//! output was written, and never writes where the caller keeps its input as it was.
//! [`Schedule::in_place`] checks exactly that and rewrites the input's regions as the
//! output's; where it says no, the peer runs the call in scratch and copies the result
//! back. The ring all_reduce passes (each rank reads its input chunk in the
//! reduce-scatter phase before the gather phase writes it), so a large in-place
//! all_reduce needs no scratch and no copy.

use crate::schedule::{Buf, Prim, Region, Schedule, Step};

impl Schedule {
    /// This schedule with its input and output in one buffer of
    /// `max(input_len, output_len)` elements, which holds the input when the call starts
    /// and the output when it ends; `None` where that would change the result:
    /// - an input element read after the same output element was written (earlier
    ///   primitives of the step run first when local; the communication primitives of a
    ///   step run concurrently, so one that writes where another of the step reads is a
    ///   race and refused by [`Schedule::validate`]);
    /// - a write past `output_len` (where a rank's buffer is input only, as a reduce's
    ///   off the root: the caller keeps those elements);
    /// - a local copy or reduction whose two regions become overlapping ones.
    ///
    /// A copy from an input region onto the same output region is dropped (the data is
    /// there already). The result validates.
    pub fn in_place(&self) -> Option<Schedule> {
        let mut written = Written::default();
        let mut steps = Vec::with_capacity(self.steps.len());
        for step in &self.steps {
            let mut prims = Vec::with_capacity(step.prims.len());
            // Local primitives run first, one after another.
            for p in step.prims.iter().filter(|p| p.is_local()) {
                if p.reads()
                    .any(|r| r.buf == Buf::Input && written.touches(&r))
                {
                    return None;
                }
                match alias(p)? {
                    // The input's elements are there already, unchanged: nothing is
                    // written.
                    Prim::Copy { src, dst } if src == dst => continue,
                    q => prims.push(q),
                }
                if let Some(w) = p.writes() {
                    if w.buf == Buf::Output && w.end() > self.output_len {
                        return None;
                    }
                    written.add(&w);
                }
            }
            // Then every communication primitive at once: each reads against what was
            // written before the step.
            let comm: Vec<&Prim> = step.prims.iter().filter(|p| !p.is_local()).collect();
            for p in &comm {
                if p.reads()
                    .any(|r| r.buf == Buf::Input && written.touches(&r))
                {
                    return None;
                }
            }
            for p in comm {
                if let Some(w) = p.writes() {
                    if w.buf == Buf::Output && w.end() > self.output_len {
                        return None;
                    }
                    written.add(&w);
                }
                prims.push(alias(p)?);
            }
            steps.push(Step { prims });
        }
        let s = Schedule {
            algo: self.algo,
            steps,
            input_len: 0,
            output_len: self.input_len.max(self.output_len),
            scratch_len: self.scratch_len,
        };
        s.validate().ok()?;
        Some(s)
    }
}

/// The primitive with its input regions as output regions; `None` where two regions of
/// one primitive become partly overlapping (same region is fine where the primitive
/// allows it: a receive-reduce into its own `local`).
fn alias(p: &Prim) -> Option<Prim> {
    let a = |r: Region| {
        if r.buf == Buf::Input {
            Region::output(r.offset, r.len)
        } else {
            r
        }
    };
    let apart_or_same = |x: Region, y: Region| x == y || !x.overlaps(&y);
    Some(match *p {
        Prim::Send { peer, src } => Prim::Send { peer, src: a(src) },
        Prim::Recv { peer, dst } => Prim::Recv { peer, dst },
        Prim::RecvReduce { peer, local, dst } => {
            let (local, dst) = (a(local), a(dst));
            if !apart_or_same(local, dst) {
                return None;
            }
            Prim::RecvReduce { peer, local, dst }
        }
        Prim::RecvCopySend { from, to, dst } => Prim::RecvCopySend { from, to, dst },
        Prim::RecvReduceSend {
            from,
            to,
            local,
            dst,
        } => {
            let local = a(local);
            if dst.is_some_and(|d| !apart_or_same(local, d)) {
                return None;
            }
            Prim::RecvReduceSend {
                from,
                to,
                local,
                dst,
            }
        }
        Prim::Copy { src, dst } => {
            let src = a(src);
            if src != dst && src.overlaps(&dst) {
                return None;
            }
            Prim::Copy { src, dst }
        }
        Prim::Reduce { src, dst } => {
            let src = a(src);
            if src.overlaps(&dst) {
                return None;
            }
            Prim::Reduce { src, dst }
        }
        Prim::Finalize { region } => Prim::Finalize { region },
    })
}

/// The output elements written so far, as sorted, disjoint, non-adjacent ranges.
#[derive(Default)]
struct Written(Vec<(usize, usize)>);

impl Written {
    /// Whether any element of the output under input region `r` was written.
    fn touches(&self, r: &Region) -> bool {
        let (s, e) = (r.offset, r.end());
        let i = self.0.partition_point(|&(_, end)| end <= s);
        r.len > 0 && self.0.get(i).is_some_and(|&(start, _)| start < e)
    }

    fn add(&mut self, r: &Region) {
        if r.buf != Buf::Output || r.len == 0 {
            return;
        }
        let (mut s, mut e) = (r.offset, r.end());
        // Every range that overlaps or touches [s, e) merges into it.
        let first = self.0.partition_point(|&(_, end)| end < s);
        let mut last = first;
        while last < self.0.len() && self.0[last].0 <= e {
            s = s.min(self.0[last].0);
            e = e.max(self.0[last].1);
            last += 1;
        }
        self.0.splice(first..last, [(s, e)]);
    }
}

#[cfg(test)]
mod tests {
    use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, ReduceOp};

    use super::*;
    use crate::{available_algos, build, mem};

    #[test]
    fn written_ranges_merge_and_answer_overlaps() {
        let mut w = Written::default();
        w.add(&Region::output(10, 5));
        w.add(&Region::output(20, 5));
        w.add(&Region::output(15, 5)); // joins both
        assert_eq!(w.0, vec![(10, 25)]);
        w.add(&Region::scratch(0, 100)); // not the output
        w.add(&Region::output(0, 0));
        assert_eq!(w.0, vec![(10, 25)]);
        assert!(w.touches(&Region::input(24, 3)));
        assert!(w.touches(&Region::input(0, 11)));
        assert!(!w.touches(&Region::input(25, 3)));
        assert!(!w.touches(&Region::input(0, 10)));
        assert!(!w.touches(&Region::input(12, 0)));
    }

    #[test]
    fn refuses_what_in_place_would_change() {
        let sched = |prims: Vec<Prim>, input_len, output_len| Schedule {
            algo: Algo::Direct,
            steps: vec![Step { prims }],
            input_len,
            output_len,
            scratch_len: 0,
        };
        // Writes output element 0, then reads input element 0: refused.
        let s = sched(
            vec![
                Prim::Copy {
                    src: Region::input(4, 4),
                    dst: Region::output(0, 4),
                },
                Prim::Send {
                    peer: 1,
                    src: Region::input(0, 4),
                },
            ],
            8,
            8,
        );
        assert!(s.in_place().is_none());
        // Reads first, then writes: fine, and the copy onto itself goes.
        let s = sched(
            vec![
                Prim::Copy {
                    src: Region::input(0, 8),
                    dst: Region::output(0, 8),
                },
                Prim::Send {
                    peer: 1,
                    src: Region::input(0, 8),
                },
            ],
            8,
            8,
        );
        let p = s.in_place().expect("reads precede writes");
        assert_eq!(
            p.steps[0].prims,
            vec![Prim::Send {
                peer: 1,
                src: Region::output(0, 8)
            }]
        );
        assert_eq!((p.input_len, p.output_len), (0, 8));
        // A rank whose buffer is input only may not have it written (a reduce off the
        // root keeps the caller's data).
        let s = sched(
            vec![Prim::RecvReduce {
                peer: 1,
                local: Region::input(0, 4),
                dst: Region::output(0, 4),
            }],
            4,
            0,
        );
        assert!(s.in_place().is_none());
        // A receive that overwrites what a concurrent send of the step reads: a race.
        let s = sched(
            vec![
                Prim::Send {
                    peer: 1,
                    src: Region::input(0, 4),
                },
                Prim::Recv {
                    peer: 1,
                    dst: Region::output(0, 4),
                },
            ],
            4,
            4,
        );
        assert!(s.in_place().is_none());
    }

    /// Every in-place collective, algorithm, world size and rank: where `in_place()`
    /// says yes, running the rewritten schedules on one buffer per rank gives exactly
    /// the out-of-place outputs (and leaves input-only buffers as they were); the ring
    /// all_reduce, the large-buffer default, runs in place on every rank.
    #[test]
    fn in_place_schedules_give_the_out_of_place_results() {
        let dtype = DType::F32;
        let count = 29; // uneven chunks
        let mut checked = Vec::new();
        for kind in [
            CollectiveKind::AllReduce,
            CollectiveKind::Broadcast,
            CollectiveKind::Reduce,
        ] {
            for &algo in available_algos(kind) {
                for world in 1..=7u32 {
                    for op in [ReduceOp::Sum, ReduceOp::Avg] {
                        let desc = Descriptor {
                            kind,
                            dtype,
                            op,
                            algo,
                            root: world / 2,
                            count: count as u64,
                        };
                        let scheds: Vec<Schedule> = (0..world)
                            .map(|r| build(&desc, r, world).unwrap())
                            .collect();
                        let inputs: Vec<Vec<u8>> = scheds
                            .iter()
                            .enumerate()
                            .map(|(r, s)| {
                                (0..s.input_len)
                                    .flat_map(|i| ((r * 31 + i) as f32 * 0.25).to_le_bytes())
                                    .collect()
                            })
                            .collect();
                        let want = mem::run_schedules(dtype, desc.op, &scheds, &inputs).unwrap();
                        // Each rank in place where it can be, in scratch and copied
                        // back (the guarded way) where not.
                        let aliased: Vec<Option<Schedule>> =
                            scheds.iter().map(|s| s.in_place()).collect();
                        let bufs: Vec<Vec<u8>> = scheds
                            .iter()
                            .zip(&inputs)
                            .map(|(s, i)| {
                                let mut b = i.clone();
                                b.resize(s.input_len.max(s.output_len) * 4, 0);
                                b
                            })
                            .collect();
                        let got = mem::run_mixed(dtype, desc.op, &scheds, &aliased, &inputs, &bufs)
                            .unwrap_or_else(|e| panic!("{desc:?} world {world}: {e}"));
                        for r in 0..world as usize {
                            let mut expect = bufs[r].clone();
                            let out = &want[r];
                            expect[..out.len()].copy_from_slice(out);
                            assert_eq!(got[r], expect, "{desc:?} world {world} rank {r}");
                        }
                        if kind == CollectiveKind::AllReduce && algo == Algo::Ring {
                            assert!(aliased.iter().all(Option::is_some), "ring at {world}");
                        }
                        checked.push((kind, algo, aliased.iter().flatten().count()));
                    }
                }
            }
        }
        let in_place: usize = checked.iter().map(|c| c.2).sum();
        assert!(in_place > 0 && checked.len() == 2 * 7 * 9, "{checked:?}");
    }
}
