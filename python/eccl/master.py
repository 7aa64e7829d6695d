"""Masters as commands.

`eccl-master` (the package's console script, `cli` below): a master for a pip-installed
eccl, with the Rust binary's main flags and variables: one master, or one member of a
replicated cluster. It prints "eccl-master listening on ADDR" and serves until SIGINT or
SIGTERM. The cluster commands (`eccl-master cluster status|add|remove`), `--advertise`,
`--raft-listen` and `--store-job` are the Rust binary's (`target/release/eccl-master`,
docs/masters.md).

`python -m eccl.master` (`main` below): an eccl master in its own process (what
`Master.spawn()` runs). Reads the job secret from the first line of stdin (so that it
never shows in `ps`), prints "eccl master listening on ADDR" and serves until stdin
closes."""

import argparse
import os
import signal
import sys
import threading
from typing import List, Optional

from . import Master, _eccl


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m eccl.master")
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--lease-ms", type=int, default=800)
    p.add_argument("--heartbeat-ms", type=int, default=200)
    a = p.parse_args()
    secret = sys.stdin.readline().strip()
    if not secret:
        print("eccl master: no job secret on the first line of stdin", flush=True)
        sys.exit(2)
    m = Master(a.listen, secret, lease_ms=a.lease_ms, heartbeat_ms=a.heartbeat_ms)
    print(f"eccl master listening on {m.addr}", flush=True)
    sys.stdin.read()
    m.shutdown()


def cli(argv: Optional[List[str]] = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="eccl-master",
        description="An eccl master: one, or a member of a replicated cluster. "
                    "docs/configuration.md lists the flags and variables.")
    p.add_argument("--listen", default=env("ECCL_MASTER_LISTEN", "127.0.0.1:48148"),
                   help="client listener: peers, stores (ECCL_MASTER_LISTEN)")
    p.add_argument("--secret-file", default=env("ECCL_SECRET_FILE"),
                   help="the job secret's file, created with a fresh secret if missing "
                        "(ECCL_SECRET_FILE, default ~/.eccl/secret; ECCL_SECRET wins)")
    p.add_argument("--node-id", type=int, default=1, help="this master's raft node id")
    p.add_argument("--masters", help="every master of a cluster, id=CLIENT/RAFT,...")
    p.add_argument("--cluster-secret-file", default=env("ECCL_CLUSTER_SECRET_FILE"),
                   help="the secret masters share (ECCL_CLUSTER_SECRET_FILE)")
    p.add_argument("--data-dir", default=env("ECCL_MASTER_DATA_DIR"),
                   help="keep the raft log, vote and snapshots here (ECCL_MASTER_DATA_DIR)")
    p.add_argument("--join", action="store_true",
                   help="start as a new member of a running cluster")
    p.add_argument("--lease-ms", type=int, default=None,
                   help="a peer silent this long is evicted (ECCL_LEASE_MS, default 800)")
    p.add_argument("--heartbeat-ms", type=int, default=None,
                   help="how often peers renew their lease (ECCL_HEARTBEAT_MS, default 200)")
    a = p.parse_args(argv)
    if a.masters and not a.cluster_secret_file:
        p.error("--masters needs --cluster-secret-file (or ECCL_CLUSTER_SECRET_FILE)")
    try:
        secret = env("ECCL_SECRET") or _eccl.load_or_create_secret_file(a.secret_file)
        cluster = (_eccl.read_secret_file(a.cluster_secret_file)
                   if a.cluster_secret_file else None)
        m = Master(a.listen, secret, lease_ms=a.lease_ms, heartbeat_ms=a.heartbeat_ms,
                   node_id=a.node_id, masters=a.masters, cluster_secret=cluster,
                   data_dir=a.data_dir, join=a.join)
    except Exception as e:  # noqa: BLE001 - a command reports, it does not trace back
        print(f"eccl-master: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"eccl-master listening on {m.addr}", flush=True)
    while not stop.wait(0.5):
        pass
    m.shutdown()
    return 0


if __name__ == "__main__":
    main()
