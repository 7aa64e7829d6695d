//! 8-bit quantization for all_reduce over slow links, two codecs ([`Codec`]):
//!
//! - `Int8` (min-max): each block of [`BLOCK`] values goes on the wire as its minimum and
//!   step (two f32) and one byte per value, `round((v - min) / step)`, `step = (max -
//!   min) / 255`. A value comes back within `step / 2` of what was encoded (plus f32
//!   rounding).
//! - `Fp8` (OCP FP8 E4M3, scaled per block like torchft's row-wise fp8): each block's
//!   scale is its largest magnitude over 448 (E4M3's largest finite value) and each value
//!   the E4M3 number nearest `v / scale` (ties to the even code). A value comes back
//!   within `max(|v| / 16, scale / 1024)`: half a unit of E4M3's 3-bit mantissa, or of
//!   its smallest subnormal.
//!
//! The quantized all_reduce (the peer's `all_reduce_quantized`, torchft's and PCCL's
//! shape): every rank cuts its buffer in `world` segments and sends segment `r`, encoded,
//! to rank `r` (all_to_all; its own segment stays with it, unencoded); rank `r` decodes what it got and adds it up in f32 with its
//! own segment's values (as they are), in rank order ([`sum_parts`]); it encodes that sum
//! once and every rank gathers every sum (all_gather) and decodes the same bytes, so that
//! every rank ends with the same bits (G3). Error per element: at most `Σ_j step_j / 2`
//! from the other ranks' blocks plus `step_sum / 2` from the sum's, each `step` the range
//! of its block over 255 (documented with the call).
//!
//! A block holding a NaN or an infinity has no range: it is sent as a NaN step and
//! decodes to NaN everywhere (as an unquantized sum with a NaN would give NaN), on every
//! rank alike.

use eccl_protocol::DType;
use half::{bf16, f16};

/// Values per block (each block carries its own minimum and step).
pub const BLOCK: usize = 256;
/// Bytes of a block's header: its minimum and its step, f32 little-endian.
const HEADER: usize = 8;

/// How each value of a block becomes a byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// Min-max, 256 evenly spaced levels.
    Int8,
    /// FP8 E4M3 of the value over its block's scale.
    Fp8,
}

/// The 256 E4M3 values (code 127 and 255 are NaN): sign, 4 exponent bits (bias 7), 3
/// mantissa bits, subnormals at exponent 0, no infinities.
fn e4m3(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((code >> 3) & 0xF) as i32, (code & 7) as f32);
    if e == 15 && m == 7.0 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * mag
}

/// E4M3's largest finite value.
pub const FP8_MAX: f32 = 448.0;

/// Every code's value, for decoding.
static E4M3_ALL: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(|| std::array::from_fn(|c| e4m3(c as u8)));

/// The E4M3 code nearest `x` (finite; clamped to ±448), ties to the even code, from the
/// bits of `x`: in E4M3's normal range, f32's mantissa rounded to 3 bits (to nearest,
/// even) and the exponent rebiased; below it (under 2^-6), a whole number of E4M3's
/// smallest subnormal, 2^-9.
#[inline(always)]
fn to_e4m3(x: f32) -> u8 {
    let a = x.abs().min(FP8_MAX);
    let code = if a < 2f32.powi(-6) {
        // 0 to 8 units of 2^-9; 8 units is the smallest normal, code 8.
        (a * 512.0).round_ties_even() as u8
    } else {
        let mut bits = a.to_bits();
        // Round away the 20 low mantissa bits, to nearest, ties to even.
        let lsb = (bits >> 20) & 1;
        bits += 0x7_FFFF + lsb;
        bits &= !0xF_FFFF;
        let e = (bits >> 23) as i32 - 127 + 7;
        let m = (bits >> 20) & 7;
        (((e as u32) << 3) | m).min(0x7E) as u8
    };
    if x.is_sign_negative() && code != 0 {
        code | 0x80
    } else {
        code
    }
}

