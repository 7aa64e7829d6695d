"""Each of torch's reconfigure scenarios (python/tests/contract_script.py: the twelve of
PyTorch's fault-tolerance test for a backend, 3 ranks, a FileStore) in processes of its
own, as torch's harness runs them, under eccl and under gloo alternating: the wall time
from starting the three processes to the last one's exit, process start and torch's
import included (what the issue's "~1.6 s a scenario for gloo" counts). Prints a table
with the best and worst of each and the ratio of the medians.

    .venv/bin/python examples/contract_times.py --rounds 2 [--scenarios basic identity]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "python" / "tests" / "contract_script.py"
SCENARIOS = ["basic", "all_reduce", "send_recv", "shrink_last", "shrink_middle",
             "scale_down_up", "single_to_all", "identity", "late_join", "merge_split",
             "after_abort", "reused_uuid"]


def once(backend, scenario):
    """Seconds from the start of three ranks to the last exit; None if a rank failed."""
    with tempfile.TemporaryDirectory() as folder:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "ECCL_MASTER"}
        t0 = time.monotonic()
        procs = [subprocess.Popen([sys.executable, str(SCRIPT), backend, folder, scenario],
                                  env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                           RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for r in range(3)]
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        took = time.monotonic() - t0
        ok = all('"ok": "ok"' in o for o in outs)
        return took if ok else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scenarios", nargs="*", default=SCENARIOS)
    a = ap.parse_args()
    times = {(b, s): [] for b in ("eccl", "gloo") for s in a.scenarios}
    failed = {}
    for r in range(a.rounds):
        for s in a.scenarios:
            for b in (("eccl", "gloo") if r % 2 == 0 else ("gloo", "eccl")):
                t = once(b, s)
                if t is None:
                    failed[(b, s)] = failed.get((b, s), 0) + 1
                else:
                    times[(b, s)].append(t)
    print(f"# torch's reconfigure scenarios, 3 ranks, processes of their own, {a.rounds} "
          f"rounds: seconds, process start included (best-worst)")
    print(f"{'scenario':14s} {'eccl':>13s} {'gloo':>13s}  eccl/gloo (medians)")
    ratios = []
    for s in a.scenarios:
        e, g = times[("eccl", s)], times[("gloo", s)]

        def fmt(v):
            return f"{min(v):5.2f}-{max(v):5.2f}" if v else "   failed    "
        ratio = statistics.median(e) / statistics.median(g) if e and g else None
        if ratio:
            ratios.append(ratio)
        fails = "".join(f" ({b} failed {failed[(b, s)]}x)" for b in ("eccl", "gloo")
                        if (b, s) in failed)
        print(f"{s:14s} {fmt(e):>13s} {fmt(g):>13s}  {ratio:.2f}" if ratio else
              f"{s:14s} {fmt(e):>13s} {fmt(g):>13s}  -", fails)
    if ratios:
        print(f"# eccl/gloo: {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
