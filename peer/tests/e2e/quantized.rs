//! all_reduce_quantized (`Quantize::Int8` and `Fp8`) against a real master, three ranks: every rank
//! ends with the same bits, within the documented bound of the exact result (half a
//! step of each rank's block plus half a step of the sum's block), for f32, f16 and bf16,
//! sum and avg; what it cannot do is refused on the spot with a reason, and the world
//! goes on.

use crate::common::*;
use eccl::{Quantize, ReduceOp};
use futures::future::join_all;
use half::{bf16, f16};

/// Rank r's value at element k: smooth, signed, a different range on every rank.
fn value(r: usize, k: usize) -> f32 {
    ((k as f32 * 0.013 + r as f32).sin() * (r as f32 + 1.0) * 3.0) + (k % 7) as f32 * 0.01
}

/// The bound for element `k` of `count`, summed over `n` ranks' blocks and the sum's.
fn bound(q: Quantize, n: usize, count: usize, k: usize, exact: &[f32], avg: bool) -> f32 {
    match q {
        Quantize::Int8 => bound_int8(n, count, k, exact, avg),
        Quantize::Fp8 => bound_fp8(n, count, k, exact, avg),
    }
}

/// Element `k`'s block (of the segment it is in): its index range.
fn block_of(n: usize, count: usize, k: usize) -> std::ops::Range<usize> {
    const BLOCK: usize = eccl_algorithms::quant::BLOCK;
    let seg = count.div_ceil(n);
    let start = (k / seg) * seg + ((k % seg) / BLOCK) * BLOCK;
    start..(start + BLOCK).min((k / seg + 1) * seg).min(count)
}

/// FP8 E4M3 per block: each value within max(|v| / 16, scale / 1024), scale = the
/// block's largest magnitude over 448.
fn bound_fp8(n: usize, count: usize, k: usize, exact: &[f32], avg: bool) -> f32 {
    let b = block_of(n, count, k);
    let one = |v: f32, peak: f32| (v.abs() / 16.0).max(peak / 448.0 / 1024.0);
    let peak = |f: &dyn Fn(usize) -> f32| b.clone().map(|i| f(i).abs()).fold(0f32, f32::max);
    let inputs: f32 = (0..n)
        .map(|r| one(value(r, k), peak(&|i| value(r, i))))
        .sum();
    let scale = if avg { 1.0 / n as f32 } else { 1.0 };
    // The sum as computed is within `inputs` of the exact one.
    let sum = one(
        exact[k].abs() / scale + inputs,
        peak(&|i| exact[i] / scale) + 2.0 * inputs,
    );
    (inputs + sum) * scale * 1.01 + 1e-5 * exact[k].abs().max(1.0)
}

fn bound_int8(n: usize, count: usize, k: usize, exact: &[f32], avg: bool) -> f32 {
    const BLOCK: usize = eccl_algorithms::quant::BLOCK;
    // Ranks own segments of ceil(count / n); blocks of 256 start at each segment's start.
    let seg = count.div_ceil(n);
    let start = (k / seg) * seg + ((k % seg) / BLOCK) * BLOCK;
    let end = (start + BLOCK).min((k / seg + 1) * seg).min(count);
    let range = |f: &dyn Fn(usize) -> f32| {
        let (lo, hi) = (start..end).fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), i| {
            (lo.min(f(i)), hi.max(f(i)))
        });
        hi - lo
    };
    let inputs: f32 = (0..n).map(|r| range(&|i| value(r, i)) / 510.0).sum();
    let scale = if avg { 1.0 / n as f32 } else { 1.0 };
    // The sum's block range, with room for the inputs' error in it; f32 rounding on top.
    let sum = (range(&|i| exact[i] / scale) + 2.0 * inputs) / 510.0;
    (inputs + sum) * scale * 1.01 + 1e-5 * exact[k].abs().max(1.0)
}

