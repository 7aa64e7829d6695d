"""One rank of the torch.distributed checks (run by test_torch_backend.py and
test_cuda.py): every collective on fixed inputs, then a few DDP steps; prints the
results as JSON. `ECCL_TEST_DEVICE=cuda` makes every tensor a CUDA tensor (on GPU
LOCAL_RANK modulo the GPUs present)."""

import json
import os
import sys

import eccl.torch  # noqa: F401  registers "eccl"
import torch
import torch.distributed as dist


def collectives(r, n):
    out = {}
    t = torch.arange(6, dtype=torch.float32) * (r + 1)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    t = torch.full((3,), r + 1, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    out["all_reduce_prod"] = t.tolist()
    t = torch.full((3,), float(r))
    w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    w.wait()
    out["all_reduce_async"] = t.tolist()
    fut = dist.all_reduce(torch.ones(2) * r, async_op=True).get_future()
    out["future"] = fut.wait()[0].tolist()
    t = torch.full((4,), float(r))
    dist.broadcast(t, src=n - 1)
    out["broadcast"] = t.tolist()
    t = torch.full((2,), float(r + 1))
    dist.reduce(t, dst=0)
    out["reduce"] = t.tolist() if r == 0 else None
    lst = [torch.empty(2) for _ in range(n)]
    dist.all_gather(lst, torch.full((2,), float(r)))
    out["all_gather"] = [x.tolist() for x in lst]
    o = torch.empty(2 * n)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
    out["all_gather_into_tensor"] = o.tolist()
    o = torch.empty(2)
    dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(n)])
    out["reduce_scatter"] = o.tolist()
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + r)
    out["reduce_scatter_tensor"] = o.tolist()
    g = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.full((1,), float(r)), g, dst=0)
    out["gather"] = [x.item() for x in g] if g else None
    s = torch.empty(1)
    dist.scatter(s, [torch.full((1,), 5.0 + i) for i in range(n)] if r == 0 else None, src=0)
    out["scatter"] = s.tolist()
    a = torch.empty(n)
    dist.all_to_all_single(a, torch.arange(n, dtype=torch.float32) + 10 * r)
    out["all_to_all_single"] = a.tolist()
    # uneven splits: rank r sends i+1 elements to rank i
    ins = torch.full((sum(i + 1 for i in range(n)),), float(r))
    outs = torch.empty(n * (r + 1))
    dist.all_to_all_single(outs, ins, [r + 1] * n, [i + 1 for i in range(n)])
    out["all_to_all_single_uneven"] = outs.tolist()
    lst = [torch.empty(1) for _ in range(n)]
    dist.all_to_all(lst, [torch.full((1,), 100.0 * r + i) for i in range(n)])
    out["all_to_all"] = [x.item() for x in lst]
    # The list forms with blocks cut from one tensor (eccl reads and writes them in
    # place), and an uneven all_to_all_single in place (eccl copies its input first).
    whole = torch.zeros(2 * n)
    dist.all_gather(list(whole.split(2)), torch.full((2,), 3.0 * r))
    out["all_gather_views"] = whole.tolist()
    o = torch.empty(3)
    dist.reduce_scatter(o, list((torch.arange(3.0 * n) * (r + 1)).split(3)))
    out["reduce_scatter_views"] = o.tolist()
    whole = torch.full((2 * n,), -1.0)
    dist.gather(torch.full((2,), 7.0 * r), list(whole.split(2)) if r == 0 else None, dst=0)
    out["gather_views"] = whole.tolist() if r == 0 else None
    s = torch.empty(2)
    dist.scatter(s, list((torch.arange(2.0 * n) + 0.5).split(2)) if r == 0 else None, src=0)
    out["scatter_views"] = s.tolist()
    a, b = torch.arange(2.0 * n) + 10 * r, torch.empty(2 * n)
    dist.all_to_all(list(b.chunk(n)), list(a.chunk(n)))
    out["all_to_all_views"] = b.tolist()
    c = [torch.empty(2) for _ in range(n)]
    dist.all_to_all(c, list(a.chunk(n)))
    out["all_to_all_views_in"] = [x.tolist() for x in c]
    # Separate tensors (eccl writes and reads them where they are): the input one of the
    # outputs, the same tensors both sides, and empty blocks.
    lst = [torch.full((3,), -1.0) for _ in range(n)]
    lst[r].fill_(4.0 * r)
    dist.all_gather(lst, lst[r])
    out["all_gather_own"] = [x.tolist() for x in lst]
    lst = [torch.full((2,), 10.0 * r + i) for i in range(n)]
    dist.all_to_all(lst, lst)
    out["all_to_all_same_list"] = [x.tolist() for x in lst]
    lst = [torch.empty(0) for _ in range(n)]
    dist.all_gather(lst, torch.empty(0))
    out["all_gather_empty"] = [x.numel() for x in lst]
    g = [torch.full((2,), -1.0) for _ in range(n)]
    g[r].fill_(3.0 * r)
    dist.gather(g[r], g if r == 0 else None, dst=0)
    out["gather_own"] = [x.tolist() for x in g] if r == 0 else None
    dist.barrier()
    peer = (r + 1) % n
    src = (r - 1) % n
    x = torch.empty(3)
    sreq = dist.isend(torch.full((3,), float(r)), dst=peer)
    rreq = dist.irecv(x, src=src)
    sreq.wait()
    rreq.wait()
    out["isend_irecv"] = x.tolist()
    ts = [torch.full((3,), float(r + 1)), torch.full((2,), 10.0 * (r + 1))]
    dist.all_reduce_coalesced(ts)
    out["all_reduce_coalesced"] = [t.tolist() for t in ts]
    if r == 0:
        dist.send(torch.ones(2) * 42, dst=1)
    elif r == 1:
        y = torch.empty(2)
        dist.recv(y, src=0)
        out["send_recv"] = y.tolist()
    return out


