"""Three wide linear layers with ReLU, MSE loss and SGD, trained with DDP on CPU over the
"eccl" backend (bucket_cap_mb=25, as in the NCCL lecture's example).

    torchrun --nproc-per-node 2 examples/ddp_example.py              # width 4000, 10 steps
    torchrun --nproc-per-node 2 examples/ddp_example.py --width 512 --steps 5
    torchrun --nproc-per-node 2 examples/ddp_example.py --backend gloo   # to compare
    ECCL_MASTER=... ECCL_SECRET=... torchrun --nproc-per-node 2 examples/ddp_example.py \
        --backend elastic                  # eccl.torch.ElasticDDP on an eccl master
"""

import argparse
import os
import time

import eccl
import eccl.torch  # noqa: F401  registers the "eccl" backend
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="eccl")
    a = p.parse_args()
    elastic = a.backend == "elastic"
    if elastic:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        comm = eccl.Communicator(min_world=world, rank_hint=rank)
    else:
        dist.init_process_group(a.backend)
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(a.width, a.width), torch.nn.ReLU(),
        torch.nn.Linear(a.width, a.width), torch.nn.ReLU(),
        torch.nn.Linear(a.width, a.width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if elastic:
        job = eccl.torch.ElasticDDP(model, opt, comm, bucket_cap_mb=25)
    else:
        ddp = DDP(model, bucket_cap_mb=25)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(a.steps):
        x = torch.randn(32, a.width, generator=gen)
        t0 = time.perf_counter()
        if elastic:
            job.step_boundary()
            loss = torch.tensor(job.train_step(lambda m: torch.nn.functional.mse_loss(m(x), x)))
        else:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), x)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f} ({times[-1] * 1e3:.0f} ms)")
    if rank == 0:
        steady = sorted(times[1:] or times)
        print(f"{a.backend}: median step {steady[len(steady) // 2] * 1e3:.1f} ms")
    if elastic:
        comm.leave()
    else:
        # Every rank is done before any tears down: the rank that hosts torch's store
        # leaving first can abort the others' exit ("terminate called without an active
        # exception", under gloo as under eccl).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