/// A call of several pieces (`QUANT_PIECE_VALUES` per rank's segment, the codec of one
/// piece beside the collective of another) gives, on every rank, exactly the bits of the
/// scheme done in one pass: every other rank's segment encoded whole, decoded and added in
/// rank order by its owner (its own values added as they are), the sum encoded once and
/// decoded by all. f32 aligned for it is read and written in place, f32 that is not
/// (bytes one past an aligned start) is widened first: the same bits either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quantized_all_reduce_in_pieces_gives_the_bits_of_one_pass() {
    use eccl_algorithms::quant;
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    let n = comms.len();
    // Two and a half pieces per segment, the last segment padded.
    let count = n * (eccl::QUANT_PIECE_VALUES * 5 / 2) - 7;
    for (q, codec) in [
        (Quantize::Int8, quant::Codec::Int8),
        (Quantize::Fp8, quant::Codec::Fp8),
    ] {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let seg = count.div_ceil(n);
            let e = quant::encoded_len(seg);
            let padded = |r: usize| {
                let mut v: Vec<f32> = (0..count).map(|k| value(r, k)).collect();
                let last = *v.last().unwrap();
                v.resize(seg * n, last);
                v
            };
            let mut want = vec![0f32; seg * n];
            let inputs: Vec<Vec<f32>> = (0..n).map(padded).collect();
            for owner in 0..n {
                let mut sum = vec![0f32; seg];
                let mut enc = vec![0u8; e];
                for (r, input) in inputs.iter().enumerate() {
                    let part = &input[owner * seg..(owner + 1) * seg];
                    if r == owner {
                        // The owner's own values are added as they are.
                        sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
                    } else {
                        quant::encode(codec, part, &mut enc);
                        quant::decode_add(codec, &enc, &mut sum);
                    }
                }
                if op == ReduceOp::Avg {
                    sum.iter_mut().for_each(|x| *x /= n as f32);
                }
                quant::encode(codec, &sum, &mut enc);
                quant::decode(codec, &enc, &mut want[owner * seg..(owner + 1) * seg]);
            }
            // Sums on aligned f32, averages on bytes that are not aligned for f32.
            let got = join_all(comms.iter_mut().map(|c| async move {
                let r = c.rank().unwrap().0 as usize;
                let mut v: Vec<f32> = (0..count).map(|k| value(r, k)).collect();
                if op == ReduceOp::Sum {
                    c.all_reduce_quantized(&mut v, op, q)
                        .await
                        .expect("in pieces");
                    return v;
                }
                let mut bytes = vec![0u8; count * 4 + 1];
                assert_ne!(
                    bytes[1..].as_ptr() as usize % 4,
                    0,
                    "bytes not aligned for f32"
                );
                bytes[1..].copy_from_slice(bytemuck::cast_slice(&v));
                c.all_reduce_quantized_bytes(eccl::DType::F32, &mut bytes[1..], op, q)
                    .await
                    .expect("in pieces, unaligned");
                for (x, b) in v.iter_mut().zip(bytes[1..].chunks_exact(4)) {
                    *x = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                }
                v
            }))
            .await;
            for (r, v) in got.iter().enumerate() {
                let differ = v
                    .iter()
                    .zip(&want[..count])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(
                    differ, 0,
                    "{q:?} {op}: rank {r}, elements that differ from one pass"
                );
            }
        }
    }
}

