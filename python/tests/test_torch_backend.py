"""The "eccl" torch.distributed backend against gloo, with real torch processes: every
collective gives gloo's result on the same inputs, DDP ends with gloo's parameters, and
bad input raises instead of crashing or hanging."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from procs import free_port, spawn  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = 120


def run_world(n, args, script=HERE / "torch_script.py"):
    """Runs n ranks of `script` the way torchrun would (env://); returns their JSON.

    A rank may abort at interpreter exit after printing its results ("terminate called
    without an active exception", from torch's teardown once the rank hosting the
    rendezvous store is gone; seen with both gloo and eccl). That is the exit, not a
    result, so it is tolerated; any other failure is not."""
    return run_processes(world_specs(n, args, script))


def world_specs(n, args, script):
    """(argv, env) of n ranks of `script` meeting as torchrun's env:// would."""
    port = free_port()
    return [([sys.executable, str(script), *args],
             dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                  RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r)))
            for r in range(n)]


def run_world_losing_last(n, args, script):
    """Runs n ranks of `script` as run_world does; the last one SIGKILLs itself. Returns
    the others' JSON (every process stopped by PID)."""
    procs, outs = _start_and_wait(world_specs(n, args, script))
    assert procs[-1].returncode == -signal.SIGKILL, procs[-1].returncode
    res = []
    for p, (out, err) in zip(procs[:-1], outs[:-1]):
        assert p.returncode == 0, f"{p.returncode}\n{err[-3000:]}"
        res.append(_result(out))
    return res


def run_processes(specs):
    """Runs one process per (argv, env), stops every one of them, and returns the JSON
    each printed after "RESULT "."""
    procs, outs = _start_and_wait(specs)
    res = []
    for (argv, _), p, (out, err) in zip(specs, procs, outs):
        printed = any(l.startswith("RESULT ") for l in out.splitlines())
        exit_abort = printed and "terminate called" in err
        assert p.returncode == 0 or exit_abort, f"{argv[1:]}: exit {p.returncode}\n{out}\n{err[-3000:]}"
        res.append(_result(out))
    return res


def _start_and_wait(specs, hung=()):
    """Starts one process per (argv, env) and waits for all but those at the indices in
    `hung` (stopped ones: their output is None); every one still running when this
    returns or raises is killed by PID."""
    procs = [spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, env in specs]
    try:
        outs = [None if i in hung else p.communicate(timeout=TIMEOUT)
                for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs, outs


def _result(out):
    return json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])


@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_matches_gloo(n, monkeypatch):
    if n == 3:
        # With three ranks, the eccl run first measures its links and takes the ring
        # the master solved (ProcessGroupEccl.optimize_topology()).
        monkeypatch.setenv("TEST_OPTIMIZE_TOPOLOGY", "1")
    eccl_res = run_world(n, ["eccl", "collectives"])
    monkeypatch.delenv("TEST_OPTIMIZE_TOPOLOGY", raising=False)
    if n == 3:
        rings = [r.pop("_topology")["ring"] for r in eccl_res]
        assert all(ring == rings[0] for ring in rings) and sorted(rings[0]) == [0, 1, 2], rings
    gloo_res = run_world(n, ["gloo", "collectives"])
    for r in range(n):
        assert set(eccl_res[r]) == set(gloo_res[r])
        for key in gloo_res[r]:
            assert eccl_res[r][key] == gloo_res[r][key], f"rank {r} {key}"


@pytest.mark.parametrize("n", [2, 3])
def test_uneven_all_to_all_of_blocks_larger_than_a_link_buffers(n):
    """Uneven all_to_all blocks of 16 MiB and more (both forms) arrive whole, and so does
    a ring of 24 MiB batch_isend_irecv; sizes that disagree fail every rank with
    MismatchError naming the pair. Before, every rank sent its whole block first and
    waited there until the group's timeout. A rank whose own call is wrong (split sizes
    that do not cover its tensor, a block too few) fails every rank with a MismatchError
    naming it, where it used to fail alone and leave the others waiting; the group then
    goes on."""
    res = run_world(n, ["eccl", "big_uneven"])
    check_big_uneven(res, n)
    for r, got in enumerate(res):
        in_place = [r * n + i + 100.0 * s for s in range(n) for i in range(n)]
        assert got["in_place"] == in_place and got["in_place_even"] == in_place, (r, got)
        assert got["uneven_lists"] == [[100.0 * s + r] * ((s + 2 * r) % 3) for s in range(n)], (r, got)
        assert got["uneven_same_list"] == [[100.0 * s + r] * (s + r + 1) for s in range(n)], (r, got)


