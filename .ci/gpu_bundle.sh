#!/usr/bin/env bash
# Builds what the GPU check needs into .gpu/ (ignored by git): stripped eccl-bench and
# eccl-chaos (its master load test runs on the GPU machine's cores), packed into
# .gpu/bin.tgz, the Python wheel (abi3: CPython 3.11 and newer), and .gpu/SOURCES, the
# hash of the sources they were built from (.ci/gpu_sources.sh), which gpu_check.sh
# compares with its checkout. Run it on a machine with the Rust toolchain, after the
# last change to the code; copy the checkout with .gpu/ to the GPU machine, which needs
# only an NVIDIA driver, python3 with torch (CUDA build) and pytest; no network. The
# device tool carries at most 64 MiB of ignored files: this script fails above 60.
#
#   .ci/gpu_bundle.sh && (on the GPU machine) .ci/gpu_check.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
export PYO3_PYTHON="${PYO3_PYTHON:-$PWD/.venv/bin/python}"
export PYO3_ENVIRONMENT_SIGNATURE=cpython-3.11-64bit
cargo build --release --locked -p eccl -p eccl-chaos --bins
rm -rf .gpu && mkdir -p .gpu/bin
for b in eccl-bench eccl-chaos; do
    cp "target/release/$b" ".gpu/bin/$b"
    strip ".gpu/bin/$b"
done
tar -C .gpu -czf .gpu/bin.tgz bin
rm -rf .gpu/bin
rm -f target/wheels/eccl-*.whl
"$PYO3_PYTHON" -m maturin build --release --locked -m python/Cargo.toml --out target/wheels -q
cp target/wheels/eccl-*.whl .gpu/
.ci/gpu_sources.sh >.gpu/SOURCES
du -sh .gpu/*
bytes=$(du -sb .gpu | cut -f1)
if [ "$bytes" -gt $((60 << 20)) ]; then
    echo "gpu_bundle: .gpu/ holds $bytes bytes, more than the 60 MiB the device tool can carry" >&2
    exit 1
fi
