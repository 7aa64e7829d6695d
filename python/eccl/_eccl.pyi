"""Type stubs for `eccl._eccl`, the native half of the package (built from python/src/*.rs)."""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable
from typing import Any, final

# -- tables (lib.rs) ---------------------------------------------------------------------

#: Every `eccl::DType`: (NAME, code, numpy/torch name, bytes per element), e.g. ("F32", 0, "float32", 4).
DTYPES: list[tuple[str, int, str, int]]
#: Every `ECCL_*` variable: (name, default, read_by, meaning).
VARIABLES: list[tuple[str, str, str, str]]
#: Every `eccl::ReduceOp`: (NAME, code, torch's ReduceOp member name, domain: "all" | "floats" | "integers").
REDUCE_OPS: list[tuple[str, int, str, str]]
#: The names of the sync strategies: "enforce_popular", "receive_only", "send_only".
SYNC_STRATEGIES: list[str]
#: One exception class per `eccl::ErrorKind`, in the order of `ErrorKind::ALL`.
ERRORS: list[type[EcclError]]

# -- errors (errors.rs) ------------------------------------------------------------------

class EcclError(RuntimeError):
    """Base class of every eccl error (a RuntimeError, as torch.distributed's errors are); `retryable` says whether
    update_topology() and the same call can succeed, `hint` what to do.
    """

    retryable: bool
    hint: str

class AbortedError(EcclError):
    """Aborted. Hint: call update_topology() and retry the collective."""

    epoch: int
    cause: str

class RevokedError(AbortedError):
    """Revoked. Hint: form the next world (update_topology(), or in torch a reconfigure or shrink) and retry."""

class EvictedError(EcclError):
    """Evicted. Hint: create a new Communicator to register again."""

    reason: str

class MismatchError(EcclError):
    """Mismatch. Hint: make every rank call the same collectives in the same order with the same count, dtype, op and
    root; then update_topology().
    """

    rank: int | None
    detail: str

class EcclTimeoutError(EcclError, TimeoutError):
    """Timeout. Hint: call update_topology() and retry the collective."""

    what: str
    ms: int

class MasterUnavailableError(EcclError):
    """MasterUnavailable. Hint: check ECCL_MASTER / --master and that eccl-master is running and reachable."""

    addr: str
    reason: str

class InvalidArgumentError(EcclError):
    """InvalidArgument. Hint: fix the arguments; then update_topology() before the next collective."""

    detail: str

class TooFewPeersError(EcclError):
    """TooFewPeers. Hint: wait for peers to join or lower the minimum."""

    have: int
    need: int

# -- results (results.rs) ----------------------------------------------------------------

@final
class OpInfo:
    """What a successful collective reports (G3): its epoch and the members whose contributions the result holds."""

    @property
    def epoch(self) -> int: ...
    @property
    def seq(self) -> int:
        """Number of the collective in its epoch."""
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def members(self) -> tuple[int, ...]:
        """Peer ids of the members, in rank order."""
    @property
    def algo(self) -> str: ...
    @property
    def peer(self) -> int | None:
        """Point-to-point: the rank at the other end (a receive's sender); None for collectives."""
    def __repr__(self) -> str: ...

@final
class WorldUpdate:
    """What `update_topology()` returns: the world this peer is in now."""

    @property
    def epoch(self) -> int: ...
    @property
    def changed(self) -> bool:
        """Whether a new epoch began (someone joined or left, or the last one was aborted)."""
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def links_kept(self) -> int:
        """Links to other members carried over from the previous epoch."""
    def __repr__(self) -> str: ...

