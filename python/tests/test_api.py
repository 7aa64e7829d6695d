"""The eccl Python package: an embedded master, communicators in several processes,
every collective on numpy arrays and CPU torch tensors, async handles, shared state,
typed errors, and a clean exit with work in flight."""

import os
import subprocess
import sys
import textwrap

import eccl
import numpy as np
import pytest

TIMEOUT = 60


def _run_ranks(n, body, extra_env=None, rank_env=None, may_fail=(), master_args=None):
    """Runs `body(comm, rank, n)` (source text of a function) in n processes against one
    embedded master (made with `master_args`); returns their results. `rank_env`: extra
    environment by rank; ranks in `may_fail` may exit with an error (their result is
    None)."""
    master = eccl.Master(**(master_args or {}))
    script = textwrap.dedent(f"""
        import sys, json, numpy as np, eccl
        rank = int(sys.argv[1]); n = int(sys.argv[2])
        comm = eccl.Communicator({master.addr!r}, {master.secret!r}, rank_hint=rank, min_world=n)
        comm.update_topology()
        assert comm.rank == rank, (comm.rank, rank)
    """) + textwrap.dedent(body) + "\nprint('RESULT', json.dumps(main(comm, rank, n)))\n"
    envs = [dict(os.environ, **(extra_env or {}), **(rank_env or {}).get(r, {})) for r in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=envs[r])
             for r in range(n)]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        master.shutdown()
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        if r in may_fail and p.returncode != 0:
            results.append(None)
            continue
        assert p.returncode == 0, f"rank failed ({p.returncode}):\n{out}\n{err}"
        line = [l for l in out.splitlines() if l.startswith("RESULT ")][-1]
        import json
        results.append(json.loads(line[len("RESULT "):]))
    return results


