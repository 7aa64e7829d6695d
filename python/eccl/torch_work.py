"""The Work objects of the torch backend (`eccl.torch`): what its calls return to torch,
and how they are finished when the eccl calls behind them are.

A Work is finished by whoever needs it first, with no thread of the backend in between:
- `wait()` waits for the eccl calls itself (the GIL released) and finishes the Work on
  the caller's thread;
- `get_future()` (what DDP's reducer and torchft use) asks for the Work to be finished
  as soon as the last eccl call is done: eccl's callback thread runs the copy-out step
  and completes torch's future (`eccl.Work.add_done_callback`), as gloo's
  `AsyncWork::execute` completes its own future (never the communicator's task: a
  runtime worker waiting for the GIL would stall every timer of the process, the
  lease's heartbeat among them);
- a failure is always noticed when it happens, even in a Work nobody waits for: the
  backend's recovery must know that the epoch was aborted before the next call.

The callback thread never waits for torch's abort hooks: a failure that it notices is
finished on a short-lived thread, since a hook may wait for calls of its own, whose
callbacks that thread (busy running the hook) could never run.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch.distributed as dist
from torch.futures import Future

import eccl
from eccl import torch_cuda


class TorchWork(dist._Work):
    """The `torch.distributed` Work that the backend's collectives return: `wait()`
    blocks until the eccl calls (`eccl.Work`s) behind it are done and raises their error
    (an `eccl.EcclError` subclass); `get_future()` completes with the collective's
    result, or fails with that error. Once `wait()` has returned, `get_future()` is
    complete, as with gloo (torchft chains callbacks on it then). The eccl calls own
    their tensors, so dropping this object early is harmless."""

    def __init__(self, works: List[Any], result: Any = None,
                 after: Optional[Callable[[], None]] = None, kind: str = "collective",
                 recovery: Any = None) -> None:
        super().__init__()
        self._works = works
        self._result = result
        self._after = after
        self._kind = kind
        self._recovery = recovery
        # The world the call was made in (see `Recovery.failed`).
        self._generation = getattr(recovery, "generation", None)
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None
        # Set while a failure the task noticed is being finished on another thread.
        self._failing: Optional[threading.Event] = None
        # torch's future, made when first asked for; `_done` is what it chains on.
        self._done: Optional[Future] = None
        self._fut: Optional[Future] = None
        if not works:
            self._finish(on_task=False)
        # A control call (a reconfigure) is finished by the task also when it succeeds:
        # its copy-out step adopts the new world, which must not wait for someone to
        # wait on the Work.
        control = kind == "control"
        for w in works:
            w.add_done_callback(self._on_error, errors_only=not control)

    # -- finishing ----------------------------------------------------------------

    def _on_error(self) -> None:
        """An eccl call behind this Work failed, or (a control call) finished (on eccl's
        callback thread)."""
        self._finish(on_task=True)

    def _on_done(self) -> None:
        """The last eccl call is done and torch waits on the future (on eccl's callback
        thread)."""
        if all(w.is_completed() for w in self._works):
            self._finish(on_task=True)

    def _finish(self, on_task: bool, infos: Optional[List[Any]] = None) -> None:
        """Finishes the Work once: the copy-out step, then torch's future. Runs when
        every eccl call is done, or when one has failed (the others may still run).
        `infos`: what every eccl call returned, when the caller waited for them all and
        none failed (`wait()`: each is asked once, not again here)."""
        with self._lock:
            if self._finished or self._failing is not None:
                return
            error: Optional[BaseException] = None
            try:
                if infos is None:
                    infos = []
                    running = False
                    for w in self._works:
                        if not w.is_completed():
                            running = True   # a later call may have failed already
                            continue
                        infos.append(w.wait())  # at once, or raises the call's error
                    if running:
                        return        # not done yet and nothing failed so far
                for info in infos:
                    peer = getattr(info, "peer", None)
                    if peer is not None:
                        self._source = peer
                if self._after is not None:
                    self._after()
            except BaseException as e:  # noqa: BLE001 - every error belongs to the Work
                error = e
            if error is None:
                self._finished = True
                done = self._done
            else:
                # Claimed: whoever finishes the failure, nobody else starts on it.
                self._failing = threading.Event()
        if error is None:
            if done is not None:
                done.set_result(None)
        elif on_task:
            try:
                threading.Thread(target=self._fail, args=(error,), name="eccl-failure",
                                 daemon=True).start()
            except RuntimeError:
                # No thread to be had (the interpreter is exiting, or at its limit): the
                # failure is finished here, so that no wait() waits for it in vain.
                self._fail(error)
        else:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        # The recovery decides whether the failure aborted the epoch (the hooks run
        # before the failure is reported).
        try:
            if self._recovery is not None:
                self._recovery.failed(error, self._kind, self._generation)
        finally:
            with self._lock:
                self._error = error
                self._finished = True
                done = self._done
                failing = self._failing
            if done is not None:
                done.set_result(None)
            if failing is not None:
                failing.set()

    def _outcome(self, _: Future) -> Any:
        # The future torch's C++ side (DDP's reducer) waits on must fail as a future,
        # not complete with an exception object for a value: a callback that raises
        # makes torch mark it failed, and DDP then raises "AbortedError: <cause>".
        if self._error is not None:
            raise self._error
        return self._result

    # -- torch's Work -------------------------------------------------------------

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self._finished:
            # One deadline for the whole wait, however many calls it waits for.
            end = time.monotonic() + timeout.total_seconds() if timeout else None

            def left() -> Optional[float]:
                return None if end is None else max(0.0, end - time.monotonic())
            infos: Optional[List[Any]] = []
            for w in self._works:
                try:
                    infos.append(w.wait(left()))  # the GIL is released meanwhile
                except eccl.EcclError:
                    if not w.is_completed():
                        raise eccl.EcclTimeoutError(
                            f"the collective did not finish within {timeout}") from None
                    infos = None       # it failed: so does the Work, with its error
                    break
            self._finish(on_task=False, infos=infos)
            failing = self._failing
            if failing is not None and not failing.wait(left()):
                raise eccl.EcclTimeoutError(f"the collective did not finish within {timeout}")
            if failing is None and not self._finished:
                # A call that timed out here and succeeded an instant later, with calls
                # after it still running: the Work is not done, so neither is the wait.
                raise eccl.EcclTimeoutError(f"the collective did not finish within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._finished and self._failing is None \
                and all(w.is_completed() for w in self._works):
            self._finish(on_task=False)
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def get_future(self) -> Future:
        with self._lock:
            if self._fut is not None:
                return self._fut
            self._done = Future()
            self._fut = self._done.then(self._outcome)
            fut, finished = self._fut, self._finished
            watch = bool(self._works) and not finished and self._failing is None
        if finished:
            self._done.set_result(None)
        elif watch:
            # The task finishes the Work when the last call is done (at once, here, if
            # it already is).
            self._works[-1].add_done_callback(self._on_done)
        return fut

    # What `dist.recv(src=None)` asks after waiting: the rank the message came from.
    _source: int = -1

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


class _Calls:
    """The Works of one backend: makes them, and says whether eccl calls it submitted
    are still running (a communicator runs its calls in order, so the last one
    finishing means all have)."""

    def __init__(self, recovery: Any = None) -> None:
        # `recovery`: the backend's `eccl.torch_recovery.Recovery`, told of every failure.
        self._recovery = recovery
        self._last: Any = None

    def submit(self, works: List[Any], result: Any, after=None,
               kind: str = "collective") -> dist.Work:
        """A torch Work that finishes once every one of `works` (eccl Works) has: then
        `after()` runs (a copy-out step) and the future completes with `result`.
        `kind`: "collective", "p2p" or "control" (which errors abort the epoch)."""
        staging = torch_cuda.STAGING
        if staging.active and staging.waits:
            # The waits for the copies to host were queued before these calls.
            works = staging.waits + list(works)
            staging.waits = []
        if staging.active and staging.back:
            # A call on CUDA tensors staged through host copies: the device tensors
            # get the results before the Work completes, and are its result.
            pairs = torch_cuda.STAGING.back
            torch_cuda.STAGING.back = []
            inner = after

            def after() -> None:
                if inner is not None:
                    inner()
                torch_cuda.copy_back(pairs)

            result = torch_cuda.swap_result(result, pairs)
        if works:
            self._last = works[-1]
        return TorchWork(works, result, after, kind, self._recovery)

    def in_flight(self) -> bool:
        """Whether calls submitted here have not finished yet."""
        last = self._last
        return last is not None and not last.is_completed()
