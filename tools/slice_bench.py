#!/usr/bin/env python3
"""Slice sampling (torchrl's ``SliceSampler``) on the server against torchrl in memory, by buffer size.

The workload: rows ``obs`` f32[16], ``action`` f32[4], ``episode`` (int64 id) and
``("next", "done")``; episodes of 20 to 200 steps; samples of 512 rows as ``num_slices=32`` slices
of 16. For each size (10^4, 10^5, 10^6 rows by default) three buffers get the same rows, then,
interleaved (every repetition runs each contender, so machine load hits all alike), each samples:

* ``tdstore``: ``replay_buffer(N, url=..., sampler=SliceSampler(num_slices=32, traj_key="episode"))``:
  the server keeps the episode index and draws the slices, rows read in the same call (one round trip);
* ``memory``: torchrl's ``TensorDictReplayBuffer(LazyTensorStorage(N), SliceSampler(...))`` in this process;
* ``before`` (unless ``--no-before``): the same tdstore buffer sampled by torchrl's own sampling (a
  ``SliceSampler`` subclass the buffer does not recognise), which reads the whole trajectory key from
  the server every time (torchrl's sampler without the index). Slow at 10^6 (about half a second a sample): fewer reps.

Prints per size the median (and min) ms per sample, the ratios tdstore / memory and tdstore(N) /
tdstore(smallest), and the server's time per ``sample_slices`` call (``INFO commandstats``). Starts its
own private redis-server (``--binary`` picks another); never connects to anything else.

Usage::

    python -m tools.slice_bench [--sizes 10000,100000,1000000] [--reps 30] [--no-before] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch
from tensordict import TensorDict

from tdstore.server import EmbeddedServer
from tools._probes import timed, usec_while

BATCH, SLICES = 512, 32
CHUNK = 20_000  # rows per extend while filling


def episodes_rows(n: int, gen: torch.Generator) -> TensorDict:
    """``n`` rows of episodes of 20 to 200 steps (the last one cut), ``("next", "done")`` on each episode's last row."""
    lengths = []
    total = 0
    while total < n:
        k = int(torch.randint(20, 201, (1,), generator=gen))
        lengths.append(k)
        total += k
    episode = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]
    done = torch.zeros(n, 1, dtype=torch.bool)
    ends = torch.tensor(lengths).cumsum(0) - 1
    done[ends[ends < n]] = True
    td = TensorDict(
        obs=torch.randn(n, 16, generator=gen),
        action=torch.randn(n, 4, generator=gen),
        episode=episode,
        batch_size=[n],
    )
    td["next", "done"] = done
    return td


def torchrl_missing() -> str:
    try:
        import torchrl  # noqa: F401
    except ImportError as err:
        return str(err)
    return ""


def buffers(url: str, prefix: str, size: int, data: TensorDict, before: bool) -> dict[str, Any]:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    from tdstore.torchrl import replay_buffer

    class ClientSideSliceSampler(SliceSampler):
        """torchrl's SliceSampler as it is: not recognised by replay_buffer, so it samples on the client."""

    out: dict[str, Any] = {
        "tdstore": replay_buffer(
            size, url=url, prefix=prefix, sampler=SliceSampler(num_slices=SLICES, traj_key="episode"), batch_size=BATCH
        ),
        "memory": TensorDictReplayBuffer(
            storage=LazyTensorStorage(size), sampler=SliceSampler(num_slices=SLICES, traj_key="episode"), batch_size=BATCH
        ),
    }
    for i in range(0, size, CHUNK):
        part = data[i : i + CHUNK]
        out["tdstore"].extend(part)
        out["memory"].extend(part)
    if before:  # the same server buffer, sampled by torchrl on the client
        out["before"] = replay_buffer(
            url=url,
            prefix=prefix,
            td_id=out["tdstore"].storage.td_id,
            sampler=ClientSideSliceSampler(num_slices=SLICES, traj_key="episode"),
            batch_size=BATCH,
        )
    return out


def check(sample: TensorDict) -> None:
    """Every slice inside one episode (consecutive rows of one id)."""
    ep = sample["episode"].reshape(SLICES, -1)
    if not bool((ep == ep[:, :1]).all()):
        raise AssertionError("a slice crosses an episode boundary")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--before-reps", type=int, default=5, help="reps of the client-side sampling (slow at 10^6)")
    ap.add_argument("--no-before", action="store_true", help="skip the client-side sampling")
    ap.add_argument("--binary", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    missing = torchrl_missing()
    if missing:
        print(f"torchrl is not installed ({missing}): nothing to compare with", file=sys.stderr)
        sys.exit(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    gen = torch.Generator().manual_seed(0)
    results: dict[int, dict[str, Any]] = {}
    with EmbeddedServer(binary=args.binary) as srv:
        client = srv.client()
        for size in sizes:
            data = episodes_rows(size, gen)
            bufs = buffers(srv.url, f"slice-bench-{size}", size, data, not args.no_before)
            for rb in bufs.values():
                check(rb.sample())  # warm: the script loaded, the index built
            times: dict[str, list[float]] = {name: [] for name in bufs}
            for r in range(args.reps):
                for name, rb in bufs.items():
                    if name == "before" and r >= args.before_reps:
                        continue
                    times[name].append(timed(rb.sample) * 1e3)
            server_us = usec_while(client, bufs["tdstore"].sample, calls=20)
            results[size] = {name: {"median_ms": statistics.median(t), "min_ms": min(t), "reps": len(t)} for name, t in times.items() if t}
            results[size]["server_us"] = server_us
            episodes = int(data["episode"][-1]) + 1
            del data
            for rb in (bufs["tdstore"],):
                rb.storage.delete()
            bufs.clear()
            results[size]["episodes"] = episodes
        client.close()
    if args.json:
        print(json.dumps(results, indent=1))
        return
    first = results[sizes[0]]["tdstore"]["median_ms"]
    print(f"SliceSampler(num_slices={SLICES}, traj_key='episode'), {BATCH} rows per sample; median (min) ms per sample")
    head = f"{'rows':>10} {'episodes':>9} {'memory':>16} {'tdstore':>16} {'before':>16}"
    head += f" {'tdstore/memory':>15} {'tdstore/first':>14} {'server':>10}"
    print(head)
    for size in sizes:
        r = results[size]

        def cell(name: str, r: dict[str, Any] = r) -> str:
            got = r.get(name)
            return f"{got['median_ms']:7.2f} ({got['min_ms']:6.2f})" if got else f"{'-':>16}"

        t = r["tdstore"]["median_ms"]
        print(
            f"{size:>10,} {r['episodes']:>9,} {cell('memory'):>16} {cell('tdstore'):>16} {cell('before'):>16} "
            f"{t / r['memory']['median_ms']:>14.2f}x {t / first:>13.2f}x {r['server_us'] / 1e3:>7.2f} ms"
        )


if __name__ == "__main__":
    main()
