"""One rank of test_cuda's stream-order test (env:// as torchrun, backend eccl, a CUDA
GPU), on the path the environment chooses (CUDA IPC, or staged through the host with
`ECCL_CUDA_IPC=0`: read once, when the rank's communicator first meets its device, so
each path is a world of its own): the current stream gets about half a second of
device work (`torch.cuda._sleep`) and then writes the tensor; a collective called with
`async_op=True` right after must

- return to the caller before that work is done (the backend does not block the host on
  the stream: `call_ms` against `sleep_ms`), and
- still read what the stream wrote after the sleep (its result is exact); so must a
  list-form reduce_scatter and an all_to_all with splits made behind the same work
  (staged calls that rearrange their host copies first, and wait for them to do so).

Prints its measurements and results as JSON after "RESULT "."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spends in about `ms` milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / max(start.elapsed_time(end), 1e-3))


def main() -> None:
    dist.init_process_group(sys.argv[1] if len(sys.argv) > 1 else "eccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    cycles = sleep_cycles(500.0)
    res = {}
    for path in ["staged" if os.environ.get("ECCL_CUDA_IPC", "1").strip() == "0" else "ipc"]:
        t = torch.zeros(1 << 20, device=dev)
        g = torch.zeros(n * 4, device=dev)
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        torch.cuda._sleep(cycles)
        t.fill_(float(rank + 1))
        mine = torch.full((4,), float(rank + 1), device=dev)
        parts = [torch.full((4,), float(rank + 1), device=dev) for _ in range(n)]
        sendbuf = torch.full((2 * n,), float(rank + 1), device=dev)
        w1 = dist.all_reduce(t, async_op=True)
        w2 = dist.all_gather_into_tensor(g, mine, async_op=True)
        res[f"{path}_call_ms"] = (time.monotonic() - t0) * 1e3
        # Calls that rearrange their host copies before queuing anything (a list-form
        # reduce_scatter, a list-form all_to_all): they wait for the copies first. An
        # all_to_all_single with splits goes to eccl's device path on both legs (in the
        # staged leg, through host memory as a pipeline: even blocks).
        scattered = torch.zeros(4, device=dev)
        w3 = dist.reduce_scatter(scattered, parts, async_op=True)
        exchanged = torch.zeros(2 * n, device=dev)
        w4 = dist.all_to_all_single(exchanged, sendbuf, [2] * n, [2] * n, async_op=True)
        outs = [torch.zeros(2, device=dev) for _ in range(n)]
        ins = [torch.full((2,), float(rank + 1), device=dev) for _ in range(n)]
        w5 = dist.all_to_all(outs, ins, async_op=True)
        for w in (w1, w2, w3, w4, w5):
            w.wait()
        torch.cuda.synchronize()
        res[f"{path}_scattered"] = scattered.tolist()
        res[f"{path}_exchanged"] = exchanged.tolist()
        res[f"{path}_exchanged_list"] = torch.cat(outs).tolist()
        res[f"{path}_done_ms"] = (time.monotonic() - t0) * 1e3
        res[f"{path}_sum"] = sorted(set(t.tolist()))
        res[f"{path}_gathered"] = g.tolist()
    # What the sleep alone takes with every rank's sleep on the GPU at once.
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    res["sleep_ms"] = (time.monotonic() - t0) * 1e3
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