def check_big_uneven(res, n):
    """What every rank of torch_script.py's big_uneven must have seen (also on CUDA
    tensors: test_cuda.py)."""

    def block(s, t):
        return (4 << 20) + (s * n + t) * 12345
    for r, got in enumerate(res):
        want = [[block(s, r), 100.0 * s + r, 100.0 * s + r] for s in range(n)]
        assert got["single"] == want and got["list"] == want and got["list_views"] == want, (r, got)
        assert got["ring"] == [float((r - 1) % n)] * 2, (r, got["ring"])
        sizes = [2 if 0 in (s, r) else s + r + 1 for s in range(n)]
        assert got["mixed_lists"] == [[100.0 * s + r] * k for s, k in enumerate(sizes)], (r, got)
        # Rank 0 and the last rank disagree on a block: every rank raises the same
        # MismatchError naming the pair and both sizes (on the CPU from the sizes' round,
        # on CUDA over IPC from every rank's record of its counts), before anything moves.
        m = got["mismatch"]
        assert m.startswith("MismatchError") and "rank 0 sends 4 elements" in m and "expects 3" in m, (r, m)
        # The last rank's wrong splits / blocks: every rank fails, the culprit saying what.
        for key, what in (("wrong_splits", "input_split_sizes"), ("wrong_blocks", "blocks")):
            assert "MismatchError" in got[key], (r, key, got[key])
            if r == n - 1:
                assert "cannot take part" in got[key] and what in got[key], (r, key, got[key])
            else:   # the sizes' row, or eccl's check of the calls or of the counts, names it
                assert f"rank {n - 1}" in got[key], (r, key, got[key])
        # The root's blocks that do not fit: a typed error everywhere (on the CPU the
        # root says what; over CUDA eccl's device call refuses the root's missing buffer).
        for key in ("wrong_scatter", "wrong_gather"):
            assert got[key].startswith(("InvalidArgumentError", "MismatchError")), (r, key, got[key])
            if r == 0 and os.environ.get("ECCL_TEST_DEVICE") != "cuda":
                assert "blocks do not fit" in got[key], (r, key, got[key])
        for key in ("wrong_all_gather", "wrong_reduce_scatter"):
            if r == n - 1:
                assert got[key].startswith("InvalidArgumentError") and "blocks do not fit" in got[key], \
                    (r, key, got[key])
            else:
                assert got[key].startswith("MismatchError") and f"rank {n - 1}" in got[key], (r, key, got[key])
        assert got["after"] == float(n), (r, got["after"])