/// G2 in the middle of the pipeline: ranks 0 and 1 call with three pieces a segment,
/// rank 2 with one (so the collectives of its one piece are those of their first), and
/// then it leaves. Their calls fail in the second piece's all_to_all, after the first
/// piece's sums were gathered (and its decoding was next), and their buffers hold what
/// they held before the call; the two go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quantized_all_reduce_failing_after_its_first_piece_leaves_the_buffer_as_it_was() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    comms.sort_by_key(|c| c.rank().unwrap().0);
    let piece = eccl::QUANT_PIECE_VALUES;
    let mut third = comms.pop().expect("rank 2");
    let (survivors, ()) = tokio::join!(
        join_all(comms.iter_mut().map(|c| async move {
            let r = c.rank().unwrap().idx();
            let orig: Vec<f32> = (0..3 * piece * 3).map(|k| value(r, k)).collect();
            let mut b = orig.clone();
            let out = c
                .all_reduce_quantized(&mut b, ReduceOp::Sum, Quantize::Int8)
                .await;
            (r, out, b == orig)
        })),
        async {
            let mut b: Vec<f32> = (0..3 * piece).map(|k| value(2, k)).collect();
            third
                .all_reduce_quantized(&mut b, ReduceOp::Sum, Quantize::Int8)
                .await
                .expect("one piece: the collectives of the others' first");
            drop(third);
        }
    );
    for (r, out, unchanged) in &survivors {
        assert!(
            out.is_err(),
            "rank {r}: the second piece cannot end: {out:?}"
        );
        assert!(
            unchanged,
            "rank {r}: G2: the failed quantized call left its buffer changed"
        );
    }
    let epochs = join_all(comms.iter_mut().map(|c| c.update_topology())).await;
    assert!(
        epochs
            .iter()
            .all(|e| e.as_ref().is_ok_and(|t| t.world_size == 2)),
        "{epochs:?}"
    );
    let sums = join_all(comms.iter_mut().map(|c| async move {
        let mut b = vec![1.5f32; 1000];
        c.all_reduce_quantized(&mut b, ReduceOp::Sum, Quantize::Int8)
            .await
            .map(|_| b)
    }))
    .await;
    for s in sums {
        assert!(s.expect("the two go on").iter().all(|x| *x == 3.0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_all_reduce_is_identical_everywhere_and_within_its_bound() {
    let m = start_master(&[]);
    let mut comms = world(&m.addr, 3).await;
    let n = comms.len();
    for q in [Quantize::Int8, Quantize::Fp8] {
        for count in [1usize, 700, 10_001] {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let avg = op == ReduceOp::Avg;
                let exact: Vec<f32> = (0..count)
                    .map(|k| {
                        let s: f32 = (0..n).map(|r| value(r, k)).sum();
                        if avg {
                            s / n as f32
                        } else {
                            s
                        }
                    })
                    .collect();
                // f32
                let got = join_all(comms.iter_mut().map(|c| async move {
                    let r = c.rank().unwrap().0 as usize;
                    let mut v: Vec<f32> = (0..count).map(|k| value(r, k)).collect();
                    c.all_reduce_quantized(&mut v, op, q)
                        .await
                        .expect("quantized all_reduce");
                    v
                }))
                .await;
                for (r, v) in got.iter().enumerate() {
                    assert_eq!(
                        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        got[0].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "rank {r} differs from rank 0 ({count} f32, {op})"
                    );
                }
                let mut worst = 0f32;
                for k in 0..count {
                    let err = (got[0][k] - exact[k]).abs();
                    let b = bound(q, n, count, k, &exact, avg);
                    assert!(
                        err <= b,
                        "element {k} of {count} ({op}): {} vs {} (bound {b})",
                        got[0][k],
                        exact[k]
                    );
                    worst = worst.max(err / b);
                }
                // Quantized, not exact: some element moved (the bound is not vacuous).
                if count > 1 {
                    assert!(got[0] != exact, "{count} {op}: bit for bit the exact sum");
                    assert!(
                        worst > 0.01,
                        "{count} {op}: error far below the bound ({worst})"
                    );
                }
                // bf16 and f16: the same bits everywhere, the bound widened by their rounding.
                let halves = join_all(comms.iter_mut().map(|c| async move {
                    let r = c.rank().unwrap().0 as usize;
                    let mut b: Vec<bf16> =
                        (0..count).map(|k| bf16::from_f32(value(r, k))).collect();
                    let mut h: Vec<f16> = (0..count).map(|k| f16::from_f32(value(r, k))).collect();
                    c.all_reduce_quantized(&mut b, op, q).await.expect("bf16");
                    c.all_reduce_quantized(&mut h, op, q).await.expect("f16");
                    (b, h)
                }))
                .await;
                for (r, (b, h)) in halves.iter().enumerate() {
                    assert!(
                        b.iter()
                            .zip(&halves[0].0)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "rank {r} bf16"
                    );
                    assert!(
                        h.iter()
                            .zip(&halves[0].1)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "rank {r} f16"
                    );
                }
                // Against the exact result of the rounded inputs: the quantization's bound (a
                // little wider for the rounded inputs' ranges), then the output's rounding.
                let of = |round: fn(f32) -> f32| -> Vec<f32> {
                    (0..count)
                        .map(|k| {
                            let s: f32 = (0..n).map(|r| round(value(r, k))).sum();
                            if avg {
                                s / n as f32
                            } else {
                                s
                            }
                        })
                        .collect()
                };
                let exact_b = of(|v| bf16::from_f32(v).to_f32());
                let exact_h = of(|v| f16::from_f32(v).to_f32());
                for k in 0..count {
                    let b = bound(q, n, count, k, &exact, avg) * 1.05 + 1e-3;
                    let bf = halves[0].0[k].to_f32();
                    let hf = halves[0].1[k].to_f32();
                    let (eb, eh) = (exact_b[k], exact_h[k]);
                    assert!(
                        (bf - eb).abs() <= b + (eb.abs() + b) / 256.0,
                        "bf16 {k}: {bf} vs {eb}"
                    );
                    assert!(
                        (hf - eh).abs() <= b + (eh.abs() + b) / 2048.0,
                        "f16 {k}: {hf} vs {eh}"
                    );
                }
            }
        }
    }
    // Refused on every rank before anything is sent; the world goes on.
    for c in comms.iter_mut() {
        let e = c
            .all_reduce_quantized(&mut [1i32, 2], ReduceOp::Sum, Quantize::Int8)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("f32, f16 or bf16, not i32"), "{e}");
        let e = c
            .all_reduce_quantized(&mut [1f32, 2.0], ReduceOp::Max, Quantize::Int8)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("sum or avg"), "{e}");
    }
    let got = join_all(comms.iter_mut().map(|c| async move {
        let mut v = vec![1i64; 5];
        c.all_reduce(&mut v, ReduceOp::Sum)
            .await
            .expect("plain all_reduce after");
        v
    }))
    .await;
    assert!(got.iter().all(|v| v == &vec![3i64; 5]));
    assert_eq!(Quantize::parse("INT8"), Some(Quantize::Int8));
    assert_eq!(Quantize::parse("fp8"), Some(Quantize::Fp8));
    assert_eq!(Quantize::parse("fp4"), None);
}

