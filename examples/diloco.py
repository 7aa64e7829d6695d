"""DiLoCo (local SGD with an outer Nesterov step) on eccl: members train alone for
`--sync-every` steps, then average how far they moved in one all_reduce. Kill a member
at any time, or start another: the others go on.

    eccl-master --listen 127.0.0.1:48148 --secret-file ~/.eccl/secret &
    export ECCL_MASTER=127.0.0.1:48148 ECCL_SECRET_FILE=~/.eccl/secret
    python examples/diloco.py --min-world 3 &  python examples/diloco.py --min-world 3 & \
        python examples/diloco.py --min-world 3
    python examples/diloco.py              # a newcomer, any time

Every member that finishes prints the same parameter hash.
"""

import argparse
import hashlib
import os
import signal
import time

import eccl
import eccl.torch
import torch


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes()
                                   for t in model.parameters())).hexdigest()[:16]


class Stalling:
    """The communicator, with a pause before its first `sync_shared_state` (a slow
    newcomer, for tests)."""

    def __init__(self, comm: eccl.Communicator, seconds: float) -> None:
        self._comm, self._seconds = comm, seconds

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def sync_shared_state(self, *args, **kwargs):
        if self._seconds:
            time.sleep(self._seconds)
            self._seconds = 0
        return self._comm.sync_shared_state(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--outer-steps", type=int, default=30)
    p.add_argument("--sync-every", type=int, default=5)
    p.add_argument("--min-world", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=0, help="extra time per inner step")
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--width", type=int, default=64, help="the hidden layer's width")
    p.add_argument("--batch", type=int, default=64, help="samples per inner step")
    p.add_argument("--join-when", metavar="FILE",
                   help="join only once FILE exists (a newcomer started with the others)")
    p.add_argument("--stall-sync-s", type=float, default=0,
                   help="sleep this long before this process's first state sync (for tests: "
                        "the members serve it while they train)")
    p.add_argument("--die-at-outer", type=int, default=0,
                   help="SIGKILL this process as it reaches that outer step (for tests)")
    a = p.parse_args()
    if a.batch < 1:
        p.error("--batch must be at least 1")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, a.width), torch.nn.ReLU(),
                                torch.nn.Linear(a.width, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=a.inner_lr)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    while a.join_when and not os.path.exists(a.join_when):
        time.sleep(0.05)
    comm = eccl.Communicator(min_world=a.min_world)
    if a.stall_sync_s:
        comm = Stalling(comm, a.stall_sync_s)
    job = eccl.torch.DiLoCo(model, inner, outer, comm, sync_every=a.sync_every)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    x_eval = torch.randn(256, 16, generator=torch.Generator().manual_seed(2))

    def evaluate() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(x_eval), x_eval @ target))

    first = evaluate()      # the shared starting model (a newcomer's: after its sync)
    loss = None
    local = 0
    while job.outer_steps < a.outer_steps:
        if a.die_at_outer and job.outer_steps == a.die_at_outer - 1 \
                and job.local_steps % a.sync_every == a.sync_every - 1:
            print(f"peer {comm.peer_id}: dying before outer step {a.die_at_outer}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(os.getpid() * 7919 + local)
        local += 1
        x = torch.randn(a.batch, 16, generator=g)
        before = job.outer_steps
        loss = job.train_step(lambda m: torch.nn.functional.mse_loss(m(x), x @ target))
        if a.step_ms:
            time.sleep(a.step_ms / 1000)
        if job.serving:
            # A newcomer is fetching the state from this member, which trains meanwhile.
            print(f"peer {comm.peer_id} inner step {job.local_steps} while serving", flush=True)
        if job.outer_steps != before:
            print(f"peer {comm.peer_id} outer step {job.outer_steps}: loss {loss:.4f}, "
                  f"{len(job.members)} members, params {digest(model)}", flush=True)
    job.close()
    print(f"FINAL peer {comm.peer_id} outer {job.outer_steps} first_loss {first:.6f} "
          f"loss {evaluate():.6f} params {digest(model)}", flush=True)
    comm.leave()


if __name__ == "__main__":
    main()