def test_every_collective_on_numpy_and_torch():
    body = """
    import torch
    def main(comm, rank, n):
        out = {}
        # all_reduce in place, numpy and torch, several dtypes and ops
        a = np.arange(10, dtype=np.float32) + rank
        info = comm.all_reduce(a)
        out["ar"] = a.tolist(); out["members"] = len(info.members)
        t = torch.full((5,), rank + 1, dtype=torch.int64)
        comm.all_reduce(t, "max"); out["ar_max"] = t.tolist()
        b = torch.ones(3, dtype=torch.bfloat16) * (rank + 1)
        comm.all_reduce(b, "sum"); out["bf16"] = b.float().tolist()
        # broadcast / reduce
        x = np.full(4, rank, dtype=np.float64); comm.broadcast(x, root=1); out["bc"] = x.tolist()
        y = np.full(4, rank + 1, dtype=np.int32); comm.reduce(y, root=0); out["red"] = y.tolist()
        # all_gather / reduce_scatter / all_to_all
        g = np.empty(2 * n, dtype=np.float32); comm.all_gather(g, np.full(2, rank, dtype=np.float32))
        out["ag"] = g.tolist()
        rs = np.empty(2, dtype=np.float32); comm.reduce_scatter(rs, np.arange(2 * n, dtype=np.float32))
        out["rs"] = rs.tolist()
        a2a = np.empty(n, dtype=np.int64); comm.all_to_all(a2a, np.arange(n, dtype=np.int64) + 10 * rank)
        out["a2a"] = a2a.tolist()
        # all_to_all with split sizes: rank s sends rank t s + t + 1 elements of value
        # 100 s + t (rank 0 sends itself one, nothing padded)
        sends = [rank + t + 1 for t in range(n)]
        recvs = [s + rank + 1 for s in range(n)]
        inp = torch.cat([torch.full((k,), 100.0 * rank + t) for t, k in enumerate(sends)])
        v = torch.empty(sum(recvs))
        comm.all_to_all(v, inp, send_counts=sends, recv_counts=recvs)
        out["a2av"] = v.tolist()
        # gather / scatter
        ga = np.empty(n, dtype=np.float32) if rank == 0 else None
        comm.gather(ga, np.full(1, rank, dtype=np.float32), root=0)
        out["gather"] = ga.tolist() if ga is not None else None
        sc = np.empty(1, dtype=np.float32)
        comm.scatter(sc, np.arange(n, dtype=np.float32) * 2 if rank == 0 else None, root=0)
        out["scatter"] = sc.tolist()
        # the list forms: one buffer per rank, read and written where they lie
        lst = [np.full(2, -1.0, dtype=np.float32) for _ in range(n)]
        comm.all_gather(lst, np.full(2, rank, dtype=np.float32))
        out["ag_list"] = [b.tolist() for b in lst]
        rs = np.empty(2, dtype=np.float32)
        comm.reduce_scatter(rs, [np.arange(2, dtype=np.float32) + 2 * q for q in range(n)])
        out["rs_list"] = rs.tolist()
        one = np.full(2, rank + 1.0, dtype=np.float32)
        comm.reduce_scatter(rs, [one] * n)    # what is only read may repeat
        out["rs_same"] = rs.tolist()
        lst = [torch.empty(1, dtype=torch.int64) for _ in range(n)]
        comm.all_to_all(lst, tuple(torch.full((1,), 10 * rank + q) for q in range(n)))
        out["a2a_list"] = [int(b) for b in lst]
        lst = [torch.empty(s + rank + 1) for s in range(n)]
        comm.all_to_all(lst, [torch.full((k,), 100.0 * rank + t) for t, k in enumerate(sends)],
                        send_counts=sends, recv_counts=recvs)
        out["a2av_list"] = [b.tolist() for b in lst]
        ga = [np.empty(1, dtype=np.float32) for _ in range(n)] if rank == 0 else None
        comm.gather(ga, np.full(1, rank, dtype=np.float32), root=0)
        out["gather_list"] = [b.tolist() for b in ga] if ga is not None else None
        sc = np.empty(1, dtype=np.float32)
        comm.scatter(sc, [np.full(1, 2.0 * q, dtype=np.float32) for q in range(n)] if rank == 0 else None, root=0)
        out["scatter_list"] = sc.tolist()
        comm.barrier()
        # send / recv around the ring, async
        s = np.full(3, rank, dtype=np.float32); r = np.empty(3, dtype=np.float32)
        ws = comm.send(s, (rank + 1) % n, tag=7, async_op=True)
        wr = comm.recv(r, (rank - 1) % n, tag=7, async_op=True)
        ws.wait(); wr.wait(); out["ring"] = r.tolist()
        # async all_reduce returns a Work at once
        big = np.ones(1 << 20, dtype=np.float32)
        w = comm.all_reduce(big, async_op=True)
        info = w.wait(); out["async"] = float(big[0]); out["done"] = w.is_completed()
        out["epoch"] = info.epoch
        return out
    """
    n = 3
    res = _run_ranks(n, body)
    assert len({r["epoch"] for r in res}) == 1 and res[0]["epoch"] >= 1, res
    for rank, r in enumerate(res):
        assert r["ar"] == [float(3 * i + 3) for i in range(10)]
        assert r["members"] == n
        assert r["ar_max"] == [n] * 5
        assert r["bf16"] == [6.0] * 3
        assert r["bc"] == [1.0] * 4
        assert r["red"] == ([6] * 4 if rank == 0 else [rank + 1] * 4)
        assert r["ag"] == [float(q) for q in range(n) for _ in range(2)]
        assert r["rs"] == [float(n * (2 * rank)), float(n * (2 * rank + 1))]
        assert r["a2a"] == [10 * src + rank for src in range(n)]
        assert r["a2av"] == [100.0 * s + rank for s in range(n) for _ in range(s + rank + 1)]
        assert r["gather"] == ([0.0, 1.0, 2.0] if rank == 0 else None)
        assert r["scatter"] == [2.0 * rank]
        assert r["ag_list"] == [[float(q)] * 2 for q in range(n)]
        assert r["rs_list"] == r["rs"]
        assert r["rs_same"] == [float(sum(range(1, n + 1)))] * 2
        assert r["a2a_list"] == r["a2a"]
        assert r["a2av_list"] == [[100.0 * s + rank] * (s + rank + 1) for s in range(n)]
        assert r["gather_list"] == ([[0.0], [1.0], [2.0]] if rank == 0 else None)
        assert r["scatter_list"] == r["scatter"]
        assert r["ring"] == [float((rank - 1) % n)] * 3
        assert r["async"] == float(n) and r["done"]


