"""torch's fault-tolerance API on eccl: `ProcessGroup.abort()` and abort hooks,
`init_process_group(..., enable_reconfigure=True)`, `dist._get_reconfigure_handle()` and
`dist._reconfigure(uuid, handles)`, the Backend's `get_error()`, and `revoke()` (NCCL's
`ncclCommRevoke`, torchcomms' revoke: not in torch's Backend API yet, so a method of
eccl's backend and of its reconfigurable group).

Every eccl group is a ProcessGroup of eccl's own (`EcclGroup`, which torch's C++ side
names "eccl") with eccl's backend registered beneath it for "cpu" and "cuda". torch's
ProcessGroup reads a group's rank and size from fixed values, so a group whose members
change is a `ReconfigurableGroup`, whose rank and size follow eccl's current world.

A handle is `eccl1:<job id>:<peer id>:<master addresses>`: the job id is a one-way hash
of the job's secret, so a handle tells two jobs apart and is of no use to anyone without
the secret (the master admits no one else).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch._C._distributed_c10d import ProcessGroup

import eccl
from eccl.torch_recovery import Fault

try:  # torch's ErrorType (what Backend.get_error() returns) came with torch 2.8
    from torch._C._distributed_c10d import ErrorType as _ErrorType
except ImportError:  # pragma: no cover - older torch: the names as strings
    _ErrorType = None


def error_type(fault: Fault) -> Any:
    """torch's `ErrorType` member for `fault` (its name where torch has no ErrorType)."""
    return fault.value if _ErrorType is None else getattr(_ErrorType, fault.value)

PREFIX = "eccl1"


def handle_of(comm: eccl.Communicator) -> str:
    """This peer's handle: its job, its id and where its masters are."""
    return f"{PREFIX}:{comm.job_id}:{comm.peer_id}:{comm.masters}"


def parse_handles(handles: Any, job_id: str) -> Tuple[List[int], bool]:
    """The peer ids `handles` name, and whether their order is the ranks' (a list) or
    eccl's to choose (a set). A handle of another job, or not eccl's, is refused."""
    ordered = not isinstance(handles, (set, frozenset))
    peers = []
    for h in handles:
        parts = str(h).split(":", 3)
        if len(parts) != 4 or parts[0] != PREFIX or not parts[2].isdigit():
            raise eccl.InvalidArgumentError(
                f"reconfigure: {str(h)[:80]!r} is not an eccl handle (expected "
                f"'{PREFIX}:<job>:<peer>:<masters>' from dist._get_reconfigure_handle())")
        if parts[1] != job_id:
            raise eccl.InvalidArgumentError(
                f"reconfigure: handle of peer {parts[2]} belongs to another job ({parts[1]}, "
                f"this one is {job_id}): handles come from processes of one job, which "
                "share its secret")
        peers.append(int(parts[2]))
    if not peers:
        raise eccl.InvalidArgumentError("reconfigure: no handles")
    return peers, ordered


def reconfigure(backend: Any, opts: Any) -> Any:
    """`dist._reconfigure(uuid, handles)` on `backend` (an eccl.torch.ProcessGroupEccl):
    calls still in flight here fail first (they belonged to the old world), then the
    master commits the world of exactly those peers once every one of them has asked.
    Returns torch's Work; once it completes, the group's rank and size are the new
    world's."""
    comm = backend.comm
    peers, ordered = parse_handles(opts.handles, comm.job_id)
    uuid = int(opts.uuid)
    if not 0 <= uuid < 1 << 64:
        raise eccl.InvalidArgumentError(f"reconfigure: uuid {uuid} is not in 0..2**64")
    timeout = opts.timeout or backend._timeout
    # An earlier reconfigure still running is not a call to abandon: this one follows it.
    backend._recovery.await_forming()
    if backend._calls.in_flight():
        backend._recovery.aborted()
        comm.abort(f"reconfigure {uuid} on rank {backend.rank()} while calls were in flight")
    ms = max(1, int(timeout.total_seconds() * 1000))
    w = comm.reconfigure(uuid, peers, ordered, timeout_ms=ms, async_op=True)

    def adopt() -> None:
        backend._recovery.adopt()
        backend._options.global_ranks_in_group = list(range(comm.world_size))
    work = backend._calls.submit([w], None, adopt, kind="control")
    if not work.is_completed():
        backend._recovery.forming = work
    return work


