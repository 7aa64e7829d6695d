//! Reduction kernels on byte slices, one monomorphized loop per (dtype, operator).
//!
//! Buffers arrive as bytes because they come from sockets and from callers of every
//! type. Each entry point dispatches once on `(DType, ReduceOp)` to a generic loop over
//! typed slices; the operator is a zero-sized type whose `combine` is `#[inline(always)]`,
//! so each loop is a plain element-wise zip that LLVM vectorizes.
//!
//! None of these functions panics, whatever it is given:
//! - A slice that is not aligned for its dtype (a frame payload at an odd offset) takes
//!   an element-at-a-time loop with unaligned reads instead of the typed fast path.
//! - Slices of different lengths are combined over their common prefix of whole
//!   elements; bytes past it are left untouched.
//! - Combinations that [`ReduceOp::valid_for`] rejects (avg on an integer type, a bitwise
//!   operator on a float type) never reach here through [`crate::build`]; if they do,
//!   they reduce as `sum` and `finalize` leaves the buffer alone, rather than panic.
//!
//! Integer `sum` and `prod` wrap, like NCCL and two's-complement hardware. Floating
//! `min`/`max` are written `if a < b { a } else { b }` (and `>` for max): when either
//! operand is NaN the comparison is false and the *right* operand wins, so a NaN on the
//! right propagates and one on the left is dropped. Results are still the same on every
//! rank because every schedule fixes which operand is on which side.
//!
//! `f16` and `bf16` compute in `f32` and round back to nearest-even after every
//! operation. `f32` carries at least `2p + 2` significand bits for both (p = 11 and 8),
//! so this double rounding gives the correctly rounded half-precision result for `+` and
//! `*`, and it is what every rank computes. `f16`'s `sum`, `prod` and `avg` (the
//! gradients' operators) run a block at a time (`half.rs`): a block widened to
//! `f32` with F16C's eight-lane conversions where the CPU has them, combined in `f32`,
//! and rounded back the same way; the element loop asked the CPU for F16C on every value
//! and vectorized nothing (docs/measurements.md has the rates). `bf16` stays in the
//! element loop (blocks were slower: three passes over each block instead of one), with
//! its own conversions (`half.rs`): a shift, and a branch-free
//! rounding with `bf16::from_f32`'s results, which LLVM vectorizes better than `half`'s
//! branching one.

mod half;
mod par;

pub use par::{map_chunks, set_threads, threads, PAR_MIN_BYTES};

use ::half::{bf16, f16};
use bytemuck::Pod;
use eccl_protocol::{DType, ReduceOp};
use half::{half_blocks, half_map};

/// A binary reduction operator on `T`.
trait Combine<T> {
    fn combine(a: T, b: T) -> T;
}

struct Sum;
struct Prod;
struct Min;
struct Max;
struct BAnd;
struct BOr;
struct BXor;

macro_rules! int_ops {
    ($($t:ty),*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a.wrapping_add(b) } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a.wrapping_mul(b) } }
        impl Combine<$t> for Min { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if a < b { a } else { b } } }
        impl Combine<$t> for Max { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if a > b { a } else { b } } }
        impl Combine<$t> for BAnd { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a & b } }
        impl Combine<$t> for BOr { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a | b } }
        impl Combine<$t> for BXor { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a ^ b } }
    )*};
}
int_ops!(i8, u8, i32, i64);

macro_rules! float_ops {
    ($($t:ty),*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a + b } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { a * b } }
        impl Combine<$t> for Min { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if a < b { a } else { b } } }
        impl Combine<$t> for Max { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if a > b { a } else { b } } }
    )*};
}
float_ops!(f32, f64);