@final
class SyncInfo:
    """What `sync_shared_state()` did."""

    @property
    def epoch(self) -> int: ...
    @property
    def revision(self) -> int:
        """The revision every member now holds."""
    @property
    def bytes_sent(self) -> int: ...
    @property
    def bytes_received(self) -> int: ...
    @property
    def sources(self) -> tuple[int, ...]:
        """Peers this member fetched chunks from."""
    @property
    def updated(self) -> tuple[str, ...]:
        """Names of the tensors that were replaced."""
    @property
    def hash(self) -> str:
        """blake3 of the whole state (hex), equal on every member (G5)."""
    @property
    def hash_ms(self) -> float:
        """Milliseconds spent hashing this member's tensors."""
    @property
    def plan_ms(self) -> float:
        """Milliseconds waiting for the master's plan (every member's report)."""
    @property
    def transfer_ms(self) -> float:
        """Milliseconds serving or fetching chunks."""
    @property
    def hashed_bytes(self) -> int:
        """Bytes this call hashed (tensors promised unchanged are not)."""
    def __repr__(self) -> str: ...

# -- Work (work.rs) ----------------------------------------------------------------------

@final
class Work:
    """A call in flight. `wait()` returns its result or raises its error."""

    def is_completed(self) -> bool:
        """Whether the call has finished, successfully or not."""
    def wait(self, timeout: float | None = None) -> Any:
        """Waits for the call (GIL released) and returns its result (OpInfo, WorldUpdate, SyncInfo, bool or None), or
        raises its error; with `timeout` (seconds), raises `EcclTimeoutError` if it passes first (the call goes on).
        """
    def add_done_callback(self, fn: Callable[[], object], *, errors_only: bool = False) -> None:
        """Calls `fn()` once the call has finished, successfully or not (with `errors_only=True`: only if it failed):
        here and now if it has, otherwise on eccl's callback thread, with the GIL, after the outcome is set (so `wait()`
        there returns at once), in the order calls finish. `fn` should be short, and it cannot wait for an unfinished
        call (that raises `InvalidArgumentError`). Its exceptions are reported as unraisable.
        """
    def exception(self) -> EcclError | None:
        """The error the call ended with, `None` if it succeeded or is still running."""
    def __repr__(self) -> str: ...

# -- Communicator (communicator.rs) ------------------------------------------------------

