#!/usr/bin/env python3
"""torchrl's replay-buffer workload on three storages, side by side in one run (issue #17).

torchrl's own benchmark workload: a buffer of 10,000; rows of ``obs`` f32[64],
``action`` f32[4], ``reward`` f32[1]; fill 5,000 rows in chunks of 500; sample 256.
Contenders, interleaved (each repetition runs every one, so machine load hits all alike):

* ``LazyTensorStorage``: torchrl's in-memory storage (``ReplayBuffer``, ``RandomSampler``,
  ``RoundRobinWriter``), and the same in a ``TensorDictReplayBuffer``;
* torchrl's ``StoreStorage`` over the reference ``tensordict.store`` (same sampler and writer);
* ``tdstore.torchrl``: ``replay_buffer(...)`` (``StoreStorage``, ``StoreWriter``,
  ``StoreSampler``), as a ``ReplayBuffer`` and as a ``TensorDictReplayBuffer``.

Then 4 actor processes, each with its own handle on one tdstore buffer, extend it at once
(chunks of 500, ``--fill`` rows each): their aggregate rate in rows per second.

Starts its own private redis-server (loopback TCP by default, ``--unix`` for a unix
socket); never connects to anything else.  Prints medians (and minima) and ratios; ``--json``
prints the figures as JSON instead.

Usage::

    python -m tools.torchrl_bench [--reps 15] [--samples 50] [--unix] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from tdstore.server import EmbeddedServer

REFERENCE = "torchrl StoreStorage / tensordict.store"
IN_MEMORY = "LazyTensorStorage"


def chunks(fill: int, chunk: int, seed: int = 0) -> list[TensorDict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        TensorDict(
            obs=torch.randn(chunk, 64, generator=gen),
            action=torch.randn(chunk, 4, generator=gen),
            reward=torch.randn(chunk, 1, generator=gen),
            batch_size=[chunk],
        )
        for _ in range(fill // chunk)
    ]


class Contender:
    """One storage: a fresh buffer filled each repetition (timed), then sampled ``samples`` times (each timed)."""

    def __init__(self, name: str, make: Callable[[], Any], cleanup: Callable[[Any], None] = lambda rb: None) -> None:
        self.name, self.make, self.cleanup = name, make, cleanup
        self.fills: list[float] = []
        self.samples: list[float] = []
        self.live: Any = None

    def fill(self, data: list[TensorDict], expected: int) -> None:
        rb = self.make()
        t = time.perf_counter()
        for c in data:
            rb.extend(c.clone())  # a TensorDictReplayBuffer writes "index" into what it is given
        self.fills.append(time.perf_counter() - t)
        if len(rb) != expected:
            raise AssertionError(f"{self.name}: len {len(rb)} after the fill, expected {expected}")
        old, self.live = self.live, rb
        if old is not None:
            self.cleanup(old)

    def sample(self, n: int, batch: int) -> None:
        for _ in range(n):
            t = time.perf_counter()
            s = self.live.sample()
            self.samples.append(time.perf_counter() - t)
        if s.batch_size != torch.Size([batch]):
            raise AssertionError(f"{self.name}: sampled {s.batch_size}")


def _actor(conn: dict[str, Any], td_id: str, fill: int, chunk: int, seed: int, go: Any, out: Any) -> None:
    from tdstore.torchrl import attach

    rb = attach(td_id, **conn)
    data = chunks(fill, chunk, seed)
    rb.extend(data[0][:1])  # connect and learn the schema before the clock starts
    out.put("ready")
    go.wait(120)
    t0 = time.monotonic()
    for c in data:
        rb.extend(c)
    out.put((t0, time.monotonic()))


def _next(out: Any, procs: list[Any]) -> Any:
    """The next actor message; an actor that died (it cannot put one) raises instead of a wait without end."""
    import queue

    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"an actor process died (exit codes {dead})") from None


def actors_rate(conn: dict[str, Any], max_size: int, fill: int, chunk: int, actors: int) -> dict[str, Any]:
    """``actors`` processes extend one buffer at once: aggregate rows per second, first start to last end."""
    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(max_size, **conn)
    td_id = rb.storage.td_id
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(conn, td_id, fill, chunk, 1 + a, go, out)) for a in range(actors)]
    for p in procs:
        p.start()
    for _ in procs:  # every actor is connected and has written its schema row
        if _next(out, procs) != "ready":
            raise RuntimeError("an actor did not start")
    go.set()
    spans = [_next(out, procs) for _ in procs]
    for p in procs:
        p.join(60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"an actor failed: exit codes {[p.exitcode for p in procs]}")
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    rows = actors * fill
    written = rb.write_count
    rb.storage._store.clear_redis()
    return {"actors": actors, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "write_count": written}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-size", type=int, default=10_000)
    ap.add_argument("--fill", type=int, default=5_000, help="rows written per fill (and per actor)")
    ap.add_argument("--chunk", type=int, default=500, help="rows per extend")
    ap.add_argument("--batch", type=int, default=256, help="rows per sample")
    ap.add_argument("--reps", type=int, default=15, help="fills per contender (interleaved)")
    ap.add_argument("--samples", type=int, default=50, help="samples per contender per repetition")
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--unix", action="store_true", help="the private server on a unix socket (default: loopback TCP)")
    ap.add_argument("--binary", default=None, help="the redis-server binary (default: tdstore.server's choice)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    return ap.parse_args(argv)


def _contenders(M: int, B: int, conn: dict[str, Any]) -> list[Contender]:
    """In-memory torchrl buffers, torchrl's StoreStorage over the reference, and tdstore's buffers."""
    import tensordict.store as reference
    from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer, RoundRobinWriter, TensorDictReplayBuffer
    from torchrl.data.replay_buffers import StoreStorage as TorchrlStoreStorage

    from tdstore.torchrl import replay_buffer

    logging.getLogger("torchrl").setLevel(logging.WARNING)  # after the import, which sets it
    ref_conn = dict(conn)
    if not reference.TensorDictStore.__module__.startswith("tensordict."):
        raise RuntimeError("tensordict.store.TensorDictStore was replaced: this benchmark needs the reference")

    def ref_cleanup(rb: Any) -> None:
        store = rb.storage._storage
        if store is not None:
            store.clear_redis()

    def ours_cleanup(rb: Any) -> None:
        rb.storage._store.clear_redis()

    return [
        Contender(
            IN_MEMORY,
            lambda: ReplayBuffer(storage=LazyTensorStorage(M), sampler=RandomSampler(), writer=RoundRobinWriter(), batch_size=B),
        ),
        Contender(f"{IN_MEMORY}, TensorDictReplayBuffer", lambda: TensorDictReplayBuffer(storage=LazyTensorStorage(M), batch_size=B)),
        Contender(
            REFERENCE,
            lambda: ReplayBuffer(
                storage=TorchrlStoreStorage(M, **ref_conn), sampler=RandomSampler(), writer=RoundRobinWriter(), batch_size=B
            ),
            ref_cleanup,
        ),
        Contender("tdstore.torchrl", lambda: replay_buffer(M, batch_size=B, tensordict=False, **conn), ours_cleanup),
        Contender("tdstore.torchrl, TensorDictReplayBuffer", lambda: replay_buffer(M, batch_size=B, **conn), ours_cleanup),
    ]


def _med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _print_table(args: argparse.Namespace, result: dict[str, Any]) -> None:
    M, B, rows = args.max_size, args.batch, result["rows"]
    print(
        f"torchrl workload: buffer {M:,}; fill {args.fill:,} in chunks of {args.chunk}; sample {B}; "
        f"{args.reps} reps x {args.samples} samples, interleaved"
    )
    print(
        f"redis-server {result['server']['version']} over {result['server']['transport']}; PING median {result['server']['ping_ms']:.3f} ms"
    )
    print()
    print(f"| storage | fill {args.fill:,} ms | sample {B} ms | sample vs in-memory | fill: reference / this |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['storage']} | {r['fill_ms']:.1f} (min {r['fill_min_ms']:.1f}) | {r['sample_ms']:.3f} (min {r['sample_min_ms']:.3f}) | "
            f"{r['sample_vs_in_memory']:.1f}x | {r['fill_speedup_vs_reference']:.1f}x |"
        )
    a = result["actors"]
    print()
    print(
        f"{a['actors']} actor processes extending one tdstore buffer at once: {a['rows']:,} rows in {a['seconds'] * 1e3:.0f} ms = "
        f"{a['rows_per_s']:,.0f} rows/s ({a['vs_one_process']:.1f}x one process's fill rate)"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    warnings.filterwarnings("ignore")
    data = chunks(args.fill, args.chunk)
    expected = min(args.fill, args.max_size)
    M, B = args.max_size, args.batch
    with EmbeddedServer(unix_socket=args.unix, binary=args.binary) as srv:
        conn: dict[str, Any] = {"unix_socket_path": srv.unix_socket_path} if args.unix else {"host": "127.0.0.1", "port": srv.port}
        contenders = _contenders(M, B, conn)
        client = srv.client()
        pings: list[float] = []
        for _ in range(args.reps):
            for c in contenders:
                c.fill(data, expected)
            for c in contenders:
                c.sample(args.samples, B)
            for _ in range(20):
                t = time.perf_counter()
                client.ping()
                pings.append(time.perf_counter() - t)
        for c in contenders:
            if c.live is not None:
                c.cleanup(c.live)
        actors = actors_rate(conn, M, args.fill, args.chunk, args.actors)
        version = srv.version
    base, ref = contenders[0], contenders[2]
    rows = [
        {
            "storage": c.name,
            "fill_ms": _med(c.fills),
            "fill_min_ms": min(c.fills) * 1e3,
            "sample_ms": _med(c.samples),
            "sample_min_ms": min(c.samples) * 1e3,
            "sample_vs_in_memory": _med(c.samples) / _med(base.samples),
            "fill_speedup_vs_reference": _med(ref.fills) / _med(c.fills),
        }
        for c in contenders
    ]
    single = next(r for r in rows if r["storage"] == "tdstore.torchrl")
    result = {
        "workload": {"max_size": M, "fill": args.fill, "chunk": args.chunk, "batch": B, "reps": args.reps, "samples_per_rep": args.samples},
        "server": {"version": version, "transport": "unix socket" if args.unix else "loopback TCP", "ping_ms": _med(pings)},
        "rows": rows,
        "actors": {**actors, "vs_one_process": actors["rows_per_s"] / (args.fill / (single["fill_ms"] / 1e3))},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return result
    _print_table(args, result)
    return result


if __name__ == "__main__":
    main()
