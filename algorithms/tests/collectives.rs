//! Every collective × every algorithm it has × worlds 1..=8 × awkward counts, run on
//! the in-memory executor and compared byte for byte with the naive reference.
//!
//! Float inputs hold small integers so that every association order gives the same
//! sum exactly; integer inputs are arbitrary bits, since wrapping arithmetic and
//! bitwise operators are associative and commutative anyway. The G3 test below uses
//! real fractions and checks what must hold regardless: all ranks agree bit for bit.

use eccl_algorithms::{
    available_algos, buffer_lens, build, build_all_to_all_v, build_in_ring, mem, Algo,
    CollectiveKind, DType, Descriptor, ReduceOp,
};
use half::{bf16, f16};
use rand::{rngs::StdRng, Rng, SeedableRng};

const COUNTS: [usize; 10] = [0, 1, 2, 3, 5, 7, 8, 13, 64, 257];

const REDUCING: [(DType, ReduceOp); 17] = [
    (DType::F32, ReduceOp::Sum),
    (DType::F32, ReduceOp::Avg),
    (DType::F32, ReduceOp::Min),
    (DType::F32, ReduceOp::Max),
    (DType::F32, ReduceOp::Prod),
    (DType::F64, ReduceOp::Sum),
    (DType::F64, ReduceOp::Avg),
    (DType::F16, ReduceOp::Sum),
    (DType::F16, ReduceOp::Avg),
    (DType::BF16, ReduceOp::Max),
    (DType::BF16, ReduceOp::Sum),
    (DType::I8, ReduceOp::Sum),
    (DType::U8, ReduceOp::BXor),
    (DType::I32, ReduceOp::Prod),
    (DType::I32, ReduceOp::Min),
    (DType::I64, ReduceOp::BAnd),
    (DType::I64, ReduceOp::BOr),
];

/// Moving data does not depend on the operator; these cover every element size.
const MOVING: [(DType, ReduceOp); 4] = [
    (DType::F32, ReduceOp::Sum),
    (DType::U8, ReduceOp::Sum),
    (DType::F16, ReduceOp::Sum),
    (DType::I64, ReduceOp::Sum),
];

/// One element's bytes: a small integer for floats (exact under any association),
/// arbitrary bits for integers.
fn element(rng: &mut StdRng, dtype: DType, op: ReduceOp) -> Vec<u8> {
    let v: f32 = match op {
        // Products of at most 8 factors in {±1, ±2} stay exact even in bf16.
        ReduceOp::Prod => [-2.0, -1.0, 1.0, 2.0][rng.gen_range(0..4)],
        // Sums of at most 8 values in -8..=7 stay exact even in bf16.
        _ => rng.gen_range(-8..=7) as f32,
    };
    match dtype {
        DType::F32 => v.to_le_bytes().to_vec(),
        DType::F64 => (v as f64).to_le_bytes().to_vec(),
        DType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
        DType::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
        _ => (0..dtype.size()).map(|_| rng.gen()).collect(),
    }
}

fn inputs(rng: &mut StdRng, desc: &Descriptor, world: u32) -> Vec<Vec<u8>> {
    (0..world)
        .map(|r| {
            let (len, _) = buffer_lens(desc.kind, desc.count as usize, world, r, desc.root);
            (0..len)
                .flat_map(|_| element(rng, desc.dtype, desc.op))
                .collect()
        })
        .collect()
}

