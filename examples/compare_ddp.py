"""DDP step time with the "eccl" backend and eccl's ElasticDDP against "gloo" on the
same model and machine, in one run (alternating, so all see the same load).

    python examples/compare_ddp.py --width 4000 --steps 10 --rounds 2
"""

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_step_ms(backend: str, nproc: int, width: int, steps: int) -> float:
    env = dict(os.environ)
    master = None
    if backend == "elastic":
        import eccl
        master = eccl.Master()
        env.update(ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)
    try:
        return _median_step_ms(backend, nproc, width, steps, env)
    finally:
        if master is not None:
            master.shutdown()


def _median_step_ms(backend: str, nproc: int, width: int, steps: int, env) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / "ddp_example.py"),
           "--backend", backend, "--width", str(width), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    m = re.search(r"median step ([0-9.]+) ms", out.stdout)
    # torch's own teardown may abort a worker after the run is measured ("terminate
    # called without an active exception", seen under gloo and eccl alike): that is the
    # exit, not the measurement.
    exit_abort = "terminate called without an active exception" in out.stderr
    if (out.returncode != 0 and not exit_abort) or not m:
        raise SystemExit(f"{backend} failed ({out.returncode}):\n{out.stdout}\n{out.stderr[-3000:]}")
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    systems = ("eccl", "elastic", "gloo")
    times = {b: [] for b in systems}
    for _ in range(a.rounds):
        for b in systems:
            times[b].append(median_step_ms(b, a.nproc, a.width, a.steps))
    g = times["gloo"]
    print(f"DDP, {a.nproc} ranks, 3 x Linear({a.width}), {a.steps} steps, {a.rounds} rounds "
          "(median step per run; best and worst run):")
    for b in systems:
        t = times[b]
        print(f"  {b:8s} {min(t):7.1f} .. {max(t):7.1f} ms/step   vs gloo (best/best) "
              f"{min(t) / min(g):.2f}, (worst/worst) {max(t) / max(g):.2f}")


if __name__ == "__main__":
    main()
