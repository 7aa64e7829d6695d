#!/usr/bin/env python3
"""eccl vs gloo all_reduce, in one run on one machine.

Runs `eccl-bench all_reduce --local N` and the same sizes with torch.distributed's
gloo backend over N local processes, then prints both tables and eccl/gloo ratios.

    .venv/bin/python examples/compare_gloo.py --ranks 2 4 -b 1K -e 256M -f 4
    .venv/bin/python examples/compare_gloo.py --ranks 2 4 -b 64M -e 64M --inplace
    .venv/bin/python examples/compare_gloo.py --ranks 2 -b 1K -e 64M -f 4 \
        --transports shm,tcp,quic --plot all_reduce.svg   # docs/pictures/all_reduce.svg

--plot draws every result in one picture with `eccl-bench plot` (bus bandwidth and time
against size): eccl over each transport and gloo side by side.

Needs torch (the test script installs it in .venv) and a release build
(`cargo build --release`).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "target" / "release" / "eccl-bench"


def parse_size(s):
    s = s.strip().upper()
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(s[:-1] if mul > 1 else s) * mul


def sizes(lo, hi, f):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= f
    return out


def gloo_worker(rank, world, port, sizes, iters, warmup, out_path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for size in sizes:
        t = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        us = (time.perf_counter() - t0) * 1e6 / iters
        m = torch.tensor([us], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        rows.append({"bytes": size, "time_us": m.item()})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def run_gloo(world, szs, iters, warmup):
    port = free_port()
    out = tempfile.mktemp(suffix=".json")
    procs = [
        subprocess.Popen([sys.executable, __file__, "--gloo-worker", str(r), str(world), str(port), out,
                          json.dumps(szs), str(iters), str(warmup)])
        for r in range(world)
    ]
    try:
        for p in procs:
            if p.wait(timeout=1800) != 0:
                raise SystemExit(f"gloo worker failed with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(out) as f:
        rows = json.load(f)
    os.unlink(out)
    for r in rows:
        t = r["time_us"]
        r["algbw_gbps"] = r["bytes"] / t / 1e3
        r["busbw_gbps"] = r["algbw_gbps"] * 2 * (world - 1) / world
    return rows


def run_eccl(world, lo, hi, f, iters, warmup, transport="auto", inplace=False):
    out = tempfile.mktemp(suffix=".json")
    cmd = [str(BENCH), "all_reduce", "--local", str(world), "-b", str(lo), "-e", str(hi), "-f", str(f),
           "-n", str(iters), "-w", str(warmup), "-c", "--json", out] + (["--inplace"] if inplace else [])
    env = dict(os.environ)
    if transport != "auto":
        env["ECCL_TRANSPORT"] = transport
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800, env=env)
    with open(out) as fh:
        rows = json.load(fh)["rows"]
    os.unlink(out)
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--gloo-worker":
        r, w, port, out, szs, iters, warmup = sys.argv[2:9]
        gloo_worker(int(r), int(w), int(port), json.loads(szs), int(iters), int(warmup), out)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("-b", default="1K")
    ap.add_argument("-e", default="256M")
    ap.add_argument("-f", type=int, default=4)
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("-w", type=int, default=2)
    ap.add_argument("--transports", default="auto",
                    help="eccl's transports to run, comma-separated (auto, shm, tcp, tls, quic); "
                         "the table compares the first with gloo")
    ap.add_argument("--inplace", action="store_true",
                    help="eccl works in place, as gloo's dist.all_reduce does (eccl keeps G2: a failed "
                         "call leaves the buffer as it was; gloo leaves what it wrote); out of place "
                         "by default")
    ap.add_argument("--json", help="write both result sets here")
    ap.add_argument("--plot", help="draw every result into this SVG file (eccl-bench plot)")
    a = ap.parse_args()
    transports = [t for t in a.transports.split(",") if t]
    if not transports:
        ap.error("--transports names no transport")
    if not BENCH.exists():
        raise SystemExit(f"{BENCH} missing: run `cargo build --release` first")
    lo, hi = parse_size(a.b), parse_size(a.e)
    szs = sizes(lo, hi, a.f)
    results = {}
    for n in a.ranks:
        by_transport = {t: run_eccl(n, lo, hi, a.f, a.n, a.w, t, a.inplace) for t in transports}
        e = by_transport[transports[0]]
        g = run_gloo(n, szs, a.n, a.w)
        results[n] = {"eccl": e, "gloo": g}
        if len(transports) > 1:
            results[n]["eccl_by_transport"] = by_transport
        mode = "eccl in place (G2)" if a.inplace else "eccl out of place"
        print(f"\n# all_reduce float32 sum, {n} ranks, {a.n} iterations ({a.w} warm-up), {mode}, "
              "same machine, same run")
        print(f"# {'size(B)':>11} | {'eccl us':>10} {'busbw':>7} | {'gloo us':>10} {'busbw':>7} |"
              f" {'busbw eccl/gloo':>15} {'time gloo/eccl':>14}")
        for er, gr in zip(e, g):
            busbw_ratio = er['busbw_gbps'] / max(gr['busbw_gbps'], 1e-12)
            time_ratio = gr['time_us'] / max(er['time_us'], 1e-12)
            print(f"  {er['bytes']:>11} | {er['time_us']:>10.1f} {er['busbw_gbps']:>7.3f} |"
                  f" {gr['time_us']:>10.1f} {gr['busbw_gbps']:>7.3f} | {busbw_ratio:>15.2f} {time_ratio:>14.2f}")
        sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        plot(results, transports, a.plot)


def plot(results, transports, path):
    """Every result as an eccl-bench --json file (gloo's rows in the same shape), drawn
    into one picture by `eccl-bench plot`."""
    several = len(results) > 1
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for n, r in results.items():
            sets = [(f"eccl {t}", r.get("eccl_by_transport", {t: r["eccl"]})[t]) for t in transports]
            sets.append(("gloo", [dict(row, dtype="float32", op="sum") for row in r["gloo"]]))
            for label, rows in sets:
                f = os.path.join(tmp, f"{len(files)}.json")
                with open(f, "w") as fh:
                    json.dump({"collective": "all_reduce", "world_size": n, "transport": label,
                               "label": f"{label}, {n} ranks" if several else label,
                               "rows": rows}, fh)
                files.append(f)
        subprocess.run([str(BENCH), "plot", path, *files], check=True, timeout=120)


if __name__ == "__main__":
    main()