/// Runs every algorithm of `kind` for worlds 1..=8, both end roots, every count and every
/// (dtype, op) of `combos` against the reference; returns the algorithms it ran, so a
/// test also says which ones it expects to have covered.
fn check_kind(kind: CollectiveKind, combos: &[(DType, ReduceOp)]) -> Vec<Algo> {
    assert!(!combos.is_empty());
    let mut rng = StdRng::seed_from_u64(0xecc1 + kind as u64);
    for &algo in available_algos(kind) {
        for world in 1..=8u32 {
            let roots: Vec<u32> = if kind.is_rooted() && world > 1 {
                vec![0, world - 1]
            } else {
                vec![0]
            };
            for &root in &roots {
                for count in COUNTS {
                    for &(dtype, op) in combos {
                        let desc = Descriptor {
                            kind,
                            dtype,
                            op,
                            algo,
                            root,
                            count: count as u64,
                        };
                        let ins = inputs(&mut rng, &desc, world);
                        let got = mem::run_all(&desc, world, &ins)
                            .unwrap_or_else(|e| panic!("{desc} world {world}: {e}"));
                        let want = mem::reference(&desc, world, &ins);
                        for r in 0..world as usize {
                            let (_, out_len) = buffer_lens(kind, count, world, r as u32, root);
                            assert_eq!(
                                got[r].len(),
                                out_len * dtype.size(),
                                "{desc} world {world} rank {r}: output length"
                            );
                            assert_eq!(got[r], want[r], "{desc} world {world} rank {r}");
                        }
                    }
                }
            }
        }
    }
    available_algos(kind).to_vec()
}

const ALL_THREE: [Algo; 3] = [Algo::Ring, Algo::Direct, Algo::Tree];

#[test]
fn all_reduce_matches_reference() {
    assert_eq!(check_kind(CollectiveKind::AllReduce, &REDUCING), ALL_THREE);
}

#[test]
fn reduce_scatter_matches_reference() {
    assert_eq!(
        check_kind(CollectiveKind::ReduceScatter, &REDUCING),
        [Algo::Ring, Algo::Direct]
    );
}

#[test]
fn reduce_matches_reference() {
    assert_eq!(check_kind(CollectiveKind::Reduce, &REDUCING), ALL_THREE);
}

#[test]
fn broadcast_matches_reference() {
    assert_eq!(check_kind(CollectiveKind::Broadcast, &MOVING), ALL_THREE);
}

#[test]
fn all_gather_matches_reference() {
    assert_eq!(
        check_kind(CollectiveKind::AllGather, &MOVING),
        [Algo::Ring, Algo::Direct]
    );
}

#[test]
fn scatter_gather_all_to_all_match_reference() {
    for kind in [CollectiveKind::Scatter, CollectiveKind::Gather] {
        assert_eq!(check_kind(kind, &MOVING), [Algo::Direct], "{kind}");
    }
    assert_eq!(
        check_kind(CollectiveKind::AllToAll, &MOVING),
        [Algo::Direct, Algo::Ring]
    );
}

/// All_to_all with split sizes: random block sizes (empty ones included) for worlds of
/// 1..=8, every rank's output block `j` is rank `j`'s input block for it, byte for byte,
/// and nothing is padded (each buffer holds exactly its blocks).
#[test]
fn all_to_all_with_split_sizes_moves_each_block_as_it_is() {
    let mut rng = StdRng::seed_from_u64(0xa2a5);
    for world in 1..=8usize {
        for round in 0..12 {
            for (dtype, _) in MOVING {
                // sizes[i][j]: elements rank i sends rank j.
                let sizes: Vec<Vec<usize>> = (0..world)
                    .map(|_| {
                        (0..world)
                            .map(|_| match round % 3 {
                                0 => rng.gen_range(0..4),
                                1 => [0, 1, 257, 1000][rng.gen_range(0..4)],
                                _ => rng.gen_range(0..70),
                            })
                            .collect()
                    })
                    .collect();
                let e = dtype.size();
                let ins: Vec<Vec<u8>> = (0..world)
                    .map(|i| {
                        (0..sizes[i].iter().sum::<usize>() * e)
                            .map(|_| rng.gen())
                            .collect()
                    })
                    .collect();
                let scheds: Vec<_> = (0..world)
                    .map(|r| {
                        let recv: Vec<usize> = (0..world).map(|j| sizes[j][r]).collect();
                        let s = build_all_to_all_v(dtype, r as u32, world as u32, &sizes[r], &recv)
                            .unwrap();
                        s.validate_for(r as u32, world as u32).unwrap();
                        assert_eq!(s.scratch_len, 0);
                        s
                    })
                    .collect();
                let got = mem::run_schedules(dtype, ReduceOp::Sum, &scheds, &ins).unwrap();
                for r in 0..world {
                    let mut want = Vec::new();
                    for (j, input) in ins.iter().enumerate() {
                        let at: usize = sizes[j][..r].iter().sum();
                        want.extend_from_slice(&input[at * e..(at + sizes[j][r]) * e]);
                    }
                    assert_eq!(got[r], want, "world {world} round {round} {dtype} rank {r}");
                }
            }
        }
    }
}