def test_shared_state_brings_everyone_to_the_newest_revision():
    body = """
    import torch
    def main(comm, rank, n):
        w = torch.zeros(300_000) if rank == 2 else torch.arange(300_000, dtype=torch.float32)
        m = np.zeros(10, dtype=np.int64) if rank == 2 else np.arange(10, dtype=np.int64)
        info = comm.sync_shared_state(0 if rank == 2 else 5, {"w": w, "m": m})
        return {"rev": info.revision, "hash": info.hash, "w": float(w.double().sum()), "m": m.tolist(),
                "recv": info.bytes_received, "sources": len(info.sources)}
    """
    res = _run_ranks(3, body)
    assert len({r["hash"] for r in res}) == 1
    for r in res:
        assert r["rev"] == 5 and r["m"] == list(range(10))
        assert r["w"] == float(sum(range(300_000)))
    assert res[2]["recv"] == 300_000 * 4 + 80 and res[2]["sources"] == 2


def test_a_dropped_work_never_writes_into_reused_memory(tmp_path):
    """A use-after-free once: a recv whose Work is dropped and collected before the
    data arrives, then memory that eccl was never given; and the same with Works and
    tensors of in-flight all_reduces dropped twenty times under gc.collect(). The calls
    own their buffers until they are done, so no other memory changes."""
    body = """
    import gc, os, time, torch
    def main(comm, rank, n):
        N, M, ROUNDS = 1 << 24, 1 << 20, 20
        canaries = []
        dropped = os.path.join(os.environ["TEST_DIR"], "dropped")
        if rank == 0:
            while not os.path.exists(dropped):    # rank 1's Work is gone: now send
                time.sleep(0.005)
            comm.send(np.full(N, 7.0, np.float32), 1)
        else:
            w = comm.recv(np.empty(N, np.float32), 0, async_op=True)
            del w
            gc.collect()
            canaries.append(np.zeros(N, np.float32))
            open(dropped, "w").close()
        for i in range(ROUNDS):
            if i % 2 == rank:
                time.sleep(0.02)        # the other rank's call is in flight meanwhile
            t = np.full(M, 1.0, np.float32) if i % 4 < 2 else torch.ones(M)
            w = comm.all_reduce(t, async_op=True)
            del w, t
            gc.collect()
            canaries.append(np.zeros(M, np.float32))
            canaries.append(torch.zeros(M))
        comm.barrier()                  # calls run in order: everything before is done
        return {"changed": sum(int((c != 0).sum()) for c in canaries), "n": len(canaries)}
    """
    res = _run_ranks(2, body, {"TEST_DIR": str(tmp_path)})
    assert res[1]["n"] == 41 and res[0]["n"] == 40
    assert [r["changed"] for r in res] == [0, 0]


@pytest.mark.parametrize("transport", ["tcp", "shm", "quic"])
def test_a_send_just_before_exit_is_delivered(transport):
    """Rank 0 sends and its interpreter exits at once: at exit its links close in order,
    so the message arrives on every transport (QUIC's send buffers live in the process,
    unlike a TCP socket's)."""
    body = """
    def main(comm, rank, n):
        x = np.arange(1 << 20, dtype=np.float32)
        if rank == 0:
            comm.send(x, 1)
            return {"transport": comm.transport}
        y = np.empty_like(x)
        comm.recv(y, 0)
        return {"intact": bool((y == x).all()), "transport": comm.transport}
    """
    res = _run_ranks(2, body, {"ECCL_TRANSPORT": transport})
    assert res[1]["intact"]
    assert [r["transport"] for r in res] == [transport, transport]


def test_a_killed_shm_peer_whose_child_holds_its_socket_is_found_at_once(tmp_path):
    """Rank 2 forks a child (as a DataLoader forks its workers: the child holds copies of
    every socket) and is SIGKILLed while the others wait for it in an all_reduce over
    shared memory. Its sockets do not end (the child holds them), so the link watches
    the process itself (its pidfd): the survivors fail at once with AbortedError, not at
    the lease (10 s here; they used to)."""
    body = """
    def main(comm, rank, n):
        import os, signal, time
        x = np.ones(4, dtype=np.float32)
        if rank == 2:
            child = os.fork()
            if child == 0:
                os.close(1)         # the test reads the rank's output to its end
                os.close(2)
                time.sleep(120)
                os._exit(0)
            with open(os.path.join(os.environ["TEST_DIR"], "child"), "w") as f:
                f.write(str(child))
        comm.all_reduce(x)          # every rank is past the fork
        if rank == 2:
            time.sleep(0.5)         # the others wait for it in the next all_reduce
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
            return {"error": None, "transport": comm.transport}
        except eccl.EcclError as e:
            return {"error": type(e).__name__, "s": time.monotonic() - t0,
                    "transport": comm.transport}
    """
    try:
        res = _run_ranks(3, body, {"ECCL_TRANSPORT": "shm", "TEST_DIR": str(tmp_path)},
                         may_fail=(2,), master_args={"lease_ms": 10000})
    finally:
        child = tmp_path / "child"
        if child.exists():
            try:
                os.kill(int(child.read_text()), 9)
            except ProcessLookupError:
                pass
    assert res[2] is None
    for r in res[:2]:
        assert r["transport"] == "shm" and r["error"] == "AbortedError", r
        # The rank died 0.5 s into the call; the lease would have taken 10 s more.
        assert r["s"] < 4.0, r


