#!/usr/bin/env bash
# eccl's TCP, TLS and QUIC links through a rate-limited path between two network
# namespaces (a veth pair shaped with `tc ... tbf`; netem is not available here), in one
# run: two "hosts", a master on the first, one peer on each, all_reduce with -c.
#
#   sudo bash examples/netns_transports.sh [RATE] [SIZES]     # defaults: 1gbit, 1M..64M
#
# Needs root, iproute2 (ip, tc) and a release build. Every namespace, link and process
# it makes is removed on exit, also on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
MAX=${2:-64M}
BENCH=$PWD/target/release/eccl-bench
MASTER=$PWD/target/release/eccl-master
[ -x "$BENCH" ] && [ -x "$MASTER" ] || { echo "build first: cargo build --release" >&2; exit 2; }
A=eccl-a-$$ B=eccl-b-$$
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$A"
ip netns add "$B"
ip link add veth-a-$$ netns "$A" type veth peer name veth-b-$$ netns "$B"
ip -n "$A" addr add 10.203.0.1/24 dev veth-a-$$
ip -n "$B" addr add 10.203.0.2/24 dev veth-b-$$
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set veth-a-$$ up
ip -n "$B" link set veth-b-$$ up
# One token bucket per direction: RATE each way, a burst of 64 KiB, 50 ms of queue.
ip netns exec "$A" tc qdisc add dev veth-a-$$ root tbf rate "$RATE" burst 64kb latency 50ms
ip netns exec "$B" tc qdisc add dev veth-b-$$ root tbf rate "$RATE" burst 64kb latency 50ms

SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export ECCL_SECRET=$SECRET
out=$(mktemp)
ip netns exec "$A" "$MASTER" --listen 10.203.0.1:0 >"$out" 2>/dev/null &
PIDS+=($!)
for _ in $(seq 100); do grep -q "listening on" "$out" && break; sleep 0.05; done
ADDR=$(sed -n 's/^eccl-master listening on \([^ ]*\).*/\1/p' "$out" | head -1)
echo "# $RATE each way between two namespaces; master $ADDR"
for t in tcp tls quic; do
    case $t in
        tls) envs=(ECCL_TRANSPORT=tcp ECCL_TLS=1) ;;
        *) envs=(ECCL_TRANSPORT=$t ECCL_TLS=0) ;;
    esac
    ip netns exec "$B" env "${envs[@]}" "$BENCH" all_reduce --master "$ADDR" --world-size 2 \
        --rank-hint 1 -b 1M -e "$MAX" -f 8 -n 3 -w 1 -c >/dev/null 2>&1 &
    PIDS+=($!)
    ip netns exec "$A" env "${envs[@]}" "$BENCH" all_reduce --master "$ADDR" --world-size 2 \
        --rank-hint 0 -b 1M -e "$MAX" -f 8 -n 3 -w 1 -c 2>&1 | grep -E "^#.*transport|^ +[0-9]|Out of bounds" \
        | sed "s/^/$t: /"
    wait "${PIDS[-1]}" || true
done
