"""One rank of test_torch_backend's DTensor checks (env:// as torchrun):

    dtensor_script.py BACKEND       DTensor redistributions over a 1-D CPU mesh of every
                                    rank, even and uneven shards: Shard -> Replicate
                                    (all_gather), Shard(0) -> Shard(1) (all_to_all),
                                    Partial -> Replicate (all_reduce, sum and avg),
                                    Partial -> Shard (reduce_scatter), Replicate -> Shard,
                                    full_tensor, and ops on sharded DTensors
    dtensor_script.py BACKEND 2d    the same on a 2-D mesh (2 x n/2), across each dimension
                                    and both at once

Prints every result as JSON after "RESULT " (the test compares them with gloo's).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def base(rows, cols):
    # Eighths: sums of a few of them are exact, so every backend must give the same bits.
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) / 8.0


def local(dt):
    return dt.to_local().tolist()


def one_d(mesh, rank, n):
    out = {}
    for rows, cols in [(2 * n, 3 * n), (2 * n + 1, 3 * n - 1)]:   # even, then uneven
        key = f"{rows}x{cols}"
        full = base(rows, cols)
        s0 = distribute_tensor(full, mesh, [Shard(0)])
        out[f"{key} shard0 local"] = local(s0)
        out[f"{key} shard0->replicate"] = local(s0.redistribute(mesh, [Replicate()]))
        out[f"{key} shard0->shard1"] = local(s0.redistribute(mesh, [Shard(1)]))
        out[f"{key} shard1->shard0"] = local(
            distribute_tensor(full, mesh, [Shard(1)]).redistribute(mesh, [Shard(0)]))
        out[f"{key} full_tensor"] = s0.full_tensor().tolist()
        # Partial: each rank holds its own addend.
        mine = full * (rank + 1)
        for op in ("sum", "avg"):
            p = DTensor.from_local(mine, mesh, [Partial(op)], run_check=False)
            out[f"{key} partial({op})->replicate"] = local(p.redistribute(mesh, [Replicate()]))
            p = DTensor.from_local(mine, mesh, [Partial(op)], run_check=False)
            out[f"{key} partial({op})->shard0"] = local(p.redistribute(mesh, [Shard(0)]))
        r = distribute_tensor(full, mesh, [Replicate()])
        out[f"{key} replicate->shard1"] = local(r.redistribute(mesh, [Shard(1)]))
        # Ops on sharded DTensors: a matmul (row-sharded x replicated) and a reduction.
        w = distribute_tensor(base(cols, 4), mesh, [Replicate()])
        out[f"{key} matmul"] = (s0 @ w).full_tensor().tolist()
        out[f"{key} sum"] = s0.sum().full_tensor().item()
    # Inexact addends: the sum's bits depend on the order of additions, which eccl keeps
    # the same on every rank (G3).
    g = torch.Generator().manual_seed(rank)
    p = DTensor.from_local(torch.rand(5, 7, generator=g), mesh, [Partial()], run_check=False)
    out["inexact partial->replicate"] = local(p.redistribute(mesh, [Replicate()]))
    return out


def two_d(mesh, rank):
    out = {}
    n0, n1 = mesh.shape
    full = base(4 * n0 * n1 + 1, 2 * n0 * n1)
    for a, b in [([Shard(0), Shard(1)], [Replicate(), Replicate()]),
                 ([Shard(0), Shard(1)], [Shard(1), Shard(0)]),
                 ([Replicate(), Shard(0)], [Shard(0), Replicate()]),
                 ([Shard(0), Replicate()], [Replicate(), Shard(1)])]:
        dt = distribute_tensor(full, mesh, a)
        out[f"{a}->{b}"] = local(dt.redistribute(mesh, b))
    mine = full * (rank + 1)
    p = DTensor.from_local(mine, mesh, [Partial(), Partial("avg")], run_check=False)
    out["partial,partial(avg)->shard0,replicate"] = local(
        p.redistribute(mesh, [Shard(0), Replicate()]))
    p = DTensor.from_local(mine, mesh, [Replicate(), Partial()], run_check=False)
    out["replicate,partial->replicate,shard1"] = local(
        p.redistribute(mesh, [Replicate(), Shard(1)]))
    out["full_tensor"] = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).full_tensor().tolist()
    return out


def main():
    dist.init_process_group(sys.argv[1])
    rank, n = dist.get_rank(), dist.get_world_size()
    if sys.argv[2:] == ["2d"]:
        out = two_d(init_device_mesh("cpu", (2, n // 2)), rank)
    else:
        out = one_d(init_device_mesh("cpu", (n,)), rank, n)
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
