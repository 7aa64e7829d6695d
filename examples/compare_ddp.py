"""DDP step time with the "eccl" backend and eccl's ElasticDDP against "gloo" on the
same model and machine, in one run: each round is one torchrun launch in which the
workers train with each system in turn (the order turns round by round, so all see the
same load).

    python examples/compare_ddp.py --width 4000 --steps 10 --rounds 2
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent


def median_step_ms(backends, nproc: int, width: int, steps: int):
    """One torchrun launch that trains with each of `backends` in turn (ddp_example.py
    --backend a,b,c): {backend: median step in ms}."""
    import eccl
    master = eccl.Master()  # ElasticDDP's; the "eccl" backend starts its own in rank 0
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", str(HERE / "ddp_example.py"),
               "--backend", ",".join(backends), "--width", str(width), "--steps", str(steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    finally:
        master.shutdown()
    found = {m.group(1): float(m.group(2))
             for m in re.finditer(r"^(\w+): median step ([0-9.]+) ms", out.stdout, re.M)}
    # torch's own teardown may abort a worker after the run is measured ("terminate
    # called without an active exception", seen under gloo and eccl alike): that is the
    # exit, not the measurement.
    exit_abort = "terminate called without an active exception" in out.stderr
    if (out.returncode != 0 and not exit_abort) or set(found) != set(backends):
        raise SystemExit(f"{','.join(backends)} failed ({out.returncode}):\n{out.stdout}\n"
                         f"{out.stderr[-3000:]}")
    return found


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="also write each system's step times (ms) here")
    a = p.parse_args()
    systems = ("eccl", "elastic", "gloo")
    times = {b: [] for b in systems}
    for r in range(a.rounds):
        # Each round is one launch; the order turns round by round, so that no system
        # always runs first (cold caches) or last.
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for b, ms in median_step_ms(order, a.nproc, a.width, a.steps).items():
            times[b].append(ms)
    g = times["gloo"]
    print(f"DDP, {a.nproc} ranks, 3 x Linear({a.width}), {a.steps} steps, {a.rounds} rounds "
          "(median step per run; best and worst run):")
    for b in systems:
        t = times[b]
        print(f"  {b:8s} {min(t):7.1f} .. {max(t):7.1f} ms/step   vs gloo (best/best) "
              f"{min(t) / min(g):.2f}, (worst/worst) {max(t) / max(g):.2f}")
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"nproc": a.nproc, "width": a.width, "steps": a.steps,
                       "ms_per_step": times,
                       "over_gloo": {b: [min(times[b]) / min(g), max(times[b]) / max(g)]
                                     for b in systems}}, f, indent=1)


if __name__ == "__main__":
    main()
