"""The Work objects of the torch backend (`eccl.torch`): what its calls return to torch,
and the thread that completes them in order."""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, List, Optional

import torch.distributed as dist
from torch.futures import Future

import eccl


class TorchWork(dist._Work):
    """The `torch.distributed` Work that the backend's collectives return: `wait()`
    blocks until the eccl calls (`eccl.Work`s) behind it are done and raises their error
    (an `eccl.EcclError` subclass); `get_future()` completes with the collective's
    result, or fails with that error. The eccl calls own their tensors, so dropping this
    object early is harmless."""

    def __init__(self) -> None:
        super().__init__()
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._result: Any = None
        # The future torch's C++ side (DDP's reducer) waits on must fail as a future,
        # not complete with an exception object for a value: a callback that raises
        # makes torch mark it failed, and DDP then raises "AbortedError: <cause>".
        self._done: Future = Future()
        self._fut: Future = self._done.then(self._outcome)

    def _outcome(self, _: Future) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        self._error = error
        self._result = result
        # The future first, as gloo's Work does: once `wait()` returns, `get_future()` is
        # complete, and callbacks chained on it then run at once in the caller's thread
        # (torchft's managed work relies on it).
        self._done.set_result(None)
        self._event.set()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        secs = timeout.total_seconds() if timeout else None
        if not self._event.wait(secs):
            raise eccl.EcclTimeoutError(f"the collective did not finish within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def get_future(self) -> Future:
        return self._fut

    # What `dist.recv(src=None)` asks after waiting: the rank the message came from.
    _source: int = -1

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


class _Completer:
    """Finishes the backend's Work objects in the order their eccl calls were made: one
    thread per process group waits on each call in turn (eccl runs one communicator's
    calls in order anyway), then runs the collective's copy-out step."""

    def __init__(self, recovery: Any = None) -> None:
        # `recovery`: the backend's `eccl.torch_recovery.Recovery`, told of every failure.
        self._recovery = recovery
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._t = threading.Thread(target=self._run, name="eccl-completer", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            works, work, result, after, kind = item
            try:
                infos = [w.wait() for w in works]
                if infos and getattr(infos[0], "peer", None) is not None:
                    work._source = infos[0].peer
                if after is not None:
                    after()
            except BaseException as e:  # noqa: BLE001 - every error belongs to the Work
                # The recovery decides whether it aborted the epoch (the hooks run before
                # the failure is reported).
                if self._recovery is not None:
                    self._recovery.failed(e, kind)
                work._finish(None, e)
            else:
                work._finish(result, None)
            finally:
                with self._lock:
                    self._pending -= 1

    def submit(self, works: List[Any], result: Any, after=None,
               kind: str = "collective") -> dist.Work:
        """`kind`: "collective", "p2p" or "control" (which errors abort the epoch)."""
        work = TorchWork()
        with self._lock:
            self._pending += 1
        self._q.put((works, work, result, after, kind))
        return work

    def in_flight(self) -> bool:
        """Whether calls submitted here have not finished yet."""
        with self._lock:
            return self._pending > 0

    def call_soon(self, fn) -> None:
        """Runs `fn` on the completer thread after everything submitted before it."""
        self.submit([], None, fn, kind="control")

    def close(self) -> None:
        self._q.put(None)
