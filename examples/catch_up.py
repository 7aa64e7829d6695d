#!/usr/bin/env python3
"""A newcomer's catch-up: N members hold a shared state of --state-mb MiB (4 tensors) on
an embedded master; a newcomer process joins, fetches the state from them, and does its
first all_reduce; then it leaves and the next one joins (--rounds times). Prints, per
round, the newcomer's time from `Communicator(...)` to its first synced all_reduce and
its parts (admission, the sync call's hashing, plan and transfer as `SyncInfo` gives
them, the all_reduce), the transfer's rate, and the members' sync call:

    python examples/catch_up.py --members 3 --state-mb 256 --rounds 5

The newcomer's process start and imports are not counted (about 0.3 s of Python here).
"""

import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's threads would spin beside eccl's
import multiprocessing as mp
import statistics
import time

import eccl
import numpy as np


def state_of(mb, fill):
    per = mb * (1 << 20) // 4
    return {f"t{i}": np.full(per // 4, fill + i, dtype=np.float32) for i in range(4)}


def member(addr, secret, n, mb, rounds, joined, left, out):
    comm = eccl.Communicator(addr, secret, min_world=n)
    comm.update_topology()
    state = state_of(mb, 1.0)
    comm.sync_shared_state(1, state)          # everyone starts equal
    out.put(("ready",))
    rows = []
    for _ in range(rounds):
        while not comm.are_peers_pending():
            time.sleep(0.002)
        comm.update_topology()
        t0 = time.perf_counter()
        info = comm.sync_shared_state(1, state, unchanged=set(state))
        rows.append(((time.perf_counter() - t0) * 1e3, info.bytes_sent))
        comm.all_reduce(np.ones(1024, dtype=np.float32))
        joined.wait()
        left.wait()
        comm.update_topology()
    out.put(("member", comm.rank, rows))
    comm.leave()


def newcomer(addr, secret, mb, joined, out):
    state = state_of(mb, 0.0)
    t0 = time.perf_counter()
    comm = eccl.Communicator(addr, secret)
    comm.update_topology()
    t1 = time.perf_counter()
    info = comm.sync_shared_state(0, state, strategy="receive_only")
    t2 = time.perf_counter()
    comm.all_reduce(np.ones(1024, dtype=np.float32))
    t3 = time.perf_counter()
    assert all(float(state[f"t{i}"][0]) == 1.0 + i for i in range(4)), "state not fetched"
    out.put(("newcomer", (t3 - t0) * 1e3, (t1 - t0) * 1e3, info.hash_ms, info.plan_ms,
             info.transfer_ms, (t3 - t2) * 1e3, info.bytes_received))
    joined.set()
    comm.leave()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--state-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    master = eccl.Master()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    joined, left = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=member, args=(master.addr, master.secret, a.members,
                                              a.state_mb, a.rounds, joined, left, out))
             for _ in range(a.members)]
    for p in procs:
        p.start()
    rows, members = [], []
    try:
        for _ in procs:
            assert out.get(timeout=300) == ("ready",)
        for _ in range(a.rounds):
            joined.clear()
            left.clear()
            p = ctx.Process(target=newcomer, args=(master.addr, master.secret, a.state_mb,
                                                   joined, out))
            p.start()
            got = out.get(timeout=300)
            assert got[0] == "newcomer", got
            rows.append(got[1:])
            p.join(timeout=60)
            left.set()
            time.sleep(0.2)
        members = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        master.shutdown()
    print(f"# catch-up of {a.state_mb} MiB from {a.members} members, {a.rounds} rounds (ms)")
    print(f"{'round':>5s} {'total':>8s} {'admit':>8s} {'hash':>8s} {'plan':>8s} "
          f"{'transfer':>9s} {'GB/s':>6s} {'1st a_r':>8s} {'members':>8s}")
    for i, (total, admit, h, plan, xfer, ar, got) in enumerate(rows):
        slowest = max(m[2][i][0] for m in members)
        print(f"{i:5d} {total:8.1f} {admit:8.1f} {h:8.1f} {plan:8.1f} {xfer:9.1f} "
              f"{got / xfer / 1e6 if xfer else 0:6.2f} {ar:8.1f} {slowest:8.1f}")
    med = statistics.median(r[0] for r in rows)
    rate = statistics.median(r[6] / r[4] / 1e6 for r in rows if r[4])
    print(f"# median: {med:.1f} ms to the first synced all_reduce, transfer {rate:.2f} GB/s")


if __name__ == "__main__":
    main()
