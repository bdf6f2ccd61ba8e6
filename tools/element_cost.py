#!/usr/bin/env python3
"""Element reads and writes timed back to back: what a heterogeneous key costs over homogeneous ones (issue #6).

``python -m tools.bench`` runs its contenders interleaved, so each call starts after another
client's; this times tdstore alone, one call after the other, on the benchmark's two
stacks (10,000 elements of obs f32[64], action f32[4], reward f32[1], nested.b i64[3],
plus tokens i64[1 + i % 17] in the heterogeneous one), and prints the medians of
``store[i].to_tensordict()`` and ``store[i] = td`` (same shapes as stored) with the
heterogeneous / homogeneous ratios.

Usage::

    python -m tools.element_cost [--binary /usr/bin/redis-server] [--calls 3000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer, find_redis_server
from tools.bench import workload as bench  # the benchmark's workload


def measure(url: str, het: bool, calls: int, count: int) -> tuple[float, float]:
    """Median microseconds of an element read and an element write."""
    store = LazyStackedTensorDictStore.from_lazy_stack(bench.make_stack(count, het, 0), url=url)
    gen = torch.Generator().manual_seed(1)
    n = min(500, count)
    values = [bench.make_element(i, het, gen, 1 + i % bench.TOKENS_PERIOD) for i in range(n)]
    for i in range(min(100, n)):  # warm
        store[i] = values[i]
        store[i].to_tensordict()
    reads, writes = [], []
    for k in range(calls):
        i = k % n
        t = time.perf_counter()
        store[i].to_tensordict()
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        store[i] = values[i]
        writes.append(time.perf_counter() - t)
    store.clear_redis()
    return statistics.median(reads) * 1e6, statistics.median(writes) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--binary", default=None, help="redis-server to start (default: /usr/bin/redis-server if present, else find_redis_server())"
    )
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--count", type=int, default=10_000)
    args = ap.parse_args()
    binary = args.binary or (bench.SYSTEM_REDIS if os.path.exists(bench.SYSTEM_REDIS) else find_redis_server())
    with EmbeddedServer(binary=binary) as srv:
        homog = measure(srv.url, False, args.calls, args.count)
        het = measure(srv.url, True, args.calls, args.count)
    print(f"homogeneous   read {homog[0]:7.1f} us   write {homog[1]:7.1f} us")
    print(f"heterogeneous read {het[0]:7.1f} us   write {het[1]:7.1f} us")
    print(f"heterogeneous / homogeneous: read {het[0] / homog[0]:.2f}x, write {het[1] / homog[1]:.2f}x")


if __name__ == "__main__":
    main()
