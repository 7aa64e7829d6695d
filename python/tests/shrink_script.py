"""One rank of test_reconfigure's shrink test: the last rank is SIGKILLed, the others
call dist.shrink_group([it]) and run an all_reduce on the shrunk default group."""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from procs import wait_dead


def main():
    dist.init_process_group(sys.argv[1])
    r, n = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(torch.ones(1))
    store = dist.distributed_c10d._get_default_store()
    if r == n - 1:
        store.set("lost_pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    wait_dead(int(store.get("lost_pid")))
    try:
        t0 = time.monotonic()
        g = dist.shrink_group([n - 1])
        shrink_s = time.monotonic() - t0
        t = torch.full((2,), float(r + 1))
        dist.all_reduce(t)
        out = {"sum": t.tolist(), "rank": dist.get_rank(), "size": dist.get_world_size(),
               "group_size": g.size(), "quick": shrink_s < 5.0}
    except Exception as e:  # noqa: BLE001 - gloo refuses shrinking
        out = {"error": type(e).__name__}
    print("RESULT " + json.dumps(out), flush=True)
    # Rank 0 hosts the store: it leaves only once every survivor is done with it (gloo's
    # refusal is immediate, so rank 0 could exit while another still reads lost_pid).
    store.add("done", 1)
    if r == 0:
        deadline = time.monotonic() + 30
        while store.add("done", 0) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    os._exit(0)


if __name__ == "__main__":
    main()