/// Whether `dtype` can be quantized (floating point of 32 bits or fewer).
pub fn supported(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// Bytes that `n` values take encoded.
pub fn encoded_len(n: usize) -> usize {
    n + n.div_ceil(BLOCK) * HEADER
}

/// `bytes` (elements of `dtype`, native-endian as in memory) as f32, appended to `out`.
pub fn widen(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    match dtype {
        DType::F32 => {
            // A copy: `bytes` need not be aligned for f32, the vector is.
            let at = out.len();
            out.resize(at + bytes.len() / 4, 0.0);
            bytemuck::cast_slice_mut::<f32, u8>(&mut out[at..])
                .copy_from_slice(&bytes[..bytes.len() / 4 * 4]);
        }
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f32()),
        ),
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f32()),
        ),
        other => panic!("quant::widen: {other} is not quantizable (check supported())"),
    }
}

/// `values` written into `bytes` as elements of `dtype` (rounded to nearest, even).
pub fn narrow(dtype: DType, values: &[f32], bytes: &mut [u8]) {
    match dtype {
        DType::F32 => {
            let n = (bytes.len() / 4).min(values.len());
            bytes[..n * 4].copy_from_slice(bytemuck::cast_slice(&values[..n]));
        }
        DType::F16 => {
            for (c, v) in bytes.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&f16::from_f32(*v).to_ne_bytes());
            }
        }
        DType::BF16 => {
            for (c, v) in bytes.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&bf16::from_f32(*v).to_ne_bytes());
            }
        }
        other => panic!("quant::narrow: {other} is not quantizable (check supported())"),
    }
}

/// Encodes `values` into `out` (`encoded_len(values.len())` bytes).
pub fn encode(codec: Codec, values: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        encoded_len(values.len()),
        "quant::encode: output size"
    );
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { encode_avx2(codec, values, out) };
        return;
    }
    encode_blocks::<false>(codec, values, out);
}

/// [`encode_blocks`] compiled for AVX2: the same operations, eight lanes wide (the
/// bytes are the same as the baseline build's: no operation differs, none is fused).
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn encode_avx2(codec: Codec, values: &[f32], out: &mut [u8]) {
    encode_blocks::<true>(codec, values, out);
}

/// One whole int8 block's codes with AVX2: the scalar loop's operations (subtract,
/// multiply, add a half, clamp to [0, 255] with a NaN going to 0, truncate), the same
/// IEEE results lane by lane, then packed to bytes in order. The compiler's own
/// vectorization of that loop narrows i32 to u8 through shuffles: 0.8-0.9 ns a value on
/// this machine, against what a pass over the memory costs (decoding: 0.35).
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn int8_block_avx2(b: &[f32; BLOCK], base: f32, inv: f32, c: &mut [u8; BLOCK]) {
    use std::arch::x86_64::*;
    let vb = _mm256_set1_ps(base);
    let vi = _mm256_set1_ps(inv);
    let half = _mm256_set1_ps(0.5);
    let zero = _mm256_setzero_ps();
    let top = _mm256_set1_ps(255.0);
    // packus works within 128-bit halves: the four groups of four bytes of each half
    // come out as (a0 lo, a1 lo, a2 lo, a3 lo | a0 hi, a1 hi, a2 hi, a3 hi).
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for k in 0..BLOCK / 32 {
        let mut lanes = [_mm256_setzero_si256(); 4];
        for (j, lane) in lanes.iter_mut().enumerate() {
            // SAFETY: `k * 32 + j * 8 + 8 <= BLOCK`: eight floats inside `b`.
            let v = unsafe { _mm256_loadu_ps(b.as_ptr().add(k * 32 + j * 8)) };
            let x = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, vb), vi), half);
            // max(x, 0) gives its second operand for a NaN: 0, as the scalar select.
            let x = _mm256_min_ps(_mm256_max_ps(x, zero), top);
            *lane = _mm256_cvttps_epi32(x);
        }
        let lo = _mm256_packus_epi32(lanes[0], lanes[1]);
        let hi = _mm256_packus_epi32(lanes[2], lanes[3]);
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(lo, hi), order);
        // SAFETY: `k * 32 + 32 <= BLOCK`: 32 bytes inside `c`.
        unsafe { _mm256_storeu_si256(c.as_mut_ptr().add(k * 32).cast(), bytes) };
    }
}

