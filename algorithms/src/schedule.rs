//! A collective as data: for one rank, a list of steps, each a set of primitives.
//!
//! The peer runs these over links; the in-memory executor in [`crate::mem`] runs them
//! for every rank at once in tests. Regions are measured in elements, not bytes.
//!
//! Semantics of one [`Step`]: its local primitives (`Copy`, `Reduce`, `Finalize`) run
//! first, in the order given; then its communication primitives run concurrently. The
//! next step starts when every primitive of this one has finished. Within a step a rank
//! has at most one sending primitive and at most one receiving primitive per peer, so a
//! frame is named by `(epoch, seq, step)` on its link, and no two primitives of a step
//! write overlapping regions or read a region another one writes ([`Schedule::validate`]).
//!
//! The input buffer is never written, which makes guarantee G2 structural: the peer
//! runs in-place calls out-of-place into scratch and copies back only on success.

use eccl_protocol::Algo;

/// Which buffer a region lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The caller's input; read-only.
    Input,
    /// The caller's output.
    Output,
    /// Executor-owned temporary space of [`Schedule::scratch_len`] elements.
    Scratch,
}

/// A contiguous range of elements in one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    pub buf: Buf,
    pub offset: usize,
    pub len: usize,
}

impl Region {
    pub const fn new(buf: Buf, offset: usize, len: usize) -> Region {
        Region { buf, offset, len }
    }
    pub const fn input(offset: usize, len: usize) -> Region {
        Region::new(Buf::Input, offset, len)
    }
    pub const fn output(offset: usize, len: usize) -> Region {
        Region::new(Buf::Output, offset, len)
    }
    pub const fn scratch(offset: usize, len: usize) -> Region {
        Region::new(Buf::Scratch, offset, len)
    }
    pub const fn end(&self) -> usize {
        self.offset + self.len
    }
    pub fn overlaps(&self, other: &Region) -> bool {
        self.buf == other.buf
            && self.len > 0
            && other.len > 0
            && self.offset < other.end()
            && other.offset < self.end()
    }
}

/// One primitive operation of a rank (NCCL's vocabulary). Peers are ranks in the world.
/// `a ⊕ b` is the collective's reduction operator with `a` on the left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prim {
    /// Send `src` to `peer`.
    Send { peer: u32, src: Region },
    /// Receive `dst.len` elements from `peer` into `dst`.
    Recv { peer: u32, dst: Region },
    /// Receive `dst.len` elements from `peer`; `dst = incoming ⊕ local`. `local` may be
    /// `dst` itself.
    RecvReduce {
        peer: u32,
        local: Region,
        dst: Region,
    },
    /// Receive into `dst` and forward each piece to `to` as soon as it has arrived
    /// (pipelined chain broadcast).
    RecvCopySend { from: u32, to: u32, dst: Region },
    /// Receive, combine `incoming ⊕ local`, store it in `dst` if given, and forward each
    /// combined piece to `to` as soon as it is ready (pipelined chain reduce).
    RecvReduceSend {
        from: u32,
        to: u32,
        local: Region,
        dst: Option<Region>,
    },
    /// Local copy.
    Copy { src: Region, dst: Region },
    /// Local reduction `dst = dst ⊕ src`.
    Reduce { src: Region, dst: Region },
    /// Turns a finished sum into the operator's result: divides by the world size for
    /// `avg`, does nothing for every other operator. Exactly one rank finalizes each
    /// element, and everyone else receives a copy, so all ranks hold the same bits; the
    /// direct all_reduce is the exception, where every rank finalizes the identical sum
    /// it computed itself, with the same result. [`crate::build`] emits it only for
    /// `avg`.
    Finalize { region: Region },
}

