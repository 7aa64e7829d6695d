"""CUDA tensors on the eccl torch backend, with real processes on a real GPU (two
processes share a GPU when there is one). Skipped without CUDA: the GPU check
(`.ci/gpu_check.sh`) runs it on a machine with one. The same-host path (CUDA IPC) and the
staged path (`ECCL_CUDA_IPC=0`) must both give the CPU path's results exactly."""

import os

import pytest
from conftest import NOT_POSSIBLE  # noqa: E402

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"{NOT_POSSIBLE} no CUDA GPU (the GPU check, .ci/gpu_check.sh, runs these on one)")

from test_torch_backend import HERE, check_big_uneven, check_p2p_mismatch, run_processes, run_world, world_specs  # noqa: E402


def on(device, ipc=True):
    os.environ["ECCL_TEST_DEVICE"] = device
    os.environ["ECCL_CUDA_IPC"] = "1" if ipc else "0"


@pytest.fixture(autouse=True)
def _restore_env():
    saved = {k: os.environ.get(k) for k in ("ECCL_TEST_DEVICE", "ECCL_CUDA_IPC")}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "staged"])
def test_every_collective_on_cuda_gives_the_cpu_results(ipc):
    on("cpu")
    cpu = run_world(2, ["eccl", "collectives"])
    on("cuda", ipc)
    gpu = run_world(2, ["eccl", "collectives"])
    assert gpu == cpu


def test_memory_ipc_cannot_export_takes_the_staged_path_with_the_cpu_results(monkeypatch):
    # torch's expandable segments allocate with cuMemCreate, which cuIpcGetMemHandle
    # refuses: every rank's record then sends the call through host memory together,
    # where a failed export used to fail that rank alone before the exchange.
    on("cpu")
    cpu = run_world(2, ["eccl", "collectives"])
    on("cuda")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Fresh interpreters, not forks of the suite's zygote (which imported torch before
    # the variable was set: whether torch reads it that late differs between versions).
    monkeypatch.setenv("TEST_ZYGOTE", "0")
    gpu = run_world(2, ["eccl", "collectives"])
    # Each rank checked that its allocator made expandable segments before it called.
    assert all(x.pop("_expandable_segments", False) is True for x in gpu), gpu
    assert gpu == cpu


def test_every_dtype_and_op_on_cuda_gives_the_cpu_results():
    on("cpu")
    cpu = run_world(2, ["eccl", "coverage"])
    on("cuda")
    gpu = run_world(2, ["eccl", "coverage"])
    assert gpu == cpu


def test_ddp_on_cuda_ends_with_gloos_parameters():
    on("cuda")
    eccl_res = run_world(2, ["eccl", "ddp"])
    gloo_res = run_world(2, ["gloo", "ddp"])
    assert eccl_res[0]["params"] == gloo_res[0]["params"]
    assert eccl_res[0]["params"] == eccl_res[1]["params"]


def test_fsdp2_on_cuda_over_ipc_trains_as_staged_and_near_the_cpu():
    """FSDP2 on CUDA tensors: its all-gathers and reduce-scatters (NCCL's in-place forms)
    over CUDA IPC end with the staged path's parameters and loss bit for bit (the same
    GPU computes both; only the path of the bytes differs), and within float rounding of
    the CPU's."""
    script = HERE / "fsdp_script.py"
    on("cuda", ipc=True)
    ipc = run_world(2, ["eccl"], script)
    on("cuda", ipc=False)
    staged = run_world(2, ["eccl"], script)
    on("cpu")
    cpu = run_world(2, ["eccl"], script)
    assert ipc[0]["params"] == ipc[1]["params"]
    assert ipc == staged
    for k, v in cpu[0]["params"].items():
        got = torch.tensor(ipc[0]["params"][k], dtype=torch.float64)
        assert torch.allclose(got, torch.tensor(v, dtype=torch.float64), rtol=1e-4, atol=1e-5), k


def test_in_place_gather_and_scatter_over_ipc_follow_nccl():
    """all_gather_into_tensor and reduce_scatter_tensor on CUDA tensors in NCCL's
    in-place forms give the out-of-place results; an input overlapping the output
    anywhere else is refused with InvalidArgumentError on every rank, and the group goes
    on (as on the CPU: test_torch_backend)."""
    on("cuda")
    n = 2
    res = run_world(n, ["eccl", "inplace"], HERE / "fsdp_script.py")
    gathered = [float(10 * r + i) for r in range(n) for i in range(3)]
    for r, x in enumerate(res):
        assert x["gathered"] == gathered, (r, x)
        assert x["scattered"] == x["scatter_expect"], (r, x)
        assert x["overlap"] == "InvalidArgumentError", (r, x)
        assert x["after"] == [float(n)] * 2, (r, x)


@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "staged"])
def test_uneven_all_to_all_on_cuda_and_a_rank_with_wrong_splits(ipc):
    """all_to_all_single and all_to_all of uneven blocks of 16 MiB and more on the device
    path, sizes that disagree, and a rank whose own splits do not cut its tensor (it
    joins the device call moving nothing, then fails; the others fail with it rather
    than wait): as on the CPU (test_torch_backend.py)."""
    on("cuda", ipc)
    check_big_uneven(run_world(2, ["eccl", "big_uneven"]), 2)


