"""One rank of test_reconfigure's contract test: torch's reconfigure scenarios for
backends (the ones PyTorch's own fault-tolerance test runs for gloo), each in a process
group of its own over a FileStore, one after another in the same processes:

    contract_script.py BACKEND DIR [SCENARIO ...]     (RANK and WORLD_SIZE from env)

basic, all_reduce, send_recv, shrink_last, shrink_middle, scale_down_up, single_to_all,
identity, late_join, merge_split, after_abort, reused_uuid. Prints, after "RESULT ", for
each scenario "ok" or the error it met, and the milliseconds it took (init included).
"""

import faulthandler
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import eccl
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

R, N = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# CONTRACT_RANK0_FAULT: an ECCL_FAULT_INJECT spec for rank 0 alone (a slow member).
if R == 0 and os.environ.get("CONTRACT_RANK0_FAULT"):
    os.environ["ECCL_FAULT_INJECT"] = os.environ["CONTRACT_RANK0_FAULT"]
# CONTRACT_TIMEOUT_S: the stores' and groups' timeout (the test shortens gloo's, which
# is there for its times only: when it fails a merge, the others wait this long).
TIMEOUT = timedelta(seconds=float(os.environ.get("CONTRACT_TIMEOUT_S", "30")))


class Scenario:
    def __init__(self, backend, store_path):
        self.backend = backend
        self.store = dist.FileStore(store_path, N)
        self.store.set_timeout(TIMEOUT)

    def init(self):
        dist.init_process_group(self.backend, world_size=N, rank=R, store=self.store,
                                timeout=TIMEOUT, enable_reconfigure=True)
        be = dist.get_backend_impl(c10d._get_default_group(), torch.device("cpu"))
        assert dist._supports_reconfigure() and be.supports_reconfigure
        return be

    def handles(self, key):
        """Every rank's reconfigure handle, in rank order."""
        self.store.set(f"{key}_{R}", dist._get_reconfigure_handle())
        return [self.store.get(f"{key}_{r}").decode() for r in range(N)]

    def barrier(self, key):
        self.store.set(f"{key}_{R}", "1")
        for r in range(N):
            self.store.get(f"{key}_{r}")

    @staticmethod
    def reconfigure(uuid, handles):
        dist._reconfigure(uuid, handles, timeout=TIMEOUT).wait()

    @staticmethod
    def world(size, rank):
        got = (dist.get_world_size(), dist.get_rank())
        assert got == (size, rank), f"world size and rank {got}, not {(size, rank)}"

    def formed(self, name, uuid):
        """Init, then a reconfigure of all N: the handles of the world it formed."""
        be = self.init()
        self.reconfigure(uuid, self.handles(f"{name}_init"))
        self.world(N, R)
        return be, self.handles(f"{name}_post")

    @staticmethod
    def sums_to(expected):
        t = torch.full((4,), dist.get_rank() + 1.0)
        dist.all_reduce(t)
        assert t.tolist() == [float(expected)] * 4, t.tolist()


def basic(s):
    s.formed("basic", 100)


def all_reduce(s):
    s.formed("all_reduce", 200)
    s.sums_to(sum(range(1, N + 1)))


def send_recv(s):
    be, _ = s.formed("send_recv", 300)
    rank = dist.get_rank()
    to, frm = (rank + 1) % N, (rank - 1) % N
    out, into = torch.full((4,), rank + 1.0), torch.zeros(4)
    if rank % 2 == 0:
        works = [be.send([out], to, 0), be.recv([into], frm, 0)]
    else:
        works = [be.recv([into], frm, 0), be.send([out], to, 0)]
    for w in works:
        w.wait()
    assert into.tolist() == [frm + 1.0] * 4, into.tolist()


def shrink_last(s):
    _, hs = s.formed("shrink_last", 400)
    if R != N - 1:
        s.reconfigure(401, hs[:N - 1])
        s.world(N - 1, R)
        s.sums_to(sum(range(1, N)))
        t = torch.full((4,), 42.0) if dist.get_rank() == 0 else torch.zeros(4)
        dist.broadcast(t, group_src=0)
        assert t.tolist() == [42.0] * 4, t.tolist()
    s.barrier("shrink_last_done")


def shrink_middle(s):
    _, hs = s.formed("shrink_middle", 500)
    out = N // 2
    if R != out:
        s.reconfigure(501, [h for r, h in enumerate(hs) if r != out])
        s.world(N - 1, R if R < out else R - 1)
        s.sums_to(sum(range(1, N)))
    s.barrier("shrink_middle_done")


def scale_down_up(s):
    s.init()
    # Disjoint singletons at once, each with a uuid of its own.
    s.reconfigure(600 + R, [dist._get_reconfigure_handle()])
    s.world(1, 0)
    s.reconfigure(600 + N, s.handles("scale_up"))
    s.world(N, R)
    s.reconfigure(601 + N + R, [dist._get_reconfigure_handle()])
    s.world(1, 0)
    s.barrier("scale_down_up_done")


def single_to_all(s):
    s.init()
    s.reconfigure(700 + R, [dist._get_reconfigure_handle()])
    s.reconfigure(700 + N, s.handles("single_to_all"))
    s.sums_to(sum(range(1, N + 1)))


