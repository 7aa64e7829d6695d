//! Half-precision reductions at vector speed: `f16` blocks widened and narrowed with
//! F16C, and `bf16`'s branch-free conversions (the module docs of `kernels` say why).

use bytemuck::Pod;
use eccl_protocol::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A half-precision type's conversions for [`half_blocks`], a block at a time, rounding
/// exactly as `half`'s `from_f32` (to nearest, ties to even; a NaN stays a NaN). Only
/// `f16` has them (see the module docs for `bf16`).
pub(super) trait Half: Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

/// Whether this CPU has F16C (and AVX, which its 256-bit forms need); the answer is
/// cached by the standard library after the first call.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if has_f16c() {
            // SAFETY: the CPU has F16C and AVX (checked just above).
            unsafe { f16c::widen(src, dst) };
            return;
        }
        src.convert_to_f32_slice(dst);
    }

    fn narrow(src: &[f32], dst: &mut [Self]) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if has_f16c() {
            // SAFETY: the CPU has F16C and AVX (checked just above).
            unsafe { f16c::narrow(src, dst) };
            return;
        }
        dst.convert_from_f32_slice(src);
    }
}

/// `f16` conversions eight at a time with F16C (`vcvtph2ps`, `vcvtps2ph` rounding to
/// nearest even: the instructions `half` uses for one value, so the same results).
#[cfg(all(target_arch = "x86_64", not(miri)))]
mod f16c {
    use half::f16;
    use std::arch::x86_64::{
        __m128i, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
        _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    /// `dst[i] = src[i]` widened, over the shorter of the two.
    ///
    /// # Safety
    /// The CPU must have F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn widen(src: &[f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements i..i + 8 lie inside both slices (i + 8 <= n); the loads
            // and stores are the unaligned kind.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// `dst[i] = src[i]` rounded to nearest even, over the shorter of the two.
    ///
    /// # Safety
    /// The CPU must have F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn narrow(src: &[f32], dst: &mut [f16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements i..i + 8 lie inside both slices (i + 8 <= n); the loads
            // and stores are the unaligned kind.
            unsafe {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast::<__m128i>(), h);
            }
            i += 8;
        }
        for j in i..n {
            dst[j] = f16::from_f32(src[j]);
        }
    }
}

