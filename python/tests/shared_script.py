"""One rank of the shared-memory collective checks (run by test_torch_window.py): the
communicator's all_gather_shared / reduce_scatter_shared and the torch backend's
all_gather_into_tensor / reduce_scatter_tensor on tensors from `allocate_tensor`, on
plain tensors, and on a mix; prints what each returned and whether it was right, as
JSON after "RESULT "."""

import json

import eccl
import eccl.torch  # noqa: F401  registers "eccl"
import torch
import torch.distributed as dist


def main():
    dist.init_process_group("eccl")
    r, n = dist.get_rank(), dist.get_world_size()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    comm = backend.comm

    def shared(k, dtype=torch.float32):
        return backend.allocate_tensor(k, dtype=dtype, device=torch.device("cpu"))

    m = 1 << 18      # elements per rank's block: 1 MiB, so torch's calls take the way too
    mine = (torch.arange(m, dtype=torch.float32) + r * m) / 8.0
    whole = torch.cat([(torch.arange(m, dtype=torch.float32) + q * m) / 8.0 for q in range(n)])
    out = {}

    def gather(name, output, input):
        direct = comm.all_gather_shared(output, input)
        out[name] = [bool(direct), bool(torch.equal(output, whole))]

    o = shared(n * m)
    i = shared(m)
    i.copy_(mine)
    gather("shared", o, i)
    o = shared(n * m)
    o[r * m:(r + 1) * m] = mine
    gather("shared_in_place", o, None)
    gather("plain", torch.zeros(n * m), mine.clone())
    gather("mixed", shared(n * m) if r == 0 else torch.zeros(n * m),
           (shared(m).copy_(mine)) if r == 0 else mine.clone())

    # reduce_scatter: rank q's input is q + 1 times the whole; sums exact in any order.
    for opname, op, expect in [("sum", "sum", sum(range(1, n + 1))), ("max", "max", n),
                               ("avg", "avg", sum(range(1, n + 1)) / n)]:
        inp = shared(n * m)
        inp.copy_(whole * (r + 1))
        res = shared(m)
        direct = comm.reduce_scatter_shared(res, inp, op)
        want = whole[r * m:(r + 1) * m] * expect
        out[f"rs_{opname}"] = [bool(direct), bool(torch.allclose(res, want, rtol=0, atol=0))]
    res = torch.zeros(m)
    direct = comm.reduce_scatter_shared(res, (whole * (r + 1)).clone(), "sum")
    out["rs_plain"] = [bool(direct),
                       bool(torch.equal(res, whole[r * m:(r + 1) * m] * sum(range(1, n + 1))))]

    # Calls that are wrong: the same error on every rank (no rank left waiting), and the
    # group goes on after update_topology().
    def wrong(name, call):
        try:
            call()
            out[name] = None
        except eccl.EcclError as e:
            out[name] = type(e).__name__
            comm.update_topology()
    wrong("mismatch", lambda: comm.all_gather_shared(shared(n * (m + r)), None))
    wrong("op_mismatch", lambda: comm.reduce_scatter_shared(
        shared(m), shared(n * m), "sum" if r == 0 else "max"))
    wrong("bad_on_one_rank", lambda: comm.all_gather_shared(
        shared(n * m + (1 if r == 0 else 0)), None))
    wrong("avg_of_ints", lambda: comm.reduce_scatter_shared(
        shared(m, torch.int32), shared(n * m, torch.int32), "avg"))
    wrong("kind_mismatch", lambda: (comm.all_gather_shared(shared(n * m), shared(m))
                                    if r == 0 else
                                    comm.reduce_scatter_shared(shared(m), shared(n * m))))

    # The torch backend's calls take the shared way: what the communicator's calls said,
    # seen through a stand-in that keeps their Works.
    class Seen:
        def __init__(self, inner):
            self.inner, self.works = inner, []

        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            if name.endswith("_shared"):
                def call(*a, **k):
                    w = attr(*a, **k)
                    self.works.append(w)
                    return w
                return call
            return attr
    seen = Seen(comm)
    backend.comm = seen

    # Through torch: FSDP2's calls on its buffers (in place), and reduce_scatter_tensor.
    o = shared(n * m)
    o[r * m:(r + 1) * m] = mine
    dist.all_gather_into_tensor(o, o[r * m:(r + 1) * m])
    out["torch_all_gather"] = bool(torch.equal(o, whole))
    inp = shared(n * m)
    inp.copy_(whole * (r + 1))
    res = torch.empty(m)
    dist.reduce_scatter_tensor(res, inp)
    out["torch_reduce_scatter"] = bool(
        torch.equal(res, whole[r * m:(r + 1) * m] * sum(range(1, n + 1))))
    # PREMUL_SUM (FSDP2's with a divide factor) on a shared input stays shared.
    dist.reduce_scatter_tensor(res, inp, op=dist._make_nccl_premul_sum(0.5))
    out["torch_premul"] = bool(
        torch.equal(res, whole[r * m:(r + 1) * m] * 0.5 * sum(range(1, n + 1))))
    out["torch_direct"] = [bool(w.wait()) for w in seen.works]
    backend.comm = comm
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
