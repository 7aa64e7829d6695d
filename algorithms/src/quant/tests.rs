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
    assert!(back[..BLOCK].iter().all(|x| x.is_nan()) && back[BLOCK..].iter().all(|x| *x == 1.0));
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
                4 => (r as i32 as f32) * 1e28,  // near f32's largest
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
