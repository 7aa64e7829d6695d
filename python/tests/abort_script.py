"""One rank of test_reconfigure's abort test: ranks 0 and 1 start an all_reduce that
rank 2 does not join (yet); rank 0 calls ProcessGroup.abort(); prints what each rank saw
and the abort hooks' calls, then one more all_reduce over all three."""

import json
import sys
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group(sys.argv[1])
    r = dist.get_rank()
    pg = dist.distributed_c10d._get_default_group()
    hooks = []
    pg.register_abort_hook(7, lambda: hooks.append(time.monotonic()))
    dist.all_reduce(torch.ones(1))  # the world is up everywhere
    out = {}
    store = dist.distributed_c10d._get_default_store()
    if r in (0, 1):
        w = dist.all_reduce(torch.ones(1000), async_op=True)
        time.sleep(0.3)
        t0 = time.monotonic()
        if r == 0:
            pg.abort()
        try:
            w.wait()
            out["in_flight"] = "completed"
        except Exception as e:  # noqa: BLE001
            out["in_flight"] = type(e).__name__
            # Told, not timed out (the group's timeout is minutes): the bound leaves
            # room for a busy host to schedule rank 0's abort and its message late.
            out["fast"] = time.monotonic() - t0 < 3.0
        store.set(f"failed/{r}", "1")
    else:
        # Once ranks 0 and 1 are out of their call (the abort reached them), rank 2's next
        # call runs into the aborted epoch.
        store.wait(["failed/0", "failed/1"])
        try:
            dist.all_reduce(torch.ones(1))
            out["late_call"] = "completed"
        except Exception as e:  # noqa: BLE001 - its epoch was aborted by rank 0
            out["late_call"] = type(e).__name__
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    out["hooks"] = len(hooks)
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