def ddp(r, n, steps, hook=None, state=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    if hook is not None:
        ddp_model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    g = torch.Generator(device="cpu").manual_seed(100 + r)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g, device="cpu").to(torch.get_default_device())
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp_model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    res = {"params": [p.detach().flatten().tolist() for p in model.parameters()],
           "losses": losses}
    if hook is None and torch.get_default_device().type == "cpu":
        # DDP's communication hooks (their futures, f16 all_reduces): torch's allreduce
        # hook gives what DDP's own reduction gives; the f16-compressing one nearly so.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks
        res["allreduce_hook"] = ddp(r, n, steps, hooks.allreduce_hook)["params"]
        res["fp16_hook"] = ddp(r, n, steps, hooks.fp16_compress_hook)["params"]
        # PowerSGD waits for an all_reduce's future inside the `then` callback of another
        # (a callback on eccl's callback thread that waits for callbacks queued behind it).
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, random_seed=0)
        res["powersgd_hook"] = ddp(r, n, steps, psgd.powerSGD_hook, state)["params"]
    return res


def coverage(r, n):
    """Every dtype and reduce op of eccl's Rust lists, through the torch backend: rank r
    contributes r + 1 everywhere."""
    import eccl
    out = {}
    for dtype in eccl.DType:
        tdtype = getattr(torch, eccl.DTYPE_NAMES[dtype])
        for op in eccl.ReduceOp:
            name = op.name.lower()
            floaty = tdtype.is_floating_point
            if (name == "avg" and not floaty) or (name in ("band", "bor", "bxor") and floaty):
                continue
            t = torch.full((4,), r + 1, dtype=tdtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, eccl.TORCH_OP_NAMES[op]))
            out[f"{dtype.name}/{op.name}"] = t.double().tolist()
    return out