def identity(s):
    s.formed("identity", 800)
    s.reconfigure(801, s.handles("identity_again"))
    s.sums_to(sum(range(1, N + 1)))


def late_join(s):
    s.init()
    hs = s.handles("late_join_first")
    first = N // 2
    if R < first:
        s.reconfigure(900, hs[:first])
    s.reconfigure(901, s.handles("late_join_all"))
    s.sums_to(sum(range(1, N + 1)))


def merge_split(s):
    s.init()
    hs = s.handles("merge_split_first")
    half = N // 2
    if R < half:
        s.reconfigure(1000, hs[:half])
    else:
        s.reconfigure(1001, hs[half:])
    s.reconfigure(1002, s.handles("merge_split_all"))
    s.sums_to(sum(range(1, N + 1)))


def after_abort(s):
    from torch._C._distributed_c10d import ErrorType
    be, _ = s.formed("after_abort", 1200)
    be.abort()
    # What torch's test asks of every backend but NCCL's (whose abort is a revoke).
    assert be.get_error() == ErrorType.SUCCESS, be.get_error()
    s.reconfigure(1201, s.handles("after_abort_recover"))
    s.sums_to(sum(range(1, N + 1)))


def reused_uuid(s):
    s.init()
    s.reconfigure(1100 + R, [dist._get_reconfigure_handle()])
    try:
        s.reconfigure(1100 + R, [dist._get_reconfigure_handle()])
    except RuntimeError as e:
        assert "already used" in str(e), str(e)
    else:
        raise AssertionError("a reused uuid was accepted")


def revoke_and_get_error(s):
    """eccl's own (not in torch's contract): get_error() after a remote and a local
    revoke and abort, a revoked group refusing calls until a reconfigure."""
    be, _ = s.formed("revoke", 1200)

    def error():
        return be.get_error().name

    assert error() == "SUCCESS", error()
    # Ranks 0 and 2 start an all_reduce that rank 1 never joins; it revokes instead.
    if R != 1:
        t = torch.ones(4)
        w = dist.all_reduce(t, async_op=True)
        s.store.set(f"revoke_started_{R}", "1")
        t0 = time.monotonic()
        try:
            w.wait()
            raise AssertionError("an all_reduce went through a revoke")
        except eccl.RevokedError as e:
            assert "rank 1 revoked" in str(e), str(e)
        waited = time.monotonic() - t0
        assert waited < TIMEOUT.total_seconds() / 3, f"the revoke took {waited:.1f} s to arrive"
        assert error() == "REMOTE_ERROR", error()
    else:
        s.store.get("revoke_started_0")
        s.store.get("revoke_started_2")
        be.revoke()
        assert error() == "COMM_ERROR", error()
    s.barrier("revoke_seen")
    # Refused until a reconfigure, on every rank; nothing forms a world on its own.
    for _ in range(2):
        try:
            dist.all_reduce(torch.ones(4))
            raise AssertionError("a revoked group took a call")
        except eccl.RevokedError as e:
            assert "reconfigure" in str(e), str(e)
    s.reconfigure(1201, s.handles("revoke_again"))
    assert error() == "SUCCESS", error()
    s.sums_to(sum(range(1, N + 1)))
    # An abort: SUCCESS where it was called (as torch's after_abort asks of every
    # backend but NCCL's), REMOTE_ERROR where it broke a call; the next call forms the
    # next epoch and get_error() is SUCCESS again.
    if R == 0:
        be.abort()
        assert error() == "SUCCESS", error()
    s.barrier("aborted")
    if R != 0:
        try:
            dist.all_reduce(torch.ones(4))
            raise AssertionError("an all_reduce went through an abort")
        except eccl.AbortedError:
            pass
        assert error() == "REMOTE_ERROR", error()
    s.sums_to(sum(range(1, N + 1)))
    assert error() == "SUCCESS", error()


# torch's scenarios, run when none is named; eccl's own only when named.
SCENARIOS = [basic, all_reduce, send_recv, shrink_last, shrink_middle, scale_down_up,
             single_to_all, identity, late_join, merge_split, after_abort, reused_uuid]
NOT_TORCHS = [revoke_and_get_error]


def main():
    backend, folder = sys.argv[1], sys.argv[2]
    wanted = sys.argv[3:] or [f.__name__ for f in SCENARIOS]
    res = {}
    for f in SCENARIOS + NOT_TORCHS:
        if f.__name__ not in wanted:
            continue
        # A scenario that hangs prints where every thread is and ends the process, so
        # the test names it instead of waiting out its own limit.
        faulthandler.dump_traceback_later(60, exit=True)
        t0 = time.monotonic()
        s = Scenario(backend, os.path.join(folder, f.__name__))
        try:
            f(s)
            res[f.__name__] = {"ok": "ok"}
        except Exception as e:  # noqa: BLE001 - reported, and the next scenario runs
            res[f.__name__] = {"ok": f"{type(e).__name__}: {e}"[:300],
                               "trace": traceback.format_exc()[-1500:]}
        res[f.__name__]["ms"] = round((time.monotonic() - t0) * 1000, 1)
        # Every rank ends the scenario before any destroys its group or starts the next:
        # torch's harness gives each scenario processes of its own; here one rank's
        # teardown must not race another's scenario (gloo hung on that once in 16 runs).
        s.barrier("scenario_end")
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
