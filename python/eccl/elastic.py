"""`ElasticDDP`: data-parallel training that goes on when ranks die and admits new ones,
on an `eccl.Communicator` (not a torch process group: its world changes)."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, List, NoReturn, Optional, TypeVar

import torch

import eccl

log = logging.getLogger("eccl.torch")

__all__ = ["ElasticDDP", "init_optimizer_state", "bucket_layout", "next_world", "retryable",
           "give_up", "sync_or_next_world"]

T = TypeVar("T")

#: Wire dtypes `ElasticDDP(compression=...)` accepts.
COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": None,
               "fp8": None}
#: Compressions that quantize on the wire (the all_reduce's `quantize=`) instead of
#: casting the buffer.
QUANTIZED = {"int8", "fp8"}
#: What `quantize=` takes.
QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)

# A step's tally, summed over the ranks when a newcomer healed during it: gradients
# contributed, members whose state the sync replaced, ranks whose part of the sync failed.
_TALLY_CONTRIBUTED, _TALLY_POISONED, _TALLY_FAILED = 0, 1, 2


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


def retryable(e: BaseException) -> bool:
    """Whether a failure is one that the next world can cure (an abort, a revoke, a
    timeout: the error's `retryable`), not one that every retry would meet again (bad
    arguments, ranks that disagree) or that ends this rank (evicted: a new Communicator
    registers again)."""
    return isinstance(e, eccl.EcclError) and bool(getattr(e, "retryable", False))


def next_world(comm: eccl.Communicator, resync: Callable[[], T], max_retries: int) -> T:
    """After a failed collective: moves `comm` to the next world and runs `resync` (the
    state sync every member runs after a change of world) over it, again while either
    is aborted by a further fault or `resync` fails with another retryable error (a
    timeout); returns what `resync` returned. `update_topology()`'s own timeout is
    raised at once: it already waited the whole join timeout for the other members (5
    minutes by default), and 16 more would not bring them. An error the next world
    cannot cure is given up on (`give_up`)."""
    last: Optional[BaseException] = None
    for _ in range(max_retries):
        try:
            comm.update_topology()
        except eccl.AbortedError as e:
            last = e
            continue
        except eccl.EcclError as e:
            if retryable(e):
                raise
            give_up(comm, e)
        try:
            return resync()
        except eccl.EcclError as e:
            if not retryable(e):
                give_up(comm, e)
            last = e
    raise eccl.AbortedError(f"no stable world after {max_retries} attempts: {last}") from last


def sync_or_next_world(comm: eccl.Communicator, sync: Callable[[], T], max_retries: int,
                       resync: Optional[Callable[[], T]] = None) -> T:
    """Runs `sync` (what every rank runs after a change of world); if a further fault
    fails it (a member or newcomer died), moves to the next world and runs `resync`
    (default: `sync`) over it (`next_world`). An error the next world cannot cure is
    given up on (`give_up`)."""
    try:
        return sync()
    except eccl.EcclError as e:
        if not retryable(e):
            give_up(comm, e)
    return next_world(comm, resync or sync, max_retries)


def give_up(comm: eccl.Communicator, error: BaseException) -> NoReturn:
    """Raises `error`, one the next world cannot cure, after this rank leaves the job:
    the other ranks' next world then forms without it (a process that goes on after the
    exception would keep renewing its lease, and they would wait for it in their vote
    until the join timeout). Where every rank met it (ranks that called different
    collectives), every rank leaves and raises it."""
    with contextlib.suppress(Exception):
        comm.leave()
    raise error


def bucket_layout(module: torch.nn.Module, bucket_cap_mb: float) -> List[List[str]]:
    """The gradient buckets of `module`: parameter names, in the order their gradients
    usually become ready (the reverse of registration, as DDP starts out), grouped by
    dtype and cut at `bucket_cap_mb`. A function of the model alone, so members and
    newcomers reduce the same parameters in the same collectives."""
    cap = max(1, int(bucket_cap_mb * 2**20))
    buckets: List[List[str]] = []
    open_: dict = {}  # dtype -> (names, bytes) of the bucket being filled
    for name, p in reversed(list(module.named_parameters())):
        if not p.requires_grad:
            continue
        names, size = open_.get(p.dtype, (None, 0))
        if names is None or size + p.numel() * p.element_size() > cap and names:
            names, size = [], 0
            buckets.append(names)
        names.append(name)
        open_[p.dtype] = (names, size + p.numel() * p.element_size())
    return buckets


class _Bucket:
    """One bucket's parameters, its flat copy of their gradients (what goes on the wire)
    and the collective in flight for it."""

    def __init__(self, params: List[torch.nn.Parameter], wire: Optional[torch.dtype],
                 quantize: Optional[str] = None):
        self.params = params
        self.sizes = [p.numel() for p in params]
        dtype = params[0].dtype
        on_wire = wire if wire is not None and dtype.is_floating_point else dtype
        # Zeroed, not just allocated: its pages are touched here, not in a newcomer's
        # first step (192 MiB of page faults took 0.5 s of a first step on 2 loaded
        # cores; a newcomer builds this before it waits for admission).
        self.flat = torch.zeros(sum(self.sizes), dtype=on_wire)
        self.quantize = quantize if on_wire in QUANTIZABLE else None
        self.waiting = len(params)
        self.work: Optional[eccl.Work] = None

    def fill(self) -> None:
        """Copies the gradients in (a parameter with none contributes zeros)."""
        for p, part in zip(self.params, self.flat.split(self.sizes)):
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1))

    def write_back(self, members: int) -> None:
        """The averaged gradients, into each parameter's `.grad`."""
        for p, part in zip(self.params, self.flat.split(self.sizes)):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            torch.div(part.view(p.shape), members, out=p.grad)