macro_rules! half_ops {
    ($($t:ty: $widen:path, $narrow:path, $inf:expr);*) => {$(
        impl Combine<$t> for Sum { #[inline(always)] fn combine(a: $t, b: $t) -> $t { $narrow($widen(a) + $widen(b)) } }
        impl Combine<$t> for Prod { #[inline(always)] fn combine(a: $t, b: $t) -> $t { $narrow($widen(a) * $widen(b)) } }
        // Min and max pick one operand unchanged, so no rounding is involved; they compare
        // the bits as the widened values compare (`half::half_lt`), without converting.
        impl Combine<$t> for Min { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if half::half_lt(a.to_bits(), b.to_bits(), $inf) { a } else { b } } }
        impl Combine<$t> for Max { #[inline(always)] fn combine(a: $t, b: $t) -> $t { if half::half_lt(b.to_bits(), a.to_bits(), $inf) { a } else { b } } }
    )*};
}
half_ops!(f16: f16::to_f32, f16::from_f32, 0x7c00; bf16: half::bf16_widen, half::bf16_narrow, 0x7f80);

/// A loop over typed elements, instantiated once per (type, operator) by [`dispatch`].
trait Visit {
    fn visit<T: Pod, O: Combine<T>>(self);
}

fn dispatch<V: Visit>(dtype: DType, op: ReduceOp, v: V) {
    match dtype {
        DType::F32 => float_op::<f32, V>(op, v),
        DType::F64 => float_op::<f64, V>(op, v),
        DType::F16 => float_op::<f16, V>(op, v),
        DType::BF16 => float_op::<bf16, V>(op, v),
        DType::I8 => int_op::<i8, V>(op, v),
        DType::U8 => int_op::<u8, V>(op, v),
        DType::I32 => int_op::<i32, V>(op, v),
        DType::I64 => int_op::<i64, V>(op, v),
    }
}

fn float_op<T: Pod, V: Visit>(op: ReduceOp, v: V)
where
    Sum: Combine<T>,
    Prod: Combine<T>,
    Min: Combine<T>,
    Max: Combine<T>,
{
    match op {
        // Avg accumulates as a sum and divides once in `finalize`. Bitwise operators are
        // invalid on floats (see the module docs); summing keeps this total.
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {
            v.visit::<T, Sum>()
        }
        ReduceOp::Prod => v.visit::<T, Prod>(),
        ReduceOp::Min => v.visit::<T, Min>(),
        ReduceOp::Max => v.visit::<T, Max>(),
    }
}

fn int_op<T: Pod, V: Visit>(op: ReduceOp, v: V)
where
    Sum: Combine<T>,
    Prod: Combine<T>,
    Min: Combine<T>,
    Max: Combine<T>,
    BAnd: Combine<T>,
    BOr: Combine<T>,
    BXor: Combine<T>,
{
    match op {
        // Avg is invalid on integers (see the module docs); summing keeps this total.
        ReduceOp::Sum | ReduceOp::Avg => v.visit::<T, Sum>(),
        ReduceOp::Prod => v.visit::<T, Prod>(),
        ReduceOp::Min => v.visit::<T, Min>(),
        ReduceOp::Max => v.visit::<T, Max>(),
        ReduceOp::BAnd => v.visit::<T, BAnd>(),
        ReduceOp::BOr => v.visit::<T, BOr>(),
        ReduceOp::BXor => v.visit::<T, BXor>(),
    }
}

#[inline(always)]
fn read<T: Pod>(b: &[u8]) -> T {
    // `chunks_exact` hands us exactly size_of::<T>() bytes, so this never fails; the
    // fallback only keeps the function total.
    bytemuck::try_pod_read_unaligned(b).unwrap_or_else(|_| T::zeroed())
}

#[inline(always)]
fn write<T: Pod>(b: &mut [u8], v: T) {
    let src = bytemuck::bytes_of(&v);
    if b.len() == src.len() {
        b.copy_from_slice(src);
    }
}

struct InPlace<'a> {
    dst: &'a mut [u8],
    src: &'a [u8],
    /// `dst = src ⊕ dst` instead of `dst = dst ⊕ src`.
    rev: bool,
}

impl Visit for InPlace<'_> {
    fn visit<T: Pod, O: Combine<T>>(self) {
        let size = std::mem::size_of::<T>();
        let bytes = self.dst.len().min(self.src.len()) / size * size;
        let (dst, src) = (&mut self.dst[..bytes], &self.src[..bytes]);
        if let (Ok(d), Ok(s)) = (
            bytemuck::try_cast_slice_mut::<u8, T>(&mut *dst),
            bytemuck::try_cast_slice::<u8, T>(src),
        ) {
            // Two loops rather than a branch inside one, so each stays a clean zip.
            if self.rev {
                for (x, y) in d.iter_mut().zip(s) {
                    *x = O::combine(*y, *x);
                }
            } else {
                for (x, y) in d.iter_mut().zip(s) {
                    *x = O::combine(*x, *y);
                }
            }
            return;
        }
        for (x, y) in dst.chunks_exact_mut(size).zip(src.chunks_exact(size)) {
            let (a, b) = (read::<T>(x), read::<T>(y));
            write(
                x,
                if self.rev {
                    O::combine(b, a)
                } else {
                    O::combine(a, b)
                },
            );
        }
    }
}