class FaultTolerance:
    """The fault-tolerance API of eccl's torch Backend (`eccl.torch.ProcessGroupEccl`):
    `abort()` and abort hooks, and the reconfigure calls, over the backend's
    `_recovery` (`eccl.torch_recovery.Recovery`, which holds the state they change)."""

    def rank(self) -> int:
        self._recovery.await_forming()
        return self._recovery.rank

    def size(self) -> int:
        self._recovery.await_forming()
        return self._recovery.size

    def abort(self) -> None:
        """`ProcessGroup.abort()`: every call in flight or queued on this rank fails at
        once with `eccl.AbortedError`, the other ranks are told, the abort hooks run
        once; the next call forms the next epoch."""
        if self._closed:
            return
        self._recovery.aborted()
        # The rank as it stands, not after a reconfigure still running (`rank()` would
        # wait for it): an abort must not wait for anything.
        self.comm.abort(f"ProcessGroup.abort() on rank {self._recovery.rank}")

    def revoke(self) -> None:
        """Revokes the group's epoch (NCCL's `ncclCommRevoke`): every call in flight or
        queued here fails at once with `eccl.RevokedError` (an `AbortedError`), the
        other ranks' calls of the epoch fail with it too, the abort hooks run once, and
        from then on every call is refused with `RevokedError` until
        `dist._reconfigure` forms the next world (or the group is shrunk). Unlike
        `abort()`, no call forms the next epoch on its own: the members decide, through
        a reconfigure, who goes on. The communicator, its registration with the master
        and its handle stay, so the reconfigure that follows reuses them."""
        if self._closed:
            return
        reason = f"revoke() on rank {self._recovery.rank}"
        self._recovery.revoked(reason)
        self.comm.revoke(reason)

    def get_error(self) -> Any:
        """torch's `Backend.get_error()`: `ErrorType.SUCCESS` while the current world has
        had no failure; `TIMEOUT` after a timeout; `REMOTE_ERROR` when another rank's
        failure, abort or revoke (or a member's death) broke the epoch; `COMM_ERROR`
        after this rank's own `revoke()` or a call the ranks disagreed on. This rank's
        own `abort()` leaves it SUCCESS, as torch's fault-tolerance test asks of every
        backend but NCCL's (whose abort is a revoke: eccl's is `revoke()`). The first
        failure of a world is the answer until the group forms its next world (after
        an abort, at the next call; after a revoke, at a reconfigure)."""
        return error_type(self._recovery.fault)

    @property
    def supports_abort_hooks(self) -> bool:
        return True

    def registerAbortHook(self, hook_id: int, hook) -> None:  # noqa: N802 - torch's name
        self._recovery.hooks[hook_id] = hook

    def unregisterAbortHook(self, hook_id: int) -> None:  # noqa: N802
        self._recovery.hooks.pop(hook_id, None)

    @property
    def supports_reconfigure(self) -> bool:
        return self._recovery.reconfigurable

    def get_reconfigure_handle(self) -> str:
        return handle_of(self.comm)

    def reconfigure(self, opts: Any) -> Any:
        return reconfigure(self, opts)


class EcclGroup(ProcessGroup):
    """The process group torch gets for every eccl group (torch 2.12 and later): a
    ProcessGroup of eccl's own with eccl's backend registered beneath it for "cpu" and
    "cuda", so that torch's C++ side names the backend "eccl" (DDP's logging data; a
    ProcessGroup torch makes itself would say "custom", the name of every backend
    registered from Python). Collectives, abort, revoke and hooks go to the backend."""

    def __init__(self, store: Any, backend: Any) -> None:
        super().__init__(store, backend.rank(), backend.size())
        self._backend = backend
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM,
                                   backend)
        self._set_default_backend(ProcessGroup.BackendType.CUSTOM)

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return "eccl"

    def abort(self) -> None:
        self._backend.abort()

    def revoke(self) -> None:
        self._backend.revoke()

    def get_error(self) -> Any:
        return self._backend.get_error()

    def shutdown(self) -> None:
        self._backend.shutdown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._backend!r})"


class ReconfigurableGroup(EcclGroup):
    """The process group of `init_process_group("eccl", enable_reconfigure=True)`: no
    world until the first `dist._reconfigure`, then the rank and size of the newest one."""

    def getRank(self) -> int:  # noqa: N802 - torch's names
        return self._backend.rank()

    def getSize(self) -> int:  # noqa: N802
        return self._backend.size()

    @property
    def supports_reconfigure(self) -> bool:
        return True

    def get_reconfigure_handle(self) -> str:
        return handle_of(self._backend.comm)

    def reconfigure(self, opts: Any) -> Any:
        return reconfigure(self._backend, opts)
