"""torchft's lighthouse and Manager on eccl (eccl.torchft.ProcessGroupEcclFT): three replica
groups train; one is SIGKILLed; the other two go on committing steps together.

torchft is not among the default test requirements: run with ECCL_TORCHFT=1 (the test
command passes it on; `.ci/test.sh` with ECCL_TORCHFT=1 runs this file), which installs
torchft into its own venv (.venv-torchft, seeing this venv's torch and eccl) as
examples/goodput.py does."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import opt_in
from procs import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("torchft_worker.py")

opt_in("ECCL_TORCHFT", "installs torchft into .venv-torchft")


def torchft_python():
    sys.path.insert(0, str(ROOT / "examples"))
    import goodput

    return goodput.torchft_python(str(ROOT / ".venv-torchft"))


def steps_of(out):
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("STEP ")]


def run_replicas(pg, tmp_path):
    """Three replica groups (one process each) training with torchft's Manager and DDP
    on `pg` ("eccl": eccl.torchft.ProcessGroupEcclFT, "gloo": torchft's ProcessGroupGloo);
    replica 2 SIGKILLs itself after a step all three committed. Returns each replica's
    committed steps (every process stopped by PID)."""
    import torch.distributed as dist

    python = torchft_python()
    port = free_port()
    # Each replica group's store, hosted here as torchrun's agent would host it.
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
              for _ in range(3)]
    lighthouse = subprocess.Popen(
        [str(Path(python).parent / "torchft_lighthouse"), "--min_replicas", "2",
         "--quorum_tick_ms", "100", "--join_timeout_ms", "2000", "--bind", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = []
    (tmp_path / pg).mkdir()
    try:
        for rid in range(3):
            env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
                       REPLICA_GROUP_ID=str(rid), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(stores[rid].port), RANK="0", WORLD_SIZE="1",
                       PYTHONUNBUFFERED="1")
            argv = [python, str(WORKER), "--steps", "30", "--ready-dir", str(tmp_path / pg),
                    "--pg", pg]
            procs.append(subprocess.Popen(argv + (["--die-at", "8"] if rid == 2 else []),
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs + [lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[2].returncode == -9, outs[2][1][-3000:]
    for p, (_, err) in zip(procs[:2], outs[:2]):
        assert p.returncode == 0, err[-3000:]
    return [steps_of(out) for out, _ in outs]


def test_a_kill_under_torchft_on_eccl_leaves_the_others_training(tmp_path):
    """The two survivors commit every step after the kill together (2 participants),
    reach step 30 and end with the same model, the same as under torchft's gloo group."""
    results = {pg: run_replicas(pg, tmp_path) for pg in ("eccl", "gloo")}
    for pg, steps in results.items():
        *survivors, dead = steps
        last_of_three = dead[-1]["step"]
        for s in survivors:
            assert s[-1]["step"] == 30, (pg, s[-3:])
            assert any(x["participants"] == 3 for x in s), (pg, s)
            after = [x for x in s if x["step"] > last_of_three]
            assert after and all(x["participants"] == 2 for x in after), (pg, after)
        # The survivors' models agree (their gradients were averaged together).
        assert survivors[0][-1]["digest"] == survivors[1][-1]["digest"], pg
        at = {x["step"]: x["t"] for x in survivors[0]}
        print(f"{pg}: replica 2 killed after step {last_of_three}; the survivors' next step "
              f"came {(at[last_of_three + 1] - at[last_of_three]) * 1000:.0f} ms later")
    # The same training: the same models at the end under both groups.
    assert results["eccl"][0][-1]["digest"] == results["gloo"][0][-1]["digest"]