/// `AVX2`: whole int8 blocks go through [`int8_block_avx2`] (true only where the CPU has
/// AVX2, in [`encode_avx2`]).
#[inline(always)]
fn encode_blocks<const AVX2: bool>(codec: Codec, values: &[f32], out: &mut [u8]) {
    for (block, dst) in values.chunks(BLOCK).zip(out.chunks_mut(HEADER + BLOCK)) {
        let (lo, hi, odd) = match <&[f32; BLOCK]>::try_from(block) {
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            // SAFETY: AVX2 is only true in `encode_avx2`, which runs where the CPU has it.
            Ok(b) if AVX2 => unsafe { range_avx2(b) },
            _ => range(block),
        };
        let finite = !odd;
        let (base, step) = match codec {
            Codec::Int8 => {
                if !finite {
                    (0.0, f32::NAN)
                } else if hi > lo {
                    (lo, (hi - lo) / 255.0)
                } else {
                    (lo, 0.0)
                }
            }
            Codec::Fp8 => {
                if !finite {
                    (0.0, f32::NAN)
                } else {
                    (0.0, lo.abs().max(hi.abs()) / FP8_MAX)
                }
            }
        };
        dst[..4].copy_from_slice(&base.to_le_bytes());
        dst[4..HEADER].copy_from_slice(&step.to_le_bytes());
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        match codec {
            // Clamped to the codes' range (a non-finite block's codes are never read: its
            // step is NaN) and truncated after adding a half: the non-negative value
            // rounded to nearest. One multiplication a value, no division; written so
            // that it vectorizes (f32 to i32 to u8 lane by lane).
            Codec::Int8 => {
                let code = |v: f32| {
                    let x = (v - base) * inv + 0.5;
                    // A NaN fails the first comparison and becomes 0.
                    let x = if x > 0.0 { x } else { 0.0 };
                    let x = if x < 255.0 { x } else { 255.0 };
                    // SAFETY: `x` is a number in [0, 255] (the two selects above), which
                    // an i32 holds.
                    unsafe { x.to_int_unchecked::<i32>() as u8 }
                };
                let codes = &mut dst[HEADER..];
                match (
                    <&[f32; BLOCK]>::try_from(block),
                    <&mut [u8; BLOCK]>::try_from(&mut *codes),
                ) {
                    #[cfg(all(target_arch = "x86_64", not(miri)))]
                    (Ok(b), Ok(c)) if AVX2 => {
                        // SAFETY: AVX2 is only true in `encode_avx2`, which runs where
                        // the CPU has AVX2.
                        unsafe { int8_block_avx2(b, base, inv, c) }
                    }
                    // A whole block with its length known to the compiler (as decoding
                    // has it): the loop unrolls with no remainder checks.
                    (Ok(b), Ok(c)) => {
                        for i in 0..BLOCK {
                            c[i] = code(b[i]);
                        }
                    }
                    _ => {
                        for (q, &v) in codes.iter_mut().zip(block) {
                            *q = code(v);
                        }
                    }
                }
            }
            Codec::Fp8 => {
                for (q, &v) in dst[HEADER..].iter_mut().zip(block) {
                    *q = if inv > 0.0 { to_e4m3(v * inv) } else { 0 };
                }
            }
        }
    }
}

/// Lanes of [`range`]: value `i` of a block goes to lane `i % RANGE_LANES`.
const RANGE_LANES: usize = 32;

/// The smallest and largest value of `block` (NaNs skipped) and whether it holds a NaN
/// or an infinity, in 32 lanes of independent minimums, maximums and NaN flags (four
/// vectors of eight), so that no lane waits long for its last result (with eight lanes
/// and a running sum for the NaN check, each block was a chain of dependent steps: 1.4
/// ns a value, most of the encoder's time). [`range_avx2`] computes the same.
#[inline(always)]
fn range(block: &[f32]) -> (f32, f32, bool) {
    const LANES: usize = RANGE_LANES;
    let (mut lo, mut hi) = ([f32::INFINITY; LANES], [f32::NEG_INFINITY; LANES]);
    let mut nan = [0u32; LANES];
    let mut chunks = block.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
            nan[i] |= c[i].is_nan() as u32;
        }
    }
    for &v in chunks.remainder() {
        lo[0] = if v < lo[0] { v } else { lo[0] };
        hi[0] = if v > hi[0] { v } else { hi[0] };
        nan[0] |= v.is_nan() as u32;
    }
    range_of_lanes(&lo, &hi, nan.iter().any(|&x| x != 0))
}

