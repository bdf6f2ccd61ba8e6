"""The learner under load: one process sampling while writer processes extend the same store, per contender."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis
import torch

from tools._probes import server_cpu
from tools.bench.measure import _describe
from tools.bench.workload import LEARNER_BATCH, WRITER_ROWS, RawFloor, Settings
from tools.bench.writers import WriterPool


def learner_case(
    pool: WriterPool,
    store: Any,
    reference: Any,
    raw: RawFloor,
    jobs: list[tuple[str, Any]],
    st: Settings,
    rng: np.random.Generator,
    client: redis.Redis,
) -> dict[str, Any]:
    """The learner under load: ``sample(LEARNER_BATCH)`` per second alone, then while every writer
    process extends ``WRITER_ROWS``-row batches as fast as it can (per contender: tdstore samples
    and extends its ring; the reference reads random rows and writes row slices; raw pipelines
    GETRANGEs and SETRANGEs of the same bytes). ``kept`` is the loaded rate over the idle one."""
    count = st.count
    samplers: dict[str, Callable[[], Any]] = {
        "tdstore": lambda: store.sample(LEARNER_BATCH),
        "reference": lambda: reference[torch.from_numpy(rng.integers(0, count, LEARNER_BATCH))],
        "raw": lambda: raw.read_batch(np.sort(rng.integers(0, count, LEARNER_BATCH))),
    }

    def rate(sample: Callable[[], Any], seconds: float) -> tuple[float, float, float]:
        """Samples per second, this thread's CPU seconds per sample, and the share of the wall
        time it ran on a core (how much CPU the learner got: the writers compete for it)."""
        n, t0, c0 = 0, time.perf_counter(), time.thread_time()
        while time.perf_counter() - t0 < seconds:
            sample()
            n += 1
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return n / wall, cpu / n, cpu / wall

    def under_writers(kind: str, target: Any, sample: Callable[[], Any]) -> tuple[tuple[float, float, float], float, dict[str, Any]]:
        """The learner's rate while the writer processes run job ``kind``, the server's busy share, the writers' result."""
        box: dict[str, Any] = {}
        writers = threading.Thread(target=lambda: box.update(pool.run(kind, target, st.mp_seconds, count, st.seed)))
        writers.start()
        time.sleep(min(1.0, st.mp_seconds / 5))  # the writers are past their barrier and warm
        cpu0, t0 = server_cpu(client), time.perf_counter()
        got = rate(sample, st.mp_seconds / 2)
        busy = (server_cpu(client) - cpu0) / (time.perf_counter() - t0)  # of one core (INFO cpu)
        writers.join()
        return got, busy, box

    out: dict[str, Any] = {"batch": LEARNER_BATCH, "writer_rows": WRITER_ROWS, "writers": st.mp_writers}
    for name, target in jobs:
        sample = samplers[name]
        try:
            sample()
            idle, idle_cpu, idle_share = rate(sample, st.mp_seconds / 2)
            (loaded, loaded_cpu, loaded_share), busy, box = under_writers(f"{name}+extend", target, sample)
        except Exception as err:  # recorded; the reference may not run under load
            out[name] = {"status": "raises", "error": _describe(err)}
            continue
        if box.get("status") != "ok":
            out[name] = {"status": "raises", "error": box.get("error")}
            continue
        rows = box["writes_per_s"] * WRITER_ROWS
        out[name] = {
            "status": "ok",
            "idle_per_s": idle,
            "loaded_per_s": loaded,
            "kept": loaded / idle,
            "writer_rows_per_s": rows,
            "server_cpu_share": busy,
            "cpu_ms_per_sample": [idle_cpu * 1e3, loaded_cpu * 1e3],  # the learner's own CPU, alone and loaded
            "learner_cpu_share": [idle_share, loaded_share],  # of the wall time, alone and loaded
        }
        print(
            f"  learner {name:<10} sample({LEARNER_BATCH}) {idle:8,.0f}/s idle, {loaded:8,.0f}/s under {st.mp_writers} writers "
            f"({loaded / idle:.2f}x kept; writers {rows:,.0f} rows/s; server busy {busy:.0%} of a core; learner CPU "
            f"{idle_cpu * 1e3:.2f} and {loaded_cpu * 1e3:.2f} ms per sample, "
            f"on a core {idle_share:.0%} and {loaded_share:.0%} of the time)",
            flush=True,
        )
    mine = out.get("tdstore", {})
    if mine.get("status") == "ok":
        # Which limit the learner meets: the same writers at nice 19 (last, since a process may not raise
        # its priority back) still put their rows through the one server, but yield the CPU to the learner.
        (niced, _, niced_share), busy, box = under_writers("nice:tdstore+extend", jobs[0][1], samplers["tdstore"])
        if box.get("status") == "ok":
            rows = box["writes_per_s"] * WRITER_ROWS
            mine["niced_writers"] = {
                "loaded_per_s": niced,
                "kept": niced / mine["idle_per_s"],
                "writer_rows_per_s": rows,
                "server_cpu_share": busy,
                "learner_cpu_share": niced_share,
            }
            print(
                f"  learner tdstore    the same writers at nice 19: {niced:8,.0f}/s ({niced / mine['idle_per_s']:.2f}x kept; "
                f"writers {rows:,.0f} rows/s; server busy {busy:.0%} of a core; learner on a core {niced_share:.0%} of the time)",
                flush=True,
            )
    return out
