#!/usr/bin/env python3
"""The GRPO-shaped rollout workload through tdstore and through torchrl's ``RayReplayBuffer``, side by side.

The workload of torchrl's async GRPO (``sota-implementations/grpo/grpo-async.py``): writers produce
groups of ``--group`` rollouts, each a prompt string, ragged ``tokens`` (i64) and ``logp`` (f32) of 32
to ``--max-len`` tokens, and a reward; a learner samples batches of ``--batch``. Contenders:

* ``tdstore``: a lazy ring (``LazyStackedTensorDictStore(count=...)``) on a private redis-server; each
  writer process attaches by ``td_id`` and writes each group in one call
  (``extend(group, version=v, group=gid, group_size=n)``: the group appears whole); the learner calls
  ``sample(batch)``.
* ``ray``: ``RayReplayBuffer(storage=partial(LazyStackStorage, capacity))`` as grpo-async builds it
  (Ray started with 2 CPUs, no dashboard); writers are Ray tasks extending through the buffer's
  client, one call a group; the learner calls ``rb.sample(batch)``.

Figures: rollouts/s written by all writers together (rows over the slowest writer's time, data made
before its clock starts), batches/s sampled by the learner alone; then tdstore/ray ratios. Without
``ray`` installed (``pip install ".[bench]"``), ``--no-ray`` is implied and says so.

Usage::

    python -m tools.grpo_bench [--writers 4] [--groups 40] [--group 8] [--batch 32] [--samples 100] [--no-ray] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tensordict import NonTensorData, TensorDict, lazy_stack

from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer

PREFIX = "grpo-bench"


def make_groups(writer: int, groups: int, group: int, max_len: int) -> list[list[TensorDict]]:
    """``groups`` groups of ``group`` ragged rollouts (made before a writer's clock starts)."""
    gen = torch.Generator().manual_seed(writer)
    out = []
    for g in range(groups):
        rows = []
        for _ in range(group):
            n = int(torch.randint(32, max_len + 1, (1,), generator=gen))
            rows.append(
                TensorDict(
                    prompt=NonTensorData(f"user: prompt {writer}-{g}, please think step by step"),
                    tokens=torch.randint(0, 32000, (n,), generator=gen),
                    logp=-torch.rand(n, generator=gen),
                    reward=torch.rand(1, generator=gen),
                )
            )
        out.append(rows)
    return out


def timed_writes(write: Callable[[int, list[TensorDict]], Any], data: list[list[TensorDict]]) -> tuple[int, float]:
    """Write every group; (rows, seconds)."""
    t0 = time.perf_counter()
    for g, rows in enumerate(data):
        write(g, rows)
    return sum(len(r) for r in data), time.perf_counter() - t0


def tdstore_writer(url: str, td_id: str, writer: int, groups: int, group: int, max_len: int, go: Any, out: Any) -> None:
    """One tdstore writer process: attach and make its data, say ready, wait for ``go``, then write each
    group whole in one call."""
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=PREFIX, td_id=td_id)
    data = make_groups(writer, groups, group, max_len)
    out.put("ready")
    go.wait()
    out.put(timed_writes(lambda g, rows: store.extend(rows, version=0, group=f"w{writer}-g{g}", group_size=group), data))
    store.close()


def run_tdstore(a: argparse.Namespace) -> dict[str, float]:
    """The tdstore side: writer processes, then the learner's samples."""
    capacity = a.writers * a.groups * a.group
    with EmbeddedServer() as server:
        store = LazyStackedTensorDictStore(url=server.url, prefix=PREFIX, count=capacity)
        store.set_version(0)
        store.extend(make_groups(99, 1, a.group, a.max_len)[0], version=0, group="primer", group_size=a.group)  # the keys
        ctx = mp.get_context("spawn")
        q, go = ctx.Queue(), ctx.Event()
        args = (server.url, store.td_id)
        procs = [ctx.Process(target=tdstore_writer, args=(*args, w, a.groups, a.group, a.max_len, go, q)) for w in range(a.writers)]
        for p in procs:
            p.start()
        assert [q.get(timeout=600) for _ in procs] == ["ready"] * a.writers  # every writer imported, connected, made its data
        go.set()
        results = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        t0 = time.perf_counter()
        for _ in range(a.samples):
            store.sample(a.batch)
        sample_s = time.perf_counter() - t0
        store.clear_redis()
        store.close()
    rows = sum(r[0] for r in results)
    return {"rollouts_per_s": rows / max(r[1] for r in results), "batches_per_s": a.samples / sample_s}


def run_ray(a: argparse.Namespace) -> dict[str, float]:
    """The Ray side: ``RayReplayBuffer(LazyStackStorage)``, Ray tasks as writers, then the learner's samples."""
    import ray
    from torchrl.data import LazyStackStorage, RayReplayBuffer

    capacity = a.writers * a.groups * a.group
    rb = RayReplayBuffer(
        storage=partial(LazyStackStorage, capacity),
        batch_size=a.batch,
        ray_init_config={"num_cpus": 2, "include_dashboard": False, "log_to_driver": False},
    )
    try:
        client = rb.client()

        @ray.remote(num_cpus=0)
        class Writer:
            """A Ray writer (as grpo-async's collectors are): makes its data, then writes when asked."""

            def __init__(self, w: int) -> None:
                self.data = make_groups(w, a.groups, a.group, a.max_len)

            def ready(self) -> bool:
                return True

            def write(self) -> tuple[int, float]:
                return timed_writes(lambda g, rows: client.extend(lazy_stack(rows)), self.data)

        writers = [Writer.remote(w) for w in range(a.writers)]  # type: ignore[attr-defined]
        ray.get([w.ready.remote() for w in writers])  # every writer started and made its data
        results = ray.get([w.write.remote() for w in writers])
        t0 = time.perf_counter()
        for _ in range(a.samples):
            rb.sample(a.batch)
        sample_s = time.perf_counter() - t0
    finally:
        rb.shutdown()
        ray.shutdown()
    rows = sum(r[0] for r in results)
    return {"rollouts_per_s": rows / max(r[1] for r in results), "batches_per_s": a.samples / sample_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--groups", type=int, default=40, help="groups per writer")
    p.add_argument("--group", type=int, default=8, help="rollouts per group")
    p.add_argument("--max-len", type=int, default=512, help="longest completion in tokens (from 32)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--samples", type=int, default=100, help="batches the learner samples")
    p.add_argument("--no-ray", action="store_true", help="the tdstore side only")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    figures: dict[str, Any] = {"tdstore": run_tdstore(a)}
    note = ""
    if a.no_ray:
        note = "ray side skipped (--no-ray)"
    else:
        try:
            import ray  # noqa: F401
        except ImportError:
            note = 'ray side skipped: ray is not installed (pip install ".[bench]")'
        else:
            figures["ray"] = run_ray(a)
    if "ray" in figures:
        figures["ratio"] = {k: figures["tdstore"][k] / figures["ray"][k] for k in ("rollouts_per_s", "batches_per_s")}
    if a.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{a.writers} writers x {a.groups} groups of {a.group} rollouts (32..{a.max_len} tokens), batches of {a.batch}")
    print(f"{'':8} | {'rollouts/s written':>18} | {'batches/s sampled':>17}")
    for name in ("tdstore", "ray", "ratio"):
        if name in figures:
            r = figures[name]
            unit = "x" if name == "ratio" else ""
            print(f"{name:8} | {r['rollouts_per_s']:>17.1f}{unit or ' '} | {r['batches_per_s']:>16.1f}{unit or ' '}")
    if note:
        print(note)


if __name__ == "__main__":
    main()
