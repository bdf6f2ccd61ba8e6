#!/usr/bin/env python3
"""What rollouts (``_ring.rollouts``: versions, groups, token budgets) cost the server, and their worst calls.

Server time of each ``EVALSHA``, read exactly from ``SLOWLOG`` (threshold 0), on one private redis-server:

* the same ring calls on a plain ring and on a ring with rollouts, interleaved call by call (A B, B A) so
  that the machine's load falls on both alike: ``extend`` of 8 ragged rows (plain; ``version=``; one row
  of a group of 8 at a time), ``sample(32)`` (uniform, through ``read.lua`` on a ring not yet full; with
  ``max_staleness``), ``pop(8)`` (plain; with ``max_staleness``; ``groups=1`` of 8; ``token_budget``);
  medians and ratios;
* the bounded worst cases (the project's standard: ~50 ms a call): a pop that meets 2,048 stale queue
  entries (its scan bound), ``set_version`` turning the index on over 4,096 rows written before (its
  backfill bound: 4,096), a sample of 1,024 rows by staleness, a group of 256 rows completing in one call.

Usage::

    python -m tools.rollouts_cost [--binary /usr/bin/redis-server] [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import redis
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer, find_redis_server


def rows(n: int, lens: int = 64, ragged: bool = False) -> list[TensorDict]:
    """``n`` rollouts of ``lens`` tokens (``ragged``: 0 to 6 more, so the key is heterogeneous)."""
    return [TensorDict({"tokens": torch.arange(lens + (k % 7 if ragged else 0)), "reward": torch.tensor(float(k))}, []) for k in range(n)]


def server_us(client: redis.Redis, fn: Callable[[], Any]) -> float:
    """Server time (us) of the EVALSHAs ``fn`` sent (SLOWLOG, threshold 0), summed."""
    client.slowlog_reset()
    fn()
    entries = client.slowlog_get(128)
    return float(sum(e["duration"] for e in entries if str(e["command"]).lower().startswith(("evalsha", "b'evalsha"))))


def paired(client: redis.Redis, a: Callable[[], Any], b: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Medians of a and b's server time, interleaved A B / B A."""
    ta, tb = [], []
    for k in range(calls):
        if k % 2:
            ta.append(server_us(client, a))
            tb.append(server_us(client, b))
        else:
            tb.append(server_us(client, b))
            ta.append(server_us(client, a))
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=None)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    with EmbeddedServer(binary=args.binary or find_redis_server()) as srv:
        client = srv.client()
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 1024)
        big = 1 << 16  # homogeneous rows (a heterogeneous ring's write shifts the later offsets: O(count), whatever the index)
        plain = LazyStackedTensorDictStore(count=big, url=srv.url, prefix="cost")
        ro = LazyStackedTensorDictStore(count=big, url=srv.url, prefix="cost")
        ro.set_version(1)
        batch = rows(8)
        plain.extend(batch)
        ro.extend(batch, version=1)
        print(f"redis-server {client.info()['redis_version']}; median server time per call, {args.calls} interleaved pairs")
        gid = iter(range(10**9))

        def grouped() -> None:
            g = next(gid)
            for k in range(8):
                ro.extend(batch[k : k + 1], version=1, group=f"g{g}", group_size=8)

        rp = LazyStackedTensorDictStore(count=4096, url=srv.url, prefix="cost")
        rr = LazyStackedTensorDictStore(count=4096, url=srv.url, prefix="cost")
        rr.set_version(1)
        for s in (rp, rr):
            s.extend(rows(8, ragged=True))
        figures = [
            ("extend 8 rows", lambda: plain.extend(batch), lambda: ro.extend(batch, version=1)),
            ("extend 8 x 1 row of a group of 8", lambda: [plain.extend(batch[k : k + 1]) for k in range(8)], grouped),
            ("sample(32)", lambda: plain.sample(32), lambda: ro.sample(32, max_staleness=1)),
            ("sample(4 groups of 8)", lambda: plain.sample(32), lambda: ro.sample(1, groups=4)),
            ("pop(8)", lambda: plain.pop(8), lambda: ro.pop(8, max_staleness=1)),
            ("pop(groups=1) of 8", lambda: plain.pop(8), lambda: ro.pop(groups=1)),
            ("pop(8) vs pop(token_budget=600), ragged", lambda: rp.pop(8), lambda: rr.pop(token_budget=600, length_key="tokens")),
        ]
        for name, a, b in figures:
            for _ in range(3 * args.calls):  # enough to pop
                plain.extend(batch)
                ro.extend(batch, version=1)
                if "ragged" in name:
                    rp.extend(rows(8, ragged=True))
                    rr.extend(rows(8, ragged=True))
            grouped_fill = name.startswith(("pop(groups", "sample(4"))
            if grouped_fill:
                for _ in range(args.calls + 2):
                    grouped()
            pa, pb = paired(client, a, b, args.calls)
            print(f"  {name:36s} plain {pa:8.1f} us   rollouts {pb:8.1f} us   ratio {pb / pa:5.2f}")

        print("worst cases (one call, server time):")
        w = LazyStackedTensorDictStore(count=1 << 16, url=srv.url, prefix="worst")
        for _ in range(4096 // 512):
            w.extend(rows(512, 4))
        ms = server_us(client, lambda: w.set_version(0)) / 1000
        print(f"  set_version over 4,096 rows written before (backfill bound): {ms:7.2f} ms")
        for _ in range(4096 // 512):
            w.extend(rows(512, 4), version=0)
        w.set_version(10)
        w.extend(rows(1, 4), version=10)

        def stale_pop() -> None:
            try:
                w.pop(8, max_staleness=0, timeout=0.0)
            except TimeoutError:  # 4,096 stale entries dropped, none taken yet: the next pop goes on
                pass

        before = w.stats()["stale"]
        ms = server_us(client, stale_pop) / 1000
        print(f"  pop dropping {w.stats()['stale'] - before} stale entries (scan bound 2,048): {ms:7.2f} ms")
        w.extend(rows(512, 4), version=10)
        ms, plain_ms = (
            server_us(client, lambda: w.sample(1024, max_staleness=0)) / 1000,
            server_us(client, lambda: plain.sample(1024)) / 1000,
        )
        print(f"  sample(1024, max_staleness=0): {ms:7.2f} ms (a plain ring's sample(1024): {plain_ms:.2f} ms)")
        w.extend(rows(255, 4), version=10, group="big", group_size=256)
        ms = server_us(client, lambda: w.extend(rows(1, 4), version=10, group="big", group_size=256)) / 1000
        print(f"  the call completing a group of 256 rows: {ms:7.2f} ms")
        print(f"  pop(groups=1) of 256 rows: {server_us(client, lambda: w.pop(groups=1)) / 1000:7.2f} ms")
        for s in (plain, ro, w, rp, rr):
            s.clear_redis()


if __name__ == "__main__":
    main()
