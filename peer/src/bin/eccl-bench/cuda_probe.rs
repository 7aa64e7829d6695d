//! `eccl-bench probe cuda [-b SIZE] [-n ITERS] [--device N]`: what the device layer does on
//! a real GPU, against the CPU and against the GPU's own copy rates.
//!
//! - every generated kernel (every dtype and operator, `avg` too) over three inputs and two
//!   outputs, on a ragged count and on buffers off 16-byte alignment, compared bit for bit
//!   with the CPU kernels (`probe cuda-kernel <dtype> <op> wrong <n>`; special values
//!   included: signed zeros, infinities, subnormals; NaN payloads are not compared, since
//!   the GPU's arithmetic answers a canonical NaN where the CPU keeps an input's);
//! - the rates a same-host collective is judged against: a device-to-device copy, pinned
//!   host to device and back, and the reduction kernel (two inputs, one output) for f32
//!   and bf16 (`probe <what> bytes <SIZE> gbps <best> median <median>`, SIZE bytes of the
//!   destination per pass).

use std::time::Instant;

use eccl::{DType, ReduceOp};
use eccl_cuda::{CudaDevice, Device};

fn line(what: &str, bytes: usize, mut ms: Vec<f32>) {
    ms.sort_by(f32::total_cmp);
    let gbps = |m: f32| bytes as f64 / (m as f64 / 1e3) / 1e9;
    println!(
        "probe {what} bytes {bytes} gbps {:.1} median {:.1}",
        gbps(ms[0]),
        gbps(ms[ms.len() / 2])
    );
}