impl Prim {
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            Prim::Copy { .. } | Prim::Reduce { .. } | Prim::Finalize { .. }
        )
    }
    /// The peer this primitive sends to, if any.
    pub fn sends_to(&self) -> Option<u32> {
        match self {
            Prim::Send { peer, .. } => Some(*peer),
            Prim::RecvCopySend { to, .. } | Prim::RecvReduceSend { to, .. } => Some(*to),
            _ => None,
        }
    }
    /// The peer this primitive receives from, if any.
    pub fn recvs_from(&self) -> Option<u32> {
        match self {
            Prim::Recv { peer, .. } | Prim::RecvReduce { peer, .. } => Some(*peer),
            Prim::RecvCopySend { from, .. } | Prim::RecvReduceSend { from, .. } => Some(*from),
            _ => None,
        }
    }
    /// Number of elements this primitive moves over the network or touches locally.
    pub fn len(&self) -> usize {
        match self {
            Prim::Send { src, .. } => src.len,
            Prim::Recv { dst, .. }
            | Prim::RecvReduce { dst, .. }
            | Prim::RecvCopySend { dst, .. } => dst.len,
            Prim::RecvReduceSend { local, .. } => local.len,
            Prim::Copy { src, .. } | Prim::Reduce { src, .. } => src.len,
            Prim::Finalize { region } => region.len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub prims: Vec<Prim>,
}

/// One rank's part of one collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub algo: Algo,
    pub steps: Vec<Step>,
    /// Elements of input this rank's schedule reads (the caller's input must have exactly
    /// this many).
    pub input_len: usize,
    /// Elements of output this rank's schedule writes.
    pub output_len: usize,
    /// Elements of scratch the executor must provide.
    pub scratch_len: usize,
}

impl Prim {
    /// Regions this primitive reads. A primitive that forwards what it received
    /// (`RecvCopySend`) reads only its own destination, which is not listed.
    pub fn reads(&self) -> impl Iterator<Item = Region> {
        let r = match self {
            Prim::Send { src, .. } | Prim::Copy { src, .. } => [Some(*src), None],
            Prim::RecvReduce { local, .. } | Prim::RecvReduceSend { local, .. } => {
                [Some(*local), None]
            }
            Prim::Reduce { src, dst } => [Some(*src), Some(*dst)],
            Prim::Finalize { region } => [Some(*region), None],
            Prim::Recv { .. } | Prim::RecvCopySend { .. } => [None, None],
        };
        r.into_iter().flatten()
    }

    /// The region this primitive writes, if any.
    pub fn writes(&self) -> Option<Region> {
        match self {
            Prim::Send { .. } => None,
            Prim::Recv { dst, .. }
            | Prim::RecvReduce { dst, .. }
            | Prim::RecvCopySend { dst, .. }
            | Prim::Copy { dst, .. }
            | Prim::Reduce { dst, .. } => Some(*dst),
            Prim::RecvReduceSend { dst, .. } => *dst,
            Prim::Finalize { region } => Some(*region),
        }
    }
}

impl Schedule {
    /// Elements in `buf` for this schedule.
    pub fn buf_len(&self, buf: Buf) -> usize {
        match buf {
            Buf::Input => self.input_len,
            Buf::Output => self.output_len,
            Buf::Scratch => self.scratch_len,
        }
    }

    /// Checks the rules of the module docs that one schedule can check alone:
    /// - every region lies inside its buffer, and no primitive writes the input;
    /// - the two regions of a `Copy`/`Reduce` have equal lengths and do not overlap, and
    ///   the `local` and `dst` of a receive-reduce are equal lengths and either the same
    ///   region or disjoint;
    /// - per step, at most one sending and one receiving primitive per peer;
    /// - per step, a region written by a communication primitive overlaps no region
    ///   that any other primitive of the step reads or writes.
    ///
    /// Local primitives run first and in order, so they may overlap each other freely
    /// (copy into the output, reduce into it, finalize it), and a communication
    /// primitive may read what a local one of the same step wrote (finalize a chunk,
    /// then send it). What stays forbidden is what concurrency would make a race.
    pub fn validate(&self) -> Result<(), String> {
        self.check(None)
    }

    /// [`Schedule::validate`], and also that every peer is a rank of a `world`-rank world
    /// other than `rank` itself.
    pub fn validate_for(&self, rank: u32, world: u32) -> Result<(), String> {
        if rank >= world {
            return Err(format!("rank {rank} is not in a world of {world}"));
        }
        self.check(Some((rank, world)))
    }

