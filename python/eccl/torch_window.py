"""One-sided windows and shared-memory tensors for the torch backend (`eccl.torch`).

`allocate_tensor` (torch's `Backend.allocate_tensor`, what FSDP2 asks a group for when
`set_allocate_memory_from_process_group_for_comm(True)`) places a CPU tensor in host
memory that the processes of the host share (`eccl._eccl.SharedMemory`: a sealed memfd).
A window (`dist._new_window(tensor, group)`, torch's one-sided API) registers one tensor
per rank. Rank `a` reaches rank `b`'s tensor one of two ways, chosen per direction when
the tensors are registered:

- **mapped** (`a` and `b` on one host, `b`'s tensor from `allocate_tensor`): `a` maps
  `b`'s tensor. `put(tensor, b, offset)` is one copy straight into it followed by a
  signal, `signal(b)` adds one to a counter of `b`'s that only `a` writes (a release,
  after `a`'s writes), `map_remote_tensor(b)` is `b`'s memory itself;
- **over the link** (other hosts, or a tensor `b`'s peers cannot map): `put` sends the
  elements to `b` over the job's authenticated link, `signal` sends a signal there, and
  `b` applies what came, in order, when it waits for a signal from `a`
  (`map_remote_tensor(b)` is refused: there is nothing to map).

Either way a put carries a signal (as NCCL's `ncclPutSignal`, which torch's NCCL window
uses), `wait_signal(a)` consumes the next signal from `a` (extras stay counted), and what
`a` put into `b` before a signal is in `b`'s tensor once `b`'s wait for that signal has
returned (torch's `get_attr` says UNIFIED for a mapped peer, SEPARATE otherwise).

A peer that dies or is evicted at its lease (a hung one) breaks the epoch, and every
window wait then fails with that `AbortedError`; every window call made after the world
changed fails with `InvalidArgumentError` (a window belongs to the world it was made in).
A bad call (a CUDA tensor, another dtype than the target's, elements past its end, a rank
outside the group) fails with `InvalidArgumentError` before anything moves; a tensor one
rank cannot register fails the registration on every rank.

torch's Python backend trampoline casts what `new_window` returns to its C++ `Window`,
which Python cannot make, so the window torch gets is a small C++ class that forwards
each call to the `HostWindow` here (`eccl/csrc/window.cpp`, compiled against the torch
in use on first use with `torch.utils.cpp_extension`, which needs a C++ compiler and
`ninja`, and cached by torch under `TORCH_EXTENSIONS_DIR`).
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import os
import re
import secrets
import shutil
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.futures import Future

import eccl
from eccl import _eccl

log = logging.getLogger("eccl.torch")

# -- shared-memory tensors --------------------------------------------------------------

# Reentrant: a garbage collection that runs while the lock is held may drop a region,
# whose callback (`_forget`) then takes it on the same thread.
_regions_lock = threading.RLock()
# Address of every live region this process made for a tensor -> the region (weakly:
# the tensors made over it hold it; it leaves the table when the last one goes).
_regions: Dict[int, "weakref.ref[_eccl.SharedMemory]"] = {}
_addresses: List[int] = []


def _forget(address: int) -> None:
    with _regions_lock:
        _regions.pop(address, None)
        i = bisect.bisect_left(_addresses, address)
        if i < len(_addresses) and _addresses[i] == address:
            del _addresses[i]


def allocate(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements of `dtype` in host memory that the processes
    of this host can map (what windows are made of). Uninitialized, as `torch.empty`'s:
    the memory of a dropped tensor of the same size is handed out again (a fresh region
    costs a page fault per page on first touch; `ECCL_SHM_POOL_MB` caps what is kept)."""
    if numel < 0:
        raise eccl.InvalidArgumentError(f"allocate_tensor: a size of {numel} elements")
    itemsize = torch.empty((), dtype=dtype).element_size()
    region = _eccl.SharedMemory(max(numel * itemsize, 1))
    address = region.address
    ref = weakref.ref(region, lambda _: _forget(address))   # allocated outside the lock
    with _regions_lock:
        _regions[address] = ref
        bisect.insort(_addresses, address)
    if numel == 0:
        return torch.frombuffer(region, dtype=torch.uint8, count=1)[:0].view(dtype)
    return torch.frombuffer(region, dtype=dtype, count=numel)


