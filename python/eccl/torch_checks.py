"""Whether one rank's own torch call can take part, and how it takes part when it cannot.

A call that is wrong on one rank only (split sizes that do not cut its tensor, too few
blocks, blocks of another size or dtype) must not fail there alone: the other ranks would
wait for it in the collective. The backend (`eccl.torch`, and `eccl.torch_cuda` on the
device path) still makes the call on that rank, in a form every rank rejects, and then
raises what this module found wrong ([`join_and_raise`])."""

from __future__ import annotations

from typing import Any, Callable, List, NoReturn, Optional

import torch

import eccl


def split_rows(t: torch.Tensor, splits: Any, n: int) -> Optional[List[int]]:
    """The rows of `t`'s `n` blocks along dim 0 (`splits`, or equal blocks where torch
    passes none), or None where they do not cut it (torch's split would raise on this
    rank alone)."""
    if t.dim() == 0:
        return None
    rows = list(splits) if splits else (
        [t.shape[0] // n] * n if n and t.shape[0] % n == 0 else None)
    if rows is None or len(rows) != n or any(r < 0 for r in rows) or sum(rows) != t.shape[0]:
        return None
    return rows


def split_refusal(which: str, t: torch.Tensor, splits: Any, n: int) -> str:
    """What is wrong with the split sizes of `which` ("input" or "output")."""
    return (f"its {which}_split_sizes {list(splits) if splits else '(none: equal blocks)'} "
            f"do not cut its {which} of {t.shape[0] if t.dim() else 0} rows into {n} blocks")


def blocks_refusal(blocks: List[torch.Tensor], mine: torch.Tensor, n: int) -> Optional[str]:
    """What makes a list of blocks unusable against this rank's own tensor (one block per
    rank, each of its size and dtype), or None."""
    if len(blocks) != n:
        return f"{len(blocks)} blocks for {n} ranks"
    for i, b in enumerate(blocks):
        if b.numel() != mine.numel() or b.dtype != mine.dtype:
            return (f"block {i} is {b.dtype} of {b.numel()} elements, this rank's tensor "
                    f"{mine.dtype} of {mine.numel()}")
    return None


def a2a_refusal(outs: List[torch.Tensor], ins: List[torch.Tensor], n: int) -> Optional[str]:
    """What makes this rank's all_to_all blocks unusable, or None."""
    if len(outs) != n or len(ins) != n:
        return f"{len(ins)} input and {len(outs)} output blocks for {n} ranks"
    dtypes = {t.dtype for t in outs + ins}
    if len(dtypes) > 1:
        return f"blocks of several dtypes ({', '.join(sorted(str(d) for d in dtypes))})"
    return None


def join_and_raise(recovery: Any, call: Callable[[], Any], error: Exception) -> NoReturn:
    """Makes `call` (it returns a Work), the call a wrong rank makes so that the others
    fail rather than wait, waits for it, and raises `error`, caused by the call's own
    failure, which the recovery hears of as a failed Work's would be."""
    cause = None
    try:
        call().wait()
    except eccl.EcclError as e:
        cause = e
        recovery.failed(e, "collective")
    raise error from cause
