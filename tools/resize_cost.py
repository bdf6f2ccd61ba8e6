"""How the cost of a shape-changing element write depends on the store size.

A write whose heterogeneous leaf changes size makes the server move the bytes
after the element *in its segment* and shift the later entries of that segment's
offset table (``lua/write.lua``, ``splice``).  Segments bound that work: this tool
builds stores of growing size (default 4 MiB and 1 GiB, ~8 KiB per element with a
heterogeneous ``tokens`` key) on a private redis-server (or ``--url``), times such
writes at the first, middle and last element, and prints the medians and the
ratio of each size to the smallest.

    python -m tools.resize_cost [--sizes 4MiB 1GiB] [--reps 15] [--segment-bytes N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import uuid

import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore.server import server_or_url

TOKENS = 1_000  # int64 tokens per element, plus 0..16: about 8 KiB per element


def element(i: int, length: int) -> TensorDict:
    return TensorDict(obs=torch.full((16,), float(i)), tokens=torch.arange(length, dtype=torch.int64))


def parse_size(text: str) -> int:
    """'4MiB', '1GiB', '512k', '1048576' -> bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)])


def measure(url: str, size: int, reps: int, segment_bytes: int | None) -> dict[str, float]:
    per_element = 16 * 4 + (TOKENS + 8) * 8
    count = max(3, size // per_element)
    local = lazy_stack([element(i, TOKENS + i % 17) for i in range(count)])
    store = LazyStackedTensorDictStore.from_lazy_stack(local, url=url, prefix=f"resize-{uuid.uuid4().hex[:6]}", segment_bytes=segment_bytes)
    del local
    h = store._engine.header
    out: dict[str, float] = {"count": count, "segments": h.segments.n, "elements_per_segment": h.segments.per}
    try:
        for where, i in (("first", 0), ("middle", count // 2), ("last", count - 1)):
            times = []
            for r in range(reps):
                new = element(i, TOKENS + 40 + (r % 2) * 7)  # alternate sizes: every write changes the size
                t0 = time.perf_counter()
                store[i] = new
                times.append(time.perf_counter() - t0)
            out[where] = statistics.median(times) * 1e3
            got = store[i]["tokens"]
            assert got.numel() == new["tokens"].numel(), "write not applied"
        # same-size write for comparison
        same = element(5, TOKENS + 5 % 17)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            store[5] = same
            times.append(time.perf_counter() - t0)
        out["same size"] = statistics.median(times) * 1e3
    finally:
        store.clear_redis()
    return out


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="server URL (default: a private redis-server)")
    ap.add_argument("--sizes", type=parse_size, nargs="+", default=[4 << 20, 1 << 30], help="store sizes (default: 4MiB 1GiB)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--segment-bytes", type=parse_size, default=None, help="segment size of the stores (default: tdstore's)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--binary", help="redis-server binary for the private server (default: /usr/bin/redis-server if present)")
    args = ap.parse_args(argv)
    rows: dict[int, dict[str, float]] = {}
    with server_or_url(args.url, args.binary) as (url, where):
        print(where)
        print(
            f"{'store':>9} {'count':>9} {'segments':>9} {'first ms':>9} {'middle ms':>10} {'last ms':>8} "
            f"{'same-size ms':>13} {'first / smallest':>17}"
        )
        for size in args.sizes:
            r = measure(url, size, args.reps, args.segment_bytes)
            base = rows[args.sizes[0]]["first"] if rows else r["first"]
            r["ratio_first"] = r["first"] / base
            rows[size] = r
            print(
                f"{_human(size):>9} {r['count']:>9,} {r['segments']:>9,} {r['first']:>9.2f} {r['middle']:>10.2f} {r['last']:>8.2f} "
                f"{r['same size']:>13.2f} {r['ratio_first']:>17.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": where, "rows": {str(k): v for k, v in rows.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