#[test]
fn all_to_all_with_split_sizes_refuses_what_cannot_be_right() {
    let f = DType::F32;
    let err = |r: Result<_, eccl_algorithms::BuildError>| r.err().map(|e| e.to_string());
    assert!(err(build_all_to_all_v(f, 0, 2, &[1], &[1, 1]))
        .unwrap()
        .contains("one count per rank"));
    assert!(err(build_all_to_all_v(f, 1, 2, &[1, 2], &[1, 3]))
        .unwrap()
        .contains("sends itself 2"));
    assert!(err(build_all_to_all_v(f, 2, 2, &[1, 1], &[1, 1]))
        .unwrap()
        .contains("not in a world"));
    assert!(err(build_all_to_all_v(
        f,
        0,
        2,
        &[usize::MAX / 2, 1],
        &[usize::MAX / 2, 0]
    ))
    .unwrap()
    .contains("do not fit"));
}

#[test]
fn barrier_exchanges_frames_and_completes() {
    assert_eq!(
        check_kind(CollectiveKind::Barrier, &MOVING[..1]),
        [Algo::Direct, Algo::Tree]
    );
    for algo in available_algos(CollectiveKind::Barrier) {
        for world in 2..=8u32 {
            let desc = Descriptor {
                kind: CollectiveKind::Barrier,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                algo: *algo,
                root: 0,
                count: 0,
            };
            for r in 0..world {
                let s = build(&desc, r, world).unwrap();
                // Every rank must hear from someone, or the barrier would not wait.
                assert!(s
                    .steps
                    .iter()
                    .flat_map(|st| &st.prims)
                    .any(|p| p.recvs_from().is_some()));
            }
        }
    }
}

