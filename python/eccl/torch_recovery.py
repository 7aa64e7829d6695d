"""How the torch backend keeps a group usable after a failure: one state machine per
backend (`eccl.torch.ProcessGroupEccl`), and the wrapping that puts every call torch
makes through it.

States of a backend's `Recovery`:

- FORMED: calls go to the communicator as they are.
- ABORTED: an earlier call failed in a way that aborted the epoch on every rank (see
  `ABORTING`), or `abort()` was called here: the next call first forms the next epoch
  (`update_topology()`; every rank does the same at its next call; of several threads
  calling at once, one forms it and the others wait for it). The same ranks go
  on; a world that lost or gained a member is not torch's fixed group any more, and the
  call says so (a reconfigurable group is then reconfigured with the members' handles).
- UNFORMED: a group made with `enable_reconfigure=True` before its first
  `dist._reconfigure`: calls are refused until one forms a world (`adopt`).
- REVOKED: `revoke()` here, or a call failed with `eccl.RevokedError` (another rank
  revoked the epoch): calls are refused with `RevokedError` until a reconfigure forms
  the next world (`adopt`); nothing forms one on its own.

In any state, a reconfigure nobody has waited for yet (`forming`) is waited for before
the next call (and by `rank()`/`size()`), as gloo's is done when it returns; `abort()`
and `revoke()` never wait for it.

`get_error()` answers torch's `ErrorType` from the first failure in the current world:
SUCCESS while there is none, TIMEOUT for a timeout, REMOTE_ERROR when another rank's
failure, abort or revoke broke the epoch here, COMM_ERROR for this rank's own revoke and
for calls the ranks disagreed on; back to SUCCESS once the group has formed its next
world. This rank's own `abort()` is not an error of the group (SUCCESS, as torch's
fault-tolerance test asks of every backend but NCCL's, whose abort is a revoke).

The abort hooks torch registers run once per aborted epoch, before the failure is
reported. Which methods are calls is decided by construction (`recovering_calls`): every
method the backend class defines, except the few named in `NOT_CALLS`, so a call added
later is covered without being listed anywhere.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Any, Callable, Dict, Optional

import eccl


class State(enum.Enum):
    FORMED = "formed"
    ABORTED = "aborted"
    UNFORMED = "unformed"
    REVOKED = "revoked"
    # The next epoch formed with another rank or size than the group's: every call is
    # refused until a reconfigure adopts the new world (a call that went on would run
    # with the old size: DDP would average over ranks that are gone).
    CHANGED = "changed"


class Fault(enum.Enum):
    """What broke the current world, as torch's `ErrorType` names it."""
    SUCCESS = "SUCCESS"
    TIMEOUT = "TIMEOUT"
    COMM_ERROR = "COMM_ERROR"
    REMOTE_ERROR = "REMOTE_ERROR"


def fault_of(error: BaseException) -> Fault:
    """The kind of `error` for `get_error()`: a timeout; a failure another rank caused
    (an abort, revoke or link failure there, a member that died, left or was evicted:
    every `AbortedError` not raised by this rank's own abort or revoke); or this rank's
    (a mismatch of the call's arguments, anything else). A call failed by this rank's
    own `abort()` is no error of the group: SUCCESS."""
    if isinstance(error, eccl.EcclTimeoutError):
        return Fault.TIMEOUT
    if isinstance(error, eccl.AbortedError):
        cause = str(getattr(error, "cause", ""))
        if cause.startswith("revoked on this rank"):
            return Fault.COMM_ERROR
        if cause.startswith("aborted on this rank"):
            return Fault.SUCCESS
        return Fault.REMOTE_ERROR
    return Fault.COMM_ERROR


# The failures that aborted the epoch on every rank, by kind of call. A collective's
# refused argument and its timeout abort it (every rank's copy of the call fails); a
# send's or receive's refused argument or receive timeout is checked on its own rank and
# leaves the epoch as it was; a refused reconfigure ("control") leaves the world as it
# was.
ABORTING: Dict[str, tuple] = {
    "collective": (eccl.InvalidArgumentError, eccl.MismatchError, eccl.AbortedError,
                   eccl.EcclTimeoutError),
    "p2p": (eccl.MismatchError, eccl.AbortedError),
    "control": (),
}


