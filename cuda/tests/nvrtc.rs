//! Every generated kernel compiles with NVRTC, for the oldest architecture CUDA 13 builds
//! for and for Hopper. Needs libnvrtc but no GPU (pip's `nvidia-cuda-nvrtc`, which torch's
//! CUDA wheels pull in; `ECCL_NVRTC_LIB` names it). The test command sets
//! `ECCL_REQUIRE_NVRTC=1`, so there a missing NVRTC fails rather than skips.
#![cfg(feature = "cuda")]

#[test]
fn every_generated_kernel_compiles() {
    if let Err(e) = eccl_cuda::load_nvrtc() {
        if std::env::var_os("ECCL_REQUIRE_NVRTC").is_some() {
            panic!("ECCL_REQUIRE_NVRTC is set: {e}");
        }
        eprintln!("skipped: {e}");
        return;
    }
    for arch in ["compute_75", "compute_90"] {
        let ptx = eccl_cuda::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for (d, o) in eccl_cuda::kernels::pairs() {
            let name = eccl_cuda::kernels::kernel_name(d, o);
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{arch}: {name} missing from the PTX"
            );
        }
        // No fast-math shortcuts: IEEE division (div.rn), no flush to zero.
        assert!(!ptx.contains(".ftz"), "{arch}: flush-to-zero in the PTX");
        assert!(!ptx.contains("div.approx"), "{arch}: approximate division");
    }
}