def region_of(tensor: torch.Tensor) -> Optional[Tuple[_eccl.SharedMemory, int]]:
    """The shared region holding `tensor`'s elements and their byte offset in it, if
    `allocate` made it (a view of such a tensor included)."""
    if tensor.device.type != "cpu":
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _regions_lock:
        i = bisect.bisect_right(_addresses, start) - 1
        if i < 0:
            return None
        region = _regions[_addresses[i]]()
    if region is None or end > region.address + region.nbytes:
        return None
    return region, start - region.address


# -- the C++ Window torch needs ---------------------------------------------------------

_shim_lock = threading.Lock()
_shim: Any = None


def shim() -> Any:
    """The compiled module whose `ForwardingWindow(impl)` is a torch `Window` calling
    `impl`'s methods. Built on first use for this torch (some 20 s), then loaded from
    torch's extension cache; `RuntimeError` saying why where it cannot be built."""
    global _shim
    with _shim_lock:
        if _shim is not None:
            return _shim
        from torch.utils import cpp_extension
        try:
            import ninja  # the pip package: its binary need not be on PATH
            bin_dir = getattr(ninja, "BIN_DIR", None)
            if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
        if shutil.which("ninja") is None:
            raise RuntimeError(
                "eccl's one-sided windows compile a small C++ class against torch on first "
                "use, which needs ninja (pip install ninja) and a C++ compiler")
        source = Path(__file__).with_name("csrc") / "window.cpp"
        # One build per torch: torch's cache would not notice a torch upgraded in place.
        name = "eccl_window_" + re.sub(r"[^A-Za-z0-9]", "_", torch.__version__)
        dist.Backend  # noqa: B018 - torch._C._distributed_c10d (Window's base) is loaded
        try:
            _shim = cpp_extension.load(name=name, sources=[str(source)], verbose=False)
        except Exception as e:  # a compiler error, no compiler, no headers
            raise RuntimeError(
                f"eccl's one-sided windows: building {source} against torch "
                f"{torch.__version__} failed: {e}") from e
        return _shim


# -- windows -----------------------------------------------------------------------------

# Bytes per signal counter: one cache line each, so senders do not share lines. Counter r
# (at (r + 1) * _SLOT) counts the signals rank r sent this rank; the first line holds a
# nonce that proves a mapping is the region its owner announced.
_SLOT = 64
# int64s per rank in a window's exchanges.
_RECORD = 8
# What a message over the link is (the first of its header's three int64s).
_PUT, _SIGNAL = 1, 2
# Tags of window traffic over the links: one per window of a group (p2p tags of users are
# small numbers; these stay clear of them).
_TAG_BASE = 0x5EC0_0000