@pytest.mark.parametrize("n", [2, 3])
def test_outputs_that_are_not_contiguous_are_written_where_they_lie(n):
    """Every single-output collective into every second element of a tensor, on every
    rank (before, eccl's native call refused such an output); reduce_scatter into the
    rank's own input block; the split all_to_all_single's future holds its output."""
    for r, got in enumerate(run_world(n, ["eccl", "strided"])):
        assert got["reduce_scatter"] == [float(n * r + n * (n - 1) // 2)] * 2, (r, got)
        own = [[float(10 * i + r)] * 2 for i in range(n)]
        own[r] = [float(sum(10 * r + s for s in range(n)))] * 2
        assert got["reduce_scatter_own"] == own, (r, got)
        assert got["scatter"] == [5.0 + r] * 2, (r, got)
        assert got["all_to_all_single"] == [float(r + 10 * s) for s in range(n)], (r, got)
        assert got["all_to_all_single_splits"] == got["all_to_all_single"], (r, got)
        assert got["future"] == [1, True], (r, got)
        assert got["all_gather_into_tensor"] == [float(s) for s in range(n) for _ in range(2)], (r, got)
        assert got["reduce_scatter_tensor"] == [float(sum(2 * r + j + s for s in range(n))) for j in range(2)], \
            (r, got)


@pytest.mark.parametrize("form", ["all_to_all_single", "all_to_all_single_splits", "all_to_all_list"])
def test_an_in_place_all_to_all_that_fails_leaves_its_tensor_as_it_was(form):
    """G2 for torch's in-place all_to_alls: rank 2 of three dies while ranks 0 and 1 are
    in the call and have exchanged their blocks with each other; the call fails on both
    and their tensors hold what they held (the blocks land in a buffer of the call's own,
    copied out only on success)."""
    res = run_world_losing_last(3, ["eccl", form], HERE / "in_place_loss_script.py")
    assert res == [{"failed": "AbortedError", "kept": True}] * 2, res


def test_backend_covers_every_dtype_and_op_of_the_rust_lists():
    """eccl.DType and eccl.ReduceOp come from the Rust tables; every pair that the op is
    defined for goes through dist.all_reduce with the closed-form result."""
    import functools
    import operator

    import eccl
    torch_ops = {k for k in dir(torch.distributed.ReduceOp) if k.isupper()}
    assert set(eccl.TORCH_OP_NAMES.values()) <= torch_ops
    n = 2
    vals = [r + 1 for r in range(n)]
    want = {"SUM": sum(vals), "PROD": functools.reduce(operator.mul, vals), "MIN": min(vals),
            "MAX": max(vals), "AVG": sum(vals) / n,
            "BAND": functools.reduce(operator.and_, vals),
            "BOR": functools.reduce(operator.or_, vals),
            "BXOR": functools.reduce(operator.xor, vals)}
    res = run_world(n, ["eccl", "coverage"])
    ops_per_dtype = {d: 4 + (1 if getattr(torch, eccl.DTYPE_NAMES[d]).is_floating_point else 3)
                     for d in eccl.DType}
    assert len(res[0]) == sum(ops_per_dtype.values())
    for r in res:
        for key, got in r.items():
            assert got == [want[key.split("/")[1]]] * 4, key


def test_ddp_ends_with_gloos_parameters():
    e = run_world(2, ["eccl", "ddp"])
    g = run_world(2, ["gloo", "ddp"])
    assert e[0]["params"] == e[1]["params"], "ranks agree bit for bit"
    for pe, pg in zip(e[0]["params"], g[0]["params"]):
        assert pe == pytest.approx(pg, rel=1e-5, abs=1e-6)
    assert e[0]["losses"][-1] < e[0]["losses"][0]
    # DDP's communication hooks run on eccl as on gloo.
    for res in (e, g):
        assert res[0]["allreduce_hook"] == res[1]["allreduce_hook"]
        for ph, p in zip(res[0]["allreduce_hook"], res[0]["params"]):
            assert ph == pytest.approx(p, rel=1e-6, abs=1e-7)
        for ph, p in zip(res[0]["fp16_hook"], res[0]["params"]):
            assert ph == pytest.approx(p, rel=1e-2, abs=1e-3)
        assert res[0]["powersgd_hook"] == res[1]["powersgd_hook"]
    # PowerSGD (a low-rank approximation: not DDP's parameters) as on gloo.
    for pe, pg in zip(e[0]["powersgd_hook"], g[0]["powersgd_hook"]):
        assert pe == pytest.approx(pg, rel=1e-4, abs=1e-5)


BAD = textwrap.dedent("""
    import sys, json, torch, torch.distributed as dist, eccl, eccl.torch
    dist.init_process_group("eccl")
    r = dist.get_rank()
    caught = {}
    def expect(name, fn):
        try:
            fn()
            caught[name] = None
        except Exception as e:
            caught[name] = type(e).__name__ + ": " + str(e)[:200]
    expect("meta_device", lambda: dist.all_reduce(torch.ones(2, device="meta")))
    expect("non_contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t()))
    expect("bool_dtype", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)))
    # shapes that differ across ranks: every rank gets an error, nobody hangs
    expect("shape_mismatch", lambda: dist.all_reduce(torch.ones(3 + r)))
    # and the group recovers by itself: the next call forms the next epoch first
    t = torch.ones(2); dist.all_reduce(t)
    caught["after"] = t.tolist()
    print("RESULT " + json.dumps(caught), flush=True)
    dist.destroy_process_group()
""")


def test_bad_input_raises_and_never_hangs(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(BAD)
    res = run_world(2, [], script=script)
    for r in res:
        for key in ("non_contiguous", "bool_dtype", "shape_mismatch"):
            assert r[key], f"{key} did not raise"
        # A meta tensor never reaches the backend: torch runs its meta kernel, for gloo
        # and eccl alike (the backend is registered for "cpu"). On torch 2.11 and older,
        # where a Python backend is the whole group, it reaches eccl's, which refuses it.
        assert r["meta_device"] is None or (
            r["meta_device"].startswith("InvalidArgumentError") and "meta" in r["meta_device"])
        assert "contiguous" in r["non_contiguous"]
        assert "bool" in r["bool_dtype"]
        assert "Mismatch" in r["shape_mismatch"] or "mismatch" in r["shape_mismatch"]
        assert r["after"] == [2.0, 2.0]


DROPPED = textwrap.dedent("""
    import gc, json, time, torch, torch.distributed as dist, eccl.torch
    dist.init_process_group("eccl")
    r = dist.get_rank()
    M = 1 << 20
    canaries = []
    for i in range(20):                 # a Work and its tensor dropped mid-collective
        if i % 2 == r:
            time.sleep(0.02)
        t = torch.full((M,), float(r + 1))
        w = dist.all_reduce(t, async_op=True)
        del w, t
        gc.collect()
        canaries.append(torch.zeros(M))
    def submit_then_fail(i):
        if i % 2 == r:
            time.sleep(0.02)
        t = torch.full((M,), float(r + 1))
        w = dist.all_reduce(t, async_op=True)
        raise RuntimeError("user code failed between submit and wait")
    for i in range(10):                 # an exception between submit and wait
        try:
            submit_then_fail(i)
        except RuntimeError:
            pass
        gc.collect()
        canaries.append(torch.zeros(M))
    t = torch.ones(4)
    dist.all_reduce(t)                  # runs after every call above has finished
    changed = sum(int((c != 0).sum()) for c in canaries)
    print("RESULT " + json.dumps({"changed": changed, "after": t.tolist()}), flush=True)
    dist.destroy_process_group()
""")


def check_p2p_mismatch(res):
    """What every rank of torch_script.py's p2p_mismatch must have seen (also on CUDA
    tensors, through eccl's device send: test_cuda.py)."""
    n = len(res)
    for r, got in enumerate(res):
        if r == 1:
            assert got["mismatch"].startswith("MismatchError"), got
            # Both calls named: eccl's check of the host call's count (8 against 6), or
            # the device receive's (8 elements, 32 bytes, against 6, 24 bytes).
            assert "rank 0" in got["mismatch"] and "8" in got["mismatch"], got
        else:
            assert got["mismatch"] in ("sent", "idle"), (r, got)
        assert got["after"] == [float(n)] * 4, (r, got)
        assert got["ring"] == [float((r - 1) % n)] * 3, (r, got)


def test_a_send_and_receive_of_different_sizes_fail_the_receiver_and_the_group_goes_on():
    check_p2p_mismatch(run_world(3, ["eccl", "p2p_mismatch"]))


def test_dropped_works_and_failed_callers_leave_other_memory_alone(tmp_path):
    script = tmp_path / "dropped.py"
    script.write_text(DROPPED)
    for r in run_world(2, [], script=script):
        assert r == {"changed": 0, "after": [2.0] * 4}


EXPLICIT = textwrap.dedent("""
    import sys, json, torch, torch.distributed as dist, eccl.torch
    r, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("eccl", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    t = torch.ones(3) * (r + 1)
    dist.all_reduce(t)
    print("RESULT " + json.dumps({"sum": t.tolist(), "backend": dist.get_backend()}), flush=True)
    dist.destroy_process_group()
""")


def test_init_with_explicit_arguments(tmp_path):
    script = tmp_path / "explicit.py"
    script.write_text(EXPLICIT)
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    res = run_processes([([sys.executable, str(script), str(r), port], env) for r in range(2)])
    for r in res:
        assert r == {"sum": [3.0, 3.0, 3.0], "backend": "eccl"}


SEALED = textwrap.dedent("""
    import sys, json, torch, torch.distributed as dist, eccl.torch
    r, store = int(sys.argv[1]), sys.argv[2]
    got = []
    share = eccl.torch._share_secret
    eccl.torch._share_secret = lambda *a: got.append(share(*a)) or got[-1]
    dist.init_process_group("eccl", init_method=f"file://{store}", rank=r, world_size=3)
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t)
    # Every key is in by now (every rank needed its box to join); the file goes away
    # with the last rank, so look while all are here.
    data = open(store, "rb").read()
    found = got[0].encode() in data or bytes.fromhex(got[0]) in data
    dist.barrier()
    print("RESULT " + json.dumps({"sum": t.tolist(), "secret": got[0], "found": found,
                                  "sealed": data.count(b"eccl/sealed/")}), flush=True)
    dist.destroy_process_group()
""")


def test_the_job_secret_never_sits_in_the_store_in_the_clear(tmp_path):
    """Three ranks through a FileStore (whose file holds every key and value): each got
    rank 0's secret, and neither it nor its bytes appear in the store."""
    script = tmp_path / "sealed.py"
    script.write_text(SEALED)
    store = tmp_path / "store"
    env = {k: v for k, v in os.environ.items()
           if k not in ("ECCL_SECRET", "ECCL_SECRET_FILE", "ECCL_MASTER")}
    res = run_processes([([sys.executable, str(script), str(r), str(store)], env) for r in range(3)])
    assert [r["sum"] for r in res] == [[6.0, 6.0]] * 3
    secrets = {r["secret"] for r in res}
    assert len(secrets) == 1 and len(secrets.pop()) == 64
    assert [r["sealed"] for r in res] == [2] * 3
    assert not any(r["found"] for r in res)


def test_a_store_writer_posing_as_a_rank_is_noticed():
    """_share_secret against a real store: a fresh key per rank, a sealed box per rank,
    nothing readable in the store; and a rank whose key someone else published first
    stops with an error instead of joining beside the impostor."""
    import threading
    from datetime import timedelta

    import eccl
    import torch.distributed as dist
    from eccl.torch import _share_secret

    timeout = timedelta(seconds=20)
    store = dist.HashStore()
    got = {}
    ts = [threading.Thread(target=lambda r=r: got.__setitem__(
        r, _share_secret(store, r, 3, "s" * 64 if r == 0 else None, timeout))) for r in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == {0: "s" * 64, 1: "s" * 64, 2: "s" * 64}
    for k in ("eccl/key/1", "eccl/key/2", "eccl/sealed/1", "eccl/sealed/2"):
        v = store.get(k)
        assert b"s" * 8 not in v and bytes.fromhex(v.decode()).find(b"s" * 8) < 0
    # Over torch's non-libuv TCPStore server, whose compare_set wakes no waiter: rank 0
    # waits first and still hears of every rank's key.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           use_libuv=False)
    got = {}
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=False)
               for _ in range(3)]

    class Waiting:
        """Rank 0's store, which says when rank 0 has begun to wait on it."""

        def __init__(self, store):
            self.store, self.began = store, threading.Event()

        def wait(self, keys, timeout):
            self.began.set()
            return self.store.wait(keys, timeout)

        def __getattr__(self, name):
            return getattr(self.store, name)

    clients[0] = Waiting(clients[0])
    ts = [threading.Thread(target=lambda r=r: got.__setitem__(
        r, _share_secret(clients[r], r, 3, "s" * 64 if r == 0 else None, timeout)))
        for r in range(3)]
    ts[0].start()
    assert clients[0].began.wait(20)
    for t in ts[1:]:
        t.start()
    for t in ts:
        t.join()
    assert got == {0: "s" * 64, 1: "s" * 64, 2: "s" * 64}
    # An impostor publishes rank 1's key (and says it did) before rank 1. Rank 0 cannot
    # tell (the store authenticates nobody): it seals the secret to the impostor's key.
    # But rank 1, finding the key taken, stops and marks the store, and every rank stops
    # at the check it makes once its world has formed, so none goes on with a secret
    # the impostor may hold.
    from eccl.torch_setup import _check_no_conflict
    store = dist.HashStore()
    impostor = eccl._eccl.OpenKey()
    store.set("eccl/key/1", impostor.public.hex())
    store.set("eccl/published/1", "1")
    short = timedelta(seconds=2)
    got = {}

    def rank(r):
        got[r] = _try(lambda: _share_secret(store, r, 3, "s" * 64 if r == 0 else None, short))

    rank(1)
    assert isinstance(got[1], eccl.InvalidArgumentError) and "posing as this rank" in str(got[1])
    # Ranks 0 and 2 then: rank 0 seals nothing more once the mark is there, so rank 2
    # gets no box (its wait fails), and the check every rank makes stops them all.
    ts = [threading.Thread(target=rank, args=(r,)) for r in (0, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert isinstance(got[0], eccl.InvalidArgumentError) and "tampered with" in str(got[0]), got
    assert isinstance(got[2], Exception), got
    with pytest.raises(eccl.InvalidArgumentError, match="tampered with: another process"):
        _check_no_conflict(store)


def _try(f):
    try:
        return f()
    except Exception as e:  # noqa: BLE001 - the test looks at what was raised
        return e


EXAMPLES = HERE.parents[1] / "examples"


def test_lecture_examples_under_torchrun():
    """examples/ddp_simple.py prints 3.5 on both ranks; ddp_example.py trains."""
    def torchrun(script, *args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(EXAMPLES / script), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        return r.stdout
    out = torchrun("ddp_simple.py")
    # Two processes share the stream, so lines may run together.
    import re
    assert sorted(re.findall(r"rank (\d): grad ([0-9.]+)", out)) == [("0", "3.5"), ("1", "3.5")]
    out = torchrun("ddp_example.py", "--width", "256", "--steps", "3")
    assert "step 2: loss" in out and "eccl: median step" in out


def test_older_torch_registers_the_backend_at_import():
    """torch before 2.15 has no lazy `torch.distributed.backends` hook (the GPU images'
    2.11 among them): the package's `torch.backends` entry point, which those releases run
    at the end of `import torch`, registers "eccl" there; on this torch it does nothing,
    so `import torch` does not import eccl."""
    code = """
import sys
import torch
import torch.distributed as dist
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="torch.backends") if e.name == "eccl"]
if hasattr(dist.Backend, "_ensure_backend_registered"):
    assert "eccl" not in sys.modules, "import torch imported eccl"
    assert "ECCL" not in dist.Backend._plugins
    del dist.Backend._ensure_backend_registered  # as on torch 2.14 and older
    ep.load()()
assert "ECCL" in dist.Backend._plugins
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-3000:]


def test_fsdp2_trains_as_with_gloo():
    """FSDP2 (`fully_shard` over a 1-D CPU DeviceMesh) on two ranks: its all-gathers pass
    the input as the output's slice at the rank's offset and its reduce-scatters the
    output as the input's slice (NCCL's in-place forms). Three SGD steps on each rank's
    own data end with gloo's parameters, bit for bit, on both ranks."""
    script = HERE / "fsdp_script.py"
    gloo = run_world(2, ["gloo"], script)
    ours = run_world(2, ["eccl"], script)
    assert gloo[0]["params"] == gloo[1]["params"]
    for r in range(2):
        assert ours[r]["params"] == gloo[r]["params"], f"rank {r}"
        assert ours[r]["loss"] == gloo[r]["loss"], f"rank {r}"


def test_premul_sum_and_fsdp2_with_a_gradient_divide_factor():
    """torch's PREMUL_SUM (NCCL's pre-multiplied sum, what FSDP2 reduce-scatters with
    once a gradient divide factor is set): all_reduce and reduce_scatter_tensor give the
    exact sums of the scaled inputs; FSDP2 with a divide factor of 3 trains to gloo's
    parameters (gloo has no PREMUL_SUM, so it sums and scales, which rounds differently:
    close, not bit for bit)."""
    script = HERE / "fsdp_script.py"
    n = 2
    gloo = run_world(n, ["gloo", "divide"], script)
    ours = run_world(n, ["eccl", "divide"], script)
    torch = pytest.importorskip("torch")
    for r in range(n):
        assert ours[r]["premul_all_reduce"] == [0.5 * sum(range(1, n + 1))] * 4
        whole = [float(k) * 0.25 * sum(range(1, n + 1)) for k in range(2 * n)]
        assert ours[r]["premul_reduce_scatter"] == whole[2 * r:2 * r + 2]
        assert ours[r]["premul_input_kept"] is True
        tri = sum(range(1, n + 1))
        assert ours[r]["premul_reduce_scatter_list"] == [0.25 * (k * tri + 2 * r * n) for k in range(2)]
        assert ours[r]["premul_list_kept"] is True
        # reduce: the root has the scaled sum, every other rank its tensor as it was.
        want = [2.0 * sum(range(1, n + 1))] * 3 if r == 0 else [float(r + 1)] * 3
        assert ours[r]["premul_reduce"] == want, (r, ours[r]["premul_reduce"])
        assert ours[r]["premul_int"] == "InvalidArgumentError"
        for k, v in gloo[r]["params"].items():
            assert torch.allclose(torch.tensor(ours[r]["params"][k]), torch.tensor(v),
                                  rtol=1e-5, atol=1e-6), (r, k)
        assert abs(ours[r]["loss"] - gloo[r]["loss"]) < 1e-5


def test_in_place_all_gather_and_reduce_scatter_follow_nccl():
    """all_gather_into_tensor with the input as the output's slice at the rank's offset,
    and reduce_scatter_tensor with the output as the input's slice, give the
    out-of-place results; an input overlapping the output anywhere else is refused with
    InvalidArgumentError on every rank, and the next collective is right."""
    n = 3
    ours = run_world(n, ["eccl", "inplace"], HERE / "fsdp_script.py")
    gathered = [float(10 * r + i) for r in range(n) for i in range(3)]
    for r, res in enumerate(ours):
        assert res["gathered"] == gathered, (r, res)
        assert res["scattered"] == res["scatter_expect"], (r, res)
        assert res["overlap"] == "InvalidArgumentError", (r, res)
        assert res["after"] == [float(n)] * 2, (r, res)


@pytest.mark.parametrize("n,mesh", [(3, "1d"), (4, "2d")])
def test_dtensor_redistributions_match_gloo(n, mesh):
    """DTensor over an eccl DeviceMesh: Shard/Replicate/Partial(sum, avg) redistributions
    in every direction (all_gather, all_to_all, all_reduce, reduce_scatter underneath),
    even and uneven shards, full_tensor and ops on sharded tensors, over a 1-D mesh of
    three ranks and a 2 x 2 mesh of four: gloo's results, bit for bit (the inputs are
    eighths, so sums are exact in any order); an inexact all_reduce has the same bits on
    every eccl rank and gloo's values within rounding."""
    script = HERE / "dtensor_script.py"
    args = ["2d"] if mesh == "2d" else []
    gloo = run_world(n, ["gloo", *args], script)
    ours = run_world(n, ["eccl", *args], script)
    inexact = "inexact partial->replicate"
    for r in range(n):
        assert set(ours[r]) == set(gloo[r])
        for key in gloo[r]:
            if key != inexact:
                assert ours[r][key] == gloo[r][key], (r, key)
    if mesh == "1d":
        assert all(o[inexact] == ours[0][inexact] for o in ours)
        torch = pytest.importorskip("torch")
        assert torch.allclose(torch.tensor(ours[0][inexact]), torch.tensor(gloo[0][inexact]))


def test_hsdp_over_a_two_dimensional_mesh_trains_as_with_gloo():
    """HSDP: `fully_shard` over a (replicate, shard) = (2, 2) CPU mesh of four ranks, so
    each step reduce-scatters within a shard group and all-reduces across replicas
    (subgroups of the world). Three SGD steps end with gloo's parameters and losses, bit
    for bit, on every rank."""
    script = HERE / "fsdp_script.py"
    gloo = run_world(4, ["gloo", "hsdp"], script)
    ours = run_world(4, ["eccl", "hsdp"], script)
    for r in range(4):
        assert gloo[r]["params"] == gloo[0]["params"]
        assert ours[r]["params"] == gloo[r]["params"], f"rank {r}"
        assert ours[r]["loss"] == gloo[r]["loss"], f"rank {r}"