/// `ECCL_ALGO=ring` over a solved ring: all_to_all relays every block around the ring
/// (exact), and the quantized all_reduce, whose all_to_all it is, gives the same bits on
/// every rank within the same bound (the owner receives the same codes either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_relayed_around_the_solved_ring_and_int8_over_it() {
    let m = start_master(&[]);
    let mut comms = world_with(&m.addr, 4, |c| c.algo = Some(eccl::Algo::Ring)).await;
    let ups = join_all(comms.iter_mut().map(|c| c.optimize_topology())).await;
    assert!(
        ups.iter()
            .all(|u| u.as_ref().is_ok_and(|u| u.ring.len() == 4)),
        "{ups:?}"
    );
    let n = comms.len();
    let c = 777usize;
    let got = join_all(comms.iter_mut().map(|comm| async move {
        let r = comm.rank().unwrap().0 as i64;
        let input: Vec<i64> = (0..(c * n) as i64).map(|k| r * 1_000_000 + k).collect();
        let mut out = vec![0i64; c * n];
        let info = comm
            .all_to_all_into(&input, &mut out)
            .await
            .expect("all_to_all");
        assert_eq!(info.algo, eccl::Algo::Ring);
        (r as usize, out)
    }))
    .await;
    for (r, out) in got {
        // Block j is rank j's input block r.
        let want: Vec<i64> = (0..n)
            .flat_map(|j| (0..c).map(move |k| j as i64 * 1_000_000 + (r * c + k) as i64))
            .collect();
        assert_eq!(out, want, "rank {r}");
    }
    let count = 10_001;
    let exact: Vec<f32> = (0..count)
        .map(|k| (0..n).map(|r| value(r, k)).sum())
        .collect();
    let got = join_all(comms.iter_mut().map(|comm| async move {
        let r = comm.rank().unwrap().0 as usize;
        let mut v: Vec<f32> = (0..count).map(|k| value(r, k)).collect();
        comm.all_reduce_quantized(&mut v, ReduceOp::Sum, Quantize::Int8)
            .await
            .expect("quantized all_reduce");
        v
    }))
    .await;
    for (r, v) in got.iter().enumerate() {
        assert!(
            v.iter()
                .zip(&got[0])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "rank {r} differs from rank 0"
        );
    }
    for k in 0..count {
        let b = bound(Quantize::Int8, n, count, k, &exact, false);
        assert!(
            (got[0][k] - exact[k]).abs() <= b,
            "element {k}: {} vs {}",
            got[0][k],
            exact[k]
        );
    }
}
