"""DDP on CUDA tensors: eccl (same-host CUDA IPC, and staged through the host with
ECCL_CUDA_IPC=0) against gloo's CUDA path, same model, same machine, one run; and the
step with no communication at all. Two processes share GPU 0 unless there are more GPUs.

    python examples/ddp_cuda.py --width 4096 --batch 64 --steps 10 --json ddp_cuda.json
    python examples/ddp_cuda.py --what allreduce --json allreduce_cuda.json

`--what allreduce` times `dist.all_reduce` of CUDA tensors instead (1 MiB and 256 MiB of
f32, and 256 MiB of bf16; the slowest rank's median per size).

Each backend runs as its own world of `--nproc` processes (env://, as torchrun starts
them); rank 0 saves its parameters after the timed steps, and the summary says whether
every backend ended with gloo's parameters (bit for bit) and each one's median step.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "tests"))
from procs import free_port  # noqa: E402


def rank_main(a) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    if a.backend != "none":
        if a.backend == "eccl":
            import eccl.torch  # noqa: F401
        dist.init_process_group(a.backend)
    if a.what == "allreduce":
        out = {}
        for label, count, dtype in (("1M f32", 1 << 18, torch.float32),
                                    ("256M f32", 1 << 26, torch.float32),
                                    ("256M bf16", 1 << 27, torch.bfloat16)):
            t = torch.ones(count, dtype=dtype, device=dev)
            times = []
            for i in range(3 + a.steps):
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                dist.all_reduce(t)
                torch.cuda.synchronize(dev)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1e6)
            times.sort()
            out[label] = times[len(times) // 2]
        print("RESULT " + json.dumps(out), flush=True)
        dist.destroy_process_group()
        return
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(dev)
    net = model if a.backend == "none" else torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[dev.index], bucket_cap_mb=25)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    g = torch.Generator(device="cpu").manual_seed(100 + rank)
    times = []
    for step in range(a.warmup + a.steps):
        x = torch.randn(a.batch, a.width, generator=g).to(dev)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        torch.cuda.synchronize(dev)
        if step >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0 and a.save:
        torch.save([p.detach().cpu() for p in model.parameters()], a.save)
    times.sort()
    print("RESULT " + json.dumps({"median_ms": times[len(times) // 2], "best_ms": times[0]}),
          flush=True)
    if a.backend != "none":
        dist.destroy_process_group()


def run(backend: str, a, save: str, env_extra: dict) -> dict:
    nproc = 1 if backend == "none" else a.nproc
    port = free_port()
    procs = []
    for r in range(nproc):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), **env_extra)
        cmd = [sys.executable, __file__, "--rank", "--what", a.what, "--backend", backend,
               "--width",
               str(a.width), "--batch", str(a.batch), "--steps", str(a.steps), "--warmup",
               str(a.warmup), "--save", save]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=a.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0 or "RESULT " not in out:
            raise SystemExit(f"{backend}: exit {p.returncode}\n{out[-2000:]}\n{err[-3000:]}")
    res = [json.loads(line[7:]) for out, _ in outs for line in out.splitlines()
           if line.startswith("RESULT ")]
    if a.what == "allreduce":
        return {k: max(r[k] for r in res) for k in res[0]}
    return {"median_ms": max(r["median_ms"] for r in res),
            "best_ms": max(r["best_ms"] for r in res)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="eccl", help=argparse.SUPPRESS)
    p.add_argument("--save", default="", help=argparse.SUPPRESS)
    p.add_argument("--what", choices=["ddp", "allreduce"], default="ddp")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--json", help="also write the summary here")
    a = p.parse_args()
    if a.rank:
        rank_main(a)
        return
    import torch
    runs = [("none", {}), ("gloo", {}), ("eccl", {"ECCL_CUDA_IPC": "1"}),
            ("eccl-staged", {"ECCL_CUDA_IPC": "0"})]
    out = {"what": a.what, "width": a.width, "batch": a.batch, "steps": a.steps,
           "nproc": a.nproc, "gpu": torch.cuda.get_device_name(0), "runs": {}}
    if a.what == "allreduce":
        for name, extra in runs[1:]:
            out["runs"][name] = run(name.split("-")[0], a, "", extra)
            print(f"allreduce_cuda {name}: {out['runs'][name]} (us)", flush=True)
        print(json.dumps(out, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in runs:
            save = str(Path(tmp) / f"{name}.pt")
            out["runs"][name] = run(name.split("-")[0], a, save, extra)
            print(f"ddp_cuda {name}: median {out['runs'][name]['median_ms']:.2f} ms", flush=True)
        ref = torch.load(str(Path(tmp) / "gloo.pt"))
        for name in ("eccl", "eccl-staged"):
            mine = torch.load(str(Path(tmp) / f"{name}.pt"))
            out["runs"][name]["same_params_as_gloo"] = all(
                torch.equal(x, y) for x, y in zip(mine, ref))
            out["runs"][name]["gloo_over_eccl"] = (
                out["runs"]["gloo"]["median_ms"] / out["runs"][name]["median_ms"])
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
