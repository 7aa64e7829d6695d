#!/usr/bin/env python3
"""What a newcomer's catch-up costs the members of an ElasticDDP job, with the state served
in the background (`heal_in_background=True`: the members compute the next step while the
newcomer fetches, and it contributes zero gradients to that step) and inside the step
boundary (`False`: everyone waits for the transfer). N members train a model of
--params-mb MiB of f32 parameters with Adam (a state of three times that) on an embedded
master; after --join-at steps a newcomer process starts and joins. Prints, per mode and
round, the members' median step (step boundary plus train_step) before the join, the step
whose boundary admitted the newcomer, and the newcomer's time from its start to the end of
its first step:

    python examples/heal_cost.py --members 2 --params-mb 128 --rounds 2

Every rank's parameters are compared at the end (a hash): a run whose ranks differ fails.
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time


def model(params_mb: float, width: int):
    import torch

    layers = max(1, round(params_mb * (1 << 20) / 4 / (width * width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def worker(a) -> None:
    import eccl
    import eccl.torch
    import torch

    torch.set_num_threads(1)
    start = time.monotonic()
    m = model(a.params_mb, a.width)
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    comm = eccl.Communicator(min_world=a.members if not a.newcomer else 1)
    job = eccl.torch.ElasticDDP(m, opt, comm, heal_in_background=a.mode == "background")
    steps, full_since, first_done = [], None, None
    while True:
        t0 = time.monotonic()
        admitted = job.step_boundary()
        t1 = time.monotonic()
        if (comm.world_size or 0) > a.members and full_since is None:
            full_since = job.revision
        if full_since is not None and job.revision >= full_since + 3:
            break
        if time.monotonic() - start > 300:
            raise SystemExit("the newcomer never arrived")
        # Each rank's batch depends on the step and its rank.
        g = torch.Generator().manual_seed(job.revision * 100 + (comm.rank or 0))
        x = torch.randn(a.batch, a.width, generator=g)
        job.train_step(lambda mod: mod(x).square().mean())
        t2 = time.monotonic()
        if first_done is None:
            first_done = t2 - start
        steps.append({"rev": job.revision, "admitted": admitted, "boundary_ms": (t1 - t0) * 1e3,
                      "step_ms": (t2 - t0) * 1e3, "world": comm.world_size})
        if not a.newcomer and job.revision == a.join_at:
            print("JOIN", flush=True)
    job.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters()))
    print("RESULT " + json.dumps({"newcomer": a.newcomer, "steps": steps, "hash": digest.hexdigest(),
                                  "revision": job.revision, "first_step_s": first_done}),
          flush=True)
    comm.leave()


def run(a, mode: str) -> dict:
    import eccl

    master = eccl.Master(lease_ms=3000, heartbeat_ms=300)
    env = dict(os.environ, ECCL_MASTER=master.addr, ECCL_SECRET=master.secret,
               OMP_NUM_THREADS="1")
    base = [sys.executable, __file__, "--worker", "--mode", mode, "--members", str(a.members),
            "--params-mb", str(a.params_mb), "--width", str(a.width), "--batch", str(a.batch),
            "--join-at", str(a.join_at)]
    procs = [subprocess.Popen(base, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(a.members)]
    newcomer = None
    try:
        for line in procs[0].stdout:
            if line.startswith("JOIN"):
                newcomer = subprocess.Popen(base + ["--newcomer"], env=env, stdout=subprocess.PIPE,
                                            text=True)
                break
        outs = [p.communicate(timeout=600)[0] for p in procs[1:]]
        rest0 = procs[0].communicate(timeout=600)[0]
        outs.insert(0, rest0)
        if newcomer is None:
            raise SystemExit("the members never reached --join-at")
        outs.append(newcomer.communicate(timeout=600)[0])
    finally:
        for p in procs + ([newcomer] if newcomer else []):
            if p.poll() is None:
                p.kill()
                p.wait()
        master.shutdown()
    res = []
    for out in outs:
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"a rank printed no result:\n{out[-2000:]}")
        res.append(json.loads(lines[-1][7:]))
    if len({r["hash"] for r in res}) != 1 or len({r["revision"] for r in res}) != 1:
        raise SystemExit(f"ranks differ: {[(r['revision'], r['hash'][:12]) for r in res]}")
    members = [r for r in res if not r["newcomer"]]
    before = [s["step_ms"] for r in members for s in r["steps"]
              if not s["admitted"] and s["world"] == a.members and s["rev"] > 2]
    joined = [s["step_ms"] for r in members for s in r["steps"] if s["admitted"]]
    joined_boundary = [s["boundary_ms"] for r in members for s in r["steps"] if s["admitted"]]
    after = [s["step_ms"] for r in members for s in r["steps"] if not s["admitted"]
             and s["world"] > a.members]
    nc = next(r for r in res if r["newcomer"])
    return {"mode": mode, "before_ms": statistics.median(before), "join_ms": max(joined),
            "join_boundary_ms": max(joined_boundary),
            "after_ms": statistics.median(after) if after else None,
            "newcomer_first_step_s": nc["first_step_s"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--members", type=int, default=2)
    p.add_argument("--params-mb", type=float, default=128)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--join-at", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--modes", default="background,boundary")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--newcomer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="background", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    state = 3 * a.params_mb
    print(f"{a.members} members, {a.params_mb:g} MiB of parameters (Adam: {state:g} MiB of "
          f"state), newcomer after step {a.join_at}")
    rows = []
    for r in range(a.rounds):
        for mode in a.modes.split(","):
            row = run(a, mode)
            row["round"] = r
            rows.append(row)
            after = "-" if row["after_ms"] is None else f"{row['after_ms']:.0f}"
            print(f"round {r} {mode:>10}: members' step {row['before_ms']:.0f} ms before, "
                  f"{row['join_ms']:.0f} ms in the step that admitted the newcomer (its boundary "
                  f"{row['join_boundary_ms']:.0f} ms), {after} ms "
                  f"after; newcomer's first step done {row['newcomer_first_step_s']:.2f} s "
                  f"after its start", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
