"""How the cost of a shape-changing element write grows with the store size.

A write whose heterogeneous leaf changes size makes the server move the bytes
after the element and shift every later entry of the offset table (``lua/write.lua``,
``splice``).  This tool times such writes at the first, middle and last element of
stores of growing count, on a private redis-server (or ``--url``), and prints the
medians and the cost per later element.

    python tools/resize_cost.py [--counts 1000 10000 100000] [--reps 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from tensordict import TensorDict, lazy_stack

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run from a checkout without installing tdstore
    sys.path.insert(0, str(_REPO))

from tdstore import LazyStackedTensorDictStore  # noqa: E402
from tdstore.server import EmbeddedServer  # noqa: E402


def element(i: int, length: int) -> TensorDict:
    return TensorDict(obs=torch.full((16,), float(i)), tokens=torch.arange(length, dtype=torch.int64))


def measure(url: str, count: int, reps: int) -> dict[str, float]:
    local = lazy_stack([element(i, 1 + i % 17) for i in range(count)])
    store = LazyStackedTensorDictStore.from_lazy_stack(local, url=url, prefix=f"resize-{uuid.uuid4().hex[:6]}")
    out: dict[str, float] = {}
    try:
        for where, i in (("first", 0), ("middle", count // 2), ("last", count - 1)):
            times = []
            for r in range(reps):
                new = element(i, 40 + (r % 2) * 7)  # alternate sizes: every write changes the size
                t0 = time.perf_counter()
                store[i] = new
                times.append(time.perf_counter() - t0)
            out[where] = statistics.median(times) * 1e3
            got = store[i]["tokens"]
            assert got.numel() == new["tokens"].numel(), "write not applied"
        # same-size write for comparison
        same = element(5, 1 + 5 % 17)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            store[5] = same
            times.append(time.perf_counter() - t0)
        out["same size"] = statistics.median(times) * 1e3
    finally:
        store.clear_redis()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="server URL (default: a private redis-server)")
    ap.add_argument("--counts", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--binary", help="redis-server binary for the private server (default: /usr/bin/redis-server if present)")
    args = ap.parse_args(argv)
    binary = args.binary or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    server = None if args.url else EmbeddedServer(binary=binary).start()
    url = args.url or server.url  # type: ignore[union-attr]
    where = f"private redis-server {server.version} ({server.binary})" if server is not None else args.url
    print(where)
    rows = {}
    try:
        print(f"{'count':>8} {'first ms':>9} {'middle ms':>10} {'last ms':>8} {'same-size ms':>13} {'us per later element':>21}")
        for count in args.counts:
            r = measure(url, count, args.reps)
            per = (r["first"] - r["last"]) / max(count - 1, 1) * 1e3
            r["us_per_later_element"] = per
            rows[count] = r
            print(f"{count:>8} {r['first']:>9.2f} {r['middle']:>10.2f} {r['last']:>8.2f} {r['same size']:>13.2f} {per:>21.3f}")
    finally:
        if server is not None:
            server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": where, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
