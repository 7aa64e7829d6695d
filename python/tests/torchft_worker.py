"""One replica group (one process) of test_torchft.py: torchft's Manager, DDP and
Optimizer on a small model, with eccl.torchft.ProcessGroupEcclFT where torchft's examples
use its ProcessGroupGloo. Prints one JSON line per committed step ("STEP {...}") and
stops at --steps. With --die-at N, SIGKILLs itself at the first step after N that all
three replicas committed. The replica group's store (MASTER_ADDR/MASTER_PORT) is hosted
by the test, as torchrun's agent hosts it."""

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
from eccl.torchft import ProcessGroupEcclFT
from torchft import DistributedDataParallel, Manager, Optimizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--ready-dir", help="start once every replica has written a file here")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--pg", choices=["eccl", "gloo"], default="eccl",
                   help="gloo: torchft's own ProcessGroupGloo, for comparison")
    a = p.parse_args()
    rid = int(os.environ["REPLICA_GROUP_ID"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    if a.pg == "gloo":
        from torchft import ProcessGroupGloo
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    else:
        pg = ProcessGroupEcclFT(timeout=timedelta(seconds=5))   # the one line change
    manager = Manager(
        pg=pg, min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"eccl_torchft_{rid}", timeout=timedelta(seconds=10))
    if a.ready_dir:  # importing torch takes seconds: start the replicas together
        open(os.path.join(a.ready_dir, str(rid)), "w").close()
        while len(os.listdir(a.ready_dir)) < a.replicas:
            time.sleep(0.05)
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    while manager.current_step() < a.steps:
        before = manager.current_step()
        opt.zero_grad()
        g = torch.Generator().manual_seed(before * 7 + rid)
        x = torch.randn(8, 16, generator=g)
        torch.nn.functional.mse_loss(ddp(x), torch.zeros(8, 4)).backward()
        opt.step()
        step = manager.current_step()
        if step > before:
            digest = float(sum(p.detach().double().sum() for p in model.parameters()))
            print("STEP " + json.dumps({"step": step, "participants": manager.num_participants(),
                                        "t": time.time(), "digest": round(digest, 6)}),
                  flush=True)
            if 0 <= a.die_at <= step and manager.num_participants() == a.replicas:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)  # a step of real training takes a while; others may join meanwhile
    manager.shutdown(wait=False)
    os._exit(0)


if __name__ == "__main__":
    main()
