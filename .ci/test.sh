#!/usr/bin/env bash
# The one test command (README): installs what it needs at pinned versions, builds
# everything once, runs every suite, and prints how long each phase took. Works on a
# fresh machine with only the Rust toolchain and Python 3.11 (Debian packages come
# from apt-get; run it as root there).
#
#   bash .ci/test.sh                     # everything CI runs
#   ECCL_SKIP_TORCH=1 bash .ci/test.sh   # no torch: the Python tests are skipped
#   ECCL_SOAK=1 bash .ci/test.sh         # also the long chaos runs (6 peers for 5 minutes,
#                                        # 8 peers and 3 masters for 10) and the chaos soak
#   ECCL_TORCHFT=1 bash .ci/test.sh      # also torchft on eccl (python/tests/test_torchft.py
#                                        # installs torchft into .venv-torchft)
#
# One build serves cargo, maturin and the tests: every cargo command here sees the same
# features for every dependency (workspace-hack/, checked by .ci/check_features.py), the
# same lint wrapper and the same Python, so nothing is compiled twice.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

# Miri's nightly, pinned by date so a new nightly cannot change what CI runs.
MIRI_TOOLCHAIN=nightly-2026-10-30

# Each phase's wall time, and the CPU time the whole machine spent in it (every process:
# the background job's too), so the log shows where CPU, not only time, goes.
cpu_busy() {  # seconds of CPU used since boot, all cores (user, nice, system, irq, softirq)
    awk '/^cpu /{printf "%d\n", ($2 + $3 + $4 + $7 + $8) / 100}' /proc/stat
}
started=$(date +%s)
started_cpu=$(cpu_busy)
phase_name=""
phase_start=0
phase_cpu=0
phase_times=()
end_phase() {
    if [ -n "$phase_name" ]; then
        phase_times+=("$(($(date +%s) - phase_start))|$(($(cpu_busy) - phase_cpu))|$phase_name")
    fi
    phase_name=""
}
phase() {
    end_phase
    phase_name="$*"
    phase_start=$(date +%s)
    phase_cpu=$(cpu_busy)
    printf '\n==> %s\n' "$*"
}
summary() {
    local rc=$?
    local pid
    if [ -n "${pip_pid:-}" ]; then
        kill "$pip_pid" 2>/dev/null || true
    fi
    if [ -n "${background_pid:-}" ]; then
        kill -- "-$background_pid" 2>/dev/null || true
    fi
    if [ -n "${beside_pid:-}" ]; then
        kill -- "-$beside_pid" 2>/dev/null || true
        echo "--- the tests beside (-m beside), stopped with the run: the end of their log"
        tail -n 40 target/pytest-beside.log 2>/dev/null || true
    fi
    if [ -n "${shim_pid:-}" ]; then
        kill -- "-$shim_pid" 2>/dev/null || true
        # torch's build lock, left by the killed compile, would hold the next run's
        # build of the shim forever.
        sleep 1
        rm -f "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"/*/eccl_window_*/lock
    fi
    end_phase
    printf '\n==> phase times (wall; CPU seconds of all %s cores)\n' "$(nproc)"
    local t wall rest
    for t in "${phase_times[@]}"; do
        wall="${t%%|*}"
        rest="${t#*|}"
        printf '%7ss %6s cpu-s  %s\n' "$wall" "${rest%%|*}" "${rest#*|}"
    done
    printf '%7ss %6s cpu-s  total (exit %s)\n' "$(($(date +%s) - started))" \
        "$(($(cpu_busy) - started_cpu))" "$rc"
}
trap summary EXIT

phase "system packages: python3-venv, valgrind, and what the verbs feature builds with"
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

phase "toolchains: clippy and rustfmt (stable), $MIRI_TOOLCHAIN with Miri (the unsafe-code checks)"
rustup component add clippy rustfmt
rustup toolchain install "$MIRI_TOOLCHAIN" --profile minimal --component miri,rust-src

phase "python venv (.venv): made now; the pinned tools and torch install in the background"
# The install runs beside the Rust builds
# below (which need only the venv's interpreter, for pyo3) and is waited for before the
# first step that uses what it installs.
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
reqs=(-r python/requirements-test.txt)
if [ -z "${ECCL_SKIP_TORCH:-}" ]; then
    reqs+=(-r python/requirements-torch.txt)