/// `bf16` widened: its bits are an `f32`'s top half.
#[inline(always)]
pub(super) fn bf16_widen(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// `f32` rounded to `bf16`, nearest with ties to even, a NaN made quiet with its sign
/// and top payload bits: `bf16::from_f32`'s results, written without branches so that
/// LLVM vectorizes the loops it is in.
#[inline(always)]
pub(super) fn bf16_narrow(f: f32) -> bf16 {
    let x = f.to_bits();
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet = ((x >> 16) as u16) | 0x40;
    bf16::from_bits(if (x & 0x7fff_ffff) > 0x7f80_0000 {
        quiet
    } else {
        rounded
    })
}

/// `a < b` for two halves given by their bits, as their widened `f32` values compare:
/// false when either is a NaN (magnitude bits above `inf`'s) and for `-0 < +0`. Integer
/// operations only, so that the loops of min and max vectorize (a conversion per element
/// kept `f16`'s at an eighth of `f32`'s speed).
#[inline(always)]
pub(super) fn half_lt(a: u16, b: u16, inf: u16) -> bool {
    let (ma, mb) = (a & 0x7fff, b & 0x7fff);
    let unordered = (ma > inf) | (mb > inf) | ((ma | mb) == 0);
    // Sign and magnitude to two's complement: a negative value's magnitude bits are
    // flipped, so a larger magnitude is a smaller integer.
    let key = |x: u16| (x ^ ((((x as i16) >> 15) as u16) & 0x7fff)) as i16;
    (key(a) < key(b)) & !unordered
}

/// Halves per block of [`half_blocks`]: two `f32` blocks of 4 KiB on the stack, well
/// inside L1 with the halves they come from.
pub(super) const HALF_BLOCK: usize = 1024;

/// Where [`half_blocks`] takes its operands from: `dst` is always written.
#[derive(Clone, Copy)]
enum Operands<'a, H> {
    /// `dst = dst ⊕ src` (`rev`: `src ⊕ dst`).
    InPlace { src: &'a [H], rev: bool },
    /// `dst = a ⊕ b`.
    Into { a: &'a [H], b: &'a [H] },
}

/// `f16` `sum`, `prod` and `avg` (a sum until `finalize`) a block at a time, with
/// the same `f32` arithmetic and rounding as the element loop, operands in the same
/// order. Returns false (nothing done) for every other dtype and operator, and for
/// slices not aligned for the dtype (the element loop reads those unaligned).
pub(super) fn half_blocks(
    dtype: DType,
    op: ReduceOp,
    dst: &mut [u8],
    a: &[u8],
    b: Option<&[u8]>,
    rev: bool,
) -> bool {
    match (dtype, op) {
        (DType::F16, ReduceOp::Sum | ReduceOp::Avg) => {
            typed_blocks::<f16, _>(dst, a, b, rev, |x, y| x + y)
        }
        (DType::F16, ReduceOp::Prod) => typed_blocks::<f16, _>(dst, a, b, rev, |x, y| x * y),
        _ => false,
    }
}

fn typed_blocks<H: Half, F: Fn(f32, f32) -> f32>(
    dst: &mut [u8],
    a: &[u8],
    b: Option<&[u8]>,
    rev: bool,
    f: F,
) -> bool {
    let size = std::mem::size_of::<H>();
    let mut bytes = dst.len().min(a.len()) / size * size;
    if let Some(b) = b {
        bytes = bytes.min(b.len() / size * size);
    }
    let Ok(d) = bytemuck::try_cast_slice_mut::<u8, H>(&mut dst[..bytes]) else {
        return false;
    };
    let Ok(a) = bytemuck::try_cast_slice::<u8, H>(&a[..bytes]) else {
        return false;
    };
    let ops = match b {
        None => Operands::InPlace { src: a, rev },
        Some(b) => match bytemuck::try_cast_slice::<u8, H>(&b[..bytes]) {
            Ok(b) => Operands::Into { a, b },
            Err(_) => return false,
        },
    };
    let (mut l, mut r) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
    for (i, out) in d.chunks_mut(HALF_BLOCK).enumerate() {
        let (from, k) = (i * HALF_BLOCK, out.len());
        let (l, r) = (&mut l[..k], &mut r[..k]);
        match ops {
            Operands::InPlace { src, rev: false } => {
                H::widen(out, l);
                H::widen(&src[from..from + k], r);
            }
            Operands::InPlace { src, rev: true } => {
                H::widen(&src[from..from + k], l);
                H::widen(out, r);
            }
            Operands::Into { a, b } => {
                H::widen(&a[from..from + k], l);
                H::widen(&b[from..from + k], r);
            }
        }
        for (x, y) in l.iter_mut().zip(r.iter()) {
            *x = f(*x, *y);
        }
        H::narrow(l, out);
    }
    true
}

/// `x / w` for every half of `buf` a block at a time (as [`half_blocks`]); false when
/// `buf` is not aligned for the dtype.
pub(super) fn half_map<H: Half>(buf: &mut [u8], w: f32) -> bool {
    let size = std::mem::size_of::<H>();
    let bytes = buf.len() / size * size;
    let Ok(xs) = bytemuck::try_cast_slice_mut::<u8, H>(&mut buf[..bytes]) else {
        return false;
    };
    let mut v = [0f32; HALF_BLOCK];
    for out in xs.chunks_mut(HALF_BLOCK) {
        let v = &mut v[..out.len()];
        H::widen(out, v);
        for x in v.iter_mut() {
            *x /= w;
        }
        H::narrow(v, out);
    }
    true
}
