"""`ElasticDDP`: DistributedDataParallel that goes on when ranks die and admits new ones,
on an `eccl.Communicator` (not a torch process group: its world changes)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

import eccl
from eccl.torch import TorchWork, _Completer

__all__ = ["ElasticDDP", "init_optimizer_state"]


class _LocalGroup(dist.ProcessGroup):
    """A process group of one, for constructing DDP without collectives: an elastic
    job's members do not all construct DDP at the same time (a newcomer does it alone),
    so construction must not talk to anyone. Gradients travel by the comm hook."""

    def __init__(self) -> None:
        super().__init__(0, 1)

    def getBackendName(self) -> str:  # noqa: N802
        return "eccl-local"

    def _done(self, result: Any) -> dist.Work:
        w = TorchWork()
        w._finish(result, None)
        return w

    def allreduce(self, tensors, opts=None):
        return self._done(tensors)

    def broadcast(self, tensors, opts=None):
        return self._done(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, inp in zip(output_tensors, input_tensors):
            outs[0].copy_(inp)
        return self._done(output_tensors)

    def all_gather_single(self, output, input, opts=None):
        output.copy_(input.reshape(output.shape))
        return self._done(output)

    _allgather_base = all_gather_single

    def barrier(self, opts=None):
        return self._done(None)


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Creates an optimizer's per-parameter state now instead of at its first step, so
    that a newcomer's state has the same tensors as the members' and can be synced.
    Knows SGD (momentum), Adam and AdamW; other optimizers must be stateless or have
    their state created by the caller."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if isinstance(opt, torch.optim.SGD):
                if group.get("momentum", 0) and "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p)
            elif isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p)


class ElasticDDP:
    """DistributedDataParallel that goes on when ranks die and admits new ones.

        comm = eccl.Communicator()                 # ECCL_MASTER, ECCL_SECRET_FILE, ...
        job = eccl.torch.ElasticDDP(model, opt, comm)
        while job.revision < steps:
            job.step_boundary()                    # admit newcomers, sync their state
            loss = job.train_step(lambda m: loss_fn(m(x), y))

    The module is wrapped in a real `DistributedDataParallel` (its buckets, its overlap of
    communication with backward) whose gradients travel by a comm hook on `comm`. When a
    member dies or hangs, the step in flight fails on every survivor (no optimizer step
    is taken), the survivors move to the next world and **retry the same step**: every
    rank keeps the batch it had, and gradients are averaged over the members that took
    part in the successful attempt (the all_reduce reports them). A retry rather than a
    skip keeps every rank's batch sequence intact and costs one step's compute.

    At each step boundary, pending peers are admitted and the model's parameters and
    buffers and the optimizer's state go to them with `sync_shared_state` (the content
    most members hold at the highest revision, i.e. the step count), so every rank holds
    bit-identical parameters.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: eccl.Communicator, *, bucket_cap_mb: float = 25, max_retries: int = 16):
        self.comm = comm
        self.module = module
        self.optimizer = optimizer
        self.max_retries = max_retries
        self.revision = 0
        self.members: tuple = ()
        self._failed: Optional[BaseException] = None
        self._buckets: list = []
        self._order = [p for _, p in module.named_parameters()]
        self._done = _Completer()
        init_optimizer_state(optimizer)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            module, process_group=_LocalGroup(), bucket_cap_mb=bucket_cap_mb)
        self.ddp.register_comm_hook(self, ElasticDDP._hook)
        # A newcomer's admission is the step boundary at which the members admit it: its
        # first step_boundary() must not ask again.
        self._joined_now = comm.rank is None
        if self._joined_now:
            comm.update_topology()
        self._sync()

    def _state(self) -> dict:
        st = {f"param.{n}": p.data for n, p in self.module.named_parameters()}
        st.update({f"buffer.{n}": b for n, b in self.module.named_buffers()})
        names = {p: n for n, p in self.module.named_parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in sorted(self.optimizer.state[p].items()):
                    if torch.is_tensor(v):
                        st[f"optim.{names.get(p, id(p))}.{k}"] = v
        return st

    def _sync(self) -> None:
        info = self.comm.sync_shared_state(self.revision, self._state())
        self.revision = info.revision

    def step_boundary(self) -> bool:
        """Admits pending peers (every member calls this at the same step); returns
        whether the world changed."""
        if self._joined_now:
            self._joined_now = False
            return False
        if not self.comm.are_peers_pending():
            return False
        self.comm.update_topology()
        self._sync()
        return True

    def recover(self) -> None:
        """After a failed step: the next world, and the state synced over it."""
        for _ in range(self.max_retries):
            try:
                self.comm.update_topology()
                self._sync()
                return
            except eccl.AbortedError:
                continue
        raise eccl.AbortedError(f"no stable world after {self.max_retries} attempts")

    def train_step(self, compute_loss) -> float:
        """Runs forward, backward (gradients averaged over the members) and the
        optimizer step; retries on the next world if a member fails meanwhile."""
        for _ in range(self.max_retries):
            self._failed = None
            self.optimizer.zero_grad(set_to_none=False)
            loss = compute_loss(self.ddp)
            loss.backward()
            if self._failed is None:
                self.optimizer.step()
                self.revision += 1
                return float(loss.item())
            self.recover()
        raise eccl.AbortedError(f"step failed {self.max_retries} times: {self._failed}")

    # No annotations: DDP accepts a hook's only if they are exactly its own types.
    @staticmethod
    def _hook(state, bucket):
        fut: Future = Future()
        state._buckets.append((bucket, fut))
        if bucket.is_last():
            state._reduce_buckets()
        return fut

    def _reduce_buckets(self) -> None:
        """All of a step's gradients in one all_reduce, in parameter-name order. DDP
        lays its buckets out by the order gradients became ready, which it rebuilds
        after a process's first step, so a newcomer's buckets differ from the members';
        reducing bucket by bucket would add up different parameters' gradients."""
        pending, self._buckets = self._buckets, []
        views = {}
        for bucket, _ in pending:
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                views[p] = g
        grads = [views[p] for p in self._order if p in views]

        def finish_all() -> None:
            for bucket, fut in pending:
                fut.set_result(bucket.buffer())

        if self._failed is not None or not grads:
            finish_all()
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = self.comm.all_reduce(flat, "sum", async_op=True)

        def finish() -> None:
            try:
                info = work.wait()
                self.members = info.members
                flat.div_(len(info.members))
                offset = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[offset:offset + n].view_as(g))
                    offset += n
            except Exception as e:  # noqa: BLE001 - the step fails and is retried
                self._failed = e
            finally:
                # DDP's reducer needs every bucket's future, whatever happened.
                finish_all()

        self._done.call_soon(finish)
