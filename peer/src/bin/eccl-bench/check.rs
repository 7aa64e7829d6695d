//! Closed-form inputs and expected outputs, so `-c` can check every element of every
//! rank without a reference run.
//!
//! Values are small integers: every sum over at most a few hundred ranks is exact in
//! every dtype (bf16 holds integers up to 256 exactly), so the expected bits do not
//! depend on the order of reduction. Products use only 1 and 2; integer types wrap the
//! way the kernels do (arithmetic modulo 2^bits).

use eccl::{CollectiveKind, DType, ReduceOp};
use half::{bf16, f16};

/// Input value of element `i` of rank `r`'s input.
pub fn input_value(kind: CollectiveKind, op: ReduceOp, r: usize, i: usize) -> i64 {
    if !kind.reduces() {
        // Data movement: distinct-looking values so a misplaced block shows.
        return ((r * 131 + i * 7) % 101) as i64;
    }
    match op {
        ReduceOp::Prod => ((r + i) % 2 + 1) as i64,
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => ((r * 37 + i * 11) & 0x7f) as i64,
        _ => ((r + i) % 4 + 1) as i64,
    }
}

fn fold(op: ReduceOp, vals: impl Iterator<Item = i64>) -> i64 {
    let mut it = vals;
    let first = it.next().unwrap_or(0);
    it.fold(first, |a, b| match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Prod => a.wrapping_mul(b),
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        ReduceOp::BAnd => a & b,
        ReduceOp::BOr => a | b,
        ReduceOp::BXor => a ^ b,
    })
}

/// Writes `v` as element `idx` of `buf`, wrapping integers to the type's width.
pub fn put(dtype: DType, buf: &mut [u8], idx: usize, v: i64) {
    let s = dtype.size();
    let b = &mut buf[idx * s..idx * s + s];
    match dtype {
        DType::F32 => b.copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F64 => b.copy_from_slice(&(v as f64).to_le_bytes()),
        DType::F16 => b.copy_from_slice(&f16::from_f64(v as f64).to_le_bytes()),
        DType::BF16 => b.copy_from_slice(&bf16::from_f64(v as f64).to_le_bytes()),
        DType::I8 | DType::U8 => b[0] = v as u8,
        DType::I32 => b.copy_from_slice(&(v as i32).to_le_bytes()),
        DType::I64 => b.copy_from_slice(&v.to_le_bytes()),
    }
}

/// The bytes of a finished average: the exact sum divided by `n` the way the kernels
/// divide (in f32 for the half types).
fn put_avg(dtype: DType, buf: &mut [u8], idx: usize, sum: i64, n: usize) {
    let s = dtype.size();
    let b = &mut buf[idx * s..idx * s + s];
    match dtype {
        DType::F32 => b.copy_from_slice(&(sum as f32 / n as f32).to_le_bytes()),
        DType::F64 => b.copy_from_slice(&(sum as f64 / n as f64).to_le_bytes()),
        DType::F16 => b.copy_from_slice(&f16::from_f32(sum as f32 / n as f32).to_le_bytes()),
        DType::BF16 => b.copy_from_slice(&bf16::from_f32(sum as f32 / n as f32).to_le_bytes()),
        _ => put(dtype, buf, idx, sum),
    }
}

pub struct Call {
    pub kind: CollectiveKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub root: usize,
    pub count: usize,
    pub world: usize,
    pub rank: usize,
}

/// Fills this rank's input.
pub fn fill_input(c: &Call, input: &mut [u8]) {
    for i in 0..input.len() / c.dtype.size() {
        put(c.dtype, input, i, input_value(c.kind, c.op, c.rank, i));
    }
}

/// Builds this rank's expected output (`None` where the rank has no output).
pub fn expected(c: &Call, out_len: usize) -> Vec<u8> {
    let s = c.dtype.size();
    let mut e = vec![0u8; out_len * s];
    let v = |r: usize, i: usize| input_value(c.kind, c.op, r, i);
    let reduce = |idx: usize, e: &mut [u8], at: usize| {
        let x = fold(c.op, (0..c.world).map(|r| v(r, idx)));
        if c.op == ReduceOp::Avg {
            put_avg(c.dtype, e, at, x, c.world)
        } else {
            put(c.dtype, e, at, x)
        }
    };
    let n = c.count;
    match c.kind {
        CollectiveKind::Broadcast => {
            (0..out_len).for_each(|i| put(c.dtype, &mut e, i, v(c.root, i)))
        }
        CollectiveKind::Reduce | CollectiveKind::AllReduce => {
            (0..out_len).for_each(|i| reduce(i, &mut e, i))
        }
        CollectiveKind::ReduceScatter => {
            (0..out_len).for_each(|i| reduce(c.rank * n + i, &mut e, i))
        }
        CollectiveKind::AllGather | CollectiveKind::Gather => {
            (0..out_len).for_each(|j| put(c.dtype, &mut e, j, v(j / n.max(1), j % n.max(1))))
        }
        CollectiveKind::AllToAll => (0..out_len).for_each(|j| {
            put(
                c.dtype,
                &mut e,
                j,
                v(j / n.max(1), c.rank * n + j % n.max(1)),
            )
        }),
        CollectiveKind::Scatter => {
            (0..out_len).for_each(|i| put(c.dtype, &mut e, i, v(c.root, c.rank * n + i)))
        }
        CollectiveKind::Barrier | CollectiveKind::SendRecv => {}
    }
    e
}

/// Number of elements of `got` that differ from `want`, bit for bit.
pub fn count_wrong(dtype: DType, got: &[u8], want: &[u8]) -> u64 {
    let s = dtype.size();
    got.chunks(s)
        .zip(want.chunks(s))
        .filter(|(a, b)| a != b)
        .count() as u64
        + (got.len().abs_diff(want.len()) / s) as u64
}

