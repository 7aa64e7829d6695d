"""A cluster of three masters run by `eccl.Master` in this process: peers (plain
communicators, and torch ranks through the "eccl" backend) are given every master's
address, the leader is shut down while they work, and they go on with the next one."""

import json
import os
import subprocess
import sys
import textwrap
import time

import eccl
import pytest
from procs import free_port  # noqa: E402

TIMEOUT = 90
CLUSTER_SECRET = "python-test-cluster-secret-0123456789"


def start_cluster(tmp_path):
    ports = [(free_port(), free_port()) for _ in range(3)]
    spec = ",".join(f"{i + 1}=127.0.0.1:{c}/127.0.0.1:{r}" for i, (c, r) in enumerate(ports))
    secret = "python-test-job-secret-0123456789abcdef"
    masters = [eccl.Master(f"127.0.0.1:{c}", secret, node_id=i + 1, masters=spec,
                           cluster_secret=CLUSTER_SECRET, data_dir=str(tmp_path / f"m{i + 1}"))
               for i, (c, _) in enumerate(ports)]
    return masters, secret


def leader(masters, wait=10.0):
    end = time.time() + wait
    while time.time() < end:
        for m in masters:
            if m.is_leader():
                return m
        time.sleep(0.02)
    raise AssertionError("no master leads")


def run_ranks(script, n, env, go_file, on_ready):
    """Starts n copies of `script` (argv: rank, n, go_file); once every one printed READY,
    calls `on_ready()` and creates `go_file`; returns their RESULT JSON."""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(n), str(go_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(n)]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.startswith("READY"), (line, p.stderr.read() if p.poll() else "")
        on_ready()
        go_file.write_text("go")
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = []
    for p, (out, err) in zip(procs, outs):
        printed = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert printed and (p.returncode == 0 or "terminate called" in err), \
            f"exit {p.returncode}\n{out}\n{err[-3000:]}"
        res.append(json.loads(printed[-1][7:]))
    return res


WAIT = """
def wait_for(go):
    import os, time
    while not os.path.exists(go):
        time.sleep(0.02)
"""


def test_a_master_of_a_cluster_is_refused_without_its_parts():
    with pytest.raises(eccl.InvalidArgumentError, match="cluster_secret"):
        eccl.Master("127.0.0.1:0", node_id=1, masters="1=127.0.0.1:1/127.0.0.1:2")
    with pytest.raises(eccl.InvalidArgumentError, match="node_id 4"):
        eccl.Master("127.0.0.1:0", node_id=4, masters="1=127.0.0.1:1/127.0.0.1:2",
                    cluster_secret=CLUSTER_SECRET)


def test_communicators_go_on_when_the_leading_master_stops(tmp_path):
    masters, secret = start_cluster(tmp_path)
    try:
        old = leader(masters)
        listed = ",".join(m.addr for m in masters)
        script = textwrap.dedent(f"""
            import sys, json, numpy as np, eccl
            rank, n, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
            comm = eccl.Communicator({listed!r}, {secret!r}, rank_hint=rank, min_world=n)
            comm.update_topology()
            a = np.ones(1000, np.float32) * (rank + 1)
            comm.all_reduce(a)
            print("READY", flush=True)
        """) + WAIT + textwrap.dedent("""
            wait_for(go)
            # The leader is gone: collectives need no master; membership goes to the
            # next leader.
            b = np.ones(1000, np.float32)
            comm.all_reduce(b)
            u = comm.update_topology()
            c = np.ones(1000, np.float32) * 2
            comm.all_reduce(c)
            print("RESULT " + json.dumps({"a": float(a[0]), "b": float(b[0]),
                  "c": float(c[0]), "world": u.world_size}), flush=True)
        """)
        res = run_ranks(script, 2, dict(os.environ), tmp_path / "go", old.shutdown)
        # update_topology after the stop (the world of 2) was answered by another master.
        assert res == [{"a": 3.0, "b": 2.0, "c": 4.0, "world": 2}] * 2
        # And one of the two others leads (leader() fails after 10 s without one).
        leader([m for m in masters if m is not old])
    finally:
        for m in masters:
            m.shutdown()


def test_torch_ranks_point_at_an_external_master_cluster(tmp_path):
    pytest.importorskip("torch")
    masters, secret = start_cluster(tmp_path)
    try:
        old = leader(masters)
        script = textwrap.dedent("""
            import sys, json, torch, torch.distributed as dist, eccl.torch
            rank, n, go = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
            dist.init_process_group("eccl", rank=rank, world_size=n)
            t = torch.ones(3) * (rank + 1)
            dist.all_reduce(t)
            print("READY", flush=True)
        """) + WAIT + textwrap.dedent("""
            wait_for(go)
            u = torch.ones(3)
            dist.all_reduce(u)
            dist.barrier()
            print("RESULT " + json.dumps({"t": t.tolist(), "u": u.tolist()}), flush=True)
            dist.destroy_process_group()
        """)
        env = dict(os.environ, ECCL_MASTER=",".join(m.addr for m in masters),
                   ECCL_SECRET=secret, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        res = run_ranks(script, 2, env, tmp_path / "go", old.shutdown)
        assert res == [{"t": [3.0] * 3, "u": [2.0] * 3}] * 2
    finally:
        for m in masters:
            m.shutdown()


def test_the_packages_eccl_master_and_python_m_eccl_work_as_documented(tmp_path):
    """`eccl-master` (the package's console script) creates the secret file it is given
    (owner-only) and serves a peer with it until SIGTERM; a secret file others may read
    is refused, naming the file; `python -m eccl` reports the installation."""
    exe = os.path.join(os.path.dirname(sys.executable), "eccl-master")
    assert os.path.exists(exe), "the package installs an eccl-master command"
    secret_file = tmp_path / "dir" / "secret"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECCL_")}
    p = subprocess.Popen([exe, "--listen", "127.0.0.1:0", "--secret-file", str(secret_file)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("eccl-master listening on "), (line, p.stderr.read() if p.poll() else "")
        assert os.stat(secret_file).st_mode & 0o777 == 0o600
        secret = secret_file.read_text().strip()
        assert len(secret) == 64 and int(secret, 16) >= 0
        comm = eccl.Communicator(line.split()[-1], secret, min_world=1)
        update = comm.update_topology()
        assert (update.rank, update.world_size) == (0, 1)
        comm.leave()
        p.terminate()
        assert p.wait(timeout=TIMEOUT) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    os.chmod(secret_file, 0o644)
    bad = subprocess.run([exe, "--listen", "127.0.0.1:0", "--secret-file", str(secret_file)],
                         capture_output=True, text=True, env=env, timeout=TIMEOUT)
    assert bad.returncode == 1 and str(secret_file) in bad.stderr, bad.stderr
    info = subprocess.run([sys.executable, "-m", "eccl"], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT)
    assert info.returncode == 0, info.stderr
    assert info.stdout.startswith("eccl 0.1.0, native module ") and "ECCL_MASTER" in info.stdout
