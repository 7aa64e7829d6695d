"""One node of `examples/goodput.py`: trains the lecture's 3×Linear(4000) with one of
eccl's ElasticDDP, torchft (Manager + its DDP over its gloo process group) or plain gloo
DDP, and appends what happened to `--events`, one line per event:

    ready T                 import torch done, the model and its optimizer built (wall clock)
    synced T                eccl only: admitted to a world and holding the job's state
    step N T MEMBERS        global step N committed at T by MEMBERS replicas
    error TEXT              the training loop raised (the process then exits non-zero)

Run by goodput.py under `torchrun --standalone --nnodes 1 --nproc-per-node 1`, one per
node; not meant to be started by hand (the settings come from the environment that
goodput.py gives it: ECCL_MASTER/ECCL_SECRET, TORCHFT_LIGHTHOUSE/REPLICA_GROUP_ID, or
GOODPUT_INIT/GOODPUT_RANK/GOODPUT_WORLD for gloo).
"""

import argparse
import importlib
import os
import sys
import time
from datetime import timedelta

import torch


class Log:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def __call__(self, *fields) -> None:
        self.f.write(" ".join(str(x) for x in fields) + "\n")


def build(width: int) -> torch.nn.Module:
    torch.manual_seed(0)            # the same initial model on every node
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width))


def batch(step: int, rank: int, width: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(size, width, generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), x)


def run_eccl(model, opt, a, log) -> None:
    import eccl
    comm = eccl.Communicator(min_world=a.min_world)
    job = eccl.torch.ElasticDDP(model, opt, comm)
    log("synced", time.time())      # admitted (a newcomer: and given the state)
    while True:
        job.step_boundary()
        x = batch(job.revision, comm.rank or 0, a.width, a.batch)
        job.train_step(lambda m: loss_of(m, x))
        log("step", job.revision, time.time(), len(job.members))


def run_torchft(model, inner, a, log) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    # The settings of torchft's own train_ddp.py (its README's example) on CPU.
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    transport = PGTransport(pg, timeout=timedelta(seconds=10), device="cpu")
    manager = Manager(
        pg=pg, min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"goodput_{os.environ['REPLICA_GROUP_ID']}",
        timeout=timedelta(seconds=30), checkpoint_transport=transport)
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    rank = int(os.environ["REPLICA_GROUP_ID"])
    while True:
        before = manager.current_step()
        opt.zero_grad()
        x = batch(before, rank, a.width, a.batch)
        loss_of(ddp, x).backward()
        opt.step()
        if manager.current_step() > before:
            log("step", manager.current_step(), time.time(), manager.num_participants())


def run_gloo(model, opt, a, log) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world = int(os.environ["GOODPUT_RANK"]), int(os.environ["GOODPUT_WORLD"])
    dist.init_process_group("gloo", init_method=os.environ["GOODPUT_INIT"],
                            rank=rank, world_size=world)
    ddp = DDP(model, bucket_cap_mb=25)
    step = 0
    while True:
        opt.zero_grad(set_to_none=True)
        loss_of(ddp, batch(step, rank, a.width, a.batch)).backward()
        opt.step()
        step += 1
        log("step", step, time.time(), world)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["eccl", "torchft", "gloo"], required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--min-world", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    log = Log(a.events)
    # The library is imported first, as a training script does at its top: "ready" is
    # where such a script has imported everything and built its model and optimizer (the
    # first optimizer made in a process imports much of torch: 1.3 s on a loaded core).
    importlib.import_module({"eccl": "eccl.torch", "torchft": "torchft",
                             "gloo": "torch.distributed"}[a.system])
    model = build(a.width)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    log("ready", time.time())
    try:
        {"eccl": run_eccl, "torchft": run_torchft, "gloo": run_gloo}[a.system](model, opt, a, log)
    except BaseException as e:  # noqa: B902 - recorded for the report, then re-raised
        log("error", f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
        raise


if __name__ == "__main__":
    sys.exit(main())
