#!/usr/bin/env bash
# What .ci/test.sh runs in the background at the lowest CPU priority, beside the Python
# tests (which leave CPU idle part of the time while they wait on processes, leases
# and timeouts): the checks that build with a toolchain of their own (the pinned
# nightly, $MIRI_TOOLCHAIN):
#  - Miri over the pure-Rust unsafe code (the executor's buffer borrows, the shared-memory
#    ring: eccl-algorithms' bufs, eccl-shm): fails on any undefined behaviour or data race;
#  - coverage-guided fuzzing (cargo fuzz, libFuzzer) of every decoder a stranger or a job
#    member reaches, ECCL_FUZZ_SECONDS (default 6) per target, starting from the corpus
#    committed in fuzz/corpus (what a run finds goes to target/fuzz-corpus, not into the
#    repository; a crash leaves its input in fuzz/artifacts and fails the run);
# Miri and the fuzzers build into targets of their own (target/miri, fuzz/target).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MIRI_TOOLCHAIN:?}"

# With the kernel's autogroups (sched_autogroup_enabled), nice counts only within a
# session: the job's new session gets the lowest weight as a whole, so that it takes
# only what the tests leave idle. Raising one's own niceness needs no privilege.
if [ -w /proc/self/autogroup ]; then
    echo 19 >/proc/self/autogroup || true
fi

# Miri and the fuzzers do not lint (the main build does, with clippy).
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS

# Each part says when it starts, in seconds since the job started (bash's SECONDS), so
# the test command's log shows what the background job costs.
echo "== miri (at ${SECONDS} s)"
# The executor's buffer borrows (eccl-algorithms' bufs) and the shm segment (eccl-shm)
# live in crates with few dependencies (eccl-protocol without its "wire" feature), so
# Miri does not build tokio, quinn, rustls or ring. What it still compiles natively is
# the proc macros (syn, serde_derive, ...), which the workspace's dev profile optimizes
# (opt-level 2 for every dependency); Miri interprets without optimizing anyway, so they
# are built at opt-level 0 here: 188 -> 38 CPU seconds for the build.
miri_test() {
    cargo +"$MIRI_TOOLCHAIN" miri test --locked --config 'profile.dev.package."*".opt-level=0' "$@"
}
# Without the thread pool (rayon and crossbeam would be built for Miri only to go unused).
miri_test -p eccl-algorithms --lib --no-default-features -- bufs::
miri_test -p eccl-shm --lib

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
seconds="${ECCL_FUZZ_SECONDS:-6}"
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
cd ..

echo "== done (at ${SECONDS} s)"
# The CPU time this job and what it ran used (user, then system): it shares the machine
# with the foreground's tests, so its cost is in CPU, not in its wall time.
times