@final
class Communicator:
    """One peer's membership in a job, and every collective, on numpy arrays, CPU torch tensors and other buffer-
    protocol objects, used where they are.
    """

    def __init__(
        self,
        master: str | None = None,
        secret: str | None = None,
        *,
        rank_hint: int | None = None,
        min_world: int | None = None,
        timeout_ms: int | None = None,
        connect_timeout_ms: int | None = None,
        join_timeout_ms: int | None = None,
        transport: str | None = None,
        tls: bool | None = None,
    ) -> None:
        """Registers with the master. Arguments beat the `ECCL_*` variables (`ECCL_MASTER`, `ECCL_SECRET`,
        `ECCL_TIMEOUT_MS`, ...).
        """
    @property
    def peer_id(self) -> int: ...
    @property
    def rank(self) -> int | None:
        """This peer's rank in its current world, `None` before the first one."""
    @property
    def world_size(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def transport(self) -> str:
        """What this peer's links run on now: "shm", "tcp", "tls", "quic", "shm+tcp" for a mixed world, "local" in a
        world of one.
        """
    @property
    def job_id(self) -> str:
        """The job's public name (a one-way hash of its secret): handles of one job carry it."""
    @property
    def masters(self) -> str:
        """The master addresses this communicator was given (comma-separated)."""

    # membership
    def update_topology(self) -> WorldUpdate:
        """Votes for the next epoch and waits until every live member has voted: pending peers are admitted, departed
        ones dropped.
        """
    def optimize_topology(self, *, async_op: bool = False) -> dict[str, Any] | Work:
        """Measures the links to every other member and has the master solve the ring order from them; returns at the
        new epoch that uses it (same members and ranks): {"epoch", "ring", "links": [{"rank", "bytes_per_s",
        "latency_us"}], "algorithms": [{"collective", "up_to_bytes", "algo"}]} (what the master chose from everyone's
        measurements; up_to_bytes None: every larger call). A collective call: every member makes it.
        """
    def reconfigure(
        self,
        uuid: int,
        peers: list[int],
        ordered: bool = True,
        *,
        timeout_ms: int | None = None,
        async_op: bool = False,
    ) -> WorldUpdate | Work:
        """torch's `_reconfigure`: the next epoch is a world of exactly `peers` (peer ids), ranks in list order when
        `ordered`.
        """
    def are_peers_pending(self) -> bool:
        """Whether peers wait to be admitted; the same answer on every member, so all can skip `update_topology()`
        together.
        """
    def abort(self, reason: str = "abort() was called") -> None:
        """Aborts this peer's calls at once (torch's `ProcessGroup.abort()`); returns without waiting."""
    def revoke(self, reason: str = "revoke() was called") -> None:
        """Revokes this peer's epoch at once (NCCL's `ncclCommRevoke`); returns without waiting."""
    def raise_if_broken(self) -> None:
        """Raises the error that broke this communicator's current epoch (a dead or evicted peer, an abort,
        a revoke), if one did, without waiting for its calls."""
    def leave(self) -> None:
        """Leaves the job on purpose; the others see it at their next update_topology()."""

    # collectives (`op`: an `eccl.ReduceOp`/int code, or any name of eccl's table such as "sum", "avg", torch's
    # "PRODUCT"; None is sum)

    def await_device_stream(self, stream: int, *, device: int) -> Work:
        """Queues a wait for a CUDA stream (`stream`: a raw stream of device `device`, as
        `torch._C._cuda_getCurrentRawStream(device)` gives it; 0 is the default stream): an event is recorded on it
        now, and the calls queued after this one start once the work queued on `stream` before it is done; the
        calling thread does not block. If the device cannot say, the wait fails and aborts the epoch (later calls
        here and the other ranks' copies of them fail with `AbortedError`), so that no rank's call takes unready
        data. `stream` must be a live stream of `device`: the driver is handed it as it is."""

    def all_reduce_device(
        self,
        ptr: int,
        count: int,
        dtype: str,
        op: Any | None = None,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
        keep_on_abort: bool = True,
    ) -> None | Work:
        """All_reduce of device memory in place, among ranks that all run on this host: `count` elements of `dtype`
        at address `ptr` on CUDA device `device` (a tensor's `data_ptr()`), read and written by every rank's GPU
        kernels straight from each other's memory over CUDA IPC. The memory must be ready (its stream synchronized,
        or an `await_device_stream` queued before this call) and untouched until the call is done; `owner` (the
        tensor) is held until then.
        """
    def all_gather_device(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """All_gather of device memory among ranks that all run on this host: `count` elements of `dtype` at
        `send` from every rank into `recv` (world x count, rank order) on every rank, GPU to GPU over CUDA IPC.
        `send` may be `recv`'s slice at this rank's offset (NCCL's in-place form). After a failed call `recv` is
        undefined. Readiness and `owner` as for `all_reduce_device`.
        """
    def reduce_scatter_device(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        op: Any | None = None,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """Reduce_scatter of device memory among ranks that all run on this host: every rank's `send` (world x
        count elements) reduced with `op` in rank order, slice r of the result into rank r's `recv` (`count`
        elements). `recv` may be `send`'s slice at this rank's offset. After a failed call `recv` is undefined.
        """
    def broadcast_device(
        self,
        ptr: int,
        count: int,
        dtype: str,
        root: int,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """Broadcast of device memory from rank `root` among ranks that all run on this host, GPU to GPU over
        CUDA IPC. After a failed call a non-root buffer is undefined; the root's is never written.
        """
    def all_to_all_device(
        self,
        send: int,
        recv: int,
        send_counts: list[int],
        recv_counts: list[int],
        dtype: str,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """All_to_all of device memory: GPU to GPU over CUDA IPC among ranks of one host, else through host memory:
        `send_counts[t]` elements from `send` to rank t, `recv_counts[s]` from rank s into `recv` (blocks in
        rank order; torch's split sizes). Counts that disagree across ranks are a MismatchError everywhere.
        `send` and `recv` must not overlap. After a failed call `recv` is undefined.
        """
    def gather_device(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        root: int,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """Gather of device memory to rank `root` (GPU to GPU over CUDA IPC among ranks of one host, else
        through host memory): every rank's `send` (count) into the root's `recv` (world x count); other ranks
        pass `recv=0`.
        """
    def scatter_device(
        self,
        send: int,
        recv: int,
        count: int,
        dtype: str,
        root: int,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """Scatter of device memory from rank `root` (GPU to GPU over CUDA IPC among ranks of one host, else
        through host memory): block t of the root's `send` (world x count) into rank t's `recv` (count); other
        ranks pass `send=0`.
        """
    def all_reduce(
        self,
        tensor: Any,
        op: Any | None = None,
        *,
        async_op: bool = False,
        keep_on_abort: bool = True,
        quantize: str | None = None,
    ) -> OpInfo | Work:
        """Reduces `tensor` across all members, in place. Returns an `OpInfo` (or a `Work`). A failed call leaves
        `tensor` as it was; with `keep_on_abort=False` it may leave partial results there instead, and saves a copy of
        the whole tensor per call (the ring works in the tensor itself, as NCCL and gloo do). `quantize="int8"` or
        `"fp8"` sends 8-bit values, scaled per block of 256 (f32, f16, bf16; sum and avg; within a documented bound,
        the same bits on every rank, a failed call leaves the tensor as it was).
        """
    def all_reduce_coalesced(
        self, tensors: Iterable[Any], op: Any | None = None, *, async_op: bool = False
    ) -> OpInfo | Work:
        """Several tensors of one dtype reduced in place by one all_reduce (one collective, one descriptor), as gloo's
        `allreduce_coalesced` does.
        """
    def broadcast(
        self, tensor: Any, root: int = 0, *, async_op: bool = False, keep_on_abort: bool = True
    ) -> OpInfo | Work:
        """Copies root's `tensor` into every member's, in place (`keep_on_abort` as for `all_reduce`)."""
    def reduce(
        self,
        tensor: Any,
        root: int = 0,
        op: Any | None = None,
        *,
        async_op: bool = False,
        keep_on_abort: bool = True,
    ) -> OpInfo | Work:
        """Reduces into `tensor` on `root`; other ranks' tensors stay as they were (`keep_on_abort` as for
        `all_reduce`, on the root).
        """
    def all_gather(self, output: Any, input: Any, *, async_op: bool = False) -> OpInfo | Work:
        """`output` holds world_size blocks of `input`'s size; block r is rank r's input. `output` may be a list of
        world_size buffers, one per block, written where they are (torch's list form); any side of an out-of-place
        call may be a list, read as its buffers back to back."""
    def all_gather_shared(self, output: Any, input: Any | None = None, *, async_op: bool = False) -> bool | Work:
        """all_gather reading the other ranks' memory directly where every rank's source lies in eccl's shared
        memory (a tensor from the torch backend's `allocate_tensor`), over the links otherwise; `input=None`: this
        rank's block of `output` is its source. Returns (or `wait()` returns) whether the memory was read directly.
        """
    def reduce_scatter_shared(
        self, output: Any, input: Any, op: Any | None = None, *, async_op: bool = False
    ) -> bool | Work:
        """reduce_scatter reading every rank's input directly where all lie in eccl's shared memory, over the
        links otherwise. Returns (or `wait()` returns) whether the memory was read directly."""
    def reduce_scatter(
        self, output: Any, input: Any, op: Any | None = None, *, async_op: bool = False
    ) -> OpInfo | Work:
        """`input` holds world_size blocks of `output`'s size; rank r gets block r reduced. `input` may be a list
        of world_size buffers, one per block, read where they are."""
    def all_to_all(
        self,
        output: Any,
        input: Any,
        *,
        send_counts: list[int] | None = None,
        recv_counts: list[int] | None = None,
        async_op: bool = False,
    ) -> OpInfo | Work:
        """Block j of `input` goes to rank j; block j of `output` comes from rank j. With
        `send_counts` and `recv_counts` (elements, one per rank, both or neither) the
        blocks may differ in size: `send_counts[j]` elements of `input` go to rank j,
        `recv_counts[j]` of `output` come from it, each buffer's blocks in rank order;
        every pair moves exactly its own blocks, and a pair whose ends disagree fails
        with `MismatchError` at both ends."""
    def gather(
        self, output: Any | None, input: Any, root: int = 0, *, async_op: bool = False
    ) -> OpInfo | Work:
        """On `root`, `output` holds world_size blocks (or is a list of world_size buffers, one per block);
        elsewhere pass `output=None`."""
    def scatter(
        self, output: Any, input: Any | None, root: int = 0, *, async_op: bool = False
    ) -> OpInfo | Work:
        """On `root`, `input` holds world_size blocks (or is a list of world_size buffers, one per block);
        elsewhere pass `input=None`."""
    def barrier(self, *, async_op: bool = False) -> OpInfo | Work:
        """Waits until every member has reached it (a collective with no data)."""
    def send(self, tensor: Any, peer: int, tag: int = 0, *, async_op: bool = False) -> OpInfo | Work:
        """Sends `tensor` to rank `peer`, matched by its `recv` with the same tag."""
    def recv(
        self, tensor: Any, peer: int | None = None, tag: int = 0, *, async_op: bool = False
    ) -> OpInfo | Work:
        """Receives into `tensor` from rank `peer` what it sent with the same tag; `peer=None`: from whichever rank's
        message comes first (`OpInfo.peer` names it).
        """
    def send_device(
        self,
        ptr: int,
        count: int,
        dtype: str,
        peer: int,
        tag: int = 0,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """Sends `count` elements of `dtype` of CUDA device `device`'s memory at `ptr` to rank `peer`, whose
        `recv_device` with the same tag takes them: GPU to GPU over CUDA IPC where both run on this host and the
        receiver's GPU reaches this one's, through page-locked host memory in pipelined chunks otherwise. A receive
        of another size or dtype fails both ranks with `MismatchError`. Readiness and `owner` as for
        `all_reduce_device`.
        """
    def recv_device(
        self,
        ptr: int,
        count: int,
        dtype: str,
        peer: int,
        tag: int = 0,
        *,
        device: int,
        owner: Any | None = None,
        async_op: bool = False,
    ) -> None | Work:
        """Receives into `count` elements of `dtype` of CUDA device `device`'s memory at `ptr` what rank `peer`
        sends with `send_device` and the same tag. After a failed call the memory is undefined.
        """

    # shared state
    def sync_shared_state(
        self,
        revision: int,
        tensors: dict[str, Any],
        strategy: str = "enforce_popular",
        *,
        unchanged: set[str] | None = None,
        async_op: bool = False,
    ) -> SyncInfo | Work:
        """Brings every member's `tensors` (name -> array or tensor) to the content most members hold at the highest
        revision. A failed call leaves the tensors as they were, except a newcomer's (revision 0), which take each
        chunk as it arrives.
        """

# -- Master (master.rs) ------------------------------------------------------------------

@final
class Master:
    """An embedded master in this process: alone (a one-node raft cluster), or one member of a cluster of masters."""

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        secret: str | None = None,
        lease_ms: int = 800,
        heartbeat_ms: int = 200,
        node_id: int = 1,
        masters: str | None = None,
        cluster_secret: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        join: bool = False,
    ) -> None: ...
    @property
    def addr(self) -> str: ...
    @property
    def secret(self) -> str: ...
    @property
    def raft_addr(self) -> str | None:
        """The raft listener's address, for a member of a master cluster."""
    @property
    def node_id(self) -> int: ...
    def is_leader(self) -> bool:
        """Whether this master leads its cluster now."""
    def peer_counts(self) -> tuple[int, int]:
        """(peers registered so far, departed ones included; peers registered and not gone now): what a process
        hosting the master waits on before it stops it.
        """
    def shutdown(self) -> None:
        """Stops the master (peers then get `MasterUnavailableError` from calls that need it)."""

# -- StoreClient (store.rs) --------------------------------------------------------------

@final
class SharedMemory:
    """Host memory the processes of one host share: a sealed memfd, mapped; a writable buffer
    (`torch.frombuffer`) and 8-byte counters at 8-aligned offsets. Another process maps it with
    `SharedMemory.open(pid, fd, nbytes)` once told `pid` and `fd` over an authenticated link."""
    def __init__(self, nbytes: int) -> None:
        """A region of at least `nbytes` (whole pages): a dropped one of that size from the pool
        (uninitialized), else a new zeroed one."""
    @staticmethod
    def open(pid: int, fd: int, nbytes: int) -> "SharedMemory": ...
    def share(self) -> None:
        """Marks the region as told to another process: never pooled for reuse when dropped."""
    @property
    def pid(self) -> int: ...
    @property
    def fd(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    def store(self, offset: int, value: int) -> None:
        """Stores `value` at byte `offset` (a release: earlier writes are visible first)."""
    def add(self, offset: int, value: int) -> int:
        """Adds `value` to the counter at byte `offset` (atomic; a release); returns the sum."""
    def load(self, offset: int) -> int:
        """The counter at byte `offset` (an acquire)."""
    def wait_at_least(self, offset: int, value: int, timeout_s: float) -> int:
        """Waits (GIL released) until the counter at `offset` is at least `value` or the time is up; returns it."""

@final
class StoreClient:
    """A session in the master's key-value store, with blocking methods (the GIL released while they wait); keys and
    values are `bytes`.
    """

    def __init__(
        self, masters: str, scope: str, secret: str | None = None, timeout_s: float = 30.0
    ) -> None:
        """Opens a session in `scope` on `masters` (comma-separated client addresses of the master or its cluster)."""
    @property
    def masters(self) -> str: ...
    @property
    def scope(self) -> str: ...
    @property
    def session(self) -> int: ...
    def set(self, key: bytes, value: bytes, ephemeral: bool = False) -> None: ...
    def get(self, keys: builtins.list[bytes]) -> builtins.list[bytes | None]:
        """The values of `keys` now: bytes, or None for a missing key."""
    def wait_get(self, keys: builtins.list[bytes], timeout_s: float) -> builtins.list[bytes]:
        """Waits (at most `timeout_s`) for `keys`, then returns their values."""
    def multi_set(self, pairs: builtins.list[tuple[bytes, bytes]]) -> None: ...
    def add(self, key: bytes, delta: int) -> int: ...
    def append(self, key: bytes, value: bytes) -> None: ...
    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes: ...
    def delete_key(self, key: bytes) -> bool: ...
    def check(self, keys: builtins.list[bytes]) -> bool: ...
    def wait(self, keys: builtins.list[bytes], timeout_s: float) -> None:
        """Returns once every key exists; `EcclTimeoutError` (a `TimeoutError`) after `timeout_s`."""
    def num_keys(self) -> int: ...
    def list(self, prefix: bytes) -> builtins.list[tuple[bytes, bytes]]:
        """The keys that start with `prefix`, with their values, in key order."""
    def close(self) -> None:
        """Ends the session (its ephemeral keys go; the scope's keys too if it was the last session of the scope)."""

# -- sealing (seal.rs) -------------------------------------------------------------------

@final
class OpenKey:
    """A one-use X25519 key (made by `OpenKey()`): publish `public`, then `open` the box sealed to it."""

    @property
    def public(self) -> bytes: ...
    def open(self, sealed: bytes, context: bytes) -> bytes:
        """The contents of `sealed`, a box sealed to this key under `context`."""

def seal(public: bytes, plain: bytes, context: bytes) -> bytes:
    """`plain` sealed to the holder of the key whose public half is `public`, under `context`."""

# -- functions (lib.rs, runtime.rs) ------------------------------------------------------

def dtype_of(obj: Any) -> int:
    """The element type of `obj` (a numpy array, torch tensor or buffer) as eccl reads it: the code of its
    `eccl.DType`.
    """

def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The text of the secret file at `path`, stripped; `InvalidArgumentError` when others may read or write the file.
    """

def load_or_create_secret_file(path: str | os.PathLike[str] | None = None) -> str:
    """The job secret of the file at `path` (`~/.eccl/secret` when None).

    The file is created with a fresh secret, readable by its owner only, when missing.
    """

def _shutdown() -> None:
    """Stops every communicator of this process (registered with `atexit`); returns once every task has stopped."""
