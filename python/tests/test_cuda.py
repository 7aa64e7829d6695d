"""CUDA tensors on the eccl torch backend, with real processes on a real GPU (two
processes share a GPU when there is one). Skipped without CUDA: the GPU check
(`.ci/gpu_check.sh`) runs it on a machine with one. The same-host path (CUDA IPC) and the
staged path (`ECCL_CUDA_IPC=0`) must both give the CPU path's results exactly."""

import os

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the GPU check runs these)")

from test_torch_backend import HERE, run_processes, run_world, world_specs  # noqa: E402


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


def test_mixed_devices_and_disagreeing_ranks_get_typed_errors():
    on("cuda")
    res = run_processes(world_specs(2, ["eccl", "mixed"], HERE / "torch_script.py"))
    for r in res:
        assert r["mixed"] == "InvalidArgumentError"
        assert r["after_mixed"] == [3.0] * 4
        assert r["disagree"] != "no error", r