def _moved(info) -> bool:
    """Whether a sync replaced parameters or optimizer state here (buffers, such as
    batch norm's statistics, differ between members by design and do not count)."""
    return any(not n.startswith("buffer.") for n in info.updated)


class _Healing:
    """A sync running in the background since the step boundary that admitted a
    newcomer: its Work, the (address, version) of each tensor it holds in place, whether
    this rank is the one behind, and the tensors it was given (copies of a member's
    buffers among them)."""

    def __init__(self, work: eccl.Work, served: dict, behind: bool, tensors: dict):
        self.work = work
        self.served = served
        self.behind = behind
        self.tensors = tensors


class ElasticDDP:
    """Data-parallel training that goes on when ranks die and admits new ones.

        comm = eccl.Communicator()                 # ECCL_MASTER, ECCL_SECRET_FILE, ...
        job = eccl.torch.ElasticDDP(model, opt, comm)
        while job.revision < steps:
            job.step_boundary()                    # admit newcomers, sync their state
            loss = job.train_step(lambda m: loss_fn(m(x), y))

    Gradients travel in buckets (`bucket_cap_mb`, 25 MiB by default like DDP's) whose
    layout is a function of the model (`bucket_layout`), so it is the same on members
    and newcomers. Each bucket's all_reduce starts as soon as its gradients are ready,
    while backward goes on, in bucket order on every rank. `compression="bf16"` or
    `"fp16"` sends floating-point gradients in that type (the sum is still the same on
    every rank); `"int8"` sends them as 8-bit values with a minimum and step per block of
    256 (the all_reduce's `quantize="int8"`: a quarter of f32's bytes, the same bits on
    every rank, within half a step per other rank's block plus half of the sum's); `"fp8"` as
    E4M3 scaled per block (`quantize="fp8"`).
    `with job.no_sync():` around forward and backward accumulates gradients locally for
    the next `train_step`.

    When a member dies or hangs, the step's reduction fails on every survivor (no
    optimizer step is taken); the survivors move to the next world and reduce the same
    local gradients again over it (nothing is recomputed unless the state itself had to
    be replaced), averaging over the members that took part (the all_reduce reports
    them). At each step boundary, pending peers are admitted and the parameters,
    buffers and optimizer state go to them with `sync_shared_state`, so every rank
    holds bit-identical parameters.

    With `heal_in_background=True` (the default) a newcomer heals as torchft's
    recovering replicas do: the members serve the state while they compute the next
    step's forward and backward (the transfer hides behind their compute instead of
    adding to their step), and the newcomer contributes zero gradients to that one step
    (its `train_step` returns NaN, computing nothing, and the average is over the ranks
    that contributed); the state arrives before anyone's optimizer step, so every rank
    takes the same step from the same state. Until that step's end the members must not
    change their parameters or optimizer state outside `train_step` (buffers are served
    from a copy taken at the step boundary). `heal_in_background=False` syncs inside
    `step_boundary()` instead, every rank waiting for the transfer; the setting must be
    the same on every rank. A newcomer holds the state once its first `train_step`
    returns: a loop that stops at a step boundary, or reads the state there (a
    checkpoint, an evaluation), calls `close()` first, which waits for the transfer on
    every rank (members keep serving until then). A newcomer admitted while the members recover from a
    failure, or a rank that was evicted and comes back, heals the same way.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: eccl.Communicator, *, bucket_cap_mb: float = 25,
                 compression: Optional[str] = None, max_retries: int = 16,
                 heal_in_background: bool = True):
        if compression not in COMPRESSION:
            raise eccl.InvalidArgumentError(
                f"compression must be one of {sorted(k for k in COMPRESSION if k)} or None, "
                f"not {compression!r}")
        self.comm = comm
        self.module = module
        self.optimizer = optimizer
        self.max_retries = max_retries
        self.heal_in_background = heal_in_background
        #: The revision every member reports (the same on every rank of a world).
        self.revision = 0
        # The revision of the state this rank holds: behind `revision` on a newcomer
        # whose state is still arriving in the background.
        self._held = 0
        # The background sync of the step being healed, if any (see `_admit`).
        self._healing: Optional[_Healing] = None
        # This step's gradients were never computed here (a healing newcomer's).
        self._no_grads = False
        # (address, torch version) of each state tensor after the last sync.
        self._synced: dict = {}
        self.members: tuple = ()
        self.layout = bucket_layout(module, bucket_cap_mb)
        params = dict(module.named_parameters())
        quantize = compression if compression in QUANTIZED else None
        self._buckets = [_Bucket([params[n] for n in names], COMPRESSION[compression], quantize)
                         for names in self.layout]
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._next = 0                  # the next bucket to start, in layout order
        self._in_step = False           # inside train_step's backward: reduce
        self._reducing = True           # False inside no_sync()
        self._accumulated = False       # gradients from earlier backwards await a step
        self._failed: Optional[BaseException] = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for p in self._bucket_of]
        init_optimizer_state(optimizer)
        # A newcomer's admission is the step boundary at which the members admit it: its
        # first step_boundary() must not ask again.
        self._joined_now = comm.rank is None
        if self._joined_now:
            comm.update_topology()

        def again() -> bool:
            # A fault during the first sync (a member serving it died): the next world,
            # and the sync again over it, as the members do after a failed step. That
            # world may admit newcomers, for whom this is their admission: every rank
            # that came here skips its first step boundary as they do.
            self._joined_now = True
            return self._admit()
        sync_or_next_world(comm, self._admit, max_retries, again)

    # -- state ----------------------------------------------------------------------

    def _state(self) -> dict:
        return {n: t.data for n, t in self._sources().items()}

    def _sources(self) -> dict:
        """The state's tensors as torch tracks them (parameters themselves, whose version
        counter every in-place update bumps, not their `.data`)."""
        st = dict((f"param.{n}", p) for n, p in self.module.named_parameters())
        st.update({f"buffer.{n}": b for n, b in self.module.named_buffers()})
        names = {p: n for n, p in self.module.named_parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k, v in sorted(self.optimizer.state[p].items()):
                    if torch.is_tensor(v):
                        st[f"optim.{names.get(p, id(p))}.{k}"] = v
        return st

    def _sync(self) -> bool:
        """Syncs the state; returns whether this rank's state was replaced. Tensors with
        the address and torch version counter they had after the last sync are promised
        unchanged (not hashed again); the sync's own writes bump no counter, and what
        they wrote is what eccl remembers."""
        sources = self._sources()
        now = {n: (t.data_ptr(), t._version) for n, t in sources.items()}
        unchanged = {n for n, v in now.items() if self._synced.get(n) == v}
        info = self.comm.sync_shared_state(self._held, {n: t.data for n, t in sources.items()},
                                           unchanged=unchanged)
        self._synced = now
        replaced = info.revision != self._held or _moved(info)
        self.revision = self._held = info.revision
        return replaced

    def _admit(self) -> bool:
        """The sync after every change of world (a step boundary that admitted peers, a
        recovery, a newcomer's start: every rank of the world calls it at the same point,
        whichever of these brought it there). The ranks first agree on the newest revision
        and the oldest (one small all_reduce); if a rank is behind and
        `heal_in_background`, the sync runs in the background until the next step's end
        (`_Healing`), otherwise here. Returns whether this rank's state was replaced here."""
        # The newest revision a rank holds, the oldest, and the newest the job reached
        # (a newcomer healing in the background knows it before it holds it).
        revs = torch.tensor([self._held, -self._held, self.revision], dtype=torch.int64)
        self.comm.all_reduce(revs, "max")
        newest, oldest, reached = int(revs[0]), -int(revs[1]), int(revs[2])
        if reached > newest:
            if newest == 0:
                # Every rank that held a state left before passing it on: the ranks here
                # are newcomers with at most a half-received copy. Every rank of the
                # world sees the same figures and stops.
                raise eccl.StateLostError(reached, newest, "the model and optimizer state")
            # The holders of the newest revision left before passing it on; the ranks
            # here hold an older one whole (members receive into staging): the job
            # goes on from it, as from a checkpoint, and says so.
            log.warning("eccl: the holders of revision %d left before passing it on: "
                        "the job goes on from revision %d", reached, newest)
        # Known from now on, also if the sync below fails part-way.
        self.revision = newest
        if not self.heal_in_background or oldest == newest:
            # Nobody is behind (a first world, a recovery among members): what the sync
            # settles, it settles before anyone computes.
            return self._sync()
        sources = self._sources()
        behind = self._held < newest
        # A member serves its buffers from a copy: forward passes update some of them
        # (batch norm's running statistics) while the newcomer fetches.
        tensors = {n: (t.data.clone() if n.startswith("buffer.") and not behind else t.data)
                   for n, t in sources.items()}
        now = {n: (t.data_ptr(), t._version) for n, t in sources.items()}
        unchanged = {n for n, v in now.items()
                     if self._synced.get(n) == v and tensors[n].data_ptr() == v[0]}
        work = self.comm.sync_shared_state(self._held, tensors, unchanged=unchanged,
                                           async_op=True)
        # Names served from a copy are hashed afresh next time: no promise covers them.
        served = {n: v for n, v in now.items() if tensors[n].data_ptr() == v[0]}
        self._healing = _Healing(work, served, behind, tensors)
        self.revision = newest
        return False

    def _end_healing(self) -> torch.Tensor:
        """Waits for the background sync of this step; returns this rank's part of the
        step's tally (gradients contributed, state replaced unexpectedly), or raises the
        sync's error."""
        h, self._healing = self._healing, None
        info = h.work.wait()
        self._synced = h.served
        self._held = info.revision
        # A member whose parameters or optimizer state the sync replaced (it held the
        # newest revision with other content) had them rewritten under its own forward
        # pass: its gradients are garbage; the tally makes every rank drop the step (and
        # this one compute again). Buffers were served from a copy: what the sync put
        # there goes into the module.
        poisoned = not h.behind and _moved(info)
        for n, t in self._sources().items():
            if n.startswith("buffer.") and n in info.updated \
                    and h.tensors[n].data_ptr() != t.data_ptr():
                t.data.copy_(h.tensors[n])
        tally = torch.tensor([0 if self._no_grads else 1, int(poisoned), 0], dtype=torch.int64)
        if poisoned:
            self._no_grads = True
        return tally

    def _settle(self) -> None:
        """Waits for a background sync before anything else syncs or admits (a second
        step boundary before the healing step): the newcomer then computes its next step
        as any member does."""
        if self._healing is not None:
            self._end_healing()

    def step_boundary(self) -> bool:
        """Admits pending peers (every member calls this at the same step); returns
        whether the world changed."""
        if self._joined_now:
            self._joined_now = False
            return False
        try:
            self._settle()
        except eccl.EcclError as e:
            if not retryable(e):
                give_up(self.comm, e)
            # The background sync of a newcomer admitted at the last boundary failed. A
            # fault in its world failed it on every rank; a failure of this rank's part
            # alone did not, and the others would go on to their next call and wait for
            # this rank in it: the epoch is aborted, so that they meet the failure
            # there at once and move to the next world with this one.
            self.comm.abort(f"the background state sync failed on this rank: {e}")
            next_world(self.comm, self._admit, self.max_retries)
            return True
        if not self.comm.are_peers_pending():
            return False

        def admit() -> bool:
            self.comm.update_topology()
            return self._admit()
        # A fault during the admission's sync (the newcomer, or a member, died): the next
        # world, and the sync again over it.
        sync_or_next_world(self.comm, admit, self.max_retries, self._admit)
        return True

    def recover(self) -> bool:
        """After a failed step: the next world, and the state synced over it. Returns
        whether this rank's state was replaced (its gradients are then stale)."""
        with contextlib.suppress(eccl.EcclError):
            self._settle()      # a failed background sync: the next world replaces it
        return next_world(self.comm, self._admit, self.max_retries)

    # -- gradients ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate locally; the next
        `train_step` reduces them with its own."""
        self._reducing = False
        try:
            yield
        finally:
            self._reducing = True

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not (self._in_step and self._reducing):
            # A backward outside train_step (or inside no_sync) only accumulates: the
            # collectives must be the same calls on every rank.
            self._accumulated = True
            return
        self._bucket_of[p].waiting -= 1
        self._start_in_order(only_ready=True)

    def _start_in_order(self, only_ready: bool) -> None:
        """Starts buckets in layout order on every rank (with `only_ready`, up to the
        first whose gradients are not all in): the collectives then line up across
        ranks whatever order autograd finished them in."""
        while self._next < len(self._buckets) and \
                not (only_ready and self._buckets[self._next].waiting > 0):
            self._start(self._buckets[self._next])
            self._next += 1

    def _start(self, b: _Bucket) -> None:
        if self._failed is not None:
            return
        b.fill()
        try:
            b.work = self.comm.all_reduce(b.flat, "sum", async_op=True, quantize=b.quantize)
        except eccl.EcclError as e:
            self._failed = e

    def _reset(self) -> None:
        self._next = 0
        self._failed = None
        for b in self._buckets:
            b.waiting = len(b.params)
            b.work = None

    def _finish(self) -> None:
        """Starts the buckets backward left (unused parameters), waits for all and, if
        every one succeeded, writes the averages into the gradients."""
        self._start_in_order(only_ready=False)
        members = None
        for b in self._buckets:
            if b.work is None:
                continue
            try:
                info = b.work.wait()
                members = info.members
            except eccl.EcclError as e:
                if self._failed is None:
                    self._failed = e
            b.work = None
        contributors = len(members) if members is not None else 0
        if self._healing is not None:
            try:
                tally = self._end_healing()
            except eccl.EcclError as e:
                tally = torch.zeros(3, dtype=torch.int64)
                if self._failed is None:
                    self._failed = e
            # Every rank takes part in the tally, also one whose reduction or part of
            # the sync failed, with its failure counted: the others may have finished
            # theirs and wait in it, and every rank must drop the step (a rank that
            # skipped the tally went on to its next collective, which met the others').
            tally[_TALLY_FAILED] = int(self._failed is not None)
            try:
                self.comm.all_reduce(tally, "sum")
                if self._failed is None:
                    contributors = int(tally[_TALLY_CONTRIBUTED])
                    if int(tally[_TALLY_POISONED]):
                        self._failed = eccl.AbortedError(
                            "a member's state was replaced while it served a newcomer: "
                            "the step is taken again")
                    elif int(tally[_TALLY_FAILED]):
                        self._failed = eccl.AbortedError(
                            f"{int(tally[_TALLY_FAILED])} rank(s) failed this step's "
                            "reduction or the newcomer's state sync: the step is taken again")
            except eccl.EcclError as e:
                if self._failed is None:
                    self._failed = e
        if self._failed is None and members is not None:
            self.members = members
            for b in self._buckets:
                b.write_back(contributors)

    def train_step(self, compute_loss) -> float:
        """Runs forward and backward (gradients reduced as they become ready, averaged
        over the members) and the optimizer step; if a member fails meanwhile, moves to
        the next world and reduces again over it."""
        self._no_grads = self._healing is not None and self._healing.behind
        if self._no_grads:
            # This rank's state is still arriving: it computes nothing this step and
            # contributes zeros (a member's gradients are averaged without it).
            self.optimizer.zero_grad(set_to_none=True)
            self._accumulated = False
            self._reset()
            loss = torch.tensor(float("nan"))
        else:
            if not self._accumulated:
                self.optimizer.zero_grad(set_to_none=True)
            self._reset()
            loss = self._forward_backward(compute_loss)
        for _ in range(self.max_retries):
            self._finish()
            if self._failed is not None and not retryable(self._failed):
                # Bad arguments, ranks that disagree, an eviction: the next world would
                # not cure it. Raised at once, with no optimizer step taken (the others
                # counted it in the tally, if there was one, and take the step again
                # without this rank).
                failed, self._failed = self._failed, None
                give_up(self.comm, failed)
            if self._failed is None:
                self.optimizer.step()
                self.revision += 1
                self._held = self.revision
                self._no_grads = False
                # Cleared now, not at the next step: backward passes under no_sync()
                # before it accumulate into nothing but their own gradients.
                self.optimizer.zero_grad(set_to_none=True)
                self._accumulated = False
                return float(loss.item())
            failed = self._failed
            stale = self.recover()
            self._reset()
            if self._healing is not None and self._healing.behind:
                # Behind the others (it had been evicted): its state now arrives in the
                # background and it adds nothing to this step.
                self._no_grads = True
                self.optimizer.zero_grad(set_to_none=True)
                loss = torch.tensor(float("nan"))
            elif stale or self._no_grads:
                # This rank's gradients belong to an old model or were never computed
                # (it was healing): compute them on the state it now holds.
                self._no_grads = False
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._forward_backward(compute_loss)
        raise eccl.AbortedError(f"step failed {self.max_retries} times: {failed}") from failed

    def _forward_backward(self, compute_loss) -> torch.Tensor:
        self._in_step = True
        try:
            loss = compute_loss(self.module)
            loss.backward()
        finally:
            self._in_step = False
        return loss

    def close(self) -> None:
        """Waits for a background sync still running, and removes the gradient hooks
        from the module."""
        with contextlib.suppress(eccl.EcclError):
            self._settle()
        for h in self._hooks:
            h.remove()
        self._hooks = []
