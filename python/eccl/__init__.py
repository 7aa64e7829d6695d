"""eccl: collectives that keep working while peers die, hang or join.

    import eccl, numpy as np
    comm = eccl.Communicator("127.0.0.1:48148", secret="...", min_world=2)
    comm.update_topology()                 # join: now there is a rank and an epoch
    x = np.ones(1024, dtype=np.float32)
    info = comm.all_reduce(x)              # in place; info.members took part

Buffers are numpy arrays or CPU torch tensors, used where they are (no copies); they
must be C-contiguous, of a supported dtype (float32, float64, float16, bfloat16, int8,
uint8, int32, int64), and writable where eccl writes. Every call waits with the GIL
released; `async_op=True` returns a `Work` at once (calls of one communicator run in the
order they were made). Errors are typed subclasses of `EcclError`; `AbortedError` means
a peer died or hung: call `update_topology()` and retry (the inputs are unchanged).
`import eccl.torch` registers the `torch.distributed` backend "eccl".
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _eccl
from ._eccl import (  # noqa: F401  (re-exported)
    AbortedError,
    EcclError,
    EvictedError,
    InvalidArgumentError,
    MasterUnavailableError,
    MismatchError,
    TimeoutError,
    TooFewPeersError,
)

__all__ = [
    "Communicator", "Master", "Work", "OpInfo", "Topology", "SyncInfo",
    "EcclError", "AbortedError", "EvictedError", "MismatchError", "TimeoutError",
    "MasterUnavailableError", "InvalidArgumentError", "TooFewPeersError",
]

# Calls in flight write into Python-owned buffers; stop them before the interpreter
# frees anything.
atexit.register(_eccl._shutdown)

_DTYPES = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int8": "i8", "uint8": "u8", "int32": "i32", "int64": "i64",
}
_OPS = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"}


@dataclass(frozen=True)
class OpInfo:
    """What a successful collective reports (G3): its epoch and the members whose
    contributions the result holds."""
    epoch: int
    seq: int
    rank: int
    world_size: int
    members: Tuple[int, ...]
    algo: str


@dataclass(frozen=True)
class Topology:
    epoch: int
    changed: bool
    rank: int
    world_size: int
    links_kept: int


@dataclass(frozen=True)
class SyncInfo:
    epoch: int
    revision: int
    bytes_sent: int
    bytes_received: int
    sources: Tuple[int, ...]
    updated: Tuple[str, ...]
    hash: str


def _op_info(d: dict) -> OpInfo:
    return OpInfo(d["epoch"], d["seq"], d["rank"], d["world_size"], tuple(d["members"]), d["algo"])


class _Buf:
    """A buffer as eccl sees it: the object that owns the memory, its address, size in
    bytes, eccl dtype and element count."""

    __slots__ = ("owner", "ptr", "nbytes", "dtype", "count")

    def __init__(self, x: Any, writable: bool, what: str):
        mod = type(x).__module__.split(".")[0]
        if mod == "torch":
            if x.device.type != "cpu":
                raise InvalidArgumentError(
                    f"{what} is a tensor on {x.device}: eccl moves CPU tensors only so far "
                    "(device transports come later); move it with .cpu()")
            if not x.is_contiguous():
                raise InvalidArgumentError(f"{what} is not contiguous: pass x.contiguous()")
            name = str(x.dtype).replace("torch.", "")
            self.ptr, self.count = x.data_ptr(), x.numel()
            self.nbytes = self.count * x.element_size()
        elif mod == "numpy":
            if not x.flags.c_contiguous:
                raise InvalidArgumentError(f"{what} is not C-contiguous: pass numpy.ascontiguousarray(x)")
            if writable and not x.flags.writeable:
                raise InvalidArgumentError(f"{what} is read-only, and eccl writes into it")
            name = x.dtype.name
            self.ptr, self.count, self.nbytes = x.ctypes.data, x.size, x.nbytes
        else:
            raise InvalidArgumentError(
                f"{what} must be a numpy array or a CPU torch tensor, not {type(x).__name__}")
        if name not in _DTYPES:
            raise InvalidArgumentError(
                f"{what} has dtype {name}; eccl supports {', '.join(_DTYPES)}")
        self.dtype = _DTYPES[name]
        self.owner = x


class Work:
    """A call in flight. `wait()` returns its result or raises its error; the buffers it
    uses stay alive until it has completed."""

    def __init__(self, native: Any, owners: List[Any], convert: Callable[[Any], Any]):
        self._native = native
        self._owners = owners
        self._convert = convert

    def is_completed(self) -> bool:
        done = self._native.is_completed()
        if done:
            self._owners = []
        return done

    def wait(self, timeout: Optional[float] = None) -> Any:
        try:
            return self._convert(self._native.wait(timeout))
        finally:
            if self._native.is_completed():
                self._owners = []


def _finish(work: Work, async_op: bool):
    return work if async_op else work.wait()


def _check_op(op: str) -> str:
    op = str(op).lower()
    if op not in _OPS:
        raise InvalidArgumentError(f"unknown reduce op {op!r}: {', '.join(sorted(_OPS))}")
    return op


class Communicator:
    """One peer's membership in a job. Arguments beat the ECCL_* variables (ECCL_MASTER,
    ECCL_SECRET, ECCL_TIMEOUT_MS, ...)."""

    def __init__(self, master: Optional[str] = None, secret: Optional[str] = None, *,
                 rank_hint: Optional[int] = None, min_world: Optional[int] = None,
                 timeout_ms: Optional[int] = None, connect_timeout_ms: Optional[int] = None,
                 join_timeout_ms: Optional[int] = None):
        self._c = _eccl.Communicator(master, secret, rank_hint, min_world, timeout_ms,
                                     connect_timeout_ms, join_timeout_ms)

    @property
    def peer_id(self) -> int:
        return self._c.peer_id

    @property
    def rank(self) -> Optional[int]:
        return self._c.rank

    @property
    def world_size(self) -> int:
        return self._c.world_size

    @property
    def epoch(self) -> int:
        return self._c.epoch

    # -- membership ---------------------------------------------------------------

    def update_topology(self) -> Topology:
        """Votes for the next epoch and waits until every live member has voted: pending
        peers are admitted, departed ones dropped."""
        d = self._c.update_topology().wait()
        return Topology(d["epoch"], d["changed"], d["rank"], d["world_size"], d["links_kept"])

    def are_peers_pending(self) -> bool:
        """The same answer on every member, so all can skip update_topology() together."""
        return bool(self._c.are_peers_pending().wait())

    def leave(self) -> None:
        """Leaves the job on purpose; the others see it at their next update_topology()."""
        self._c.leave().wait()

    # -- collectives --------------------------------------------------------------

    def _inplace(self, kind: str, x: Any, op: str, root: int, async_op: bool):
        b = _Buf(x, True, "tensor")
        w = self._c.collective_inplace(kind, b.dtype, _check_op(op), root, b.ptr, b.nbytes)
        return _finish(Work(w, [b.owner], _op_info), async_op)

    def _coll(self, kind: str, out: Any, inp: Any, count: int, op: str, root: int,
              async_op: bool, out_dtype_from: Optional[_Buf] = None):
        owners = []
        if inp is not None:
            i = _Buf(inp, False, "input")
            owners.append(i.owner)
        else:
            i = None
        if out is not None:
            o = _Buf(out, True, "output")
            owners.append(o.owner)
        else:
            o = None
        dtype = (i or o).dtype if (i or o) else "u8"
        if i and o and i.dtype != o.dtype:
            raise InvalidArgumentError(f"input is {i.dtype} but output is {o.dtype}")
        w = self._c.collective(kind, dtype, _check_op(op), root, count,
                               i.ptr if i else 0, i.nbytes if i else 0,
                               o.ptr if o else 0, o.nbytes if o else 0)
        return _finish(Work(w, owners, _op_info), async_op)

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False):
        """Reduces `tensor` across all members, in place."""
        return self._inplace("all_reduce", tensor, op, 0, async_op)

    def broadcast(self, tensor: Any, root: int = 0, *, async_op: bool = False):
        return self._inplace("broadcast", tensor, "sum", root, async_op)

    def reduce(self, tensor: Any, root: int = 0, op: str = "sum", *, async_op: bool = False):
        """Reduces into `tensor` on `root`; other ranks' tensors stay as they were."""
        return self._inplace("reduce", tensor, op, root, async_op)

    def all_gather(self, output: Any, input: Any, *, async_op: bool = False):
        """`output` holds world_size blocks of `input`'s size; block r is rank r's input."""
        return self._coll("all_gather", output, input, _Buf(input, False, "input").count,
                          "sum", 0, async_op)

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", *, async_op: bool = False):
        """`input` holds world_size blocks of `output`'s size; rank r gets block r reduced."""
        return self._coll("reduce_scatter", output, input, _Buf(output, True, "output").count,
                          op, 0, async_op)

    def all_to_all(self, output: Any, input: Any, *, async_op: bool = False):
        """Block j of `input` goes to rank j; block j of `output` comes from rank j."""
        n = max(self.world_size, 1)
        return self._coll("all_to_all", output, input, _Buf(input, False, "input").count // n,
                          "sum", 0, async_op)

    def gather(self, output: Any, input: Any, root: int = 0, *, async_op: bool = False):
        """On `root`, `output` holds world_size blocks; elsewhere pass output=None."""
        return self._coll("gather", output, input, _Buf(input, False, "input").count,
                          "sum", root, async_op)

    def scatter(self, output: Any, input: Any, root: int = 0, *, async_op: bool = False):
        """On `root`, `input` holds world_size blocks; elsewhere pass input=None."""
        return self._coll("scatter", output, input, _Buf(output, True, "output").count,
                          "sum", root, async_op)

    def barrier(self, *, async_op: bool = False):
        return _finish(Work(self._c.collective("barrier", "u8", "sum", 0, 0, 0, 0, 0, 0), [],
                            _op_info), async_op)

    def send(self, tensor: Any, peer: int, tag: int = 0, *, async_op: bool = False):
        b = _Buf(tensor, False, "tensor")
        return _finish(Work(self._c.send(b.dtype, b.ptr, b.nbytes, peer, tag), [b.owner],
                            _op_info), async_op)

    def recv(self, tensor: Any, peer: int, tag: int = 0, *, async_op: bool = False):
        b = _Buf(tensor, True, "tensor")
        return _finish(Work(self._c.recv(b.dtype, b.ptr, b.nbytes, peer, tag), [b.owner],
                            _op_info), async_op)

    # -- shared state -------------------------------------------------------------

    def sync_shared_state(self, revision: int, tensors: Dict[str, Any],
                          strategy: str = "enforce_popular", *, async_op: bool = False):
        """Brings every member's `tensors` (name -> array/tensor, same names and sizes
        everywhere) to the content most members hold at the highest revision; outdated
        members fetch it in checked chunks from several members at once. Returns a
        SyncInfo whose `revision` every member now holds."""
        bufs = [(name, _Buf(t, True, f"shared tensor {name!r}")) for name, t in tensors.items()]
        w = self._c.sync_shared_state(int(revision), [(n, b.ptr, b.nbytes) for n, b in bufs],
                                      strategy)

        def convert(d: dict) -> SyncInfo:
            return SyncInfo(d["epoch"], d["revision"], d["bytes_sent"], d["bytes_received"],
                            tuple(d["sources"]), tuple(d["updated"]), d["hash"])

        return _finish(Work(w, [b.owner for _, b in bufs], convert), async_op)


class Master:
    """An eccl master. `Master()` runs one in this process (a one-node raft cluster);
    `Master.spawn()` runs one in a child process, which survives this one's crashes only
    as long as its parent lives. `addr` and `secret` are what peers need."""

    def __init__(self, listen: str = "127.0.0.1:0", secret: Optional[str] = None, *,
                 lease_ms: int = 2000, heartbeat_ms: int = 250):
        self._m = _eccl.Master(listen, secret, lease_ms, heartbeat_ms)
        self._proc = None
        self.addr: str = self._m.addr
        self.secret: str = self._m.secret

    @classmethod
    def spawn(cls, listen: str = "127.0.0.1:0", secret: Optional[str] = None, *,
              lease_ms: int = 2000, heartbeat_ms: int = 250) -> "Master":
        import subprocess
        import sys
        secret = secret or _eccl_secret()
        proc = subprocess.Popen(
            [sys.executable, "-m", "eccl.master", "--listen", listen, "--secret", secret,
             "--lease-ms", str(lease_ms), "--heartbeat-ms", str(heartbeat_ms)],
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.startswith("eccl master listening on "):
            proc.kill()
            proc.wait()
            raise MasterUnavailableError(f"the master process did not start: {line!r}")
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
