"""One rank of test_torch_backend's G2 test for torch's in-place all_to_alls, which
keep their input: rank 2 of three makes no exchange (of the forms with split sizes it
takes only the sizes' round) and is SIGKILLed while ranks 0 and 1 are in the call (argv[2]),
having exchanged with each other what they could. Prints whether the call failed and
whether its tensor kept its values."""

import json
import os
import signal
import sys
import time

import eccl.torch
import torch
import torch.distributed as dist


def main():
    dist.init_process_group(sys.argv[1])
    r, n = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    k = 1 << 16
    name = sys.argv[2]
    if r == n - 1:
        store.set("lost_pid", str(os.getpid()))
        if name != "all_to_all_single":
            # The forms with split sizes exchange every rank's sizes first: this rank
            # takes that round, so that the others go on to move their blocks.
            pg = dist.distributed_c10d._get_default_group()
            if not isinstance(pg, eccl.torch.ProcessGroupEccl):
                pg = pg._get_backend(torch.device("cpu"))  # torch 2.12+: the group wraps it
            assert pg._sizes_agree([k] * n, [k] * n)
        time.sleep(1.5)                   # while the others are in their calls
        os.kill(os.getpid(), signal.SIGKILL)
    calls = {
        # all_to_all_single(t, t), even and with split sizes, and the list form on the
        # same tensors both sides: each reads what it sends and writes the same memory.
        "all_to_all_single": lambda t: dist.all_to_all_single(t, t, async_op=True),
        "all_to_all_single_splits": lambda t: dist.all_to_all_single(
            t, t, [k] * n, [k] * n, async_op=True),
        "all_to_all_list": lambda t: dist.all_to_all(list(t.split(k)), list(t.split(k)), async_op=True),
    }
    t = torch.arange(float(n * k)) + 1000 * r
    before = t.clone()
    try:
        calls[name](t).wait()
        failed = None
    except Exception as e:               # noqa: BLE001 - the call must fail
        failed = type(e).__name__
    out = {"failed": failed, "kept": bool(torch.equal(t, before))}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the group lost a rank: no orderly teardown of it


if __name__ == "__main__":
    main()
