//! eccl's collectives as pure schedules: which primitive each rank runs in each step,
//! the choice among ring, direct and tree, and the reduction kernels.
//!
//! Nothing here does I/O. [`build`] turns a [`Descriptor`] into one rank's [`Schedule`];
//! the peer runs it over links, and [`mem`] runs every rank's at once in memory, which
//! is how every algorithm is tested at every world size.
//!
//! Buffer lengths follow NCCL's count convention (see [`buffer_lens`]); in a world of one
//! every collective is a local copy.

pub mod bufs;
pub mod element;
mod in_place;
pub mod kernels;
pub mod mem;
pub mod model;
pub mod quant;
pub mod schedule;
pub mod tuner;

mod collectives;

pub use eccl_protocol::{Algo, CollectiveKind, DType, Descriptor, ReduceOp};
pub use element::Element;
pub use schedule::*;
pub use tuner::{available_algos, choose_algo, choose_algo_in, Choice};

use collectives::{Body, Ctx};

/// Why [`build`] refused a descriptor.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The call itself is wrong (operator invalid for the dtype, root or rank outside the
    /// world, an empty world, send/recv, a count whose buffers do not fit in memory).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The algorithm exists but not for this collective; [`choose_algo`] never picks it.
    #[error("{algo} is not available for {kind} (available: {})", names(available_algos(*kind)))]
    Unsupported { kind: CollectiveKind, algo: Algo },
}

