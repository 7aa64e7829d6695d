"""Elastic torchrun on eccl's rendezvous against torch's c10d, side by side.

Three torchrun agents (`--nnodes=2:3 --nproc-per-node=1 --max-restarts=3`), each its own
process session like a node, train examples/elastic_train.py (plain DDP, backend "eccl"
by default). Once they train at world 3, the node that was started first is SIGKILLed
as a whole (agent and worker): with c10d that node hosts the rendezvous store; with eccl
nothing is hosted by a node. Then a replacement node is started. For each rendezvous
backend it prints what happened: the time from the kill to the first step at world 2,
the time from the replacement's start to the first step at world 3, and whether the job
finished (every survivor holding the same parameters) or ended.

    python examples/elastic_torchrun.py                       # eccl and c10d, one master
    python examples/elastic_torchrun.py --masters 3 --kill-leader both --backends eccl
    python examples/elastic_torchrun.py --json out.json

With `--masters 3`, `--kill-leader train` SIGKILLs the raft leader while the three nodes
train, `rdzv` right after the node kill (during the re-rendezvous), `both` does both.
The master binary is target/release/eccl-master (`cargo build --release`).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAIN = os.path.join(HERE, "elastic_train.py")
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
sys.path.insert(0, HERE)
from eccl_masters import Masters, write_secret  # noqa: E402
from procs import free_port, kill_node  # noqa: E402

STEP = re.compile(r"STEP (\d+) world=(\d+) rank=(\d+) t=([0-9.]+)")
DONE = re.compile(r"DONE rank=(\d+) world=(\d+) params=([0-9a-f]+)")


class Agent:
    def __init__(self, name: str, log: str, proc: subprocess.Popen):
        self.name, self.log, self.proc = name, log, proc
        self.started = time.time()
        self.killed = False

    def text(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def steps(self):
        return [(int(s), int(w), float(t)) for s, w, _, t in STEP.findall(self.text())]

    def done(self):
        return DONE.findall(self.text())


def wait_for(cond, limit: float, poll: float = 0.05):
    end = time.time() + limit
    while time.time() < end:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    return None


def scenario(backend: str, a, workdir: str) -> Dict:
    out: Dict = {"rdzv_backend": backend}
    ckpt = os.path.join(workdir, "ckpt.pt")
    secret_file = os.path.join(workdir, "secret")
    write_secret(secret_file)
    masters = None
    env = dict(os.environ, ECCL_SECRET_FILE=secret_file, PYTHONUNBUFFERED="1")
    # Each run starts from torch's defaults and its own masters.
    for k in ("ECCL_MASTER", "ECCL_SECRET", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(k, None)
    if backend == "eccl":
        masters = Masters(a.masters, workdir, secret_file, a.master_bin)
        endpoint = masters.endpoint
        time.sleep(1.0 if a.masters > 1 else 0.3)
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    agents: List[Agent] = []

    def start(name: str) -> Agent:
        log = os.path.join(workdir, f"{name}.log")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3",
               "--nproc-per-node=1", f"--rdzv-backend={backend}",
               f"--rdzv-endpoint={endpoint}", "--rdzv-id=job", "--max-restarts=3",
               "--monitor-interval=0.1", TRAIN, "--steps", str(a.steps), "--ckpt", ckpt,
               "--backend", a.train_backend, "--step-s", str(a.step_s),
               # The survivors train on at world 2 until the replacement is in, however
               # long its start takes against how fast they step.
               "--until-world", "3"]
        p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        ag = Agent(name, log, p)
        agents.append(ag)
        return ag

    try:
        first = start("node0")
        time.sleep(1.0)  # with c10d, the first node hosts the store
        start("node1")
        start("node2")
        at3 = wait_for(lambda: all(any(w == 3 and s >= a.warm_steps for s, w, _ in g.steps())
                                   for g in agents), a.limit)
        if not at3:
            out["outcome"] = "never trained at world 3"
            return out
        if masters is not None and a.kill_leader in ("train", "both"):
            ld = masters.leader()
            t_l = time.time()
            masters.kill(ld)
            base = max(s for g in agents for s, _, _ in g.steps())
            ok = wait_for(lambda: max(s for g in agents for s, _, _ in g.steps()) > base + 5, 60)
            out["leader_killed_in_training"] = {"master": ld + 1, "training_went_on": bool(ok),
                                                "steps_after_s": round(time.time() - t_l, 2)}
            # Back from its data directory (as eccl-chaos's master-kill does), so that
            # the next kill leaves a majority.
            masters.start(ld)
            time.sleep(3.0)
        killed_at = time.time()
        kill_node(first.proc)
        first.killed = True
        if masters is not None and a.kill_leader in ("rdzv", "both"):
            time.sleep(0.2)
            ld = masters.leader()
            if ld is not None:
                masters.kill(ld)
                out["leader_killed_in_rdzv"] = {"master": ld + 1}
        survivors = [g for g in agents if not g.killed]

        def first_at(world: int, after: float):
            ts = [t for g in survivors for _, w, t in g.steps() if w == world and t > after]
            return min(ts) if ts else None

        def ended():
            return all(g.proc.poll() is not None for g in survivors)

        t2 = wait_for(lambda: first_at(2, killed_at) or (ended() and -1), a.limit)
        if t2 is None or t2 == -1:
            codes = [g.proc.poll() for g in survivors]
            errs = [re.findall(r"(\w+Error: [^\n]{0,160})", g.text())[-1:] for g in survivors]
            out["outcome"] = "job ended" if ended() else "stuck"
            out["survivor_exit_codes"] = codes
            out["survivor_errors"] = [e[0] if e else "" for e in errs]
            out["kill_to_end_s"] = round(time.time() - killed_at, 2)
            return out
        out["kill_to_world2_step_s"] = round(t2 - killed_at, 2)
        newcomer = start("node3")
        survivors.append(newcomer)
        t3 = wait_for(lambda: first_at(3, newcomer.started), a.limit)
        out["replacement_to_world3_step_s"] = (round(t3 - newcomer.started, 2)
                                               if t3 else None)
        fin = wait_for(lambda: ended(), a.limit + a.steps * (a.step_s + 0.2))
        dones = [d for g in survivors for d in g.done()]
        hashes = {h for _, _, h in dones}
        codes = [g.proc.poll() for g in survivors]
        out["outcome"] = ("finished" if fin and all(c == 0 for c in codes) and len(hashes) == 1
                          else f"exit codes {codes}, {len(hashes)} parameter hashes")
        out["final_world"] = max((int(w) for _, w, _ in dones), default=None)
        return out
    finally:
        for g in agents:
            if g.proc.poll() is None:
                kill_node(g.proc)
            else:
                g.proc.wait()
        if masters is not None:
            masters.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="eccl,c10d")
    ap.add_argument("--masters", type=int, choices=(1, 3), default=1)
    ap.add_argument("--kill-leader", choices=("none", "train", "rdzv", "both"), default="none")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warm-steps", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--train-backend", default="eccl")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds any phase may take")
    ap.add_argument("--master-bin", default=os.path.join(ROOT, "target", "release", "eccl-master"))
    ap.add_argument("--json")
    ap.add_argument("--keep", action="store_true", help="keep the logs' directory")
    a = ap.parse_args()
    if a.kill_leader != "none" and a.masters == 1:
        ap.error("--kill-leader needs --masters 3")
    # --masters and --kill-leader apply to the eccl run; c10d has no masters.
    results = []
    for b in a.backends.split(","):
        d = tempfile.mkdtemp(prefix=f"eccl-elastic-{b}-")
        t0 = time.time()
        r = scenario(b, a, d)
        r["wall_s"] = round(time.time() - t0, 1)
        r["logs"] = d
        results.append(r)
        print(json.dumps(r), flush=True)
        if not a.keep and r.get("outcome") in ("finished", "job ended"):
            shutil.rmtree(d, ignore_errors=True)
    print()
    print(f"{'rdzv':<6} {'outcome':<12} {'kill -> world-2 step':>21} {'new node -> world-3 step':>25}")
    for r in results:
        k = r.get("kill_to_world2_step_s")
        n = r.get("replacement_to_world3_step_s")
        print(f"{r['rdzv_backend']:<6} {r['outcome'][:12]:<12} "
              f"{(f'{k:.2f} s' if k is not None else '-'):>21} "
              f"{(f'{n:.2f} s' if n is not None else '-'):>25}")
        if r.get("survivor_errors"):
            print(f"       survivors: {r['survivor_errors']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if results and results[0].get("outcome") == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
