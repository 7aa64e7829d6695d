"""Every torch.distributed collective on the "eccl" backend against gloo, the two
alternating in rounds (each round a fresh set of processes), on CPU tensors of `--mib`
MiB (f32): the tensor forms, the list forms with blocks as separate tensors and with
blocks cut from one tensor (`list(t.split(k))`: eccl reads and writes those in place), a
ring of batch_isend_irecv, two object collectives and a barrier. Prints each call's
median (the slowest rank's time per call), worst and best over the rounds, and gloo's
time over eccl's. Each call is made three times before it is timed: the first calls of a
world over shared memory touch the pages of its links' rings for the first time (8 slots
of a frame each way a link, mapped lazily so that worlds of many local peers reserve
nothing they do not use), which at 8 ranks on two cores made the first four or five
all_to_alls 2-6 times slower than the rest.

    python examples/compare_collectives.py --ranks 2 4 --mib 16 --rounds 2
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402

WORKER = r"""
import json, sys, time, torch, torch.distributed as dist
backend, rank, n, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mib, iters = float(sys.argv[5]), int(sys.argv[6])
names = sys.argv[7].split(",")
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, n, rank == 0)
dist.init_process_group(backend, store=store, rank=rank, world_size=n)
b = max(1, int(mib * (1 << 20) / 4) // n)    # elements of a block
x = torch.randn(b * n)


def blocks():
    return [torch.empty(b) for _ in range(n)]


def views():
    return list(torch.empty(b * n).split(b))


def filled(bs):
    for t, v in zip(bs, x.split(b)):
        t.copy_(v)
    return bs


# Each entry makes the call's tensors (not timed) and returns the call.
root = rank == 0
ops = {
    "all_reduce": lambda: lambda: dist.all_reduce(x),
    "broadcast": lambda: lambda: dist.broadcast(x, 0),
    "reduce": lambda: lambda: dist.reduce(x, 0),
    "all_gather_into_tensor": lambda: (lambda o: lambda: dist.all_gather_into_tensor(o, x[:b]))(torch.empty(b * n)),
    "reduce_scatter_tensor": lambda: (lambda o: lambda: dist.reduce_scatter_tensor(o, x))(torch.empty(b)),
    "all_to_all_single": lambda: (lambda o: lambda: dist.all_to_all_single(o, x))(torch.empty(b * n)),
    "all_gather": lambda: (lambda o: lambda: dist.all_gather(o, x[:b]))(blocks()),
    "all_gather_views": lambda: (lambda o: lambda: dist.all_gather(o, x[:b]))(views()),
    "reduce_scatter": lambda: (lambda o, i: lambda: dist.reduce_scatter(o, i))(torch.empty(b), filled(blocks())),
    "reduce_scatter_views": lambda: (lambda o: lambda: dist.reduce_scatter(o, list(x.split(b))))(torch.empty(b)),
    "all_to_all": lambda: (lambda o, i: lambda: dist.all_to_all(o, i))(blocks(), filled(blocks())),
    "all_to_all_views": lambda: (lambda o: lambda: dist.all_to_all(o, list(x.split(b))))(views()),
    "gather": lambda: (lambda o: lambda: dist.gather(x[:b], o, 0))(blocks() if root else None),
    "gather_views": lambda: (lambda o: lambda: dist.gather(x[:b], o, 0))(views() if root else None),
    "scatter": lambda: (lambda o, i: lambda: dist.scatter(o, i, 0))(torch.empty(b), filled(blocks()) if root else None),
    "scatter_views": lambda: (lambda o: lambda: dist.scatter(o, list(x.split(b)) if root else None, 0))(torch.empty(b)),
    "send_recv_ring": lambda: (lambda y: lambda: [w.wait() for w in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x[:b], (rank + 1) % n), dist.P2POp(dist.irecv, y, (rank - 1) % n)])])(torch.empty(b)),
    # Small Python objects (what evaluation loops and launchers pass around), whatever --mib says.
    "all_gather_object": lambda: lambda: dist.all_gather_object([None] * n, {"rank": rank, "loss": 1.5}),
    "broadcast_object_list": lambda: lambda: dist.broadcast_object_list([{"step": 1}] if root else [None], 0),
    "barrier": lambda: lambda: dist.barrier(),
}
out = {}
for name in names:
    f = ops[name]()
    for _ in range(3):    # warm-up (see above)
        f()
    ts = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    out[name] = ts
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""
OPS = ["all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
       "all_to_all_single", "all_gather", "all_gather_views", "reduce_scatter", "reduce_scatter_views",
       "all_to_all", "all_to_all_views", "gather", "gather_views", "scatter", "scatter_views",
       "send_recv_ring", "all_gather_object", "broadcast_object_list", "barrier"]


def run_ranks(worker, backend, n, args, env=None):
    """Runs `worker` (Python source) as ranks 0..n-1 of a `backend` group on this host,
    each with argv `backend rank n port *args`, and returns what each printed after
    `RESULT ` (JSON). A rank that fails stops the run; every process is stopped on the
    way out."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", worker, backend, str(r), str(n), str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(n)]
    res = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"{backend} rank failed ({p.returncode}):\n{err[-3000:]}")
            res.append(json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return res


def run(backend, n, mib, iters, ops):
    res = run_ranks(WORKER, backend, n, [str(mib), str(iters), ",".join(ops)])
    return {k: statistics.median(max(r[k][i] for r in res) for i in range(iters)) for k in ops}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=float, default=16, help="MiB of the whole tensor each call moves")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    figures = []
    for n in a.ranks:
        times = {"eccl": [], "gloo": []}
        for _ in range(a.rounds):
            for b in times:
                times[b].append(run(b, n, a.mib, a.iters, a.ops))
        for op in a.ops:
            e = [t[op] for t in times["eccl"]]
            g = [t[op] for t in times["gloo"]]
            best, worst = min(g) / min(e), max(g) / max(e)
            print(f"{n} ranks {op:24s} eccl {min(e) * 1e3:8.2f}-{max(e) * 1e3:8.2f} ms  "
                  f"gloo {min(g) * 1e3:8.2f}-{max(g) * 1e3:8.2f} ms  "
                  f"gloo/eccl {min(best, worst):.2f}-{max(best, worst):.2f}x", flush=True)
            figures.append({"ranks": n, "op": op, "mib": a.mib, "eccl_s": e, "gloo_s": g})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
