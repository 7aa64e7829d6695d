"""The `torch.distributed` backend "eccl" (importing this module registers it).

    import torch.distributed as dist, eccl.torch
    dist.init_process_group("eccl")          # under torchrun, or with rank/world_size/store

The eccl master runs inside rank 0 unless `ECCL_MASTER` names one; its address reaches
the other ranks through torch's rendezvous store. When `ECCL_SECRET`/`ECCL_SECRET_FILE`
are not set, rank 0's fresh job secret goes through the store too, sealed to each rank
(see `_share_secret`): a store reader learns nothing; a store writer can pose as a rank,
and when it does so visibly (a rank finds its key taken) every rank stops. Every
collective torch.distributed offers runs on eccl, for CPU tensors and for CUDA tensors
(`eccl.torch_cuda`: all_reduce over CUDA IPC among ranks of one host, everything else
staged through host memory).
"""

from __future__ import annotations

import array
import functools
import logging
import os
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.overrides import has_torch_function

import eccl
from eccl import torch_window
from eccl.torch_blocks import adjacent, clear_of, landing, read_blocks, separate, written_blocks
from eccl.torch_checks import a2a_refusal, blocks_refusal, join_and_raise, split_refusal, split_rows
from eccl.torch_cuda import all_reduce_ipc, copy_back, cuda_calls
from eccl.torch_fault import EcclGroup, FaultTolerance, ReconfigurableGroup
from eccl.torch_recovery import Recovery, recovering_calls
from eccl.torch_setup import (
    _check_no_conflict,
    _fresh_store,
    _share_secret,
    _store_get,
    monitored_barrier,
)
from eccl.torch_work import TorchWork, _Calls

log = logging.getLogger("eccl.torch")

__all__ = ["ProcessGroupEccl", "TorchWork", "BACKEND", "ElasticDDP", "DiLoCo",
           "init_optimizer_state", "register"]

BACKEND = "eccl"

# torch's ReduceOp members -> eccl's, from eccl's one table of operators.
_OPS = [(getattr(dist.ReduceOp, torch_name), op)
        for op, torch_name in eccl.TORCH_OP_NAMES.items()
        if hasattr(dist.ReduceOp, torch_name)]


# all_gather_into_tensor and reduce_scatter_tensor of this many bytes or more read the
# other ranks' memory directly where every rank's buffer lies in eccl's shared memory
# (three small exchanges decide and end it: below this size they cost about what they
# save, with four ranks on two cores; docs/measurements.md "Collectives on shared
# tensors").
SHARED_FROM = 1 << 20


_PREMUL_SUM = getattr(dist.ReduceOp, "PREMUL_SUM", None)


def _op_name(opts: Any) -> "eccl.ReduceOp":
    op = getattr(opts, "reduceOp", opts)
    for k, v in _OPS:
        if op == k:
            return v
    raise eccl.InvalidArgumentError(f"reduce op {op} is not supported by eccl")


def _run_all(steps: list) -> Any:
    """One copy-out step that runs each of `steps`; None where there is none."""
    if not steps:
        return None

    def run() -> None:
        for step in steps:
            step()
    return run


def _op_and_factor(opts: Any) -> "tuple[eccl.ReduceOp, Any]":
    """The eccl op of a call's options, and the factor of torch's PREMUL_SUM (NCCL's
    `ncclRedOpCreatePreMulSum`: every rank's input times the factor, then a sum; what
    FSDP2 asks for with a gradient divide factor), else None. The caller multiplies."""
    if opts is None:
        return eccl.ReduceOp.SUM, None
    op = getattr(opts, "reduceOp", opts)
    if _PREMUL_SUM is not None and op == _PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise eccl.InvalidArgumentError("a PREMUL_SUM without its factor")
        return eccl.ReduceOp.SUM, factor
    return _op_name(opts), None


def _premultiplied(t: torch.Tensor, factor: Any, in_place: bool) -> torch.Tensor:
    """`t` times `factor` (a number or a one-element tensor): in `t` itself for torch's
    in-place calls (whose tensors are undefined after a failure anyway), else a copy."""
    if factor is None:
        return t
    if not (t.is_floating_point() or t.is_complex()):
        raise eccl.InvalidArgumentError(
            f"PREMUL_SUM scales its inputs: a {t.dtype} tensor cannot be (as NCCL's, it "
            f"takes floating types)")
    f = (factor.to(device=t.device).reshape(()) if isinstance(factor, torch.Tensor)
         else factor)
    if in_place:
        return t.mul_(f)
    # A copy in shared memory where the input was there, so that a reduce-scatter of
    # FSDP2's buffers still reads the ranks' memory directly.
    shared = t.is_cpu and torch_window.region_of(t) is not None
    out = (torch_window.allocate(t.numel(), t.dtype).view(t.shape) if shared
           else torch.empty_like(t))
    return torch.mul(t, f, out=out)


def _own_slot(whole: "torch.Tensor", part: "torch.Tensor", rank: int) -> bool:
    """Whether `part` is `whole`'s `rank`-th of `whole.numel() // part.numel()` equal
    slices, in the same memory: NCCL's in-place convention for all_gather_into_tensor
    (the input in the output) and reduce_scatter_tensor (the output in the input)."""
    n = part.numel()
    return (n > 0 and part.dtype == whole.dtype and part.device == whole.device
            and part.is_contiguous() and whole.is_contiguous() and whole.numel() % n == 0
            and part.data_ptr() == whole.data_ptr() + rank * n * part.element_size())


