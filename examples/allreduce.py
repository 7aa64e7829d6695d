"""The first collective, in a few lines: an embedded master and two ranks.

    python examples/allreduce.py
"""

import multiprocessing as mp

import eccl
import numpy as np


def rank(addr: str, secret: str, r: int) -> None:
    comm = eccl.Communicator(addr, secret, rank_hint=r, min_world=2)
    comm.update_topology()                      # join the job: rank and epoch
    x = np.full(4, r + 1, dtype=np.float32)
    info = comm.all_reduce(x)                   # in place, GIL released while it runs
    print(f"rank {comm.rank}: {x} (epoch {info.epoch}, members {list(info.members)})", flush=True)


if __name__ == "__main__":
    master = eccl.Master()                      # in this process; peers need addr + secret
    ps = [mp.Process(target=rank, args=(master.addr, master.secret, r)) for r in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    master.shutdown()