/// For an all_reduce with quantized values on the wire (`--quantize` with `-c`: Sum or
/// Avg of f32, f16 or bf16): each element's exact result (from the closed-form inputs,
/// in f64) and the documented bound of its error, block by block as the call encodes:
/// every rank owns a segment of `ceil(count / world)` elements cut in blocks of
/// `eccl_algorithms::quant::BLOCK`; each other rank's values are encoded once (int8: half
/// a step, the block's range over 255; fp8: `max(|v| / 16, scale / 1024)`, scale the
/// block's largest magnitude over 448), the owner's own values are added as they are,
/// and the sum is encoded once more; f16 and bf16 add their own rounding of the result.
pub fn quantized_bounds(c: &Call, fp8: bool) -> (Vec<f64>, Vec<f64>) {
    const BLOCK: usize = eccl_algorithms::quant::BLOCK;
    let (n, count) = (c.world.max(1), c.count);
    let v = |r: usize, i: usize| quantized_input(c.dtype, r, i);
    let avg = c.op == ReduceOp::Avg;
    let scale = if avg { 1.0 / n as f64 } else { 1.0 };
    let sums: Vec<f64> = (0..count).map(|i| (0..n).map(|r| v(r, i)).sum()).collect();
    let exact: Vec<f64> = sums.iter().map(|s| s * scale).collect();
    // The result's own rounding in a half type (half a unit in the last place).
    let narrow = match c.dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => 0.0,
    };
    let seg = count.div_ceil(n).max(1);
    let mut bound = vec![0.0; count];
    for owner in 0..n {
        let seg_end = ((owner + 1) * seg).min(count);
        let mut start = owner * seg;
        while start < seg_end {
            let block = start..(start + BLOCK).min(seg_end);
            // Each other rank's block, and the sum's: their ranges and largest magnitudes.
            let span = |f: &dyn Fn(usize) -> f64| {
                block.clone().fold(
                    (f64::INFINITY, f64::NEG_INFINITY, 0f64),
                    |(lo, hi, top), i| {
                        let x = f(i);
                        (lo.min(x), hi.max(x), top.max(x.abs()))
                    },
                )
            };
            let others: Vec<(f64, f64, f64)> = (0..n)
                .filter(|&r| r != owner)
                .map(|r| span(&|i| v(r, i)))
                .collect();
            let others_at: Vec<usize> = (0..n).filter(|&r| r != owner).collect();
            let (slo, shi, stop) = span(&|i| sums[i]);
            let one = |x: f64, top: f64| (x.abs() / 16.0).max(top / 448.0 / 1024.0);
            // fp8: each element's error from the other ranks' codes, and the block's
            // largest (the computed sums' largest magnitude is within it of the exact one).
            let fp8_inputs = |k: usize| -> f64 {
                others
                    .iter()
                    .zip(&others_at)
                    .map(|(&(_, _, top), &r)| one(v(r, k), top))
                    .sum()
            };
            let widest = if fp8 {
                block.clone().map(fp8_inputs).fold(0.0, f64::max)
            } else {
                0.0
            };
            for k in block.clone() {
                let b = if fp8 {
                    let inputs = fp8_inputs(k);
                    inputs + one(sums[k].abs() + inputs, stop + 2.0 * widest)
                } else {
                    let inputs: f64 = others.iter().map(|&(lo, hi, _)| (hi - lo) / 510.0).sum();
                    inputs + (shi - slo + 2.0 * inputs) / 510.0
                };
                // f32 arithmetic on top (the codec's steps and sums), and a half type's
                // rounding of the result.
                bound[k] =
                    b * scale * 1.01 + 1e-5 * exact[k].abs().max(1.0) + narrow * exact[k].abs();
            }
            start = block.end;
        }
    }
    (exact, bound)
}

/// Element `i` of rank `r`'s input to a quantized all_reduce, as `dtype` holds it:
/// smooth, signed, not whole numbers (which min-max codes of small integers would carry
/// exactly), a different range on every rank.
pub fn quantized_input(dtype: DType, r: usize, i: usize) -> f64 {
    let x = ((i as f64 * 0.013 + r as f64).sin() * (r as f64 + 1.0) * 3.0) + (i % 7) as f64 * 0.01;
    match dtype {
        DType::BF16 => bf16::from_f64(x).to_f64(),
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::F64 => x,
        _ => x as f32 as f64,
    }
}

/// Fills this rank's input to a quantized all_reduce ([`quantized_input`]).
pub fn fill_quantized_input(c: &Call, input: &mut [u8]) {
    let s = c.dtype.size();
    for i in 0..input.len() / s {
        let x = quantized_input(c.dtype, c.rank, i);
        let b = &mut input[i * s..i * s + s];
        match c.dtype {
            DType::BF16 => b.copy_from_slice(&bf16::from_f64(x).to_le_bytes()),
            DType::F16 => b.copy_from_slice(&f16::from_f64(x).to_le_bytes()),
            DType::F64 => b.copy_from_slice(&x.to_le_bytes()),
            _ => b.copy_from_slice(&(x as f32).to_le_bytes()),
        }
    }
}

/// Element `i` of `buf` (f32, f16 or bf16) as f64.
pub fn get_float(dtype: DType, buf: &[u8], i: usize) -> f64 {
    let s = dtype.size();
    let b = &buf[i * s..i * s + s];
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::F64 => f64::from_le_bytes(b.try_into().expect("8 bytes")),
        _ => panic!("get_float: {dtype} is not a float type"),
    }
}
