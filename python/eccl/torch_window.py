"""One-sided windows and shared-memory tensors for the torch backend (`eccl.torch`).

`allocate_tensor` (torch's `Backend.allocate_tensor`, what FSDP2 asks a group for when
`set_allocate_memory_from_process_group(True)`) places a CPU tensor in host memory that
the processes of the host share (`eccl._eccl.SharedMemory`: a sealed memfd). A window
(`dist._new_window(tensor, group)`, torch's one-sided API) registers such a tensor on
every rank; each rank then maps every other rank's tensor, so that

- `put(tensor, dst, offset)` is one copy straight into rank `dst`'s tensor, followed by
  a signal to it (as NCCL's `ncclPutSignal`, which torch's NCCL window uses: a put
  cannot be told apart from put-then-signal there either);
- `signal(peer)` adds one to a counter in `peer`'s shared memory, `wait_signal(peer)`
  waits for the next signal from `peer` (each wait consumes one; extras stay counted);
  a `put` is visible to `dst` once its `wait_signal` for the signal that put sent (or
  any later one) returned;
- `map_remote_tensor(rank)` is a tensor over rank `rank`'s window memory itself.

Where this cannot work, the call says why on every rank instead of moving anything: a
tensor not placed by `allocate_tensor`, a CUDA tensor, ranks on other hosts (windows
over the network links are not built yet). A peer that dies or is evicted at its lease
(a hung one) breaks the epoch, and every window wait then fails with that
`AbortedError`; every window call made after the world changed fails with
`InvalidArgumentError` (the window belongs to the world it was made in).

torch's Python backend trampoline casts what `new_window` returns to its C++ `Window`,
which Python cannot make, so the window torch gets is a small C++ class that forwards
each call to the `ShmWindow` here (`eccl/csrc/window.cpp`, compiled against the torch in
use on first use with `torch.utils.cpp_extension`, which needs a C++ compiler and
`ninja`, and cached by torch under `TORCH_EXTENSIONS_DIR`).
"""

from __future__ import annotations

import bisect
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

# -- shared-memory tensors --------------------------------------------------------------

_regions_lock = threading.Lock()
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
    with _regions_lock:
        _regions[address] = weakref.ref(region, lambda _: _forget(address))
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
    torch's extension cache; `InvalidArgumentError` where it cannot be built."""
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
            raise eccl.InvalidArgumentError(
                "eccl's one-sided windows compile a small C++ class against torch on first "
                "use, which needs ninja (pip install ninja) and a C++ compiler")
        source = Path(__file__).with_name("csrc") / "window.cpp"
        # One build per torch: torch's cache would not notice a torch upgraded in place.
        name = "eccl_window_" + re.sub(r"[^A-Za-z0-9]", "_", torch.__version__)
        dist.Backend  # noqa: B018 - torch._C._distributed_c10d (Window's base) is loaded
        try:
            _shim = cpp_extension.load(name=name, sources=[str(source)], verbose=False)
        except Exception as e:  # a compiler error, no compiler, no headers
            raise eccl.InvalidArgumentError(
                f"eccl's one-sided windows: building {source} against torch "
                f"{torch.__version__} failed: {e}") from e
        return _shim


# -- windows -----------------------------------------------------------------------------

# Bytes per signal counter: one cache line each, so senders do not share lines.
_SLOT = 64
# What identifies this host's processes to each other: the kernel's boot and the pid
# namespace (a pid means the same process only where both agree).
_RECORD = 8


def _host_key() -> Tuple[int, int]:
    try:
        boot = int(Path("/proc/sys/kernel/random/boot_id").read_text().strip()
                   .replace("-", "")[:15], 16)
    except (OSError, ValueError):
        boot = 0
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return boot, pidns


