"""The torch backend's Work (`eccl.torch_work.TorchWork`) on stand-in eccl calls: who
finishes it (the waiter, or the communicator's task when torch waits on the future),
that it finishes once, and that a failure reaches the recovery once and off the task.
The real calls run in test_torch_backend.py and test_conformance.py; the task's side of
`add_done_callback` in test_api.py."""

import threading

import pytest

torch = pytest.importorskip("torch")

import eccl  # noqa: E402
from eccl.torch_work import TorchWork, _Calls  # noqa: E402


class Info:
    peer = None


class Call:
    """What TorchWork uses of an eccl.Work. `finish()` plays the communicator's task:
    it sets the outcome, then runs the callbacks on the thread that calls it."""

    def __init__(self):
        self._done = threading.Event()
        self._error = None
        self._callbacks = []
        self._lock = threading.Lock()

    def finish(self, error=None):
        with self._lock:
            self._error = error
            self._done.set()
            cbs, self._callbacks = self._callbacks, []
        for fn, errors_only in cbs:
            if error is not None or not errors_only:
                fn()

    def is_completed(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise eccl.EcclTimeoutError("waiting for the call (it goes on)")
        if self._error is not None:
            raise self._error
        return Info()

    def add_done_callback(self, fn, errors_only=False):
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append((fn, errors_only))
                return
        if self._error is not None or not errors_only:
            fn()


class Recovery:
    def __init__(self, gate=None):
        self.failed_with = []
        self.threads = []
        self.gate = gate
        self.generation = 3

    def failed(self, error, kind, generation):
        assert generation == 3      # the world the call was made in
        self.threads.append(threading.current_thread())
        if self.gate is not None:
            self.gate.wait(10)
        self.failed_with.append((type(error), kind))


def on_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    t.join(10)
    assert not t.is_alive()
    return t


def test_wait_finishes_the_work_on_the_waiters_thread_and_the_future_with_it():
    calls, ran = [Call(), Call()], []
    w = TorchWork(calls, result="r", after=lambda: ran.append(threading.current_thread()))
    assert not w.is_completed()
    on_thread(lambda: [c.finish() for c in calls])   # the task: no callback for success
    assert ran == []
    assert w.wait() is True
    assert ran == [threading.current_thread()]
    fut = w.get_future()
    assert fut.done() and fut.value() == "r"
    w.wait()
    assert len(ran) == 1 and w.is_success()


def test_a_future_asked_for_first_is_completed_by_the_task():
    calls, ran = [Call(), Call()], []
    w = TorchWork(calls, result=[1], after=lambda: ran.append(threading.current_thread()))
    fut = w.get_future()
    calls[0].finish()
    assert not fut.done()
    task = on_thread(calls[1].finish)
    assert fut.done() and fut.value() == [1]
    assert ran == [task]
    assert w.is_completed() and w.wait() is True and len(ran) == 1


def test_a_failure_reaches_the_recovery_once_off_the_task_and_fails_wait_and_future():
    gate = threading.Event()
    rec = Recovery(gate)
    calls = [Call(), Call()]
    w = TorchWork(calls, result=None, kind="p2p", recovery=rec)
    fut = w.get_future()
    task = on_thread(lambda: calls[0].finish(eccl.AbortedError("peer died")))
    # The task handed the failure to a thread of its own; the hooks (the recovery)
    # hold it until the gate opens, and the Work is not finished before they ran.
    assert not w.is_completed() and not fut.done()
    gate.set()
    with pytest.raises(eccl.AbortedError):
        w.wait()
    assert rec.failed_with == [(eccl.AbortedError, "p2p")]
    assert rec.threads and rec.threads[0] is not task
    assert fut.done()
    with pytest.raises(RuntimeError, match="peer died"):
        fut.wait()
    calls[1].finish(eccl.AbortedError("later"))           # the second call fails too
    with pytest.raises(eccl.AbortedError, match="peer died"):
        w.wait()
    assert rec.failed_with == [(eccl.AbortedError, "p2p")]


def test_a_failure_the_waiter_sees_first_runs_the_recovery_on_the_waiter():
    rec = Recovery()
    call = Call()
    w = TorchWork([call], recovery=rec)
    call._error = eccl.MismatchError("counts differ")    # done, callbacks not run yet
    call._done.set()
    with pytest.raises(eccl.MismatchError):
        w.wait()
    assert rec.threads == [threading.current_thread()]
    call.finish(call._error)                             # the task's callback: too late
    assert len(rec.failed_with) == 1


def test_wait_with_a_timeout_raises_and_the_work_goes_on():
    from datetime import timedelta
    call = Call()
    w = TorchWork([call])
    with pytest.raises(eccl.EcclTimeoutError):
        w.wait(timedelta(milliseconds=20))
    call.finish()
    assert w.wait() is True


def test_in_flight_follows_the_last_call():
    calls = _Calls()
    assert not calls.in_flight()
    a, b = Call(), Call()
    calls.submit([a], None)
    calls.submit([b], None)
    a.finish()
    assert calls.in_flight()
    b.finish()
    assert not calls.in_flight()
    w = calls.submit([], "x", after=None)
    assert w.is_completed() and w.get_future().value() == "x"


def test_a_control_call_is_finished_by_the_task_also_when_nobody_waits():
    """A reconfigure's Work adopts the new world in its copy-out step: the task runs it
    when the call succeeds, whether or not anyone waits on the Work or its future."""
    adopted = []
    call = Call()
    work = TorchWork([call], None, lambda: adopted.append(True), kind="control")
    assert adopted == [] and not work.is_completed()
    call.finish()
    assert adopted == [True] and work.is_completed()
    work.wait()                       # finished once: the step does not run again
    assert adopted == [True]
    # A collective's Work is left to its waiter (or its future) when it succeeds.
    ran, call = [], Call()
    work = TorchWork([call], None, lambda: ran.append(True))
    call.finish()
    assert ran == []
    work.wait()
    assert ran == [True]


def test_a_wait_with_a_timeout_keeps_one_deadline_for_all_its_calls():
    """wait(timeout) on a Work of two calls gives up at the timeout, not at the first
    call's time plus a full timeout for the second."""
    import time
    from datetime import timedelta

    first, second = Call(), Call()
    work = TorchWork([first, second])
    threading.Timer(0.3, first.finish).start()
    t = time.monotonic()
    with pytest.raises(eccl.EcclTimeoutError):
        work.wait(timedelta(seconds=0.5))
    took = time.monotonic() - t
    assert 0.45 < took < 0.75, took
    second.finish()
    assert work.wait()