/// Deterministic values with the special cases mixed in (never NaN).
fn values(d: DType, count: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(count * d.size());
    for i in 0..count {
        let r = next();
        let f: f64 = match i % 97 {
            0 => 0.0,
            1 => -0.0,
            2 => f64::INFINITY,
            3 => f64::NEG_INFINITY,
            4 => 1e-40, // an f32 subnormal
            5 => 3e-6,  // near f16's subnormals
            _ => ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 200.0,
        };
        match d {
            DType::F32 => out.extend_from_slice(&(f as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&f.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f64(f).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(f).to_le_bytes()),
            DType::I8 | DType::U8 => out.push(r as u8),
            DType::I32 => out.extend_from_slice(&(r as u32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&r.to_le_bytes()),
        }
    }
    out
}

fn is_nan(d: DType, b: &[u8]) -> bool {
    match d {
        DType::F32 => f32::from_le_bytes(b.try_into().unwrap_or_default()).is_nan(),
        DType::F64 => f64::from_le_bytes(b.try_into().unwrap_or_default()).is_nan(),
        DType::F16 => half::f16::from_le_bytes(b.try_into().unwrap_or_default()).is_nan(),
        DType::BF16 => half::bf16::from_le_bytes(b.try_into().unwrap_or_default()).is_nan(),
        _ => false,
    }
}

fn dev<T>(r: eccl_cuda::device::Result<T>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

/// Every kernel against the CPU; returns the number of pairs with a wrong element.
fn kernels(d: &CudaDevice) -> Result<usize, String> {
    let count = (1 << 20) + 3;
    let mut bad_pairs = 0;
    let t = Instant::now();
    for dtype in DType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|o| o.valid_for(dtype)) {
            let size = dtype.size();
            let ins: Vec<Vec<u8>> = (0..3).map(|s| values(dtype, count, s + 1)).collect();
            let mut want = ins[0].clone();
            for i in &ins[1..] {
                eccl_algorithms::kernels::reduce_inplace(dtype, op, &mut want, i);
            }
            eccl_algorithms::kernels::finalize(dtype, op, &mut want, 3);
            let mut wrong = 0usize;
            // Aligned buffers (the vector path) and buffers one element off (the scalar
            // path), each with a ragged count.
            for skew in [0, size] {
                let bytes = count * size + skew;
                let bufs: Vec<u64> = (0..5)
                    .map(|_| dev(d.alloc(bytes)))
                    .collect::<Result<_, _>>()?;
                let at = |i: usize| bufs[i] + skew as u64;
                for (i, data) in ins.iter().enumerate() {
                    // SAFETY: each buffer holds `skew + count * size` bytes.
                    dev(unsafe { d.upload(at(i), data) })?;
                }
                // SAFETY: as above; outputs 3 and 4 are distinct from the inputs.
                dev(unsafe {
                    d.reduce(dtype, op, &[at(0), at(1), at(2)], &[at(3), at(4)], count, 3)
                })?;
                dev(d.synchronize())?;
                for o in [3, 4] {
                    let mut got = vec![0u8; count * size];
                    // SAFETY: as above.
                    dev(unsafe { d.download(&mut got, at(o)) })?;
                    wrong += got
                        .chunks(size)
                        .zip(want.chunks(size))
                        .filter(|(g, w)| g != w && !(is_nan(dtype, g) && is_nan(dtype, w)))
                        .count();
                }
                for b in bufs {
                    // SAFETY: synchronized above; nothing uses them now.
                    unsafe { d.free(b) };
                }
            }
            println!("probe cuda-kernel {dtype} {} wrong {wrong}", op.name());
            if wrong > 0 {
                bad_pairs += 1;
            }
        }
    }
    println!(
        "probe cuda-kernels checked in {:.1} s (compile included)",
        t.elapsed().as_secs_f64()
    );
    Ok(bad_pairs)
}

fn rates(d: &CudaDevice, bytes: usize, iters: usize) -> Result<(), String> {
    let a = dev(d.alloc(bytes))?;
    let b = dev(d.alloc(bytes))?;
    let c = dev(d.alloc(bytes))?;
    let zeros = vec![0u8; bytes];
    for p in [a, b, c] {
        // SAFETY: each buffer holds `bytes`.
        dev(unsafe { d.upload(p, &zeros) })?;
    }
    let n = iters.max(5);
    let time = |f: &dyn Fn() -> eccl_cuda::device::Result<()>| -> Result<Vec<f32>, String> {
        dev(d.time_ms(f))?; // warm-up
        (0..n).map(|_| dev(d.time_ms(f))).collect()
    };
    // SAFETY (all closures below): a, b, c hold `bytes`; pinned holds `bytes`.
    line("cuda-d2d", bytes, time(&|| unsafe { d.copy(b, a, bytes) })?);
    let pinned = dev(d.alloc_pinned(bytes))?;
    line(
        "cuda-h2d-pinned",
        bytes,
        time(&|| unsafe { d.queue_h2d(a, pinned, bytes) })?,
    );
    line(
        "cuda-d2h-pinned",
        bytes,
        time(&|| unsafe { d.queue_d2h(pinned, a, bytes) })?,
    );
    // SAFETY: nothing uses the pinned buffer after the timed copies (synchronized).
    unsafe { d.free_pinned(pinned) };
    for dtype in [DType::F32, DType::BF16] {
        let count = bytes / dtype.size();
        line(
            &format!("cuda-reduce-{dtype}"),
            bytes,
            time(&|| unsafe { d.reduce(dtype, ReduceOp::Sum, &[a, b], &[c], count, 2) })?,
        );
    }
    for p in [a, b, c] {
        // SAFETY: synchronized by the timing; nothing uses them now.
        unsafe { d.free(p) };
    }
    Ok(())
}

pub fn run(bytes: usize, iters: usize, ordinal: usize) -> Result<(), String> {
    let d = dev(CudaDevice::new(ordinal))?;
    println!("probe cuda-device {}", d.describe());
    let bad = kernels(&d)?;
    rates(&d, bytes, iters)?;
    if bad > 0 {
        return Err(format!("{bad} kernels differ from the CPU"));
    }
    Ok(())
}
