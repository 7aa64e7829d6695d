#!/usr/bin/env bash
# Runs a command again and again on a loaded machine (two busy loops at the lowest
# priority, as the background checks load CI) until it fails or RUNS runs pass; keeps the
# failing run's output in target/stress-fail.log. How a test that fails once in a hundred
# runs is made to fail here (docs/testing.md, "A flaky test is a bug until shown
# otherwise"), e.g.:
#
#   cargo test --release --locked -p eccl --test worlds --no-run
#   .ci/stress.sh 300 target/release/deps/worlds-<hash> a_mixed_world --quiet
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:?usage: .ci/stress.sh RUNS COMMAND [ARGS...]}"
shift
[ $# -gt 0 ] || { echo "usage: .ci/stress.sh RUNS COMMAND [ARGS...]" >&2; exit 2; }
busy=()
stop() { [ ${#busy[@]} -gt 0 ] && kill "${busy[@]}" 2>/dev/null; }
trap stop EXIT
for _ in 1 2; do
    nice -n 19 sh -c 'while :; do :; done' &
    busy+=($!)
done
mkdir -p target
for i in $(seq 1 "$runs"); do
    if ! "$@" > target/stress-run.log 2>&1; then
        mv target/stress-run.log target/stress-fail.log
        echo "run $i of $runs failed: target/stress-fail.log"
        exit 1
    fi
done
rm -f target/stress-run.log
echo "$runs runs passed"
