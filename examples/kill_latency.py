"""How fast the survivors of a SIGKILLed (or SIGSTOPped: hung) rank learn of it, under
eccl and gloo in the same run.

    python examples/kill_latency.py --trials 10 --backends eccl,gloo [--signal STOP]

Each trial starts 3 ranks (env://, as torchrun would; group timeout 20 s) that
all_reduce 1 MiB in a loop; after 1 s rank 2 writes the wall-clock time and sends itself
the signal; each survivor records when its all_reduce raised. Prints, per backend, the
signal → error times of all survivors (p50 and the largest). Every process is stopped by
PID."""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def rank_main(backend: str, stamp: str, sig: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    dist.init_process_group(backend, timeout=timedelta(seconds=20))
    r = dist.get_rank()
    t = torch.ones(1 << 18)
    dist.all_reduce(t)
    start = time.monotonic()
    try:
        while True:
            if r == 2 and time.monotonic() - start > 1.0:
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
            dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - what the survivor saw is the result
        print("RESULT " + json.dumps({"err": time.time(), "type": type(e).__name__,
                                    "msg": str(e)[:300]}), flush=True)
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(backend: str, stamp: str, sig: str) -> list:
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank-of", backend, stamp, sig],
        env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                 WORLD_SIZE="3", LOCAL_RANK=str(r)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    outs = []
    try:
        for p in procs[:2]:  # the survivors; rank 2 is dead, or stopped until killed below
            outs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    kill = float(open(stamp).read())
    lat, msgs = [], []
    for out in outs[:2]:
        res = [line for line in out.splitlines() if line.startswith("RESULT ")]
        got = json.loads(res[-1][7:]) if res else None
        lat.append((got["err"] - kill) * 1000 if got else float("inf"))
        msgs.append(f"{got['type']}: {got['msg']}" if got else "no error")
    return lat, msgs


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-of":
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--backends", default="eccl,gloo")
    ap.add_argument("--signal", default="KILL", choices=["KILL", "STOP"])
    a = ap.parse_args()
    if "eccl" in a.backends:
        import eccl.torch  # noqa: F401 - registers the backend (the entry point does too)
    with tempfile.TemporaryDirectory() as d:
        for backend in a.backends.split(","):
            lat, msgs = [], []
            for i in range(a.trials):
                t, m = trial(backend, os.path.join(d, f"{backend}-{i}"), a.signal)
                lat += t
                msgs += m
            lat.sort()
            print(f"{backend}: {len(lat)} survivors' errors after SIG{a.signal}: p50 "
                  f"{statistics.median(lat):.1f} ms, largest {lat[-1]:.1f} ms "
                  f"({', '.join(f'{x:.0f}' for x in lat)})\n  e.g. {msgs[0]}")


if __name__ == "__main__":
    main()
