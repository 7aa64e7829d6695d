"""One rank of test_conformance's subgroup test: ranks 0 and 1 form a group, rank 2 (outside
it) is SIGKILLed, and the group goes on; prints the group's results as JSON."""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from procs import wait_dead


def main():
    dist.init_process_group(sys.argv[1])
    r = dist.get_rank()
    g = dist.new_group([0, 1])
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if r == 2:
        store.set("lost_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    wait_dead(int(store.get("lost_pid")))
    sums = []
    for i in range(3):
        t = torch.full((4,), float(r + 1 + i))
        dist.all_reduce(t, group=g)
        sums.append(t.tolist())
    print("RESULT " + json.dumps({"sums": sums}), flush=True)
    dist.destroy_process_group(g)
    os._exit(0)  # the default group lost a rank: no orderly teardown of it


if __name__ == "__main__":
    main()