class Recovery:
    """The epoch state of one backend: its rank and size in the current world, whether
    the next call must form the next epoch first, the abort hooks, the last failure."""

    def __init__(self, comm: eccl.Communicator, rank: int, size: int,
                 unformed: bool = False, reconfigurable: bool = False) -> None:
        self.comm = comm
        # torch's Backend keeps the rank and size it was made with; a reconfigured
        # group's change, so the backend answers rank()/size() from here.
        self.rank, self.size = rank, size
        self.state = State.UNFORMED if unformed else State.FORMED
        self.reconfigurable = reconfigurable
        # The last call's failure (torchft's `errored()`).
        self.error: Optional[BaseException] = None
        # The first failure in the current world (`get_error()`), and who revoked it.
        self.fault = Fault.SUCCESS
        self._revoked_by = ""
        # torch's abort hooks by id, and the epoch they last ran for (once per abort).
        self.hooks: Dict[int, Callable[[], None]] = {}
        self._hooked_epoch = -1
        # Counts the worlds this backend has taken on (a reconfigure's, or the epoch
        # formed after an abort). A call remembers the one it was made in: its failure,
        # reported after the group moved on, says nothing about the world it is in now.
        self.generation = 0
        # Why calls are refused in State.CHANGED.
        self._changed = ""
        # A reconfigure's torch Work that has not finished yet: the next call, and
        # rank()/size(), wait for it (its world is the one they are about).
        self.forming: Any = None
        # `failed` runs on the thread that completes the calls, the rest on the caller's.
        self._lock = threading.Lock()
        # Held by the one thread that forms the next epoch after an abort: another that
        # finds the group aborted meanwhile waits for it rather than form one more.
        self._form_lock = threading.Lock()

    def await_forming(self) -> None:
        """Waits for a reconfigure nobody waited for yet, so that what follows sees the
        world it formed (gloo's reconfigure is done when it returns; eccl's runs in the
        communicator's queue). Its failure is its own Work's to report: the group then
        stays in the world it had."""
        w = self.forming
        if w is None:
            return
        try:
            w.wait()
        except Exception:  # noqa: BLE001 - reported by the reconfigure's Work
            pass
        with self._lock:
            if self.forming is w:
                self.forming = None

    def before_call(self) -> None:
        """Before every call: refuse it in a group with no world yet; after an aborted
        epoch, form the next one."""
        if self.state is State.FORMED and self.forming is None:
            # The common case, without the lock: a failure that flips the state just
            # after this read fails this call, and the next one forms the next epoch
            # (as when it lands just after the call started).
            return
        self.await_forming()
        with self._form_lock:
            self._form_next()

    def _form_next(self) -> None:
        with self._lock:
            state = self.state
            if state is State.UNFORMED:
                raise eccl.InvalidArgumentError(
                    "the group has no world yet: with enable_reconfigure=True it forms one "
                    "at dist._reconfigure(uuid, handles)")
            if state is State.REVOKED:
                raise eccl.RevokedError(
                    f"the group's epoch was revoked ({self._revoked_by}): form the next "
                    "world with dist._reconfigure(uuid, handles) (or shrink the group) "
                    "before the next call")
            if state is State.CHANGED:
                raise eccl.AbortedError(self._changed)
            if state is State.FORMED:
                return
        # Raises if the next epoch cannot be formed now: the next call tries again.
        w = self.comm.update_topology()
        with self._lock:
            self.generation += 1
            self.fault = Fault.SUCCESS
            if w.rank == self.rank and w.world_size == self.size:
                self.state = State.FORMED
                return
            fix = ("call dist._reconfigure with the members' handles" if self.reconfigurable
                   else "re-create it, or use eccl.torch.ElasticDDP")
            self._changed = (
                f"the group's world changed from {self.size} ranks to {w.world_size} (this "
                f"process was rank {self.rank}, now {w.rank}): {fix}")
            self.state = State.CHANGED
        raise eccl.AbortedError(self._changed)

    def failed(self, error: BaseException, kind: str,
               generation: Optional[int] = None) -> None:
        """A call of `kind` ("collective", "p2p", "control"), made in the world numbered
        `generation` (None: the current one), failed with `error`: if that aborted the
        epoch on every rank, the hooks run and the next call recovers. A call of a world
        the group has already left (a reconfigure abandoned it while it was in flight,
        and its failure arrived after the new world was adopted) changes nothing: the
        other ranks are in the new world, and forming yet another here would wait for
        them in vain."""
        self.error = error
        with self._lock:
            stale = generation is not None and generation != self.generation
            if not stale and self.fault is Fault.SUCCESS:
                self.fault = fault_of(error)
        if not isinstance(error, ABORTING[kind]):
            return
        # The epoch the call failed in (an AbortedError names it): a reconfigure that
        # abandoned the call may have moved the communicator on already, and the hooks
        # ran for that epoch when it did.
        epoch = getattr(error, "epoch", None)
        if stale:
            # The epoch of an abandoned world was aborted all the same: its hooks run once
            # (nothing if they ran when the reconfigure abandoned it), never for the new
            # world's epoch.
            if epoch:
                self.run_hooks(epoch)
            return
        self.run_hooks(epoch if epoch else None)
        with self._lock:
            if generation not in (None, self.generation):
                return
            if isinstance(error, eccl.RevokedError):
                if self.state in (State.FORMED, State.ABORTED):
                    self.state = State.REVOKED
                    self._revoked_by = str(getattr(error, "cause", error))
            elif self.state is State.FORMED:
                self.state = State.ABORTED

    def aborted(self) -> None:
        """`abort()` here (or a reconfigure that abandons calls in flight): the hooks run,
        the next call forms the next epoch."""
        self.run_hooks()
        with self._lock:
            if self.state is State.FORMED:
                self.state = State.ABORTED

    def revoked(self, reason: str) -> None:
        """`revoke()` here: the hooks run; calls are refused until a reconfigure."""
        self.run_hooks()
        with self._lock:
            if self.fault is Fault.SUCCESS:
                self.fault = Fault.COMM_ERROR
            if self.state in (State.FORMED, State.ABORTED):
                self.state = State.REVOKED
                self._revoked_by = f"revoked on this rank: {reason}"

    def adopt(self) -> None:
        """A reconfigure committed a new world: its rank and size are the group's now."""
        with self._lock:
            self.rank, self.size = self.comm.rank, self.comm.world_size
            self.state = State.FORMED
            self.generation += 1
            self.fault = Fault.SUCCESS

    def run_hooks(self, epoch: Optional[int] = None) -> None:
        """Runs the abort hooks, once per aborted epoch (`epoch`, default the
        communicator's current one), before the failure is reported."""
        epoch = self.comm.epoch if epoch is None else epoch
        with self._lock:
            if epoch == self._hooked_epoch:
                return
            self._hooked_epoch = epoch
            hooks = list(self.hooks.values())
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook's failure is not the call's
                logging.getLogger("eccl").exception("abort hook failed")


