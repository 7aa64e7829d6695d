"""One rank of the conformance checks (test_conformance.py): torch.distributed calls
beyond the plain collectives, run the same way under gloo and eccl; prints the results as
JSON for the test to compare."""

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch_script import collectives


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
    except Exception:  # noqa: BLE001
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

    # A Work says it is complete once wait() returned (loops that poll rely on it).
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.wait()
    sw = dist.isend(torch.ones(1), (r + 1) % n, tag=5)
    rw = dist.irecv(torch.empty(1), (r - 1) % n, tag=5)
    sw.wait()
    rw.wait()
    out["is_completed_after_wait"] = [w.is_completed(), w.is_success(), sw.is_completed(),
                                      rw.is_completed()]

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

    # Receive from any source: rank 0 takes one message from each other rank, in the
    # order they come (the sender's rank is what recv returns), then with a tag.
    for tag in (0, 7):
        if r == 0:
            got = []
            for _ in range(n - 1):
                t = torch.empty(2)
                src = dist.recv(t, tag=tag)
                got.append([src, t.tolist()])
            out[f"recv_anysource_tag{tag}"] = sorted(got)
        else:
            dist.send(torch.full((2,), float(r)), 0, tag=tag)
    if r == 0:
        w = dist.irecv(torch.empty(1), tag=3)
        w.wait()
        out["irecv_anysource_completed"] = w.is_completed()
    elif r == n - 1:
        dist.send(torch.ones(1), 0, tag=3)

    # Object collectives.
    objs = [{"rank": r, "s": "x" * r}, None]
    if r != 1:
        objs = [None, None]
    dist.broadcast_object_list(objs, src=1)
    out["broadcast_object_list"] = objs
    lst = [None] * n
    dist.all_gather_object(lst, ("r", r))
    out["all_gather_object"] = lst
    lst = [None] * n if r == 0 else None
    dist.gather_object({"r": r}, lst, dst=0)
    out["gather_object"] = lst
    got = [None]
    dist.scatter_object_list(got, [f"for {i}" for i in range(n)] if r == n - 1 else None,
                             src=n - 1)
    out["scatter_object_list"] = got
    if r == 0:
        dist.send_object_list([{"a": 1}, [2, 3]], dst=1)
    elif r == 1:
        got = [None, None]
        dist.recv_object_list(got, src=0)
        out["send_recv_object_list"] = got

    # Subgroups in every form torch offers: p2p inside one, groups of two, groups by
    # enumeration (uneven at 3 ranks), split_group.
    g = dist.new_group([0, 1])
    if r == 0:
        dist.send(torch.full((2,), 3.0), group=g, group_dst=1)
    elif r == 1:
        t = torch.empty(2)
        dist.recv(t, group=g, group_src=0)
        out["subgroup_p2p"] = t.tolist()
    dist.destroy_process_group(g)
    try:
        cur, _ = dist.new_subgroups(group_size=2)
        t = torch.full((1,), float(r + 1))
        dist.all_reduce(t, group=cur)
        out["new_subgroups"] = [t.tolist(), dist.get_rank(cur), dist.get_world_size(cur)]
    except Exception as e:  # noqa: BLE001 - gloo's refusal is part of the answer
        out["new_subgroups"] = type(e).__name__
    parts = [list(range(0, n, 2)), list(range(1, n, 2))]
    cur, _ = dist.new_subgroups_by_enumeration(parts)
    t = torch.full((1,), float(r + 1))
    dist.all_reduce(t, group=cur)
    lst = [None] * dist.get_world_size(cur)
    dist.all_gather_object(lst, r, group=cur)
    out["new_subgroups_by_enumeration"] = [t.tolist(), lst]
    try:
        sg = dist.split_group(split_ranks=parts)
        t = torch.full((1,), float(r + 1))
        dist.all_reduce(t, group=sg)
        out["split_group"] = t.tolist()
    except Exception as e:  # noqa: BLE001
        out["split_group"] = type(e).__name__

    # Timeouts as torch passes them: a group's own timeout bounds a receive nobody
    # answers (that rank alone fails; the group goes on) and a collective one rank
    # skips (the ranks in it fail within the bound).
    tg = dist.new_group(list(range(n)), timeout=timedelta(seconds=2))
    if r == 0:
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(1), src=1, group=tg, tag=99)
            out["recv_timeout"] = "received"
        except Exception:  # noqa: BLE001
            out["recv_timeout"] = ["raised", 1.5 < time.monotonic() - t0 < 4]
    dist.barrier()  # the default group: rank 0 is done waiting
    t = torch.full((1,), float(r + 1))
    try:
        # gloo closes the pair whose receive timed out; eccl's group goes on.
        dist.all_reduce(t, group=tg)
        out["after_recv_timeout"] = t.tolist()
    except Exception as e:  # noqa: BLE001
        out["after_recv_timeout"] = type(e).__name__
    dist.destroy_process_group(tg)

    # barrier(device_ids) is ignored on CPU, as gloo does.
    dist.barrier(device_ids=[0])
    out["group_name_set"] = bool(dist.distributed_c10d._get_default_group().group_name)
    return out


def main():
    backend = sys.argv[1]
    dist.init_process_group(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    res = collectives(r, n)
    res.update(calls(r, n))
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
