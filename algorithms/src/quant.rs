//! 8-bit min-max quantization for all_reduce over slow links (`Quantize::Int8`): each
//! block of [`BLOCK`] values goes on the wire as its minimum and step (two f32) and one
//! byte per value, `round((v - min) / step)`, `step = (max - min) / 255`. A value comes
//! back within `step / 2` of what was encoded (plus f32 rounding).
//!
//! The quantized all_reduce (the peer's `all_reduce_quantized`, torchft's and PCCL's
//! shape): every rank encodes its buffer in `world` segments and sends segment `r` to
//! rank `r` (all_to_all); rank `r` decodes what it got and adds it up in f32, in rank
//! order; it encodes that sum once and every rank gathers every sum (all_gather) and
//! decodes the same bytes, so that every rank ends with the same bits (G3). Error per
//! element: at most `Σ_j step_j / 2` from the inputs' blocks plus `step_sum / 2` from the
//! sum's, each `step` the range of its block over 255 (documented with the call).
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
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]])),
        ),
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
            for (c, v) in bytes.chunks_exact_mut(4).zip(values) {
                c.copy_from_slice(&v.to_ne_bytes());
            }
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
pub fn encode(values: &[f32], out: &mut [u8]) {
    assert_eq!(
        out.len(),
        encoded_len(values.len()),
        "quant::encode: output size"
    );
    for (block, dst) in values.chunks(BLOCK).zip(out.chunks_mut(HEADER + BLOCK)) {
        let (min, max) = block
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        let finite = block.iter().all(|v| v.is_finite());
        let step = if !finite {
            f32::NAN
        } else if max > min {
            (max - min) / 255.0
        } else {
            0.0
        };
        let min = if finite { min } else { 0.0 };
        dst[..4].copy_from_slice(&min.to_le_bytes());
        dst[4..HEADER].copy_from_slice(&step.to_le_bytes());
        // `as u8` saturates (and takes NaN to 0); adding a half before it rounds the
        // non-negative value to nearest. One multiplication a value, no division.
        let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
        for (q, &v) in dst[HEADER..].iter_mut().zip(block) {
            *q = ((v - min) * inv + 0.5) as u8;
        }
    }
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
            let min = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
            let step = f32::from_le_bytes([src[4], src[5], src[6], src[7]]);
            (min, step, &src[HEADER..], dst)
        })
}

/// Adds the `acc.len()` values encoded in `enc` to `acc`.
pub fn decode_add(enc: &[u8], acc: &mut [f32]) {
    for (min, step, codes, dst) in blocks(enc, acc) {
        for (a, &q) in dst.iter_mut().zip(codes) {
            *a += min + q as f32 * step;
        }
    }
}

/// The `out.len()` values encoded in `enc`.
pub fn decode(enc: &[u8], out: &mut [f32]) {
    for (min, step, codes, dst) in blocks(enc, out) {
        for (o, &q) in dst.iter_mut().zip(codes) {
            *o = min + q as f32 * step;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(values: &[f32]) -> Vec<f32> {
        let mut enc = vec![0u8; encoded_len(values.len())];
        encode(values, &mut enc);
        let mut out = vec![0f32; values.len()];
        decode(&enc, &mut out);
        out
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
}
