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
