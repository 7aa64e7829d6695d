#!/usr/bin/env bash
# What .ci/test.sh runs in the background at the lowest CPU priority, beside the Python
# tests (which leave a core idle much of the time while they wait on processes, leases
# and timeouts):
#  - every Rust test binary, the verbs feature's too, with the foreground's toolchain,
#    lint wrapper and features (only the tests themselves compile: the libraries and
#    binaries are built); target/.tests-built marks them done, for the Rust tests;
# and then the checks that build with a toolchain of their own (the pinned nightly,
# $MIRI_TOOLCHAIN):
#  - Miri over the pure-Rust unsafe code (the executor's buffer borrows, the shared-memory
#    ring): fails on any undefined behaviour or data race;
#  - coverage-guided fuzzing (cargo fuzz, libFuzzer) of every decoder a stranger or a job
#    member reaches, ECCL_FUZZ_SECONDS (default 10) per target, starting from the corpus
#    committed in fuzz/corpus (what a run finds goes to target/fuzz-corpus, not into the
#    repository; a crash leaves its input in fuzz/artifacts and fails the run).
# Miri and the fuzzers build into targets of their own (target/miri, fuzz/target).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MIRI_TOOLCHAIN:?}"

# Each part says when it starts, in seconds since the job started (bash's SECONDS), so
# the test command's log shows what the background job costs.
echo "== test binaries (at ${SECONDS} s)"
cargo test --release --workspace --locked --no-run
cargo test --release --locked -p eccl-transport --features verbs --no-run
touch target/.tests-built

unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS

echo "== miri (at ${SECONDS} s)"
# One invocation for both crates: one dependency build.
cargo +"$MIRI_TOOLCHAIN" miri test --locked -p eccl -p eccl-transport --lib -- \
    executor::bufs shm::segment

echo "== cargo fuzz (at ${SECONDS} s)"
CARGO_FUZZ_VERSION=0.13.2
if [ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
    cargo install --locked --quiet "cargo-fuzz@$CARGO_FUZZ_VERSION"
fi
cd fuzz
# No sanitizer: the decoders are safe Rust; what fuzzing looks for is a panic, an
# unbounded allocation (-rss_limit_mb, -malloc_limit_mb) or a hang (-timeout). A dev
# build (overflow checks on, no optimization): it compiles in half the time of a release
# build, which matters more for a 10 s run than executions per second (tens of
# thousands still); long runs use the release build (docs/testing.md).
# cargo fuzz takes no --locked: fetching first with it checks fuzz/Cargo.lock holds.
cargo +"$MIRI_TOOLCHAIN" fetch --locked
cargo +"$MIRI_TOOLCHAIN" fuzz build -s none --dev
seconds="${ECCL_FUZZ_SECONDS:-10}"
for t in $(cargo +"$MIRI_TOOLCHAIN" fuzz list); do
    mkdir -p "../target/fuzz-corpus/$t"
    log="../target/fuzz-$t.log"
    if ! cargo +"$MIRI_TOOLCHAIN" fuzz run -s none --dev "$t" "../target/fuzz-corpus/$t" "corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=256 -timeout=10 >"$log" 2>&1; then
        tail -60 "$log"
        echo "cargo fuzz: target $t failed; its input is in fuzz/artifacts/$t" >&2
        exit 1
    fi
    grep -E "^Done [0-9]+ runs" "$log" | sed "s/^/$t: /"
done
echo "== done (at ${SECONDS} s)"
