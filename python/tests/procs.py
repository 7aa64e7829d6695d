"""What the Python tests share for the processes they start: a free loopback port, and
stopping every process a test started, by PID, whatever state it is in."""

import os
import signal
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_sessions(procs) -> None:
    """SIGKILLs each process's whole session (each was started with
    `start_new_session=True`, so this reaches a torchrun agent's workers too) and reaps
    it; a process that has already exited is only reaped."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
