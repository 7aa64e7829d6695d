"""Elastic DDP the way elastic jobs run: one `torchrun --nnodes 1` per node, all on one
eccl master. A node (its torchrun agent and its worker) is SIGKILLed mid-training and a
new node joins; the survivors retry the step, the newcomer receives model and optimizer
state, every rank ends with bit-identical parameters, and the loss went down."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import eccl  # noqa: E402
from procs import free_port, kill_node, outputs, read_until, spawn, stop_sessions  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_ddp.py"
FINAL = re.compile(r"FINAL peer (\d+) revision (\d+) first_loss ([0-9.]+) loss ([0-9.]+) params (\w+)")


def start_node(env, *args):
    """One node of the example under its own `torchrun --nnodes 1`, in its own session
    (so that the whole node, agent and worker, can be killed)."""
    return spawn(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
         "--master-port", str(free_port()), str(EXAMPLE), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def test_kill_one_rank_and_add_another():
    master = eccl.Master(lease_ms=1000, heartbeat_ms=100)
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)
    steps = "400"

    def start(min_world):
        # The survivors go on until the newcomer is in: on a loaded machine its start
        # (torch's import) once took longer than their remaining steps, and it then
        # trained alone after they had left.
        return start_node(env, "--steps", steps, "--min-world", str(min_world),
                          "--step-ms", "10", "--until-world", "3")

    procs = [start(3) for _ in range(3)]
    try:
        # Let the world form and train a while, then kill rank 1's process outright.
        line = read_until(procs[0], "step 20:", 60)
        assert "step 20:" in line, "training did not start"
        kill_node(procs[1])     # its torchrun agent and its worker
        newcomer = start(1)
        procs.append(newcomer)
        outs = outputs((procs[0], procs[2], newcomer), 120)
    finally:
        stop_sessions(procs)
        master.shutdown()
    finals = [FINAL.search(o) for o in outs]
    assert all(finals), outs
    assert "world is now" in outs[0], "the survivors saw the newcomer join"
    revisions = {f.group(2) for f in finals}
    params = {f.group(5) for f in finals}
    assert len(revisions) == 1 and int(revisions.pop()) >= int(steps), finals
    # On a divergence, what each rank saw of the world's changes and its errors.
    seen = ["\n".join(l for l in o.splitlines() if "step 20" not in l and " step " not in l)[-2500:]
            for o in outs]
    assert len(params) == 1, f"parameters differ: {[f.group(0) for f in finals]}\n" + \
        "\n---\n".join(seen)
    for f in finals[:2]:
        assert float(f.group(4)) < float(f.group(3)) / 10, f.group(0)
    # The kill took the node's worker too: the survivors trained over two members a while.
    assert " over 2 members" in outs[0], "the killed node's worker went on training"


def test_a_newcomer_killed_while_it_heals_leaves_the_members_training():
    """A newcomer that dies as its first chunk of state arrives (in the background, while
    the members compute the step it was admitted at): the members' step fails, they
    move to the next world without it, take the step again with their own gradients and
    go on; both end with the same parameters."""
    master = eccl.Master(lease_ms=1000, heartbeat_ms=100)
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)

    def start(min_world, extra_env=None):
        # Long enough for the newcomer's start (torch's import) on a loaded machine.
        return start_node(dict(env, **(extra_env or {})), "--steps", "1500", "--min-world",
                          str(min_world), "--step-ms", "5")

    procs = [start(2) for _ in range(2)]
    try:
        line = read_until(procs[0], "step 20:", 60)
        assert "step 20:" in line, "training did not start"
        newcomer = start(1, {"ECCL_FAULT_INJECT": "sync-fetch:kill"})
        procs.append(newcomer)
        newcomer_out, _ = newcomer.communicate(timeout=120)
        outs = outputs(procs[:2], 120)
    finally:
        stop_sessions(procs)
        master.shutdown()
    assert newcomer.returncode != 0, f"the newcomer was to die on its first chunk: {newcomer_out[-3000:]}"
    assert any("world is now 3" in o for o in outs), "the members admitted the newcomer"
    finals = [FINAL.search(o) for o in outs]
    assert all(finals), outs
    assert len({f.group(2) for f in finals}) == 1 and int(finals[0].group(2)) >= 1500, finals
    assert len({f.group(5) for f in finals}) == 1, [f.group(0) for f in finals]


@pytest.mark.parametrize("where", ["background", "boundary"])
def test_a_newcomer_whose_only_source_dies_stops_with_state_lost(where):
    """The one member serving a newcomer's state dies as it sends its first chunk: no rank
    of the next world holds the state the job reached, and the newcomer's copy is half
    received. It stops with `StateLostError` naming the revision, instead of training on
    from that copy (it used to go on alone, as if at the members' revision); whether it
    heals in the background of the next step or inside the step boundary."""
    master = eccl.Master(lease_ms=1000, heartbeat_ms=100)
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)
    mode = ["--heal-in-boundary"] if where == "boundary" else []

    def start(extra_env):
        return start_node(dict(env, **extra_env), "--steps", "3000", "--min-world", "1",
                          "--step-ms", "5", *mode)

    member = start({"ECCL_FAULT_INJECT": "sync-serve:kill"})
    procs = [member]
    try:
        line = read_until(member, "step 20:", 60)
        assert "step 20:" in line, "training did not start"
        newcomer = start({})
        procs.append(newcomer)
        out, _ = newcomer.communicate(timeout=120)
        member_out, _ = member.communicate(timeout=30)
    finally:
        stop_sessions(procs)
        master.shutdown()
    assert "kill at SyncServe" in member_out, member_out[-2000:]
    lost = re.search(r"StateLostError: the model and optimizer state at revision (\d+) is lost",
                     out)
    assert lost and int(lost.group(1)) >= 20, out[-3000:]
    assert "FINAL" not in out and newcomer.returncode != 0, out[-3000:]


def test_a_member_dying_while_it_serves_leaves_the_newcomer_to_the_other():
    """Two members serve a newcomer; one dies as it sends its first chunk. The newcomer and
    the other member move to the next world, the state comes again from the survivor,
    and both end with the same parameters at the same revision."""
    master = eccl.Master(lease_ms=1000, heartbeat_ms=100)
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret)

    def start(min_world, extra_env=None):
        return start_node(dict(env, **(extra_env or {})), "--steps", "1500", "--min-world",
                          str(min_world), "--step-ms", "5")

    procs = [start(2), start(2, {"ECCL_FAULT_INJECT": "sync-serve:kill"})]
    try:
        line = read_until(procs[0], "step 20:", 60)
        assert "step 20:" in line, "training did not start"
        procs.append(start(1))
        outs = outputs((procs[0], procs[2]), 120)
        victim, _ = procs[1].communicate(timeout=30)
    finally:
        stop_sessions(procs)
        master.shutdown()
    assert "kill at SyncServe" in victim, victim[-2000:]
    finals = [FINAL.search(o) for o in outs]
    assert all(finals), [o[-3000:] for o in outs]
    assert len({f.group(2) for f in finals}) == 1 and int(finals[0].group(2)) >= 1500, finals
    assert len({f.group(5) for f in finals}) == 1, [f.group(0) for f in finals]
    assert "over 2 members" in outs[1], "the newcomer trained with the survivor"