def test_bad_input_raises_typed_errors():
    master = eccl.Master()
    try:
        comm = eccl.Communicator(master.addr, master.secret, min_world=1)
        comm.update_topology()
        import torch
        with pytest.raises(eccl.InvalidArgumentError, match="contiguous"):
            comm.all_reduce(torch.ones(4, 4).t())
        with pytest.raises(eccl.InvalidArgumentError, match="dtype"):
            comm.all_reduce(np.ones(4, dtype=np.complex64))
        with pytest.raises(eccl.InvalidArgumentError, match="read-only"):
            a = np.ones(4, dtype=np.float32)
            a.setflags(write=False)
            comm.all_reduce(a)
        with pytest.raises(eccl.InvalidArgumentError, match="must be a numpy array, a CPU torch tensor"):
            comm.all_reduce([1.0, 2.0])
        with pytest.raises(eccl.InvalidArgumentError, match="op"):
            comm.all_reduce(np.ones(4, dtype=np.float32), "median")
        with pytest.raises(eccl.InvalidArgumentError):
            comm.all_reduce(np.ones(4, dtype=np.int32), "avg")
        with pytest.raises(eccl.InvalidArgumentError, match="expected"):
            comm.all_gather(np.empty(3, dtype=np.float32), np.ones(2, dtype=np.float32))
        # lists: one dtype, no written buffer twice or overlapping what is read, buffers only
        f32 = np.ones(2, dtype=np.float32)
        with pytest.raises(eccl.InvalidArgumentError, match="differ in dtype: f32 and f64"):
            comm.all_gather([np.empty(2, dtype=np.float64)], f32)
        same = np.empty(2, dtype=np.float32)
        with pytest.raises(eccl.InvalidArgumentError, match="overlap"):
            comm.all_to_all([same, same], [f32, f32])
        with pytest.raises(eccl.InvalidArgumentError, match="overlap"):
            comm.all_gather([f32], f32)
        with pytest.raises(eccl.InvalidArgumentError, match="input is an empty list"):
            comm.all_to_all(np.empty(0, dtype=np.float32), [], send_counts=[0], recv_counts=[0])
        with pytest.raises(eccl.InvalidArgumentError, match=r"output\[1\] must be"):
            comm.all_gather([same, 1.0], f32)
        with pytest.raises(eccl.InvalidArgumentError, match="expected"):
            comm.all_gather([same, same.copy()], f32)
        comm.update_topology()
        with pytest.raises(eccl.InvalidArgumentError, match="both send_counts and recv_counts"):
            comm.all_to_all(np.empty(2, dtype=np.float32), np.ones(2, dtype=np.float32), send_counts=[2])
        with pytest.raises(eccl.InvalidArgumentError, match="one count per rank"):
            comm.all_to_all(np.empty(2, dtype=np.float32), np.ones(2, dtype=np.float32),
                            send_counts=[1, 1], recv_counts=[1, 1])
        comm.update_topology()
        with pytest.raises(eccl.InvalidArgumentError, match="buffers hold 8 and 4"):
            comm.all_to_all(np.empty(1, dtype=np.float32), np.ones(2, dtype=np.float32),
                            send_counts=[3], recv_counts=[3])
        comm.update_topology()
        if torch.cuda.is_available():
            with pytest.raises(eccl.InvalidArgumentError, match="cuda"):
                comm.all_reduce(torch.ones(4, device="cuda"))
        # the communicator still works after all that
        comm.update_topology()
        x = np.ones(4, dtype=np.float32)
        comm.all_reduce(x)
        assert x.tolist() == [1.0] * 4
    finally:
        master.shutdown()
    with pytest.raises(eccl.MasterUnavailableError):
        eccl.Communicator("127.0.0.1:1", "s" * 32, connect_timeout_ms=300)
    with pytest.raises(eccl.InvalidArgumentError, match="secret"):
        eccl.Communicator("127.0.0.1:1", "short")


