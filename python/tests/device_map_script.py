"""One rank of test_conformance's device-map test: the backend string names devices
("cpu:eccl"); torch's own dispatch must pick eccl's backend for CPU tensors."""

import json
import sys

import torch
import torch.distributed as dist


def main():
    dist.init_process_group(sys.argv[1])
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    pg = dist.distributed_c10d._get_default_group()
    # torch 2.11 and earlier take a Python backend as the whole process group (no
    # per-device backends to ask); later releases wrap it.
    whole = type(pg).__name__ == "ProcessGroupEccl"
    backend = type(pg).__name__ if whole else type(pg._get_backend(torch.device("cpu"))).__name__
    print("RESULT " + json.dumps({"sum": t.tolist(), "backend": backend}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