struct Into3<'a> {
    dst: &'a mut [u8],
    a: &'a [u8],
    b: &'a [u8],
}

impl Visit for Into3<'_> {
    fn visit<T: Pod, O: Combine<T>>(self) {
        let size = std::mem::size_of::<T>();
        let bytes = self.dst.len().min(self.a.len()).min(self.b.len()) / size * size;
        let (dst, a, b) = (&mut self.dst[..bytes], &self.a[..bytes], &self.b[..bytes]);
        if let (Ok(d), Ok(x), Ok(y)) = (
            bytemuck::try_cast_slice_mut::<u8, T>(&mut *dst),
            bytemuck::try_cast_slice::<u8, T>(a),
            bytemuck::try_cast_slice::<u8, T>(b),
        ) {
            for ((d, x), y) in d.iter_mut().zip(x).zip(y) {
                *d = O::combine(*x, *y);
            }
            return;
        }
        for ((d, x), y) in dst
            .chunks_exact_mut(size)
            .zip(a.chunks_exact(size))
            .zip(b.chunks_exact(size))
        {
            write(d, O::combine(read::<T>(x), read::<T>(y)));
        }
    }
}

/// `dst = dst ⊕ src`, element-wise over the common whole-element prefix; a large one
/// split over [`threads`] threads.
pub fn reduce_inplace(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    if par::in_parts(dtype.size(), dst, src, None, |d, s, _| {
        reduce_inplace_one(dtype, op, d, s)
    }) {
        return;
    }
    reduce_inplace_one(dtype, op, dst, src)
}

fn reduce_inplace_one(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    if half_blocks(dtype, op, dst, src, None, false) {
        return;
    }
    dispatch(
        dtype,
        op,
        InPlace {
            dst,
            src,
            rev: false,
        },
    );
}

/// `dst = src ⊕ dst`: the incoming operand on the left, as [`crate::Prim::RecvReduce`]
/// defines it.
pub fn reduce_inplace_rev(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    if par::in_parts(dtype.size(), dst, src, None, |d, s, _| {
        reduce_inplace_rev_one(dtype, op, d, s)
    }) {
        return;
    }
    reduce_inplace_rev_one(dtype, op, dst, src)
}

fn reduce_inplace_rev_one(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    if half_blocks(dtype, op, dst, src, None, true) {
        return;
    }
    dispatch(
        dtype,
        op,
        InPlace {
            dst,
            src,
            rev: true,
        },
    );
}

/// `dst = a ⊕ b`, element-wise over the common whole-element prefix of all three.
pub fn reduce_to(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    if par::in_parts(dtype.size(), dst, a, Some(b), |d, x, y| {
        reduce_to_one(dtype, op, d, x, y.unwrap_or_default())
    }) {
        return;
    }
    reduce_to_one(dtype, op, dst, a, b)
}

fn reduce_to_one(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    if half_blocks(dtype, op, dst, a, Some(b), false) {
        return;
    }
    dispatch(dtype, op, Into3 { dst, a, b });
}