    fn check(&self, me: Option<(u32, u32)>) -> Result<(), String> {
        for (si, step) in self.steps.iter().enumerate() {
            let at = |pi: usize| format!("step {si} prim {pi} ({:?})", step.prims[pi]);
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            // (region, index of the primitive) for every region a communication
            // primitive writes.
            let mut comm_writes: Vec<(Region, usize)> = Vec::new();
            for (pi, p) in step.prims.iter().enumerate() {
                for r in p.reads() {
                    self.check_region(&r)
                        .map_err(|e| format!("{}: {e}", at(pi)))?;
                }
                if let Some(w) = p.writes() {
                    self.check_region(&w)
                        .map_err(|e| format!("{}: {e}", at(pi)))?;
                    if w.buf == Buf::Input {
                        return Err(format!("{}: writes the input, which is read-only", at(pi)));
                    }
                    if !p.is_local() {
                        comm_writes.push((w, pi));
                    }
                }
                self.check_shape(p)
                    .map_err(|e| format!("{}: {e}", at(pi)))?;
                for peer in p.sends_to().into_iter().chain(p.recvs_from()) {
                    if let Some((rank, world)) = me {
                        if peer == rank {
                            return Err(format!("{}: rank {rank} talks to itself", at(pi)));
                        }
                        if peer >= world {
                            return Err(format!(
                                "{}: peer {peer} is not in a world of {world}",
                                at(pi)
                            ));
                        }
                    }
                }
                sends.extend(p.sends_to());
                recvs.extend(p.recvs_from());
            }
            for (list, what) in [(&mut sends, "sends to"), (&mut recvs, "receives from")] {
                list.sort_unstable();
                if let Some(w) = list.windows(2).find(|w| w[0] == w[1]) {
                    return Err(format!(
                        "step {si}: more than one primitive {what} peer {}",
                        w[0]
                    ));
                }
            }

            // Sorting the communication writes makes the conflict check O(p log p) rather
            // than quadratic, which matters for direct algorithms at thousands of ranks.
            comm_writes.sort_unstable_by_key(|(r, _)| (r.buf as u8, r.offset));
            comm_writes.retain(|(r, _)| r.len > 0);
            for pair in comm_writes.windows(2) {
                if pair[0].0.overlaps(&pair[1].0) {
                    return Err(format!(
                        "{} and {}: write overlapping regions",
                        at(pair[0].1),
                        at(pair[1].1)
                    ));
                }
            }
            for (pi, p) in step.prims.iter().enumerate() {
                let local_write = if p.is_local() { p.writes() } else { None };
                for r in p.reads().chain(local_write) {
                    let first = comm_writes.partition_point(|(w, _)| {
                        (w.buf as u8, w.end()) <= (r.buf as u8, r.offset)
                    });
                    for (w, wi) in &comm_writes[first..] {
                        if w.buf != r.buf || w.offset >= r.end() {
                            break;
                        }
                        if *wi != pi && w.overlaps(&r) {
                            return Err(format!(
                                "{}: touches {:?}, which {} writes concurrently",
                                at(pi),
                                r,
                                at(*wi)
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn check_region(&self, r: &Region) -> Result<(), String> {
        let len = self.buf_len(r.buf);
        match r.offset.checked_add(r.len) {
            Some(end) if end <= len => Ok(()),
            _ => Err(format!("{r:?} is outside {:?} of {len} elements", r.buf)),
        }
    }

    fn check_shape(&self, p: &Prim) -> Result<(), String> {
        match p {
            Prim::Copy { src, dst } | Prim::Reduce { src, dst } => {
                if src.len != dst.len {
                    return Err("source and destination lengths differ".into());
                }
                if src.overlaps(dst) {
                    return Err("source and destination overlap".into());
                }
            }
            Prim::RecvReduce { local, dst, .. }
            | Prim::RecvReduceSend {
                local,
                dst: Some(dst),
                ..
            } => {
                if local.len != dst.len {
                    return Err("local and destination lengths differ".into());
                }
                if local != dst && local.overlaps(dst) {
                    return Err("local and destination partly overlap".into());
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(prims: Vec<Prim>) -> Schedule {
        Schedule {
            algo: Algo::Direct,
            steps: vec![Step { prims }],
            input_len: 8,
            output_len: 8,
            scratch_len: 8,
        }
    }

    #[test]
    fn accepts_a_plain_exchange() {
        let s = sched(vec![
            Prim::Copy {
                src: Region::input(0, 4),
                dst: Region::output(0, 4),
            },
            Prim::Finalize {
                region: Region::output(0, 4),
            },
            Prim::Send {
                peer: 1,
                src: Region::output(0, 4),
            },
            Prim::RecvReduce {
                peer: 1,
                local: Region::scratch(4, 4),
                dst: Region::scratch(4, 4),
            },
            Prim::Recv {
                peer: 2,
                dst: Region::output(4, 4),
            },
            Prim::Send {
                peer: 2,
                src: Region::input(0, 8),
            },
        ]);
        s.validate().unwrap();
        s.validate_for(0, 3).unwrap();
    }

    #[test]
    fn rejects_each_broken_rule() {
        let cases: Vec<(Vec<Prim>, &str)> = vec![
            (
                vec![Prim::Send {
                    peer: 1,
                    src: Region::input(4, 5),
                }],
                "outside",
            ),
            (
                vec![Prim::Recv {
                    peer: 1,
                    dst: Region::input(0, 1),
                }],
                "read-only",
            ),
            (
                vec![Prim::Copy {
                    src: Region::input(0, 2),
                    dst: Region::input(4, 2),
                }],
                "read-only",
            ),
            (
                vec![Prim::Copy {
                    src: Region::output(0, 2),
                    dst: Region::output(1, 2),
                }],
                "overlap",
            ),
            (
                vec![Prim::Reduce {
                    src: Region::output(0, 2),
                    dst: Region::scratch(0, 3),
                }],
                "lengths",
            ),
            (
                vec![Prim::RecvReduce {
                    peer: 1,
                    local: Region::output(0, 4),
                    dst: Region::output(2, 4),
                }],
                "partly",
            ),
            (
                vec![
                    Prim::Send {
                        peer: 1,
                        src: Region::input(0, 1),
                    },
                    Prim::Send {
                        peer: 1,
                        src: Region::input(1, 1),
                    },
                ],
                "more than one",
            ),
            (
                vec![
                    Prim::RecvCopySend {
                        from: 1,
                        to: 2,
                        dst: Region::output(0, 1),
                    },
                    Prim::Recv {
                        peer: 1,
                        dst: Region::output(4, 1),
                    },
                ],
                "more than one",
            ),
            (
                vec![
                    Prim::Recv {
                        peer: 1,
                        dst: Region::output(0, 4),
                    },
                    Prim::Recv {
                        peer: 2,
                        dst: Region::output(3, 4),
                    },
                ],
                "overlapping",
            ),
            (
                vec![
                    Prim::Recv {
                        peer: 1,
                        dst: Region::output(0, 4),
                    },
                    Prim::Send {
                        peer: 2,
                        src: Region::output(3, 2),
                    },
                ],
                "concurrently",
            ),
            (
                vec![
                    Prim::Recv {
                        peer: 1,
                        dst: Region::output(0, 4),
                    },
                    Prim::Copy {
                        src: Region::output(2, 1),
                        dst: Region::scratch(0, 1),
                    },
                ],
                "concurrently",
            ),
            (
                vec![
                    Prim::RecvReduceSend {
                        from: 1,
                        to: 2,
                        local: Region::input(0, 4),
                        dst: Some(Region::output(0, 4)),
                    },
                    Prim::Finalize {
                        region: Region::output(3, 1),
                    },
                ],
                "concurrently",
            ),
        ];
        for (prims, want) in cases {
            let err = sched(prims.clone())
                .validate()
                .expect_err(&format!("{prims:?}"));
            assert!(err.contains(want), "{prims:?}: {err}");
        }
    }

    #[test]
    fn zero_length_regions_never_conflict() {
        let s = Schedule {
            algo: Algo::Direct,
            steps: vec![Step {
                prims: vec![
                    Prim::Send {
                        peer: 1,
                        src: Region::input(0, 0),
                    },
                    Prim::Recv {
                        peer: 1,
                        dst: Region::output(0, 0),
                    },
                ],
            }],
            input_len: 0,
            output_len: 0,
            scratch_len: 0,
        };
        s.validate_for(0, 2).unwrap();
    }

    #[test]
    fn validate_for_checks_peers() {
        let s = sched(vec![Prim::Send {
            peer: 1,
            src: Region::input(0, 1),
        }]);
        assert!(s.validate_for(1, 2).unwrap_err().contains("itself"));
        assert!(s.validate_for(0, 1).unwrap_err().contains("not in a world"));
        assert!(s.validate_for(2, 2).unwrap_err().contains("not in a world"));
        s.validate_for(0, 2).unwrap();
    }
}
