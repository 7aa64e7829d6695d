"""Starting eccl masters as processes for the examples: one in-memory master, or a raft
cluster of three with data directories. Used by elastic_torchrun.py and store_bench.py."""

import os
import re
import subprocess
import sys
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_BIN = os.path.join(ROOT, "target", "release", "eccl-master")
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
from procs import free_port  # noqa: E402


def write_secret(path: str) -> str:
    """A fresh random secret in `path` (mode 0600, as eccl requires); returns it."""
    secret = os.urandom(24).hex()
    with open(path, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    return secret


class Masters:
    """`n` (1 or 3) eccl-master processes of one job, logging into `workdir`."""

    def __init__(self, n: int, workdir: str, secret_file: str, binary: str = DEFAULT_BIN):
        self.procs: List[Optional[subprocess.Popen]] = [None] * n
        self.clients = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        self.binary, self.workdir = binary, workdir
        self.env = dict(os.environ, ECCL_SECRET_FILE=secret_file)
        os.makedirs(workdir, exist_ok=True)
        if n == 1:
            self.cmds = [[binary, "--listen", self.clients[0], "--secret-file", secret_file]]
        else:
            cs = os.path.join(workdir, "cluster-secret")
            write_secret(cs)
            rafts = [f"127.0.0.1:{free_port()}" for _ in range(n)]
            spec = ",".join(f"{i + 1}={c}/{r}" for i, (c, r) in enumerate(zip(self.clients, rafts)))
            self.cmds = [[binary, "--node-id", str(i + 1), "--listen", self.clients[i],
                          "--masters", spec, "--cluster-secret-file", cs,
                          "--secret-file", secret_file,
                          "--data-dir", os.path.join(workdir, f"m{i + 1}")] for i in range(n)]
        for i in range(n):
            self.start(i)

    def start(self, i: int) -> None:
        """Starts master `i` (again: from its data directory, with its log appended)."""
        log = open(os.path.join(self.workdir, f"master{i + 1}.log"), "a")
        self.procs[i] = subprocess.Popen(self.cmds[i], stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)

    @property
    def endpoint(self) -> str:
        return ",".join(self.clients)

    def leader(self) -> Optional[int]:
        """The index of the raft leader, as `eccl-master cluster status` reports it."""
        out = subprocess.run([self.binary, "cluster", "status", "--master", self.endpoint],
                             env=self.env, capture_output=True, text=True, timeout=20).stdout
        m = re.search(r"^leader: (\d+)", out, re.M)
        return int(m.group(1)) - 1 if m else None

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
