"""`python -m eccl.master`: an eccl master in its own process (what `Master.spawn()`
runs). Reads the job secret from the first line of stdin (so that it never shows in
`ps`), prints "eccl master listening on ADDR" and serves until stdin closes."""

import argparse
import sys

from . import Master


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


if __name__ == "__main__":
    main()
