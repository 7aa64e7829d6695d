"""torchft on eccl: `ProcessGroupEcclFT` is torchft's reconfigurable process group with
eccl underneath, in place of torchft's `ProcessGroupGloo`. torchft's lighthouse and
`Manager` stay as they are:

    from eccl.torchft import ProcessGroupEcclFT      # was: from torchft import ProcessGroupGloo
    pg = ProcessGroupEcclFT(timeout=timedelta(seconds=5))
    manager = Manager(pg=pg, ...)

Each quorum torchft forms calls `configure(store_addr, ..., rank, world_size, quorum_id)`
with a store prefix of its own; as torchft's gloo group starts a new gloo context, this
starts a new eccl job there (its master in the quorum's rank 0, its secret sealed to each
member through that store unless `ECCL_SECRET` is set). What eccl adds under torchft: a
member that dies or hangs is reported to the others at once (a dead one's links, a hung
one's lease) instead of after the operation timeout, and every error is typed.

Needs torchft (`pip install torchft`); eccl itself does not depend on it.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Optional

import torch
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "eccl.torchft needs torchft (pip install torchft); eccl's own elastic training "
        "is eccl.torch.ElasticDDP") from e

__all__ = ["ProcessGroupEcclFT"]


class ProcessGroupEcclFT(ProcessGroupWrapper):
    """torchft's process-group interface (configure, abort, errored, shutdown and the
    collectives its Manager, DDP and checkpoint transport use) on eccl. Not to be
    confused with `eccl.torch.ProcessGroupEccl`, the c10d backend it drives."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60), pg: Optional[Any] = None):
        super().__init__(timeout=timeout, pg=pg)
        self._backend: Optional[Any] = None

    def _create_pg(self, store: Any, rank: int, world_size: int) -> BaseProcessGroup:
        from eccl.torch import _connect

        backend = _connect(store, rank, world_size, self._timeout, default_group=False)
        # torchft 0.2 keeps the quorum's global ranks and id on the group; later torchft
        # (whose `configure` takes a replica id instead) may not.
        ranks = getattr(self, "_global_ranks", None) or list(range(world_size))
        quorum = getattr(self, "_quorum_id", None)
        backend._named(f"torchft_eccl_quorum_{quorum if quorum is not None else 'x'}", ranks)
        pg = BaseProcessGroup(store, rank, world_size)
        custom = BaseProcessGroup.BackendType.CUSTOM
        pg._set_default_backend(custom)
        pg._register_backend(torch.device("cpu"), custom, backend)
        self._backend = backend
        return pg

    def getBackendName(self) -> str:  # noqa: N802 - torchft's name
        return "torchft-eccl"

    def errored(self) -> Optional[Exception]:
        """The error of the last call that failed in this quorum's group, if any: torchft
        then does not commit the step and reconfigures."""
        b = self._backend
        return None if b is None else b._recovery.error

    def _close(self) -> None:
        """Fails the calls in flight at once; leaves the abandoned job in the background:
        its master (in its rank 0) may be gone already, and a member's goodbye to it would
        hold the next quorum's set-up for a connect timeout."""
        b, self._backend = self._backend, None
        if b is not None:
            b.abort()
            threading.Thread(target=b.shutdown, kwargs={"wait": False},
                             name="eccl-torchft-leave", daemon=True).start()

    def abort(self, errored: bool = True) -> None:
        """Fails every call in flight at once and leaves this quorum's eccl job (torchft
        calls it before each reconfiguration too)."""
        self._close()
        super().abort(errored)

    def shutdown(self) -> None:
        self._close()
        super().shutdown()

    def __repr__(self) -> str:
        return f"ProcessGroupEcclFT(backend={self._backend!r})"
