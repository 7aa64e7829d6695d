"""A `torch.distributed.Store` kept in the eccl master (replicated with raft).

    store = eccl.store.EcclStore("m1:29400,m2:29400,m3:29400", scope="job-7")
    dist.init_process_group("gloo", store=store, rank=r, world_size=n)

Any backend can use it (gloo, eccl, ...), and so can `init_process_group(
init_method="eccl://m1:29400,m2:29400/job-7?rank=R&world_size=N")`. Writes are committed
through raft before they return; reads come from the leader's memory. The store follows
the raft leader, so a master that dies changes nothing visible but a short delay.

Keys live in a scope (torchrun's `--rdzv-id`): a scope is removed when its last client
closes or dies, so a finished job leaves nothing behind. A worker that torchrun started
gets a scope of its own round by default (`<rdzv-id>/workers/<MASTER_ADDR>:<MASTER_PORT>`),
apart from the agents' rendezvous, which lives in `<rdzv-id>` for the whole job: a
restarted round's workers read nothing the last round's wrote. Keys are at most 4 KiB, values at
most 1 MiB; past a bound the call raises `eccl.InvalidArgumentError`
and the store is unchanged.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

import eccl

from . import _eccl

DEFAULT_TIMEOUT = timedelta(seconds=300)
#: The longest scope name the masters take (`eccl_protocol::StoreLimits::MAX_SCOPE_NAME`).
MAX_SCOPE_NAME = 256


def _b(x) -> bytes:
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, (bytearray, memoryview)):
        return bytes(x)
    if isinstance(x, list):  # torch passes list[int] for some values
        return bytes(x)
    raise TypeError(f"a store key or value must be str or bytes, not {type(x).__name__}")


#: What a wait of `Store.kNoTimeout` (0) waits: the longest wait the masters take.
NO_TIMEOUT_S = 24 * 3600.0


def _seconds(timeout: Optional[timedelta], default: timedelta) -> float:
    """A wait's `timeout` in seconds; torch's `kNoTimeout` (0, as `TCPStore` takes it)
    waits as long as the masters let a wait last (`NO_TIMEOUT_S`)."""
    t = default if timeout is None else timeout
    s = t.total_seconds()
    return NO_TIMEOUT_S if s == 0 else min(max(s, 0.0), NO_TIMEOUT_S)


def default_scope() -> str:
    """The scope an `EcclStore` made without one uses. In a worker that torchrun started
    (it has `TORCHELASTIC_RESTART_COUNT`), one per rendezvous round: the round's rank-0
    address, which every worker of the round shares and the next round's agents pick
    afresh (eccl's rendezvous publishes one per round). The agents' own scope, the run
    id, lives as long as any agent does, so keys a worker wrote there would still be
    read by the workers of a restart (stale addresses, counters already counted up)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run:
        return "default"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        round_ = "".join(c if c.isascii() and (c.isalnum() or c in "-_.:") else "_"
                         for c in f"{addr}:{port}")
        return f"{run}/workers/{round_}"[:MAX_SCOPE_NAME]
    return run


class EcclStore(dist.Store):
    """A `torch.distributed.Store` backed by eccl's masters.

    `masters`: comma-separated client addresses (default `ECCL_MASTER`); `scope`: the
    namespace of this job's keys (default: in a worker of torchrun, one per rendezvous
    round, see the module; else `TORCHELASTIC_RUN_ID` or "default"); `secret`:
    the job secret (default `ECCL_SECRET`/`ECCL_SECRET_FILE`); `timeout`: how long `get`
    and `wait` wait for keys, and how long to look for a leader.
    """

    def __init__(
        self,
        masters: Optional[str] = None,
        scope: Optional[str] = None,
        secret: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        _client: Optional[_eccl.StoreClient] = None,
    ):
        super().__init__()
        masters = masters or os.environ.get("ECCL_MASTER")
        if not masters:
            raise ValueError("EcclStore needs masters= or ECCL_MASTER (host:port,...)")
        scope = scope or default_scope()
        self.set_timeout(timeout)
        self._secret = secret
        # Finding a leader and every call but a wait: at most a minute (also for a store
        # whose waits have no timeout, kNoTimeout).
        t = timeout.total_seconds()
        self._client = _client or _eccl.StoreClient(
            masters, scope, secret, timeout_s=60.0 if t == 0 else min(max(t, 1.0), 60.0)
        )

    # -- what eccl adds ---------------------------------------------------------------

    @property
    def client(self) -> _eccl.StoreClient:
        return self._client

    @property
    def scope(self) -> str:
        return self._client.scope

    def set_ephemeral(self, key, value) -> None:
        """Sets a key that is removed when this store's session ends (its process dies
        or `close()` is called)."""
        self._client.set(_b(key), _b(value), True)

    def list(self, prefix="") -> dict[str, bytes]:
        return {k.decode(errors="replace"): v for k, v in self._client.list(_b(prefix))}

    def close(self) -> None:
        """Ends the session; when it is the scope's last, the scope's keys go."""
        self._client.close()

    # -- torch.distributed.Store ------------------------------------------------------

    def set(self, key, value) -> None:
        self._client.set(_b(key), _b(value))

    def get(self, key) -> bytes:
        return self._waiting(self._client.wait_get, [_b(key)], _seconds(None, self.timeout))[0]

    def add(self, key, value: int) -> int:
        return self._client.add(_b(key), int(value))

    def append(self, key, value) -> None:
        self._client.append(_b(key), _b(value))

    def compare_set(self, key, expected_value, desired_value) -> bytes:
        return self._client.compare_set(_b(key), _b(expected_value), _b(desired_value))

    def delete_key(self, key) -> bool:
        return self._client.delete_key(_b(key))

    def check(self, keys) -> bool:
        return self._client.check([_b(k) for k in keys])

    def wait(self, keys, timeout: Optional[timedelta] = None) -> None:
        self._waiting(self._client.wait, [_b(k) for k in keys], _seconds(timeout, self.timeout))

    def num_keys(self) -> int:
        return self._client.num_keys()

    def multi_get(self, keys) -> list[bytes]:
        return self._waiting(
            self._client.wait_get, [_b(k) for k in keys], _seconds(None, self.timeout)
        )

    @staticmethod
    def _waiting(fn, keys, seconds):
        # torch's stores raise DistStoreError (a RuntimeError) when a wait times out, and
        # torch's own callers catch that.
        try:
            return fn(keys, seconds)
        except eccl.EcclTimeoutError as e:
            raise dist.DistStoreError(str(e)) from e

    def multi_set(self, keys, values) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        self._client.multi_set([(_b(k), _b(v)) for k, v in zip(keys, values)])

    def list_keys(self) -> list[str]:
        return list(self.list(""))

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "EcclStore":
        return EcclStore(self._client.masters, self.scope, self._secret, self.timeout)


def _eccl_rendezvous_handler(url: str, timeout: timedelta = DEFAULT_TIMEOUT, **kwargs):
    """`init_process_group(init_method="eccl://HOST:PORT[,HOST:PORT...]/SCOPE?rank=R&
    world_size=N")`: the store is eccl's; rank and world size come from the URL or from
    `RANK`/`WORLD_SIZE`."""
    u = urlparse(url)
    q = parse_qs(u.query)

    def pick(name, env):
        if name in q:
            return int(q[name][0])
        if name in kwargs and kwargs[name] is not None and kwargs[name] >= 0:
            return int(kwargs[name])
        if env in os.environ:
            return int(os.environ[env])
        raise ValueError(f"{url}: no {name} (in the URL, the call, or {env})")

    rank, world_size = pick("rank", "RANK"), pick("world_size", "WORLD_SIZE")
    scope = u.path.strip("/") or None
    store = EcclStore(u.netloc, scope, timeout=timeout)
    yield (store, rank, world_size)
    raise RuntimeError("eccl:// rendezvous handler is not reentrant")


def register() -> None:
    """Registers the `eccl://` init method (idempotent)."""
    try:
        dist.register_rendezvous_handler("eccl", _eccl_rendezvous_handler)
    except RuntimeError:
        pass  # registered already


# `import eccl.store` is enough for `init_method="eccl://..."`.
register()
