"""CUDA tensors on the eccl torch backend (`eccl.torch`).

Four paths, picked per call:

- **Same host, CUDA IPC** (all_reduce, broadcast, all_gather_into_tensor and
  reduce_scatter_tensor with their coalesced forms, all_to_all_single with any split
  sizes, gather and scatter, and the list forms of all_gather, reduce_scatter and
  all_to_all through one flat device buffer each): when every rank of the world runs on
  this host (every link is shared memory) and `ECCL_CUDA_IPC` is not `0`, the backend
  queues a wait for the tensors' current stream (an event the communicator's task
  waits on, so the caller's thread does not block), and each GPU's first rank copies or reduces
  straight from the other ranks' device memory into the buffers of the ranks on its GPU
  (`eccl.Communicator.all_reduce_device` and its siblings): no copy through the host. Two
  processes on one GPU are served too (NCCL refuses them). Where the ranks' GPUs cannot
  map each other's memory (no peer access, or hidden from each other by
  `CUDA_VISIBLE_DEVICES`), every rank learns it from the same records and the call goes
  through host memory inside eccl instead (`ECCL_DEBUG=INFO` says so). Tensors must be
  of a dtype eccl's device kernels know, with the shapes the call asks for (a
  non-contiguous one goes through a contiguous copy); otherwise the call is staged.
- **The same calls across hosts** (or with `ECCL_CUDA_IPC=0` on any
  rank): the same device calls, which every rank then runs through host memory inside
  eccl as a pipeline of chunks in page-locked buffers: while one chunk's host collective
  runs over the links, the next chunks are copied to the host and the previous one's
  results back to the device, on copy streams of their own.
- **send and recv** (with a source rank): eccl's device send and receive, through
  page-locked host memory in pipelined chunks (also between ranks of one host: not over
  CUDA IPC, see docs/gpu.md); a send is eager, as a host send is (it returns once its
  chunks are on the link).
- **Staged** (a receive from any source, and calls whose tensors do not fit the paths
  above): the CUDA tensors are copied to host memory
  (after the current stream's work), the call runs on the host tensors as for CPU
  tensors once the copies are done (an event, waited for on the communicator's task,
  not the caller's thread; the calls that rearrange their host copies in Python first,
  such as a list-form all_to_all of blocks that do not fit, wait on the caller's
  thread), and
  the outputs are copied back to the device before the Work completes, as gloo does
  with CUDA tensors.

A call that mixes CPU and CUDA tensors is refused with `InvalidArgumentError` before
anything is sent. `ECCL_DEBUG=INFO` logs which path a call took, once per path.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, List, Tuple

import torch
import torch.utils._device as _torch_device

import eccl
from eccl.torch_checks import a2a_refusal, blocks_refusal, join_and_raise, split_refusal, split_rows

log = logging.getLogger("eccl.torch")

# The backend's calls whose CUDA tensors are staged through the host. Argument 0 is what
# each writes (the calls that only send write nothing).
STAGED = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
          "_allgather_base", "allgather_into_tensor_coalesced", "allgather_coalesced",
          "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
          "gather", "scatter", "alltoall", "alltoall_base", "send", "recv",
          "recv_anysource")
SENDS_ONLY = ("send",)
# The staged calls that hand their host copies straight to eccl: the copies to host are
# waited for on the communicator's task, and this thread goes on. The others read or
# write the host copies in Python before queuing anything (torch.stack, torch.cat of
# blocks that cannot be passed as they are; all_gather's and gather's copy of an input
# that is one of their outputs), so they wait for the copies here.
HANDS_OVER = frozenset({
    "allreduce", "allreduce_coalesced", "broadcast", "reduce",
    "_allgather_base", "allgather_into_tensor_coalesced", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "send", "recv", "recv_anysource"})

_said: set = set()


def _say(what: str) -> None:
    if what not in _said:
        _said.add(what)
        log.info("eccl: CUDA tensors %s", what)


def _default_is_cpu() -> bool:
    """Whether torch's default device is the CPU: no `torch.device(...)` context or
    `set_default_device` names another (`torch.get_default_device()` answers too, at a
    few microseconds a call, more than the collective's own overhead budget)."""
    d = getattr(_torch_device, "CURRENT_DEVICE", None)
    return d is None or torch.device(d).type == "cpu"


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _devices(args: Any) -> set:
    """The device types of the tensors in `args` (tensors, and lists of them at any
    depth). Every backend call asks, so it stays cheap: `is_cpu` is a flag, where
    `device` makes an object."""
    kinds = set()
    for a in args:
        if isinstance(a, torch.Tensor):
            kinds.add("cpu" if a.is_cpu else a.device.type)
        elif isinstance(a, (list, tuple)):
            kinds |= _devices(a)
    return kinds


def _to_host(x: Any, moved: List[Tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`x` with every CUDA tensor replaced by a host copy (recorded in `moved`)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            return x
        for d, h in moved:
            if d is x:
                return h
        # Pinned (page-locked) host memory from torch's caching host allocator: the copy
        # runs at the link's full rate, and the buffer is reused by the next call.
        h = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
        h.copy_(x.detach(), non_blocking=True)
        moved.append((x, h))
        return h
    if isinstance(x, list):
        return [_to_host(y, moved) for y in x]
    if isinstance(x, tuple):
        return tuple(_to_host(y, moved) for y in x)
    return x


def after_streams(comm: Any, tensors: List[torch.Tensor]) -> List[Any]:
    """Queues on `comm` a wait for the work that the tensors' current streams have queued
    so far (an event recorded on each device's current stream, waited for on the
    communicator's task): the calls queued next read the tensors only after it, and this
    thread does not block as `current_stream().synchronize()` would (what torch's own
    backends promise: a collective is ordered after the stream's work, not the host).
    Returns the waits' Works, which go first in the call's Work: a failed wait is its
    error. (The raw stream handle costs a microsecond where `torch.cuda.current_stream`
    and a `torch.cuda.Event` cost tens per call.)"""
    return [comm.await_device_stream(_raw_stream(i), device=i)
            for i in {t.get_device() for t in tensors}]


_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(
    torch._C, "_cuda_getCurrentRawStream") else (
        lambda i: torch.cuda.current_stream(i).cuda_stream)


class Staging(threading.local):
    """What the call being made on this thread staged: (device tensor, host copy) pairs
    whose host copies the call writes, and the waits for the copies to host, read by
    `_Calls.submit`."""

    def __init__(self) -> None:
        self.back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.waits: List[Any] = []
        self.active = False


STAGING = Staging()


def copy_back(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each result (a host copy, or a contiguous stand-in) into its tensor and
    waits for the copies, so the Work completes with the tensors holding the result
    whichever thread finishes it (whose current stream orders nothing for the
    caller's), and the stand-ins may be freed."""
    for d, h in pairs:
        d.copy_(h, non_blocking=True)
    for dev in {d.device for d, _ in pairs if d.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()


def swap_result(result: Any, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """`result` with each host copy replaced by its device tensor (what torch's future
    must complete with)."""
    if not pairs:
        return result
    if isinstance(result, torch.Tensor):
        for d, h in pairs:
            if h is result:
                return d
        return result
    if isinstance(result, list):
        return [swap_result(r, pairs) for r in result]
    if isinstance(result, tuple):
        return tuple(swap_result(r, pairs) for r in result)
    return result


def all_reduce_ipc(comm: Any, tensors: List[torch.Tensor], op: Any) -> List[Any]:
    """The same-host path: one device all_reduce per tensor, after the tensors' streams."""
    for t in tensors:
        if not t.is_contiguous():
            raise eccl.InvalidArgumentError(
                "all_reduce of a non-contiguous CUDA tensor: call .contiguous() first")
    works = after_streams(comm, tensors)
    for t in tensors:
        works.append(comm.all_reduce_device(
            t.data_ptr(), t.numel(), str(t.dtype), op, device=t.device.index or 0,
            owner=t, async_op=True, keep_on_abort=False))
    return works


# The dtypes eccl's device kernels and records know (its DType list, as torch names them).
IPC_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int32, torch.int64}
# The backend calls eccl's device path serves: over CUDA IPC on one host, else (across
# hosts, or with ECCL_CUDA_IPC=0 on any rank: one decision for the world, from eccl's
# records) through host memory as a pipeline of chunks inside eccl: FSDP's all-gathers
# and reduce-scatters, broadcast (DDP's first step), all_to_all_single (MoE's dispatch,
# even or uneven splits), gather and scatter.
IPC_CALLS = ("broadcast", "_allgather_base", "allgather_into_tensor_coalesced",
             "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "alltoall_base",
             "gather", "scatter", "allgather", "reduce_scatter", "alltoall")
# The list forms among them: through one flat device buffer per call (`_list_ipc`).
LIST_CALLS = ("allgather", "reduce_scatter", "alltoall")


def _device_all_reduce_ok(ts: List[torch.Tensor]) -> bool:
    """Whether an all_reduce of `ts` goes to eccl's device call: from what every rank of a
    correct call has alike (dtypes, one device), so every rank takes the same path; a
    non-contiguous tensor goes through a contiguous copy (`_all_reduce_cuda`)."""
    return (bool(ts) and all(t.dtype in IPC_DTYPES for t in ts)
            and len({t.device for t in ts}) == 1)


def _ipc_ok(ts: List[torch.Tensor]) -> bool:
    return (bool(ts) and all(t.is_contiguous() and t.dtype in IPC_DTYPES for t in ts)
            and len({t.device for t in ts}) == 1)


def ipc_works(backend: Any, name: str, args: Tuple[Any, ...]) -> Any:
    """The device path of the backend call `name` (one of `IPC_CALLS`: over CUDA IPC on
    one host, across hosts through host memory inside eccl, pipelined): its eccl Works and what torch's
    Work completes with (and a copy-back step), or None where the call's tensors do not
    fit it (the call is then staged; every rank decides alike, from the call's dtypes,
    devices and shapes)."""
    comm, world = backend.comm, backend.size()
    if name == "alltoall_base":
        return _all_to_all_ipc(backend, *args[:4])
    if name in ("gather", "scatter"):
        return _rooted_ipc(backend, name, *args[:3])
    if name in LIST_CALLS:
        return _list_ipc(backend, name, args)
    if name == "broadcast":
        tensors, opts = args[0], args[1]
        if not _device_all_reduce_ok(tensors):
            return None
        # A non-contiguous tensor through a contiguous copy (the root's data in it),
        # copied back on every rank.
        flat = [t.contiguous() for t in tensors]
        # The root's tensors are never written: nothing to copy back there.
        pairs = ([] if backend.rank() == opts.rootRank
                 else [(t, f) for t, f in zip(tensors, flat) if f is not t])
        works = after_streams(comm, flat)
        works += [comm.broadcast_device(t.data_ptr(), t.numel(), str(t.dtype), opts.rootRank,
                                        device=t.device.index or 0, owner=t, async_op=True)
                  for t in flat]
        if pairs:
            return works, tensors, functools.partial(copy_back, pairs)
        return works, tensors
    outs, ins = args[0], args[1]
    if name.endswith("_base"):
        outs, ins = [outs], [ins]
    outs, ins = list(outs), list(ins)
    gather = "allgather" in name
    # Not by contiguity, which is one rank's own: a non-contiguous tensor goes through a
    # contiguous copy (inputs before the call, outputs back after it).
    if len(outs) != len(ins) or not _device_all_reduce_ok(outs + ins):
        return None
    for o, i in zip(outs, ins):
        small, big = (i, o) if gather else (o, i)
        if o.dtype != i.dtype or big.numel() != small.numel() * world:
            return None
    op = None
    if not gather:
        from eccl.torch import _op_and_factor
        opts = args[2] if len(args) > 2 else None
        op, factor = _op_and_factor(opts)
        if factor is not None:
            return None   # PREMUL_SUM: the host path multiplies a copy of the input
    ins = [i.contiguous() for i in ins]
    written, copy_outs = _contiguous_outs(outs)
    works = after_streams(comm, written + ins)
    for o, i in zip(written, ins):
        dev = o.device.index or 0
        if gather:
            works.append(comm.all_gather_device(
                i.data_ptr(), o.data_ptr(), i.numel(), str(i.dtype), device=dev,
                owner=(o, i), async_op=True))
        else:
            works.append(comm.reduce_scatter_device(
                i.data_ptr(), o.data_ptr(), o.numel(), str(o.dtype), op, device=dev,
                owner=(o, i), async_op=True))
    if copy_outs is not None:
        return works, outs, copy_outs
    return works, outs


def _contiguous_outs(ts: List[torch.Tensor]) -> Tuple[List[torch.Tensor], Any]:
    """`ts` as a call writes them (`_contiguous_out` each), and one step that copies the
    non-contiguous ones' results back, or None when there is none."""
    written, backs = [], []
    for t in ts:
        w, back = _contiguous_out(t)
        written.append(w)
        if back is not None:
            backs.append(back)
    if not backs:
        return written, None

    def copy_backs() -> None:
        for b in backs:
            b()
    return written, copy_backs


def _contiguous_out(t: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """`t` as a call writes it: itself if contiguous, else a contiguous buffer and the
    step that copies it into `t` before the Work completes."""
    if t.is_contiguous():
        return t, None
    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)

    def copy_back() -> None:
        t.copy_(buf)
        torch.cuda.current_stream(t.device).synchronize()
    return buf, copy_back


def _all_to_all_ipc(backend: Any, output: torch.Tensor, input: torch.Tensor,
                    output_split_sizes: List[int], input_split_sizes: List[int]) -> Any:
    """`all_to_all_single` GPU to GPU: every rank's blocks and their sizes go to eccl,
    which checks every rank's sizes against every other's (uneven splits, as MoE layers
    pass them, included). Whether a call goes this way depends on its dtypes and devices
    only, which every rank of a correct call shares: a non-contiguous tensor goes through
    a contiguous copy rather than another path, and a rank whose split sizes do not cut
    its tensors (or whose output's dtype is not its input's) joins the call moving
    nothing, then raises a MismatchError (the ranks that expected a block from it fail
    with one too)."""
    comm, world = backend.comm, backend.size()
    if input.dtype not in IPC_DTYPES or output.device != input.device:
        return None
    in_rows = split_rows(input, input_split_sizes, world)
    out_rows = split_rows(output, output_split_sizes, world)
    if output.dtype != input.dtype or in_rows is None or out_rows is None:
        # This rank's own call is wrong, and the others (whose dtypes and devices are
        # its own) are in the device call: it joins them moving nothing, so that a
        # rank expecting a block from it fails with a MismatchError rather than
        # waiting, and then fails itself saying why.
        if output.dtype != input.dtype:
            what = f"its output is {output.dtype} and its input {input.dtype}"
        elif in_rows is None:
            what = split_refusal("input", input, input_split_sizes, world)
        else:
            what = split_refusal("output", output, output_split_sizes, world)
        join_and_raise(backend._recovery, lambda: comm.all_to_all_device(
            0, 0, [0] * world, [0] * world, str(input.dtype),
            device=input.device.index or 0, async_op=True),
            eccl.MismatchError(f"all_to_all: this rank cannot take part: {what}"))

    def counts(t: torch.Tensor, rows: List[int]) -> List[int]:
        per_row = t.numel() // t.shape[0] if t.shape[0] else 0
        return [r * per_row for r in rows]
    send_counts, recv_counts = counts(input, in_rows), counts(output, out_rows)
    inp = input.contiguous()        # a copy on the stream, before the wait, if needed
    out, copy_back = _contiguous_out(output)
    works = after_streams(comm, [out, inp])
    works.append(comm.all_to_all_device(
        inp.data_ptr(), out.data_ptr(), send_counts, recv_counts, str(input.dtype),
        device=input.device.index or 0, owner=(output, input, out, inp), async_op=True))
    return (works, output) if copy_back is None else (works, output, copy_back)


def _rooted_ipc(backend: Any, name: str, outputs: Any, inputs: Any, opts: Any) -> Any:
    """gather and scatter as eccl device calls (GPU to GPU on one host, else through
    host memory inside eccl). torch passes the root's blocks as a list of
    tensors: they go through one flat device buffer (the root's blocks stacked before
    the call for scatter, copied out after it for gather, on the device). Whether a call
    goes this way depends on this rank's own tensor's dtype alone, the same on every rank
    of a correct call; a root whose blocks cannot take part (not one per rank, or of
    another size) passes no buffer, and eccl fails the call on every rank alike."""
    comm, world, root = backend.comm, backend.size(), opts.rootRank
    is_root = backend.rank() == root
    if name == "gather":
        mine = inputs[0]
        blocks = list(outputs[0]) if is_root else []
    else:
        mine = outputs[0]
        blocks = list(inputs[0]) if is_root else []
    if mine.dtype not in IPC_DTYPES:
        return None
    usable = (is_root and len(blocks) == world
              and all(b.numel() == mine.numel() for b in blocks))
    dev, dtype, count = mine.device.index or 0, str(mine.dtype), mine.numel()
    if name == "scatter":
        flat = None
        if usable:   # on the stream, before the wait
            flat = torch.stack([b.to(device=mine.device, dtype=mine.dtype).reshape(mine.shape)
                                for b in blocks])
        out, copy_back = _contiguous_out(mine)
        works = after_streams(comm, [out] + ([flat] if flat is not None else []))
        works.append(comm.scatter_device(
            flat.data_ptr() if flat is not None else 0, out.data_ptr(), count, dtype, root,
            device=dev, owner=(mine, out, flat), async_op=True))
        return (works, outputs) if copy_back is None else (works, outputs, copy_back)
    inp = mine.contiguous()
    flat = torch.empty((world,) + tuple(mine.shape), dtype=mine.dtype,
                       device=mine.device) if usable else None
    works = after_streams(comm, [inp] + ([flat] if flat is not None else []))
    works.append(comm.gather_device(
        inp.data_ptr(), flat.data_ptr() if flat is not None else 0, count, dtype, root,
        device=dev, owner=(mine, inp, flat), async_op=True))
    if flat is None:
        return works, outputs

    def copy_out() -> None:
        for b, f in zip(blocks, flat):
            b.copy_(f.reshape(b.shape))
        torch.cuda.current_stream(mine.device).synchronize()
    return works, outputs, copy_out


def p2p_works(backend: Any, name: str, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """`send` or `recv` of CUDA tensors as eccl device calls (`send_device`,
    `recv_device`), after the tensors' streams: the Works, what torch's Work completes
    with, and the step that copies a non-contiguous tensor's result into it."""
    comm = backend.comm
    tensors, peer, tag = list(args[0]), args[1], args[2]
    if name == "send":
        # Copies on the stream, before the wait, where a tensor is not contiguous.
        bufs, copy_outs = [t.contiguous() for t in tensors], None
    else:
        bufs, copy_outs = _contiguous_outs(tensors)
    call = comm.send_device if name == "send" else comm.recv_device
    works = after_streams(comm, bufs)
    for t, b in zip(tensors, bufs):
        works.append(call(b.data_ptr(), b.numel(), str(b.dtype), peer, tag,
                          device=b.device.index or 0, owner=(t, b), async_op=True))
    return (works, args[0]) if copy_outs is None else (works, args[0], copy_outs)


def _list_ipc(backend: Any, name: str, args: Tuple[Any, ...]) -> Any:
    """The list forms (`all_gather` into a list, `reduce_scatter` from a list,
    `all_to_all` of lists, blocks of any sizes) as eccl device calls through one flat
    device buffer each: the blocks a call sends are concatenated on the current stream
    before it, the blocks it receives copied out of its flat output on the device after
    it (no copy through the host, and the caller's thread does not wait for the
    stream). Whether a call goes this way depends on the dtypes and device of the
    tensors every rank of a correct call has alike (all_gather's inputs,
    reduce_scatter's outputs, all_to_all's blocks). A rank whose blocks do not fit (a
    list of another length, a block of another size or dtype) joins the device call
    moving nothing, so the others fail with a MismatchError naming it rather than wait,
    then raises saying what was wrong, as on the CPU."""
    from eccl.torch import _op_and_factor
    comm, world = backend.comm, backend.size()
    if name == "allgather":
        outs, ins = [list(o) for o in args[0]], list(args[1])
        if len(outs) != len(ins) or not _device_all_reduce_ok(ins):
            return None
        dev, dtype = ins[0].device, str(ins[0].dtype)
        for o, i in zip(outs, ins):
            refusal = blocks_refusal(o, i, world) or _elsewhere(o, dev)
            if refusal is not None:
                join_and_raise(backend._recovery, lambda: comm.all_gather_device(
                    0, 0, 0, dtype, device=dev.index or 0, async_op=True),
                    eccl.InvalidArgumentError(f"all_gather: output blocks do not fit: {refusal}"))
        srcs = [i.contiguous() for i in ins]
        flats = [torch.empty((world,) + tuple(i.shape), dtype=i.dtype, device=i.device)
                 for i in srcs]
        works = after_streams(comm, flats + srcs)
        for f, s in zip(flats, srcs):
            works.append(comm.all_gather_device(
                s.data_ptr(), f.data_ptr(), s.numel(), str(s.dtype),
                device=s.device.index or 0, owner=(f, s), async_op=True))
        pairs = [(o, part.reshape(o.shape))
                 for os_, f in zip(outs, flats) for o, part in zip(os_, f)]
        return works, args[0], functools.partial(copy_back, pairs)
    if name == "reduce_scatter":
        outs, ins = list(args[0]), [list(i) for i in args[1]]
        if len(outs) != len(ins) or not _device_all_reduce_ok(outs):
            return None
        op, factor = _op_and_factor(args[2] if len(args) > 2 else None)
        if factor is not None:
            return None   # PREMUL_SUM: the host path multiplies a copy of the input
        dev, dtype = outs[0].device, str(outs[0].dtype)
        for o, i in zip(outs, ins):
            refusal = blocks_refusal(i, o, world) or _elsewhere(i, dev)
            if refusal is not None:
                join_and_raise(backend._recovery, lambda: comm.reduce_scatter_device(
                    0, 0, 0, dtype, op, device=dev.index or 0, async_op=True),
                    eccl.InvalidArgumentError(
                        f"reduce_scatter: input blocks do not fit: {refusal}"))
        # Concatenated on the current stream, before the wait.
        flats = [torch.cat([t.reshape(-1) for t in i]) for i in ins]
        written, copy_outs = _contiguous_outs(outs)
        works = after_streams(comm, written + flats)
        for o, w, f in zip(outs, written, flats):
            works.append(comm.reduce_scatter_device(
                f.data_ptr(), w.data_ptr(), w.numel(), str(w.dtype), op,
                device=w.device.index or 0, owner=(o, w, f), async_op=True))
        return (works, args[0]) if copy_outs is None else (works, args[0], copy_outs)
    outs, ins = list(args[0]), list(args[1])
    if not _device_all_reduce_ok(outs + ins):
        return None
    dtype, dev = ins[0].dtype if ins else outs[0].dtype, (ins or outs)[0].device
    refusal = a2a_refusal(outs, ins, world)
    if refusal is not None:
        join_and_raise(backend._recovery, lambda: comm.all_to_all_device(
            0, 0, [0] * world, [0] * world, str(dtype), device=dev.index or 0,
            async_op=True),
            eccl.MismatchError(f"all_to_all: this rank ({backend.rank()}) cannot take part: "
                               f"{refusal}"))
    send_counts, recv_counts = [t.numel() for t in ins], [t.numel() for t in outs]
    flat_in = torch.cat([t.reshape(-1) for t in ins])
    flat_out = torch.empty(sum(recv_counts), dtype=dtype, device=dev)
    works = after_streams(comm, [flat_out, flat_in])
    works.append(comm.all_to_all_device(
        flat_in.data_ptr(), flat_out.data_ptr(), send_counts, recv_counts, str(dtype),
        device=dev.index or 0, owner=(flat_out, flat_in), async_op=True))
    pairs = [(o, part.reshape(o.shape)) for o, part in zip(outs, flat_out.split(recv_counts))]
    return works, args[0], functools.partial(copy_back, pairs)


def _elsewhere(blocks: List[torch.Tensor], dev: torch.device) -> Any:
    """What is wrong with blocks on another device than the call's, or None."""
    for i, b in enumerate(blocks):
        if b.device != dev:
            return f"block {i} is on {b.device}, the call's tensor on {dev}"
    return None


def _premultiplies(name: str, args: Any, kwargs: Any) -> bool:
    """Whether a reducing call's options are torch's PREMUL_SUM: the backend scales the
    host copies on the caller's thread, so they must be complete before it runs (not
    merely awaited by the communicator's task)."""
    if "reduce" not in name:
        return False
    from eccl.torch import _op_and_factor
    for opts in (*args, *kwargs.values()):
        if hasattr(opts, "reduceOp"):
            return _op_and_factor(opts)[1] is not None
    return False


def staged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a backend call) taking CUDA tensors through host copies."""
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        kinds = _devices(args)
        if "cuda" not in kinds:
            # The backend's own buffers are host memory whatever torch's default
            # device is (`torch.set_default_device("cuda")`). Entering a device mode
            # costs every torch call inside it a Python dispatch (a 1 KiB dist.all_reduce
            # on one rank took 182 µs with it, 122 without): only where it is needed.
            if _default_is_cpu():
                return fn(self, *args, **kwargs)
            with torch.device("cpu"):
                return fn(self, *args, **kwargs)
        if len(kinds) > 1:
            raise eccl.InvalidArgumentError(
                f"{name}: a call mixes tensors on {sorted(kinds)}; eccl moves the "
                "tensors of one call on one kind of device")
        if name == "allreduce" and _device_all_reduce_ok(_tensors(args[0])):
            # eccl's device all_reduce: over CUDA IPC where every rank runs on this host
            # and ECCL_CUDA_IPC is not 0, through host memory in pipelined chunks
            # otherwise (every rank takes the same path, from the ranks' records).
            _say("all_reduce on the device path (CUDA IPC on one host, else pipelined "
                 "through host memory)")
            return self._all_reduce_cuda(*args, **kwargs)
        if name in ("send", "recv") and not kwargs and _device_all_reduce_ok(_tensors(args[0])):
            # eccl's device send and receive: over CUDA IPC on one host, else pipelined
            # through host memory (the receiver decides, from the sender's first message).
            _say(f"{name} on the device path (CUDA IPC on one host, else pipelined "
                 "through host memory)")
            return self._calls.submit(*p2p_works(self, name, args), kind="p2p")
        if name in IPC_CALLS and not kwargs:
            got = ipc_works(self, name, args)
            if got is not None:
                _say(f"{name} on the device path (CUDA IPC on one host, else pipelined "
                     "through host memory)")
                return self._calls.submit(*got)
        _say(f"staged through host memory ({name})")
        moved: List[Tuple[torch.Tensor, torch.Tensor]] = []
        host_args = tuple(_to_host(a, moved) for a in args)
        # The copies to host run on the current stream, after its work on the tensors:
        # the call starts once they are done.
        if name in HANDS_OVER and not _premultiplies(name, args, kwargs):
            STAGING.waits = after_streams(self.comm, [d for d, _ in moved])
        else:
            for dev in {d.device for d, _ in moved}:
                torch.cuda.current_stream(dev).synchronize()
        written = set() if name in SENDS_ONLY else {id(t) for t in _tensors(args[0])}
        STAGING.back = [(d, h) for d, h in moved if id(d) in written]
        STAGING.active = True
        try:
            with torch.device("cpu"):
                return fn(self, *host_args, **kwargs)
        finally:
            STAGING.active = False
            STAGING.back = []
            STAGING.waits = []
    return call


def cuda_calls(cls: type) -> type:
    """Class decorator: the backend's calls (`STAGED`) take CUDA tensors."""
    for name in STAGED:
        fn = vars(cls).get(name)
        if fn is not None:
            setattr(cls, name, staged(name, fn))
    return cls
