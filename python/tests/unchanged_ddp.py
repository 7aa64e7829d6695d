"""pytorch/examples' distributed/ddp-tutorial-series/multinode.py, as a user would run it
on CPU: the only change is the backend string. Nothing here imports the backend's
package; torch finds it by name.

    torchrun --nproc-per-node 2 unchanged_ddp.py 20 32 --backend NAME
"""

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, step_s):
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.step_s = step_s
        self.epochs_run = 0

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        time.sleep(self.step_s)
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            loss = self._run_batch(source, targets)
        print(f"[GPU{self.global_rank}] Epoch {epoch} | loss {loss:.6f}", flush=True)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
        digest = hashlib.sha256(b"".join(
            p.detach().numpy().tobytes() for p in self.model.parameters())).hexdigest()
        print(f"FINAL rank {self.global_rank} params {digest[:16]}", flush=True)


def main(total_epochs, batch_size, backend, step_s):
    pid_dir = os.environ.get("TEST_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"rank{os.environ['RANK']}.{os.getpid()}"), "w"):
            pass
    init_process_group(backend=backend)
    torch.manual_seed(0)
    dataset = MyTrainDataset(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        sampler=DistributedSampler(dataset))
    Trainer(model, loader, optimizer, step_s).train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("batch_size", type=int, nargs="?", default=32)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--step-s", type=float, default=0.0)
    args = parser.parse_args()
    main(args.total_epochs, args.batch_size, args.backend, args.step_s)
    sys.exit(0)