/// The block's range from its lanes' (folded in lane order, so that a block of zeros of
/// both signs keeps the same one whichever build folds it).
#[inline(always)]
fn range_of_lanes(lo: &[f32; RANGE_LANES], hi: &[f32; RANGE_LANES], nan: bool) -> (f32, f32, bool) {
    let lo = lo
        .iter()
        .fold(f32::INFINITY, |a, &b| if b < a { b } else { a });
    let hi = hi
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    // An infinity is the block's minimum or maximum.
    let odd = nan || lo == f32::NEG_INFINITY || hi == f32::INFINITY;
    (lo, hi, odd)
}

/// [`range`] of a whole block with AVX2: the same lanes (vector `j` of each 32 values
/// holds lanes `8j..8j+8`), `min(v, lo)` and `max(v, hi)` being the scalar selects
/// (`v < lo ? v : lo`: the second operand for a NaN or equal zeros), the same fold.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn range_avx2(b: &[f32; BLOCK]) -> (f32, f32, bool) {
    use std::arch::x86_64::*;
    let mut lo = [_mm256_set1_ps(f32::INFINITY); 4];
    let mut hi = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut nan = [_mm256_setzero_ps(); 4];
    for k in 0..BLOCK / RANGE_LANES {
        for j in 0..4 {
            // SAFETY: `k * 32 + j * 8 + 8 <= BLOCK`: eight floats inside `b`.
            let v = unsafe { _mm256_loadu_ps(b.as_ptr().add(k * RANGE_LANES + j * 8)) };
            lo[j] = _mm256_min_ps(v, lo[j]);
            hi[j] = _mm256_max_ps(v, hi[j]);
            nan[j] = _mm256_or_ps(nan[j], _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        }
    }
    let (mut l, mut h) = ([0f32; RANGE_LANES], [0f32; RANGE_LANES]);
    for j in 0..4 {
        // SAFETY: eight floats at `8j` inside each array of 32.
        unsafe {
            _mm256_storeu_ps(l.as_mut_ptr().add(8 * j), lo[j]);
            _mm256_storeu_ps(h.as_mut_ptr().add(8 * j), hi[j]);
        }
    }
    let any = _mm256_or_ps(_mm256_or_ps(nan[0], nan[1]), _mm256_or_ps(nan[2], nan[3]));
    range_of_lanes(&l, &h, _mm256_movemask_ps(any) != 0)
}

/// A block's header: its minimum (int8) or 0 (fp8), and its step or scale.
#[inline(always)]
fn header(src: &[u8]) -> (f32, f32) {
    (
        f32::from_le_bytes([src[0], src[1], src[2], src[3]]),
        f32::from_le_bytes([src[4], src[5], src[6], src[7]]),
    )
}

/// Each block of `enc` (holding `n` values) with its minimum, step and codes, beside the
/// matching block of `out`.
fn blocks<'a>(
    enc: &'a [u8],
    out: &'a mut [f32],
) -> impl Iterator<Item = (f32, f32, &'a [u8], &'a mut [f32])> {
    assert_eq!(
        enc.len(),
        encoded_len(out.len()),
        "quant::decode: input size"
    );
    enc.chunks(HEADER + BLOCK)
        .zip(out.chunks_mut(BLOCK))
        .map(|(src, dst)| {
            let (min, step) = header(src);
            (min, step, &src[HEADER..], dst)
        })
}

/// Hands every decoded value of `enc` to `f` with its slot of `out`.
#[inline(always)]
fn decode_with(codec: Codec, enc: &[u8], out: &mut [f32], f: impl Fn(&mut f32, f32)) {
    let table = &*E4M3_ALL;
    for (base, step, codes, dst) in blocks(enc, out) {
        match codec {
            Codec::Int8 => {
                for (o, &q) in dst.iter_mut().zip(codes) {
                    f(o, base + q as f32 * step);
                }
            }
            Codec::Fp8 => {
                for (o, &q) in dst.iter_mut().zip(codes) {
                    f(o, table[q as usize] * step);
                }
            }
        }
    }
}

/// Adds the `acc.len()` values encoded in `enc` to `acc`.
pub fn decode_add(codec: Codec, enc: &[u8], acc: &mut [f32]) {
    decode_with(codec, enc, acc, |a, v| *a += v);
}

