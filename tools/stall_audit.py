"""How long each call holds the server: the slowest command SLOWLOG records, per operation.

Redis runs one script at a time, so a script's server time is how long every other client
waits. This tool builds a store of ``--segments`` segments of one element each (a row block of
three small keys and one heterogeneous key), runs every operation whose work grows with the
store (upload commit, expire, persist, reads and writes of every element, copy, ring extend and
sample, priorities, schema changes, clear), and prints for each the slowest command the server
logged (``SLOWLOG``: exact server time, no client noise) and the call's wall time. With
``--ring N`` it also times ``enable_priorities`` on a filled ring of N slots, with a PING loop
on its own connection measuring the longest gap. Figures: ``lua/README.md`` (Worst cases).

    python -m tools.stall_audit [--segments 4096] [--ring 10000000] [--url redis://...]
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._engine import whole_store as _whole_store
from tdstore._format.keys import StoreKeys
from tdstore.server import server_or_url


def slowest(client: redis.Redis, label: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` and print the slowest command the server logged meanwhile (over 1 ms)."""
    client.slowlog_reset()
    t0 = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    log = client.slowlog_get(100_000)
    worst = max(log, key=lambda e: e["duration"], default=None)
    ms, cmd = (worst["duration"] / 1000, bytes(worst["command"][:24])) if worst else (0.0, b"-")
    print(f"{label:46s} slowest {ms:9.1f} ms  {cmd!r:30s} wall {wall:6.2f} s", flush=True)
    return out


def audit_segments(url: str, client: redis.Redis, n: int) -> None:
    tags = torch.arange(n)
    rows = [
        TensorDict({"obs": torch.full((14,), float(i)), "a": tags[i], "b": tags[i].float(), "tok": torch.arange(1 + i % 5)}, [])
        for i in range(n)
    ]
    stack = lazy_stack(rows)
    store = slowest(client, "upload (commit.lua)", lambda: TensorDictStore.from_tensordict(stack, url=url, segment_bytes=64, td_id="audit"))
    print(f"  {store._engine.header.segments.n} segments, {len(store._engine.header.leaves)} keys", flush=True)
    slowest(client, "expire (expire.lua)", lambda: store.expire(3600))
    slowest(client, "persist (expire.lua)", lambda: store.persist())
    slowest(client, "read every element (read.lua)", lambda: store[:])
    slowest(client, "write every element (write.lua)", lambda: store.__setitem__(slice(None), stack))
    engine = store._engine
    try:
        slowest(client, "copy (copy.lua)", lambda: _whole_store.copy_to(engine, StoreKeys(engine.keys.prefix, "audit-copy")))
    except ValueError as err:  # above copy.lua's bound: refused before anything is sent
        print(f"{'copy (copy.lua)':46s} refused: {str(err)[:90]}...", flush=True)
    copy = TensorDictStore.from_tensordict(TensorDict(x=torch.zeros(15, 1 << 19), batch_size=[15]), url=url, td_id="audit-big")
    slowest(client, "dense clone() of 30 MiB (copy.lua, its bound)", lambda: copy.clone().clear_redis())
    slowest(client, f"ring sample of {n} rows (read.lua)", lambda: store.sample(n))
    slowest(client, f"ring extend of {n} rows (write.lua W)", lambda: store.extend(stack))
    slowest(client, "enable_priorities (tree_build.lua)", lambda: store.enable_priorities(1.0))
    slowest(client, f"update_priority of {n} slots (priority.lua)", lambda: store.update_priority(torch.arange(n), 2.0))
    slowest(client, f"prioritized sample of {n} rows", lambda: store.sample(n, prioritized=True))
    slowest(client, "dtype change of a key (write.lua)", lambda: store.set("a", torch.zeros(n, dtype=torch.float64)))
    slowest(client, "a key turning heterogeneous (write.lua C)", lambda: store.__setitem__(0, TensorDict({"obs": torch.zeros(3)}, [])))
    slowest(client, "delete a key (write.lua D)", lambda: store.__delitem__("tok"))
    slowest(client, "clear_redis (clear.lua)", lambda: store.clear_redis())
    copy.clear_redis()


def audit_ring(url: str, client: redis.Redis, count: int) -> None:
    store = LazyStackedTensorDictStore(count=count, url=url, td_id="audit-ring")
    store.extend(TensorDict(x=torch.zeros(1, dtype=torch.uint8), batch_size=[1]))
    client.hset(store._engine.keys.meta, "rw", count)  # every slot written, as far as the tree is concerned
    store._engine.set_header(store._engine.fetch_header())
    gaps: list[float] = [0.0]
    stop = threading.Event()

    def ping() -> None:
        own = redis.Redis.from_url(url)
        last = time.perf_counter()
        while not stop.is_set():
            own.ping()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ping, daemon=True)
    thread.start()
    slowest(client, f"enable_priorities on {count} slots", lambda: store.enable_priorities(1.0, max_times_sampled=1000))
    stop.set()
    thread.join()
    print(f"  longest PING gap {max(gaps) * 1000:.1f} ms (includes the client's own scheduling)")
    store.clear_redis()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=4096, help="segments of the audited store (0: skip)")
    ap.add_argument("--ring", type=int, default=0, help="also time enable_priorities on a filled ring of this many slots")
    ap.add_argument("--url", default=None, help="an existing server (default: a private redis-server)")
    ap.add_argument("--binary", default=None)
    args = ap.parse_args()
    with server_or_url(args.url, args.binary) as (url, _):
        client = redis.Redis.from_url(url)
        old = client.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
        client.config_set("slowlog-log-slower-than", 1000)
        client.config_set("slowlog-max-len", 100_000)
        try:
            if args.segments:
                audit_segments(url, client, args.segments)
            if args.ring:
                audit_ring(url, client, args.ring)
        finally:
            client.config_set("slowlog-log-slower-than", old)


if __name__ == "__main__":
    main()
