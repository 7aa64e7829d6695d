"""What the Python tests share for the processes they start: a free loopback port, and
stopping every process a test started, by PID, whatever state it is in."""

import os
import signal
import socket
from typing import Dict, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> List[int]:
    """`pid` and every process below it, from /proc."""
    children: Dict[int, List[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue        # gone meanwhile
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_node(p) -> None:
    """SIGKILLs a process started with `start_new_session=True`, its session's group and
    every process below it, and reaps it. A torchrun agent starts each worker in a
    session of its own, so the agent's process group alone does not reach them."""
    try:
        os.kill(p.pid, signal.SIGSTOP)      # it starts nothing more while we look
    except ProcessLookupError:
        pass
    for q in descendants(p.pid):
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def stop_sessions(procs) -> None:
    """Kills each process as a whole node (`kill_node`): it, its process group and its
    descendants (a torchrun agent's workers among them); one that has already exited is
    only reaped."""
    for p in procs:
        if p.poll() is None:
            kill_node(p)
        else:
            p.wait()


def _state(pid: int):
    """The state letter of `pid` in /proc (R, S, T, Z, ...), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_dead(pid: int, timeout: float = 30.0) -> None:
    """Waits until `pid` has died (gone, or a zombie its parent has not reaped yet): for a
    script whose peer kills itself, the event to wait for instead of a fixed sleep."""
    _wait_state(pid, lambda s: s in (None, "Z", "X"), "die", timeout)


def wait_stopped(pid: int, timeout: float = 30.0) -> None:
    """Waits until `pid` is stopped (SIGSTOP)."""
    _wait_state(pid, lambda s: s in ("T", "t"), "stop", timeout)


def _wait_state(pid, ok, what, timeout):
    import time
    end = time.monotonic() + timeout
    while not ok(_state(pid)):
        if time.monotonic() > end:
            raise TimeoutError(f"process {pid} did not {what} within {timeout} s")
        time.sleep(0.005)