def test_mixed_devices_and_disagreeing_ranks_get_typed_errors():
    on("cuda")
    res = run_processes(world_specs(2, ["eccl", "mixed"], HERE / "torch_script.py"))
    for r in res:
        assert r["mixed"] == "InvalidArgumentError"
        assert r["after_mixed"] == [3.0] * 4
        assert r["disagree"] != "no error", r
    # A CPU send where a CUDA receive waits: the receiver's typed error, then the group
    # goes on.
    assert res[0]["p2p_kinds"] == "sent", res[0]
    assert res[1]["p2p_kinds"].startswith("MismatchError"), res[1]
    for r in res:
        assert r["after_p2p_kinds"] == [2.0] * 4, r


@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "staged"])
def test_a_collective_is_ordered_after_the_stream_without_blocking_the_caller(ipc):
    """Stream semantics as torch's own backends give them: a collective called while the
    current stream still has half a second of work queued returns to the caller at once
    (the wait for the stream is an event, waited on by the communicator's task), and
    still takes what the stream wrote after that work; over CUDA IPC and staged (a world
    each: a rank reads ECCL_CUDA_IPC once, when its communicator first meets the GPU)."""
    on("cuda", ipc)
    res = run_world(2, ["eccl"], HERE / "stream_script.py")
    for r, x in enumerate(res):
        for path in ["ipc" if ipc else "staged"]:
            assert x[f"{path}_sum"] == [3.0], (r, path, x)
            assert x[f"{path}_gathered"] == [1.0] * 4 + [2.0] * 4, (r, path, x)
            assert x[f"{path}_scattered"] == [3.0] * 4, (r, path, x)
            assert x[f"{path}_exchanged"] == [1.0, 1.0, 2.0, 2.0], (r, path, x)
            assert x[f"{path}_exchanged_list"] == [1.0, 1.0, 2.0, 2.0], (r, path, x)
            # Blocking on the stream would cost the whole sleep (at least 500 ms).
            assert x[f"{path}_call_ms"] < 150, (r, path, x)
            assert x[f"{path}_done_ms"] > 400, (r, path, x)


FAULT_SCRIPT = r"""
import os, signal, sys, time, json
import torch, eccl
rank, fault, addr, secret = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.cuda.set_device(rank % torch.cuda.device_count())
comm = eccl.Communicator(addr, secret, rank_hint=rank, min_world=2)
comm.update_topology()
t = torch.ones(16 << 20, device="cuda")  # 64 MiB

def call(async_op=False):
    torch.cuda.synchronize()
    return comm.all_reduce_device(t.data_ptr(), t.numel(), "float32", device=t.device.index,
                                  owner=t, async_op=async_op, keep_on_abort=True)

out = {"ok_calls": 0}
for i in range(20):
    t.fill_(float(i + 1))
    if rank == 1 and i == 3:
        call(async_op=True)        # in flight when this process dies or stops
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        time.sleep(60)
    before = t.clone()
    t0 = time.monotonic()
    try:
        call()
        assert torch.equal(t, before * 2), "a successful call's result is wrong"
        out["ok_calls"] += 1
    except eccl.EcclError as e:
        torch.cuda.synchronize()
        out["error"] = type(e).__name__
        out["seconds"] = time.monotonic() - t0
        out["unchanged"] = bool(torch.equal(t, before))
        t.fill_(7.0)               # the device and the process still work
        out["after"] = float(t.sum().item())
        break
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("path", ["ipc", "staged"])
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_peer_lost_mid_call_fails_the_survivor_fast_with_its_tensor_unchanged(fault, path):
    """G2 on the device: with keep_on_abort=True a survivor's CUDA tensor is as it was
    before the failed call; a killed peer is noticed at once, a stopped one at its lease;
    no hang. Over CUDA IPC, and through host memory (`ECCL_CUDA_IPC=0`: the staged
    pipeline, 64 MiB in four chunks through a device scratch buffer)."""
    import json
    import signal
    import subprocess
    import sys

    import eccl
    master = eccl.Master()
    env = dict(os.environ, ECCL_CUDA_IPC="1" if path == "ipc" else "0")
    procs = [subprocess.Popen([sys.executable, "-c", FAULT_SCRIPT, str(r), fault, master.addr,
                               master.secret], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        master.shutdown()
    assert procs[0].returncode == 0, f"{out}\n{err[-3000:]}"
    res = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])
    assert res["ok_calls"] >= 3, res
    assert "error" in res, res
    assert res["unchanged"], res
    assert res["after"] == 7.0 * (16 << 20)
    assert res["seconds"] < 15, res


def test_a_device_send_and_receive_of_different_sizes_fail_the_receiver_and_the_group_goes_on():
    """eccl's device send and receive (CUDA tensors, through page-locked host memory):
    as on the CPU (test_torch_backend.py)."""
    on("cuda")
    res = run_world(3, ["eccl", "p2p_mismatch"])
    check_p2p_mismatch(res)
    assert "elements of float32" in res[1]["mismatch"], res[1]
