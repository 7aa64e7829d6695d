"""What the torch backend (`eccl.torch`) does over torch's store: the part of the
rendezvous store a group's set-up uses, rank 0's fresh job secret handed to each rank
sealed to it, and gloo's monitored barrier."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

import eccl


def _store_get(store: Any, key: str, timeout: timedelta) -> str:
    store.wait([key], timeout)
    return store.get(key).decode()


CONFLICT = "eccl/conflict"


def _share_secret(store: Any, rank: int, world_size: int, secret: Optional[str],
                  timeout: timedelta) -> str:
    """Rank 0's fresh job secret, handed to every other rank through the store sealed to
    that rank alone: rank r publishes a one-use X25519 public key (write-once, with
    `compare_set`), rank 0 answers with the secret encrypted to it.

    What this protects, and what it cannot: a process that can only *read* the store
    learns nothing. One that can *write* it can always pose as a rank or as rank 0 (the
    store authenticates nobody, and nothing else is shared yet). eccl notices the form
    it can see: a rank that finds another key published in its place marks the store
    (`eccl/conflict`) and stops; rank 0 seals nothing once the mark is there, and every
    rank checks for it once its world has formed (`_check_no_conflict`), so every rank
    fails, not only the one posed as. The README says which stores to trust with this."""
    from eccl import _eccl
    if rank == 0:
        assert secret is not None
        # Rank r says it published with a plain set: torch's non-libuv TCPStore server
        # does not wake a waiter on compare_set.
        if world_size > 1:
            store.wait([f"eccl/published/{r}" for r in range(1, world_size)], timeout)
        for r in range(1, world_size):
            _check_no_conflict(store)
            public = bytes.fromhex(store.get(f"eccl/key/{r}").decode())
            box = _eccl.seal(public, secret.encode(), f"eccl/torch rank {r}".encode())
            store.set(f"eccl/sealed/{r}", box.hex())
        return secret
    key = _eccl.OpenKey()
    mine = key.public.hex()
    stored = store.compare_set(f"eccl/key/{rank}", "", mine)
    if (stored.decode() if isinstance(stored, bytes) else stored) != mine:
        why = (f"another process published rank {rank}'s key in the rendezvous store "
               "before this one: something else on the store is posing as this rank (or "
               "two processes were started as the same rank)")
        store.set(CONFLICT, why)
        raise eccl.InvalidArgumentError(why)
    store.set(f"eccl/published/{rank}", "1")
    box = bytes.fromhex(_store_get(store, f"eccl/sealed/{rank}", timeout))
    return key.open(box, f"eccl/torch rank {rank}".encode()).decode()


def _check_no_conflict(store: Any) -> None:
    """Raises if a rank found its key published by another process: the job secret may
    have gone to that process, so no rank goes on with it."""
    if store.check([CONFLICT]):
        why = store.get(CONFLICT).decode(errors="replace")
        raise eccl.InvalidArgumentError(f"the job's set-up was tampered with: {why}")


_created = 0


def _fresh_store(store: Any, default_group: bool) -> Any:
    """The part of the rendezvous store this group's set-up uses. torchrun keeps one
    store across restarts of its workers, and a process may create the default group
    again after destroying it: keys left by an earlier attempt (a dead master's address,
    a dead rank's public key) must not be read as this one's. Every rank creates the
    default group, so a count of them names the attempt; a later group's store is
    already its own (torch prefixes it with the group's unique name), and only its
    members create it, so a count there would differ between ranks."""
    global _created
    if not default_group:
        return dist.PrefixStore("eccl/", store)
    _created += 1
    # Under an agent-hosted store (torchrun's c10d default) the store outlives the
    # workers, and every agent restarts its workers together: the restart count names
    # the attempt. Where the workers' rank 0 hosts a fresh store in each round (eccl's
    # rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) the counts differ between a
    # newcomer (0) and the nodes it joins, and the store itself is new: no attempt key.
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "r"
    return dist.PrefixStore(f"eccl/{attempt}/{_created}/", store)


def monitored_barrier(store: Any, base: str, me: int, n: int, timeout: timedelta,
                      wait_all_ranks: bool) -> None:
    """gloo's monitored barrier over a group's store (keys under `base`): rank 0 waits at
    most `timeout` for every other rank to arrive and names the ranks that did not (the
    first one, or all of them with `wait_all_ranks`) in gloo's words; the others wait for
    rank 0's verdict. The backend runs it beside its communicator, whose calls run in
    order (one missing rank would hide the ones behind it)."""
    ms = int(timeout.total_seconds() * 1000)
    deadline = time.monotonic() + timeout.total_seconds()
    if me != 0:
        store.set(f"{base}arrived/{me}", "1")
        while not store.check([f"{base}verdict"]):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Rank {me} timed out in monitoredBarrier after {ms} ms waiting for rank 0")
            time.sleep(0.005)
        verdict = store.get(f"{base}verdict").decode()
        if verdict != "ok":
            raise RuntimeError(verdict)
        return
    missing = list(range(1, n))
    pause = 0.001
    while missing:
        missing = [r for r in missing if not store.check([f"{base}arrived/{r}"])]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    if not missing:
        store.set(f"{base}verdict", "ok")
        return
    # gloo's words, so that code matching them keeps working.
    if wait_all_ranks:
        msg = (f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass "
               f"monitoredBarrier in {ms} ms")
    else:
        msg = f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"
    store.set(f"{base}verdict", msg)
    raise RuntimeError(msg)