def test_every_error_is_one_class_per_rust_kind_and_pickles_to_itself():
    """The exception classes come from eccl's one Rust list, live in `eccl`, and pickle
    (with their fields) to the same class in another process."""
    import pickle
    names = [c.__name__ for c in eccl.ERRORS]
    assert names == ["AbortedError", "RevokedError", "EvictedError", "MismatchError",
                     "EcclTimeoutError", "MasterUnavailableError", "InvalidArgumentError",
                     "TooFewPeersError"]
    # A revoked epoch is an aborted one: what retries after an abort retries after it.
    assert issubclass(eccl.RevokedError, eccl.AbortedError)
    assert all(issubclass(c, eccl.EcclError) and getattr(eccl, c.__name__) is c
               for c in eccl.ERRORS)
    # No class shadows a builtin: eccl's timeout is EcclTimeoutError, and it is a
    # TimeoutError, so `except TimeoutError` catches it.
    import builtins
    assert not any(hasattr(builtins, n) for n in names)
    assert issubclass(eccl.EcclTimeoutError, TimeoutError) and not hasattr(eccl, "TimeoutError")
    raised = []
    try:
        eccl.Communicator("127.0.0.1:1", "s" * 32, connect_timeout_ms=200)
    except eccl.MasterUnavailableError as e:
        raised.append(e)
    m = eccl.Master()
    try:
        comm = eccl.Communicator(m.addr, m.secret)
        comm.update_topology()
        try:
            comm.all_reduce(np.ones(2, np.int32), "avg")
        except eccl.InvalidArgumentError as e:
            raised.append(e)
    finally:
        m.shutdown()
    assert [type(e).__name__ for e in raised] == ["MasterUnavailableError", "InvalidArgumentError"]
    assert raised[0].addr == "127.0.0.1:1" and raised[0].retryable is False
    assert "avg" in raised[1].detail and raised[1].hint
    made = [c(f"made {c.__name__}") for c in eccl.ERRORS]
    code = ("import pickle, sys; errs = pickle.loads(sys.stdin.buffer.read()); "
            "print(repr([(type(e).__module__, type(e).__name__, str(e), "
            "getattr(e, 'addr', None), getattr(e, 'detail', None)) for e in errs]))")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(raised + made),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    got = eval(out.stdout.decode())  # noqa: S307 - our own repr
    want = [(type(e).__module__, type(e).__name__, str(e), getattr(e, "addr", None),
             getattr(e, "detail", None)) for e in raised + made]
    assert got == want
    assert all(mod == "eccl" for mod, *_ in got)


def test_all_reduce_coalesced_is_one_collective():
    body = """
    import torch
    def main(comm, rank, n):
        a = np.full(3, rank + 1, np.float32)
        b = torch.full((5,), float(10 * (rank + 1)))
        c = np.arange(4, dtype=np.float32)
        before = comm.barrier().seq
        info = comm.all_reduce_coalesced([a, b, c])
        after = comm.barrier().seq
        return {"seqs": [before, info.seq, after], "a": a.tolist(), "b": b.tolist(),
                "c": c.tolist()}
    """
    for r in _run_ranks(2, body):
        s = r["seqs"]
        assert s[1] == s[0] + 1 and s[2] == s[1] + 1, s
        assert r["a"] == [3.0] * 3 and r["b"] == [30.0] * 5 and r["c"] == [0.0, 2.0, 4.0, 6.0]


