"""What the Python tests share for the processes they start: starting Python workers
(`spawn`, forked from the suite's zygote), a free loopback port, and stopping every
process a test started, by PID, whatever state it is in."""

import collections
import io
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

# Set by conftest.py where two pytest processes run at once (.ci/test.sh: `-m beside`
# and `-m "not beside"`): each takes only ports of its own parity, so a port one process
# probed is never handed to the other; the examples they run inherit it through
# TEST_PORT_CLASS.
PORT_CLASS: Optional[int] = (int(os.environ["TEST_PORT_CLASS"]) & 1
                             if os.environ.get("TEST_PORT_CLASS", "").isdigit() else None)
_NEXT = 0


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on now, for a process started later (a master, a
    torchrun store, one restarted on its old port).

    Taken below the kernel's ephemeral range, where neither a bind to port 0 nor an
    outgoing connection gets its port, so it stays free until the process binds it (a
    port from a bind to port 0 once went to another connection in between: "address
    already in use"). This process walks the range from a start of its own (its PID)
    and never hands out a port twice."""
    global _NEXT
    high = _ephemeral_low()
    low = max(1024, high - 16384)
    if high <= low + 1024:
        # Nearly every port is ephemeral here: the kernel's choice is all there is.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    span = high - low
    start = (os.getpid() * 2654435761) % span
    while _NEXT < span:
        port = low + (start + _NEXT) % span
        _NEXT += 1
        if PORT_CLASS is not None and port & 1 != PORT_CLASS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {low}..{high}")


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


def read_until(p, text: str, timeout: float) -> str:
    """Reads `p`'s stdout line by line until a line contains `text` or `timeout` seconds
    pass; returns the last line read (check it for `text`)."""
    deadline = time.time() + timeout
    line = ""
    while text not in line and time.time() < deadline:
        line = p.stdout.readline()
    return line


def outputs(procs, timeout: float) -> List[str]:
    """Waits for each of `procs` (stdout piped, as text) and returns what each printed;
    a process that did not exit 0 fails the test with the end of its output."""
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


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


# -- Python workers forked from the zygote (zygote.py) --------------------------------

def spawn(argv, env=None, stdin=None, stdout=None, stderr=None, text=False, cwd=None,
          start_new_session=False):
    """`subprocess.Popen(argv, ...)` for a worker of this interpreter
    (`[sys.executable, script | "-c" code | "-m" module, ...]`): forked from the suite's
    zygote, which has imported torch already (zygote.py says why), and returned as an
    object with Popen's pid, args, returncode, stdin/stdout/stderr, poll, wait,
    communicate, send_signal, kill and terminate. Anything else, or any argv with
    TEST_ZYGOTE=0 in the test run's environment, is started by subprocess.Popen."""
    forkable = (argv and argv[0] == sys.executable and len(argv) >= 2
                and (argv[1] in ("-c", "-m") or not argv[1].startswith("-"))
                and os.environ.get("TEST_ZYGOTE", "1") != "0")
    if not forkable:
        return subprocess.Popen(argv, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                text=text, cwd=cwd, start_new_session=start_new_session)
    return Forked(_the_zygote(), [str(a) for a in argv], env, stdin, stdout, stderr, text,
                  cwd, start_new_session)


def run(argv, timeout=None, input=None, capture_output=False, text=False, cwd=None, env=None):
    """`subprocess.run(argv, ...)` through `spawn`: the process is killed (by pid) if it
    outlives `timeout`, and TimeoutExpired raised."""
    pipe = subprocess.PIPE if capture_output else None
    p = spawn(argv, env=env, stdin=subprocess.PIPE if input is not None else None,
              stdout=pipe, stderr=pipe, text=text, cwd=cwd)
    try:
        out, err = p.communicate(input, timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


_zygote = None
_zygote_lock = threading.Lock()


def _the_zygote() -> "_Zygote":
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.dead:
            _zygote = _Zygote()
        return _zygote


class _Zygote:
    """The client of one zygote process: sends it requests, and keeps the exit status of
    every child it reports (a reader thread)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py")), str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.cond = threading.Condition()
        self.exited: Dict[int, int] = {}
        self.replies: collections.deque = collections.deque()
        self.dead = False
        self.spawning = threading.Lock()
        threading.Thread(target=self._read, name="zygote", daemon=True).start()
        self._reply("ready", 180)

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                msg = b""
            with self.cond:
                if not msg:
                    self.dead = True
                    self.cond.notify_all()
                    return
                m = json.loads(msg)
                if "exit" in m:
                    self.exited[m["exit"]] = m["status"]
                else:
                    self.replies.append(m)
                self.cond.notify_all()

    def _reply(self, key: str, timeout: float) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.replies or self.dead, timeout)
            if not self.replies:
                code = self.proc.poll()
                raise RuntimeError(f"the test zygote (zygote.py) did not answer: exit {code}")
            return self.replies.popleft()[key]

    def spawn(self, req: dict, fds: List[int]) -> int:
        with self.spawning:
            socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
            return self._reply("spawned", 60)

    def status(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The wait status of child `pid` once it has ended (None: not within `timeout`)."""
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exited or self.dead, timeout)
            if pid in self.exited:
                return self.exited[pid]
            if self.dead:
                raise RuntimeError(f"the test zygote ended before its child {pid} did")
            return None


class Forked:
    """A process forked from the zygote, with the part of subprocess.Popen's interface the
    tests use."""

    def __init__(self, zygote, argv, env, stdin, stdout, stderr, text, cwd, new_session):
        self._zygote = zygote
        self.args = argv
        self.returncode: Optional[int] = None
        self._text = text
        self._comm: Optional[list] = None
        child_fds, ours, close = [], [], []
        for i, spec in enumerate((stdin, stdout, stderr)):
            mine = None
            if spec is None:
                fd = i
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                fd, mine = (r, w) if i == 0 else (w, r)
                close.append(fd)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                close.append(fd)
            elif spec == subprocess.STDOUT and i == 2:
                fd = child_fds[1]
            else:
                fd = spec if isinstance(spec, int) else spec.fileno()
            child_fds.append(fd)
            ours.append(mine)
        try:
            self.pid = zygote.spawn({"argv": argv, "env": dict(os.environ if env is None else env),
                                     "cwd": str(cwd or os.getcwd()), "new_session": new_session},
                                    child_fds)
        finally:
            for fd in close:
                os.close(fd)
        self.stdin = self._wrap(ours[0], "wb")
        self.stdout = self._wrap(ours[1], "rb")
        self.stderr = self._wrap(ours[2], "rb")

    def _wrap(self, fd, mode):
        if fd is None:
            return None
        f = io.open(fd, mode)
        if self._text:
            enc = locale.getpreferredencoding(False)
            return io.TextIOWrapper(f, encoding=enc, write_through="w" in mode)
        return f

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            status = self._zygote.status(self.pid, 0)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            status = self._zygote.status(self.pid, timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def communicate(self, input=None, timeout: Optional[float] = None):
        """Writes `input` (then closes stdin), reads stdout and stderr to their ends, and
        waits; on TimeoutExpired it may be called again, as Popen's."""
        import time
        if self._comm is None:
            got: Dict[str, list] = {"stdout": [], "stderr": []}
            threads = []
            for name in ("stdout", "stderr"):
                f = getattr(self, name)
                if f is not None:
                    threads.append(threading.Thread(
                        target=lambda f=f, buf=got[name]: buf.append(f.read()), daemon=True))
            if self.stdin is not None:
                def feed(f=self.stdin):
                    try:
                        if input:
                            f.write(input)
                        f.close()
                    except BrokenPipeError:
                        pass
                threads.append(threading.Thread(target=feed, daemon=True))
            for t in threads:
                t.start()
            self._comm = [threads, got]
        threads, got = self._comm
        end = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        outs = []
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is None:
                outs.append(None)
                continue
            # Text streams translate newlines as they read (TextIOWrapper's default).
            data = got[name][0] if got[name] else ("" if self._text else b"")
            f.close()
            outs.append(data)
        return outs[0], outs[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()
