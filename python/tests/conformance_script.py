"""One rank of the conformance checks (test_conformance.py): torch.distributed calls
beyond the plain collectives, run the same way under gloo and eccl; prints the results as
JSON for the test to compare."""

import json
import sys

import torch
import torch.distributed as dist


def calls(r, n):
    out = {}
    # all_gather_coalesced with torch's layout: outputs[rank][i] is rank's inputs[i].
    ins = [torch.full((2,), float(r)), torch.arange(3, dtype=torch.float32) + 10 * r]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(n)]
    dist.all_gather_coalesced(outs, ins)
    out["all_gather_coalesced"] = [[t.tolist() for t in lst] for lst in outs]

    # A call refused for an argument checkable on this rank leaves the group usable.
    try:
        dist.broadcast(torch.ones(2), src=n + 5)
        out["bad_root"] = "accepted"
    except Exception as e:  # noqa: BLE001
        out["bad_root"] = "refused"
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t)
    out["after_bad_root"] = t.tolist()
    # One that reaches the backend: gloo has no AVG; eccl has none for integers.
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)
        out["int_avg"] = "accepted"
    except Exception:  # noqa: BLE001
        out["int_avg"] = "refused"
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t)
    out["after_int_avg"] = t.tolist()

    # Subgroups: a collective in a group of ranks 0 and 1, then the group destroyed.
    g = dist.new_group([0, 1])
    t = torch.full((2,), float(r + 1))
    if r in (0, 1):
        dist.all_reduce(t, group=g)
        out["subgroup_all_reduce"] = t.tolist()
        out["subgroup_rank"] = dist.get_rank(g)
    dist.destroy_process_group(g)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after_destroy_subgroup"] = t.tolist()

    # Futures chain.
    fut = dist.all_reduce(torch.ones(2) * r, async_op=True).get_future()
    out["future_then"] = fut.then(lambda f: f.value()[0] * 2).wait().tolist()

    # batch_isend_irecv with tags (torch asks the backend whether it coalesces first).
    send, recv = torch.full((3,), float(r)), torch.empty(3)
    send2, recv2 = torch.full((2,), 10.0 + r), torch.empty(2)
    ops = [dist.P2POp(dist.isend, send, (r + 1) % n, tag=1),
           dist.P2POp(dist.irecv, recv, (r - 1) % n, tag=1),
           dist.P2POp(dist.isend, send2, (r + 1) % n, tag=2),
           dist.P2POp(dist.irecv, recv2, (r - 1) % n, tag=2)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv"] = [recv.tolist(), recv2.tolist()]

    # barrier(device_ids) is ignored on CPU, as gloo does.
    dist.barrier(device_ids=[0])
    out["group_name_set"] = bool(dist.distributed_c10d._get_default_group().group_name)
    return out


def main():
    backend = sys.argv[1]
    dist.init_process_group(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    res = calls(r, n)
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
