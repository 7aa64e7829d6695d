#!/usr/bin/env bash
# The one test command (README): installs what it needs, builds everything, runs every
# test suite. Works on a fresh machine with only the Rust toolchain and Python 3.11.
#
#   bash .ci/test.sh            # everything CI runs
#   ECCL_SKIP_TORCH=1 bash .ci/test.sh   # skip installing torch (and the tests needing it)
#   ECCL_SOAK=1 bash .ci/test.sh         # also the 10-minute chaos soak and the 6-peer,
#                                        # 5-minute target run of issue 3
#   ECCL_TORCHFT=1 bash .ci/test.sh      # also torchft on eccl (python/tests/test_torchft.py
#                                        # installs torchft into .venv-torchft)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

step() { printf '\n==> %s\n' "$*"; }

step "system packages: python3-venv, valgrind, and what the verbs feature builds with"
pkgs=()
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || pkgs+=(python3-venv)
command -v valgrind >/dev/null 2>&1 || pkgs+=(valgrind)
# ibverbs-sys configures rdma-core with cmake (libnl), runs bindgen (libclang) and links
# libibverbs; ibverbs-utils gives ibv_devices, to see whether a device is there.
for p in cmake libclang-dev libnl-3-dev libnl-route-3-dev libibverbs-dev pkg-config ibverbs-utils; do
    dpkg -s "$p" >/dev/null 2>&1 || pkgs+=("$p")
done
if [ ${#pkgs[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi

step "nightly toolchain with Miri (for the unsafe-code checks only)"
rustup toolchain install nightly --profile minimal --component miri,rust-src --allow-downgrade

step "python venv (.venv): pip, maturin, pytest, numpy, torch"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q maturin pytest numpy
if [ -z "${ECCL_SKIP_TORCH:-}" ]; then
    .venv/bin/python -m pip install -q torch
fi

step "build (release, whole workspace)"
cargo build --release --workspace

step "python package: pip install ./python (maturin, abi3 wheel) into .venv"
.venv/bin/python -m pip install -q ./python

step "rust tests"
cargo test --release --workspace

step "rust tests of the verbs feature (RDMA links; without a device they say why they skip)"
ibv_devices 2>&1 | head -5 || true
cargo test --release -p eccl-transport --features verbs -- verbs --nocapture

step "miri: the executor's buffer borrows and the shared-memory ring between threads"
# Miri interprets the pure-Rust unsafe code and fails on any undefined behaviour or data
# race; the Python layer's unsafe code calls into C, so valgrind checks it (pytest below).
cargo +nightly miri test -p eccl --lib executor::bufs
cargo +nightly miri test -p eccl-transport --lib shm::segment

step "python tests"
if [ -z "${ECCL_SKIP_TORCH:-}" ]; then
    .venv/bin/python -m pytest -q python/tests
else
    echo "skipped (ECCL_SKIP_TORCH is set)"
fi

step "smoke: eccl-bench all_reduce --local 4 -c over every transport"
for t in tcp shm quic; do
    ECCL_TRANSPORT=$t target/release/eccl-bench all_reduce --local 4 -b 8 -e 8M -f 8 -n 3 -w 1 -c
done

seed="${ECCL_CHAOS_SEED:-$RANDOM}"
step "chaos: 45 s of kills, hangs, joins and leaves on 4 peers over shared memory (exit 1 on any violation)"
target/release/eccl-chaos --peers 4 --duration 45 --seed "$seed" --transport shm
for t in tcp quic tls; do
    step "chaos: 20 s over $t"
    target/release/eccl-chaos --peers 4 --duration 20 --seed "$seed" --transport "$t"
done
step "chaos: 30 s with three masters, the leader killed and hung among peer faults"
target/release/eccl-chaos --peers 4 --masters 3 --duration 30 --seed "$seed" --state-mb 4 \
    --faults kill,hang,join,master-kill,master-hang

if [ -n "${ECCL_SOAK:-}" ]; then
    step "soak: the issue-3 target run (6 peers, 5 minutes) and the 10-minute soak"
    target/release/eccl-chaos --peers 6 --duration 300 --seed 42 --interval-ms 2500
    step "soak: the issue-10 target run (8 peers, 3 masters, 10 minutes, every fault)"
    target/release/eccl-chaos --peers 8 --masters 3 --duration 600 --seed 10 --state-mb 4 \
        --faults kill,hang,join,leave,master-kill,master-hang
    cargo test --release -p eccl-chaos -- --ignored
fi