fi
mkdir -p target
# uv installs the pinned set (pip's resolver and unpacking took 128 CPU seconds and 142 s
# here with its download cache warm, beside the build; uv with a cold cache 72 and 48 s),
# itself pinned and installed by the venv's pip. What it installs is byte-compiled:
# without that, where PYTHONDONTWRITEBYTECODE is set (as on this machine) every process
# that imports torch compiles it again (16 s instead of 7 per import; the Python tests
# took twice as long).
UV_VERSION=0.13.9
(
    .venv/bin/python -m pip install -q --disable-pip-version-check "uv==$UV_VERSION" &&
        .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode "${reqs[@]}"
) >target/pip.log 2>&1 &
pip_pid=$!
wait_for_pip() {
    if ! wait "$pip_pid"; then
        cat target/pip.log
        echo "uv pip install of python/requirements-*.txt failed" >&2
        return 1
    fi
}

phase "lint: rustfmt, one feature set per dependency"
cargo fmt --all -- --check
python3 .ci/check_features.py

# Every cargo build below goes through clippy-driver (rustc with clippy's lints, the
# way `cargo clippy` runs it), so the one release build is also the lint pass, with
# warnings as errors; maturin inherits the same wrapper and Python, and reuses it all.
export RUSTC_WORKSPACE_WRAPPER
RUSTC_WORKSPACE_WRAPPER="$(rustup which clippy-driver)"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
# pyo3's build script reruns (and pyo3 and eccl-python compile again) when the Python it
# was configured for changes: every command names the venv's, with the signature that
# maturin sets for it.
export PYO3_PYTHON="$PWD/.venv/bin/python"
PYO3_ENVIRONMENT_SIGNATURE="$("$PYO3_PYTHON" -c 'import struct, sys; print("cpython-%d.%d-%dbit" % (sys.version_info[0], sys.version_info[1], 8 * struct.calcsize("P")))')"
export PYO3_ENVIRONMENT_SIGNATURE

# One feature set for every cargo command and maturin: eccl-transport's verbs feature
# (RDMA links; rdma-core's headers and libibverbs, installed above) is in the one build,
# so its code is linted and its tests run with the others instead of compiling the
# transport, its tests and their dependents a second time.
CARGO_FEATURES=(--features eccl-python/verbs)
# ibverbs-sys's build script configures rdma-core for its headers and then compiles all
# of it for a libibverbs.so that the system's replaces at link and run time: this cmake
# runs the configure step only (.ci/cmake-configure-only says why).
export CMAKE="$PWD/.ci/cmake-configure-only"

phase "miri and cargo fuzz (.ci/background_checks.sh), started in the background"
# Everything below leaves CPU idle part of the time (the build's last crates and links
# run one at a time; the tests wait on processes, leases and timeouts): the background
# job uses it, from here to the end. Miri over the pure-Rust unsafe code (it fails on
# any undefined behaviour or data race; the Python layer's unsafe code calls into C, so
# valgrind checks it, pytest below), and each fuzz target briefly from the committed
# corpus. In a session of its
# own, so that a failed run stops all of it (kill -- -PID); the job lowers its own
# session's scheduling group to nice 19 (with the kernel's autogroups, a process's nice
# value only counts within its session, so `nice` alone left the job an equal share
# beside every test).
export MIRI_TOOLCHAIN
setsid -w nice -n 19 bash .ci/background_checks.sh >target/background.log 2>&1 &
background_pid=$!
wait_for_background() {
    if ! wait "$background_pid"; then
        cat target/background.log
        echo "the background job failed (target/background.log above)" >&2
        return 1
    fi
}

phase "build: the workspace's libraries, binaries and Python extension (release, clippy -D warnings)"
# What the Python tests need (the extension, eccl-master, eccl-bench, eccl-chaos) first;
# the test binaries after maturin (below).
cargo build --release --workspace --locked "${CARGO_FEATURES[@]}"

phase "python tools: the background install, ruff"
wait_for_pip
.venv/bin/ruff check python examples .ci

phase "python package: maturin into the shared target, then the wheel into .venv"
rm -f target/wheels/eccl-*.whl
.venv/bin/maturin build --release --locked -m python/Cargo.toml --features verbs --out target/wheels -q
.venv/bin/python -m pip install -q --no-deps --force-reinstall --disable-pip-version-check \
    target/wheels/eccl-*.whl
# The type stubs (python/eccl/_eccl.pyi) name what the extension really has, with the
# same signatures.
.venv/bin/python -m mypy.stubtest eccl._eccl

phase "test binaries: every test target (release, same features)"
# In the foreground: only the tests themselves compile (the libraries are built), and
# at full speed (in the background, starved by the Python tests, they took 616 s).
cargo test --release --workspace --locked "${CARGO_FEATURES[@]}" --no-run

