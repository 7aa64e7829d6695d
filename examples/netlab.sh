#!/usr/bin/env bash
# The network lab: eccl peers on links of different speeds, each peer in a network
# namespace of its own (a host of its own to eccl, so no shared memory between them),
# the master in another, all on one bridge. Each peer shapes what it sends with `tc`
# (an htb qdisc on its veth: FAST by default, SLOW to the peers a scenario names; netem
# is not available here, so links differ in rate, not in delay). It runs eccl-bench's
# all_reduce twice over TCP links, in rank order and after optimize_topology()
# (--show-topology, which prints the measured matrix and the ring), and compares.
#
#   sudo bash examples/netlab.sh --scenario slow-pair --json out.json
#
# Scenarios (SLOW is FAST / 100):
#   slow-pair  4 peers; 0<->1 and 2<->3 are slow. Rank order's ring (0 1 2 3) crosses
#              both, a ring such as 0 2 1 3 none.
#   slow-ring  5 peers; every link between neighbours in rank order (i <-> i+1) is
#              slow, so rank order's ring is slow throughout and 0 2 4 1 3 is not.
#   wan        4 peers; one long slow hop, 3<->0 (rank order's closing link).
#   uniform    4 peers (--peers N: 2 or more), every link at --fast: where int8 on the
#              wire is measured against the exact all_reduce on equal links.
#   long-fat   2 peers joined by a long fat path: their links go over a TUN device pair
#              that eccl-bench delay-link relays with a --delay-ms round trip (netem's
#              part), shaped to --fast by tbf; the master on the bridge. Runs with one
#              connection per link (ECCL_NSTREAMS=1), then with ECCL_NSTREAMS=auto after
#              optimize_topology(), which stripes a link whose one connection the TCP
#              window held back; reports both as fractions of the rate.
#
# Options: --size (bytes, default 1M), --iters (default 3), --peers (uniform's count), --fast (default 1gbit;
# long-fat: 400mbit), --delay-ms (long-fat's round trip, default 100), --collective
# (eccl-bench's: all_reduce by default; all_gather, reduce_scatter, broadcast, ... follow
# the solved ring too; the int8 run is all_reduce's only), --transport (tcp by default;
# tls or quic), --json FILE. The JSON: {"scenario", "rank_order_busbw_gbps", "optimized_busbw_gbps",
# "speedup", "ring", "striped_rate_fraction", "one_connection_rate_fraction",
# "quantized_speedup", "quantized_ring_speedup", "quantized_max_rel_error"}: the rate fractions are long-fat's
# (null elsewhere); quantized_max_rel_error is the int8 run's largest error over the
# largest exact value (`eccl-bench -c --quantize`, which also fails an element past the
# documented bound and a rank whose bits differ). quantized_speedup is rank order's time over
# the int8 run's, quantized_ring_speedup the same for int8 after optimize_topology() (its
# all_to_all relayed around the solved ring where links off it are much slower); not run
# for long-fat.
#
# Needs root, iproute2 (ip, tc) and a release build. Every namespace, link and process
# it makes is removed on exit, also on failure; where namespaces cannot be made it says
# so and exits 3.
set -euo pipefail
cd "$(dirname "$0")/.."
SCENARIO=slow-pair SIZE=1M ITERS=3 FAST= DELAY_MS=100 JSON= COLL=all_reduce TRANSPORT=tcp PEERS=
while [ $# -gt 0 ]; do
    case $1 in
        --scenario) SCENARIO=$2; shift 2 ;;
        --size) SIZE=$2; shift 2 ;;
        --iters) ITERS=$2; shift 2 ;;
        --fast) FAST=$2; shift 2 ;;
        --delay-ms) DELAY_MS=$2; shift 2 ;;
        --json) JSON=$2; shift 2 ;;
        --collective) COLL=$2; shift 2 ;;
        --transport) TRANSPORT=$2; shift 2 ;;
        --peers) PEERS=$2; shift 2 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "netlab: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $SCENARIO in
    slow-pair) N=4; SLOW_PAIRS="0-1 2-3" ;;
    slow-ring) N=5; SLOW_PAIRS="0-1 1-2 2-3 3-4 4-0" ;;
    wan) N=4; SLOW_PAIRS="3-0" ;;
    long-fat) N=2; SLOW_PAIRS="" ;;
    uniform) N=${PEERS:-4}; SLOW_PAIRS="" ;;
    *) echo "netlab: unknown scenario $SCENARIO (slow-pair, slow-ring, wan, long-fat, uniform)" >&2; exit 2 ;;
