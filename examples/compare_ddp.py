"""DDP step time with the "eccl" backend against "gloo" on the same model and machine,
in one run (alternating, so both see the same load).

    python examples/compare_ddp.py --width 4000 --steps 10 --rounds 2
"""

import argparse
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
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / "ddp_example.py"),
           "--backend", backend, "--width", str(width), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    m = re.search(r"median step ([0-9.]+) ms", out.stdout)
    if out.returncode != 0 or not m:
        raise SystemExit(f"{backend} failed ({out.returncode}):\n{out.stdout}\n{out.stderr[-3000:]}")
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    times = {"eccl": [], "gloo": []}
    for _ in range(a.rounds):
        for b in ("eccl", "gloo"):
            times[b].append(median_step_ms(b, a.nproc, a.width, a.steps))
    e, g = min(times["eccl"]), min(times["gloo"])
    print(f"DDP, {a.nproc} ranks, 3 x Linear({a.width}), {a.steps} steps, best of {a.rounds}:")
    print(f"  eccl {e:.1f} ms/step   gloo {g:.1f} ms/step   eccl/gloo {e / g:.2f}")


if __name__ == "__main__":
    main()
