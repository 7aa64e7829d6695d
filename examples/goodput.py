"""Goodput under failures: eccl's ElasticDDP against torchft and plain gloo DDP.

Each system trains the NCCL lecture's 3×Linear(4000) (about 192 MiB of gradients, SGD,
batch 32 per replica) on `--nproc` CPU nodes, each node its own
`torchrun --standalone --nnodes 1 --nproc-per-node 1` (examples/goodput_worker.py), under
one schedule:

  fault-free   `--duration` seconds of training, counted from the job's first step at
               full size;
  faulted      the same, but every `--kill-every` seconds the node that has run longest
               is SIGKILLed as a whole (its torchrun agent and worker, one process group)
               and a replacement node is started right after.

gloo DDP runs the fault-free phase only (it cannot survive a kill). torchft runs with
its lighthouse, `Manager`, DDP and gloo process group set as its own train_ddp.py sets
them; it is installed into its own venv (`--torchft-venv`, made on first use, seeing
this interpreter's torch through a .pth file) unless `--skip-torchft`.

    python examples/goodput.py                         # 120 s phases, about 12 minutes
    python examples/goodput.py --duration 60 --json goodput.json --skip-torchft
    python examples/goodput.py --duration 40 --kill-every 10 --skip-torchft \
        --json goodput.json --plot goodput.svg      # docs/pictures/goodput.svg
    python examples/goodput.py --replot goodput.json --plot goodput.svg

Throughput counts samples: a step taken by m of the n replicas counts m/n of a step
(steps_per_s is in full-size steps). goodput_ratio = faulted / fault-free;
lost_s_per_fault = the fault-free seconds the faulted phase fell behind, per fault;
newcomer_first_step_s = from the replacement's "ready" (torch and the library imported,
model and optimizer built) to its first committed step, state sync included (median over the
replacements; the table shows the worst too); newcomer_synced_s (eccl) = from "ready" to
admitted into a world and holding the model's and optimizer's state, the catch-up part.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "goodput_worker.py")
ROOT = os.path.dirname(HERE)
# Starting and stopping whole nodes by PID is shared with the tests that do the same.
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
from procs import free_port, kill_node  # noqa: E402


class Node:
    def __init__(self, index: int, log: str, proc: subprocess.Popen, newcomer: bool):
        self.index, self.log, self.proc, self.newcomer = index, log, proc, newcomer
        self.started = time.time()
        self.killed = False

    def events(self) -> List[List[str]]:
        try:
            with open(self.log) as f:
                return [line.split(" ", 3) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []


class Phase:
    """One system's run of one phase: starts the nodes, applies the schedule, stops
    every process it started (by process group) and reads the nodes' logs."""

    def __init__(self, system: str, faulted: bool, a, workdir: str, python: str):
        self.system, self.faulted, self.a = system, faulted, a
        self.python = python
        self.dir = os.path.join(workdir, f"{system}-{'faulted' if faulted else 'fault-free'}")
        os.makedirs(self.dir)
        self.nodes: List[Node] = []
        self.env = dict(os.environ)
        self.env.pop("ECCL_DEBUG", None)
        self.service: Optional[object] = None   # the eccl master or torchft's lighthouse
        self.crashes: List[str] = []
        self.kills_at: List[float] = []

    # -- processes ------------------------------------------------------------------

    def start_services(self) -> None:
        if self.system == "eccl":
            import eccl
            self.service = eccl.Master(lease_ms=self.a.lease_ms)
            self.env.update(ECCL_MASTER=self.service.addr, ECCL_SECRET=self.service.secret)
        elif self.system == "torchft":
            port = free_port()
            lighthouse = os.path.join(os.path.dirname(self.python), "torchft_lighthouse")
            out = open(os.path.join(self.dir, "lighthouse.out"), "w")
            self.service = subprocess.Popen(
                [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100",
                 "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
        else:
            self.env.update(GOODPUT_INIT=f"tcp://127.0.0.1:{free_port()}",
                            GOODPUT_WORLD=str(self.a.nproc))

    def start_node(self, newcomer: bool) -> Node:
        i = len(self.nodes)
        log = os.path.join(self.dir, f"node{i}.log")
        env = dict(self.env)
        env.update(REPLICA_GROUP_ID=str(i), GOODPUT_RANK=str(i), PYTHONUNBUFFERED="1")
        out = open(os.path.join(self.dir, f"node{i}.out"), "w")
        proc = subprocess.Popen(
            [self.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
             "--nproc-per-node", "1", WORKER, "--system", self.system, "--events", log,
             "--width", str(self.a.width), "--batch", str(self.a.batch),
             "--threads", str(self.a.threads), "--min-world", str(self.a.nproc)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        node = Node(i, log, proc, newcomer)
        self.nodes.append(node)
        return node

    def kill(self, node: Node) -> None:
        kill_node(node.proc)
        node.killed = True

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                self.kill(n)
        if isinstance(self.service, subprocess.Popen):
            kill_node(self.service)
        elif self.service is not None:
            self.service.shutdown()

    def check_crashes(self) -> None:
        """A node that exited without being killed crashed: recorded with its error
        (the result), never restarted."""
        for n in self.nodes:
            if not n.killed and n.proc.poll() is not None and n.index not in \
                    {c["node"] for c in self.crashes}:
                errors = [e[1] + " " + e[2] if len(e) > 2 else e[1]
                          for e in n.events() if e[0] == "error"]
                if not errors:
                    with open(n.log.replace(".log", ".out")) as f:
                        errors = [f.read()[-400:]]
                self.crashes.append({"node": n.index, "exit": n.proc.returncode,
                                     "error": errors[-1] if errors else ""})

    # -- the schedule ---------------------------------------------------------------

    def full_size_at(self) -> Optional[float]:
        for n in self.nodes:
            for e in n.events():
                if e[0] == "step" and int(e[3]) == self.a.nproc:
                    return float(e[2])
        return None

    def run(self) -> dict:
        try:
            self.start_services()
            for _ in range(self.a.nproc):
                self.start_node(newcomer=False)
            deadline = time.time() + self.a.start_timeout
            t0 = None
            while t0 is None:
                time.sleep(0.2)
                self.check_crashes()
                if self.crashes or time.time() > deadline:
                    raise RuntimeError(f"{self.system}: the job never reached "
                                       f"{self.a.nproc} replicas: {self.crashes}")
                t0 = self.full_size_at()
            faults = 0
            next_kill = t0 + self.a.kill_every
            end = t0 + self.a.duration
            while time.time() < end:
                time.sleep(0.05)
                self.check_crashes()
                if self.faulted and time.time() >= next_kill and next_kill < end:
                    live = [n for n in self.nodes if n.proc.poll() is None]
                    if live:
                        self.kill(min(live, key=lambda n: n.started))
                        self.kills_at.append(time.time() - t0)
                        faults += 1
                    self.start_node(newcomer=True)
                    next_kill += self.a.kill_every
            time.sleep(1.0)   # let the last steps of the window reach the logs
            return self.measure(t0, faults)
        finally:
            self.stop()

    def measure(self, t0: float, faults: int) -> dict:
        first: Dict[int, tuple] = {}
        for n in self.nodes:
            for e in n.events():
                if e[0] == "step":
                    step, t, m = int(e[1]), float(e[2]), int(e[3])
                    if step not in first or t < first[step][0]:
                        first[step] = (t, m)
        end = t0 + self.a.duration
        done = sum(m for t, m in first.values() if t0 < t <= end) / self.a.nproc
        # Each step of the window at its first commit: (seconds since t0, share of the
        # replicas that took it), for the picture.
        timeline = sorted((round(t - t0, 3), m / self.a.nproc)
                          for t, m in first.values() if t0 < t <= end)
        newcomers, synced = [], []
        for n in self.nodes:
            if not n.newcomer:
                continue
            ev = n.events()
            ready = next((float(e[1]) for e in ev if e[0] == "ready"), None)
            sync = next((float(e[1]) for e in ev if e[0] == "synced"), None)
            step = next((float(e[2]) for e in ev if e[0] == "step"), None)
            if ready is not None and step is not None:
                newcomers.append(step - ready)
            if ready is not None and sync is not None:
                synced.append(sync - ready)
        return {"steps": done, "steps_per_s": done / self.a.duration, "faults": faults,
                "timeline": timeline, "kills_at": [round(k, 3) for k in self.kills_at],
                "newcomers": newcomers, "synced": synced, "crashes": self.crashes,
                "replacements": sum(n.newcomer for n in self.nodes)}


def torchft_python(venv: str) -> str:
    """The venv's interpreter, with torchft installed in it (made on first use)."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"installing torchft into {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        import sysconfig
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], check=True, capture_output=True, text=True)
        # This interpreter's packages (torch among them) are seen from the new venv, so
        # pip does not download torch again.
        with open(os.path.join(site.stdout.strip(), "goodput_base.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")
    ok = subprocess.run([python, "-c", "import torchft"], capture_output=True).returncode == 0
    if not ok:
        subprocess.run([python, "-m", "pip", "install", "-q", "torchft==0.2.0"], check=True)
    return python


def summarize(ff: dict, fl: Optional[dict]) -> dict:
    out = {"fault_free_steps_per_s": ff["steps_per_s"],
           "timeline": {"fault_free": ff["timeline"]}}
    if fl is None:
        return out
    out["timeline"].update(faulted=fl["timeline"], kills_at=fl["kills_at"])
    rate = ff["steps_per_s"]
    out.update(
        faulted_steps_per_s=fl["steps_per_s"],
        goodput_ratio=fl["steps_per_s"] / rate if rate else None,
        lost_s_per_fault=((ff["steps"] - fl["steps"]) / rate / fl["faults"])
        if rate and fl["faults"] else None,
        newcomer_first_step_s=statistics.median(fl["newcomers"]) if fl["newcomers"] else None,
        newcomer_first_step_worst_s=max(fl["newcomers"]) if fl["newcomers"] else None,
        replacements=fl["replacements"], replacements_that_stepped=len(fl["newcomers"]),
        crashes=fl["crashes"] + ff["crashes"])
    if fl["synced"]:        # eccl: admitted and holding the model and optimizer state
        out["newcomer_synced_s"] = statistics.median(fl["synced"])
    return out


def plot(results: dict, path: str) -> None:
    """Steps per second over time for each system and phase (in bins of a twelfth of a
    phase, at least 2 s: a step takes about a second here), and the steps done so far
    below it; each kill of the faulted phases a vertical line. Drawn with matplotlib into
    `path` (its format from the name: .svg, .png, .pdf)."""
    import matplotlib
    matplotlib.use("Agg")
    # Text stays text in an SVG (searchable, and smaller than glyph outlines).
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    duration = results["duration_s"]
    width = max(2.0, duration / 12)
    bins = int(math.ceil(duration / width))
    fig, (rate_ax, done_ax) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                           gridspec_kw={"height_ratios": [3, 2]})
    kills = set()
    colours = {"eccl": "tab:blue", "torchft": "tab:orange", "gloo_ddp": "tab:gray"}
    for name in ("eccl", "torchft", "gloo_ddp"):
        r = results.get(name)
        if r is None:
            continue
        for phase, line in (("fault_free", "--"), ("faulted", "-")):
            steps = r["timeline"].get(phase)
            if steps is None:
                continue
            label = f"{name} {phase.replace('_', '-')}"
            counts = [0.0] * bins
            for t, share in steps:
                counts[min(int(t // width), bins - 1)] += share
            xs = [(k + 0.5) * width for k in range(bins)]
            rate_ax.plot(xs, [c / width for c in counts], line, marker=".",
                         color=colours[name], label=label)
            total, ts, done = 0.0, [0.0], [0.0]
            for t, share in steps:
                total += share
                ts.append(t)
                done.append(total)
            done_ax.step(ts, done, line, where="post", color=colours[name], label=label)
        kills.update(r["timeline"].get("kills_at", []))
    for ax in (rate_ax, done_ax):
        for i, k in enumerate(sorted(kills)):
            ax.axvline(k, color="tab:red", alpha=0.6, linewidth=1,
                       label="node SIGKILLed (and a replacement started)" if i == 0 else None)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    rate_ax.set_ylabel(f"steps per second ({width:.2g} s bins)")
    done_ax.set_ylabel("steps done")
    done_ax.set_xlabel("seconds since the job first stepped at full size")
    done_ax.set_xlim(0, duration)
    every = results.get("kill_every_s")
    rate_ax.set_title(f"Goodput under failures: {results.get('nproc', '?')} nodes, "
                      f"a kill every {every if every is None else format(every, 'g')} s "
                      f"(steps of full size; one of m of n replicas counts m/n)")
    rate_ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=3, help="nodes (replicas)")
    p.add_argument("--duration", type=float, default=120, help="seconds per phase")
    p.add_argument("--kill-every", type=float, default=30)
    p.add_argument("--skip-torchft", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--width", type=int, default=4000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 3),
                   help="torch threads per node")
    p.add_argument("--torchft-venv", default=os.path.join(ROOT, ".venv-torchft"))
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--lease-ms", type=int, default=2000,
                   help="the eccl master's lease (a killed node is noticed by its closed "
                        "connections at once; the lease only times out hung ones)")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--plot", help="draw steps per second over time, kills marked, into "
                                  "this file (.svg, .png or .pdf; needs matplotlib)")
    p.add_argument("--replot", metavar="JSON",
                   help="draw --plot from the results a --json run wrote, without running")
    a = p.parse_args()
    if a.replot:
        if not a.plot:
            p.error("--replot needs --plot FILE")
        with open(a.replot) as f:
            plot(json.load(f), a.plot)
        return
    if a.nproc < 2 or a.duration <= 0 or a.kill_every <= 0:
        p.error("--nproc must be at least 2, --duration and --kill-every positive")

    workdir = tempfile.mkdtemp(prefix="eccl-goodput-")
    results: dict = {}
    try:
        runs = [("eccl", sys.executable)]
        if not a.skip_torchft:
            runs.append(("torchft", torchft_python(a.torchft_venv)))
        for system, python in runs:
            print(f"{system}: fault-free phase ({a.duration:.0f} s)", flush=True)
            ff = Phase(system, False, a, workdir, python).run()
            print(f"{system}: faulted phase (a kill every {a.kill_every:.0f} s)", flush=True)
            fl = Phase(system, True, a, workdir, python).run()
            results[system] = summarize(ff, fl)
        print(f"gloo_ddp: fault-free phase ({a.duration:.0f} s)", flush=True)
        results["gloo_ddp"] = summarize(Phase("gloo", False, a, workdir, sys.executable).run(),
                                        None)
        results["faults"] = fl["faults"]
        results["duration_s"] = a.duration
        results["nproc"] = a.nproc
        results["kill_every_s"] = a.kill_every
    finally:
        if a.keep_logs:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n{a.nproc} nodes, 3×Linear({a.width}), {a.duration:.0f} s per phase, "
          f"{results['faults']} kills\n")
    print(f"{'system':10} {'fault-free':>11} {'faulted':>9} {'goodput':>8} "
          f"{'lost s/fault':>13} {'newcomer 1st step s':>20}")
    for name in ("eccl", "torchft", "gloo_ddp"):
        r = results.get(name)
        if r is None:
            continue
        nc = (f"{fmt(r.get('newcomer_first_step_s'), '.2f')} "
              f"(worst {fmt(r.get('newcomer_first_step_worst_s'), '.2f')})"
              if "faulted_steps_per_s" in r else "-")
        print(f"{name:10} {r['fault_free_steps_per_s']:>9.3f}/s "
              f"{fmt(r.get('faulted_steps_per_s'), '.3f'):>7}/s "
              f"{fmt(r.get('goodput_ratio'), '.1%'):>8} "
              f"{fmt(r.get('lost_s_per_fault'), '.2f'):>13} {nc:>20}")
        if r.get("newcomer_synced_s") is not None:
            print(f"  {name} newcomers: admitted and synced {r['newcomer_synced_s']:.2f} s "
                  f"after ready (median); the rest of the first step is the step itself")
        for c in r.get("crashes", []):
            print(f"  {name} node {c['node']} crashed (exit {c['exit']}): {c['error'][:300]}")
    if "torchft" in results and results["torchft"].get("faulted_steps_per_s"):
        print(f"\neccl/torchft under faults: "
              f"{results['eccl']['faulted_steps_per_s'] / results['torchft']['faulted_steps_per_s']:.2f}x")
    print(f"eccl/gloo DDP fault-free: "
          f"{results['eccl']['fault_free_steps_per_s'] / results['gloo_ddp']['fault_free_steps_per_s']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
