"""One rank of a fault-free run, either plain DDP over gloo (under env://) or ElasticDDP
over eccl (ECCL_MASTER/ECCL_SECRET, ECCL_RANK for the data), on the same model and data;
saves the final parameters to OUT.

    python elastic_parity.py gloo|elastic OUT [--accumulate K] [--compression bf16]
        [--join-at K | --newcomer]

With `--join-at K` the members wait at step K's boundary for a newcomer (started with
`--newcomer` once a member prints `WAITING`), which heals in the background during step
K and computes nothing in it. `--heal-fails-once` (a newcomer's) makes its part of that
background sync report a (retryable) failure once, after the transfer itself ended: a
local failure the members do not see.
"""

import argparse
import os
import time

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8))


def batches(rank: int, step: int, k: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(k)]


def loss_of(m, xy):
    x, y = xy
    return torch.nn.functional.mse_loss(m(x), y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["gloo", "elastic"])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--compression", default=None)
    p.add_argument("--join-at", type=int, default=None)
    p.add_argument("--newcomer", action="store_true")
    p.add_argument("--heal-fails-once", action="store_true")
    a = p.parse_args()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    if a.mode == "gloo":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.01)
        for step in range(a.steps):
            opt.zero_grad()
            micro = batches(rank, step, a.accumulate)
            for xy in micro[:-1]:
                with ddp.no_sync():
                    loss_of(ddp, xy).backward()
            loss_of(ddp, micro[-1]).backward()
            opt.step()
        dist.destroy_process_group()
    else:
        import eccl
        import eccl.torch
        if a.newcomer:
            comm = eccl.Communicator(min_world=1)
        else:
            comm = eccl.Communicator(min_world=int(os.environ["ECCL_WORLD"]),
                                     rank_hint=int(os.environ["ECCL_RANK"]))
        job = eccl.torch.ElasticDDP(m, opt, comm, bucket_cap_mb=0.01,
                                    compression=a.compression)
        assert len(job.layout) > 1, job.layout
        if a.heal_fails_once:
            assert job._healing is not None and job._healing.behind
            real = job._healing.work

            class FailsOnce:
                def wait(self):
                    real.wait()
                    raise eccl.EcclTimeoutError("injected: this rank's part of the sync failed")

                def is_completed(self):
                    return real.is_completed()

            job._healing.work = FailsOnce()
        if not a.newcomer:
            assert comm.rank == int(os.environ["ECCL_RANK"]), (comm.rank, os.environ["ECCL_RANK"])
        while job.revision < a.steps:
            step = job.revision
            if step == a.join_at:
                print("WAITING", flush=True)
                # Every member asks in every round, so they leave the loop together.
                while not comm.are_peers_pending():
                    time.sleep(0.02)
            job.step_boundary()
            rank = comm.rank
            micro = batches(rank, step, a.accumulate)
            for xy in micro[:-1]:
                with job.no_sync():
                    loss_of(job.module, xy).backward()
            job.train_step(lambda mod: loss_of(mod, micro[-1]))
        comm.leave()
    torch.save([t.detach().clone() for t in m.parameters()], a.out)
    print("RESULT {}", flush=True)


if __name__ == "__main__":
    main()