def _host_key() -> Tuple[int, int, int]:
    """Who this process can share memory with by pid and fd: the same ECCL_HOST_ID (where
    set: the user says which ranks are one host), the same kernel boot, the same pid
    namespace."""
    def h(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
    try:
        boot = h(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        boot = 0
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return h(os.environ.get("ECCL_HOST_ID", "")), boot, pidns


class WindowWork(dist._Work):
    """The Work of a window call: done at once, or done by `wait()` (an asynchronous
    `wait_signal`, or a put over the link still being sent)."""

    def __init__(self, wait: Optional[Callable[[Optional[float]], None]] = None,
                 ready: Optional[Callable[[], bool]] = None, background: bool = True) -> None:
        super().__init__()
        self._background = background
        self._wait = wait
        self._ready = ready
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None
        self._lock = threading.Lock()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        with self._lock:
            if self._wait is not None:
                fn, self._wait = self._wait, None
                try:
                    fn(timeout.total_seconds() if timeout else None)
                except BaseException as e:
                    self._error = e
            if self._future is not None and not self._future.done():
                if self._error is None:
                    self._future.set_result([])
                else:
                    self._future.set_exception(self._error)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if self._wait is None:
            return True
        return bool(self._ready and self._ready())

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def get_future(self) -> Future:
        """Complete once the call is: a pending wait runs on a thread of its own then
        (one over a link: at `wait()`)."""
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = Future()
            pending = self._wait is not None
            if not pending:
                if self._error is None:
                    self._future.set_result([])
                else:
                    self._future.set_exception(self._error)
        if pending and self._background:
            def run() -> None:
                try:
                    self.wait()
                except BaseException:  # noqa: BLE001 - the future carries it
                    pass
            threading.Thread(target=run, name="eccl-window-wait", daemon=True).start()
        return self._future


class HostWindow:
    """A window over the CPU tensors of a group's ranks (see the module's documentation).
    Made collectively by every rank of `backend`'s group, the `index`-th of the group."""

    def __init__(self, backend: Any, index: int, built: Optional[BaseException] = None) -> None:
        """`built`: why this rank could not build the C++ Window (every rank raises then,
        after the first exchange, rather than leave the others in it)."""
        self._backend = backend
        self._comm = backend.comm
        self._rank, self._size = backend.rank(), backend.size()
        self._epoch = self._comm.epoch
        self._tag = _TAG_BASE + index % 0x10000
        self._signals = _eccl.SharedMemory(_SLOT * (self._size + 1))
        self._signals.share()
        nonce = secrets.randbits(62)
        for r in range(self._size):
            self._signals.store(_SLOT * (r + 1), 0)   # a pooled region is not zeroed
        self._signals.store(0, nonce)
        key = _host_key()
        table = self._exchange([self._signals.pid, self._signals.fd, self._signals.nbytes,
                                nonce, *key, 1 if built is not None else 0])
        if built is not None:
            raise built
        for r in range(self._size):
            if int(table[r, 7]):
                raise RuntimeError(f"rank {r} could not build eccl's C++ Window (see its "
                                   f"error)")
        # Every same-host peer's counters, where this process could map them (and they
        # are what the peer announced); None: that peer is reached over the link.
        self._peer_signals: List[Optional[_eccl.SharedMemory]] = []
        for r in range(self._size):
            if r == self._rank:
                self._peer_signals.append(self._signals)
            elif tuple(int(x) for x in table[r, 4:7]) != key:
                self._peer_signals.append(None)
            else:
                peer = None
                try:
                    peer = _eccl.SharedMemory.open(int(table[r, 0]), int(table[r, 1]),
                                                   int(table[r, 2]))
                    ok = peer.load(0) == int(table[r, 3])
                except eccl.EcclError:
                    ok = False
                if not ok:
                    log.info("window: rank %d's memory cannot be mapped here; its part "
                             "goes over the link", r)
                self._peer_signals.append(peer if ok else None)
        self._seen = [0] * self._size
        # Signals received over the link from each rank (puts count as signals).
        self._arrived = [0] * self._size
        self._tensor: Optional[torch.Tensor] = None
        self._held: Optional[torch.Tensor] = None
        self._region: Optional[_eccl.SharedMemory] = None
        self._remote: List[Optional[torch.Tensor]] = [None] * self._size
        self._numel = [0] * self._size
        self._dtypes: List[Optional[torch.dtype]] = [None] * self._size
        # Per direction: whether this rank writes rank r's memory itself (out) and
        # whether rank r writes this rank's (into).
        self._out_mapped = [False] * self._size
        self._in_mapped = [False] * self._size

    # -- helpers ---------------------------------------------------------------------

    def _exchange(self, mine: List[int]) -> torch.Tensor:
        table = torch.empty((self._size, _RECORD), dtype=torch.int64)
        self._comm.all_gather(table, torch.tensor(mine, dtype=torch.int64))
        return table

    def _check_world(self) -> None:
        self._comm.raise_if_broken()
        if self._comm.epoch != self._epoch:
            raise eccl.InvalidArgumentError(
                f"this window was made in epoch {self._epoch} and the world has changed "
                f"since (epoch {self._comm.epoch}): make a new window")

    def check_peer(self, rank: int) -> None:
        if not 0 <= rank < self._size:
            raise eccl.InvalidArgumentError(
                f"rank {rank} is not in this window's group of {self._size}")

    def _registered(self) -> None:
        if self._tensor is None:
            raise eccl.InvalidArgumentError(
                "this window has no tensor: pass one to new_window or tensor_register")

    def _timeout(self, timeout: Optional[float]) -> float:
        if timeout is not None:
            return timeout
        return self._backend._timeout.total_seconds()

    # -- torch's Window --------------------------------------------------------------

    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Registers `tensor` (a contiguous CPU tensor; from the group's `allocate_tensor`
        for peers of this host to write it directly) as this rank's window memory;
        collective. A rank whose tensor cannot serve makes every rank raise the same
        error."""
        self._check_world()
        if self._tensor is not None:
            raise eccl.InvalidArgumentError(
                "this window has a tensor already: tensor_deregister it first")
        problem = 0
        if tensor.device.type != "cpu":
            problem = 1
        elif not tensor.is_contiguous():
            problem = 2
        elif tensor.dtype not in _DTYPES:
            problem = 3
        found = region_of(tensor) if problem == 0 else None
        region, offset = found if found is not None else (None, 0)
        mine = [problem, region.pid if region else 0, region.fd if region else 0,
                region.nbytes if region else 0, offset, tensor.numel(),
                _DTYPES.index(tensor.dtype) if problem == 0 else 0, 0]
        table = self._exchange(mine)
        for r in range(self._size):
            why = int(table[r, 0])
            if why:
                raise eccl.InvalidArgumentError(
                    f"window tensor_register: rank {r}'s tensor " + {
                        1: "is not on the CPU (eccl's windows hold host memory)",
                        2: "is not contiguous",
                        3: "has a dtype windows do not take",
                    }[why])
        flat = tensor.reshape(-1)
        remote: List[Optional[torch.Tensor]] = [None] * self._size
        for r in range(self._size):
            self._numel[r] = int(table[r, 5])
            self._dtypes[r] = _DTYPES[int(table[r, 6])]
            if r == self._rank:
                remote[r] = flat
            elif self._peer_signals[r] is not None and int(table[r, 3]) > 0:
                try:
                    peer = _eccl.SharedMemory.open(int(table[r, 1]), int(table[r, 2]),
                                                   int(table[r, 3]))
                    itemsize = torch.empty((), dtype=self._dtypes[r]).element_size()
                    remote[r] = torch.frombuffer(
                        peer, dtype=torch.uint8, count=self._numel[r] * itemsize,
                        offset=int(table[r, 4])).view(self._dtypes[r])
                except (eccl.EcclError, ValueError) as e:
                    log.info("window: rank %d's tensor cannot be mapped here (%s); puts "
                             "to it go over the link", r, e)
        # Who writes whose memory directly: each rank says which tensors it mapped.
        mapped = [1 if (remote[r] is not None and r != self._rank) else 0
                  for r in range(self._size)]
        table = torch.empty((self._size, self._size), dtype=torch.int64)
        self._comm.all_gather(table, torch.tensor(mapped, dtype=torch.int64))
        if region is not None and int(table[:, self._rank].sum()) > 0:
            region.share()   # never pooled again: other ranks map it now
        self._out_mapped = [r == self._rank or bool(mapped[r]) for r in range(self._size)]
        self._in_mapped = [r == self._rank or bool(table[r, self._rank])
                           for r in range(self._size)]
        self._remote = remote
        self._tensor = flat
        # The memory stays mapped while the window lives either way; `owning` keeps the
        # tensor object itself too.
        self._held = tensor if owning else None
        self._region = region

    def tensor_deregister(self) -> None:
        """Drops this rank's registration once every rank has reached it (collective), so
        that no rank still writes into memory its owner reuses."""
        self._registered()
        self._comm.barrier()
        self._tensor = None
        self._held = None
        self._region = None
        self._remote = [None] * self._size
        self._out_mapped = [False] * self._size
        self._in_mapped = [False] * self._size

    def put(self, tensor: torch.Tensor, dst: int, offset: int, async_op: bool,
            timeout: Optional[float] = None) -> WindowWork:
        """Writes `tensor`'s elements into rank `dst`'s window memory from element
        `offset` on, then signals `dst`. Into mapped memory it is done when it returns;
        over the link, once the elements are handed to it (`async_op`: the Work's
        `wait()`)."""
        self._check_world()
        self._registered()
        self.check_peer(dst)
        if tensor.device.type != "cpu":
            raise eccl.InvalidArgumentError(
                f"window put: the tensor is on {tensor.device} (eccl's windows hold host "
                f"memory)")
        if tensor.dtype != self._dtypes[dst]:
            raise eccl.InvalidArgumentError(
                f"window put: a {tensor.dtype} tensor into rank {dst}'s window of "
                f"{self._dtypes[dst]}")
        n = tensor.numel()
        if offset < 0 or offset + n > self._numel[dst]:
            raise eccl.InvalidArgumentError(
                f"window put: elements {offset}..{offset + n} of rank {dst}'s window, "
                f"which holds {self._numel[dst]}")
        if self._out_mapped[dst]:
            target = self._remote[dst]
            assert target is not None
            target[offset:offset + n].copy_(tensor.reshape(-1))
            self._signal_mapped(dst)
            return WindowWork()
        self._comm.send(torch.tensor([_PUT, offset, n], dtype=torch.int64), dst, self._tag)
        work = self._comm.send(tensor.contiguous().reshape(-1), dst, self._tag,
                               async_op=True)
        if async_op:
            return WindowWork(lambda t: work.wait(t), work.is_completed)
        work.wait()
        return WindowWork()

    def _signal_mapped(self, peer: int) -> None:
        counters = self._peer_signals[peer]
        assert counters is not None
        counters.add(_SLOT * (self._rank + 1), 1)

    def signal(self, peer: int, async_op: bool, timeout: Optional[float] = None) -> WindowWork:
        """Sends `peer` one signal, after every write this rank made to it before (puts
        included)."""
        self._check_world()
        self._registered()
        self.check_peer(peer)
        if self._out_mapped[peer]:
            self._signal_mapped(peer)
        else:
            self._comm.send(torch.tensor([_SIGNAL, 0, 0], dtype=torch.int64), peer, self._tag)
        return WindowWork()

    def _arrive(self, peer: int, deadline: float) -> None:
        """Receives the next message `peer` sent this window over the link, applies it
        (a put's elements land in this rank's tensor) and counts its signal."""
        header = torch.empty(3, dtype=torch.int64)
        self._await(self._comm.recv(header, peer, self._tag, async_op=True), peer, deadline)
        kind, offset, n = (int(x) for x in header)
        if kind == _PUT:
            tensor = self._tensor
            assert tensor is not None
            if offset < 0 or n < 0 or offset + n > tensor.numel():
                self._comm.abort(f"window: rank {peer} put past the end of this window")
                raise eccl.MismatchError(
                    f"window: rank {peer} put elements {offset}..{offset + n} into this "
                    f"rank's window of {tensor.numel()}")
            self._await(self._comm.recv(tensor[offset:offset + n], peer, self._tag,
                                        async_op=True), peer, deadline)
        elif kind != _SIGNAL:
            self._comm.abort(f"window: rank {peer} sent a message of kind {kind}")
            raise eccl.MismatchError(f"window: rank {peer} sent a message of kind {kind}")
        self._arrived[peer] += 1

    def _await(self, work: Any, peer: int, deadline: float) -> None:
        try:
            work.wait(max(0.0, deadline - time.monotonic()))
        except eccl.EcclTimeoutError:
            # The receive would hold the communicator's queue until the peer sent: the
            # epoch ends instead, as after a collective that timed out.
            self._comm.abort(f"a window wait for rank {peer} timed out")
            raise

    def wait_signal(self, peer: int, async_op: bool,
                    timeout: Optional[float] = None) -> WindowWork:
        """Waits for the next signal from `peer` (what it wrote before is then in this
        rank's tensor). Fails with the epoch's `AbortedError` if a peer dies or is
        evicted, with `EcclTimeoutError` after `timeout` seconds (the group's timeout by
        default; over the link a timeout also ends the epoch)."""
        self._check_world()
        self._registered()
        self.check_peer(peer)
        self._seen[peer] += 1
        target = self._seen[peer]
        offset = _SLOT * (peer + 1)
        limit = self._timeout(timeout)

        def wait(work_timeout: Optional[float]) -> None:
            try:
                waiting(work_timeout)
            except BaseException:
                # Not consumed: the next wait is for the same signal (where no later
                # wait was made meanwhile).
                if self._seen[peer] == target:
                    self._seen[peer] -= 1
                raise

        def waiting(work_timeout: Optional[float]) -> None:
            budget = limit if work_timeout is None else min(limit, work_timeout)
            deadline = time.monotonic() + budget
            if not self._in_mapped[peer]:
                while self._arrived[peer] < target:
                    self._arrive(peer, deadline)
                return
            while True:
                left = deadline - time.monotonic()
                got = self._signals.wait_at_least(offset, target, max(0.0, min(left, 0.05)))
                if got >= target:
                    return
                self._check_world()
                if time.monotonic() >= deadline:
                    raise eccl.EcclTimeoutError(
                        f"window wait_signal: no signal #{target} from rank {peer} in "
                        f"{budget:.1f} s")

        if async_op:
            def ready() -> bool:
                if self._in_mapped[peer]:
                    return self._signals.load(offset) >= target
                return self._arrived[peer] >= target
            # Over a link the wait receives through the communicator's queue, which must
            # not hold calls made after this one: it runs at wait() only.
            return WindowWork(wait, ready, background=self._in_mapped[peer])
        wait(None)
        return WindowWork()

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s window memory as a 1-D tensor of its dtype, mapped here: reads
        and writes go straight to that rank's memory (no signal is sent). Only for a
        rank whose tensor this rank maps (one host, allocated by the group)."""
        self._check_world()
        self._registered()
        self.check_peer(rank)
        t = self._remote[rank]
        if t is None:
            raise eccl.InvalidArgumentError(
                f"rank {rank}'s window memory is not mapped here (another host, or a "
                f"tensor the group did not allocate): use put")
        return t

    def get_attr(self, peer: int) -> bool:
        """Whether rank `peer`'s window is one coherent memory with this rank's view of it
        (torch's UNIFIED: mapped) rather than reached over the link (SEPARATE)."""
        self.check_peer(peer)
        return self._out_mapped[peer]


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
           torch.complex64, torch.complex128]


def new_window(backend: Any, tensor: Optional[torch.Tensor], index: int) -> Any:
    """torch's `new_window` for `backend` (collective): the C++ Window over a new
    `HostWindow` (the group's `index`-th), with `tensor` registered when given."""
    try:
        module, built = shim(), None
    except RuntimeError as e:
        module, built = None, e
    impl = HostWindow(backend, index, built)
    if tensor is not None:
        impl.tensor_register(tensor)
    return module.ForwardingWindow(impl)
