"""Where a torch call's tensors are read and written: in place where the caller's
blocks allow it (one tensor cut into blocks, or separate tensors passed to eccl as a list
of buffers), and through one buffer of the call's own only where they do not (a tensor
that is not contiguous, written tensors that overlap each other or what the call reads).
The backend (`eccl.torch`) asks here before each list-form call."""

from __future__ import annotations

import bisect
from typing import Any, Optional

import torch


def overlaps(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Whether the memory of `a` and `b` (contiguous tensors) overlaps."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    return (a.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
            and b.data_ptr() < a.data_ptr() + a.numel() * a.element_size())


def adjacent(blocks: list, *avoid: Any) -> Any:
    """One flat view of `blocks` where they already lie back to back in one tensor's
    memory, in order (`list(t.split(k))`, `t.chunk(n)`: the list forms' blocks as callers
    often cut them), contiguous CPU tensors of one dtype, and clear of every tensor in
    `avoid` (the call's other side); else None, and the caller copies them into a buffer
    of their own (or passes them as a list: `separate`). The list forms then read or write
    the caller's blocks in place, as gloo does, instead of through a copy of the whole
    call."""
    if not blocks:
        return None
    b0 = blocks[0]
    at = b0.data_ptr()
    for b in blocks:
        if not (b.is_cpu and b.is_contiguous() and b.dtype == b0.dtype and b.data_ptr() == at
                and b.untyped_storage().data_ptr() == b0.untyped_storage().data_ptr()):
            return None
        at += b.numel() * b.element_size()
    flat = b0.as_strided((sum(b.numel() for b in blocks),), (1,), b0.storage_offset())
    if any(t is not None and overlaps(flat, t) for t in avoid):
        return None
    return flat


def apart(writes: list, reads: list) -> bool:
    """Whether no tensor of `writes` overlaps another one of them or one of `reads`
    (contiguous tensors; reads may overlap each other)."""
    def span(t: "torch.Tensor") -> tuple:
        return (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
    spans = sorted(span(t) for t in writes if t.numel())
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return False
    starts = [a for a, _ in spans]
    for t in reads:
        if t is None or not t.numel():
            continue
        lo, hi = span(t)
        k = bisect.bisect_left(starts, hi)   # the written spans that start before `t` ends
        if k and spans[k - 1][1] > lo:
            return False
    return True


def clear_of(writes: list, reads: Any) -> bool:
    """`apart`, with `reads` that may not be contiguous: such a read counts as touching
    every written tensor in its storage."""
    storages = {r.untyped_storage().data_ptr() for r in reads if r.numel() and not r.is_contiguous()}
    return (apart(writes, [r for r in reads if r.is_contiguous()])
            and not any(w.numel() and w.untyped_storage().data_ptr() in storages for w in writes))


def separate(blocks: list, dtype: Any, reads: Any = (), written: bool = True) -> Optional[list]:
    """`blocks` as a list that the native call takes as it is, one buffer per block,
    read or (`written`) written where each tensor lies, as gloo does: contiguous CPU
    tensors of `dtype`; written ones apart from each other and from every tensor of
    `reads` (the call's other side). Else None, and the caller copies them through one
    buffer."""
    if not blocks or not all(b.is_cpu and b.is_contiguous() and b.dtype == dtype for b in blocks):
        return None
    if written and not apart(blocks, list(reads)):
        return None
    return list(blocks)


def written_blocks(outs: list, inp: "torch.Tensor") -> tuple:
    """Where an all_gather or a gather writes the caller's `outs`: one flat view where
    they lie back to back, else the separate tensors themselves; None where neither
    serves (the caller then copies through one buffer). With what the call reads: `inp`,
    or a copy of it where it is one of `outs` (`all_gather(ts, ts[rank])`)."""
    flat = adjacent(outs, inp)
    if flat is not None:
        return flat, inp
    if any(overlaps(o, inp) for o in outs if o.is_contiguous()):
        inp = inp.clone()
    return separate(outs, inp.dtype, [inp]), inp


def read_blocks(blocks: list, out: "torch.Tensor", as_list: bool = True) -> Any:
    """What a reduce_scatter or a scatter reads of the caller's `blocks`: one flat view
    where they lie back to back, else (`as_list`) the separate tensors where they lie,
    clear of `out`; None where neither serves (the caller then copies them)."""
    flat = adjacent(blocks, out)
    if flat is not None or not as_list:
        return flat
    listed = separate(blocks, out.dtype, written=False)
    return listed if listed is not None and out.is_contiguous() and apart([out], listed) else None


def landing(out: "torch.Tensor", reads: Any = ()) -> tuple:
    """Where a call writes its one output `out`: the tensor itself where it is contiguous
    and clear of every tensor of `reads` (what the call reads), else a contiguous buffer
    of its own. Returns (where, copy): `copy` (None for the tensor itself) puts the
    buffer into `out` and is run once the call has succeeded. So a non-contiguous output
    is written as gloo writes it, where the native call would refuse it on this rank
    alone (and the others would wait for it), and an output that is also what the call
    reads (`reduce_scatter(ts[r], ts)`) is left as it was if the call fails (G2)."""
    if out.is_contiguous() and clear_of([out], reads):
        return out, None
    buf = torch.empty(out.shape, dtype=out.dtype)
    return buf, lambda: out.copy_(buf)