/// Guarantee G3: with fractional inputs, where association order changes the bits, every
/// rank still ends with the same bits.
#[test]
fn all_reduce_results_are_bitwise_identical_across_ranks() {
    let mut rng = StdRng::seed_from_u64(3);
    for algo in [Algo::Ring, Algo::Tree, Algo::Direct] {
        for world in 2..=8u32 {
            for count in [1usize, 7, 64, 1000] {
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Prod] {
                    let desc = Descriptor {
                        kind: CollectiveKind::AllReduce,
                        dtype: DType::F32,
                        op,
                        algo,
                        root: 0,
                        count: count as u64,
                    };
                    let ins: Vec<Vec<u8>> = (0..world)
                        .map(|_| {
                            (0..count)
                                .flat_map(|_| (rng.gen::<f32>() * 2.0 - 1.0).to_le_bytes())
                                .collect()
                        })
                        .collect();
                    let out = mem::run_all(&desc, world, &ins).unwrap();
                    for r in 1..world as usize {
                        assert_eq!(
                            out[r], out[0],
                            "{desc} world {world}: rank {r} differs from rank 0"
                        );
                    }
                    // And the result is the sum, up to rounding.
                    if op == ReduceOp::Sum {
                        let f = |b: &[u8], i: usize| {
                            f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap())
                        };
                        for i in 0..count {
                            let exact: f64 = ins.iter().map(|x| f(x, i) as f64).sum();
                            assert!(
                                (f(&out[0], i) as f64 - exact).abs() < 1e-5,
                                "{desc} world {world}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// A solved ring order (the master's, from measured links): rank `ring[k]` sends to
/// `ring[k+1]`. Every algorithm of every collective (rooted ones from every root) still
/// gives the reference (exact inputs) and, with fractions, the same bits on every rank
/// that has the whole result; the ring's schedules talk only to the ranks beside them in
/// the order (all_reduce, all_gather, reduce_scatter, all_to_all: right and left; a
/// chain from a root: either neighbour); and a list that is not a permutation, or a world of two,
/// keeps rank order.
#[test]
fn all_reduce_in_a_solved_ring_order_is_exact_and_identical_on_every_rank() {
    let mut rng = StdRng::seed_from_u64(5);
    for world in 3..=8u32 {
        // A few orders per world: reversed, interleaved, and a shuffle.
        let mut shuffled: Vec<u32> = (0..world).collect();
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, rng.gen_range(0..=i));
        }
        let reversed: Vec<u32> = (0..world).rev().collect();
        let interleaved: Vec<u32> = (0..world).step_by(2).chain((1..world).step_by(2)).collect();
        for ring in [reversed, interleaved, shuffled] {
            let kinds = [
                CollectiveKind::AllReduce,
                CollectiveKind::Broadcast,
                CollectiveKind::Reduce,
                CollectiveKind::AllGather,
                CollectiveKind::ReduceScatter,
                CollectiveKind::AllToAll,
                CollectiveKind::Scatter,
                CollectiveKind::Gather,
                CollectiveKind::Barrier,
            ];
            let runs = kinds.into_iter().flat_map(|kind| {
                let roots = if kind.is_rooted() { 0..world } else { 0..1 };
                roots.flat_map(move |root| {
                    available_algos(kind).iter().map(move |a| (kind, root, *a))
                })
            });
            for (kind, root, algo) in runs {
                for (count, fractions) in [(257usize, false), (1000, true), (3, true)] {
                    let desc = Descriptor {
                        kind,
                        dtype: DType::F32,
                        op: ReduceOp::Sum,
                        algo,
                        root,
                        count: count as u64,
                    };
                    let schedules: Vec<_> = (0..world)
                        .map(|r| build_in_ring(&desc, r, world, Some(&ring)).unwrap())
                        .collect();
                    if algo == Algo::Ring {
                        for (r, s) in schedules.iter().enumerate() {
                            let k = ring.iter().position(|&x| x == r as u32).unwrap();
                            let right = ring[(k + 1) % ring.len()];
                            let left = ring[(k + ring.len() - 1) % ring.len()];
                            let beside = |x: u32| x == right || x == left;
                            for p in s.steps.iter().flat_map(|st| &st.prims) {
                                let around = matches!(
                                    kind,
                                    CollectiveKind::AllReduce
                                        | CollectiveKind::AllGather
                                        | CollectiveKind::ReduceScatter
                                        | CollectiveKind::AllToAll
                                );
                                if around {
                                    assert!(
                                        p.sends_to().is_none_or(|to| to == right),
                                        "{ring:?} rank {r}: {p:?}"
                                    );
                                    assert!(
                                        p.recvs_from().is_none_or(|f| f == left),
                                        "{ring:?} rank {r}: {p:?}"
                                    );
                                } else {
                                    assert!(
                                        p.sends_to().is_none_or(beside)
                                            && p.recvs_from().is_none_or(beside),
                                        "{desc} {ring:?} rank {r}: {p:?}"
                                    );
                                }
                            }
                        }
                    }
                    let ins: Vec<Vec<u8>> = if fractions {
                        (0..world)
                            .map(|r| {
                                let (len, _) = buffer_lens(kind, count, world, r, root);
                                (0..len)
                                    .flat_map(|_| (rng.gen::<f32>() * 2.0 - 1.0).to_le_bytes())
                                    .collect()
                            })
                            .collect()
                    } else {
                        inputs(&mut rng, &desc, world)
                    };
                    let out = mem::run_schedules(desc.dtype, desc.op, &schedules, &ins)
                        .unwrap_or_else(|e| panic!("{desc} ring {ring:?}: {e}"));
                    let same_everywhere = matches!(
                        kind,
                        CollectiveKind::AllReduce
                            | CollectiveKind::Broadcast
                            | CollectiveKind::AllGather
                    );
                    if same_everywhere {
                        for r in 1..world as usize {
                            assert_eq!(out[r], out[0], "{desc} ring {ring:?}: rank {r} differs");
                        }
                    }
                    if !fractions {
                        assert_eq!(
                            out,
                            mem::reference(&desc, world, &ins),
                            "{desc} ring {ring:?}"
                        );
                    }
                }
            }
        }
    }
    // Rank order where the order does not apply: two ranks (either order is the ring).
    let gather = Descriptor {
        kind: CollectiveKind::AllGather,
        dtype: DType::F32,
        op: ReduceOp::Sum,
        algo: Algo::Ring,
        root: 0,
        count: 8,
    };
    for r in 0..2 {
        assert_eq!(
            build_in_ring(&gather, r, 2, Some(&[1, 0])).unwrap(),
            build(&gather, r, 2).unwrap()
        );
    }
    let all_reduce = Descriptor {
        kind: CollectiveKind::AllReduce,
        ..gather
    };
    for bad in [&[0u32, 1, 2][..], &[0, 1, 1, 2], &[0, 1, 2, 4]] {
        assert_eq!(
            build_in_ring(&all_reduce, 1, 4, Some(bad)).unwrap(),
            build(&all_reduce, 1, 4).unwrap()
        );
    }
}

/// The same schedule run twice gives the same bits (no hidden nondeterminism).
#[test]
fn reduce_scatter_and_reduce_are_deterministic_with_fractions() {
    let mut rng = StdRng::seed_from_u64(4);
    for kind in [CollectiveKind::ReduceScatter, CollectiveKind::Reduce] {
        for &algo in available_algos(kind) {
            for world in 2..=6u32 {
                let desc = Descriptor {
                    kind,
                    dtype: DType::F16,
                    op: ReduceOp::Avg,
                    algo,
                    root: world - 1,
                    count: 33,
                };
                let ins: Vec<Vec<u8>> = (0..world)
                    .map(|r| {
                        let (len, _) = buffer_lens(kind, 33, world, r, desc.root);
                        (0..len)
                            .flat_map(|_| f16::from_f32(rng.gen::<f32>()).to_le_bytes())
                            .collect()
                    })
                    .collect();
                assert_eq!(
                    mem::run_all(&desc, world, &ins).unwrap(),
                    mem::run_all(&desc, world, &ins).unwrap()
                );
            }
        }
    }
}

/// Structural properties the peer relies on, beyond what the executor checks.
#[test]
fn schedules_have_aligned_steps_and_finalize_once() {
    for kind in CollectiveKind::ALL
        .into_iter()
        .filter(|k| *k != CollectiveKind::SendRecv)
    {
        for &algo in available_algos(kind) {
            for world in 1..=9u32 {
                for count in [0u64, 5, 17] {
                    let desc = Descriptor {
                        kind,
                        dtype: DType::F32,
                        op: ReduceOp::Avg,
                        algo,
                        root: world / 2,
                        count,
                    };
                    let scheds: Vec<_> = (0..world)
                        .map(|r| build(&desc, r, world).unwrap())
                        .collect();
                    for (r, s) in scheds.iter().enumerate() {
                        s.validate_for(r as u32, world).unwrap();
                        assert_eq!(
                            s.steps.len(),
                            scheds[0].steps.len(),
                            "{desc} world {world} rank {r}"
                        );
                        assert_eq!(s.algo, algo);
                    }
                    // Each output element of a reduction is finalized exactly once in
                    // the world (by one rank) or once on every rank (identically).
                    if kind.reduces() && count > 0 {
                        let fin = |s: &eccl_algorithms::Schedule| -> Vec<usize> {
                            let mut hits = vec![0; s.output_len];
                            for p in s.steps.iter().flat_map(|st| &st.prims) {
                                if let eccl_algorithms::Prim::Finalize { region } = p {
                                    for h in &mut hits[region.offset..region.end()] {
                                        *h += 1;
                                    }
                                }
                            }
                            hits
                        };
                        for s in &scheds {
                            assert!(fin(s).iter().all(|&h| h <= 1), "{desc} world {world}");
                        }
                        let total: usize =
                            scheds.iter().map(|s| fin(s).iter().sum::<usize>()).sum();
                        let per_element = match kind {
                            CollectiveKind::AllReduce if algo == Algo::Direct => world as usize,
                            _ => 1,
                        };
                        let elements = if kind == CollectiveKind::ReduceScatter {
                            count as usize * world as usize
                        } else {
                            count as usize
                        };
                        assert_eq!(total, elements * per_element, "{desc} world {world}");
                    }
                }
            }
        }
    }
}