esac
if [ -n "$PEERS" ] && { [ "$SCENARIO" != uniform ] || ! [[ "$PEERS" =~ ^[0-9]+$ ]] || [ "$PEERS" -lt 2 ] || [ "$PEERS" -gt 16 ]; }; then
    echo "netlab: --peers takes 2 to 16 and the uniform scenario only (the others name their links)" >&2
    exit 2
fi
if [ -z "$FAST" ]; then
    if [ "$SCENARIO" = long-fat ]; then FAST=400mbit; else FAST=1gbit; fi
fi
rate_bits() { # 1gbit -> bits per second
    local v=${1%bit} m=1
    case $v in *g) m=1000000000; v=${v%g} ;; *m) m=1000000; v=${v%m} ;; *k) m=1000; v=${v%k} ;; esac
    echo $((v * m))
}
FAST_BPS=$(rate_bits "$FAST")
SLOW=$((FAST_BPS / 100000))kbit
BENCH=$PWD/target/release/eccl-bench
MASTER=$PWD/target/release/eccl-master
[ -x "$BENCH" ] && [ -x "$MASTER" ] || { echo "build first: cargo build --release" >&2; exit 2; }

TAG=$$
SW=eccl-sw-$TAG
NSS=()
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    for ns in "${NSS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
if ! ip netns add "$SW" 2>/dev/null; then
    echo "netlab: skipped: network namespaces cannot be made here (ip netns add failed; needs root)" >&2
    exit 3
