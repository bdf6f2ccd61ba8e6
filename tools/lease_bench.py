#!/usr/bin/env python3
"""What a lease costs the server: leased pops and acks against plain pops, and the worst reclaim.

On one private redis-server, a ring of 200,000 slots holding 8 float32 per item: the server
time (``INFO commandstats``, usec per ``EVALSHA``) of

* a plain pop of n items (once the store has had a leased pop, plain pops go through the lease
  table too, settling at once),
* a leased pop of n items, and the ``ack`` of it,
* the worst pop the reclaim bound allows: 64 expired leases of 16 items each (1,024 items)
  reclaimed and handed out in one call (``lua/_lease.lua``).

Minimum and median over ``--reps`` runs, in milliseconds.

Usage::

    python -m tools.lease_bench [--reps 5] [--binary /usr/bin/redis-server]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer
from tools._probes import usec_per_call

COUNT = 200_000


def server_ms(client: Any, fn: Any) -> tuple[float, Any]:
    """The server time of the one EVALSHA ``fn`` sends, and what ``fn`` returned."""
    client.config_resetstat()
    out = fn()
    return usec_per_call(client) / 1000, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--binary", default=None, help="the redis-server to run (default: tdstore's choice)")
    args = parser.parse_args()
    with EmbeddedServer(binary=args.binary) as srv:
        client = srv.client()
        store = LazyStackedTensorDictStore(count=COUNT, url=srv.url, prefix="lease-bench")
        for _ in range(0, COUNT, 10_000):
            store.extend(TensorDict(obs=torch.randn(10_000, 8), batch_size=[10_000]))
        times: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for n in (32, 1000):
                times.setdefault(f"plain pop({n})", []).append(server_ms(client, lambda n=n: store.pop(n))[0])
                took, got = server_ms(client, lambda n=n: store.pop(n, lease=600))
                times.setdefault(f"leased pop({n})", []).append(took)
                times.setdefault(f"ack({n})", []).append(server_ms(client, lambda got=got: store.ack(got))[0])
            leases = [store.pop(16, lease=600) for _ in range(64)]  # then run out at once (deadlines moved back)
            client.zadd(store._engine.keys.lease_keys[1], {g.receipt.id: 0 for g in leases})
            took, got = server_ms(client, lambda: store.pop(1024, lease=600))
            assert len(got.write_numbers) == 1024 and bool(got.redelivered.all())
            times.setdefault("pop(1024) reclaiming 64 leases", []).append(took)
            store.ack(got)
        print(f"server {client.info('server')['redis_version']}, ring of {COUNT:,} slots, {args.reps} reps")
        print(f"{'call':<34} | min ms | median ms")
        for name, values in times.items():
            print(f"{name:<34} | {min(values):6.2f} | {statistics.median(values):9.2f}")
        store.clear_redis()


if __name__ == "__main__":
    main()
