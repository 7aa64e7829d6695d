#!/usr/bin/env python3
"""What a shared-state sync costs the members when nothing changed, with and without the
"unchanged" promise (tensors not hashed again), and where the time goes (SyncInfo's
hash_ms, plan_ms, transfer_ms). N members on an embedded master, one process each, a
state of --state-mb MiB in 4 tensors:

    python examples/sync_cost.py --members 3 --state-mb 256 --rounds 5

Prints, per mode, the median over rounds of the slowest member's call and its parts.
"""

import argparse
import multiprocessing as mp
import statistics
import time

import eccl
import numpy as np


def member(addr, secret, n, mb, rounds, out):
    comm = eccl.Communicator(addr, secret, min_world=n)
    comm.update_topology()
    per = mb * (1 << 20) // 4
    state = {f"t{i}": np.full(per // 4, float(i), dtype=np.float32) for i in range(4)}
    comm.sync_shared_state(1, state)          # everyone starts equal
    res = {}
    for mode in ("hash", "unchanged"):
        rows = []
        for _ in range(rounds):
            promise = set(state) if mode == "unchanged" else None
            t0 = time.perf_counter()
            info = comm.sync_shared_state(1, state, unchanged=promise)
            rows.append(((time.perf_counter() - t0) * 1e3, info.hash_ms, info.plan_ms,
                         info.transfer_ms, info.hashed_bytes))
        res[mode] = rows
    out.put((comm.rank, res))
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
    procs = [ctx.Process(target=member, args=(master.addr, master.secret, a.members,
                                              a.state_mb, a.rounds, out))
             for _ in range(a.members)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        master.shutdown()
    print(f"# shared-state sync, {a.members} members, {a.state_mb} MiB unchanged, "
          f"{a.rounds} rounds: median of the slowest member's call (ms)")
    print(f"{'mode':10s} {'call':>9s} {'hash':>9s} {'plan':>9s} {'transfer':>9s} {'hashed B':>12s}")
    for mode in ("hash", "unchanged"):
        slowest = [max((got[r][mode][i] for r in got), key=lambda row: row[0])
                   for i in range(a.rounds)]
        med = [statistics.median(col) for col in zip(*slowest)]
        print(f"{mode:10s} {med[0]:9.2f} {med[1]:9.2f} {med[2]:9.2f} {med[3]:9.2f} "
              f"{int(med[4]):12d}")


if __name__ == "__main__":
    main()
