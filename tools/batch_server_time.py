#!/usr/bin/env python3
"""Server time of a random batch read: how much of it the server itself spends (issue #6).

Uploads the benchmark's homogeneous stack (10,000 elements: obs f32[64], action f32[4],
reward f32[1], nested.b i64[3]) to a private redis-server, reads random batches of 256,
and reports the wall time per read beside the server's own time per call (``INFO
commandstats``: ``EVALSHA`` for a script, ``MULTI`` and ``EXEC`` for a transaction of plain
``GETRANGE``s, reset before the reads) and the server's CPU per read (``INFO cpu``, which also
counts reading and parsing the commands), for ``store[idx]`` and for the ring buffer's
``sample(256)`` (half full: ``read.lua`` draws among the written slots; full: the client maps
the draws to slots and reads them in a transaction).

With ``--reference`` it also times the reference ``tensordict.store`` on the same batches,
back to back, and tdstore's ``store[idx]`` right after each reference read: the benchmark
runs its contenders interleaved, and a call that follows another client's large pipeline
starts with the server's caches cold, which costs a short call relatively more.

With ``--alternatives`` it measures, with hand-written scripts on raw keys, the server time
of the ways a script could fetch 256 random rows of 300 bytes (the benchmark's row block):
one ``GETRANGE`` per row (what ``read.lua`` does), the whole 3 MB value read once with ``GET``
and cut in Lua, and a hash of rows read with one ``HMGET`` (with the hash's memory per row).

Usage::

    python -m tools.batch_server_time [--binary /usr/bin/redis-server] [--reads 50] [--reference] [--alternatives]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import redis
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer, find_redis_server
from tools._probes import raw_commandstats, server_cpu, usec_per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=None, help="redis-server to start (default: find_redis_server())")
    ap.add_argument("--reads", type=int, default=50, help="batches read per measurement")
    ap.add_argument("--count", type=int, default=10_000)
    ap.add_argument("--reference", action="store_true", help="also time the reference tensordict.store on the same batches")
    ap.add_argument("--alternatives", action="store_true", help="also measure other ways a script could fetch the rows")
    args = ap.parse_args()
    with EmbeddedServer(binary=args.binary or find_redis_server()) as srv:
        els = [
            TensorDict(obs=torch.randn(64), action=torch.randn(4), reward=torch.randn(1), nested=TensorDict(b=torch.arange(3)))
            for _ in range(args.count)
        ]
        store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(els), url=srv.url)
        client = srv.client()
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(args.count, (256,), generator=gen) for _ in range(args.reads)]
        ring = LazyStackedTensorDictStore(url=srv.url, count=args.count)
        ring.extend(lazy_stack(els[: args.count // 2]))
        full = LazyStackedTensorDictStore(url=srv.url, count=args.count)
        full.extend(lazy_stack(els))
        calls = (
            ("store[idx], 256 random", lambda i: store[batches[i]]),
            ("ring.sample(256), half", lambda i: ring.sample(256, gen)),  # read.lua draws among the written slots
            ("ring.sample(256), full", lambda i: full.sample(256, gen)),  # a full ring: a transaction
        )
        for label, call in calls:
            for i in range(5):
                call(i % args.reads)  # warm
            client.config_resetstat()
            cpu0 = server_cpu(client)
            t = time.perf_counter()
            for i in range(args.reads):
                call(i)
            wall = (time.perf_counter() - t) / args.reads * 1e3
            cpu = (server_cpu(client) - cpu0) / args.reads * 1e3
            stats = raw_commandstats(client)
            # a script call (EVALSHA) or a transaction (MULTI/EXEC of plain GETRANGEs, see tdstore/_format/wire.py)
            calls = sum(stats.get(c, {}).get("calls", 0) for c in ("evalsha", "exec"))
            usec = sum(stats.get(c, {}).get("usec", 0) for c in ("evalsha", "exec", "multi"))
            kind = "+".join(c.upper() for c in ("evalsha", "exec") if c in stats)
            print(
                f"{label:24s} wall {wall:6.2f} ms per read, server {usec / 1000 / max(calls, 1):6.2f} ms per call ({calls} {kind} calls), "
                f"server CPU {cpu:6.2f} ms per read"
            )
        if args.reference:
            _versus_reference(srv, lazy_stack(els), store, batches)
        if args.alternatives:
            _alternatives(client, args.count, batches)


# Each gets the rows as int64 in ARGV[1]; KEYS[1] is the rows as one string, KEYS[2] a hash of them.
_FETCH = {
    "one GETRANGE per row": "local out = {} for i = 1, #ARGV[1] / 8 do local r = struct.unpack('<i8', ARGV[1], 8 * i - 7) "
    "out[i] = redis.call('GETRANGE', KEYS[1], r * 300, r * 300 + 299) end return table.concat(out)",
    "GET once, cut in Lua": "local b = redis.call('GET', KEYS[1]) local out = {} for i = 1, #ARGV[1] / 8 do "
    "local r = struct.unpack('<i8', ARGV[1], 8 * i - 7) out[i] = string.sub(b, r * 300 + 1, r * 300 + 300) end return table.concat(out)",
    "one HMGET of a hash of rows": "local f = {} for i = 1, #ARGV[1] / 8 do f[i] = tostring(struct.unpack('<i8', ARGV[1], 8 * i - 7)) end "
    "return table.concat(redis.call('HMGET', KEYS[2], unpack(f)))",
}


def _alternatives(client: redis.Redis, count: int, batches: list[torch.Tensor]) -> None:
    row = bytes(range(256)) + bytes(44)
    client.set("tdstore-alt:rows", row * count)
    for start in range(0, count, 1000):
        client.hset("tdstore-alt:hash", mapping={str(i): row for i in range(start, min(count, start + 1000))})
    per_row = {
        "string": client.memory_usage("tdstore-alt:rows") / count,
        "hash": client.memory_usage("tdstore-alt:hash", samples=0) / count,
    }
    print(f"memory per 300-byte row: {per_row['string']:.0f} B as one string, {per_row['hash']:.0f} B in a hash")
    packed = [b.numpy().astype("<i8").tobytes() for b in batches]
    for label, source in _FETCH.items():
        sha = client.script_load(source)
        for p in packed[:3]:
            client.evalsha(sha, 2, "tdstore-alt:rows", "tdstore-alt:hash", p)
        client.config_resetstat()
        for p in packed:
            client.evalsha(sha, 2, "tdstore-alt:rows", "tdstore-alt:hash", p)
        print(f"{label:28s} server {usec_per_call(client) / 1000:6.3f} ms per call of 256 rows")
    client.delete("tdstore-alt:rows", "tdstore-alt:hash")


def _median_ms(call: Callable[[int], object], n: int, before: Callable[[int], object] | None = None) -> float:
    times = []
    for i in range(n):
        if before is not None:
            before(i)
        t = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _versus_reference(srv: EmbeddedServer, stack: object, store: LazyStackedTensorDictStore, batches: list[torch.Tensor]) -> None:
    from tensordict.store import LazyStackedTensorDictStore as Reference

    ref = Reference.from_lazy_stack(stack, **srv.connection_kwargs())
    n = len(batches)
    for i in range(5):
        ref[batches[i % n]]
    td_alone = _median_ms(lambda i: store[batches[i]], n)
    ref_alone = _median_ms(lambda i: ref[batches[i]], n)
    td_after = _median_ms(lambda i: store[batches[i]], n, before=lambda i: ref[batches[i]])
    print(f"back to back: tdstore {td_alone:.2f} ms, reference {ref_alone:.2f} ms (tdstore / reference {td_alone / ref_alone:.2f}x)")
    print(f"tdstore right after a reference read: {td_after:.2f} ms ({td_after / ref_alone:.2f}x the reference back to back)")


if __name__ == "__main__":
    main()
