"""One rank of test_torch_backend's FSDP2 tests (env:// as torchrun):

    fsdp_script.py BACKEND          a small model sharded with `fully_shard` over a 1-D CPU
                                    DeviceMesh, three SGD steps on this rank's own data;
                                    prints the full parameters (DTensor.full_tensor) and
                                    the last loss
    fsdp_script.py BACKEND hsdp     the same training over a 2-D mesh (replicate x shard,
                                    HSDP): four ranks, two replicas of two shards
    fsdp_script.py BACKEND inplace  NCCL's in-place forms of all_gather_into_tensor and
                                    reduce_scatter_tensor, and an overlap they do not allow
    fsdp_script.py BACKEND divide   the 1-D training with a gradient divide factor of 3
                                    (FSDP2 then reduce-scatters with PREMUL_SUM(1/3); gloo,
                                    which has no PREMUL_SUM, with its sum-and-scale
                                    fallback); with eccl first PREMUL_SUM collectives on
                                    exact values

`ECCL_TEST_DEVICE=cuda` puts the model, the data and every buffer on the GPU (two
processes share one when there is one). Results are printed as JSON after "RESULT ".
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def in_place():
    """The two in-place forms give the out-of-place results; an input that overlaps the
    output anywhere else is refused with the call's error, and the group goes on."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(3 * n)
    out[3 * rank:3 * rank + 3] = torch.arange(3.0) + 10 * rank
    dist.all_gather_into_tensor(out, out[3 * rank:3 * rank + 3])
    inp = torch.arange(4.0 * n) * (rank + 1)
    expect = (torch.arange(4.0 * n) * sum(range(1, n + 1)))[4 * rank:4 * rank + 4].tolist()
    dist.reduce_scatter_tensor(inp[4 * rank:4 * rank + 4], inp)
    res = {"gathered": out.tolist(), "scattered": inp[4 * rank:4 * rank + 4].tolist(),
           "scatter_expect": expect}
    buf = torch.zeros(3 * n + 1)
    try:
        dist.all_gather_into_tensor(buf[:3 * n], buf[1:4])
        res["overlap"] = "accepted"
    except Exception as e:  # noqa: BLE001 - the error each backend gives
        res["overlap"] = type(e).__name__
    after = torch.ones(2)
    dist.all_reduce(after)
    res["after"] = after.tolist()
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


def main():
    dev = os.environ.get("ECCL_TEST_DEVICE", "cpu")
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.set_default_device("cuda")
    dist.init_process_group(sys.argv[1])
    if sys.argv[2:] == ["inplace"]:
        return in_place()
    rank, n = dist.get_rank(), dist.get_world_size()
    extra = {}
    if sys.argv[2:] == ["divide"] and sys.argv[1] == "eccl":
        premul = dist._make_nccl_premul_sum(0.5)
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, op=premul)
        inp = torch.arange(2.0 * n) * (rank + 1)
        kept = inp.clone()
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(0.25))
        # The list form from separate tensors (scaled in a copy, the tensors kept).
        ins = [torch.arange(2.0) * (rank + 1) + 2 * q for q in range(n)]
        kept_list = [i.clone() for i in ins]
        out_list = torch.empty(2)
        dist.reduce_scatter(out_list, ins, op=dist._make_nccl_premul_sum(0.25))
        extra["premul_reduce_scatter_list"] = out_list.tolist()
        extra["premul_list_kept"] = all(torch.equal(a, b) for a, b in zip(ins, kept_list))
        r = torch.full((3,), float(rank + 1))
        dist.reduce(r, dst=0, op=dist._make_nccl_premul_sum(torch.tensor([2.0])))
        extra |= {"premul_all_reduce": t.tolist(), "premul_reduce_scatter": out.tolist(),
                 "premul_input_kept": bool(torch.equal(inp, kept)),
                 "premul_reduce": r.tolist()}
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=premul)
            extra["premul_int"] = None
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            extra["premul_int"] = type(e).__name__
    if sys.argv[2:] == ["hsdp"]:
        mesh = init_device_mesh(dev, (2, n // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(dev, (n,))
    # The same initial parameters on every device: drawn from the CPU's generator, then
    # moved (under a CUDA default device, the CUDA generator would draw other numbers).
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 3))
    model = model.to(dev)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if sys.argv[2:] == ["divide"]:
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(3.0)
                if sys.argv[1] == "gloo":
                    m.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(8, 16, generator=data, device="cpu").to(dev)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    print("RESULT " + json.dumps({"params": params, "loss": loss.item(), **extra}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
