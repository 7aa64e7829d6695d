"""eccl: collectives that keep working while peers die, hang or join.

    import eccl, numpy as np
    comm = eccl.Communicator("127.0.0.1:48148", secret="...", min_world=2)
    comm.update_topology()                 # join: now there is a rank and an epoch
    x = np.ones(1024, dtype=np.float32)
    info = comm.all_reduce(x)              # in place; info.members took part

Buffers are numpy arrays, CPU torch tensors or other buffer-protocol objects, used where
they are (no copies); they must be C-contiguous, of a supported dtype (`eccl.DType`),
and writable where eccl writes. Each call owns its buffers until the native side is done
with them, whatever happens to its `Work`. Every call waits with the GIL released;
`async_op=True` returns a `Work` at once (calls of one communicator run in the order they
were made). Errors are typed subclasses of `EcclError`; `AbortedError` means a peer died
or hung: call `update_topology()` and retry (the inputs are unchanged).
`import eccl.torch` registers the `torch.distributed` backend "eccl".

Everything here is defined once in Rust (`eccl._eccl`): the classes, the dtype and
reduce-op tables this module turns into `DType` and `ReduceOp`, and one exception class
per kind of error.
"""

from __future__ import annotations

import atexit
import enum
import os
from typing import Any, Optional, Tuple

from . import _eccl
from ._eccl import (  # noqa: F401  (re-exported)
    Communicator,
    EcclError,
    OpInfo,
    SyncInfo,
    Work,
    WorldUpdate,
)

#: Element types, from the Rust table (`eccl::DType`): `DType.F32`, ..., with
#: `long_name` numpy's and torch's name for each.
DType = enum.IntEnum("DType", {name: code for name, code, _, _ in _eccl.DTYPES})
DTYPE_NAMES = {DType[name]: long for name, _, long, _ in _eccl.DTYPES}

#: Reduction operators, from the Rust table (`eccl::ReduceOp`); any method that takes
#: `op` accepts a member or its name ("sum", "avg", ...).
ReduceOp = enum.IntEnum("ReduceOp", {name: code for name, code, _, _ in _eccl.REDUCE_OPS})
#: The member of `torch.distributed.ReduceOp` each operator implements.
TORCH_OP_NAMES = {ReduceOp[name]: torch for name, _, torch, _ in _eccl.REDUCE_OPS}

SYNC_STRATEGIES = tuple(_eccl.SYNC_STRATEGIES)

# One exception class per kind of error (AbortedError, EvictedError, ...), all
# subclasses of EcclError, living here so that they pickle by reference.
for _cls in _eccl.ERRORS:
    globals()[_cls.__name__] = _cls
ERRORS = tuple(_eccl.ERRORS)


class StateLostError(EcclError):
    """The job's shared state is gone: every rank that held a state left (died, was
    evicted) before passing it on, and the ranks still here are newcomers holding at most
    a half-received copy. `ElasticDDP` and `DiLoCo` raise it on every rank of the world
    rather than train on from such a copy (what `sync_shared_state` would otherwise settle
    on: the newest revision among the ranks present). Survivors that hold an older
    revision whole go on from it instead, with a warning. Not retryable: restore the
    state from a checkpoint. `revision` is the newest revision the job reached, `newest`
    the newest one a rank still holds (0). Not one of `ERRORS`, the Rust library's
    kinds: it is raised by these Python classes alone."""

    retryable = False
    hint = "restore the state from a checkpoint and start the job again"

    def __init__(self, revision: int, newest: int, what: str = "the shared state") -> None:
        super().__init__(
            f"{what} at revision {revision} is lost: every rank that held a state left "
            f"before passing it on, and the newest revision a rank of this world still "
            f"holds is {newest} (hint: {self.hint})")
        self.revision = revision
        self.newest = newest
        self._what = what

    def __reduce__(self):
        return (type(self), (self.revision, self.newest, self._what), self.__dict__)


def dtype_of(x: Any) -> "DType":
    """The `DType` eccl reads `x` as, or `InvalidArgumentError` saying why it cannot."""
    return DType(_eccl.dtype_of(x))


