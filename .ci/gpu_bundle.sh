#!/usr/bin/env bash
# Builds what the GPU check needs into .gpu/ (ignored by git): stripped eccl-bench,
# eccl-master and eccl-chaos (its master load test runs on the GPU machine's cores) and
# the Python wheel (abi3: CPython 3.11 and newer). Run it on a machine
# with the Rust toolchain; copy the checkout with .gpu/ to the GPU machine, which needs
# only an NVIDIA driver, python3 with torch (CUDA build) and pytest; no network.
#
#   .ci/gpu_bundle.sh && (on the GPU machine) .ci/gpu_check.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
export PYO3_PYTHON="${PYO3_PYTHON:-$PWD/.venv/bin/python}"
export PYO3_ENVIRONMENT_SIGNATURE=cpython-3.11-64bit
cargo build --release --locked -p eccl -p eccl-master -p eccl-chaos --bins
rm -rf .gpu && mkdir -p .gpu
for b in eccl-bench eccl-master eccl-chaos; do
    cp "target/release/$b" ".gpu/$b"
    strip ".gpu/$b"
done
rm -f target/wheels/eccl-*.whl
"$PYO3_PYTHON" -m maturin build --release --locked -m python/Cargo.toml --out target/wheels -q
cp target/wheels/eccl-*.whl .gpu/
du -sh .gpu
