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

#[test]
fn compiled_kernels_are_cached_on_disk_by_what_they_depend_on() {
    if let Err(e) = eccl_cuda::load_nvrtc() {
        if std::env::var_os("ECCL_REQUIRE_NVRTC").is_some() {
            panic!("ECCL_REQUIRE_NVRTC is set: {e}");
        }
        eprintln!("skipped: {e}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("eccl-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // The only test in this binary that sets it (the other calls `compile` directly).
    std::env::set_var("ECCL_KERNEL_CACHE", &dir);
    let files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(&dir)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default()
    };
    // Two compiles in all (NVRTC takes seconds): the first call, and `fresh` below.
    let first = eccl_cuda::compile_cached("compute_90", false).unwrap();
    assert!(
        first.contains(".entry eccl_reduce_"),
        "not the kernels' PTX"
    );
    let cached = files();
    assert_eq!(cached.len(), 1, "{cached:?}");
    let name = cached[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with("compute_90-") && name.ends_with(".ptx"),
        "{name}"
    );
    // The second call reads the file: what is there is what it returns.
    std::fs::write(&cached[0], "// marker\n").unwrap();
    assert_eq!(
        eccl_cuda::compile_cached("compute_90", false).unwrap(),
        "// marker\n"
    );
    // `fresh` compiles (the same PTX) and rewrites it.
    assert_eq!(
        eccl_cuda::compile_cached("compute_90", true).unwrap(),
        first
    );
    assert_eq!(std::fs::read_to_string(&cached[0]).unwrap(), first);
    assert_eq!(files().len(), 1, "no temporary file left behind");
    // `off`: no cache.
    std::env::set_var("ECCL_KERNEL_CACHE", "off");
    assert!(eccl_cuda::kernel_cache_dir().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}