def test_optimize_topology_solves_a_ring_and_keeps_ranks():
    """optimize_topology() from Python on three processes: a new epoch with the same
    ranks, a ring of all three that every rank agrees on, a measurement to each other
    rank, and an all_reduce after it that is exact (torch's backend calls the same)."""
    body = """
    def main(comm, rank, n):
        before = (comm.epoch, comm.rank)
        t = comm.optimize_topology()
        x = np.arange(1000, dtype=np.int64) * (rank + 1)
        comm.all_reduce(x)
        return {"before": before, "after": (comm.epoch, comm.rank), "t": t,
                "ok": bool((x == np.arange(1000) * 6).all())}
    """
    res = _run_ranks(3, body)
    rings = {tuple(r["t"]["ring"]) for r in res}
    assert len(rings) == 1 and sorted(rings.pop()) == [0, 1, 2], res
    for r in res:
        assert r["after"] == [r["before"][0] + 1, r["before"][1]], r
        assert r["t"]["epoch"] == r["after"][0], r
        assert sorted(link["rank"] for link in r["t"]["links"]) == \
            sorted({0, 1, 2} - {r["after"][1]}), r
        assert all(link["bytes_per_s"] > 0 and link["latency_us"] > 0 for link in r["t"]["links"])
        # What the master chose from the measurements: one table for every rank, each
        # collective's sizes growing to an open end.
        algos = r["t"]["algorithms"]
        assert algos == res[0]["t"]["algorithms"] and algos, r
        for name in {a["collective"] for a in algos}:
            bounds = [a["up_to_bytes"] for a in algos if a["collective"] == name]
            assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), algos
        assert {a["algo"] for a in algos} <= {"ring", "direct", "tree"}, algos
        assert r["ok"], r


