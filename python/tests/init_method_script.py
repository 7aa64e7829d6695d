"""One rank of test_conformance's init-method test: init_process_group with an explicit
init_method (file:// or tcp://), rank and world size, then one all_reduce."""

import json
import sys

import torch
import torch.distributed as dist


def main():
    backend, method, rank, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group(backend, init_method=method, rank=rank, world_size=n)
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t)
    print("RESULT " + json.dumps({"sum": t.tolist()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
