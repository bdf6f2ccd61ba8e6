#!/usr/bin/env python3
"""Checkpoints of a ring buffer: export and import time, and the memory they take beside the data.

On a private redis-server (or ``--url``), this fills a ring of ``--elements`` transitions
(``obs`` f32[64], ``action`` f32[4], ``step`` i64, plus ``tokens`` i64[1 + i % 17] with
``--ragged``), then runs ``tdstore.export_checkpoint`` and ``tdstore.import_checkpoint`` each in
a fresh child process that samples its anonymous memory (``RssAnon``: the memmapped files of
the checkpoint are page cache, not the process's) every 5 ms, and prints the seconds, the
throughput, the peak anonymous memory over the child's baseline and the checkpoint's size.
The restored store is compared with the original (its ring state and a whole key).

Then (``--writers W``, default 2; 0 skips it) the export again while W writer processes extend the
ring in batches of 256 rows: its seconds beside the export alone, the rows the writers overwrote
during it (absent from the checkpoint, ``overwritten_during_export``), and the writers' throughput
during the export against their throughput over as long a window just before it (the export
holds no writer: each of its reads is one short call).

    python -m tools.checkpoint_bench [--elements 600000] [--ragged] [--writers 2] [--url URL] [--binary PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent  # the child runs there, so it imports this checkout's tdstore

_CHILD = r"""
import json, sys, threading, time
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)
mode, url, path = sys.argv[1:4]
import tdstore
from tdstore import LazyStackedTensorDictStore
store = LazyStackedTensorDictStore.from_store(td_id="bench", url=url) if mode == "export" else None
threading.Thread(target=sample, daemon=True).start()
time.sleep(0.05)
base = anon()
peak[0] = base
t = time.perf_counter()
if mode == "export":
    tdstore.export_checkpoint(store, path)
else:
    tdstore.import_checkpoint(path, td_id="bench-restored", url=url)
seconds = time.perf_counter() - t
time.sleep(0.02)
print(json.dumps({"seconds": seconds, "peak_mib": (peak[0] - base) / 2**20, "end": time.time(), "start": time.time() - seconds}))
"""

#: A writer process: extends the ring "bench" with batches of 256 rows until the file argv[3] exists, then
#: writes its progress, [[time, rows so far], ...], as JSON into argv[4].
_WRITER = r"""
import json, os, sys, time
import torch
from tensordict import TensorDict, lazy_stack
from tdstore import LazyStackedTensorDictStore
url, ragged, stop, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4]
store = LazyStackedTensorDictStore.from_store(td_id="bench", url=url)
k, done, log = 256, 0, []
batch = TensorDict(obs=torch.randn(k, 64), action=torch.randn(k, 4), step=torch.arange(k), batch_size=[k])
if ragged:
    batch = lazy_stack([td.set("tokens", torch.arange(1 + i % 17)) for i, td in enumerate(batch.unbind(0))])
while not os.path.exists(stop):
    store.extend(batch)
    done += k
    log.append([time.time(), done])
json.dump(log, open(out, "w"))
"""


def _rows_between(logs: list[list[list[float]]], t0: float, t1: float) -> int:
    """Rows the writers wrote between the times ``t0`` and ``t1`` (from their progress logs)."""
    total = 0
    for log in logs:
        before = max((n for t, n in log if t <= t0), default=0)
        upto = max((n for t, n in log if t <= t1), default=0)
        total += int(upto - before)
    return total


def _live(url: str, path: Path, writers: int, ragged: bool, alone: float) -> dict[str, float] | None:
    """The export while ``writers`` processes extend the ring (see the module docstring); None when a child failed."""
    import time

    stop, outs = path.parent / "stop", [path.parent / f"writer{w}.json" for w in range(writers)]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, url, "1" if ragged else "0", str(stop), str(out)], cwd=_REPO) for out in outs]
    try:
        time.sleep(max(2.0, alone) + 3.0)  # the writers start (imports), then run for a window as long as the export at least
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, "export", url, str(path)], cwd=_REPO, capture_output=True, text=True, timeout=3600
        )
        time.sleep(0.5)
    finally:
        stop.touch()
        for p in procs:
            p.wait(timeout=600)
    if proc.returncode != 0 or any(p.returncode != 0 for p in procs):
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    logs = [json.loads(out.read_text()) for out in outs]
    t0, t1 = got["start"], got["end"]
    span = t1 - t0
    during, before = _rows_between(logs, t0, t1), _rows_between(logs, t0 - span, t0)
    meta = json.loads((path / "tdstore.json").read_text())
    return {"seconds": got["seconds"], "during": during / span, "before": before / span,
            "overwritten": meta.get("overwritten_during_export", 0)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=600_000, help="ring slots, all written (default: 600000)")
    ap.add_argument("--ragged", action="store_true", help="add a heterogeneous key (tokens of 1 to 17 int64)")
    ap.add_argument("--url", default=None, help="a server to use instead of a private redis-server")
    ap.add_argument("--binary", default=None, help="redis-server binary for the private server")
    ap.add_argument("--writers", type=int, default=2, help="writer processes extending the ring during a second export (0: none)")
    args = ap.parse_args()

    import torch
    from tensordict import TensorDict, lazy_stack

    from tdstore import LazyStackedTensorDictStore
    from tdstore.server import server_or_url

    n = args.elements
    with server_or_url(args.url, args.binary) as (url, where), tempfile.TemporaryDirectory() as tmp:
        store = LazyStackedTensorDictStore(count=n, url=url, td_id="bench")
        step = 10_000
        for lo in range(0, n, step):
            k = min(step, n - lo)
            batch = TensorDict(obs=torch.randn(k, 64), action=torch.randn(k, 4), step=torch.arange(lo, lo + k), batch_size=[k])
            if args.ragged:
                batch = lazy_stack([td.set("tokens", torch.arange(1 + (lo + i) % 17)) for i, td in enumerate(batch.unbind(0))])
            store.extend(batch)
        path = Path(tmp) / "ck"
        print(f"{n} elements on {where}; ragged key: {'yes' if args.ragged else 'no'}")
        figures = {}
        for mode in ("export", "import"):
            proc = subprocess.run(
                [sys.executable, "-c", _CHILD, mode, url, str(path)], cwd=_REPO, capture_output=True, text=True, timeout=3600
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            figures[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        back = LazyStackedTensorDictStore.from_store(td_id="bench-restored", url=url)
        same = back.ring_state() == store.ring_state() and torch.equal(back["step"], store["step"])
        for mode, f in figures.items():
            rate = size / 2**20 / f["seconds"]
            print(f"{mode:7s} {f['seconds']:7.2f} s  {rate:7.0f} MiB/s  peak memory over baseline {f['peak_mib']:6.1f} MiB")
        print(f"checkpoint {size / 2**20:.1f} MiB; restored ring state and 'step' identical: {same}")
        back.clear_redis()
        if args.writers > 0:
            live = _live(url, Path(tmp) / "live", args.writers, args.ragged, figures["export"]["seconds"])
            if live is None:
                return 1
            ratio = live["seconds"] / figures["export"]["seconds"]
            print(
                f"export with {args.writers} writers {live['seconds']:7.2f} s ({ratio:.2f}x alone); "
                f"{live['overwritten']} rows overwritten during it (absent); writers {live['during']:.0f} rows/s during the export, "
                f"{live['before']:.0f} rows/s just before ({live['during'] / max(live['before'], 1e-9):.2f}x)"
            )
        store.clear_redis()
        shutil.rmtree(path, ignore_errors=True)
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