#[inline(always)]
fn map_inplace<T: Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    let size = std::mem::size_of::<T>();
    let bytes = buf.len() / size * size;
    let buf = &mut buf[..bytes];
    if let Ok(xs) = bytemuck::try_cast_slice_mut::<u8, T>(&mut *buf) {
        for x in xs.iter_mut() {
            *x = f(*x);
        }
        return;
    }
    for x in buf.chunks_exact_mut(size) {
        write(x, f(read::<T>(x)));
    }
}

/// Turns a finished reduction into the operator's result: for `avg` divides every
/// element by `world` (once; the schedule guarantees each element is finalized by one
/// rank or identically by all); for every other operator, does nothing.
///
/// Also a no-op for `world <= 1` (dividing by one is the identity, and zero is no
/// world), and for integer types, where `avg` is invalid.
pub fn finalize(dtype: DType, op: ReduceOp, buf: &mut [u8], world: usize) {
    if op != ReduceOp::Avg || world <= 1 {
        return;
    }
    match dtype {
        DType::F32 => {
            let w = world as f32;
            map_inplace::<f32>(buf, |x| x / w)
        }
        DType::F64 => {
            let w = world as f64;
            map_inplace::<f64>(buf, |x| x / w)
        }
        DType::F16 => {
            let w = world as f32;
            if !half_map::<f16>(buf, w) {
                map_inplace::<f16>(buf, |x| f16::from_f32(x.to_f32() / w))
            }
        }
        DType::BF16 => {
            let w = world as f32;
            map_inplace::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / w))
        }
        DType::I8 | DType::U8 | DType::I32 | DType::I64 => {}
    }
}

#[cfg(test)]
mod tests {
    use super::half::{bf16_narrow, bf16_widen, HALF_BLOCK};
    use super::*;

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn typed<T: Pod>(b: &[u8]) -> Vec<T> {
        b.chunks_exact(std::mem::size_of::<T>())
            .map(|c| bytemuck::pod_read_unaligned(c))
            .collect()
    }

    #[test]
    fn integer_ops_wrap_and_combine_bits() {
        let mut d = bytes(&[100i8, -100, 5, 7]);
        reduce_inplace(
            DType::I8,
            ReduceOp::Sum,
            &mut d,
            &bytes(&[100i8, -100, -5, 1]),
        );
        assert_eq!(typed::<i8>(&d), vec![-56, 56, 0, 8]);

        let mut d = bytes(&[i32::MAX, 3]);
        reduce_inplace(DType::I32, ReduceOp::Prod, &mut d, &bytes(&[2i32, -4]));
        assert_eq!(typed::<i32>(&d), vec![i32::MAX.wrapping_mul(2), -12]);

        let a = bytes(&[0b1100u8, 0xff]);
        let b = bytes(&[0b1010u8, 0x0f]);
        for (op, want) in [
            (ReduceOp::BAnd, [0b1000u8, 0x0f]),
            (ReduceOp::BOr, [0b1110, 0xff]),
            (ReduceOp::BXor, [0b0110, 0xf0]),
            (ReduceOp::Min, [0b1010, 0x0f]),
            (ReduceOp::Max, [0b1100, 0xff]),
        ] {
            let mut d = vec![0u8; 2];
            reduce_to(DType::U8, op, &mut d, &a, &b);
            assert_eq!(d, want, "{op}");
        }

        let mut d = bytes(&[-1i64, 6]);
        reduce_inplace(DType::I64, ReduceOp::BAnd, &mut d, &bytes(&[0x55i64, 3]));
        assert_eq!(typed::<i64>(&d), vec![0x55, 2]);
    }

