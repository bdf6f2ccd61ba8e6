#!/usr/bin/env python3
"""Server time of a random batch read: how much of it the server itself spends (issue #6).

Uploads the benchmark's homogeneous stack (10,000 elements: obs f32[64], action f32[4],
reward f32[1], nested.b i64[3]) to a private redis-server, reads random batches of 256,
and reports the wall time per read beside the server's own time per call (``INFO
commandstats``, ``usec_per_call`` of ``EVALSHA``, reset before the reads), for
``store[idx]`` and for the ring buffer's ``sample(256)``.

Usage::

    python tools/batch_server_time.py [--binary /usr/bin/redis-server] [--reads 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer, find_redis_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=None, help="redis-server to start (default: find_redis_server())")
    ap.add_argument("--reads", type=int, default=50, help="batches read per measurement")
    ap.add_argument("--count", type=int, default=10_000)
    args = ap.parse_args()
    with EmbeddedServer(binary=args.binary or find_redis_server()) as srv:
        els = [TensorDict(obs=torch.randn(64), action=torch.randn(4), reward=torch.randn(1), nested=TensorDict(b=torch.arange(3))) for _ in range(args.count)]
        store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(els), url=srv.url)
        client = srv.client()
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(args.count, (256,), generator=gen) for _ in range(args.reads)]
        ring = LazyStackedTensorDictStore(url=srv.url, count=args.count)
        ring.extend(lazy_stack(els[: args.count // 2]))
        for label, call in (("store[idx], 256 random", lambda i: store[batches[i]]), ("ring.sample(256)", lambda i: ring.sample(256, gen))):
            for i in range(5):
                call(i)  # warm
            client.config_resetstat()
            t = time.perf_counter()
            for i in range(args.reads):
                call(i)
            wall = (time.perf_counter() - t) / args.reads * 1e3
            stats = client.info("commandstats")["cmdstat_evalsha"]
            print(f"{label:24s} wall {wall:6.2f} ms per read, server {stats['usec_per_call'] / 1000:6.2f} ms per call ({stats['calls']} calls)")


if __name__ == "__main__":
    main()