def mixed(r, n):
    """Calls that must fail on every rank with a typed error, after which the group
    still works: a call mixing CPU and CUDA tensors, then ranks disagreeing on the
    device kind of one all_reduce, then of one send."""
    import eccl
    out = {}
    try:
        dist.all_reduce_coalesced([torch.ones(2, device="cpu"), torch.ones(2)])
        out["mixed"] = "no error"
    except eccl.InvalidArgumentError as e:
        out["mixed"] = "InvalidArgumentError" if "mixes" in str(e) else str(e)
    t = torch.ones(4) * (r + 1)
    dist.all_reduce(t)
    out["after_mixed"] = t.tolist()
    try:
        dist.all_reduce(torch.ones(1024, device="cpu" if r == 0 else None))
        out["disagree"] = "no error"
    except eccl.EcclError as e:
        out["disagree"] = type(e).__name__
    except RuntimeError as e:  # torch's wrapper of a failed future
        out["disagree"] = "RuntimeError: " + str(e)[:200]
    # Ranks that disagree on a send's device kind: a CPU tensor sent where a CUDA one is
    # received (eccl's device receive expects a device send's header). The receiver fails
    # with a typed error, the epoch ends, and the group goes on.
    out["p2p_kinds"] = send_from_0_to_1(r, torch.ones(4, device="cpu"), torch.empty(4))
    out["after_p2p_kinds"] = all_reduce_after_an_abort()
    return out


def send_from_0_to_1(r, sent, received):
    """Rank 0 sends `sent`, rank 1 receives into `received`, the others wait: "sent",
    "no error" or "idle", or the eccl error's name and message."""
    import eccl
    try:
        if r == 0:
            dist.send(sent, dst=1)
            return "sent"
        if r == 1:
            dist.recv(received, src=0)
            return "no error"
        return "idle"
    except eccl.EcclError as e:
        return f"{type(e).__name__}: {e}"[:300]


def all_reduce_after_an_abort():
    """An all_reduce of ones, made again once if the first fails with an abort an earlier
    call caused: its result, or the second failure's name."""
    import eccl
    for attempt in range(2):
        t = torch.ones(4)
        try:
            dist.all_reduce(t)
            return t.tolist()
        except eccl.EcclError as e:
            if attempt == 1:
                return type(e).__name__


def p2p_mismatch(r, n):
    """A send of 8 elements where the receiver expects 6 (a tensor of the default
    device: CUDA tensors take eccl's device send in test_cuda.py): the receiver fails
    with a MismatchError naming both sizes, the sender's part was eager, the epoch ends
    on every rank, and the group goes on at the next call, with every rank's sends and
    receives in order again."""
    out = {"mismatch": send_from_0_to_1(r, torch.ones(8), torch.empty(6))}
    out["after"] = all_reduce_after_an_abort()
    x = torch.full((3,), float(r))
    dist.send(x, dst=(r + 1) % n)
    y = torch.empty(3)
    dist.recv(y, src=(r - 1) % n)
    out["ring"] = y.tolist()
    return out