fi
NSS+=("$SW")
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
# One namespace per host: "m" for the master, 0..N-1 for the peers.
attach() { # name ip
    local ns=eccl-$1-$TAG
    ip netns add "$ns"
    NSS+=("$ns")
    ip link add "v$1-$TAG" netns "$ns" type veth peer name "s$1" netns "$SW"
    ip -n "$SW" link set "s$1" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "v$1-$TAG" name eth0
    ip -n "$ns" addr add "$2/24" dev eth0
    ip -n "$ns" link set eth0 up
}
ip_of() { echo "10.77.0.$((10 + $1))"; }
attach m 10.77.0.2
LINK_ENV=()
for i in $(seq 0 $((N - 1))); do
    attach "$i" "$(ip_of "$i")"
    ns=eccl-$i-$TAG
    # long-fat's links go over tun0 (below); eth0 carries the master's traffic only.
    [ "$SCENARIO" = long-fat ] && continue
    ip netns exec "$ns" tc qdisc add dev eth0 root handle 1: htb default 10 r2q 1000
    ip netns exec "$ns" tc class add dev eth0 parent 1: classid 1:10 htb rate "$FAST"
    ip netns exec "$ns" tc class add dev eth0 parent 1: classid 1:20 htb rate "$SLOW"
    for pair in $SLOW_PAIRS; do
        a=${pair%-*} b=${pair#*-}
        other=
        [ "$a" = "$i" ] && other=$b
        [ "$b" = "$i" ] && other=$a
        [ -n "$other" ] && ip netns exec "$ns" tc filter add dev eth0 parent 1: protocol ip prio 1 \
            u32 match ip dst "$(ip_of "$other")/32" flowid 1:20
    done
done

if [ "$SCENARIO" = long-fat ]; then
    # The peers' links over tun0 (ECCL_SOCKET_IFNAME), each side's sending shaped by tbf,
    # the relay adding the round trip; the master stays on the bridge.
    for i in 0 1; do
        ns=eccl-$i-$TAG
        ip -n "$ns" tuntap add dev tun0 mode tun
        ip -n "$ns" addr add "10.78.0.$((10 + i))" peer "10.78.0.$((11 - i))" dev tun0
        ip -n "$ns" link set tun0 mtu 65000 up
        ip netns exec "$ns" tc qdisc add dev tun0 root tbf rate "$FAST" burst 512k latency 400ms
    done
    "$BENCH" delay-link "eccl-0-$TAG" tun0 "eccl-1-$TAG" tun0 --delay-ms "$DELAY_MS" >/dev/null &
    PIDS+=($!)
    LINK_ENV=(ECCL_SOCKET_IFNAME=tun0)
fi

export ECCL_SECRET
ECCL_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
out=$(mktemp)
ip netns exec "eccl-m-$TAG" "$MASTER" --listen 10.77.0.2:0 >"$out" 2>/dev/null &
PIDS+=($!)
for _ in $(seq 200); do grep -q "listening on" "$out" && break; sleep 0.05; done
ADDR=$(sed -n 's/^eccl-master listening on \([^ ]*\).*/\1/p' "$out" | head -1)
rm -f "$out"
[ -n "$ADDR" ] || { echo "netlab: the master did not start" >&2; exit 1; }
if [ "$SCENARIO" = long-fat ]; then
    echo "# netlab $SCENARIO: $N peers over one $FAST path with a $DELAY_MS ms round trip; master $ADDR"
else
    echo "# netlab $SCENARIO: $N peers, $FAST links, $SLOW between $SLOW_PAIRS; master $ADDR"
fi

run() { # eccl-bench flags beyond the size and iterations; prints rank 0's output
    local first=() log
    local envs=(ECCL_TRANSPORT="$TRANSPORT" "${LINK_ENV[@]}" "${RUN_ENV[@]}")
    log=$(mktemp)
    for i in $(seq 1 $((N - 1))); do
        ip netns exec "eccl-$i-$TAG" env "${envs[@]}" "$BENCH" "$COLL" --master "$ADDR" \
            --world-size "$N" --rank-hint "$i" -b "$SIZE" -e "$SIZE" -n "$ITERS" -w 1 "$@" \
            >/dev/null 2>&1 &
        first+=($!)
        PIDS+=($!)
    done
    ip netns exec "eccl-0-$TAG" env "${envs[@]}" "$BENCH" "$COLL" --master "$ADDR" \
        --world-size "$N" --rank-hint 0 -b "$SIZE" -e "$SIZE" -n "$ITERS" -w 1 "$@" >"$log" 2>&1 || {
        cat "$log" >&2
        echo "netlab: rank 0 failed" >&2
        exit 1
    }
    for p in "${first[@]}"; do wait "$p"; done
    cat "$log"
    rm -f "$log"
}
busbw() { sed -n 's/^# Avg bus bandwidth *: *\([0-9.]*\).*/\1/p' | head -1; }
usec() { awk '/^ +[0-9]/ { print $6; exit }'; }  # the size row's time column
wrong() { grep -q "Out of bounds values : 0 OK" || { echo "netlab: wrong results" >&2; exit 1; }; }
# A quantized run checked with -c: no element past its bound, the same bits everywhere.
within() {
    echo "$1" | grep -q "Out of bounds values : 0 OK" && echo "$1" | grep -q "identical on every rank: yes" \
        || { echo "netlab: int8 results past their bound, or not the same on every rank" >&2; exit 1; }
}

RUN_ENV=()
[ "$SCENARIO" = long-fat ] && RUN_ENV=(ECCL_NSTREAMS=1)
plain=$(run -c)
RUN_ENV=()
echo "$plain" | grep -E "^# eccl-bench|^ +[0-9]" | sed "s/^/rank order: /"
echo "$plain" | wrong
# long-fat: rank 0's probe says what held its connection back (the striping verdict).
[ "$SCENARIO" = long-fat ] && RUN_ENV=(ECCL_DEBUG=INFO)
optimized=$(run -c --show-topology)
RUN_ENV=()
echo "$optimized" | grep -E "^#( topology| ring| algorithms| +from| +to)|^# eccl-bench|^ +[0-9]" | sed "s/^/optimized:  /"
echo "$optimized" | wrong
b0=$(echo "$plain" | busbw)
b1=$(echo "$optimized" | busbw)
ring=$(echo "$optimized" | sed -n 's/^# ring \[\([0-9, ]*\)\].*/\1/p' | head -1)
# What the master's model of the measured links chose for each collective and size.
algorithms=$(echo "$optimized" | sed -n 's/^# algorithms from the measured links: //p' | head -1)
# From the times: the bus bandwidths are printed to three decimals only.
t0=$(echo "$plain" | usec)
t1=$(echo "$optimized" | usec)
speedup=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
echo "# $SCENARIO: bus bandwidth rank order $b0 GB/s, optimized $b1 GB/s ($speedup x), ring [$ring]"
fractions="null null" qspeedup=null qrspeedup=null qerr=null
if [ "$SCENARIO" = long-fat ]; then
    # Rank order and the solved ring are one ring of two: the second run differs in its
    # links, striped where optimize_topology() found one connection held back by its windows.
    echo "$optimized" | grep -E "^# striped" || true
    echo "$optimized" | sed -n 's/^.*\(link to rank [0-9]*: [0-9]* connection(s) spent .*\)$/# probe: \1/p'
    # Two ranks: each sends the whole buffer once per all_reduce (its bus bandwidth).
    rate() { awk -v bps="$FAST_BPS" '/^ +[0-9]/ { printf "%.3f", $1 * 8 / ($6 * 1e-6) / bps; exit }'; }
    fractions="$(echo "$optimized" | rate) $(echo "$plain" | rate)"
    echo "# $SCENARIO: one connection ${fractions#* } of the $FAST rate, striped ${fractions% *}"
elif [ "$COLL" = all_reduce ]; then
    # int8 on the wire (all_to_all and all_gather of 8-bit codes, rank order): its results
    # are within a bound, not exact: -c checks every element against the documented
    # bound and the same bits on every rank, and says the largest relative error.
    quantized=$(run --quantize int8 -c)
    echo "$quantized" | grep -E "^# eccl-bench|^ +[0-9]|^# int8:" | sed "s/^/int8:       /"
    within "$quantized"
    qerr=$(echo "$quantized" | sed -n 's/^# int8: max relative error \([0-9.e+-]*\) .*/\1/p' | head -1)
    tq=$(echo "$quantized" | usec)
    qspeedup=$(awk -v a="$t0" -v b="$tq" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
    echo "# $SCENARIO: int8 on the wire ${qspeedup} x rank order's time"
    # The same after optimize_topology(): the master's model of the measured links finds
    # an all_to_all straight across the slow links slower than relaying around the solved
    # ring (World.tuned), so the codes go around the ring (its all_gather follows the ring
    # anyway).
    qring=$(run --quantize int8 -c --show-topology)
    echo "$qring" | grep -E "^# ring|^# eccl-bench|^ +[0-9]|^# int8:" | sed "s/^/int8 ring:  /"
    within "$qring"
    tqr=$(echo "$qring" | usec)
    qrspeedup=$(awk -v a="$t0" -v b="$tqr" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
    echo "# $SCENARIO: int8 on the wire over the solved ring ${qrspeedup} x rank order's time"
fi
if [ -n "$JSON" ]; then
    printf '{"scenario": "%s", "collective": "%s", "peers": %d, "fast": "%s", "slow": "%s", "size": "%s", "rank_order_busbw_gbps": %s, "optimized_busbw_gbps": %s, "speedup": %s, "ring": [%s], "striped_rate_fraction": %s, "one_connection_rate_fraction": %s, "quantized_speedup": %s, "quantized_ring_speedup": %s, "quantized_max_rel_error": %s, "algorithms": "%s"}\n' \
        "$SCENARIO" "$COLL" "$N" "$FAST" "$SLOW" "$SIZE" "$b0" "$b1" "$speedup" "$ring" "${fractions% *}" "${fractions#* }" "$qspeedup" "$qrspeedup" "${qerr:-null}" "$algorithms" >"$JSON"
fi
