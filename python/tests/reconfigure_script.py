"""One process of test_reconfigure's reconfigure tests (torch's `_reconfigure`).

    reconfigure_script.py BACKEND SCENARIO          one of n ranks (env:// as torchrun)
    reconfigure_script.py BACKEND SCENARIO fresh    a process started later (grows the world)

Every rank inits with enable_reconfigure=True and forms the world of all n with
`_reconfigure(uuid=1, handles)` (handles go through the rendezvous store). Then the last
rank is lost while the others run an all_reduce:
  kill      it SIGKILLs itself; the survivors reconfigure (uuid 2) over their own handles,
            all_reduce, try uuid 2 again, and grow back to n with a fresh process (uuid 3)
  stop      it SIGSTOPs itself (a hung rank); the survivors reconfigure as for kill
  inflight  as stop, but the survivors reconfigure while their all_reduce is in flight
  shrink    as kill, with dist.shrink_group([n-1]) instead of a reconfigure
  shrink_stop  as stop, with dist.shrink_group([n-1]) instead of a reconfigure
Each survivor prints its results as JSON after "RESULT ".
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from procs import wait_dead, wait_stopped

# The group's timeout: gloo's survivors of a hung rank wait this long (the test passes a
# shorter one for the hung-rank scenario, whose gloo half waits it out).
TIMEOUT = timedelta(seconds=float(os.environ.get("RECONFIGURE_TEST_TIMEOUT_S", "10")))


def exchange(store, key, ranks, mine):
    """Every process in `ranks` publishes its handle under `key`; returns them in order."""
    store.set(f"{key}/{dist.get_rank()}", mine)
    return [store.get(f"{key}/{r}").decode() for r in ranks]


def reconfigure(store, uuid, ranks):
    handles = exchange(store, f"handles/{uuid}", ranks, dist._get_reconfigure_handle())
    t0 = time.monotonic()
    dist._reconfigure(uuid=uuid, handles=handles).wait()
    return (time.monotonic() - t0) * 1000


def all_reduce_ranks():
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t.tolist()


def test_store():
    """A client of the rendezvous store (in rank 0) for this test's own keys."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=60))


def foreign_handle_refused():
    """A handle of another job (another master, another secret) in the list is refused
    with an error that says so; the group is unchanged."""
    import eccl
    from eccl.torch_fault import handle_of

    other = eccl.Master("127.0.0.1:0", None)
    comm = eccl.Communicator(other.addr, other.secret)
    try:
        dist._reconfigure(uuid=50, handles=[dist._get_reconfigure_handle(), handle_of(comm)])
        return "accepted"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: another job" if "another job" in str(e) else repr(e)
    finally:
        comm.leave()
        other.shutdown()


def fresh(backend):
    """A newly started process (env:// as the lost rank's replacement): waits until the
    survivors ask for it, then joins."""
    n = int(os.environ["WORLD_SIZE"])
    store = test_store()
    store.wait(["grow"])
    dist.init_process_group(backend, enable_reconfigure=True, timeout=TIMEOUT)
    store.set(f"handles/3/{n - 1}", dist._get_reconfigure_handle())
    handles = [store.get(f"handles/3/{r}").decode() for r in range(n)]
    dist._reconfigure(uuid=3, handles=handles).wait()
    out = {"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": all_reduce_ranks()}
    print("RESULT " + json.dumps(out), flush=True)
    store.set("done/fresh", "1")
    os._exit(0)


def main():
    backend, scenario = sys.argv[1], sys.argv[2]
    if sys.argv[3:] == ["fresh"]:
        return fresh(backend)
    dist.init_process_group(backend, enable_reconfigure=True, timeout=TIMEOUT)
    store = test_store()
    r, n = dist.get_rank(), dist.get_world_size()
    out = {"supports": dist._supports_reconfigure()}
    try:
        dist.all_reduce(torch.ones(1))
        out["before_first"] = "ran"
    except Exception as e:  # noqa: BLE001 - no world before the first reconfigure
        out["before_first"] = type(e).__name__
    hooks = []
    if backend == "eccl":
        dist.group.WORLD.register_abort_hook(7, lambda: hooks.append(1))
    reconfigure(store, 1, range(n))
    out["first"] = all_reduce_ranks()

    last = n - 1
    stops = scenario in ("stop", "inflight", "shrink_stop")
    if r == last:
        store.set("losing", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP if stops else signal.SIGKILL)
        time.sleep(600)
    store.wait(["losing"])
    lost_pid = int(store.get("losing"))
    (wait_stopped if stops else wait_dead)(lost_pid)
    survivors = list(range(last))
    t = torch.ones(2)
    t0 = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    if scenario == "inflight":
        ms = reconfigure(store, 2, survivors)
        out["reconfigure_ms"] = ms
    try:
        work.wait()
        out["lost"] = "none"
    except Exception as e:  # noqa: BLE001 - the error each backend gives
        out["lost"] = type(e).__name__
        out["error_s"] = round(time.monotonic() - t0, 1)
    shrink = scenario.startswith("shrink")
    if shrink:
        dist.shrink_group([last])
    elif scenario != "inflight":
        out["reconfigure_ms"] = reconfigure(store, 2, survivors)
    out["rank"], out["size"] = dist.get_rank(), dist.get_world_size()
    out["sum"] = all_reduce_ranks()
    if backend == "eccl" and not shrink:
        try:
            handles = exchange(store, "handles/again", survivors, dist._get_reconfigure_handle())
            dist._reconfigure(uuid=2, handles=handles).wait()
            out["reused_uuid"] = "accepted"
        except Exception as e:  # noqa: BLE001
            out["reused_uuid"] = type(e).__name__
        out["after_refusal"] = all_reduce_ranks()
        out["foreign"] = foreign_handle_refused()
    if scenario == "kill":
        # A fresh process takes the lost rank's place.
        if r == 0:
            store.set("grow", "1")
        store.set(f"handles/3/{r}", dist._get_reconfigure_handle())
        handles = [store.get(f"handles/3/{q}").decode() for q in range(n)]
        # Not waited for before the next calls: gloo's reconfigure is done when it
        # returns; eccl's next call (and rank/size) waits for it.
        grow = dist._reconfigure(uuid=3, handles=handles)
        out["grown"] = {"rank": dist.get_rank(), "size": dist.get_world_size(),
                        "sum": all_reduce_ranks()}
        grow.wait()
    if backend == "eccl":
        out["hooks"] = len(hooks)
    print("RESULT " + json.dumps(out), flush=True)
    # The store lives in rank 0: it waits for the others' results to be printed.
    store.set(f"done/{r}", "1")
    if r == 0:
        grown = ["done/fresh"] if scenario == "kill" else []
        store.wait([f"done/{q}" for q in survivors] + grown, timedelta(seconds=30))
        time.sleep(0.5)
    os._exit(0)


if __name__ == "__main__":
    main()