def big_uneven(r, n):
    """all_to_all with uneven blocks larger than a link buffers (16 MiB and more over
    shared memory, where pairwise sends of whole blocks once waited for each other for
    good), in the single-tensor and the list form; then sizes that disagree."""
    out = {}
    block = lambda s, t: (4 << 20) + (s * n + t) * 12345    # noqa: E731 - elements
    ins = torch.cat([torch.full((block(r, t),), float(100 * r + t)) for t in range(n)])
    outs = torch.empty(sum(block(s, r) for s in range(n)))
    dist.all_to_all_single(outs, ins, [block(s, r) for s in range(n)],
                           [block(r, t) for t in range(n)])
    got = outs.split([block(s, r) for s in range(n)])
    out["single"] = [[b.numel(), b.min().item(), b.max().item()] for b in got]
    lst = [torch.empty(block(s, r)) for s in range(n)]
    dist.all_to_all(lst, [torch.full((block(r, t),), float(100 * r + t)) for t in range(n)])
    out["list"] = [[b.numel(), b.min().item(), b.max().item()] for b in lst]
    # The list form again with blocks cut from one tensor each way (read and written in
    # place on the CPU).
    whole = torch.empty(sum(block(s, r) for s in range(n)))
    got = list(whole.split([block(s, r) for s in range(n)]))
    dist.all_to_all(got, list(ins.split([block(r, t) for t in range(n)])))
    out["list_views"] = [[b.numel(), b.min().item(), b.max().item()] for b in got]
    if torch.get_default_device().type == "cpu":
        # In place, with split sizes: what it sends is read before anything lands (gloo
        # gives back the input unchanged here, so this is checked against the formula).
        t = torch.arange(float(n * n)) + 100 * r
        dist.all_to_all_single(t, t, [n] * n, [n] * n)
        out["in_place"] = t.tolist()
        t = torch.arange(float(n * n)) + 100 * r
        dist.all_to_all_single(t, t)
        out["in_place_even"] = t.tolist()
        # The list form on separate tensors, some empty (gloo refuses uneven lists);
        # then in place, the same tensors both sides (rank s sends t s + t + 1).
        size = lambda s, t: (s + 2 * t) % 3    # noqa: E731
        lst = [torch.full((size(s, r),), -1.0) for s in range(n)]
        dist.all_to_all(lst, [torch.full((size(r, t),), 100.0 * r + t) for t in range(n)])
        out["uneven_lists"] = [x.tolist() for x in lst]
        lst = [torch.full((r + t + 1,), 100.0 * r + t) for t in range(n)]
        dist.all_to_all(lst, lst)
        out["uneven_same_list"] = [x.tolist() for x in lst]
    # One call, whatever each rank's own blocks look like: in the list form rank 0's
    # blocks are all of one size where the others' differ.
    size = lambda s, t: 2 if 0 in (s, t) else s + t + 1    # noqa: E731
    lst = [torch.empty(size(s, r)) for s in range(n)]
    dist.all_to_all(lst, [torch.full((size(r, t),), 100.0 * r + t) for t in range(n)])
    out["mixed_lists"] = [x.tolist() for x in lst]
    # Each rank sends the next 24 MiB before receiving from the one before (torch's
    # batch_isend_irecv): more than a link holds, so each send must keep what arrives
    # while it waits for room.
    x, y = torch.full((6 << 20,), float(r)), torch.empty(6 << 20)
    ops = [dist.P2POp(dist.isend, x, (r + 1) % n), dist.P2POp(dist.irecv, y, (r - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["ring"] = [y.min().item(), y.max().item()]
    # The last rank expects one element fewer from rank 0 than rank 0 sends it.
    recvs = [4] * n
    if r == n - 1:
        recvs[0] = 3
    try:
        dist.all_to_all_single(torch.empty(sum(recvs)), torch.ones(4 * n), recvs, [4] * n)
        out["mismatch"] = "none"
    except Exception as e:  # noqa: BLE001 - what each rank saw
        out["mismatch"] = f"{type(e).__name__}: {e}"[:400]

    # The last rank's own call is wrong: split sizes that do not cover its input, then
    # one block too few in the list form. torch's split (or a local check) would fail
    # that rank alone and leave the others waiting for it: every rank fails with a
    # MismatchError, and the group goes on.
    def wrong(call):
        try:
            call()
            return "none"
        except Exception as e:  # noqa: BLE001 - what each rank saw
            return f"{type(e).__name__}: {e}"[:300]
    splits = [4] * n
    if r == n - 1:
        splits[0] = 3
    out["wrong_splits"] = wrong(lambda: dist.all_to_all_single(
        torch.empty(4 * n), torch.ones(4 * n), [4] * n, splits))
    blocks = [torch.ones(4) for _ in range(n - 1 if r == n - 1 else n)]
    out["wrong_blocks"] = wrong(lambda: dist.all_to_all([torch.empty(4) for _ in range(n)], blocks))
    # A root whose blocks do not fit (a block too few for scatter, one of another size
    # for gather): every rank fails with a typed error, none waits for the root.
    bad = r == n - 1
    root_blocks = [torch.ones(4) for _ in range(n - 1)] if r == 0 else None
    out["wrong_scatter"] = wrong(lambda: dist.scatter(torch.empty(4), root_blocks, src=0))
    root_outs = [torch.empty(4) for _ in range(n - 1)] + [torch.empty(5)] if r == 0 else None
    out["wrong_gather"] = wrong(lambda: dist.gather(torch.ones(4), root_outs, dst=0))
    # The last rank's list forms whose blocks do not fit its tensor.
    gather_outs = [torch.empty(3 if bad and i == 0 else 4) for i in range(n)]
    out["wrong_all_gather"] = wrong(lambda: dist.all_gather(gather_outs, torch.ones(4)))
    rs_ins = [torch.ones(4) for _ in range(n - 1 if bad else n)]
    out["wrong_reduce_scatter"] = wrong(lambda: dist.reduce_scatter(torch.empty(4), rs_ins))
    done = torch.ones(1)
    dist.all_reduce(done)
    out["after"] = done.item()
    return out


def strided(r, n):
    """Outputs that are not contiguous (every second element of a tensor twice as long),
    written where they lie; and the split all_to_all_single's future, which holds the
    output. (gloo writes such outputs wrongly: the test checks formulas.)"""
    def every_second(k):
        return torch.full((2 * k,), -1.0)[::2]
    out = {}
    o = every_second(2)
    dist.reduce_scatter(o, [torch.full((2,), float(i + r)) for i in range(n)])
    out["reduce_scatter"] = o.tolist()
    ts = [torch.full((2,), float(10 * i + r)) for i in range(n)]
    dist.reduce_scatter(ts[r], ts)         # the output is this rank's own input block
    out["reduce_scatter_own"] = [t.tolist() for t in ts]
    o = every_second(2)
    dist.scatter(o, [torch.full((2,), 5.0 + i) for i in range(n)] if r == 0 else None, src=0)
    out["scatter"] = o.tolist()
    o = every_second(n)
    dist.all_to_all_single(o, torch.arange(float(n)) + 10 * r)
    out["all_to_all_single"] = o.tolist()
    o = every_second(n)
    fut = dist.all_to_all_single(o, torch.arange(float(n)) + 10 * r, [1] * n, [1] * n,
                                 async_op=True).get_future()
    got = fut.wait()
    out["all_to_all_single_splits"] = o.tolist()
    out["future"] = [len(got), got[0].data_ptr() == o.data_ptr()]
    o = every_second(2 * n)
    dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
    out["all_gather_into_tensor"] = o.tolist()
    o = every_second(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + r)
    out["reduce_scatter_tensor"] = o.tolist()
    return out


def main():
    backend, what = sys.argv[1], sys.argv[2]
    if os.environ.get("ECCL_TEST_DEVICE") == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.set_default_device("cuda")
    expandable = (os.environ.get("ECCL_TEST_DEVICE") == "cuda"
                  and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower())
    if expandable:
        # The test of memory that CUDA IPC cannot export holds only if torch's allocator
        # really made expandable segments in this process (the variable is read once).
        probe = torch.empty(1 << 20, device="cuda")
        segments = torch.cuda.memory._snapshot()["segments"]
        assert any(s.get("is_expandable") for s in segments), \
            f"PYTORCH_CUDA_ALLOC_CONF did not take effect: {[sorted(s) for s in segments[:1]]}"
        del probe
    dist.init_process_group(backend)
    r, n = dist.get_rank(), dist.get_world_size()
    if backend == "eccl" and os.environ.get("TEST_OPTIMIZE_TOPOLOGY"):
        # The backend's optimize_topology(): the collectives below then run on the ring
        # the master solved, and must still give gloo's results.
        pg = dist.distributed_c10d._get_default_group()
        if not isinstance(pg, eccl.torch.ProcessGroupEccl):
            pg = pg._get_backend(torch.device("cpu"))  # torch 2.12+: the group wraps it
        topology = pg.optimize_topology()
    res = {"collectives": collectives, "coverage": coverage, "mixed": mixed,
           "big_uneven": big_uneven, "p2p_mismatch": p2p_mismatch, "strided": strided}.get(
        what, lambda r, n: ddp(r, n, 10))(r, n)
    if backend == "eccl" and os.environ.get("TEST_OPTIMIZE_TOPOLOGY"):
        res["_topology"] = {"ring": topology["ring"], "rank": dist.get_rank()}
    if expandable:
        res["_expandable_segments"] = True
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
