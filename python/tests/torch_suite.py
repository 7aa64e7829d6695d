"""PyTorch's own backend suite (`torch.testing._internal.distributed.distributed_test`,
the tests torch runs for gloo and NCCL in `test_distributed_spawn.py`) for a backend
named by BACKEND, through the suite's hook for third-party backends ("plugin"); eccl is
marked as doing what gloo does on the CPU (DDP, subgroups), not CUDA.

    BACKEND=eccl WORLD_SIZE=3 python torch_suite.py [-k PATTERN ...]

Each test spawns WORLD_SIZE processes over a FileStore, as torch's own run does.
"""

import os
import sys

os.environ.setdefault("BACKEND", "eccl")
os.environ.setdefault("WORLD_SIZE", "3")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if not dist.is_available():
    sys.exit("torch.distributed is not available")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

BACKEND = os.environ["BACKEND"]
if BACKEND not in ("gloo", "nccl"):
    import eccl.torch  # noqa: E402,F401 - registers the backend (as its entry point would)
    for feature in ("plugin", "ddp", "subgroup"):
        DistTestCases.backend_feature[feature].add(BACKEND)

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