phase "rust tests (the background job and the window shim's compile run beside them)"
# The Rust tests leave a core idle most of their time (the phase tests, paced chaos runs,
# go one at a time): the background job (Miri, the fuzzers) takes it here rather than
# beside the Python tests, which keep both cores busier, and the one-sided windows' C++
# shim compiles into torch's extension cache beside them (about 25 s of one core, which
# test_torch_window.py's first test otherwise waits for). At the lowest priority, in a
# session of its own; if it fails, that test builds it again and says why.
shim_pid=""
if [ -z "${ECCL_SKIP_TORCH:-}" ]; then
    # (A new session is a scheduling group of its own: its nice value is set there, as
    # .ci/background_checks.sh does.)
    setsid -w bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 \
        .venv/bin/python -c "import eccl.torch_window as w; w.shim()"' >target/window-shim.log 2>&1 &
    shim_pid=$!
    # The generated device kernels must compile with NVRTC (the nvidia-cuda-nvrtc wheel
    # that torch's CUDA build pulls in; no GPU needed): there a missing NVRTC fails the
    # test.
    ECCL_NVRTC_LIB="$(ls "$PWD"/.venv/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so.* | head -n 1)"
    export ECCL_NVRTC_LIB ECCL_REQUIRE_NVRTC=1
fi
cargo test --release --workspace --locked "${CARGO_FEATURES[@]}"
if [ -n "$shim_pid" ]; then
    wait "$shim_pid" || echo "the window shim did not build beside the Rust tests (target/window-shim.log); the Python tests build it"
    shim_pid=""
fi

phase "python tests (those that mostly wait in a second pytest beside the others)"
if [ -z "${ECCL_SKIP_TORCH:-}" ]; then
    # The tests marked `beside` (python/tests/conftest.py: kills, leases, group timeouts,
    # shaped links, valgrind's one core) leave most of a core idle on two, and the others
    # a fraction of one: the two sets run at once, the waiting set in a session of its
    # own (stopped with the run on failure), its log printed after.
    setsid -w .venv/bin/python -m pytest -q -p no:cacheprovider --durations=8 -m beside \
        python/tests >target/pytest-beside.log 2>&1 &
    beside_pid=$!
    main_rc=0
    .venv/bin/python -m pytest -q --durations=15 -m "not beside" python/tests || main_rc=$?
    beside_rc=0
    wait "$beside_pid" || beside_rc=$?
    beside_pid=""
    echo "--- the tests beside (-m beside):"
    cat target/pytest-beside.log
    if [ "$main_rc" -ne 0 ] || [ "$beside_rc" -ne 0 ]; then
        echo "python tests failed (exit $main_rc; beside: exit $beside_rc)" >&2
        exit 1
    fi
else
    echo "skipped (ECCL_SKIP_TORCH is set)"
fi

phase "smoke: eccl-bench all_reduce --local 4 -c over every transport"
for t in tcp shm quic; do
    ECCL_TRANSPORT=$t target/release/eccl-bench all_reduce --local 4 -b 8 -e 8M -f 8 -n 3 -w 1 -c
done

seed="${ECCL_CHAOS_SEED:-$RANDOM}"
phase "chaos: 15 s of kills, hangs, slow peers, joins and leaves on 4 peers over shared memory (exit 1 on any violation)"
target/release/eccl-chaos --peers 4 --duration 15 --seed "$seed" --transport shm \
    --faults kill,hang,slow,join,leave
for t in tcp quic tls; do
    phase "chaos: 8 s over $t"
    target/release/eccl-chaos --peers 4 --duration 8 --seed "$seed" --transport "$t"
done
phase "chaos: 20 s with three masters, the leader killed and hung among peer faults"
target/release/eccl-chaos --peers 4 --masters 3 --duration 20 --seed "$seed" --state-mb 4 \
    --faults kill,hang,join,master-kill,master-hang

# Last: whatever is left of the background job (it yields to everything above).
phase "miri and cargo fuzz: the rest of the background run"
wait_for_background
grep -E "^(== |test |test result|[a-z_]+: Done|verbs)" target/background.log

if [ -n "${ECCL_SOAK:-}" ]; then
    phase "soak: 6 peers for 5 minutes"
    target/release/eccl-chaos --peers 6 --duration 300 --seed 42 --interval-ms 2500
    phase "soak: churn on 10 peers for 10 minutes (a fault every 0.5-2 s, whatever is playing out; 4 all_reduces in flight)"
    target/release/eccl-chaos --peers 10 --duration 600 --seed 12 --churn --in-flight 4 --quiet
    phase "soak: churn with master faults, 6 peers and 3 masters for 5 minutes"
    target/release/eccl-chaos --peers 6 --masters 3 --duration 300 --seed 21 --churn --quiet \
        --faults kill,join,hang,leave,master-kill,master-hang
    phase "soak: 8 peers, 3 masters, 10 minutes, every fault"
    target/release/eccl-chaos --peers 8 --masters 3 --duration 600 --seed 10 --state-mb 4 \
        --faults kill,hang,join,leave,master-kill,master-hang
    cargo test --release --workspace --locked "${CARGO_FEATURES[@]}" --test phases -- --ignored
fi
