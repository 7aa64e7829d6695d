"""One rank of the monitored_barrier check (test_conformance.py): a barrier everyone
reaches, then one that ranks 2 and up reach too late; prints what each rank saw."""

import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main():
    dist.init_process_group(sys.argv[1])
    r = dist.get_rank()
    out = {}
    dist.monitored_barrier(timeout=timedelta(seconds=10))
    out["all_arrive"] = "ok"
    if r >= 2:
        time.sleep(3.0)
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
        out["late"] = "ok"
    except RuntimeError as e:
        out["late"] = str(e).split("\n")[0] if r == 0 else "raised"
    print("RESULT " + json.dumps(out), flush=True)
    # The group is left as the failed barrier left it (gloo's too): no more calls.
    sys.stdout.flush()
    import os
    os._exit(0)


if __name__ == "__main__":
    main()
