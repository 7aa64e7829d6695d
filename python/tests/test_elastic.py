"""Elastic DDP with real processes: a rank is SIGKILLed mid-training and a new one joins;
the survivors retry the step, the newcomer receives model and optimizer state, every rank
ends with bit-identical parameters, and the loss went down."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import eccl  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_ddp.py"
FINAL = re.compile(r"FINAL peer (\d+) revision (\d+) first_loss ([0-9.]+) loss ([0-9.]+) params (\w+)")


def test_kill_one_rank_and_add_another():
    master = eccl.Master(lease_ms=1000, heartbeat_ms=100)
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)
    steps = "400"

    def start(min_world):
        return subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--steps", steps, "--min-world", str(min_world),
             "--step-ms", "10"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)

    procs = [start(3) for _ in range(3)]
    try:
        # Let the world form and train a while, then kill rank 1's process outright.
        deadline = time.time() + 60
        line = ""
        while "step 20:" not in line and time.time() < deadline:
            line = procs[0].stdout.readline()
        assert "step 20:" in line, "training did not start"
        procs[1].send_signal(signal.SIGKILL)
        newcomer = start(1)
        procs.append(newcomer)
        outs = []
        for p in (procs[0], procs[2], newcomer):
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        master.shutdown()
    finals = [FINAL.search(o) for o in outs]
    assert all(finals), outs
    revisions = {f.group(2) for f in finals}
    params = {f.group(5) for f in finals}
    assert revisions == {steps}
    assert len(params) == 1, f"parameters differ: {[f.group(0) for f in finals]}"
    for f in finals[:2]:
        assert float(f.group(4)) < float(f.group(3)) / 10, f.group(0)
    assert "world is now" in outs[0], "the survivors saw the newcomer join"