    #[test]
    fn float_ops_and_avg_finalize() {
        let mut d = bytes(&[1.5f32, -2.0, 3.0]);
        reduce_inplace(
            DType::F32,
            ReduceOp::Avg,
            &mut d,
            &bytes(&[2.5f32, 4.0, -1.0]),
        );
        assert_eq!(typed::<f32>(&d), vec![4.0, 2.0, 2.0]);
        finalize(DType::F32, ReduceOp::Avg, &mut d, 4);
        assert_eq!(typed::<f32>(&d), vec![1.0, 0.5, 0.5]);
        // Other operators and integer avg leave the buffer alone.
        finalize(DType::F32, ReduceOp::Sum, &mut d, 4);
        assert_eq!(typed::<f32>(&d), vec![1.0, 0.5, 0.5]);
        let mut i = bytes(&[8i32]);
        finalize(DType::I32, ReduceOp::Avg, &mut i, 4);
        assert_eq!(typed::<i32>(&i), vec![8]);

        let mut d = bytes(&[3.0f64, 1.0]);
        reduce_inplace(DType::F64, ReduceOp::Prod, &mut d, &bytes(&[0.5f64, -2.0]));
        assert_eq!(typed::<f64>(&d), vec![1.5, -2.0]);
        finalize(DType::F64, ReduceOp::Avg, &mut d, 3);
        assert_eq!(typed::<f64>(&d), vec![0.5, -2.0 / 3.0]);

        let mut d = bytes(&[1.0f32, 5.0]);
        reduce_inplace(DType::F32, ReduceOp::Min, &mut d, &bytes(&[2.0f32, -5.0]));
        assert_eq!(typed::<f32>(&d), vec![1.0, -5.0]);
        reduce_inplace(DType::F32, ReduceOp::Max, &mut d, &bytes(&[2.0f32, -6.0]));
        assert_eq!(typed::<f32>(&d), vec![2.0, -5.0]);
    }

    #[test]
    fn nan_in_min_max_follows_operand_order() {
        // dst ⊕ src with NaN on the right propagates; on the left it is dropped.
        let mut d = bytes(&[1.0f32]);
        reduce_inplace(DType::F32, ReduceOp::Min, &mut d, &bytes(&[f32::NAN]));
        assert!(typed::<f32>(&d)[0].is_nan());
        let mut d = bytes(&[1.0f32]);
        reduce_inplace_rev(DType::F32, ReduceOp::Min, &mut d, &bytes(&[f32::NAN]));
        assert_eq!(typed::<f32>(&d), vec![1.0]);
    }

    #[test]
    fn rev_agrees_on_commutative_operators() {
        // Only NaN under min/max tells the sides apart (see above); for commutative
        // operators both directions must agree.
        let a = bytes(&[3i32, -7, 11]);
        let b = bytes(&[5i32, 2, -1]);
        let mut f = a.clone();
        let mut r = a.clone();
        reduce_inplace(DType::I32, ReduceOp::Sum, &mut f, &b);
        reduce_inplace_rev(DType::I32, ReduceOp::Sum, &mut r, &b);
        assert_eq!(f, r);
    }

    #[test]
    fn half_types_round_to_nearest_even() {
        let one = f16::from_f32(1.0);
        let tie = f16::from_f32(2f32.powi(-11)); // half an ulp of 1.0
        let above = f16::from_f32(3.0 * 2f32.powi(-11));
        let mut d = bytes(&[one, one]);
        reduce_inplace(DType::F16, ReduceOp::Sum, &mut d, &bytes(&[tie, above]));
        assert_eq!(
            typed::<f16>(&d),
            vec![one, f16::from_f32(1.0 + 2f32.powi(-9))]
        );

        let one = bf16::from_f32(1.0);
        let tie = bf16::from_f32(2f32.powi(-8));
        let mut d = bytes(&[one, bf16::from_f32(3.0)]);
        reduce_inplace(
            DType::BF16,
            ReduceOp::Sum,
            &mut d,
            &bytes(&[tie, bf16::from_f32(4.0)]),
        );
        assert_eq!(typed::<bf16>(&d), vec![one, bf16::from_f32(7.0)]);

        let mut d = bytes(&[bf16::from_f32(-1.0), bf16::from_f32(2.0)]);
        reduce_inplace(
            DType::BF16,
            ReduceOp::Max,
            &mut d,
            &bytes(&[bf16::from_f32(0.5), bf16::from_f32(1.0)]),
        );
        assert_eq!(
            typed::<bf16>(&d),
            vec![bf16::from_f32(0.5), bf16::from_f32(2.0)]
        );

        let mut d = bytes(&[f16::from_f32(3.0), f16::from_f32(1.0)]);
        finalize(DType::F16, ReduceOp::Avg, &mut d, 2);
        assert_eq!(
            typed::<f16>(&d),
            vec![f16::from_f32(1.5), f16::from_f32(0.5)]
        );
        let mut d = bytes(&[bf16::from_f32(1.0)]);
        finalize(DType::BF16, ReduceOp::Avg, &mut d, 3);
        assert_eq!(typed::<bf16>(&d), vec![bf16::from_f32(1.0 / 3.0)]);
    }

