"""FSDP2 step time with the "eccl" backend against "gloo" on the same model and machine,
in one run: each round is one torchrun launch in which the workers train with each
backend in turn (the order turns round by round, so both see the same load). The model
is --layers Linear(width, width) layers with ReLU between them, each sharded with
`fully_shard` over a 1-D CPU DeviceMesh; SGD, a batch of 32 per rank. Prints the median
step per backend and round, and checks that both backends end with the same loss.

    python examples/compare_fsdp.py --nproc 2 --width 2048 --layers 4 --steps 10 --rounds 2
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402


def worker(backends, width, layers, steps):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    for backend in backends:
        allocated = [0]
        if backend == "eccl-alloc":
            # FSDP2's buffers from the backend's allocate_tensor (host shared memory);
            # counted, so that a run where FSDP2 never asked says so.
            import eccl.torch_window as tw
            place = tw.allocate

            def counted(*args, _place=place):
                allocated[0] += 1
                return _place(*args)
            tw.allocate = counted
        dist.init_process_group(backend.split("-")[0])
        rank, n = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (n,))
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*mods)
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if backend == "eccl-alloc":
            for m in model.modules():
                if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                    m.set_allocate_memory_from_process_group_for_comm(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        data = torch.Generator().manual_seed(100 + rank)
        times, loss = [], None
        for step in range(steps + 2):       # two warm-up steps
            x = torch.randn(32, width, generator=data)
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        t = torch.tensor([statistics.median(times)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{backend}: median step {t.item():.2f} ms, last loss {loss.item()!r}"
                  + (f" ({allocated[0]} buffers from allocate_tensor)"
                     if backend == "eccl-alloc" else ""), flush=True)
        dist.destroy_process_group()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        backends, width, layers, steps = sys.argv[2].split(","), *map(int, sys.argv[3:6])
        worker(backends, width, layers, steps)
        # torch 2.15's gloo now and then aborts the process at interpreter exit, after its
        # group was destroyed ("terminate called without an active exception", also with
        # gloo alone): the figures are printed, so leave without the teardown.
        sys.stdout.flush()
        os._exit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--alloc", action="store_true",
                    help="also run eccl with FSDP2's buffers from the backend's "
                         "allocate_tensor (host shared memory): 'eccl-alloc'")
    a = ap.parse_args()
    kinds = ["eccl", "gloo"] + (["eccl-alloc"] if a.alloc else [])
    results = {k: [] for k in kinds}
    losses = {}
    for r in range(a.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        env = {k: v for k, v in os.environ.items() if k not in ("ECCL_MASTER",)}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={a.nproc}",
               f"--master-port={free_port()}", __file__, "--worker", ",".join(order),
               str(a.width), str(a.layers), str(a.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        found = re.findall(r"^([\w-]+): median step ([0-9.]+) ms, last loss (\S+?)"
                           r"(?: \((\d+) buffers from allocate_tensor\))?$", out.stdout, re.M)
        if out.returncode != 0 or len(found) != len(kinds):
            raise SystemExit(f"round {r} failed (exit {out.returncode}):\n{out.stdout[-2000:]}"
                             f"\n{out.stderr[-3000:]}")
        for backend, ms, loss, allocated in found:
            if backend == "eccl-alloc" and not int(allocated or 0):
                raise SystemExit("FSDP2 never called the backend's allocate_tensor")
            results[backend].append(float(ms))
            losses.setdefault(backend, set()).add(loss)
    print(f"# FSDP2, {a.nproc} ranks, {a.layers} x Linear({a.width}), {a.steps} steps, "
          f"{a.rounds} rounds: median step per round (ms)")
    for backend, ms in results.items():
        print(f"{backend:5s} " + " ".join(f"{m:8.2f}" for m in ms))
    for k in kinds:
        if k != "gloo":
            ratios = [e / g for e, g in zip(results[k], results["gloo"])]
            print(f"# {k}/gloo step time: {min(ratios):.2f}-{max(ratios):.2f}")
    if a.alloc:
        ratios = [e / g for e, g in zip(results["eccl-alloc"], results["eccl"])]
        print(f"# eccl-alloc/eccl step time: {min(ratios):.2f}-{max(ratios):.2f}")
    same = all(losses[k] == losses["gloo"] for k in kinds)
    print("# last loss: " + " ".join(f"{k} {sorted(losses[k])}" for k in kinds)
          + f" ({'equal' if same else 'DIFFERENT'})")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
