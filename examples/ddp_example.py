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


def train(backend: str, width: int, steps: int) -> None:
    elastic = backend == "elastic"
    if elastic:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        comm = eccl.Communicator(min_world=world, rank_hint=rank)
    else:
        dist.init_process_group(backend)
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if elastic:
        job = eccl.torch.ElasticDDP(model, opt, comm, bucket_cap_mb=25)
    else:
        ddp = DDP(model, bucket_cap_mb=25)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        x = torch.randn(32, width, generator=gen)
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
            print(f"{backend} step {step}: loss {loss.item():.6f} ({times[-1] * 1e3:.0f} ms)")
    if rank == 0:
        steady = sorted(times[1:] or times)
        print(f"{backend}: median step {steady[len(steady) // 2] * 1e3:.1f} ms", flush=True)
    if elastic:
        comm.leave()
    else:
        # Every rank is done before any tears down: the rank that hosts torch's store
        # leaving first can abort the others' exit ("terminate called without an active
        # exception", under gloo as under eccl).
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="eccl",
                   help="eccl, gloo or elastic, or several comma-separated: each trains in "
                        "turn in the same processes (compare_ddp.py: one launch, one torch "
                        "import, for all three)")
    a = p.parse_args()
    backends = a.backend.split(",")
    # The "eccl" backend starts its own master in rank 0 unless ECCL_MASTER names one.
    # With elastic among several backends, ECCL_MASTER is ElasticDDP's master only, so
    # that each backend is measured as a run of it alone would be.
    elastic_master = os.environ.get("ECCL_MASTER")
    if "elastic" in backends and elastic_master is None:
        raise SystemExit("--backend elastic needs ECCL_MASTER (and ECCL_SECRET)")
    for backend in backends:
        if len(backends) > 1 and "elastic" in backends:
            os.environ.pop("ECCL_MASTER", None)
            if backend == "elastic":
                os.environ["ECCL_MASTER"] = elastic_master
        train(backend, a.width, a.steps)


if __name__ == "__main__":
    main()
