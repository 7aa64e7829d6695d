"""One rank of the one-sided window checks (run by test_torch_window.py): torch's window
API (`dist._new_window`, put, signal, wait_signal, map_remote_tensor) on an eccl group,
printing what it saw as JSON. `mode` picks the scenario:

- `basic`: every rank puts its block into the next rank's window, signals, waits for its
  predecessor; map_remote_tensor reads and writes a peer's memory; async forms; a rank
  registering a tensor the group did not allocate makes every rank raise; bad puts raise.
- `fault`: every rank prints READY once its window is made; the last rank then sleeps (to
  be SIGKILLed or SIGSTOPped by the test), the others wait for its signal and report the
  error they got, and that of a put into its window after it.
- `bench`: `put` of 64 MiB from rank 0 into rank 1, against a plain copy of that size.
"""

import json
import os
import sys
import time

import eccl
import eccl.torch  # noqa: F401  registers "eccl"
import torch
import torch.distributed as dist


def allocate(n, dtype=torch.float32):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert backend.supports_tensor_alloc(torch.device("cpu"))
    return backend.allocate_tensor(n, dtype=dtype, device=torch.device("cpu"))


def basic(r, n):
    """WINDOW_TEST_OVER_LINKS=1 (with a distinct ECCL_HOST_ID per rank): every rank is a
    host of its own, so nothing is mapped and every put and signal goes over the links."""
    links = bool(os.environ.get("WINDOW_TEST_OVER_LINKS"))
    out = {"supports_window": dist._supports_window()}
    buf = allocate(4 * n).zero_()     # allocate_tensor's memory is uninitialized
    win = dist._new_window(buf)
    out["window_type"] = type(win).__mro__[1].__name__
    nxt, prev = (r + 1) % n, (r - 1) % n
    win.put(torch.full((4,), float(r + 1)), nxt, 4 * r, False)
    win.wait_signal(prev, False)
    out["after_put"] = buf.tolist()
    dist.barrier()   # every rank has read its window before any writes into another's
    if links:
        try:
            win.map_remote_tensor(nxt)
            out["remote_error"] = None
        except Exception as e:  # noqa: BLE001 - the type is what is checked
            out["remote_error"] = f"{type(e).__name__}: {e}"
        win.put(torch.full((1,), 100.0 + r), nxt, 0, False)
        win.signal(nxt, False)      # a second signal: the next wait consumes one only
        win.wait_signal(prev, False)
        w = win.wait_signal(prev, True)
        w.wait()
        out["remote_len"], out["remote_mine"] = None, None
    else:
        # map_remote_tensor: the next rank's memory itself; read what this rank put
        # there, then write into it and signal.
        remote = win.map_remote_tensor(nxt)
        out["remote_len"] = remote.numel()
        out["remote_mine"] = remote[4 * r:4 * r + 4].tolist()
        remote[0] = 100.0 + r
        win.signal(nxt, False)
        w = win.wait_signal(prev, True)
        w.wait()
    out["after_remote_write"] = buf[0].item()
    # async put and is_completed
    w = win.put(torch.full((1,), -1.0), nxt, 1, True)
    out["put_async_completed"] = w.wait() and w.is_completed()
    win.wait_signal(prev, False)
    out["after_async_put"] = buf[1].item()
    out["attr"] = str(win.get_attr(nxt).access_type)
    errors = {}
    for name, call in [
        ("wrong_dtype", lambda: win.put(torch.ones(1, dtype=torch.int32), nxt, 0, False)),
        ("out_of_bounds", lambda: win.put(torch.ones(5), nxt, 4 * n - 2, False)),
        ("bad_rank", lambda: win.put(torch.ones(1), n + 3, 0, False)),
        ("negative_offset", lambda: win.put(torch.ones(1), nxt, -1, False)),
    ]:
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    # A rank whose tensor cannot serve (not contiguous): every rank raises, naming it.
    bad = allocate(8)[::2] if r == 0 else allocate(4)
    try:
        dist._new_window(bad)
        out["bad_tensor"] = None
    except Exception as e:  # noqa: BLE001
        out["bad_tensor"] = f"{type(e).__name__}: {e}"
    # The last rank's tensor is a plain one (not from allocate_tensor): the others' puts
    # into it go over the link and land when it waits for their signals.
    plain = allocate(n).zero_() if r != n - 1 else torch.zeros(n)
    win2 = dist._new_window(plain)
    win2.put(torch.full((1,), float(r + 1)), n - 1, r, False)
    if r == n - 1:
        for p in range(n):
            win2.wait_signal(p, False)
        out["plain_window"] = plain.tolist()
    out["plain_attr"] = str(win2.get_attr(n - 1).access_type)
    try:
        win2.map_remote_tensor(n - 1)
        out["plain_remote"] = None
    except Exception as e:  # noqa: BLE001
        out["plain_remote"] = f"{type(e).__name__}: {e}"
    # The group still works after all that.
    t = torch.ones(2)
    dist.all_reduce(t)
    out["all_reduce_after"] = t.tolist()
    # An asynchronous wait: not completed before its signal is sent, completed after;
    # and one whose future completes without a wait().
    w = win.wait_signal(prev, True)
    out["pending_completed"] = w.is_completed()
    w2 = win.wait_signal(prev, True)
    # Mapped, the future completes on its own; over a link at wait() (its receive would
    # otherwise hold the communicator's queue, the barrier below among them).
    fut = w2.get_future()
    dist.barrier()
    win.signal(nxt, False)
    win.signal(nxt, False)
    w.wait()
    out["done_completed"] = w.is_completed() and w.is_success()
    if links:
        w2.wait()
    fut.wait()
    out["future_done"] = fut.done()
    # Last, a wait that times out (over the links it ends the epoch).
    try:
        win.wait_signal(prev, False, _wait_opts(0.3))
        out["wait_timeout"] = None
    except Exception as e:  # noqa: BLE001
        out["wait_timeout"] = f"{type(e).__name__}: {e}"
    return out


