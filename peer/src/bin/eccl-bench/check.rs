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
