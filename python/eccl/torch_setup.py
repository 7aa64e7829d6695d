"""How the torch backend's groups meet (`eccl.torch`): the rendezvous store's part that a
group's set-up uses, and rank 0's fresh job secret handed to each rank sealed to it."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

import eccl


def _store_get(store: Any, key: str, timeout: timedelta) -> str:
    store.wait([key], timeout)
    return store.get(key).decode()


def _share_secret(store: Any, rank: int, world_size: int, secret: Optional[str],
                  timeout: timedelta) -> str:
    """Rank 0's fresh job secret, handed to every other rank through the store sealed to
    that rank alone: rank r publishes a one-use X25519 public key (write-once, with
    `compare_set`), rank 0 answers with the secret encrypted to it. A process that reads
    the store learns nothing; one that writes rank r's key first would get the box, so
    the real rank r, finding another key there, stops with an error instead of running
    beside it."""
    from eccl import _eccl
    if rank == 0:
        assert secret is not None
        keys = [f"eccl/key/{r}" for r in range(1, world_size)]
        if keys:
            store.wait(keys, timeout)
        for r, k in enumerate(keys, start=1):
            public = bytes.fromhex(store.get(k).decode())
            box = _eccl.seal(public, secret.encode(), f"eccl/torch rank {r}".encode())
            store.set(f"eccl/sealed/{r}", box.hex())
        return secret
    key = _eccl.OpenKey()
    mine = key.public.hex()
    stored = store.compare_set(f"eccl/key/{rank}", "", mine)
    if (stored.decode() if isinstance(stored, bytes) else stored) != mine:
        raise eccl.InvalidArgumentError(
            f"another process published rank {rank}'s key in the rendezvous store before "
            "this one: something else on the store is posing as this rank (or two "
            "processes were started as the same rank)")
    box = bytes.fromhex(_store_get(store, f"eccl/sealed/{rank}", timeout))
    return key.open(box, f"eccl/torch rank {rank}".encode()).decode()


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
