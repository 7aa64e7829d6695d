"""What the torch backend adds to an eccl call: `dist.all_reduce(t)` on the "eccl"
backend against the same all_reduce made directly on the backend's own
`eccl.Communicator` (same processes, same tensor, same in-place mode), alternating in
rounds so that both see the same load. Prints one line per size, and with --json writes
every figure.

The overhead has two parts: what torch itself spends taking a call to any Python backend
and back (`dist.all_reduce` into C++, the dispatcher, pybind11 back into Python, the
returned Work's `wait()`), and eccl's Python. The first is measured beside the others as
"floor": `dist.all_reduce` on a group of a do-nothing Python backend (its Work is
complete at once), whose cost is torch's alone. `--pin` runs each rank on a core of its
own (rank r on core r modulo the cores), which makes the figures stable where a 2-core
machine's scheduler otherwise moves the ranks' threads around; a pinned rank sees one
core, so eccl's waits do not spin there once ranks share a host (not the configuration
an unpinned job runs in).

    python examples/torch_overhead.py --ranks 2 4 --sizes 1K,64M --iters 2000,10 --rounds 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402

WORKER = r"""
import json, sys, time, torch, torch.distributed as dist
rank, n, addr, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
sizes = [int(s) for s in sys.argv[5].split(",")]
iters = [int(s) for s in sys.argv[6].split(",")]
rounds = int(sys.argv[7])
device = sys.argv[8]
store = dist.TCPStore(addr, port, n, rank == 0)
dist.init_process_group("eccl", store=store, rank=rank, world_size=n)
pg = dist.group.WORLD


class _Done(dist._Work):
    def wait(self, timeout=None):
        return True


class _Noop(torch._C._distributed_c10d.Backend):
    # A Python backend that does nothing: what torch spends reaching it is the floor.

    def __init__(self, rank, size):
        super().__init__(rank, size)

    def allreduce(self, tensors, opts=None):
        return _Done()

    def getBackendName(self):  # noqa: N802 - torch's name
        return "overheadnoop"


floor_group = None
if device == "cpu":
    try:
        dist.Backend.register_backend("overheadnoop", lambda s, r, w, t: _Noop(r, w),
                                      devices=["cpu"])
        floor_group = dist.new_group(backend="overheadnoop")
    except Exception as e:  # torch without Python-constructible backends (2.11 and older)
        print(f"no floor: {e}", file=sys.stderr)
# torch 2.5-2.14 make a Python backend the whole group (no backend beneath it).
comm = pg.comm if hasattr(pg, "comm") else pg._get_backend(torch.device("cpu")).comm
if device == "cuda":
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    paths = ("native", "event", "torch")
else:
    dev = torch.device("cpu")
    paths = ("native", "torch", "floor") if floor_group is not None else ("native", "torch")


def native(t):
    if device == "cpu":
        comm.all_reduce(t, keep_on_abort=False)
    else:
        comm.all_reduce_device(t.data_ptr(), t.numel(), "torch.float32", device=dev.index,
                               owner=t, keep_on_abort=False)


def event(t):
    comm.await_device_stream(torch._C._cuda_getCurrentRawStream(dev.index), device=dev.index)
    native(t)


call = {"native": native, "event": event, "torch": dist.all_reduce,
        "floor": lambda t: dist.all_reduce(t, group=floor_group)}
out = []
for size, it in zip(sizes, iters):
    t = torch.ones(size // 4, dtype=torch.float32, device=dev)
    for _ in range(max(2, it // 10)):   # warm-up of every path
        for path in paths:
            call[path](t)
    for r in range(rounds):
        for path in paths:
            dist.barrier()
            if device == "cuda":
                torch.cuda.synchronize(dev)
            f = call[path]
            t0 = time.perf_counter()
            for _ in range(it):
                f(t)
            us = (time.perf_counter() - t0) * 1e6 / it
            out.append({"bytes": size, "round": r, "path": path, "us": us})
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def run(n: int, sizes, iters, rounds: int, device: str = "cpu", pin: bool = False):
    """Each rank's timings; the slowest rank's time per (size, round, path) is the
    call's time, as nccl-tests reports."""
    port = free_port()
    args = [",".join(map(str, sizes)), ",".join(map(str, iters)), str(rounds), device]
    cores = sorted(os.sched_getaffinity(0))

    def pinned(r: int):
        core = cores[r % len(cores)]
        return lambda: os.sched_setaffinity(0, {core})

    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(n), "127.0.0.1",
                               str(port), *args],
                              preexec_fn=pinned(r) if pin else None,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    per_rank = []
    for p, (out, err) in zip(procs, outs):
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise SystemExit(f"a rank failed ({p.returncode}):\n{out}\n{err[-3000:]}")
        per_rank.append(json.loads(lines[-1][7:]))
    slowest = {}
    for rank in per_rank:
        for row in rank:
            k = (row["bytes"], row["round"], row["path"])
            slowest[k] = max(slowest.get(k, 0.0), row["us"])
    return slowest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[2])
    p.add_argument("--sizes", default="1K,64M")
    p.add_argument("--iters", default="2000,10", help="calls per round, one per size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--pin", action="store_true",
                   help="run rank r on core r (modulo the cores) only")
    p.add_argument("--json")
    a = p.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    iters = [int(s) for s in a.iters.split(",")]
    if len(iters) != len(sizes):
        raise SystemExit("--iters needs one count per size")
    report = []
    started = time.time()
    for n in a.ranks:
        t = run(n, sizes, iters, a.rounds, a.device, a.pin)
        for size in sizes:
            native = [t[(size, r, "native")] for r in range(a.rounds)]
            torch_ = [t[(size, r, "torch")] for r in range(a.rounds)]
            extra = [b - a_ for a_, b in zip(native, torch_)]
            row = {"ranks": n, "bytes": size, "native_us": native, "torch_us": torch_,
                   "overhead_us": extra}
            ev = ""
            if (size, 0, "floor") in t:
                # torch's own part of the overhead, and eccl's (the rest).
                row["floor_us"] = [t[(size, r, "floor")] for r in range(a.rounds)]
                row["eccl_python_us"] = [x - f for x, f in zip(extra, row["floor_us"])]
                ev = (f"floor {statistics.median(row['floor_us']):6.1f} us  eccl's part "
                      f"{statistics.median(row['eccl_python_us']):+.1f} us  ")
            if a.device == "cuda":
                row["event_us"] = [t[(size, r, "event")] for r in range(a.rounds)]
                ev = f"event {statistics.median(row['event_us']):10.1f} us  "
            report.append(row)
            print(f"n={n} {size:>10} B  native {statistics.median(native):10.1f} us  "
                  f"torch {statistics.median(torch_):10.1f} us  overhead per call "
                  f"{min(extra):+.1f} .. {max(extra):+.1f} us (median "
                  f"{statistics.median(extra):+.1f})  {ev}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d", time.gmtime(started)),
                       "transport": os.environ.get("ECCL_TRANSPORT", "auto"),
                       "device": a.device, "pinned": a.pin,
                       "rows": report}, f, indent=1)


if __name__ == "__main__":
    main()