/// The `out.len()` values encoded in `enc`.
pub fn decode(codec: Codec, enc: &[u8], out: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { decode_avx2(codec, enc, out) };
        return;
    }
    decode_blocks(codec, enc, out);
}

/// [`decode`] compiled for AVX2: the same operations (none fused), eight lanes wide.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn decode_avx2(codec: Codec, enc: &[u8], out: &mut [f32]) {
    decode_blocks(codec, enc, out);
}

/// [`decode`]'s arithmetic with each whole block's length known to the compiler.
#[inline(always)]
fn decode_blocks(codec: Codec, enc: &[u8], out: &mut [f32]) {
    assert_eq!(
        enc.len(),
        encoded_len(out.len()),
        "quant::decode: input size"
    );
    let table = &*E4M3_ALL;
    let whole = out.len() / BLOCK;
    let (full, rest) = out.split_at_mut(whole * BLOCK);
    for (src, dst) in enc
        .chunks_exact(HEADER + BLOCK)
        .zip(full.chunks_exact_mut(BLOCK))
    {
        let dst: &mut [f32; BLOCK] = dst.try_into().expect("a whole block");
        let (base, step) = header(src);
        let codes: &[u8; BLOCK] = src[HEADER..].try_into().expect("a block");
        match codec {
            Codec::Int8 => {
                for i in 0..BLOCK {
                    dst[i] = base + codes[i] as f32 * step;
                }
            }
            Codec::Fp8 => {
                for i in 0..BLOCK {
                    dst[i] = table[codes[i] as usize] * step;
                }
            }
        }
    }
    if !rest.is_empty() {
        decode_with(codec, &enc[whole * (HEADER + BLOCK)..], rest, |o, v| *o = v);
    }
}

