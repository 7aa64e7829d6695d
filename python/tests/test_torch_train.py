"""Training scripts as users run them: an unchanged pytorch-examples DDP script under
torchrun with backend "eccl" and no import of eccl; a worker SIGKILLed under
`torchrun --max-restarts`; what DDP raises on the survivor of a dead peer."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
from procs import free_port, spawn, stop_sessions  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "unchanged_ddp.py"



def torchrun(args, env=None, max_restarts=0):
    """torchrun in its own session, so that the test can stop it and all its workers."""
    return spawn(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--max-restarts", str(max_restarts), "--master-port", str(free_port()),
         str(SCRIPT), *args],
        env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)


def finals(out):
    # The two workers share one stdout: their lines may run into each other.
    return re.findall(r"FINAL rank \d+ params ([0-9a-f]{16})", out)


def test_the_script_never_mentions_eccl():
    assert "eccl" not in SCRIPT.read_text().lower()


def test_an_unchanged_script_finds_the_backend_by_name():
    p = torchrun(["3", "32", "--backend", "eccl"])
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        stop_sessions([p])
    assert p.returncode == 0, out[-3000:]
    hashes = finals(out)
    assert len(hashes) == 2 and len(set(hashes)) == 1, out[-3000:]


def test_a_killed_worker_restarts_under_torchrun(tmp_path):
    """torchrun restarts both workers after one is SIGKILLed; the new attempt forms a
    new eccl world (fresh master, fresh keys in the same store) and finishes."""
    p = torchrun(["15", "32", "--backend", "eccl", "--step-s", "0.05"],
                 env={"TEST_PID_DIR": str(tmp_path)}, max_restarts=1)
    lines = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            line = p.stdout.readline()
            lines.append(line)
            if "Epoch 2" in line:
                break
        assert any("Epoch 2" in l for l in lines), "".join(lines)[-3000:]
        victim = [f for f in os.listdir(tmp_path) if f.startswith("rank1.")][0]
        os.kill(int(victim.split(".")[1]), signal.SIGKILL)
        out, _ = p.communicate(timeout=120)
    finally:
        stop_sessions([p])
    out = "".join(lines) + out
    assert p.returncode == 0, out[-4000:]
    assert "PicklingError" not in out, out[-4000:]
    hashes = finals(out)
    assert len(hashes) == 2 and len(set(hashes)) == 1, out[-3000:]
    # Both workers ran twice: torchrun restarted the group (each attempt leaves a file
    # named after its rank and pid). What the survivor raises when its peer dies is
    # checked on its own below, where no agent stops it first.
    attempts = sorted(f.split(".")[0] for f in os.listdir(tmp_path))
    assert attempts == ["rank0", "rank0", "rank1", "rank1"], attempts


def test_ddp_on_a_dead_peer_raises_eccls_error_naming_the_peer():
    port = free_port()
    procs = [spawn(
        [sys.executable, str(HERE / "ddp_survivor.py")],
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in range(2)]
    try:
        for p in procs:
            seen = []
            while not seen or seen[-1].strip() not in ("TRAINING", ""):
                seen.append(p.stdout.readline())
            assert seen[-1].strip() == "TRAINING", "".join(seen)
        procs[1].kill()
        out, _ = procs[0].communicate(timeout=60)
    finally:
        stop_sessions(procs)
    assert procs[0].returncode == 3, out[-3000:]
    errors = [l for l in out.splitlines() if l.startswith("ERROR ")]
    assert errors, out[-3000:]
    assert "AbortedError: collective aborted" in errors[0], errors
    assert "peer " in errors[0], errors
    assert "Pickl" not in out, out[-3000:]