# The backend's methods that are not calls on the group's world: queries, the lifecycle,
# and the calls that manage the world themselves (`shrink` forms its own, `split` makes
# a new group, `reconfigure` forms the next one, `monitored_barrier` runs on the store).
NOT_CALLS = frozenset({
    "rank", "size", "getBackendName", "abort", "revoke", "get_error", "shutdown", "split",
    "shrink",
    "reconfigure", "get_reconfigure_handle", "registerAbortHook", "unregisterAbortHook",
    "monitored_barrier", "supports_tensor_alloc", "allocate_tensor",
})

# Marks a method that goes through `Recovery.before_call` first.
RECOVERING = "_eccl_recovering"


def recovering_calls(torch_backend: type) -> Callable[[type], type]:
    """Class decorator for a subclass of `torch_backend` (torch's c10d Backend): every
    method the class defines that is a call (public, or one of `torch_backend`'s own
    private names such as `_allgather_base`) first runs `self._recovery.before_call()`,
    except those in `NOT_CALLS`. Properties and the class's own helpers (private names
    torch's Backend does not have) stay as they are."""
    def wrap(cls: type) -> type:
        for name, fn in list(vars(cls).items()):
            if not callable(fn) or isinstance(fn, (staticmethod, classmethod, type)):
                continue
            if name.startswith("__") or name in NOT_CALLS:
                continue
            if name.startswith("_") and not hasattr(torch_backend, name):
                continue
            setattr(cls, name, _recovering(fn))
        return cls
    return wrap


def _recovering(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._recovery.before_call()
        return fn(self, *args, **kwargs)
    call.__name__, call.__qualname__, call.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(call, RECOVERING, True)
    return call
