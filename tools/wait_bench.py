#!/usr/bin/env python3
"""How a blocked learner waits: tdstore's Pub/Sub wake-up against polling the ring's length.

A learner process blocks until an actor (another process) extends the ring. Two ways, in
one run on one private redis-server:

* ``pubsub``: ``store.wait_for(written=n)`` (what ``sample(min_size=...)``, the rate limiter
  and ``pop`` use): subscribe to the store's channel, retry when a ring write publishes;
* ``poll 1 ms``: ``len(store.written)`` in a loop with a 1 ms sleep, the way a learner
  without it polls.

For each: the wake-up latency (from the actor calling ``extend`` to the learner's call
returning, the write's own round trip included; both processes read one
``time.perf_counter`` clock) and the commands the
server received while the learner waited idle for ``--idle`` seconds (``INFO
commandstats``). Medians over ``--reps`` wake-ups.

Usage::

    python -m tools.wait_bench [--reps 30] [--idle 1.0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer
from tools._probes import total_calls


def _learner(url: str, td_id: str, mode: str, reps: int, ready: Any, out: Any) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, td_id=td_id, prefix="wait-bench")
    for k in range(1, reps + 1):
        ready.put(k)
        if mode == "pubsub":
            store.wait_for(write_count=k, timeout=60)
        else:
            while store.write_count < k:
                time.sleep(0.001)
        out.put(time.perf_counter())


def run(url: str, mode: str, reps: int, idle: float, client: Any) -> dict[str, float]:
    store = LazyStackedTensorDictStore(count=1000, url=url, prefix="wait-bench")
    one = TensorDict(x=torch.zeros(1, 4), batch_size=[1])
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_learner, args=(url, store.td_id, mode, reps, ready, out))
    proc.start()
    lat = []
    idle_cmds = 0.0
    for k in range(1, reps + 1):
        ready.get(timeout=120)
        if k == 1:  # the learner is waiting: count what the server receives meanwhile
            time.sleep(idle)  # a measuring interval, not a synchronisation
            before = total_calls(client)
            time.sleep(idle)
            idle_cmds = (total_calls(client) - before - 1) / idle
        else:
            time.sleep(0.01)
        t = time.perf_counter()  # before the write: a poller may see it before the writer's reply arrives
        store.extend(one)
        lat.append(out.get(timeout=120) - t)
    proc.join(timeout=60)
    store.clear_redis()
    store.close()
    return {"wake_ms": statistics.median(lat) * 1e3, "wake_max_ms": max(lat) * 1e3, "idle_commands_per_s": idle_cmds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--idle", type=float, default=1.0, help="seconds the learner waits idle while commands are counted")
    ap.add_argument("--binary", default=None)
    args = ap.parse_args()
    with EmbeddedServer(binary=args.binary) as srv:
        client = srv.client()
        print(f"redis-server {srv.version}; {args.reps} wake-ups each")
        print(f"{'mode':<10} | {'wake-up ms (median)':>19} | {'max ms':>7} | {'commands/s while idle':>21}")
        for mode in ("pubsub", "poll 1 ms"):
            r = run(srv.url, "pubsub" if mode == "pubsub" else "poll", args.reps, args.idle, client)
            print(f"{mode:<10} | {r['wake_ms']:>19.3f} | {r['wake_max_ms']:>7.3f} | {r['idle_commands_per_s']:>21.0f}")


if __name__ == "__main__":
    main()
