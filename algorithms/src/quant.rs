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
                #[cfg(all(target_arch = "x86_64", not(miri)))]
                if let (true, Ok(b), Ok(c)) = (
                    AVX2,
                    <&[f32; BLOCK]>::try_from(block),
                    <&mut [u8; BLOCK]>::try_from(&mut dst[HEADER..]),
                ) {
                    // SAFETY: AVX2 is only true in `encode_avx2`, which runs where the
                    // CPU has AVX2.
                    unsafe { int8_block_avx2(b, base, inv, c) };
                    continue;
                }
                for (q, &v) in dst[HEADER..].iter_mut().zip(block) {
                    let x = (v - base) * inv + 0.5;
                    // A NaN fails the first comparison and becomes 0.
                    let x = if x > 0.0 { x } else { 0.0 };
                    let x = if x < 255.0 { x } else { 255.0 };
                    // SAFETY: `x` is a number in [0, 255] (the two selects above), which
                    // an i32 holds.
                    *q = unsafe { x.to_int_unchecked::<i32>() } as u8;
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
mod tests;

#[cfg(test)]
mod speed;
