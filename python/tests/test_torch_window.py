"""torch's one-sided windows on eccl (`dist._new_window` and the Window's put, signal,
wait_signal, map_remote_tensor), and `allocate_tensor`, in real processes under
`init_process_group("eccl")`: the contract as torch's NCCL window keeps it, bad calls
refused on every rank, and a SIGKILLed or SIGSTOPped peer failing the waits on it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eccl.torch_window  # noqa: E402
from procs import read_until, spawn, wait_stopped  # noqa: E402
from test_torch_backend import _result, run_processes, run_world, world_specs  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "window_script.py"


@pytest.fixture(scope="module", autouse=True)
def shim():
    """Builds the C++ Window once here (about 20 s the first time on 2 cores), so that the
    ranks find it in torch's extension cache instead of each waiting for one build."""
    eccl.torch_window.shim()


@pytest.mark.parametrize("n,links", [(2, False), (3, False), (3, True)],
                         ids=["2-mapped", "3-mapped", "3-over-links"])
def test_put_signal_wait_and_remote_tensors_follow_torchs_window_contract(n, links):
    specs = world_specs(n, ["basic"], SCRIPT)
    if links:   # every rank a host of its own: nothing mapped, TCP links
        for r, (_, env) in enumerate(specs):
            env.update(ECCL_HOST_ID=f"window-host-{r}", WINDOW_TEST_OVER_LINKS="1")
    res = run_processes(specs)
    for r, out in enumerate(res):
        prev = (r - 1) % n
        assert out["supports_window"] is True
        assert out["window_type"] == "Window"    # torch's C++ Window, as torch requires
        # The predecessor's put landed in this rank's block of its window, nothing else.
        want = [0.0] * (4 * n)
        want[4 * prev:4 * prev + 4] = [prev + 1.0] * 4
        assert out["after_put"] == want, (r, out["after_put"])
        if links:
            assert out["remote_error"].startswith("InvalidArgumentError"), out
            assert out["attr"] == "WindowAccessType.SEPARATE"
        else:
            # map_remote_tensor is the next rank's memory: this rank's put is there...
            assert out["remote_len"] == 4 * n
            assert out["remote_mine"] == [r + 1.0] * 4
            assert out["attr"] == "WindowAccessType.UNIFIED"
        # ...and the predecessor's write landed here, seen after its signal.
        assert out["after_remote_write"] == 100.0 + prev
        assert out["put_async_completed"] is True
        assert out["after_async_put"] == -1.0
        errs = out["errors"]
        for name in ("wrong_dtype", "out_of_bounds", "bad_rank", "negative_offset"):
            assert errs[name] and errs[name].startswith("InvalidArgumentError"), (name, errs)
        assert "float32" in errs["wrong_dtype"] and "int32" in errs["wrong_dtype"]
        # One rank's tensor could not serve: every rank says which and why.
        assert out["bad_tensor"].startswith("InvalidArgumentError"), out["bad_tensor"]
        assert "rank 0's tensor is not contiguous" in out["bad_tensor"]
        # A plain tensor on the last rank: the others' puts reached it over the link.
        if r == n - 1:
            assert out["plain_window"] == [float(p + 1) for p in range(n)]
            assert out["plain_attr"] == "WindowAccessType.UNIFIED"   # its own memory
            assert out["plain_remote"] is None
        else:
            assert out["plain_attr"] == "WindowAccessType.SEPARATE"
            assert out["plain_remote"].startswith("InvalidArgumentError"), out
        assert out["all_reduce_after"] == [float(n)] * 2
        assert out["pending_completed"] is False
        assert out["done_completed"] is True and out["future_done"] is True
        # Over the links a timed-out wait ends the epoch: a rank whose own wait had not
        # timed out yet learns it from the first that did.
        got = out["wait_timeout"]
        assert got.startswith("EcclTimeoutError") or (
            links and got.startswith("AbortedError") and "timed out" in got), got