def _input_of(output: "torch.Tensor", input: "torch.Tensor", rank: int) -> "torch.Tensor":
    """An all-gather's input as the call reads it: a copy where it is the output's own
    slice (NCCL's in-place form), else the tensor itself."""
    if _own_slot(output, input, rank):
        return _cpu(input).clone()
    return _cpu(input).contiguous()



def _cpu(t: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    # CUDA tensors reach the calls as host copies (`eccl.torch_cuda`); other devices
    # are refused.
    if not t.is_cpu:
        raise eccl.InvalidArgumentError(
            f"{what} is on {t.device}: the eccl backend moves CPU and CUDA tensors")
    return t


def _backend_base() -> type:
    """The class a Python backend derives from: torch's c10d `Backend` where Python can
    construct one (torch 2.12 and later), else `ProcessGroup` (torch 2.11 and earlier
    take a Python backend as a whole process group)."""
    class _Probe(_C10dBackend):
        pass
    try:
        _Probe(0, 1)
        return _C10dBackend
    except TypeError:
        return dist.ProcessGroup


_Base = _backend_base()


@recovering_calls(_Base)
@cuda_calls
class ProcessGroupEccl(FaultTolerance, _Base):
    """torch's c10d `Backend` for the device type "cpu" whose collectives run on an
    `eccl.Communicator` (as ProcessGroupGloo is gloo's). torch wraps it in a
    ProcessGroup and registers it for its devices, so everything torch does with a
    group's backend (group names, `destroy_process_group(g)`, `monitored_barrier`'s
    device check, `_get_backend`, the reconfigure hooks) finds it. Every call it defines
    first goes through its `Recovery` (`eccl.torch_recovery`)."""

    def __init__(self, comm: eccl.Communicator, master: Optional[eccl.Master] = None,
                 timeout: timedelta = timedelta(minutes=30), store: Any = None,
                 rank: Optional[int] = None, size: Optional[int] = None,
                 unformed: bool = False):
        rank = comm.rank if rank is None else rank
        size = comm.world_size if size is None else size
        super().__init__(rank, size)
        # The epoch's state: rank and size, what the next call must recover, the abort
        # hooks, the last failure.
        # `unformed`: a reconfigurable group with no world before its first reconfigure.
        self._recovery = Recovery(comm, rank, size, unformed=unformed, reconfigurable=unformed)
        self._handed_over = False
        self._timeout = timeout
        self._options = _C10dBackend.Options(BACKEND, timeout)
        self._store = store
        self._barriers = 0
        self.comm = comm
        self._master = master
        # The processes of the job this group's master serves (its size at init): the
        # rank hosting the master keeps it until all of them have come and gone.
        self._job_size = size
        self._calls = _Calls(self._recovery)
        self._closed = False

    @property
    def options(self):
        """The backend's options as torch reads them (a property, as gloo's is): its
        timeout, group name and global ranks (`split_group` starts from them)."""
        return self._options

    if _Base is dist.ProcessGroup:
        # torch 2.11 and earlier keep a group's name in its registered backends, and a
        # Python backend is the process group itself with none registered: `group_name`
        # would raise "ProcessGroup name not set" (DeviceMesh, and with it FSDP2 and
        # DTensor, reads it). The group keeps the name torch gives it instead.
        @property
        def group_name(self) -> str:
            return self._options.group_name

        def _set_group_name(self, name: str) -> None:
            self._options.group_name = name

    def _named(self, name: str, global_ranks) -> "ProcessGroupEccl":
        self._options.group_name = name
        self._options.global_ranks_in_group = list(global_ranks)
        return self

    def _global_ranks(self, ranks) -> list:
        """The global ranks of this group's `ranks`."""
        mine = list(self._options.global_ranks_in_group) or list(range(self.size()))
        return [mine[r] for r in ranks]

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def __repr__(self) -> str:
        r = self._recovery
        return f"ProcessGroupEccl(rank={r.rank}, size={r.size}, epoch={self.comm.epoch})"

    # Each method returns a Work whose future completes with what torch expects.

    # torch's in-place collectives leave their tensors undefined when they fail (as
    # NCCL's and gloo's do; DDP drops a failed step's gradients): eccl works in the
    # tensor itself where the schedule allows, with no copy of it (`keep_on_abort`).
    def allreduce(self, tensors, opts=None):
        op, factor = _op_and_factor(opts)
        ws = [self.comm.all_reduce(_premultiplied(_cpu(t), factor, True), op, async_op=True,
                                   keep_on_abort=False)
              for t in tensors]
        return self._calls.submit(ws, tensors)

    def _all_reduce_cuda(self, tensors, opts=None):
        """all_reduce of CUDA tensors: eccl's device call, over CUDA IPC GPU to GPU where
        every rank runs on this host, through host memory in pipelined chunks otherwise
        (`eccl.torch_cuda`). A non-contiguous tensor goes through a contiguous copy (on
        its stream, which the call waits for), copied back when the call is done."""
        op, factor = _op_and_factor(opts)
        # The multiplication runs on the tensors' stream, which the call waits for.
        tensors = [_premultiplied(t, factor, True) for t in tensors]
        flat = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        pairs = [(t, f) for t, f in zip(tensors, flat) if f is not t]
        return self._calls.submit(all_reduce_ipc(self.comm, flat, op), tensors,
                                  functools.partial(copy_back, pairs) if pairs else None)

    def allreduce_coalesced(self, tensors, opts=None):
        # One collective over the list (eccl packs it into one buffer), as gloo does.
        op, factor = _op_and_factor(opts)
        w = self.comm.all_reduce_coalesced(
            [_premultiplied(_cpu(t), factor, True) for t in tensors], op, async_op=True)
        return self._calls.submit([w], tensors)

    def broadcast(self, tensors, opts):
        ws = [self.comm.broadcast(_cpu(t), opts.rootRank, async_op=True, keep_on_abort=False)
              for t in tensors]
        return self._calls.submit(ws, tensors)

    def reduce(self, tensors, opts):
        op, factor = _op_and_factor(opts)
        # PREMUL_SUM: the root's tensor is the result, scaled in place; every other
        # rank's stays as it was (as NCCL leaves it), so theirs is scaled in a copy.
        root = self.rank() == opts.rootRank
        ws = [self.comm.reduce(_premultiplied(_cpu(t), factor, root), opts.rootRank, op,
                               async_op=True, keep_on_abort=False)
              for t in tensors]
        return self._calls.submit(ws, tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        # The caller's tensors written where they are (one tensor cut in blocks, or
        # separate ones); else one flat buffer per input, split into the list afterwards.
        works, copies = [], []
        for outs, inp in zip(output_tensors, input_tensors):
            inp = _cpu(inp).contiguous()
            refusal = blocks_refusal(list(outs), inp, self.size())
            if refusal is not None:
                wrong = torch.empty(inp.numel() * self.size() + 1, dtype=inp.dtype)
                return self._refuse("all_gather", "output", refusal,
                                    lambda: self.comm.all_gather(wrong, inp, async_op=True))
            flat, inp = written_blocks(list(outs), inp)
            if flat is None:
                flat = torch.empty((len(outs),) + tuple(inp.shape), dtype=inp.dtype)
                copies.append((outs, flat))
            works.append(self.comm.all_gather(flat, inp, async_op=True))

        def scatter_back() -> None:
            for outs, flat in copies:
                for o, f in zip(outs, flat):
                    o.copy_(f.view_as(o))
        return self._calls.submit(works, output_tensors, scatter_back if copies else None)

    def _allgather_base(self, output, input, opts=None):
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        # NCCL's in-place form (FSDP2 uses it): the input is the output's slice at this
        # rank's offset. The gather reads a copy of it; any other overlap is refused.
        # From SHARED_FROM bytes on, the call reads the other ranks' memory directly
        # where every rank's source lies in eccl's shared memory (`allocate_tensor`:
        # FSDP2's buffers after set_allocate_memory_from_process_group_for_comm), in
        # place included; the sizes are the same on every rank, so is the choice.
        ws, copies = [], []
        for o, i in zip(outputs, inputs):
            o = _cpu(o)
            if o.numel() * o.element_size() >= SHARED_FROM and o.is_contiguous():
                own = _own_slot(o, i, self.rank())
                ws.append(self.comm.all_gather_shared(
                    o, None if own else _cpu(i).contiguous(), async_op=True))
            else:
                # (A non-contiguous output is gathered into a buffer of its own.)
                target, copy = landing(o)
                ws.append(self.comm.all_gather(target, _input_of(o, i, self.rank()), async_op=True))
                if copy is not None:
                    copies.append(copy)
        return self._calls.submit(ws, outputs, _run_all(copies))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op, factor = _op_and_factor(opts)
        works, copies = [], []
        for out, ins in zip(output_tensors, input_tensors):
            out = _cpu(out)
            ins = [_cpu(i) for i in ins]
            # A non-contiguous output, or one that is also an input, gets a buffer.
            target, copy = landing(out, ins)
            refusal = blocks_refusal(ins, out, self.size())
            if refusal is not None:
                wrong = torch.empty(out.numel() * self.size() + 1, dtype=out.dtype)
                return self._refuse("reduce_scatter", "input", refusal,
                                    lambda: self.comm.reduce_scatter(target, wrong, op, async_op=True))
            # (Separate tensors only without PREMUL_SUM, which scales a copy.)
            flat = read_blocks(ins, target, as_list=factor is None)
            flat = (_premultiplied(torch.stack([i.reshape(out.shape) for i in ins]).contiguous(), factor, True)
                    if flat is None else _premultiplied(flat, factor, False))
            works.append(self.comm.reduce_scatter(target, flat, op, async_op=True))
            if copy is not None:
                copies.append(copy)
        return self._calls.submit(works, output_tensors, _run_all(copies))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op, factor = _op_and_factor(opts)
        ws, results = [], []
        for o, i in zip(outputs, inputs):
            i = _cpu(i).contiguous()
            # NCCL's in-place form: the output is the input's slice at this rank's
            # offset. The result goes to a buffer of its own and into the output once the
            # call has succeeded (a failed call leaves both as they were); any other
            # overlap is refused.
            # (So does a non-contiguous output.)
            target = (torch.empty(o.shape, dtype=o.dtype)
                      if _own_slot(i, o, self.rank()) or not o.is_contiguous() else o)
            i = _premultiplied(i, factor, False)
            if i.numel() * i.element_size() >= SHARED_FROM and target.is_contiguous():
                # Read straight from every rank's input where all lie in eccl's shared
                # memory (see allgather_into_tensor_coalesced).
                ws.append(self.comm.reduce_scatter_shared(_cpu(target), i, op, async_op=True))
            else:
                ws.append(self.comm.reduce_scatter(_cpu(target), i, op, async_op=True))
            results.append((o, target))

        def into_outputs() -> None:
            for o, target in results:
                if target is not o:
                    o.copy_(target)
        return self._calls.submit(ws, outputs, into_outputs)

    def gather(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        inp = _cpu(input_tensors[0]).contiguous()
        if self.rank() == root:
            outs = list(output_tensors[0])
            refusal = blocks_refusal(outs, inp, self.size())
            if refusal is not None:
                wrong = torch.empty(inp.numel() * self.size() + 1, dtype=inp.dtype)
                return self._refuse("gather", "the root's output", refusal,
                                    lambda: self.comm.gather(wrong, inp, root, async_op=True))
            in_place, inp = written_blocks(outs, inp)
            flat = in_place if in_place is not None else torch.empty(
                (len(outs),) + tuple(inp.shape), dtype=inp.dtype)
            w = self.comm.gather(flat, inp, root, async_op=True)

            def scatter_back() -> None:
                for o, f in zip(outs, flat.view(len(outs), -1)):
                    o.copy_(f.view_as(o))
            return self._calls.submit([w], output_tensors, None if in_place is not None else scatter_back)
        w = self.comm.gather(None, inp, root, async_op=True)
        return self._calls.submit([w], output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        out = _cpu(output_tensors[0])
        flat = None
        blocks = [_cpu(i) for i in input_tensors[0]] if self.rank() == root else []
        target, copy = landing(out, blocks)
        if self.rank() == root:
            refusal = blocks_refusal(blocks, out, self.size())
            if refusal is not None:
                wrong = torch.empty(out.numel() * self.size() + 1, dtype=out.dtype)
                return self._refuse("scatter", "the root's input", refusal,
                                    lambda: self.comm.scatter(target, wrong, root, async_op=True))
            flat = read_blocks(blocks, target)
            if flat is None:
                flat = torch.stack([b.reshape(out.shape) for b in blocks]).contiguous()
        w = self.comm.scatter(target, flat, root, async_op=True)
        return self._calls.submit([w], output_tensors, copy)

    def _refuse(self, name, which, refusal, call):
        """A call whose blocks do not fit this rank's tensor (`refusal` says how): `call`
        makes it all the same, with a buffer of a size no rank accepts, so that
        every rank fails with a typed error (the others a MismatchError naming this one)
        and none waits for it; then this rank raises saying what was wrong."""
        join_and_raise(self._recovery, call, eccl.InvalidArgumentError(
            f"{name}: {which} blocks do not fit: {refusal}"))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins = list(output_tensors), list(input_tensors)
        refusal = a2a_refusal(outs, ins, self.size())
        flat = (adjacent(outs, *ins), adjacent(ins)) if refusal is None else None
        return self._alltoall_v(outs, ins, refusal, flat)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self.size()
        _cpu(output, "output")
        _cpu(input, "input")
        out_rows = split_rows(output, output_split_sizes, n)
        in_rows = split_rows(input, input_split_sizes, n)
        if (not output_split_sizes and not input_split_sizes and out_rows is not None
                and in_rows is not None and output.dtype == input.dtype
                and output.numel() == input.numel()):
            # No split sizes: eccl's even all_to_all, whose frames carry the block size,
            # so a rank whose size differs fails every rank that exchanges with it, with
            # no round of sizes first. (Every rank must then pass no split sizes: one that
            # passes them, equal or not, takes the sizes' round, and the two fail with a
            # MismatchError.) In place it receives into a buffer of its own, copied
            # out once the call has succeeded (it reads what it sends, and G2: a failed
            # call leaves the tensor as it was).
            input = input.contiguous()
            target, copy = landing(output, [input])
            return self._calls.submit([self.comm.all_to_all(target, input, async_op=True)], output, copy)
        if out_rows is None:
            return self._alltoall_v([], [], split_refusal("output", output, output_split_sizes, n))
        if in_rows is None:
            return self._alltoall_v([], [], split_refusal("input", input, input_split_sizes, n))
        if output.dtype == input.dtype and output.is_contiguous() and input.is_contiguous():
            # The common case, one contiguous tensor each way: the call as it is, its
            # counts from the rows (in place, as the even call above).
            per_out = output.numel() // output.shape[0] if output.shape[0] else 0
            per_in = input.numel() // input.shape[0] if input.shape[0] else 0
            send, recv = [k * per_in for k in in_rows], [k * per_out for k in out_rows]
            if not self._sizes_agree(send, recv):
                return self._calls.submit([], output)
            target, copy = landing(output, [input])
            w = self.comm.all_to_all(target, input, send_counts=send, recv_counts=recv, async_op=True)
            return self._calls.submit([w], output, copy)
        outs, ins = list(output.split(out_rows)), list(input.split(in_rows))
        return self._alltoall_v(outs, ins, a2a_refusal(outs, ins, n), (output, input), [output])

    def _sizes_agree(self, send: list, recv: list, refusal: Optional[str] = None) -> bool:
        """Every rank's block sizes, in one small all_gather before anything moves, so
        that sizes that disagree are the same `MismatchError` on every rank (the
        all_to_all's pairs check their own two blocks, but a rank outside a pair that
        disagrees would finish its call and fail only its next one). A rank whose own
        call is wrong (`refusal`) takes part with a row that says so, and raises saying
        what: every rank fails with a `MismatchError` naming it, where a local error on
        that rank alone would leave the others waiting. Returns whether anything moves."""
        n = self.size()
        # Plain buffers and lists: each torch op here cost microseconds a call.
        row = array.array("q", send + recv if refusal is None else [-1] * (2 * n))
        table = array.array("q", bytes(8 * 2 * n * n))
        if refusal is not None:
            # (Every form of all_to_all with split sizes, and every list form, makes this
            # round first, so the others are in it; an all_to_all_single without split
            # sizes does not, and meets this rank's round as a MismatchError.)
            join_and_raise(self._recovery, lambda: self.comm.all_gather(table, row, async_op=True),
                           eccl.MismatchError(f"all_to_all: this rank ({self.rank()}) cannot take part: {refusal}"))
        try:
            self.comm.all_gather(table, row)
        except eccl.EcclError as e:
            self._recovery.failed(e, "collective")    # as a failed Work would
            raise
        flat = table.tolist()
        rows = [flat[2 * n * s:2 * n * (s + 1)] for s in range(n)]
        sent = [tuple(r[:n]) for r in rows]                 # sent[s][t]: s sends t
        expected = list(zip(*[r[n:] for r in rows]))        # expected[s][t]: t expects from s
        if sent == expected and min(flat) >= 0:
            return any(map(any, sent))
        for s in range(n):
            if rows[s][0] < 0:
                raise eccl.MismatchError(
                    f"all_to_all: rank {s}'s call is wrong (its split sizes or blocks do not fit "
                    "its tensors, or its dtypes differ; its own error says which)")
        for s in range(n):
            for t in range(n):
                if rows[s][t] != rows[t][n + s]:
                    raise eccl.MismatchError(
                        f"all_to_all: rank {s} sends {rows[s][t]} elements to rank {t}, which "
                        f"expects {rows[t][n + s]} from it")
        raise AssertionError("unreachable: the sizes differ somewhere")

    def _alltoall_v(self, outs, ins, refusal=None, flat=None, result=None):
        """The list form of all_to_all, and all_to_all_single with split sizes: the
        sizes' round (`_sizes_agree`), then one eccl all_to_all with split sizes: each
        pair moves its own two blocks as they are, nothing padded, paced by the
        collective engine. Every rank takes these same two calls whatever its own
        blocks, so a rank whose blocks happen to be equal (all empty, say) and one whose
        blocks differ never take different calls. `flat`:
        the (output, input) tensors that `outs` and `ins` split (either may be None), used
        in place where they are contiguous and apart; separate tensors are passed as
        they are. A rank whose own call is wrong (`refusal`: split sizes that do not
        cover its tensor, another number of blocks than ranks, dtypes that differ)
        raises in the sizes' round, as every other rank does. `result`: what the
        Work's future holds (all_to_all_single's: its output), else `outs`."""
        result = outs if result is None else result
        send = [b.numel() for b in ins]
        recv = [o.numel() for o in outs]
        if not self._sizes_agree(send, recv, refusal):
            return self._calls.submit([], result)
        dtype = ins[0].dtype
        out, flat_in = flat if flat is not None else (None, None)
        out = out if out is not None and out.is_contiguous() else None
        # What is sent: the blocks where they lie (one tensor, or separate ones).
        src = ([flat_in] if flat_in is not None and flat_in.is_contiguous()
               else separate([_cpu(b) for b in ins], dtype, written=False))
        writes = [out] if out is not None else [o for o in outs if o.is_contiguous()]
        # In place: the output may be the input.
        in_place = not clear_of(writes, src if src is not None else ins)
        if src is None:
            src = [torch.cat([b.reshape(-1) for b in ins])]
        # The blocks land where they are: in the output where it is one tensor
        # (all_to_all_single), or in the list's tensors; else in one buffer of their own,
        # copied out once the call has succeeded. In place (`all_to_all(ts, ts)`), that
        # one copy both lets the call read what it sends and keeps G2: a failed call
        # leaves its tensors as they were.
        dst = None if in_place else [out] if out is not None else separate(outs, dtype, src)
        flat_out = dst if dst is not None else torch.empty(sum(recv), dtype=dtype)
        w = self.comm.all_to_all(flat_out, src, send_counts=send, recv_counts=recv,
                                 async_op=True)

        def copy_back() -> None:
            for o, f in zip(outs, flat_out.split(recv)):
                o.copy_(f.view(o.shape))
        return self._calls.submit([w], result, None if dst is not None else copy_back)

    def barrier(self, opts=None):
        return self._calls.submit([self.comm.barrier(async_op=True)], None)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """gloo's monitored barrier (see `eccl.torch_setup.monitored_barrier`)."""
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the group's store")
        self._barriers += 1
        timeout = getattr(opts, "timeout", None) or self._timeout
        monitored_barrier(self._store, f"eccl/monitored_barrier/{self._barriers}/",
                          self.rank(), self.size(), timeout, wait_all_ranks)

    # A receive that times out fails on its rank alone (eccl's p2p timeouts are local),
    # so it leaves the epoch as it was: `p2p=True`.
    def send(self, tensors, dstRank, tag):  # noqa: N803 - torch's names
        ws = [self.comm.send(_cpu(t).contiguous(), dstRank, tag, async_op=True) for t in tensors]
        return self._calls.submit(ws, tensors, kind="p2p")

    def recv(self, tensors, srcRank, tag):  # noqa: N803
        ws = [self.comm.recv(_cpu(t), srcRank, tag, async_op=True) for t in tensors]
        return self._calls.submit(ws, tensors, kind="p2p")

    def recv_anysource(self, tensors, tag):
        """`dist.recv(t)` / `dist.irecv(t)` with no `src`: the first message with `tag`
        from any rank; the Work's `source_rank()` names the sender."""
        ws = [self.comm.recv(_cpu(t), None, tag, async_op=True) for t in tensors]
        return self._calls.submit(ws, tensors, kind="p2p")

    # torch 2.15 renamed the single-tensor forms; both names work.
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's inputs[i]. One collective:
        # the inputs travel as one flat buffer per rank.
        n = self.size()
        inputs = [_cpu(t) for t in inputs]
        if len(output_lists) != n:
            raise eccl.InvalidArgumentError(
                f"all_gather_coalesced: {len(output_lists)} output lists for {n} ranks")
        dtypes = {t.dtype for t in inputs}
        if len(dtypes) > 1:
            raise eccl.InvalidArgumentError(
                f"all_gather_coalesced: inputs of several dtypes {sorted(map(str, dtypes))}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(inputs) or any(
                    o.numel() != i.numel() or o.dtype != i.dtype for o, i in zip(outs, inputs)):
                raise eccl.InvalidArgumentError(
                    f"all_gather_coalesced: output_lists[{r}] must match the inputs "
                    f"({[tuple(i.shape) for i in inputs]}, {inputs[0].dtype if inputs else None})")
        flat_in = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
        flat_out = torch.empty((n, flat_in.numel()), dtype=flat_in.dtype)
        w = self.comm.all_gather(flat_out, flat_in, async_op=True)

        def scatter_back() -> None:
            for r, outs in enumerate(output_lists):
                off = 0
                for o in outs:
                    o.copy_(flat_out[r, off:off + o.numel()].view_as(o))
                    off += o.numel()
        return self._calls.submit([w], output_lists, scatter_back)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def gather_single(self, output, input, opts):
        root = opts.rootRank
        w = self.comm.gather(_cpu(output) if self.rank() == root else None,
                             _cpu(input).contiguous(), root, async_op=True)
        return self._calls.submit([w], output)

    def optimize_topology(self) -> dict:
        """Measures this group's links and has the master solve its ring order (see
        `eccl.Communicator.optimize_topology`); every rank of the group calls it, between
        collectives. Ranks stay as they are; all_reduce follows the new ring from the
        next call. `ECCL_TOPOLOGY=optimize` does this whenever the world changes."""
        return self.comm.optimize_topology()

    @property
    def supports_splitting(self) -> bool:
        return True

    def split(self, store, ranks, opts):
        """`dist.split_group`: this rank's part of the split (`ranks`: its members' ranks
        in this group) as a backend of its own, with its own master in its first member,
        met through `store` under the new group's name."""
        ranks = sorted(ranks)
        if self.rank() not in ranks:
            return None
        timeout = getattr(opts, "_timeout", None) or self._timeout
        name = getattr(opts, "group_name", "") or "-".join(map(str, ranks))
        sub = dist.PrefixStore(f"split/{name}/", store)
        pg = _connect(sub, ranks.index(self.rank()), len(ranks), timeout, default_group=False)
        return pg._named(name, self._global_ranks(ranks))

    @property
    def supports_shrinking(self) -> bool:
        return True

    def shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
        """`dist.shrink_group(ranks_to_exclude)`: the remaining ranks form the smaller
        group through the master in one step, each with `update_topology()` on the
        same communicator (survivors keep their relative order, which is torch's rank
        order for the shrunk group), with no handles to exchange. The excluded ranks
        must be gone (torch tells them to terminate): the master drops a dead rank at
        once and a hung one when its lease runs out. With SHRINK_ABORT, calls in flight
        here fail first. Returns the new group's backend; this one hands it the
        communicator (and the master it hosts) and no longer leaves the job."""
        excluded = set(int(r) for r in ranks_to_exclude)
        expected = self.size() - len(excluded)
        if shrink_flags & getattr(dist, "SHRINK_ABORT", 1):
            self.abort()
        w = self.comm.update_topology()
        if w.world_size != expected:
            raise eccl.AbortedError(
                f"shrink_group: excluding ranks {sorted(excluded)} of {self.size()} should "
                f"leave {expected}, but the master's next world has {w.world_size} members "
                "(an excluded rank is still alive and in the job: terminate it first)")
        new = ProcessGroupEccl(self.comm, self._master, self._timeout, self._store,
                               rank=w.rank, size=w.world_size)
        new._recovery.hooks = dict(self._recovery.hooks)
        new._job_size = self._job_size
        remaining = [r for r in range(self.size()) if r not in excluded]
        new._named(self._options.group_name, self._global_ranks(remaining))
        self._master = None
        self._handed_over = True
        return new

    def _linger(self) -> None:
        """Keeps the master this rank hosts until every other process of the job has
        registered with it and left, or lost its lease: their calls need it, and the
        ranks of a reconfigurable group finish when they finish (one left out of the last
        world may be done long before the others). One that never registers is waited for
        as long as torch's timeout allows, at most a minute; no wait is longer than the
        timeout."""
        start = time.monotonic()
        limit = self._timeout.total_seconds()
        said = False
        while True:
            seen, live = self._master.peer_counts()
            if live == 0 and seen >= self._job_size:
                return
            waited = time.monotonic() - start
            if waited > limit or (seen < self._job_size and waited > min(limit, 60.0)):
                log.info("eccl: stopping this rank's master with %d of the job's %d "
                         "processes seen and %d still live", seen, self._job_size, live)
                return
            if not said and waited > 10.0:
                # Unusual enough to say without ECCL_DEBUG: the process does not exit.
                said = True
                log.warning("eccl: this rank hosts the group's master; keeping it until the "
                            "job's other processes have left (%d of %d seen, %d live; at "
                            "most torch's timeout, %.0f s)", seen, self._job_size, live, limit)
            time.sleep(0.02)

    # -- shared memory: allocate_tensor and one-sided windows (eccl.torch_window) ------

    def supports_tensor_alloc(self, device: Any) -> bool:
        """Whether `allocate_tensor` places tensors of `device` (CPU ones: in host memory
        the host's ranks share)."""
        if isinstance(device, int):  # torch's C++ side asks by device index only
            return False
        return torch.device(device).type == "cpu"

    def allocate_tensor(self, size: int, *, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """An uninitialized 1-D tensor of `size` elements in host shared memory (FSDP2 asks for
        its communication buffers here after `set_allocate_memory_from_process_group`;
        windows need their tensors from here)."""
        if torch.device(device).type != "cpu":
            raise eccl.InvalidArgumentError(
                f"allocate_tensor: eccl places CPU tensors only, not {device}")
        return torch_window.allocate(size, dtype)

    @property
    def supports_window(self) -> bool:
        return True

    def new_window(self, tensor: Optional[torch.Tensor] = None) -> Any:
        """A one-sided window over the ranks' CPU tensors (collective; see
        `eccl.torch_window`), with `tensor` registered if given: ranks of one host write
        each other's tensors directly where they come from `allocate_tensor`, others go
        over the links."""
        self._windows_made = getattr(self, "_windows_made", 0) + 1
        return torch_window.new_window(self, tensor, self._windows_made)

    def shutdown(self, wait: bool = True) -> None:
        """`destroy_process_group()` calls this: leave the job on purpose, so that the
        others' calls still in flight (a recv of what this rank sent) complete instead of
        aborting as they would for a crashed rank. torch may call it more than once.
        `wait=False`: the rank hosting the master does not wait for the others to leave
        (the job is being abandoned)."""
        if self._closed:
            return
        self._closed = True
        if self._handed_over:  # shrink_group gave the communicator to the new group
            return
        try:
            self.comm.leave()
        except eccl.EcclError:
            pass
        if self._master is not None and wait and self._job_size > 1:
            self._linger()
        if self._master is not None:
            self._master.shutdown()


# torch's Backend trampoline forwards these capability queries to Python; left to the C++
# base, each would call back into itself. These are the ones eccl does not do (yet).
for _name in ("supports_coalescing", "_supports_time_estimate"):
    setattr(ProcessGroupEccl, _name, property(lambda self: False))


def _create(opts: Any, backend_options: Any = None) -> Any:
    """The backend's constructor, as `init_process_group` and `new_group` call it
    (torch's extended form: `opts` names the group and its global ranks too). With
    `enable_reconfigure=True`, a group whose members change (no world until the first
    `dist._reconfigure`)."""
    fixed = not getattr(opts, "enable_reconfigure", False)
    pg = _connect(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                  default_group=not dist.is_initialized(), form=fixed)
    pg._named(opts.group_id, opts.global_ranks_in_group)
    if fixed:
        # torch 2.11 and earlier take a Python backend as a whole ProcessGroup already.
        return pg if _Base is dist.ProcessGroup else EcclGroup(opts.store, pg)
    return ReconfigurableGroup(opts.store, pg)


def _connect(store: Any, rank: int, world_size: int, timeout: timedelta,
             default_group: bool, form: bool = True) -> ProcessGroupEccl:
    store = _fresh_store(store, default_group)
    # ECCL_MASTER serves the default group. A group made later (`new_group`,
    # `split_group`) is a job of its own with a master in its rank 0: on a shared master
    # its members would be pending peers of the default group's world, waiting on
    # members that never vote.
    master_addr = os.environ.get("ECCL_MASTER") if default_group else None
    secret = os.environ.get("ECCL_SECRET")
    if secret is None and os.environ.get("ECCL_SECRET_FILE"):
        secret = eccl._eccl.read_secret_file(os.environ["ECCL_SECRET_FILE"])
    master = None
    fresh_secret = False
    if master_addr is None:
        # Rank 0 hosts the master and publishes where it is through the rendezvous
        # store; when no job secret was given, rank 0's fresh one goes to each rank
        # sealed to it.
        fresh = secret is None
        if rank == 0:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else "0.0.0.0"
            master = eccl.Master(f"{bind}:0", secret)
            port = master.addr.rsplit(":", 1)[1]
            store.set("eccl/master", f"{host}:{port}")
            secret = master.secret
        master_addr = _store_get(store, "eccl/master", timeout)
        if fresh:
            fresh_secret = True
            secret = _share_secret(store, rank, world_size, secret, timeout)
    # torch's timeout (init_process_group's, or a group's own) bounds every wait of
    # every call; forming the first world may take as long.
    ms = max(1, int(timeout.total_seconds() * 1000))
    comm = eccl.Communicator(master_addr, secret, rank_hint=rank, min_world=world_size,
                             timeout_ms=ms, join_timeout_ms=ms)
    if not form:
        return ProcessGroupEccl(comm, master, timeout, store, rank=rank, size=world_size,
                                unformed=True)
    topo = comm.update_topology()
    if fresh_secret:
        # A rank that found its key posed as has marked the store: then every rank
        # stops here, not only that one.
        _check_no_conflict(store)
    if topo.rank != rank or topo.world_size != world_size:
        raise eccl.EcclError(
            f"eccl formed a world where this process is rank {topo.rank} of "
            f"{topo.world_size}, but torch asked for rank {rank} of {world_size} (is "
            "another job using the same ECCL_MASTER?)")
    return ProcessGroupEccl(comm, master, timeout, store)


def _backend_of(group: Any) -> Optional[ProcessGroupEccl]:
    """The eccl backend behind `group` (None: the default group), if it has one."""
    c10d = dist.distributed_c10d
    if not dist.is_initialized() or c10d._rank_not_in_group(group):
        return None
    pg = c10d._group_or_default_group(group)
    if isinstance(pg, ProcessGroupEccl):  # torch 2.11 and earlier
        return pg
    for device in ("cpu", "cuda"):
        try:
            b = pg._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if isinstance(b, ProcessGroupEccl):
            return b
    return None


def _install_anysource_irecv() -> None:
    """torch wraps a Python backend's Work in a C++ holder that does not pass
    `source_rank()` on, so `dist.recv(t)` with no `src` could not learn the sender from
    any Python backend. For groups whose backend is eccl, `irecv` with no source hands
    back the backend's own Work (whose `_source_rank()` answers); every other call goes to
    torch's `irecv` unchanged. `dist.recv` calls `irecv` through the module, so it is
    covered too."""
    c10d = dist.distributed_c10d
    torch_irecv = c10d.irecv
    if getattr(torch_irecv, "_eccl_anysource", False):
        return

    @functools.wraps(torch_irecv)
    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        if src is None and group_src is None and not has_torch_function((tensor,)):
            backend = _backend_of(group)
            if backend is not None:
                c10d._check_single_tensor(tensor, "tensor")
                if tensor.is_complex():
                    tensor = torch.view_as_real(tensor)
                return backend.recv_anysource([tensor], tag)
        return torch_irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)

    irecv._eccl_anysource = True
    c10d.irecv = irecv
    dist.irecv = irecv


def _install_work_completion() -> None:
    """torch hands back a Python backend's Work inside a C++ holder that forwards
    `wait()` and `get_future()` but not `is_completed()` or `is_success()`, which then
    stay False for good: a loop polling `dist.all_reduce(t, async_op=True).is_completed()`
    would never end. Where torch's own answer is False, these ask the Work's future
    (which the holder does forward, and which torch's C++ backends complete at the same
    moment as their Work), so every backend's Work answers as gloo's does."""
    work_cls = dist.distributed_c10d.Work
    if getattr(work_cls.is_completed, "_eccl_future", False):
        return
    torch_completed, torch_success = work_cls.is_completed, work_cls.is_success

    def future_of(work: Any) -> Any:
        try:
            return work.get_future()
        except RuntimeError:  # a backend whose Works have no future
            return None

    @functools.wraps(torch_completed)
    def is_completed(self: Any) -> bool:
        if torch_completed(self):
            return True
        fut = future_of(self)
        return fut is not None and fut.done()

    @functools.wraps(torch_success)
    def is_success(self: Any) -> bool:
        if torch_success(self):
            return True
        fut = future_of(self)
        if fut is None or not fut.done():
            return False
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - the call failed: not a success
            return False
        return True

    is_completed._eccl_future = True  # type: ignore[attr-defined]
    work_cls.is_completed = is_completed
    work_cls.is_success = is_success


def register() -> None:
    """Registers the backend "eccl" with torch.distributed (once). Importing this module
    does it; so does torch itself, through the package's `torch.distributed.backends`
    entry point, the first time a script asks for the backend by name: an unchanged
    script needs no `import eccl`."""
    if BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    _install_anysource_irecv()
    _install_work_completion()
    from eccl import store

    store.register()  # init_method="eccl://..."


register()


# The training loops live in their own modules; they stay reachable from here.
from eccl.diloco import DiLoCo  # noqa: E402
from eccl.elastic import ElasticDDP, init_optimizer_state  # noqa: E402