    #[test]
    fn misaligned_slices_give_the_aligned_result() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                let size = dtype.size();
                let n = 37;
                let a: Vec<u8> = (0..n * size).map(|i| (i * 7 + 3) as u8).collect();
                let b: Vec<u8> = (0..n * size).map(|i| (i * 13 + 1) as u8).collect();
                let mut want = a.clone();
                reduce_inplace(dtype, op, &mut want, &b);
                let mut want_rev = a.clone();
                reduce_inplace_rev(dtype, op, &mut want_rev, &b);
                let mut want_fin = a.clone();
                finalize(dtype, op, &mut want_fin, 3);

                // Offset every buffer by one byte so no typed view is possible.
                let shift = |v: &[u8]| {
                    let mut s = vec![0u8; v.len() + 1];
                    s[1..].copy_from_slice(v);
                    s
                };
                let mut d = shift(&a);
                reduce_inplace(dtype, op, &mut d[1..], &shift(&b)[1..]);
                assert_eq!(&d[1..], &want[..], "{dtype} {op}");
                let mut d = shift(&a);
                reduce_inplace_rev(dtype, op, &mut d[1..], &shift(&b)[1..]);
                assert_eq!(&d[1..], &want_rev[..], "{dtype} {op} rev");
                let mut d = vec![0u8; a.len() + 1];
                reduce_to(dtype, op, &mut d[1..], &shift(&a)[1..], &shift(&b)[1..]);
                assert_eq!(&d[1..], &want[..], "{dtype} {op} to");
                let mut d = shift(&a);
                finalize(dtype, op, &mut d[1..], 3);
                assert_eq!(&d[1..], &want_fin[..], "{dtype} {op} finalize");
            }
        }
    }

    #[test]
    fn mismatched_lengths_use_the_common_whole_element_prefix() {
        let mut d = bytes(&[1.0f32, 2.0, 3.0]);
        d.push(0xAA); // a stray byte past the last whole element
        let s = bytes(&[10.0f32, 20.0]);
        reduce_inplace(DType::F32, ReduceOp::Sum, &mut d, &s[..7]); // 1.75 elements
        assert_eq!(typed::<f32>(&d[..12]), vec![11.0, 2.0, 3.0]);
        assert_eq!(d[12], 0xAA);

        let mut d = vec![0u8; 8];
        reduce_to(
            DType::I32,
            ReduceOp::Sum,
            &mut d,
            &bytes(&[1i32, 2]),
            &bytes(&[5i32]),
        );
        assert_eq!(typed::<i32>(&d), vec![6, 0]);

        // Empty and odd-sized buffers are fine too.
        reduce_inplace(DType::F64, ReduceOp::Max, &mut [], &[1, 2, 3]);
        finalize(DType::F16, ReduceOp::Avg, &mut [1], 2);
        finalize(DType::F32, ReduceOp::Avg, &mut [0; 4], 0);
    }

    #[test]
    fn invalid_combinations_reduce_as_sum_without_panicking() {
        let mut d = bytes(&[3i32]);
        reduce_inplace(DType::I32, ReduceOp::Avg, &mut d, &bytes(&[4i32]));
        assert_eq!(typed::<i32>(&d), vec![7]);
        let mut d = bytes(&[3.0f32]);
        reduce_inplace(DType::F32, ReduceOp::BXor, &mut d, &bytes(&[4.0f32]));
        assert_eq!(typed::<f32>(&d), vec![7.0]);
    }

    /// The halves of `a` and `b` are equal bit for bit, or both NaN: which NaN an
    /// operation on two NaNs gives is the CPU's choice (LLVM may swap the operands of a
    /// vectorized add), in the element loop as in the blocks.
    fn same_halves(dtype: DType, a: &[u8], b: &[u8]) -> bool {
        let nan = |x: u16| match dtype {
            DType::F16 => f16::from_bits(x).is_nan(),
            _ => bf16::from_bits(x).is_nan(),
        };
        let halves = |v: &[u8]| -> Vec<u16> { typed::<u16>(v) };
        a.len() == b.len()
            && halves(a)
                .iter()
                .zip(halves(b))
                .all(|(x, y)| *x == y || (nan(*x) && nan(y)))
    }

    /// The branch-free bf16 rounding gives `bf16::from_f32`'s bits for every f32 class:
    /// random bit patterns, ties, the largest finite values, infinities, NaNs.
    #[test]
    fn bf16_narrow_is_half_from_f32() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let special = [
            0u32,
            0x8000_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xff81_2345,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x0000_8000,
            0x0001_8000,
        ];
        let random = (0..200_000).map(|_| rng.gen::<u32>());
        for bits in special.into_iter().chain(random) {
            let f = f32::from_bits(bits);
            assert_eq!(
                bf16_narrow(f).to_bits(),
                bf16::from_f32(f).to_bits(),
                "{bits:#x}"
            );
            // Widening keeps a signaling NaN's bits where `to_f32` makes it quiet; the
            // arithmetic that follows makes it quiet either way.
            let h = bf16::from_bits((bits >> 16) as u16);
            let (w, want) = (bf16_widen(h), h.to_f32());
            assert!(
                w.to_bits() == want.to_bits() || (w.is_nan() && want.is_nan()),
                "{bits:#x}"
            );
        }
    }

    /// Min and max on half bits choose the operand the widened comparison chooses, for
    /// every class: NaNs (either side: the second operand), both zeros (the second),
    /// subnormals, infinities, and random bit patterns.
    #[test]
    fn half_min_max_compare_as_the_widened_values() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let special: [u16; 12] = [
            0, 0x8000, 1, 0x8001, 0x3c00, 0xbc00, 0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7c01, 0xff81,
        ];
        let pairs = special
            .iter()
            .flat_map(|&a| special.iter().map(move |&b| (a, b)))
            .chain((0..500_000).map(|_| (rng.gen::<u16>(), rng.gen::<u16>())));
        for (a, b) in pairs {
            let (x, y) = (f16::from_bits(a), f16::from_bits(b));
            let want = |lt: bool| if lt { a } else { b };
            assert_eq!(
                <Min as Combine<f16>>::combine(x, y).to_bits(),
                want(x.to_f32() < y.to_f32()),
                "f16 min {a:#x} {b:#x}"
            );
            assert_eq!(
                <Max as Combine<f16>>::combine(x, y).to_bits(),
                want(x.to_f32() > y.to_f32()),
                "f16 max {a:#x} {b:#x}"
            );
            let (x, y) = (bf16::from_bits(a), bf16::from_bits(b));
            assert_eq!(
                <Min as Combine<bf16>>::combine(x, y).to_bits(),
                want(x.to_f32() < y.to_f32()),
                "bf16 min {a:#x} {b:#x}"
            );
            assert_eq!(
                <Max as Combine<bf16>>::combine(x, y).to_bits(),
                want(x.to_f32() > y.to_f32()),
                "bf16 max {a:#x} {b:#x}"
            );
        }
    }

    /// The blocked half-precision path gives the element loop's bits for every operand
    /// order, every bit pattern (NaNs, infinities, subnormals, both zeros), lengths that
    /// are not a multiple of the block, and `avg`'s division; unaligned slices take the
    /// element loop.
    #[test]
    fn half_blocks_give_the_element_loops_bits() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for dtype in [DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Avg] {
                for n in [1usize, 7, HALF_BLOCK, 3 * HALF_BLOCK + 5] {
                    let bits = |rng: &mut rand::rngs::StdRng| -> Vec<u8> {
                        (0..n)
                            .flat_map(|_| rng.gen::<u16>().to_ne_bytes())
                            .collect()
                    };
                    let (x, y, z) = (bits(&mut rng), bits(&mut rng), bits(&mut rng));
                    for rev in [false, true] {
                        let mut blocked = x.clone();
                        let mut element = x.clone();
                        if rev {
                            reduce_inplace_rev(dtype, op, &mut blocked, &y);
                        } else {
                            reduce_inplace(dtype, op, &mut blocked, &y);
                        }
                        let (dst, src) = (&mut element[..], &y[..]);
                        dispatch(dtype, op, InPlace { dst, src, rev });
                        assert!(
                            same_halves(dtype, &blocked, &element),
                            "{dtype:?} {op:?} n={n} rev={rev}"
                        );
                    }
                    let mut blocked = z.clone();
                    let mut element = z.clone();
                    reduce_to(dtype, op, &mut blocked, &x, &y);
                    let (a, b) = (&x[..], &y[..]);
                    dispatch(
                        dtype,
                        op,
                        Into3 {
                            dst: &mut element,
                            a,
                            b,
                        },
                    );
                    assert!(
                        same_halves(dtype, &blocked, &element),
                        "{dtype:?} {op:?} n={n} into"
                    );
                    let mut blocked = x.clone();
                    finalize(dtype, op, &mut blocked, 3);
                    let mut element = x.clone();
                    if op == ReduceOp::Avg {
                        match dtype {
                            DType::F16 => map_inplace::<f16>(&mut element, |v| {
                                f16::from_f32(v.to_f32() / 3.0)
                            }),
                            _ => map_inplace::<bf16>(&mut element, |v| {
                                bf16::from_f32(v.to_f32() / 3.0)
                            }),
                        }
                    }
                    assert!(
                        same_halves(dtype, &blocked, &element),
                        "{dtype:?} {op:?} n={n} finalize"
                    );
                }
            }
        }
        // An odd offset: not aligned for halves, so the element loop (unaligned reads).
        let two = bytes(&[f16::from_f32(1.5), f16::from_f32(2.0)]);
        let (mut d, mut s) = ([0u16; 3], [0u16; 3]);
        let d = &mut bytemuck::cast_slice_mut::<u16, u8>(&mut d)[1..5];
        let s = &mut bytemuck::cast_slice_mut::<u16, u8>(&mut s)[1..5];
        d.copy_from_slice(&two);
        s.copy_from_slice(&two);
        reduce_inplace(DType::F16, ReduceOp::Sum, d, s);
        assert_eq!(
            typed::<f16>(d),
            vec![f16::from_f32(3.0), f16::from_f32(4.0)]
        );
    }

    #[test]
    fn a_reduction_split_over_threads_gives_the_same_bits() {
        // Varied values (NaNs and infinities among the floats' bit patterns), a length
        // that is no multiple of the part size, slices at an odd offset, every dtype, op
        // and form, on three threads against one.
        let n = 3 * PAR_MIN_BYTES + 4099;
        let pattern = |seed: u64| -> Vec<u8> {
            let mut x = seed;
            (0..n + 1)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 56) as u8
                })
                .collect()
        };
        let (a, b) = (pattern(1), pattern(2));
        for dtype in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|o| o.valid_for(dtype)) {
                for off in [0, 1] {
                    let run = |threads: usize| {
                        set_threads(threads);
                        #[cfg(feature = "parallel")]
                        assert_eq!(par::plan(n).is_some(), threads > 1, "the split is taken");
                        let mut fwd = a[off..].to_vec();
                        reduce_inplace(dtype, op, &mut fwd, &b[off..]);
                        let mut rev = a[off..].to_vec();
                        reduce_inplace_rev(dtype, op, &mut rev, &b[off..]);
                        let mut to = vec![0u8; n + 1 - off];
                        reduce_to(dtype, op, &mut to, &a[off..], &b[off..]);
                        set_threads(1);
                        (fwd, rev, to)
                    };
                    assert!(run(3) == run(1), "{dtype} {op:?} offset {off}");
                }
            }
        }
    }
}