__all__ = [
    "Communicator", "Master", "Work", "OpInfo", "WorldUpdate", "SyncInfo", "DType",
    "ReduceOp", "EcclError", "StateLostError", "dtype_of",
] + [c.__name__ for c in ERRORS]

# Calls in flight write into Python-owned buffers; stop them, and wait until they have
# stopped, before the interpreter frees anything.
atexit.register(_eccl._shutdown)


def _lease(lease_ms: Optional[int], heartbeat_ms: Optional[int]):
    """A master's lease and heartbeat: as given, else `ECCL_LEASE_MS` and
    `ECCL_HEARTBEAT_MS` (as `eccl-master` reads them), else 800 and 200 ms."""
    def pick(v, var, default):
        if v is not None:
            return v
        raw = os.environ.get(var)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise InvalidArgumentError(  # noqa: F821
                f"{var}={raw!r} is not a number of milliseconds") from None
    return pick(lease_ms, "ECCL_LEASE_MS", 800), pick(heartbeat_ms, "ECCL_HEARTBEAT_MS", 200)


class Master:
    """An eccl master. `Master()` runs one in this process (a one-node raft cluster);
    `Master.spawn()` runs one in a child process, which survives this one's crashes only
    as long as its parent lives. `addr` and `secret` are what peers need.

    One member of a cluster of masters: give `node_id`, `masters` (every member as
    `id=CLIENT/RAFT`, comma-separated, as `eccl-master --masters` takes it) and the
    `cluster_secret` the members share (never the job's); `data_dir` keeps its raft log on
    disk, `join=True` waits to be added with `eccl-master cluster add`. Peers are then
    given every member's client address, comma-separated."""

    def __init__(self, listen: str = "127.0.0.1:0", secret: Optional[str] = None, *,
                 lease_ms: Optional[int] = None, heartbeat_ms: Optional[int] = None,
                 node_id: int = 1, masters: Optional[str] = None,
                 cluster_secret: Optional[str] = None, data_dir: Optional[str] = None,
                 join: bool = False):
        lease_ms, heartbeat_ms = _lease(lease_ms, heartbeat_ms)
        self._m = _eccl.Master(listen, secret, lease_ms, heartbeat_ms, node_id, masters,
                               cluster_secret, data_dir, join)
        self._proc = None
        self.addr: str = self._m.addr
        self.secret: str = self._m.secret
        self.raft_addr: Optional[str] = self._m.raft_addr
        self.node_id: int = node_id

    def is_leader(self) -> bool:
        """Whether this master leads its cluster now (a lone master always does)."""
        return self._m is not None and self._m.is_leader()

    def peer_counts(self) -> Tuple[int, int]:
        """(peers registered so far, departed ones included; peers registered and not
        gone now); (0, 0) once shut down."""
        return (0, 0) if self._m is None else self._m.peer_counts()

    @classmethod
    def spawn(cls, listen: str = "127.0.0.1:0", secret: Optional[str] = None, *,
              lease_ms: Optional[int] = None, heartbeat_ms: Optional[int] = None) -> "Master":
        import subprocess
        import sys
        lease_ms, heartbeat_ms = _lease(lease_ms, heartbeat_ms)
        secret = secret or _eccl_secret()
        # The secret goes through the child's stdin, never its argv (which `ps` shows
        # to every user of the machine); the child serves until stdin closes.
        proc = subprocess.Popen(
            [sys.executable, "-m", "eccl.master", "--listen", listen,
             "--lease-ms", str(lease_ms), "--heartbeat-ms", str(heartbeat_ms)],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(secret + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = proc.stdout.readline().strip()
        if not line.startswith("eccl master listening on "):
            proc.kill()
            proc.wait()
            raise MasterUnavailableError(  # noqa: F821 - made from the Rust list above
                f"the master process did not start: {line!r}")
        self = cls.__new__(cls)
        self._m = None
        self._proc = proc
        self.addr = line.split()[-1]
        self.secret = secret
        return self

    def shutdown(self) -> None:
        if self._m is not None:
            self._m.shutdown()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> "Master":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _eccl_secret() -> str:
    import secrets
    return secrets.token_hex(32)
