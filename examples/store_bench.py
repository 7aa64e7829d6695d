"""Store latency: eccl's master store against torch's TCPStore, in one run.

Each store's server runs in a process of its own (TCPStore's with `is_master=True`,
eccl's as an `eccl-master` with one in-memory master, and as three masters with
`--data-dir`, so every write is fsynced on a majority); this process times `set`,
`get`, `add` and `compare_set` one after another, `--n` times each, alternating the
stores `--rounds` times, and prints p50 and p99 in microseconds and eccl/TCPStore.

    python examples/store_bench.py --n 2000 --rounds 3
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
sys.path.insert(0, HERE)
from eccl.store import EcclStore  # noqa: E402
from eccl_masters import Masters, write_secret  # noqa: E402
from procs import free_port  # noqa: E402

OPS = ("set", "get", "add", "compare_set")


def time_ops(store, n: int):
    out = {}
    store.set("cas", "0")
    for op in OPS:
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            if op == "set":
                store.set(f"k{i % 64}", "value")
            elif op == "get":
                store.get(f"k{i % 64}")
            elif op == "add":
                store.add("counter", 1)
            else:
                store.compare_set("cas", str(i), str(i + 1))
            ts.append(time.perf_counter() - t0)
        ts.sort()
        out[op] = (ts[len(ts) // 2] * 1e6, ts[int(len(ts) * 0.99)] * 1e6)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--master-bin", default=os.path.join(ROOT, "target", "release", "eccl-master"))
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="eccl-store-bench-")
    secret_file = os.path.join(d, "secret")
    secret = write_secret(secret_file)
    port = free_port()
    tcp_server = subprocess.Popen([sys.executable, "-c", (
        "import time, torch.distributed as dist\n"
        f"s = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
        "time.sleep(3600)\n")])
    one = Masters(1, os.path.join(d, "one"), secret_file, a.master_bin)
    three = Masters(3, os.path.join(d, "three"), secret_file, a.master_bin)
    try:
        time.sleep(2.0)
        stores = {
            "TCPStore": dist.TCPStore("127.0.0.1", port, is_master=False,
                                      timeout=timedelta(seconds=30)),
            "eccl, 1 master (memory)": EcclStore(one.endpoint, "bench", secret),
            "eccl, 3 masters (--data-dir)": EcclStore(three.endpoint, "bench", secret),
        }
        results = {k: {op: [] for op in OPS} for k in stores}
        for _ in range(a.rounds):
            for name, s in stores.items():
                for op, (p50, p99) in time_ops(s, a.n).items():
                    results[name][op].append((p50, p99))
        print(f"{a.n} calls per op, {a.rounds} rounds alternating; p50 (p99) in µs, "
              "best and worst round's p50")
        print(f"{'store':<30} " + " ".join(f"{op:>22}" for op in OPS))
        base = {op: statistics.median(p for p, _ in results["TCPStore"][op]) for op in OPS}
        for name in stores:
            cells = []
            for op in OPS:
                p50s = sorted(p for p, _ in results[name][op])
                p99 = statistics.median(q for _, q in results[name][op])
                cells.append(f"{p50s[0]:.0f}-{p50s[-1]:.0f} ({p99:.0f})")
            print(f"{name:<30} " + " ".join(f"{c:>22}" for c in cells))
        for name in list(stores)[1:]:
            ratio = " ".join(
                f"{op} {statistics.median(p for p, _ in results[name][op]) / base[op]:.2f}x"
                for op in OPS)
            print(f"{name} / TCPStore, p50: {ratio}")
    finally:
        tcp_server.kill()
        tcp_server.wait()
        one.stop()
        three.stop()


if __name__ == "__main__":
    main()
