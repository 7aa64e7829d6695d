"""all_gather_into_tensor and reduce_scatter_tensor through the torch backend on tensors
from the group's `allocate_tensor` (eccl's shared memory: the ranks read each other's
memory directly) against the same calls on plain tensors (over the links), in one run,
alternating, on N local ranks. Prints the median time of each per size.

    .venv/bin/python examples/shared_collectives.py --ranks 2 --sizes 1M 16M 64M --iters 20
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402


def worker(sizes, iters):
    import eccl.torch  # noqa: F401
    import torch
    import torch.distributed as dist

    dist.init_process_group("eccl")
    r, n = dist.get_rank(), dist.get_world_size()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for size in sizes:
        per = size // 4 // n          # float32 elements per rank's block
        res = {}
        for kind in ("plain", "shared"):
            if kind == "shared":
                def make(k):
                    return backend.allocate_tensor(k, dtype=torch.float32, device="cpu").fill_(1.0)
            else:
                def make(k):
                    return torch.ones(k)
            out, inp, rs_in, rs_out = make(n * per), None, make(n * per), torch.empty(per)
            inp = out[r * per:(r + 1) * per]
            ag, rs = [], []
            for _ in range(iters + 2):
                dist.barrier()
                t = time.perf_counter()
                dist.all_gather_into_tensor(out, inp)
                ag.append(time.perf_counter() - t)
                dist.barrier()
                t = time.perf_counter()
                dist.reduce_scatter_tensor(rs_out, rs_in)
                rs.append(time.perf_counter() - t)
            res[kind] = (statistics.median(ag[2:]) * 1e3, statistics.median(rs[2:]) * 1e3)
        if r == 0:
            print(f"{size >> 20:5d} MiB  all_gather plain {res['plain'][0]:7.2f} ms shared "
                  f"{res['shared'][0]:7.2f} ms ({res['plain'][0] / res['shared'][0]:.2f}x)   "
                  f"reduce_scatter plain {res['plain'][1]:7.2f} ms shared "
                  f"{res['shared'][1]:7.2f} ms ({res['plain'][1] / res['shared'][1]:.2f}x)",
                  flush=True)
    dist.destroy_process_group()


def parse(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker([int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"])
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    port = free_port()
    sizes = ",".join(str(parse(x)) for x in a.sizes)
    env = {k: v for k, v in os.environ.items() if k != "ECCL_MASTER"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", sizes, str(a.iters)],
                              env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       RANK=str(r), WORLD_SIZE=str(a.ranks), LOCAL_RANK=str(r)))
             for r in range(a.ranks)]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"# {a.ranks} ranks; median of {a.iters} calls each, float32, plain and shared "
          f"tensors alternating per size")
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
