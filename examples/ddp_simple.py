"""The smallest DDP program, on CPU with the "eccl" backend: one parameter w = 5,
y = 7 * w * x with x = rank, so on two ranks the gradients 0 and 7 average to 3.5,
which every rank prints.

    torchrun --nproc-per-node 2 examples/ddp_simple.py
"""

import eccl.torch  # noqa: F401  registers the "eccl" backend
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([5.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 7 * self.w * x


def main() -> None:
    dist.init_process_group("eccl")
    rank = dist.get_rank()
    model = DDP(Scale())
    y = model(torch.tensor([float(rank)]))
    y.sum().backward()
    print(f"rank {rank}: grad {model.module.w.grad.item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
