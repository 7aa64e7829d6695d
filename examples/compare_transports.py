#!/usr/bin/env python3
"""eccl's transports against gloo and against their own baselines, in one run.

Each round runs, for every world size, `eccl-bench all_reduce --local N` over every
transport (tcp, tls, shm, quic) and the same sizes with torch.distributed's gloo, then
the baselines: a one-core memcpy of each size (the bound a shared-memory hop can
approach) and one quinn connection configured as eccl's own (one way, and both ways at
once as a two-rank all_reduce uses a link). Rounds alternate, so slow moments of a
shared machine fall on every contender; the tables give the median and, for ratios,
the worst and best round.

    .venv/bin/python examples/compare_transports.py --ranks 2 4 --sizes 1K,64M,256M --rounds 3

The issue's targets are printed with each figure (shm: at least 3x gloo's busbw at n=2
and 2.5x at n=4 for 64 and 256 MiB, at least 50 % of the memcpy bound, 1 KiB at n=2
under 20 us; quic: at least 70 % of the quinn probe at 64 MiB; tcp: not below gloo).
Needs a release build and torch (the test script installs both).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import compare_gloo as cg  # noqa: E402  (its gloo runner and size parsing)

BENCH = cg.BENCH
TRANSPORTS = {
    "tcp": {"ECCL_TRANSPORT": "tcp", "ECCL_TLS": "0"},
    "tls": {"ECCL_TRANSPORT": "tcp", "ECCL_TLS": "1"},
    "shm": {"ECCL_TRANSPORT": "shm", "ECCL_TLS": "0"},
    "quic": {"ECCL_TRANSPORT": "quic", "ECCL_TLS": "0"},
}


def eccl_rows(n, sizes, transport, iters, warmup):
    """eccl-bench all_reduce at exactly `sizes` (one run per size keeps the list
    arbitrary); returns {bytes: row}."""
    rows = {}
    env = dict(os.environ, **TRANSPORTS[transport])
    for s in sizes:
        out = tempfile.mktemp(suffix=".json")
        small = s <= (1 << 20)
        cmd = [str(BENCH), "all_reduce", "--local", str(n), "-b", str(s), "-e", str(s),
               "-n", str(iters * (20 if small else 1)), "-w", str(warmup * (10 if small else 1)),
               "--json", out]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, timeout=1800)
        with open(out) as f:
            rep = json.load(f)
        os.unlink(out)
        want = "local" if n == 1 else transport
        if rep["transport"] != want:
            raise SystemExit(f"asked for {transport}, eccl-bench used {rep['transport']}")
        rows[s] = rep["rows"][0]
    return rows


def probe(what, size, *extra):
    out = subprocess.run([str(BENCH), "probe", what, "-b", str(size), "-n", "5", *extra],
                         check=True, capture_output=True, text=True, timeout=600).stdout
    line = [l for l in out.splitlines() if l.startswith("probe ")][-1].split()
    return float(line[line.index("median") + 1])


def fmt_range(vals):
    return f"{min(vals):.2f}-{max(vals):.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", default="1K,64M,256M")
    ap.add_argument("--transports", default="tcp,tls,shm,quic")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=5, help="timed iterations for large sizes (x20 for <= 1 MiB)")
    ap.add_argument("-w", type=int, default=1)
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--json", help="write every measurement here")
    a = ap.parse_args()
    if not BENCH.exists():
        raise SystemExit(f"{BENCH} missing: run `cargo build --release` first")
    sizes = [cg.parse_size(s) for s in a.sizes.split(",")]
    transports = a.transports.split(",")
    data = {"rounds": []}
    for rnd in range(a.rounds):
        r = {"eccl": {}, "gloo": {}, "memcpy": {}, "quic_probe": {}}
        for n in a.ranks:
            for t in transports:
                r["eccl"][f"{n}/{t}"] = eccl_rows(n, sizes, t, a.n, a.w)
                print(f"round {rnd + 1}: n={n} {t} done", file=sys.stderr, flush=True)
            if not a.no_gloo:
                g = cg.run_gloo(n, sizes, a.n, a.w)
                r["gloo"][str(n)] = {row["bytes"]: row for row in g}
                print(f"round {rnd + 1}: n={n} gloo done", file=sys.stderr, flush=True)
        for s in sizes:
            if s >= (1 << 20):
                r["memcpy"][s] = probe("memcpy", s)
        if "quic" in transports:
            q = max(s for s in sizes)
            q = 64 << 20 if (64 << 20) in sizes else q
            r["quic_probe"] = {"bytes": q, "one_way": probe("quic", q), "both_ways": probe("quic", q, "--both")}
        data["rounds"].append(r)

    R = data["rounds"]
    for n in a.ranks:
        print(f"\n# all_reduce f32 sum, {n} ranks, {a.rounds} alternating rounds: busbw GB/s median (1 KiB: time us), "
              f"and eccl/gloo busbw ratio worst-best over rounds")
        head = f"{'size':>8} |" + "".join(f" {t:>17} |" for t in transports) + (" gloo" if not a.no_gloo else "")
        print(head)
        for s in sizes:
            cells = []
            for t in transports:
                rows = [rr["eccl"][f"{n}/{t}"][s] for rr in R]
                if s <= 4096:
                    v = statistics.median(x["time_us"] for x in rows)
                    cell = f"{v:8.1f}us"
                else:
                    cell = f"{statistics.median(x['busbw_gbps'] for x in rows):8.3f}"
                if not a.no_gloo:
                    ratios = [rr["eccl"][f"{n}/{t}"][s]["busbw_gbps"] / max(rr["gloo"][str(n)][s]["busbw_gbps"], 1e-12)
                              for rr in R]
                    cell += f" {fmt_range(ratios):>8}x"
                cells.append(f" {cell:>17} |")
            gl = ""
            if not a.no_gloo:
                grows = [rr["gloo"][str(n)][s] for rr in R]
                gl = (f" {statistics.median(x['time_us'] for x in grows):.1f}us" if s <= 4096
                      else f" {statistics.median(x['busbw_gbps'] for x in grows):.3f}")
            print(f"{cg_size(s):>8} |" + "".join(cells) + gl)
    if "shm" in transports:
        print("\n# shm against the one-core memcpy bound (busbw / memcpy GB/s, worst-best over rounds)")
        for n in a.ranks:
            for s in sizes:
                if s < (1 << 20):
                    continue
                fr = [rr["eccl"][f"{n}/shm"][s]["busbw_gbps"] / rr["memcpy"][s] for rr in R]
                mc = statistics.median(rr["memcpy"][s] for rr in R)
                print(f"  n={n} {cg_size(s):>6}: memcpy {mc:.2f} GB/s, shm at {fmt_range([100 * f for f in fr])} %")
    if "quic" in transports:
        qb = R[0]["quic_probe"]["bytes"]
        print(f"\n# quic against one quinn connection configured as eccl's ({cg_size(qb)}, GB/s per direction)")
        for n in a.ranks:
            if qb not in sizes:
                continue
            e = [rr["eccl"][f"{n}/quic"][qb]["busbw_gbps"] for rr in R]
            one = [rr["quic_probe"]["one_way"] for rr in R]
            both = [rr["quic_probe"]["both_ways"] for rr in R]
            print(f"  n={n}: eccl busbw {statistics.median(e):.3f}; probe one way {statistics.median(one):.3f} "
                  f"(eccl at {fmt_range([100 * x / y for x, y in zip(e, one)])} %), both ways "
                  f"{statistics.median(both):.3f} (eccl at {fmt_range([100 * x / y for x, y in zip(e, both)])} %)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1, default=str)


def cg_size(s):
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if s >= m and s % m == 0:
            return f"{s // m}{unit}"
    return str(s)


if __name__ == "__main__":
    main()
