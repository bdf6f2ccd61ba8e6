"""Benchmark of tdstore against the reference ``tensordict.store`` and a raw redis-py floor (issue #6).

Three contenders run *interleaved* in one process, on one private redis-server,
with the same data:

* ``tdstore``: :class:`tdstore.LazyStackedTensorDictStore` (one Lua call per operation);
* ``reference``: ``tensordict.store.LazyStackedTensorDictStore``, used through its own
  API (``ref[i] = td``, ``ref[i].to_tensordict()``, ``ref[idx]``...);
* ``raw``: the floor, one non-transactional redis-py pipeline of plain
  ``GET``/``GETRANGE``/``SET``/``SETRANGE`` commands that move the same bytes as tdstore
  (its own copy of the data in tdstore's layout, offsets known client-side), with
  no TensorDict work and no decoding.  Whole values (upload, the large leaf write)
  go with ``SET``, parts of values with ``SETRANGE``/``GETRANGE``.  A shape-changing
  element write moves the same bytes over the wire but not the tail of the blob
  that tdstore shifts on the server, so there the floor is a wire floor only.
  A scattered batch read is one GETRANGE per run of consecutive elements per
  leaf: there the floor pays redis-py's per-command cost, and a store that joins
  the ranges on the server can beat it.

Each repetition draws its arguments once (random element, index tensor, slice
start, value to write) and runs every contender on them, rotating the order; the
figures are medians over the repetitions, and the ratios are tdstore / reference
and tdstore / raw (below 1 means tdstore is faster).  A multi-process case runs
``--mp-writers`` processes doing ``store[i] = td`` for ``--mp-seconds`` per contender.

Usage::

    python -m tools.bench                       # full run (10,000 elements, 64 MiB leaf, 10 s mp)
    python -m tools.bench --quick --json out.json   # CI smoke run (1,000 elements, 8 MiB, 1 s mp)
    python -m tools.bench --large               # also a 1 GiB leaf
    python -m tools.bench --url redis://127.0.0.1:7000/0   # a server you started yourself

The JSON (``--json``) holds, per case and operation, each contender's median,
mean, min and p90 in ms (or ``{"status": "raises", "error": ...}``), the number of
server commands one call executed (scripts' inner commands included), and the
two ratios; ``mp`` holds element writes per second per contender.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

# torch, tensordict and the benchmark's modules are imported once the arguments are parsed: ``--help``
# and a bad argument answer at once instead of after seconds of imports
if TYPE_CHECKING:
    from tools.bench.measure import Target
    from tools.bench.workload import Settings

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10, check=True).stdout.strip()


def _git_commit() -> str | None:
    """The checkout's commit, with "-dirty" when tdstore/ or lua/ differ from it (None outside git)."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "tdstore", "lua")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def environment(target: Target, settings: Settings, argv: Sequence[str]) -> dict[str, Any]:
    """Versions and settings, so that two JSON files can be compared."""
    import redis
    import tensordict
    import torch

    import tdstore
    from tools.bench.workload import OPERATIONS, RefLazy

    return {
        "argv": list(argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "tdstore": tdstore.__version__,
        "redis_py": redis.__version__,
        "hiredis": bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False)),
        "server_version": target.server_version,
        "server": "private redis-server started by the benchmark" if target.started_here else "--url",
        "transport": urlsplit(target.url).scheme,
        "quick": settings.quick,
        "count": settings.count,
        "batch": settings.batch,
        "large_leaf_bytes": list(settings.large_leaf_bytes),
        "reps": settings.reps,
        "warmup": settings.warmup,
        "op_budget_s": settings.op_budget_s,
        "seed": settings.seed,
        "loadavg_start": list(os.getloadavg()),
        "reference_available": RefLazy is not None,
        "operations": {case: list(ops) for case, ops in OPERATIONS.items()},
        "ratios": "tdstore median / other median (below 1: tdstore is faster); mp: tdstore writes/s / other writes/s",
        "commands": "server commands one call executed (commandstats delta, commands run inside scripts included)",
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        # "tdstore bench" runs this file in a child interpreter and names itself through the environment
        prog=os.environ.get("TDSTORE_BENCH_PROG") or "python -m tools.bench",
        description=(
            "Benchmark of tdstore against the reference tensordict.store and a raw redis-py floor. The three run interleaved "
            "on one private redis-server (or --url) with the same data; figures are medians over repetitions, and ratios are "
            "tdstore / other (below 1: tdstore is faster)."
        ),
    )
    p.add_argument("--quick", action="store_true", help="CI smoke run: 1,000 elements, few repetitions, 8 MiB leaf, 1 s mp")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--url", help="use this server (redis://, rediss:// or unix://) instead of starting a private one")
    p.add_argument("--tcp", action="store_true", help="the private server listens on loopback TCP instead of a unix socket")
    p.add_argument("--count", type=int, help="elements per store (default 10,000; 1,000 with --quick)")
    p.add_argument("--large", action="store_true", help="also read and write a 1 GiB leaf (not with --quick)")
    p.add_argument(
        "--mp-seconds", type=float, help="seconds of writing per contender in the multi-process case (default 10; 1 with --quick)"
    )
    p.add_argument("--mp-writers", type=int, default=4, help="writer processes in the multi-process case (default 4)")
    p.add_argument("--no-mp", action="store_true", help="skip the multi-process case")
    p.add_argument("--reps-scale", type=float, default=1.0, help="multiply every repetition count by this factor")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.count is not None and args.count < 2:
        p.error("--count must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when tdstore and the raw floor ran every operation, else 1."""
    args = parse_args(argv)
    from tools.bench.measure import open_target
    from tools.bench.report import HEADER, print_table
    from tools.bench.runner import Runner
    from tools.bench.workload import make_settings

    settings = make_settings(args)
    t_start = time.monotonic()
    with open_target(args, settings) as target:
        runner = Runner(target, settings)
        meta = environment(target, settings, sys.argv if argv is None else argv)
        print(
            f"tdstore bench: redis {target.server_version} via {meta['transport']}, {settings.count:,} elements, quick={settings.quick}",
            flush=True,
        )
        print(HEADER)
        print("-" * len(HEADER), flush=True)
        mp_report = None
        het_report: list[dict[str, Any]] = []
        try:
            runner.element_case("homogeneous", het=False)
            runner.element_case("heterogeneous", het=True)
            for leaf_bytes in settings.large_leaf_bytes:
                runner.large_case(leaf_bytes)
            print("\nheterogeneous reads against the homogeneous store's (tdstore ms / tdstore ms, side by side) or the raw floor:")
            het_report = runner.het_vs_hom_case()
            runner.drop(runner.mp_stores.pop("heterogeneous"))
            if not args.no_mp and settings.mp_writers > 0:
                mp_report = runner.mp_case()
            else:
                runner.drop(runner.mp_stores["homogeneous"])
        finally:
            runner.close()
    meta["seconds"] = round(time.monotonic() - t_start, 1)
    meta["loadavg_end"] = list(os.getloadavg())
    meta["git_end"] = _git_commit()  # differs from "git" when the code changed during the run
    report = {
        "meta": meta,
        "results": runner.results,
        "het_vs_hom": het_report,
        "mp": mp_report,
        "problems": runner.problems,
        "notes": runner.notes,
    }
    print_table(report)
    print(f"\n{meta['seconds']} s in all")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"JSON written to {path}")
    return 1 if runner.problems else 0


if __name__ == "__main__":
    sys.exit(main())
