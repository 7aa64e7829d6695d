"""all_to_all with split sizes (a dropless MoE layer's dispatch) through torch.distributed:
`dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes)` on the "eccl"
backend against gloo, the two alternating in rounds so that both see the same load.
Prints one line per backend and pattern, and with --json writes every figure.

Each rank holds `--mib` MiB of f32 rows (rows of 1,024 values) to route to the ranks'
experts, one expert per rank, with expert t's share of a rank's rows proportional to
1/(1 + t')^skew:
- `hot`: every rank favours the same experts (t' = t): rank 0 receives the most;
- `rotated`: each rank favours its own next ranks (t' = t - r mod n): every rank sends
  and receives as much, in blocks of very different sizes;
- `even`: every block the same (no split sizes would be needed).

    python examples/compare_alltoall.py --ranks 2 4 --mib 16 --skew 1.5 --rounds 3
"""

import argparse
import json
import os
import statistics

from compare_collectives import run_ranks

ROW = 1024  # f32 values a row

WORKER = r"""
import json, sys, time, torch, torch.distributed as dist
backend, rank, n, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows, skew, pattern, iters, row = int(sys.argv[5]), float(sys.argv[6]), sys.argv[7], int(sys.argv[8]), int(sys.argv[9])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, n, rank == 0)
dist.init_process_group(backend, store=store, rank=rank, world_size=n)


def split(r):
    # Rows rank r sends to each rank (they add up to `rows`).
    if pattern == "even":
        w = [1.0] * n
    else:
        w = [1.0 / (1 + ((t - r) % n if pattern == "rotated" else t)) ** skew for t in range(n)]
    s = [int(rows * x / sum(w)) for x in w]
    s[max(range(n), key=lambda t: w[t])] += rows - sum(s)
    return s


sends = split(rank)
recvs = [split(s)[rank] for s in range(n)]
inp = torch.randn(rows, row)
out = torch.empty(sum(recvs), row)
for _ in range(2):
    dist.all_to_all_single(out, inp, recvs, sends)
# The blocks this rank got are what their senders meant it to have.
want = torch.cat([torch.full((recvs[s], row), float(s)) for s in range(n)])
probe = torch.full((rows, row), float(rank))
dist.all_to_all_single(out, probe, recvs, sends)
assert torch.equal(out, want), "wrong blocks"
times = []
for _ in range(iters):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_to_all_single(out, inp, recvs, sends)
    times.append(time.perf_counter() - t0)
sent = sum(sends[t] for t in range(n) if t != rank) * row * 4
print("RESULT " + json.dumps({"times": times, "sent": sent, "widest": max(max(split(s)) for s in range(n)) * row * 4}))
dist.destroy_process_group()
"""


def run(backend, n, rows, skew, pattern, iters):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = run_ranks(WORKER, backend, n, [str(rows), str(skew), pattern, str(iters), str(ROW)], env)
    # A call takes as long as its slowest rank: the slowest rank's time, call by call.
    per_call = [max(o["times"][i] for o in outs) for i in range(iters)]
    return statistics.median(per_call), sum(o["sent"] for o in outs), outs[0]["widest"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=float, default=16, help="MiB of rows each rank routes")
    ap.add_argument("--skew", type=float, default=1.5)
    ap.add_argument("--patterns", nargs="+", default=["rotated", "hot", "even"],
                    choices=["rotated", "hot", "even"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["eccl", "gloo"])
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    rows = max(1, int(a.mib * (1 << 20) / (ROW * 4)))
    figures = []
    for n in a.ranks:
        for pattern in a.patterns:
            times = {b: [] for b in a.backends}
            for _ in range(a.rounds):
                for b in a.backends:
                    t, sent, widest = run(b, n, rows, a.skew, pattern, a.iters)
                    times[b].append(t)
            line = (f"{n} ranks, {pattern:7s}: to other ranks {sent / 2**20:7.1f} MiB, "
                    f"widest block {widest / 2**20:6.2f} MiB")
            for b in a.backends:
                line += f" | {b} {min(times[b]) * 1e3:7.1f}-{max(times[b]) * 1e3:7.1f} ms"
            if "eccl" in times and "gloo" in times:
                best = min(times["gloo"]) / min(times["eccl"])
                worst = max(times["gloo"]) / max(times["eccl"])
                line += f" | gloo/eccl {min(best, worst):.2f}-{max(best, worst):.2f}x"
            print(line, flush=True)
            figures.append({"ranks": n, "pattern": pattern, "skew": a.skew, "mib": a.mib,
                            "bytes_to_others": sent, "widest_block": widest,
                            "median_call_s": times})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
