#!/usr/bin/env python3
"""Server time per ring call, to measure what counting ``stats()`` costs (issue 42).

The scripts count each call's work in the store's stats hash in the same call (``lua/_lib.lua``
``tds_stat``); this measures the server's own time per call (``INFO commandstats``: ``EVALSHA`` for a
script, ``EXEC`` for a transaction, which includes its commands) of ``extend`` (32 rows, sent direct:
``lua/direct.lua`` in a transaction; into a ring not yet full, and into a full one, whose overwritten rows are
counted, sampled or not, from the sampled-rows bitmap), ``sample(256)`` of a half-full ring (``read.lua``) and of a full
one (a transaction of ``GETRANGE``s), ``pop(32)`` and a leased ``pop(32)`` then ``ack``, on a private
redis-server. Run it on two checkouts to compare (``PYTHONPATH=<checkout>``): the figure is the median
over rounds of the mean server time per call in a round.

Usage::

    PYTHONPATH=. python -m tools.stats_cost [--rounds 15] [--calls 200] [--distinct]

``--distinct`` turns distinct-row tracking on for the rings (``track_distinct``: off by default, for its cost).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import redis
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer


def _server_usec(client: redis.Redis) -> float:
    stats = client.info("commandstats")
    return sum(float(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in ("evalsha", "exec"))


def _rows(n: int) -> TensorDict:
    return TensorDict(obs=torch.randn(n, 64), action=torch.randn(n, 4), reward=torch.randn(n, 1), batch_size=[n])


def measure(client: redis.Redis, call: Callable[[], object], rounds: int, calls: int) -> float:
    """Median over ``rounds`` of the server's microseconds per call of ``call``."""
    per = []
    for _ in range(rounds):
        before = _server_usec(client)
        for _ in range(calls):
            call()
        per.append((_server_usec(client) - before) / calls)
    return statistics.median(per)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--distinct", action="store_true", help="track distinct rows sampled (the sampled-rows bitmap)")
    args = parser.parse_args()
    with EmbeddedServer() as srv:
        client = srv.client()
        half = LazyStackedTensorDictStore(count=10**6, url=srv.url)
        half.extend(_rows(4096))
        full = LazyStackedTensorDictStore(count=4096, url=srv.url)
        full.extend(_rows(4096))
        queue = LazyStackedTensorDictStore(count=10**6, url=srv.url)
        if args.distinct:
            for ring in (half, full, queue):
                ring.track_distinct()
        batch = _rows(32)
        for _ in range(3):  # scripts loaded, headers cached, the full ring known full
            half.sample(256), full.sample(256), queue.extend(batch)
        for _ in range(8):
            queue.extend(_rows(4096))
        pops = max(1, 32768 // 2 // 32 // args.rounds)  # half the items each for the plain and the leased pops

        def leased() -> None:
            queue.ack(queue.pop(32, lease=600))

        figures = {
            "extend(32)": measure(client, lambda: half.extend(batch), args.rounds, args.calls),
            "extend(32) full (overwrites)": measure(client, lambda: full.extend(batch), args.rounds, args.calls),
            "sample(256) half full (read.lua)": measure(client, lambda: half.sample(256), args.rounds, args.calls),
            "sample(256) full (transaction)": measure(client, lambda: full.sample(256), args.rounds, args.calls),
            "pop(32)": measure(client, lambda: queue.pop(32), args.rounds, pops),
            "pop(32, lease) + ack": measure(client, leased, args.rounds, pops),
        }
        for name, usec in figures.items():
            print(f"{name:36s} {usec:8.1f} us server time per call")
        # the same sample counted and not (a read-only handle's calls are not counted), interleaved round by
        # round on one server: the counting's own cost, without the noise between two runs
        for name, ring in (("sample(256) half full", half), ("sample(256) full", full)):
            reader = LazyStackedTensorDictStore(count=ring.capacity, td_id=ring.td_id, url=srv.url, readonly=True)
            reader.sample(256)
            ratios = []
            for _ in range(args.rounds):
                counted = measure(client, lambda: ring.sample(256), 1, args.calls)  # noqa: B023 (called at once)
                bare = measure(client, lambda: reader.sample(256), 1, args.calls)  # noqa: B023
                ratios.append(counted / bare)
            print(f"{name:36s} counted / not counted: {statistics.median(ratios):.3f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