def _fault_world(n, links):
    specs = world_specs(n, ["fault"], SCRIPT)
    if links:
        for r, (_, env) in enumerate(specs):
            env.update(ECCL_HOST_ID=f"window-host-{r}")
    procs = [spawn(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for argv, env in specs]
    for p in procs:
        assert "READY" in read_until(p, "READY", 90), "a rank did not make its window"
    return procs


@pytest.mark.parametrize("how,links", [("killed", False), ("stopped", False),
                                       ("killed", True), ("stopped", True)],
                         ids=["killed-mapped", "stopped-mapped", "killed-over-links",
                              "stopped-over-links"])
def test_a_dead_or_hung_peer_fails_window_waits_with_a_typed_error(how, links):
    n = 3
    procs = _fault_world(n, links)
    try:
        time.sleep(0.5)   # the others are in wait_signal on the last rank by now
        start = time.monotonic()
        last = procs[-1]
        if how == "killed":
            last.kill()
        else:
            os.kill(last.pid, signal.SIGSTOP)
            wait_stopped(last.pid)
        for p in procs[:-1]:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out[-3000:]
            res = _result(out)
            # The epoch's abort, naming the lost peer, not a hang or the group's timeout.
            assert res["error"].startswith("AbortedError"), res
            assert ("lost its master connection" in res["error"]
                    or "lease expired" in res["error"]
                    or "closed the connection" in res["error"]), res
            assert res["put_error"] and res["put_error"].startswith("AbortedError"), res
        # Within the lease (and its check) for a hung peer; at once for a dead one.
        assert time.monotonic() - start < 15
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("n,links", [(2, False), (3, False), (3, True)],
                         ids=["2", "3", "3-over-links"])
def test_all_gather_and_reduce_scatter_read_shared_tensors_directly(n, links):
    """all_gather and reduce_scatter on tensors from allocate_tensor: every rank reads
    the others' memory (wait() says so), in place too, through the communicator and
    through torch; plain tensors and a mix of both go over the links, with the same
    results; sizes that disagree are a MismatchError on every rank. Ranks on other hosts
    (ECCL_HOST_ID apart) take the links whatever their tensors."""
    specs = world_specs(n, [], Path(__file__).resolve().parent / "shared_script.py")
    if links:
        for r, (_, env) in enumerate(specs):
            env.update(ECCL_HOST_ID=f"shared-host-{r}")
    res = run_processes(specs)
    for out in res:
        direct = not links
        assert out["shared"] == [direct, True], out
        assert out["shared_in_place"] == [direct, True], out
        assert out["plain"] == [False, True], out
        assert out["mixed"] == [False, True], out
        for op in ("sum", "max", "avg"):
            assert out[f"rs_{op}"] == [direct, True], (op, out)
        assert out["rs_plain"] == [False, True], out
        assert out["mismatch"] == "MismatchError", out
        assert out["op_mismatch"] == "MismatchError", out
        # Over the links the ordinary collective's checks answer (the ranks' calls
        # differ: a mismatch where the other ranks see it).
        assert out["bad_on_one_rank"] in (
            ("InvalidArgumentError", "MismatchError") if links else ("InvalidArgumentError",)), out
        assert out["avg_of_ints"] == "InvalidArgumentError", out
        assert out["kind_mismatch"] == "MismatchError", out
        assert out["torch_all_gather"] is True and out["torch_reduce_scatter"] is True, out
        assert out["torch_premul"] is True, out
        assert out["torch_direct"] == [direct] * 3, out


def test_allocate_tensor_places_tensors_in_shared_memory_only_on_the_cpu():
    t = eccl.torch_window.allocate(10, torch.bfloat16)
    assert t.shape == (10,) and t.dtype == torch.bfloat16
    region, offset = eccl.torch_window.region_of(t[3:])
    assert offset == 3 * 2 and region.nbytes >= 20
    other = eccl._eccl.SharedMemory.open(region.pid, region.fd, region.nbytes)
    t[4] = 2.5
    assert torch.frombuffer(other, dtype=torch.bfloat16, count=10)[4].item() == 2.5
    assert eccl.torch_window.region_of(torch.zeros(4)) is None
    assert eccl.torch_window.allocate(0, torch.float32).numel() == 0
    # The region goes with its last tensor, and its address leaves the table.
    address = region.address
    del t, region, other
    import gc
    gc.collect()
    assert address not in eccl.torch_window._regions
    with pytest.raises(eccl.InvalidArgumentError):
        eccl.torch_window.allocate(-1, torch.float32)


def test_window_put_of_64_mib_against_a_copy():
    """Not a timed assertion: prints the figures (docs/measurements.md) and checks the
    data arrived whole."""
    res = run_world(2, ["bench"], script=SCRIPT)
    assert res[1]["equal"] is True
    print("window put 64 MiB:", res[0])