def test_done_callbacks_run_once_where_the_call_finishes():
    """eccl.Work.add_done_callback (how the torch backend completes torch's futures): a
    callback added before the call finishes runs once, on eccl's callback thread rather
    than the caller's thread, with the outcome already set; one added afterwards runs at
    once in the caller's thread; one that would wait for an unfinished call is refused
    with InvalidArgumentError instead of waiting on the thread that runs it; one that
    raises is reported as unraisable and the others still run. Rank 1 sends its first
    message only once rank 0 said its callbacks are in place, and its second only once
    rank 0's callback has run (so the second call is unfinished while it runs). The
    callback then sleeps (GIL released) while rank 0 exits: interpreter exit waits for it
    to finish instead of aborting the process when it takes the GIL back."""
    master = eccl.Master()
    script = textwrap.dedent(f"""
        import json, sys, threading, time, numpy as np, eccl
        rank = int(sys.argv[1])
        comm = eccl.Communicator({master.addr!r}, {master.secret!r}, rank_hint=rank,
                                 min_world=2)
        comm.update_topology()
        if rank == 1:
            sys.stdin.readline()
            comm.send(np.full(4, 7, np.float32), 0, tag=1)
            sys.stdin.readline()
            comm.send(np.full(4, 8, np.float32), 0, tag=2)
            sys.exit(0)
        main_thread = threading.get_ident()
        seen, unraisable = [], []
        sys.unraisablehook = lambda u: unraisable.append(repr(u.exc_value))
        a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
        first = comm.recv(a, 1, tag=1, async_op=True)
        second = comm.recv(b, 1, tag=2, async_op=True)

        def on_first():
            seen.append(["first", threading.get_ident() != main_thread,
                         first.is_completed(), a.tolist()])
            try:
                second.wait()
                seen.append(["waited"])
            except eccl.InvalidArgumentError as e:
                seen.append(["refused", "wait on itself" in str(e)])
            print("callback done", flush=True)
            time.sleep(0.3)
            print("callback finished", file=sys.stderr, flush=True)

        def raises():
            raise RuntimeError("a failing callback")

        first.add_done_callback(raises)
        first.add_done_callback(on_first)
        print("registered", flush=True)
        second.wait()
        later = []
        second.add_done_callback(lambda: later.append(threading.get_ident() == main_thread))
        print("RESULT", json.dumps({{"seen": seen, "later": later, "b": b.tolist(),
                                    "unraisable": unraisable}}), flush=True)
    """)
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        assert procs[0].stdout.readline() == "registered\n"
        procs[1].stdin.write("go\n")
        procs[1].stdin.flush()
        assert procs[0].stdout.readline() == "callback done\n"
        _, err1 = procs[1].communicate("go\n", timeout=TIMEOUT)
        assert procs[1].returncode == 0, err1
        out0, err0 = procs[0].communicate(timeout=TIMEOUT)
        assert procs[0].returncode == 0, err0
        assert "callback finished" in err0, err0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        master.shutdown()
    import json
    r = json.loads([l for l in out0.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert r["seen"] == [["first", True, True, [7.0] * 4], ["refused", True]], r
    assert r["later"] == [True] and r["b"] == [8.0] * 4, r
    assert len(r["unraisable"]) == 1 and "a failing callback" in r["unraisable"][0], r


def test_a_callback_that_waits_for_a_later_calls_callback_is_not_stuck_behind_itself():
    """A done-callback that waits (not through eccl.Work.wait, which it may not call) for
    something a later call's callback does: torch's PowerSGD hook waits for an
    all_reduce's future inside another future's callback. Callbacks run in order on one
    thread, and a second stands by for callbacks that wait behind a running one, so the
    later callback runs within milliseconds rather than after the first gives up."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    master = eccl.Master()
    try:
        def member(r):
            c = eccl.Communicator(master.addr, master.secret, rank_hint=r, min_world=2)
            c.update_topology()
            return c
        with ThreadPoolExecutor(2) as ex:
            comms = list(ex.map(member, range(2)))
        r0, r1 = sorted(comms, key=lambda c: c.rank)
        a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
        first = r0.recv(a, 1, tag=1, async_op=True)
        second = r0.recv(b, 1, tag=2, async_op=True)
        later_ran = threading.Event()
        seen = []

        def waits_for_the_later_one():
            t = time.monotonic()
            seen.append((later_ran.wait(10), time.monotonic() - t))
        first.add_done_callback(waits_for_the_later_one)
        second.add_done_callback(later_ran.set)
        r1.send(np.full(4, 1, np.float32), 0, tag=1)
        r1.send(np.full(4, 2, np.float32), 0, tag=2)
        second.wait()
        deadline = time.monotonic() + 15
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and seen[0][0] and seen[0][1] < 2.0, seen
        assert a.tolist() == [1.0] * 4 and b.tolist() == [2.0] * 4
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda c: c.leave(), comms))
    finally:
        master.shutdown()


def test_exit_with_work_in_flight_neither_crashes_nor_hangs():
    master = eccl.Master()
    script = textwrap.dedent(f"""
        import sys, numpy as np, eccl
        rank = int(sys.argv[1])
        comm = eccl.Communicator({master.addr!r}, {master.secret!r}, rank_hint=rank,
                                 min_world=2)
        comm.update_topology()
        if rank == 1:
            x = np.ones(1 << 22, dtype=np.float32)
            w = comm.all_reduce(x, async_op=True)   # rank 0 never calls it
            print("submitted", flush=True)
        else:
            print("member", flush=True)
            sys.stdin.readline()                    # stays in the world until rank 1 is gone
    """)
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        out1, err1 = procs[1].communicate(timeout=TIMEOUT)
        assert procs[1].returncode == 0 and out1 == "submitted\n", err1
        out0, err0 = procs[0].communicate("go\n", timeout=TIMEOUT)
        assert procs[0].returncode == 0 and out0 == "member\n", err0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        master.shutdown()


def test_master_in_a_child_process():
    """The child gets the secret on stdin: nothing on its command line shows it."""
    m = eccl.Master.spawn()
    try:
        argv = open(f"/proc/{m._proc.pid}/cmdline", "rb").read()
        assert b"eccl.master" in argv and m.secret.encode() not in argv
        comm = eccl.Communicator(m.addr, m.secret, min_world=1)
        assert comm.update_topology().world_size == 1
    finally:
        m.shutdown()


def test_a_secret_file_others_may_read_is_refused(tmp_path):
    """The Python side reads secret files (ECCL_SECRET_FILE for the torch backend,
    torchrun's secret_file) with the Rust side's check: one that others may read is
    refused, naming the chmod that fixes it."""
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef" * 4 + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(eccl.InvalidArgumentError, match="chmod 600"):
        eccl._eccl.read_secret_file(str(path))
    os.chmod(path, 0o600)
    assert eccl._eccl.read_secret_file(str(path)) == "0123456789abcdef" * 4


def test_quantized_all_reduce_and_diloco_int8_give_every_rank_the_same_bits():
    """`all_reduce(..., quantize="int8")` (and "fp8") from Python: the same bits on every rank, within
    the bound of the exact sum (half a step per other rank's block of 256 plus half of the sum's:
    under 0.05 for these ranges) and not exact; an integer buffer is refused by name.
    DiLoCo(compression="int8") quantizes its outer all_reduce and keeps its members'
    models identical."""
    res = _run_ranks(3, """
        def main(comm, rank, n):
            import torch
            import eccl.torch
            def values(r):
                return (np.sin(np.arange(5000) * 0.01 + r) * (r + 1)).astype(np.float32)
            x = values(rank)
            exact = sum(values(r) for r in range(n))
            comm.all_reduce(x, "sum", quantize="int8")
            y = values(rank)
            comm.all_reduce(y, "sum", quantize="fp8")
            fp8_err = float(np.max(np.abs(y - exact) / (sum(np.abs(values(r)) for r in range(n))
                                                         + np.abs(exact) + 1e-3)))
            try:
                comm.all_reduce(np.ones(4, np.int32), quantize="int8")
                refused = ""
            except eccl.InvalidArgumentError as e:
                refused = str(e)
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 4)
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            outer = torch.optim.SGD(model.parameters(), lr=0.7)
            job = eccl.torch.DiLoCo(model, inner, outer, comm, sync_every=2, compression="int8")
            g = torch.Generator().manual_seed(rank)
            for _ in range(4):
                data = torch.randn(16, 8, generator=g)
                job.train_step(lambda m: m(data).square().mean())
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            return {"x": x.tobytes().hex(), "err": float(np.abs(x - exact).max()),
                    "y": y.tobytes().hex(), "fp8_err": fp8_err,
                    "refused": refused, "params": params.numpy().tobytes().hex(),
                    "outer": job.outer_steps}
    """)
    assert len({r["x"] for r in res}) == 1, "ranks differ"
    assert 0 < res[0]["err"] < 0.05, res[0]["err"]
    # fp8 (E4M3 per block): every value within 1/16 of its magnitude, each rank's and
    # the sum's, so the error over (sum of |inputs| + |sum|) is at most 1/16.
    assert len({r["y"] for r in res}) == 1, "ranks differ (fp8)"
    assert 0 < res[0]["fp8_err"] <= 1 / 16, res[0]["fp8_err"]
    assert all("f32, f16 or bf16, not i32" in r["refused"] for r in res), res[0]["refused"]
    assert len({r["params"] for r in res}) == 1 and res[0]["outer"] == 2, res


def test_a_failed_sync_leaves_a_members_state_and_a_newcomer_catches_up_next_time():
    """The only source dies while serving (killed at its first chunk): the member with
    a state of its own (revision 1) keeps it whole (G2: chunks wait until all have come);
    the newcomer (revision 0, whose chunks land in its tensors as they arrive) may be
    partly written, and the next sync brings it to the content chosen then."""
    body = """
    def main(comm, rank, n):
        w = [np.arange(1 << 20, dtype=np.float32), np.full(1 << 20, 7.0, np.float32),
             np.zeros(1 << 20, np.float32)][rank]
        try:
            comm.sync_shared_state([2, 1, 0][rank], {"w": w})
            first = "ok"
        except eccl.EcclError as e:
            first = type(e).__name__
        kept = bool((w == 7.0).all())
        comm.update_topology()
        info = comm.sync_shared_state([2, 1, 0][rank], {"w": w})
        return {"first": first, "kept": kept, "rev": info.revision,
                "after": bool((w == 7.0).all())}
    """
    res = _run_ranks(3, body, rank_env={0: {"ECCL_FAULT_INJECT": "sync-serve:kill"}},
                     may_fail={0})
    assert res[0] is None, "the source was to die while serving"
    assert res[1]["first"] != "ok" and res[2]["first"] != "ok", res
    assert res[1]["kept"], "a failed sync changed the state of a member that had one"
    for r in (1, 2):
        assert res[r]["rev"] == 1 and res[r]["after"], res


def test_a_receive_only_newcomer_hashes_nothing_and_fetches_everything():
    body = """
    def main(comm, rank, n):
        w = np.arange(600_000, dtype=np.float32) if rank == 0 else np.full(600_000, 5.0, np.float32)
        if rank == 0:
            info = comm.sync_shared_state(1, {"w": w})
        else:
            info = comm.sync_shared_state(0, {"w": w}, strategy="receive_only")
        ok = bool((w == np.arange(600_000, dtype=np.float32)).all())
        return {"hashed": info.hashed_bytes, "recv": info.bytes_received, "ok": ok}
    """
    res = _run_ranks(2, body)
    assert res[0]["hashed"] == 600_000 * 4 and res[0]["recv"] == 0, res
    assert res[1] == {"hashed": 0, "recv": 600_000 * 4, "ok": True}, res