def _wait_opts(seconds):
    from datetime import timedelta
    o = torch._C._distributed_c10d.WaitSignalOptions()
    o.timeout = timedelta(seconds=seconds)
    return o


def fault(r, n):
    buf = allocate(16)
    win = dist._new_window(buf)
    last = n - 1
    if r == last:
        print("READY", flush=True)
        time.sleep(600)
        return {}
    print("READY", flush=True)
    start = time.monotonic()
    try:
        win.wait_signal(last, False)
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - start
    # A put into the lost rank's window fails too (the world it was made in is gone).
    try:
        win.put(torch.ones(1), last, 0, False)
        put_err = None
    except Exception as e:  # noqa: BLE001
        put_err = f"{type(e).__name__}: {e}"
    return {"error": err, "waited_s": waited, "put_error": put_err,
            "is_eccl": err is not None and "Error" in err}


def bench(r, n):
    size = 64 << 20
    buf = allocate(size // 4)
    win = dist._new_window(buf)
    src = torch.arange(size // 4, dtype=torch.float32)
    out = {}
    if r == 0:
        plain = torch.empty_like(src)
        copies, one_core = [], []
        for _ in range(5):
            t = time.perf_counter()
            plain.copy_(src)
            copies.append(time.perf_counter() - t)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        for _ in range(5):
            t = time.perf_counter()
            plain.copy_(src)
            one_core.append(time.perf_counter() - t)
        torch.set_num_threads(threads)
        puts = []
        for _ in range(5):
            dist.barrier()
            t = time.perf_counter()
            win.put(src, 1, 0, False)
            puts.append(time.perf_counter() - t)
            win.wait_signal(1, False)
        out = {"copy_ms": [c * 1e3 for c in copies], "copy_one_core_ms": [c * 1e3 for c in one_core],
               "put_ms": [p * 1e3 for p in puts]}
    else:
        for _ in range(5):
            dist.barrier()
            win.wait_signal(0, False)
            win.signal(0, False)
        out = {"equal": bool(torch.equal(buf, src))}
    return out


def main():
    mode = sys.argv[1]
    dist.init_process_group("eccl")
    r, n = dist.get_rank(), dist.get_world_size()
    if mode == "basic":
        out = basic(r, n)
    elif mode == "fault":
        out = fault(r, n)
    else:
        out = bench(r, n)
    print("RESULT " + json.dumps(out), flush=True)
    if mode in ("basic", "bench"):
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