class WindowWork(dist._Work):
    """The Work of a window call: done at once (put, signal), or done by `wait()`
    (an asynchronous `wait_signal`, which waits then)."""

    def __init__(self, wait: Optional[Callable[[float], None]] = None,
                 ready: Optional[Callable[[], bool]] = None) -> None:
        super().__init__()
        self._wait = wait
        self._ready = ready
        self._error: Optional[BaseException] = None
        self._future: Optional[Future] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
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
        if self._future is None:
            self._future = Future()
            if self._wait is None:
                if self._error is None:
                    self._future.set_result([])
                else:
                    self._future.set_exception(self._error)
        return self._future


class ShmWindow:
    """A window over host shared memory among the ranks of one host (see the module's
    documentation). Made collectively by every rank of `backend`'s group."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._comm = backend.comm
        self._rank, self._size = backend.rank(), backend.size()
        self._epoch = self._comm.epoch
        self._signals = _eccl.SharedMemory(_SLOT * (self._size + 1))
        self._signals.share()
        self._signals.store(_SLOT, 0)
        for r in range(self._size):
            self._signals.store(_SLOT * (r + 1), 0)   # a pooled region is not zeroed
        nonce = secrets.randbits(62)
        self._signals.store(0, nonce)
        boot, pidns = _host_key()
        mine = [self._signals.pid, self._signals.fd, self._signals.nbytes, nonce, boot, pidns,
                0, 0]
        table = self._exchange(mine)
        for r in range(self._size):
            if (int(table[r, 4]), int(table[r, 5])) != (boot, pidns):
                raise eccl.InvalidArgumentError(
                    f"a window needs every rank on one host (its memory is shared memory; "
                    f"windows over the network links are not built yet): rank {r} runs on "
                    f"another host than rank {self._rank}")
        self._peer_signals: List[_eccl.SharedMemory] = []
        for r in range(self._size):
            if r == self._rank:
                self._peer_signals.append(self._signals)
                continue
            peer = _eccl.SharedMemory.open(int(table[r, 0]), int(table[r, 1]),
                                           int(table[r, 2]))
            if peer.load(0) != int(table[r, 3]):
                raise eccl.InvalidArgumentError(
                    f"rank {r}'s window memory is not what rank {r} announced (another "
                    f"process answered to its pid)")
            self._peer_signals.append(peer)
        self._sent = [0] * self._size
        self._seen = [0] * self._size
        self._tensor: Optional[torch.Tensor] = None
        self._held: Optional[torch.Tensor] = None
        self._remote: List[Optional[torch.Tensor]] = [None] * self._size

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
        """Registers `tensor` (made by the group's `allocate_tensor`, contiguous) as this
        rank's window memory; collective. Every rank learns every rank's size and dtype,
        and a rank whose tensor cannot serve makes every rank raise the same error."""
        self._check_world()
        if self._tensor is not None:
            raise eccl.InvalidArgumentError(
                "this window has a tensor already: tensor_deregister it first")
        problem = 0
        found = None
        if tensor.device.type != "cpu":
            problem = 1
        elif not tensor.is_contiguous():
            problem = 2
        elif tensor.dtype not in _DTYPES:
            problem = 4
        else:
            found = region_of(tensor)
            if found is None:
                problem = 3
        region, offset = found if found is not None else (None, 0)
        if region is not None:
            region.share()   # never pooled again: the other ranks map it now
        mine = [problem, region.pid if region else 0, region.fd if region else 0,
                region.nbytes if region else 0, offset,
                tensor.numel() * tensor.element_size(),
                _DTYPES.index(tensor.dtype) if problem != 4 else 0, 0]
        table = self._exchange(mine)
        for r in range(self._size):
            why = int(table[r, 0])
            if why:
                raise eccl.InvalidArgumentError(
                    f"window tensor_register: rank {r}'s tensor " + {
                        1: "is not on the CPU (eccl's windows are host shared memory)",
                        2: "is not contiguous",
                        3: "was not made by the group's allocate_tensor, so the other "
                           "ranks cannot map it (allocate it with "
                           "group._get_backend(torch.device('cpu')).allocate_tensor(n, "
                           "dtype=..., device='cpu'))",
                        4: "has a dtype windows do not take",
                    }[why])
        remote: List[Optional[torch.Tensor]] = []
        for r in range(self._size):
            dtype = _DTYPES[int(table[r, 6])]
            if r == self._rank:
                remote.append(tensor.reshape(-1))
                continue
            nbytes = int(table[r, 5])
            if nbytes == 0:
                remote.append(torch.empty(0, dtype=dtype))
                continue
            peer = _eccl.SharedMemory.open(int(table[r, 1]), int(table[r, 2]),
                                           int(table[r, 3]))
            remote.append(torch.frombuffer(peer, dtype=torch.uint8, count=nbytes,
                                           offset=int(table[r, 4])).view(dtype))
        self._remote = remote
        self._tensor = tensor.reshape(-1)
        # The region stays mapped while the window lives either way; `owning` keeps the
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

    def put(self, tensor: torch.Tensor, dst: int, offset: int, async_op: bool,
            timeout: Optional[float] = None) -> WindowWork:
        """Copies `tensor`'s elements into rank `dst`'s window memory from element
        `offset` on, then signals `dst`. Done when it returns (the copy is this
        process's own); `async_op` changes nothing."""
        self._check_world()
        self._registered()
        self.check_peer(dst)
        target = self._remote[dst]
        assert target is not None
        if tensor.device.type != "cpu":
            raise eccl.InvalidArgumentError(
                f"window put: the tensor is on {tensor.device} (eccl's windows are host "
                f"shared memory)")
        if tensor.dtype != target.dtype:
            raise eccl.InvalidArgumentError(
                f"window put: a {tensor.dtype} tensor into rank {dst}'s window of "
                f"{target.dtype}")
        n = tensor.numel()
        if offset < 0 or offset + n > target.numel():
            raise eccl.InvalidArgumentError(
                f"window put: elements {offset}..{offset + n} of rank {dst}'s window, "
                f"which holds {target.numel()}")
        target[offset:offset + n].copy_(tensor.reshape(-1))
        self._signal(dst)
        return WindowWork()

    def _signal(self, peer: int) -> None:
        self._sent[peer] += 1
        self._peer_signals[peer].store(_SLOT * (self._rank + 1), self._sent[peer])

    def signal(self, peer: int, async_op: bool, timeout: Optional[float] = None) -> WindowWork:
        """Adds one to the signals `peer` has had from this rank, after every write this
        rank made before (puts included)."""
        self._check_world()
        self.check_peer(peer)
        self._signal(peer)
        return WindowWork()

    def wait_signal(self, peer: int, async_op: bool,
                    timeout: Optional[float] = None) -> WindowWork:
        """Waits for the next signal from `peer` (what it wrote before is then visible
        here). Fails with the epoch's `AbortedError` if a peer dies or is evicted, with
        `EcclTimeoutError` after `timeout` seconds (the group's timeout by default)."""
        self._check_world()
        self.check_peer(peer)
        self._seen[peer] += 1
        target = self._seen[peer]
        offset = _SLOT * (peer + 1)
        limit = self._timeout(timeout)

        def wait(work_timeout: Optional[float]) -> None:
            budget = limit if work_timeout is None else min(limit, work_timeout)
            deadline = time.monotonic() + budget
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
            return WindowWork(wait, lambda: self._signals.load(offset) >= target)
        wait(None)
        return WindowWork()

    def map_remote_tensor(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s window memory as a 1-D tensor of its dtype, mapped here: reads
        and writes go straight to that rank's memory (no signal is sent)."""
        self._check_world()
        self._registered()
        self.check_peer(rank)
        t = self._remote[rank]
        assert t is not None
        return t


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
           torch.complex64, torch.complex128]


def new_window(backend: Any, tensor: Optional[torch.Tensor]) -> Any:
    """torch's `new_window` for `backend` (collective): the C++ Window over a new
    `ShmWindow`, with `tensor` registered when given."""
    module = shim()
    impl = ShmWindow(backend)
    if tensor is not None:
        impl.tensor_register(tensor)
    return module.ForwardingWindow(impl)