/// One rank's share of an owner's sum: its codes, or (the owner's own) its values.
#[derive(Clone, Copy, Debug)]
pub enum Part<'a> {
    /// `encoded_len(n)` bytes of codes for `n` values.
    Encoded(&'a [u8]),
    /// `n` values as they are.
    Values(&'a [f32]),
}

/// `out` = the parts' values added in their order, starting from 0: the bits of
/// `out.fill(0.0)` followed by [`decode_add`] (or a plain addition) of each part in turn,
/// computed one block at a time so that the block of `out` stays in the cache while every
/// part is added to it (one pass over `out` instead of one per part).
pub fn sum_parts(codec: Codec, parts: &[Part<'_>], out: &mut [f32]) {
    for part in parts {
        match part {
            Part::Encoded(enc) => assert_eq!(
                enc.len(),
                encoded_len(out.len()),
                "quant::sum_parts: codes' size"
            ),
            Part::Values(v) => assert_eq!(v.len(), out.len(), "quant::sum_parts: values"),
        }
    }
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { sum_parts_avx2(codec, parts, out) };
        return;
    }
    sum_blocks(codec, parts, out);
}

/// [`sum_blocks`] compiled for AVX2: the same operations (none fused), eight lanes wide.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2")]
unsafe fn sum_parts_avx2(codec: Codec, parts: &[Part<'_>], out: &mut [f32]) {
    sum_blocks(codec, parts, out);
}

/// [`sum_parts`]'s arithmetic with each whole block's length known to the compiler (the
/// ragged last block as [`decode_add`] does it).
#[inline(always)]
fn sum_blocks(codec: Codec, parts: &[Part<'_>], out: &mut [f32]) {
    let table = &*E4M3_ALL;
    let whole = out.len() / BLOCK;
    let (full, rest) = out.split_at_mut(whole * BLOCK);
    for (b, dst) in full.chunks_exact_mut(BLOCK).enumerate() {
        let dst: &mut [f32; BLOCK] = dst.try_into().expect("a whole block");
        *dst = [0.0; BLOCK];
        for part in parts {
            match *part {
                Part::Values(v) => {
                    let v: &[f32; BLOCK] = v[b * BLOCK..][..BLOCK].try_into().expect("a block");
                    for i in 0..BLOCK {
                        dst[i] += v[i];
                    }
                }
                Part::Encoded(enc) => {
                    let src = &enc[b * (HEADER + BLOCK)..][..HEADER + BLOCK];
                    let (base, step) = header(src);
                    let codes: &[u8; BLOCK] = src[HEADER..].try_into().expect("a block");
                    match codec {
                        Codec::Int8 => {
                            for i in 0..BLOCK {
                                dst[i] += base + codes[i] as f32 * step;
                            }
                        }
                        Codec::Fp8 => {
                            for i in 0..BLOCK {
                                dst[i] += table[codes[i] as usize] * step;
                            }
                        }
                    }
                }
            }
        }
    }
    if !rest.is_empty() {
        rest.fill(0.0);
        for part in parts {
            match *part {
                Part::Values(v) => {
                    for (o, &x) in rest.iter_mut().zip(&v[whole * BLOCK..]) {
                        *o += x;
                    }
                }
                Part::Encoded(enc) => decode_add(codec, &enc[whole * (HEADER + BLOCK)..], rest),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(values: &[f32]) -> Vec<f32> {
        roundtrip_with(Codec::Int8, values)
    }

    fn roundtrip_with(codec: Codec, values: &[f32]) -> Vec<f32> {
        let mut enc = vec![0u8; encoded_len(values.len())];
        encode(codec, values, &mut enc);
        let mut out = vec![0f32; values.len()];
        decode(codec, &enc, &mut out);
        out
    }

    /// The nearest code by search over the values (ties to the even code): what
    /// `to_e4m3` computes from bits.
    fn nearest_by_search(x: f32) -> u8 {
        let a = x.abs().min(FP8_MAX);
        let mut best = 0u8;
        for c in 1u8..=126 {
            let (d, db) = ((e4m3(c) - a).abs(), (e4m3(best) - a).abs());
            if d < db || (d == db && c % 2 == 0) {
                best = c;
            }
        }
        if x.is_sign_negative() && best != 0 {
            best | 0x80
        } else {
            best
        }
    }

    #[test]
    fn e4m3_from_bits_is_the_nearest_value() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            let x: f32 = rng.gen_range(-500.0f32..500.0) * 2f32.powi(rng.gen_range(-14..1));
            assert_eq!(to_e4m3(x), nearest_by_search(x), "{x}");
        }
        // Every midpoint between neighbours, and just either side of it.
        for c in 0u8..126 {
            let mid = (e4m3(c) + e4m3(c + 1)) / 2.0;
            for x in [mid, mid.next_down(), mid.next_up()] {
                assert_eq!(
                    to_e4m3(x),
                    nearest_by_search(x),
                    "{x} between codes {c} and {}",
                    c + 1
                );
            }
        }
    }

    #[test]
    fn e4m3_is_the_ocp_format_and_rounds_to_nearest() {
        // Known values: the largest, the smallest normal and subnormal, one, NaN.
        assert_eq!(e4m3(0x7E), 448.0);
        assert_eq!(e4m3(0x08), 2f32.powi(-6));
        assert_eq!(e4m3(0x01), 2f32.powi(-9));
        assert_eq!(e4m3(0x38), 1.0);
        assert_eq!(e4m3(0xB8), -1.0);
        assert!(e4m3(0x7F).is_nan() && e4m3(0xFF).is_nan());
        // Every finite code is its own nearest, and the values increase with the code.
        for c in 0u8..=126 {
            assert_eq!(to_e4m3(e4m3(c)), c, "{c}");
            assert_eq!(to_e4m3(-e4m3(c)), if c == 0 { 0 } else { c | 0x80 }, "-{c}");
            if c > 0 {
                assert!(e4m3(c) > e4m3(c - 1));
            }
        }
        // Halfway between 1.0 (0x38) and 1.125 (0x39) goes to the even code; past it, up.
        assert_eq!(to_e4m3(1.0625), 0x38);
        assert_eq!(to_e4m3(1.07), 0x39);
        assert_eq!(to_e4m3(1e6), 0x7E, "clamped to 448");
    }

    #[test]
    fn fp8_values_come_back_within_half_a_unit_of_their_binade() {
        let values: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.731)
            .collect();
        let back = roundtrip_with(Codec::Fp8, &values);
        for (block, got) in values.chunks(BLOCK).zip(back.chunks(BLOCK)) {
            let scale = block.iter().fold(0f32, |m, v| m.max(v.abs())) / FP8_MAX;
            for (v, g) in block.iter().zip(got) {
                let bound = (v.abs() / 16.0).max(scale / 1024.0) * 1.0001;
                assert!((v - g).abs() <= bound, "{v} -> {g} (bound {bound})");
            }
        }
        assert_eq!(roundtrip_with(Codec::Fp8, &[0.0; 10]), vec![0.0; 10]);
        let mut v = vec![1.0f32; 300];
        v[3] = f32::NAN;
        let back = roundtrip_with(Codec::Fp8, &v);
        assert!(
            back[..BLOCK].iter().all(|x| x.is_nan()) && back[BLOCK..].iter().all(|x| *x == 1.0)
        );
    }

    /// The AVX2 build of the encoder (where the CPU has it: `encode`) writes the bytes
    /// of the baseline one, block by block: NaNs, infinities, signed zeros, constant
    /// blocks, ranges near f32's ends, values on the rounding boundaries, a last block
    /// cut short.
    #[test]
    fn the_vector_encoder_writes_the_baseline_bytes() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut values = Vec::new();
        for b in 0..64 {
            for i in 0..BLOCK {
                let r = next();
                values.push(match b % 8 {
                    0 => f32::from_bits(r as u32),     // any bits: NaNs, infinities
                    1 => 7.25,                         // a constant block
                    2 => (i as f32) * (255.0 / 256.0), // codes on the half-way points
                    // Both zeros through every lane, in both orders (a lane takes
                    // values i, i + 32, ...): which one a block keeps depends on the
                    // operand order of each minimum and maximum.
                    3 => {
                        if (i / RANGE_LANES + b / 8).is_multiple_of(2) {
                            -0.0
                        } else {
                            0.0
                        }
                    }
                    4 => (r as i32 as f32) * 1e28, // near f32's largest
                    5 => (r as u16 as f32) * 1e-30, // tiny
                    6 if i == 9 => f32::INFINITY,
                    _ => (r % 20_000) as f32 * 0.001 - 10.0,
                });
            }
        }
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        let vector = std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(all(target_arch = "x86_64", not(miri))))]
        let vector = false;
        if !vector {
            eprintln!("no AVX2 on this CPU (or Miri): the vector encoder cannot run here");
            return;
        }
        for cut in [0, 1, 31, 200] {
            let v = &values[..values.len() - cut];
            for codec in [Codec::Int8, Codec::Fp8] {
                let (mut got, mut want) = (
                    vec![0u8; encoded_len(v.len())],
                    vec![0u8; encoded_len(v.len())],
                );
                #[cfg(all(target_arch = "x86_64", not(miri)))]
                // SAFETY: the CPU has AVX2 (checked above).
                unsafe {
                    encode_avx2(codec, v, &mut got)
                };
                encode_blocks::<false>(codec, v, &mut want);
                assert!(
                    got == want,
                    "{codec:?}, {cut} values short: the bytes differ"
                );
            }
        }
    }

    #[test]
    fn values_come_back_within_half_a_step_of_their_block() {
        let values: Vec<f32> = (0..1000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.731)
            .collect();
        let back = roundtrip(&values);
        for (block, got) in values.chunks(BLOCK).zip(back.chunks(BLOCK)) {
            let lo = block.iter().cloned().fold(f32::INFINITY, f32::min);
            let hi = block.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let step = (hi - lo) / 255.0;
            for (v, g) in block.iter().zip(got) {
                assert!(
                    (v - g).abs() <= step / 2.0 + 1e-5 * hi.abs().max(lo.abs()),
                    "{v} -> {g}"
                );
            }
            // The extremes are exact (0 and 255 steps from the minimum).
            assert!(got.contains(&lo));
        }
    }

    #[test]
    fn a_constant_block_is_exact_and_a_non_finite_one_is_nan() {
        assert_eq!(roundtrip(&[2.5; 300]), vec![2.5; 300]);
        let mut v = vec![1.0f32; 300];
        v[3] = f32::INFINITY;
        let back = roundtrip(&v);
        assert!(
            back[..BLOCK].iter().all(|x| x.is_nan()),
            "the first block is NaN"
        );
        assert!(
            back[BLOCK..].iter().all(|x| *x == 1.0),
            "the second is untouched"
        );
    }

    #[test]
    fn sizes_and_the_narrow_types_round_trip() {
        assert_eq!(encoded_len(0), 0);
        assert_eq!(encoded_len(1), 9);
        assert_eq!(encoded_len(BLOCK), BLOCK + 8);
        assert_eq!(encoded_len(BLOCK + 1), BLOCK + 1 + 16);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let values = [0.5f32, -2.0, 3.25, 1024.0];
            let mut bytes = vec![0u8; values.len() * dtype.size()];
            narrow(dtype, &values, &mut bytes);
            let mut back = Vec::new();
            widen(dtype, &bytes, &mut back);
            assert_eq!(back, values, "{dtype}");
        }
        assert!(supported(DType::BF16) && !supported(DType::F64) && !supported(DType::I32));
    }

    #[test]
    fn a_sum_of_parts_has_the_bits_of_one_part_at_a_time() {
        // A ragged last block, a NaN block in one part, values as they are in another.
        let n = 3 * BLOCK + 37;
        let input = |r: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 31 + r * 7) % 97) as f32 * 0.37 - 11.0 + r as f32 * 1e-3)
                .collect()
        };
        for codec in [Codec::Int8, Codec::Fp8] {
            let mut inputs: Vec<Vec<f32>> = (0..4).map(input).collect();
            inputs[2][BLOCK + 5] = f32::NAN;
            let encs: Vec<Vec<u8>> = inputs
                .iter()
                .map(|v| {
                    let mut e = vec![0u8; encoded_len(n)];
                    encode(codec, v, &mut e);
                    e
                })
                .collect();
            let own = 1;
            let mut want = vec![0f32; n];
            for (r, e) in encs.iter().enumerate() {
                if r == own {
                    want.iter_mut().zip(&inputs[r]).for_each(|(w, v)| *w += v);
                } else {
                    decode_add(codec, e, &mut want);
                }
            }
            let parts: Vec<Part<'_>> = (0..4)
                .map(|r| {
                    if r == own {
                        Part::Values(&inputs[r])
                    } else {
                        Part::Encoded(&encs[r])
                    }
                })
                .collect();
            let mut got = vec![7f32; n];
            sum_parts(codec, &parts, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{codec:?}");
            assert!(
                got[BLOCK..2 * BLOCK].iter().all(|x| x.is_nan()),
                "{codec:?}"
            );
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;

    /// Nanoseconds a value of each codec pass (`cargo test --release -p eccl-algorithms
    /// quant::speed -- --ignored --nocapture`).
    #[test]
    #[ignore = "a measurement, not a check"]
    fn codec_passes_per_value() {
        let n = 4 << 20;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.01 - 3.0)
            .collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        let mut enc = vec![0u8; encoded_len(n)];
        let mut out = vec![0f32; n];
        let mut wide = Vec::with_capacity(n);
        let mut back = vec![0u8; n * 4];
        let time = |name: &str, f: &mut dyn FnMut()| {
            f();
            let t = std::time::Instant::now();
            for _ in 0..5 {
                f();
            }
            println!(
                "{name}: {:.2} ns a value",
                t.elapsed().as_nanos() as f64 / 5.0 / n as f64
            );
        };
        for codec in [Codec::Int8, Codec::Fp8] {
            time(&format!("{codec:?} encode"), &mut || {
                encode(codec, &values, &mut enc)
            });
            time(&format!("{codec:?} decode"), &mut || {
                decode(codec, &enc, &mut out)
            });
            time(&format!("{codec:?} decode_add"), &mut || {
                decode_add(codec, &enc, &mut out)
            });
            // Per value of each part: four parts, one of them values as they are.
            let parts = [
                Part::Encoded(&enc),
                Part::Values(&values),
                Part::Encoded(&enc),
                Part::Encoded(&enc),
            ];
            let mut sum = vec![0f32; n];
            time(
                &format!("{codec:?} sum_parts of 4 (per value of all 4)"),
                &mut || sum_parts(codec, &parts, &mut sum),
            );
        }
        time("widen f32", &mut || {
            wide.clear();
            widen(DType::F32, &bytes, &mut wide)
        });
        time("narrow f32", &mut || narrow(DType::F32, &values, &mut back));
    }
}
