#!/usr/bin/env python3
"""A sharded ring (one ring per primary, ``tdstore.ShardedRing``) against one ring on one node (issue #29).

Starts a private three-primary Redis Cluster on loopback and runs two rows, one function each:

- ``sample``: ``sample(256)`` of a full ring of ``--count`` rows, uniform and prioritized, on a
  one-node ring (a cluster store in one slot) and on a sharded ring over the three primaries,
  interleaved; medians and the sharded / one-node ratio.
- ``writers``: ``--writers`` processes extend a sharded ring for ``--seconds``; each primary's
  share of the script time (``INFO commandstats``: ``evalsha`` usec, the delta over the run).

Usage::

    python -m tools.sharded_bench [--count 100000] [--reps 30] [--writers 4] [--seconds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, ShardedRing
from tdstore.cluster_server import EmbeddedCluster
from tools._probes import raw_commandstats


def script_usec(client: Any) -> int:
    """Microseconds the server spent in scripts (``EVALSHA`` and ``EVAL``) since it started (``INFO commandstats``)."""
    stats = raw_commandstats(client)
    return sum(int(v.get("usec", 0)) for k, v in stats.items() if k in ("evalsha", "eval"))


def rows(n: int, start: int = 0) -> TensorDict:
    t = torch.arange(start, start + n)
    return TensorDict(obs=torch.randn(n, 64), action=t % 7, reward=t.float(), batch_size=[n])


def fill(store: Any, count: int) -> None:
    for start in range(0, count, 1000):
        store.extend(rows(min(1000, count - start), start))


def sample_row(cluster: EmbeddedCluster, count: int, reps: int) -> dict[str, Any]:
    """sample(256), uniform and prioritized, one-node ring vs sharded ring: medians (ms) and ratios."""
    one = LazyStackedTensorDictStore(count=count, url=cluster.url, prefix="bench-sharded")
    sharded = ShardedRing(count=count, url=cluster.url, prefix="bench-sharded")
    out: dict[str, Any] = {}
    try:
        for s in (one, sharded):
            fill(s, count)
        gen = torch.Generator().manual_seed(0)
        for kind in ("uniform", "prioritized"):
            if kind == "prioritized":
                for s in (one, sharded):
                    s.enable_priorities(alpha=0.6)
            times: dict[str, list[float]] = {"one": [], "sharded": []}
            for _ in range(reps):
                for name, s in (("one", one), ("sharded", sharded)):
                    t0 = time.perf_counter()
                    s.sample(256, gen, prioritized=kind == "prioritized")
                    times[name].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            out[kind] = {"one_node_ms": med["one"], "sharded_ms": med["sharded"], "ratio": med["sharded"] / med["one"]}
    finally:
        one.clear_redis()
        sharded.clear_redis()
    return out


def _writer(url: str, td_id: str, seconds: float, batch: int) -> None:
    store = ShardedRing.from_store(url=url, prefix="bench-sharded", td_id=td_id)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        store.extend(rows(batch, i))
        i += batch


def writers_row(cluster: EmbeddedCluster, count: int, writers: int, seconds: float, batch: int = 32) -> dict[str, Any]:
    """``writers`` processes extend one sharded ring: each primary's share of the script time over the run."""
    store = ShardedRing(count=count, url=cluster.url, prefix="bench-sharded")
    store.extend(rows(batch))  # the keys exist before the writers start
    try:
        clients = [cluster.node_client(i) for i in range(len(cluster.ports))]
        before = [script_usec(c) for c in clients]
        ctx = mp.get_context("spawn")  # not fork: this process runs shard threads
        procs = [ctx.Process(target=_writer, args=(cluster.url, store.td_id, seconds, batch)) for _ in range(writers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        usec = [script_usec(c) - b for c, b in zip(clients, before)]
        for c in clients:
            c.close()
        total = sum(usec) or 1
        return {
            "writers": writers,
            "rows_written": store.write_count,
            "script_usec_per_primary": usec,
            "share_per_primary": [u / total for u in usec],
            "worst_vs_third": max(abs(u / total - 1 / 3) * 3 for u in usec),
        }
    finally:
        store.clear_redis()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with EmbeddedCluster() as cluster:
        report = {
            "sample": sample_row(cluster, args.count, args.reps),
            "writers": writers_row(cluster, args.count, args.writers, args.seconds),
        }
    for kind, r in report["sample"].items():
        print(
            f"sample(256) {kind:11s}: one node {r['one_node_ms']:.2f} ms, sharded over 3 {r['sharded_ms']:.2f} ms, ratio {r['ratio']:.2f}x"
        )
    w = report["writers"]
    shares = ", ".join(f"{s:.1%}" for s in w["share_per_primary"])
    print(
        f"{w['writers']} writer processes, {w['rows_written']} rows: script time per primary {shares} "
        f"(worst {w['worst_vs_third']:.0%} off a third)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
