"""A plain DDP training script for elastic torchrun runs (examples/elastic_torchrun.py):
nothing eccl-specific but the backend name it is given. It resumes from a checkpoint
that rank 0 writes after every step, so a restarted attempt goes on where the last one
stopped, and prints one line per step with the world size.

    torchrun --nnodes=2:3 --rdzv-backend=eccl --rdzv-endpoint=HOST:PORT --rdzv-id=job \\
        elastic_train.py --steps 200 --ckpt /tmp/ckpt.pt --backend eccl
"""

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--backend", default="eccl")
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--until-world", type=int, default=0,
                    help="past --steps, go on training while the world is smaller than this, "
                         "and end 5 steps after it is reached (a run that waits for a "
                         "replacement node instead of finishing before it arrives)")
    a = ap.parse_args()

    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    start = 0
    if os.path.exists(a.ckpt):
        st = torch.load(a.ckpt)
        model.load_state_dict(st["model"])
        start = st["step"]
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    print(f"START restart={restart} rank={rank} world={world} step={start} t={time.time():.3f}",
          flush=True)
    step, here = start, 0
    # Every rank of a world decides alike: the same step (from the checkpoint), the
    # same world, the same count of steps since this attempt started.
    while step < a.steps or (a.until_world and (world < a.until_world or here < 5)):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randn(64, 256, generator=g), torch.randn(64, 1, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"STEP {step} world={world} rank={rank} t={time.time():.3f}", flush=True)
        if rank == 0:
            torch.save({"model": model.state_dict(), "step": step + 1}, a.ckpt + ".tmp")
            os.replace(a.ckpt + ".tmp", a.ckpt)
        step, here = step + 1, here + 1
        time.sleep(a.step_s)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    print(f"DONE rank={rank} world={world} params={h.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
