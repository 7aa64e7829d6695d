"""torchrun's rendezvous on eccl's masters: `--rdzv-backend=eccl`.

    torchrun --nnodes=2:3 --nproc-per-node=1 --rdzv-backend=eccl \\
        --rdzv-endpoint=m1:29400,m2:29400,m3:29400 --rdzv-id=job train.py

The handler is torch's own `DynamicRendezvousHandler` (min/max nodes, last call,
keep-alives, `--max-restarts` are torch's) over `EcclRendezvousBackend`, whose state is a
record in the masters' replicated log, reached through `eccl.store.EcclStore` in the
scope `--rdzv-id`. No agent hosts the rendezvous, so losing any node, the first included,
leaves the others able to meet again; with three masters, losing one master changes
nothing but a short delay.

What eccl adds to torch's semantics, from the masters' leases (each agent's session has
one, and holds an ephemeral key that names it while it lives):
- a node whose agent died is dropped from the rendezvous as soon as its session ends
  (its connection closes, or its lease lapses if it hangs), not after 3 missed 5-second
  keep-alives;
- a round that has its minimum closes as soon as every live agent has joined, instead of
  waiting out the 30-second last call for nodes that cannot come.

Credentials: `ECCL_SECRET` / `ECCL_SECRET_FILE`, or `--rdzv-conf secret_file=PATH`.
Other `--rdzv-conf` keys: `read_timeout` (seconds to find a master leader, and the most
any store call waits; default 30) and torch's own (`join_timeout`, `last_call_timeout`,
`close_timeout`, `keep_alive_interval`, ...).
"""

from __future__ import annotations

import math
import os
import pickle
import socket
from datetime import datetime, timedelta, timezone
from typing import Optional

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    _RendezvousState,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler as _torch_create_handler,
)

import eccl

from .store import EcclStore

_STATE_KEY = "rdzv/state"
_AGENTS = "rdzv/agent/"
_LONG_AGO = datetime(1970, 1, 2, tzinfo=timezone.utc)


def _agent_key(addr: str, pid: int) -> str:
    return f"{_AGENTS}{addr}/{pid}"


class EcclRendezvousBackend(RendezvousBackend):
    """The rendezvous state as one key of an `EcclStore`, changed by compare-and-set; the
    token is the stored bytes (as torch's c10d backend does)."""

    def __init__(self, store: EcclStore, node_addr: Optional[str] = None):
        self._store = store
        self._node_addr = node_addr or socket.getfqdn()
        # Announce this agent (its node descriptor's address and pid) while it lives.
        self._call(store.set_ephemeral, _agent_key(self._node_addr, os.getpid()), b"1")

    @property
    def name(self) -> str:
        return "eccl"

    @property
    def store(self) -> EcclStore:
        return self._store

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except eccl.MasterUnavailableError as e:
            why = "authentication failed (wrong job secret?)" if "auth" in str(e).lower() else str(e)
            raise RendezvousConnectionError(f"eccl rendezvous: {why}") from e
        except eccl.EcclError as e:
            raise RendezvousConnectionError(f"eccl rendezvous: {e}") from e

    def _live_agents(self) -> set[tuple[str, int]]:
        live = set()
        for k in self._call(self._store.list, _AGENTS):
            addr, _, pid = k[len(_AGENTS):].rpartition("/")
            try:
                live.add((addr, int(pid)))
            except ValueError:
                pass
        return live

    def _view(self, raw: bytes) -> bytes:
        """The state as torch should see it, given who the masters know to be alive."""
        try:
            state = pickle.loads(raw)
        except Exception:  # noqa: BLE001
            return raw  # opaque to us: torch's handler judges it
        if not isinstance(state, _RendezvousState):
            return raw
        live = self._live_agents()
        changed = False
        for node in list(getattr(state, "last_heartbeats", {})):
            if (node.addr, node.pid) not in live and state.last_heartbeats[node] > _LONG_AGO:
                # Its session ended: torch's own sanitizing drops it now.
                state.last_heartbeats[node] = _LONG_AGO
                changed = True
        participants = {(n.addr, n.pid) for n in getattr(state, "participants", {})}
        if (
            not state.complete
            and not state.closed
            and state.deadline is not None
            and live
            and live <= participants
        ):
            # Everyone alive has joined: the last call has no one left to wait for.
            now = datetime.now(timezone.utc) - timedelta(microseconds=1)
            if state.deadline > now:
                state.deadline = now
                changed = True
        return pickle.dumps(state) if changed else raw

    def get_state(self) -> tuple[bytes, Token] | None:
        got = self._call(self._store.client.get, [_STATE_KEY.encode()])[0]
        if got is None:
            return None
        return self._view(got), got

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        expected = token if isinstance(token, bytes) else b""
        if token is not None and not isinstance(token, bytes):
            now = self.get_state()
            return (now[0], now[1], False) if now is not None else None
        held = self._call(self._store.compare_set, _STATE_KEY, expected, state)
        if expected == b"" and held != state:
            # "Only if absent" found a state already there.
            return self._view(held), held, False
        return self._view(held), held, held == state


def create_backend(params: RendezvousParameters) -> tuple[EcclRendezvousBackend, EcclStore]:
    secret = None
    secret_file = params.get("secret_file")
    if secret_file:
        secret = eccl._eccl.read_secret_file(secret_file)
    # torch's c10d backend takes its store's timeout from `read_timeout`. `timeout`,
    # which torchrun always sets (900 s by default) for its static and etcd backends,
    # is not this one's: a master that cannot be reached is reported within
    # `read_timeout`, and a store call waits at most that long.
    read_timeout = float(params.get("read_timeout", 30))
    if not (math.isfinite(read_timeout) and read_timeout > 0):
        raise ValueError(f"--rdzv-conf read_timeout must be a positive number of seconds, "
                         f"not {params.get('read_timeout')!r}")
    timeout = timedelta(seconds=read_timeout)
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint must name the eccl master(s): host:port[,host:port...]")
    try:
        store = EcclStore(params.endpoint, params.run_id, secret, timeout)
    except eccl.MasterUnavailableError as e:
        why = (
            "authentication failed: the job secret is not the masters'"
            if "auth" in str(e).lower()
            else f"no eccl master reachable at {params.endpoint}: {e}"
        )
        raise RendezvousConnectionError(why) from e
    except eccl.EcclError as e:
        raise RendezvousConnectionError(f"eccl rendezvous at {params.endpoint}: {e}") from e
    return EcclRendezvousBackend(store, params.local_addr), store


def create_handler(params: RendezvousParameters):
    """torchrun's handler for `--rdzv-backend=eccl`."""
    backend, store = create_backend(params)
    # torch's default shares one TCPStore, hosted by the first round's rank-0 agent, with
    # the workers of every later round, and publishes its address only in the first
    # round: a node that joins later waits for an address that never comes (the c10d
    # backend's "replacement makes all agents exit" above). Taking torch's other path,
    # the round's rank-0 agent publishes a fresh address in each round and the workers'
    # rank 0 hosts their store, so newcomers join. The rendezvous itself stays in the
    # masters.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # The workers (which inherit the agent's environment) use the same masters for their
    # "eccl" process group, instead of a master inside the workers' rank 0: a node's
    # death then takes no master with it, and survivors abort and restart at once.
    os.environ.setdefault("ECCL_MASTER", params.endpoint)
    if params.get("secret_file"):
        os.environ.setdefault("ECCL_SECRET_FILE", params.get("secret_file"))
    return _torch_create_handler(store, backend, params)


def handler_creator():
    """The `torchrun.handlers` entry point: torch calls this to get the creator."""
    return create_handler
