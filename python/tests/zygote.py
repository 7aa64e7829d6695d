"""The test suite's zygote: one Python process that has imported torch, and forks the
suite's worker processes from there (procs.spawn).

Each rank, survivor and newcomer a test starts is a Python process that imports torch,
which costs about 3 CPU seconds on this wheel (and about 1 more at interpreter exit),
most of the Python tests' CPU time on a 2-core machine. A child forked from here starts
with torch already imported and ends with os._exit after the exit steps a normal
interpreter takes (waiting for its non-daemon threads, then its atexit functions). It
is still a process of its own, with its own pid, arguments, environment, working
directory and standard streams, killed and stopped by pid like any other; eccl itself
is imported in the child (it reads its ECCL_* variables then), never here.

    zygote.py FD      FD: this end of a SOCK_SEQPACKET socket pair (procs.py holds the other)

Requests (JSON, with the child's stdin, stdout and stderr as SCM_RIGHTS fds):
    {"argv": [python, script | "-c" code | "-m" module, args...], "env": {...},
     "cwd": dir, "new_session": bool}
Replies and notices (JSON): {"ready": pid} once torch is imported, {"spawned": pid} per
request, {"exit": pid, "status": waitstatus} when a child ends. End of file on the
socket ends the zygote: the test run ended, or was killed (the kernel closes its end;
no parent-death signal, which fires when the thread that started the zygote ends)."""

import json
import os
import select
import signal
import socket
import sys


def child(sock: socket.socket, wake_r: int, wake_w: int, req: dict, fds: list) -> None:
    """In the forked child: becomes the process `req` describes, runs it, exits."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r)
    os.close(wake_w)
    sock.close()
    if req.get("new_session"):
        os.setsid()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    code = run(req["argv"][1:])
    os._exit(code)


def run(args: list) -> int:
    """Runs `python ARGS` in this interpreter and takes a normal exit's steps; returns the
    exit status."""
    import atexit
    import runpy
    import threading

    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            main = {"__name__": "__main__", "__builtins__": __builtins__}
            exec(compile(args[1], "<string>", "exec"), main)
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(args[1])  # what `python -m` itself calls
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()     # non-daemon threads end first, as at a normal exit
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    return code


def exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import torch  # noqa: F401 - what every child would import first
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.optim  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    send = lambda msg: sock.send(json.dumps(msg).encode())  # noqa: E731
    send({"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exit": pid, "status": status})
        if sock in readable:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:
                return            # the test run ended
            req = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    child(sock, wake_r, wake_w, req, fds)
                except BaseException:  # noqa: BLE001 - onto the child's own stderr
                    sys.excepthook(*sys.exc_info())
                    sys.stderr.flush()
                finally:
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            send({"spawned": pid})


if __name__ == "__main__":
    main()
