"""How fast the survivors of a SIGKILLed (or SIGSTOPped: hung) rank learn of it, and how
long torch's `_reconfigure` over the survivors takes, under eccl and gloo in the same run.

    python examples/kill_latency.py --trials 20 --ranks 3 --backends eccl,gloo \
        [--signal STOP] [--reconfigure]

Each trial starts N ranks (env://, as torchrun would; group timeout 20 s) that
all_reduce 1 MiB in a loop; after 1 s the last rank writes the wall-clock time and sends
itself the signal; each survivor records when its all_reduce raised. With
`--reconfigure` the group is made with `enable_reconfigure=True` (its first world by a
`_reconfigure` of all N), and after the error the survivors exchange fresh handles through
the rendezvous store and time `dist._reconfigure(uuid, handles).wait()` (the master's
raft commit included for eccl), then check an all_reduce. Prints, per backend, the
signal → error times of all survivors (p50, p99, largest) and the reconfigure times. Every
process is stopped by PID."""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402


def rank_main(backend: str, stamp: str, sig: str, reconf: bool) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    dist.init_process_group(backend, timeout=timedelta(seconds=20),
                            enable_reconfigure=reconf)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()

    def reconfigure(uuid: int, ranks) -> float:
        store.set(f"h/{uuid}/{r}", dist._get_reconfigure_handle())
        handles = [store.get(f"h/{uuid}/{q}").decode() for q in ranks]
        t0 = time.monotonic()
        dist._reconfigure(uuid=uuid, handles=handles).wait()
        return (time.monotonic() - t0) * 1000

    if reconf:
        reconfigure(1, range(n))
    t = torch.ones(1 << 18)
    dist.all_reduce(t)
    start = time.monotonic()
    out = {}
    try:
        while True:
            if r == n - 1 and time.monotonic() - start > 1.0:
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - what the survivor saw is the result
        out = {"err": time.time(), "type": type(e).__name__, "msg": str(e)[:300]}
    if reconf:
        out["reconfigure_ms"] = reconfigure(2, range(n - 1))
        x = torch.ones(4)
        dist.all_reduce(x)
        out["right"] = x.tolist() == [float(n - 1)] * 4
    print("RESULT " + json.dumps(out), flush=True)
    store.set(f"done/{r}", "1")
    if r == 0:  # the store lives here: the others read their last keys first
        store.wait([f"done/{q}" for q in range(n - 1)])
    os._exit(0)


def trial(backend: str, stamp: str, sig: str, n: int, reconf: bool):
    port = free_port()
    argv = [sys.executable, __file__, "--rank-of", backend, stamp, sig, str(int(reconf))]
    procs = [subprocess.Popen(
        argv, env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = []
    try:
        for p in procs[:-1]:  # the survivors; the last is dead, or stopped until killed below
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    kill = float(open(stamp).read())
    lat, msgs, rec = [], [], []
    for out in outs:
        res = [line for line in out.splitlines() if line.startswith("RESULT ")]
        got = json.loads(res[-1][7:]) if res else {}
        lat.append((got["err"] - kill) * 1000 if "err" in got else float("inf"))
        msgs.append(f"{got['type']}: {got['msg']}" if "err" in got else "no error")
        if reconf:
            ok = got.get("right")
            rec.append(got["reconfigure_ms"] if ok else float("inf"))
    return lat, msgs, rec


def pct(xs, q):
    """The q-th percentile (nearest rank) of sorted xs."""
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1")
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--backends", default="eccl,gloo")
    ap.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
    ap.add_argument("--reconfigure", action="store_true",
                    help="enable_reconfigure=True, and time _reconfigure over the survivors")
    a = ap.parse_args()
    if a.ranks < 2:
        ap.error("--ranks must be at least 2 (one is lost)")
    if "eccl" in a.backends:
        import eccl.torch  # noqa: F401 - registers the backend (the entry point does too)
    with tempfile.TemporaryDirectory() as d:
        for backend in a.backends.split(","):
            lat, msgs, rec = [], [], []
            for i in range(a.trials):
                t, m, r = trial(backend, os.path.join(d, f"{backend}-{i}"), a.signal,
                                a.ranks, a.reconfigure)
                lat += t
                msgs += m
                rec += r
            lat.sort()
            print(f"{backend}, {a.ranks} ranks: {len(lat)} survivors' errors after "
                  f"SIG{a.signal}: p50 {statistics.median(lat):.1f} ms, p99 {pct(lat, 99):.1f} "
                  f"ms, largest {lat[-1]:.1f} ms\n  e.g. {msgs[0]}")
            if rec:
                rec.sort()
                print(f"  _reconfigure of {a.ranks - 1} survivors: p50 "
                      f"{statistics.median(rec):.1f} ms, p99 {pct(rec, 99):.1f} ms, largest "
                      f"{rec[-1]:.1f} ms (inf: the all_reduce after it was wrong or failed)")


if __name__ == "__main__":
    main()
