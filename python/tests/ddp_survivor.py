"""One rank of a plain DDP job on backend "eccl" (started without torchrun: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment). It trains until a step fails,
then prints what DDP raised, its cause, and whether that error pickles to itself in
this process, and exits 3. It says TRAINING after ten steps; the test then kills
another rank."""

import pickle
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    dist.init_process_group("eccl")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    for step in range(100000):
        try:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if step == 10:
                print("TRAINING", flush=True)   # steps go through DDP's all_reduce
        except Exception as e:  # noqa: BLE001 - what DDP raised is the point
            chain = [e]
            while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
                chain.append(chain[-1].__cause__ or chain[-1].__context__)
            for c in chain:
                print(f"ERROR {type(c).__module__}.{type(c).__qualname__}: {c}", flush=True)
            again = pickle.loads(pickle.dumps(chain[-1]))
            print(f"PICKLED {type(again).__module__}.{type(again).__qualname__}", flush=True)
            traceback.print_exc()
            sys.exit(3)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
