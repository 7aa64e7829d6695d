"""`DiLoCo`: local SGD with an outer optimizer (DiLoCo, Douillard et al. 2023) on an
elastic `eccl.Communicator`: members train alone for `sync_every` steps, then average
their pseudo-gradients (how far each moved from the shared model) in one all_reduce and
take an outer optimizer step on the shared model. Members die and join between and
during outer steps."""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

import eccl
from eccl.elastic import (
    COMPRESSION,
    QUANTIZED,
    give_up,
    init_optimizer_state,
    next_world,
    retryable,
    sync_or_next_world,
)

log = logging.getLogger("eccl.torch")

__all__ = ["DiLoCo"]

# Per rank, exchanged after every change of world: whether it still needs the inner
# optimizer's state, whether its pseudo-gradient counts in the outer step under way,
# whether it is inside an outer step, and the shared state's revision it holds.
_NEEDS_INNER, _CONTRIBUTES, _IN_OUTER, _REVISION, _REACHED = 0, 1, 2, 3, 4


def _flat_bytes(tensors: List[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


class DiLoCo:
    """DiLoCo on eccl.

        comm = eccl.Communicator()
        inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        job = eccl.torch.DiLoCo(model, inner, outer, comm, sync_every=100)
        while job.outer_steps < n:
            loss = job.train_step(lambda m: loss_fn(m(x), y))
        job.close()         # a newcomer admitted at the last outer step gets its state

    Every `sync_every` calls of `train_step`, the pseudo-gradients (shared model minus
    local model) are averaged over the members in one all_reduce and the outer
    optimizer steps the shared model from them; every member then continues from the
    identical result. If a member dies or hangs during that all_reduce, the survivors
    move to the next world and reduce their (unchanged) pseudo-gradients again over it.

    Newcomers are admitted at outer steps: they receive the shared model and the outer
    optimizer's state with `sync_shared_state` (held identically by every member) and the
    inner optimizer's state of one member (each member's own is its own). The members
    serve that in the background and go on with their inner steps, which need no
    communication, while the newcomer fetches (`serving` says so); the next outer step
    waits for the transfer if it is still running. A newcomer admitted while the members
    retry an outer step joins that step with no pseudo-gradient of its own (the average
    is over the members that trained).
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, comm: eccl.Communicator, *,
                 sync_every: int, compression: Optional[str] = None, max_retries: int = 16):
        if sync_every < 1:
            raise eccl.InvalidArgumentError(f"sync_every must be at least 1, not {sync_every}")
        if compression not in COMPRESSION:
            raise eccl.InvalidArgumentError(f"unknown compression {compression!r}")
        self.model = model
        self.inner = inner_optimizer
        self.outer = outer_optimizer
        self.comm = comm
        self.sync_every = sync_every
        self.max_retries = max_retries
        self.outer_steps = 0            # the shared state's revision
        # The newest revision this rank has heard that the job reached (a newcomer knows
        # it before its state arrives).
        self._reached = 0
        self.local_steps = 0
        self.members: tuple = ()
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._shared = [p.detach().clone() for p in self._params]
        self._sizes = [p.numel() for p in self._params]
        self._wire = COMPRESSION[compression] or torch.float32
        # "int8": the outer all_reduce quantizes (f32 on both ends, 8-bit values between).
        self._quantize = compression if compression in QUANTIZED else None
        init_optimizer_state(self.inner)
        init_optimizer_state(self.outer)
        # The transfers a member serves in the background (a newcomer's state).
        self._serving: List = []
        self._needs_inner = comm.rank is None
        self._contributes = not self._needs_inner
        if self._needs_inner:
            comm.update_topology()
        # A fault during the first sync (the member serving it died): the next world, and
        # the sync again over it, as the members do.
        members_in_outer = sync_or_next_world(comm, self._admitted, max_retries)
        if members_in_outer:
            # The members are retrying an outer step: take part with nothing to add, and
            # in the step boundary that follows it there (every member asks the master
            # whether peers are pending, which it answers once all have asked).
            self._outer_step(zero=True)
            self._boundary()

    # -- shared state -----------------------------------------------------------------

    def _state(self) -> dict:
        st = {f"shared.{i}": t for i, t in enumerate(self._shared)}
        for i, p in enumerate(self._params):
            for k, v in sorted(self.outer.state[p].items()):
                if torch.is_tensor(v):
                    st[f"outer.{i}.{k}"] = v
        return st

    def _inner_state(self) -> List[torch.Tensor]:
        return [v for p in self._params for _, v in sorted(self.inner.state[p].items())
                if torch.is_tensor(v)]

    def _admitted(self, in_outer: bool = False) -> bool:
        """After a change of world: syncs the shared state, hands the inner optimizer's
        state to newcomers, and returns whether some member is inside an outer step.

        Every rank first says where it stands (one small all_gather): who needs the
        inner state, who trained for the outer step under way, and the revision each
        holds and the newest it has heard of (a job whose every holder of a state left
        before passing it on stops here with `StateLostError`, on every rank, rather than
        train on from a half-received copy; one whose survivors hold an older outer step
        whole goes on from it, and says so). A rank behind the
        newest revision (a newcomer, or a member that had been evicted) waits for its
        state here; a rank that holds it only serves, in the background, and `_settle`
        waits for that before its next collective of its own."""
        n = self.comm.world_size
        mine = torch.tensor([self._needs_inner, self._contributes, in_outer, self.outer_steps,
                             max(self._reached, self.outer_steps)], dtype=torch.int64)
        roster = torch.empty((n, 5), dtype=torch.int64)
        self.comm.all_gather(roster, mine)
        newest = int(roster[:, _REVISION].max())
        reached = int(roster[:, _REACHED].max())
        if reached > newest == 0:
            # Every rank that held a state left before passing it on: the ranks here are
            # newcomers with at most a half-received copy.
            raise eccl.StateLostError(reached, newest, "the outer state")
        if reached > newest:
            log.warning("eccl: the holders of outer step %d left before passing it on: "
                        "the job goes on from outer step %d", reached, newest)
        self._reached = newest
        current = roster[:, _REVISION] == newest
        stale = self.outer_steps < newest
        if stale and not self._needs_inner:
            # Behind the others (it had been evicted): its local training belongs to an
            # old model; it restarts from the shared one and adds nothing this time.
            self._contributes = False
        in_outer_now = bool(roster[:, _IN_OUTER].any())
        # The outer step under way averages over those who trained for it at the newest
        # revision (a rank behind adds nothing, whatever it said); the next one, over
        # everyone.
        trained = roster[:, _CONTRIBUTES].bool() & current
        self._contributors = int(trained.sum()) if in_outer_now else n
        # The shared state and the outer optimizer's change only in an outer step, which
        # runs after this sync in the communicator's queue: serving them in the
        # background is safe while inner steps run.
        works = [self.comm.sync_shared_state(self.outer_steps, self._state(), async_op=True)]
        needy = [r for r in range(n) if roster[r, _NEEDS_INNER]]
        # The inner state comes from a rank that trained on the newest model.
        givers = [r for r in range(n) if not roster[r, _NEEDS_INNER] and current[r]]
        received: List = []
        if needy and givers:
            src = givers[0]
            if self.comm.rank == src:
                # A copy taken now: inner steps go on changing the optimizer's state.
                flat = _flat_bytes(self._inner_state())
                works += [self.comm.send(flat, r, async_op=True) for r in needy]
            elif self.comm.rank in needy:
                tensors = self._inner_state()
                flat = torch.empty_like(_flat_bytes(tensors))
                works.append(self.comm.recv(flat, src, async_op=True))
                received = [(tensors, flat)]
        waits = stale or self.comm.rank in needy
        if not waits:
            self._serving = works
            return in_outer_now
        info = works[0].wait()
        # The shared state is whole from here, also if the inner state's transfer fails.
        self.outer_steps = info.revision
        for w in works[1:]:
            w.wait()
        for tensors, flat in received:
            off = 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                t.copy_(flat[off:off + nbytes].view(t.dtype).view(t.shape))
                off += nbytes
        if self.comm.rank in needy:
            self._needs_inner = False   # with a member's state, or, with none, afresh
        self._reset_local()
        return in_outer_now

    @property
    def serving(self) -> bool:
        """Whether this member is still serving a newcomer's state in the background."""
        return any(not w.is_completed() for w in self._serving)

    def close(self) -> None:
        """Waits for the transfers this member still serves (a newcomer admitted at the
        last outer step): call it before the loop ends or the process exits. A transfer
        that failed (the newcomer died) is the newcomer's loss, not this member's."""
        try:
            self._settle()
        except eccl.EcclError:
            pass

    def _settle(self) -> None:
        """Waits for the transfers this member serves (raising a failed one's error, an
        `AbortedError` when the world changed under it)."""
        works, self._serving = self._serving, []
        for w in works:
            w.wait()

    def _reset_local(self) -> None:
        with torch.no_grad():
            for p, s in zip(self._params, self._shared):
                p.copy_(s)

    # -- training ---------------------------------------------------------------------

    def train_step(self, compute_loss) -> float:
        """One inner step; every `sync_every`-th also runs the outer step."""
        self.inner.zero_grad(set_to_none=False)
        loss = compute_loss(self.model)
        loss.backward()
        self.inner.step()
        self.local_steps += 1
        self._contributes = True
        if self.local_steps % self.sync_every == 0:
            self._outer_step()
            self._boundary()
        return float(loss.item())

    def _boundary(self) -> None:
        if self.comm.are_peers_pending():
            self.comm.update_topology()
            sync_or_next_world(self.comm, self._admitted, self.max_retries)

    def _pseudo_gradient(self, zero: bool) -> torch.Tensor:
        flat = torch.empty(sum(self._sizes), dtype=self._wire)
        if zero or not self._contributes:
            return flat.zero_()
        for s, p, part in zip(self._shared, self._params, flat.split(self._sizes)):
            if part.dtype == s.dtype:
                torch.sub(s.reshape(-1), p.detach().reshape(-1), out=part)
            else:
                part.copy_(s.reshape(-1) - p.detach().reshape(-1))
        return flat

    def _outer_step(self, zero: bool = False) -> None:
        last: Optional[BaseException] = None
        for _ in range(self.max_retries):
            try:
                # A sync served in the background ends first: it may have set the
                # shared state the pseudo-gradient is taken against.
                try:
                    self._settle()
                except eccl.EcclError as e:
                    if retryable(e):
                        # Perhaps this member's transfer alone failed: the others would
                        # wait for it in the all_reduce. The epoch is aborted so that
                        # they meet the failure there at once and retry with this one.
                        self.comm.abort(f"a transfer this member served failed: {e}")
                    raise
                if self._contributors == 0:
                    # Every rank that trained for this step left during it: there is no
                    # pseudo-gradient to average, and a step on zeros would still move
                    # the model (the outer optimizer's momentum). Every rank sees the
                    # same roster: all skip the step and train on from the shared model.
                    log.warning("eccl: no rank that trained for outer step %d is left: "
                                "the step is skipped", self.outer_steps + 1)
                    self._reset_local()
                    self._contributes = True
                    self._contributors = self.comm.world_size
                    return
                flat = self._pseudo_gradient(zero)
                info = self.comm.all_reduce(flat, "sum", quantize=self._quantize)
            except eccl.EcclError as e:
                if not retryable(e):
                    give_up(self.comm, e)
                last = e
                next_world(self.comm, lambda: self._admitted(in_outer=True), self.max_retries)
                continue
            self.members = info.members
            contributors = self._contributors
            with torch.no_grad():
                for s, p, part in zip(self._shared, self._params, flat.split(self._sizes)):
                    p.copy_(s)
                    p.grad = part.view(p.shape).to(p.dtype).div_(contributors)
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for s, p in zip(self._shared, self._params):
                    s.copy_(p)
            self.outer_steps += 1
            self._contributes = True
            self._contributors = len(info.members)
            return
        raise eccl.AbortedError(f"the outer step failed {self.max_retries} times: {last}") from last