fn names(algos: &[Algo]) -> String {
    algos
        .iter()
        .map(|a| a.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Buffer lengths in elements, `(input_len, output_len)`, that rank `rank`'s schedule
/// uses for a collective of `kind` with `count` elements (NCCL's convention) in a world
/// of `world` ranks:
///
/// | kind | input | output |
/// |---|---|---|
/// | broadcast | `count` on the root, 0 elsewhere | `count` |
/// | reduce | `count` | `count` on the root, 0 elsewhere |
/// | all_reduce | `count` | `count` |
/// | scatter | `count * world` on the root, 0 elsewhere | `count` |
/// | gather | `count` | `count * world` on the root, 0 elsewhere |
/// | all_gather | `count` | `count * world` |
/// | reduce_scatter | `count * world` | `count` |
/// | all_to_all | `count * world` | `count * world` |
/// | barrier | 0 | 0 |
/// | send/recv | `count` | `count` (not a schedule; for the caller's convenience) |
///
/// Products saturate rather than overflow; [`build`] rejects such counts.
pub fn buffer_lens(
    kind: CollectiveKind,
    count: usize,
    world: u32,
    rank: u32,
    root: u32,
) -> (usize, usize) {
    use CollectiveKind::*;
    let all = count.saturating_mul(world as usize);
    let on_root = |len: usize| if rank == root { len } else { 0 };
    match kind {
        Broadcast => (on_root(count), count),
        Reduce => (count, on_root(count)),
        AllReduce => (count, count),
        Scatter => (on_root(all), count),
        Gather => (count, on_root(all)),
        AllGather => (count, all),
        ReduceScatter => (all, count),
        AllToAll => (all, all),
        Barrier => (0, 0),
        SendRecv => (count, count),
    }
}

/// Builds rank `rank`'s schedule for `desc` (its `algo` already chosen, see
/// [`choose_algo`]) in a world of `world` ranks.
///
/// The operator is checked against the dtype only for collectives that reduce, and the
/// root against the world only for rooted ones; the other fields are ignored there, as
/// in NCCL.
pub fn build(desc: &Descriptor, rank: u32, world: u32) -> Result<Schedule, BuildError> {
    build_in_ring(desc, rank, world, None)
}

/// Rank `rank`'s schedule of an all_to_all whose blocks differ in size (MPI's
/// `alltoallv`): `send[j]` elements of this rank's input go to rank `j`, `recv[j]` of
/// its output come from rank `j`, each buffer's blocks one after the other in rank
/// order. Always [`Algo::Direct`]: every pair exchanges its two blocks once, nothing
/// padded. Refused: counts that are not one per rank, a block to itself that differs
/// from the one from itself, buffers that do not fit in memory.
pub fn build_all_to_all_v(
    dtype: DType,
    rank: u32,
    world: u32,
    send: &[usize],
    recv: &[usize],
) -> Result<Schedule, BuildError> {
    let invalid = |m: String| Err(BuildError::InvalidArgument(m));
    check_place(rank, world)?;
    let n = world as usize;
    if send.len() != n || recv.len() != n {
        return invalid(format!(
            "all_to_all with split sizes needs one count per rank ({n}): {} to send, {} to receive",
            send.len(),
            recv.len()
        ));
    }
    let r = rank as usize;
    if send[r] != recv[r] {
        return invalid(format!(
            "rank {rank} sends itself {} elements but expects {} from itself",
            send[r], recv[r]
        ));
    }
    let total = |c: &[usize]| {
        c.iter()
            .try_fold(0usize, |a, &x| a.checked_add(x))
            .filter(|t| {
                t.checked_mul(dtype.size())
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
    };
    let (Some(input_len), Some(output_len)) = (total(send), total(recv)) else {
        return invalid(format!("split sizes of {dtype} that do not fit in memory"));
    };
    let body = collectives::all_to_all::uneven(r, n, send, recv);
    Ok(Schedule {
        algo: Algo::Direct,
        steps: body.steps,
        input_len,
        output_len,
        scratch_len: body.scratch_len,
    })
}

/// [`build`] with the world's ring order: `ring` lists the ranks around the ring (each
/// sends to the next, the last to the first), as the master solves it from measured
/// links (`eccl_master::topology`). The schedule is built for this rank's place in the
/// ring, and its peers are the ranks at the neighbouring places:
/// - a root is translated to its place, so broadcast's and reduce's chains run from the
///   root along the ring (trees are built over places);
/// - a buffer cut into one block per rank (all_gather's output, reduce_scatter's input,
///   both of all_to_all's, the root's of scatter and gather) has its blocks renumbered:
///   the block the schedule built for place `p` is rank `ring[p]`'s;
/// - every chunk of an all_reduce is still reduced by one rank in one order and copied
///   to the others, so every rank ends with the same bits (G3); a block of
///   reduce_scatter is computed by its one owner.
///
/// A local copy or reduction across blocks is cut at their boundaries; a message across
/// two blocks would have to be cut on both ends alike, and is refused as an internal
/// error (no builder sends one: `algorithms/tests/collectives.rs` runs them all). `None`,
/// or a ring that is not a permutation of the world's ranks, is rank order.
pub fn build_in_ring(
    desc: &Descriptor,
    rank: u32,
    world: u32,
    ring: Option<&[u32]>,
) -> Result<Schedule, BuildError> {
    let ring = ring.filter(|r| world > 2 && is_permutation(r, world));
    let Some(ring) = ring else {
        return build_rank_order(desc, rank, world);
    };
    let place_of = |r: u32| ring.iter().position(|&x| x == r).map(|p| p as u32);
    let Some(place) = place_of(rank) else {
        return Err(BuildError::InvalidArgument(format!(
            "rank {rank} is not in a world of {world}"
        )));
    };
    // A root outside the world keeps its number, so that the builder refuses it as in
    // rank order; collectives without a root keep the field as it came.
    let root = match desc.kind.is_rooted() {
        true => place_of(desc.root).unwrap_or(desc.root),
        false => desc.root,
    };
    let mut s = build_rank_order(&Descriptor { root, ..*desc }, place, world)?;
    // Buffers of one block per rank: renumber their blocks from places to ranks.
    let count = desc.count as usize;
    let blocked = |len: usize| count > 0 && len == count * world as usize;
    let (input_blocked, output_blocked) = (blocked(s.input_len), blocked(s.output_len));
    let is_blocked = |r: &Region| {
        r.len > 0
            && match r.buf {
                Buf::Input => input_blocked,
                Buf::Output => output_blocked,
                Buf::Scratch => false,
            }
    };
    // A region inside one block, renumbered; `None` if it crosses into the next.
    let renumber = |r: Region| -> Option<Region> {
        if !is_blocked(&r) {
            return Some(r);
        }
        let block = r.offset / count;
        (r.end() <= (block + 1) * count).then(|| Region {
            offset: ring[block] as usize * count + (r.offset - block * count),
            ..r
        })
    };
    // Where a local primitive's regions cross a block boundary: each piece is renumbered
    // on its own (a local copy or reduction may be cut anywhere).
    let cuts = |r: &Region, v: &mut Vec<usize>| {
        if is_blocked(r) {
            let first = r.offset / count + 1;
            v.extend(
                (first..)
                    .map(|b| b * count - r.offset)
                    .take_while(|&at| at < r.len),
            );
        }
    };
    let piece = |r: &Region, from: usize, to: usize| Region {
        offset: r.offset + from,
        len: to - from,
        ..*r
    };
    let across = |p: &Prim| {
        BuildError::InvalidArgument(format!(
            "internal: {p:?} crosses a block boundary of a buffer the solved ring renumbers"
        ))
    };
    for step in &mut s.steps {
        let mut prims = Vec::with_capacity(step.prims.len());
        for p in step.prims.drain(..) {
            let q = match p {
                Prim::Copy { src, dst } | Prim::Reduce { src, dst } => {
                    let mut at_cuts = vec![0, src.len];
                    cuts(&src, &mut at_cuts);
                    cuts(&dst, &mut at_cuts);
                    at_cuts.sort_unstable();
                    at_cuts.dedup();
                    for w in at_cuts.windows(2) {
                        let (s2, d2) = (piece(&src, w[0], w[1]), piece(&dst, w[0], w[1]));
                        let (src, dst) = (renumber(s2).expect("cut"), renumber(d2).expect("cut"));
                        prims.push(match p {
                            Prim::Copy { .. } => Prim::Copy { src, dst },
                            _ => Prim::Reduce { src, dst },
                        });
                    }
                    continue;
                }
                Prim::Finalize { region } => {
                    let mut at_cuts = vec![0, region.len];
                    cuts(&region, &mut at_cuts);
                    at_cuts.sort_unstable();
                    at_cuts.dedup();
                    for w in at_cuts.windows(2) {
                        let region = renumber(piece(&region, w[0], w[1])).expect("cut");
                        prims.push(Prim::Finalize { region });
                    }
                    continue;
                }
                Prim::Send { peer, src } => Prim::Send {
                    peer: ring[peer as usize],
                    src: renumber(src).ok_or_else(|| across(&p))?,
                },
                Prim::Recv { peer, dst } => Prim::Recv {
                    peer: ring[peer as usize],
                    dst: renumber(dst).ok_or_else(|| across(&p))?,
                },
                Prim::RecvReduce { peer, local, dst } => Prim::RecvReduce {
                    peer: ring[peer as usize],
                    local: renumber(local).ok_or_else(|| across(&p))?,
                    dst: renumber(dst).ok_or_else(|| across(&p))?,
                },
                Prim::RecvCopySend { from, to, dst } => Prim::RecvCopySend {
                    from: ring[from as usize],
                    to: ring[to as usize],
                    dst: renumber(dst).ok_or_else(|| across(&p))?,
                },
                Prim::RecvReduceSend {
                    from,
                    to,
                    local,
                    dst,
                } => Prim::RecvReduceSend {
                    from: ring[from as usize],
                    to: ring[to as usize],
                    local: renumber(local).ok_or_else(|| across(&p))?,
                    dst: match dst {
                        Some(d) => Some(renumber(d).ok_or_else(|| across(&p))?),
                        None => None,
                    },
                },
            };
            prims.push(q);
        }
        step.prims = prims;
    }
    Ok(s)
}

/// Whether `ring` holds each rank of a world of `world` exactly once.
pub fn is_permutation(ring: &[u32], world: u32) -> bool {
    // The length first: `world` alone allocates nothing.
    if ring.len() != world as usize {
        return false;
    }
    let mut seen = vec![false; world as usize];
    ring.iter()
        .all(|&r| (r < world) && !std::mem::replace(&mut seen[r as usize], true))
}

/// A world of a size eccl supports, and a rank in it.
fn check_place(rank: u32, world: u32) -> Result<(), BuildError> {
    if world == 0 || world as usize > eccl_protocol::MAX_WORLD_SIZE {
        return Err(BuildError::InvalidArgument(format!(
            "world of {world} ranks (must be 1..={})",
            eccl_protocol::MAX_WORLD_SIZE
        )));
    }
    if rank >= world {
        return Err(BuildError::InvalidArgument(format!(
            "rank {rank} is not in a world of {world}"
        )));
    }
    Ok(())
}

fn build_rank_order(desc: &Descriptor, rank: u32, world: u32) -> Result<Schedule, BuildError> {
    use CollectiveKind::*;
    let kind = desc.kind;
    let invalid = |m: String| Err(BuildError::InvalidArgument(m));
    if kind == SendRecv {
        return invalid("send/recv is point-to-point, not a collective schedule".into());
    }
    check_place(rank, world)?;
    if kind.is_rooted() && desc.root >= world {
        return invalid(format!("root {} is not in a world of {world}", desc.root));
    }
    if kind.reduces() && !desc.op.valid_for(desc.dtype) {
        return invalid(format!("{} is not defined for {}", desc.op, desc.dtype));
    }
    if !available_algos(kind).contains(&desc.algo) {
        return Err(BuildError::Unsupported {
            kind,
            algo: desc.algo,
        });
    }
    // Every buffer and scratch area of every algorithm is at most `2 * count * world`
    // elements (all_to_all's ring: two areas of `world - 1` blocks), so bounding that
    // bounds them all.
    let count = usize::try_from(desc.count).ok().filter(|c| {
        c.checked_mul(2 * world as usize)
            .and_then(|e| e.checked_mul(desc.dtype.size()))
            .is_some_and(|b| b <= isize::MAX as usize)
    });
    let Some(count) = count else {
        return invalid(format!(
            "count {} of {} in a world of {world} does not fit in memory",
            desc.count, desc.dtype
        ));
    };

    let cx = Ctx {
        rank: rank as usize,
        world: world as usize,
        root: desc.root as usize,
        count,
        finalize: kind.reduces() && desc.op == ReduceOp::Avg,
    };
    let body: Body = if world == 1 {
        collectives::local(&cx, kind == Barrier)
    } else {
        use collectives::*;
        match (kind, desc.algo) {
            (AllReduce, Algo::Ring) => all_reduce::ring(&cx),
            (AllReduce, Algo::Direct) => all_reduce::direct(&cx),
            (AllReduce, Algo::Tree) => all_reduce::tree(&cx),
            (ReduceScatter, Algo::Ring) => reduce_scatter::ring(&cx),
            (ReduceScatter, Algo::Direct) => reduce_scatter::direct(&cx),
            (AllGather, Algo::Ring) => all_gather::ring(&cx),
            (AllGather, Algo::Direct) => all_gather::direct(&cx),
            (Broadcast, Algo::Ring) => broadcast::ring(&cx),
            (Broadcast, Algo::Direct) => broadcast::direct(&cx),
            (Broadcast, Algo::Tree) => broadcast::tree(&cx),
            (Reduce, Algo::Ring) => reduce::ring(&cx),
            (Reduce, Algo::Direct) => reduce::direct(&cx),
            (Reduce, Algo::Tree) => reduce::tree(&cx),
            (Scatter, Algo::Direct) => scatter::direct(&cx),
            (Gather, Algo::Direct) => gather::direct(&cx),
            (AllToAll, Algo::Direct) => all_to_all::direct(&cx),
            (AllToAll, Algo::Ring) => all_to_all::ring(&cx),
            (Barrier, Algo::Direct) => barrier::direct(&cx),
            (Barrier, Algo::Tree) => barrier::tree(&cx),
            // Checked against `available_algos` above; kept as an error, not a panic, in
            // case the two tables drift apart.
            (kind, algo) => return Err(BuildError::Unsupported { kind, algo }),
        }
    };
    let (input_len, output_len) = buffer_lens(kind, count, world, rank, desc.root);
    Ok(Schedule {
        algo: desc.algo,
        steps: body.steps,
        input_len,
        output_len,
        scratch_len: body.scratch_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(
        kind: CollectiveKind,
        dtype: DType,
        op: ReduceOp,
        algo: Algo,
        root: u32,
        count: u64,
    ) -> Descriptor {
        Descriptor {
            kind,
            dtype,
            op,
            algo,
            root,
            count,
        }
    }

    #[test]
    fn rejects_invalid_calls() {
        use CollectiveKind::*;
        let bad = |d: Descriptor, rank, world| match build(&d, rank, world) {
            Err(BuildError::InvalidArgument(m)) => m,
            other => panic!("{d} rank {rank}/{world}: {other:?}"),
        };
        let ok = desc(AllReduce, DType::F32, ReduceOp::Sum, Algo::Ring, 0, 10);
        assert!(build(&ok, 0, 4).is_ok());
        bad(
            desc(AllReduce, DType::I32, ReduceOp::Avg, Algo::Ring, 0, 10),
            0,
            4,
        );
        bad(
            desc(ReduceScatter, DType::F32, ReduceOp::BXor, Algo::Ring, 0, 10),
            0,
            4,
        );
        bad(
            desc(Reduce, DType::BF16, ReduceOp::BAnd, Algo::Tree, 0, 10),
            0,
            4,
        );
        bad(
            desc(Broadcast, DType::F32, ReduceOp::Sum, Algo::Tree, 4, 10),
            0,
            4,
        );
        bad(
            desc(Gather, DType::F32, ReduceOp::Sum, Algo::Direct, 9, 10),
            0,
            4,
        );
        bad(
            desc(SendRecv, DType::F32, ReduceOp::Sum, Algo::Direct, 0, 10),
            0,
            4,
        );
        bad(ok, 0, 0);
        bad(ok, 4, 4);
        bad(ok, 0, eccl_protocol::MAX_WORLD_SIZE as u32 + 1);
        bad(
            desc(
                AllReduce,
                DType::F32,
                ReduceOp::Sum,
                Algo::Ring,
                0,
                u64::MAX,
            ),
            0,
            4,
        );
        bad(
            desc(
                AllGather,
                DType::F64,
                ReduceOp::Sum,
                Algo::Ring,
                0,
                (isize::MAX as u64) / 16,
            ),
            0,
            4,
        );
        // The op of a non-reducing kind and the root of a non-rooted kind are ignored.
        assert!(build(
            &desc(Broadcast, DType::F32, ReduceOp::BXor, Algo::Ring, 0, 10),
            0,
            4
        )
        .is_ok());
        assert!(build(
            &desc(AllGather, DType::F32, ReduceOp::Sum, Algo::Ring, 99, 10),
            0,
            4
        )
        .is_ok());
    }

    #[test]
    fn rejects_algorithms_a_kind_lacks() {
        use CollectiveKind::*;
        for kind in CollectiveKind::ALL.into_iter().filter(|k| *k != SendRecv) {
            for algo in Algo::ALL {
                let r = build(&desc(kind, DType::F32, ReduceOp::Sum, algo, 0, 3), 0, 2);
                if available_algos(kind).contains(&algo) {
                    assert!(r.is_ok(), "{kind} {algo}: {r:?}");
                } else {
                    assert!(
                        matches!(r, Err(BuildError::Unsupported { .. })),
                        "{kind} {algo}: {r:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn buffer_lens_follow_nccl() {
        use CollectiveKind::*;
        assert_eq!(buffer_lens(Broadcast, 5, 4, 1, 1), (5, 5));
        assert_eq!(buffer_lens(Broadcast, 5, 4, 0, 1), (0, 5));
        assert_eq!(buffer_lens(Reduce, 5, 4, 0, 1), (5, 0));
        assert_eq!(buffer_lens(Scatter, 5, 4, 1, 1), (20, 5));
        assert_eq!(buffer_lens(Gather, 5, 4, 1, 1), (5, 20));
        assert_eq!(buffer_lens(AllGather, 5, 4, 0, 0), (5, 20));
        assert_eq!(buffer_lens(ReduceScatter, 5, 4, 0, 0), (20, 5));
        assert_eq!(buffer_lens(AllToAll, 5, 4, 0, 0), (20, 20));
        assert_eq!(buffer_lens(Barrier, 5, 4, 0, 0), (0, 0));
        assert_eq!(
            buffer_lens(AllGather, usize::MAX, 4, 0, 0),
            (usize::MAX, usize::MAX)
        );
    }
}
