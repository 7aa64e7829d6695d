"""Elastic DDP: a small model keeps training while ranks are killed and others join.

One process per node, each under its own torchrun (so losing a node restarts nothing
else), all pointed at one eccl master:

    eccl-master --listen 0.0.0.0:48148            # or: python -m eccl.master ...
    export ECCL_MASTER=MASTER_HOST:48148 ECCL_SECRET_FILE=~/.eccl/secret
    torchrun --nnodes 1 --nproc-per-node 1 examples/elastic_ddp.py --steps 200   # per node
    kill -9 <pid of one node's worker>             # the others retry the step and go on
    torchrun --nnodes 1 --nproc-per-node 1 examples/elastic_ddp.py --steps 200   # a new node joins

Every rank prints its loss as it goes and, at the end, a hash of its parameters: all the
ranks that finish print the same one.
"""

import argparse
import hashlib
import os
import time

import eccl
import eccl.torch
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--min-world", type=int, default=int(os.environ.get("ECCL_MIN_WORLD", "1")))
    p.add_argument("--step-ms", type=float, default=0, help="extra time per step (to watch it)")
    p.add_argument("--until-world", type=int, default=0,
                   help="keep training past --steps until the world has had this many members "
                        "for 20 steps (a job that waits for a replacement before it ends)")
    p.add_argument("--heal-in-boundary", action="store_true",
                   help="newcomers fetch the state inside step_boundary() (every rank waits), "
                        "not in the background of the next step")
    a = p.parse_args()

    torch.manual_seed(0)            # same initial model everywhere; newcomers get synced
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    comm = eccl.Communicator(min_world=a.min_world)
    job = eccl.torch.ElasticDDP(model, opt, comm, heal_in_background=not a.heal_in_boundary)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    first = None
    full_since = None   # the revision from which the world has had --until-world members
    while True:
        if job.step_boundary():
            print(f"peer {comm.peer_id}: world is now {comm.world_size} (epoch {comm.epoch})", flush=True)
        # Every member of a world sees the same revision and world size here (a newcomer
        # too, on its first pass), so they all decide alike when to stop.
        if (comm.world_size or 0) < a.until_world:
            full_since = None
        elif full_since is None:
            full_since = job.revision
        if job.revision >= a.steps and (
                a.until_world == 0 or (full_since is not None and job.revision >= full_since + 20)):
            break
        # Each member's batch depends on the step and its rank in the current world.
        g = torch.Generator().manual_seed(job.revision * 1000 + (comm.rank or 0))
        x = torch.randn(64, 16, generator=g)
        loss = job.train_step(lambda m: torch.nn.functional.mse_loss(m(x), x @ target))
        if first is None and loss == loss:  # a healing newcomer's step computes no loss (NaN)
            first = loss
        if job.revision % 20 == 0:
            print(f"peer {comm.peer_id} step {job.revision}: loss {loss:.4f} over "
                  f"{len(job.members)} members", flush=True)
        if a.step_ms:
            time.sleep(a.step_ms / 1000)
    # A newcomer admitted at the last boundary is still fetching the state: close() waits
    # for it (the members serve it meanwhile) before the parameters are read.
    job.close()
    if first is None:   # admitted as the job ended: no step of its own
        first = loss = float("nan")
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.parameters()))
    print(f"FINAL peer {comm.peer_id} revision {job.revision} first_loss {first:.6f} "
          f"loss {loss:.6f} params {digest.hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
