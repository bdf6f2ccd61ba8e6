"""The multi-process case's writer processes (a fork server with the heavy imports done once)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import redis
import torch
from tensordict import TensorDict

from tools.bench.measure import _describe
from tools.bench.workload import WRITER_ROWS, make_batch, make_element, tensor_bytes


# --------------------------------------------------------------------------- writer processes
def _make_writer(kind: str, target: Any) -> tuple[Callable[[int, TensorDict], Any], Callable[[], None]]:
    """A ``write(i, td)`` function and a ``close()`` for one contender, inside a worker.

    ``<contender>+extend`` writes a batch of rows: tdstore at the ring's cursor (``store.extend``),
    the reference and the raw floor at rows ``i..``."""
    if kind.endswith("+extend"):
        base = kind.split("+")[0]
        if base == "raw":
            url, layout = target
            client = redis.Redis.from_url(url)

            def extend_raw(i: int, td: TensorDict) -> Any:
                pipe = client.pipeline(transaction=False)
                for key, path, eb in layout:
                    pipe.setrange(key, i * eb, tensor_bytes(td.get(path)))
                return pipe.execute()

            return extend_raw, client.close
        if base == "reference":

            def extend_ref(i: int, td: TensorDict) -> None:
                target[i : i + td.batch_size[0]] = td

            return extend_ref, getattr(target, "close", lambda: None)
        return (lambda i, td: target.extend(td)), getattr(target, "close", lambda: None)
    if kind == "raw":
        url, layout = target
        client = redis.Redis.from_url(url)

        def write_raw(i: int, td: TensorDict) -> Any:
            pipe = client.pipeline(transaction=False)
            for key, path, eb in layout:
                pipe.setrange(key, i * eb, tensor_bytes(td.get(path)))
            return pipe.execute()

        return write_raw, client.close
    store = target

    def write_store(i: int, td: TensorDict) -> None:
        store[i] = td

    return write_store, getattr(store, "close", lambda: None)


def _writer_main(wid: int, jobs: Any, results: Any, barrier: Any) -> None:
    """A writer process: for each job, connect, wait at the barrier, write for N seconds."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    while True:
        job = jobs.get()
        if job is None:
            return
        kind, target, seconds, count, seed = job
        if kind.startswith("nice:"):  # yield the CPU to every other process (see Runner.learner_case)
            kind = kind.removeprefix("nice:")
            os.nice(19 - os.nice(0))
        close: Callable[[], None] = lambda: None  # noqa: E731
        try:
            write, close = _make_writer(kind, target)
            gen = torch.Generator().manual_seed(seed + wid)
            td = make_batch(WRITER_ROWS, gen) if kind.endswith("+extend") else make_element(0, False, gen)
            rnd = random.Random(seed * 1000 + wid)
            if kind.endswith("+extend"):
                count = count - WRITER_ROWS + 1  # the batch's first row: the rest follow it
            write(rnd.randrange(count), td)  # warm-up: connection, scripts, caches
            barrier.wait(timeout=300)
            n = 0
            t0 = time.perf_counter()
            deadline = t0 + seconds
            while time.perf_counter() < deadline:
                write(rnd.randrange(count), td)
                n += 1
            results.put((wid, n, time.perf_counter() - t0, None))
        except BaseException as err:  # reported to the parent, which records it
            with contextlib.suppress(Exception):
                barrier.abort()
            results.put((wid, 0, 0.0, _describe(err) + "\n" + traceback.format_exc(limit=3)))
        finally:
            with contextlib.suppress(Exception):
                close()


#: Imported once by the fork server, so that each writer starts in a fraction of a
#: second (tdstore is left out: a writer imports it like this script does).  The
#: module names are explicit because Python 3.11's fork server ignores "__main__".
_PRELOAD = ["numpy", "torch", "redis", "tensordict", "tensordict.store"]


def _mp_context() -> Any:
    """A fork server with the heavy imports done once, else spawn.

    Plain fork is avoided: the reference keeps an event-loop thread per store.
    """
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # pragma: no cover - platforms without fork
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class WriterPool:
    """``n`` spawned writer processes, reused for every contender of the mp case."""

    def __init__(self, n: int) -> None:
        ctx = _mp_context()
        self.n = n
        self.jobs = ctx.Queue()
        self.results = ctx.Queue()
        self.barrier = ctx.Barrier(n + 1)
        self.procs = [ctx.Process(target=_writer_main, args=(w, self.jobs, self.results, self.barrier), daemon=True) for w in range(n)]

    def __enter__(self) -> WriterPool:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for _ in self.procs:
            self.jobs.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():  # only our own children, by handle
                p.terminate()
                p.join(timeout=5)

    def run(self, kind: str, target: Any, seconds: float, count: int, seed: int) -> dict[str, Any]:
        """Run one contender on every writer; element writes per second summed over writers."""
        for _ in range(self.n):
            self.jobs.put((kind, target, seconds, count, seed))
        started = True
        try:
            self.barrier.wait(timeout=300)
        except threading.BrokenBarrierError:
            started = False
        got = [self.results.get(timeout=seconds + 300) for _ in range(self.n)]
        if not started:
            self.barrier.reset()
        errors = [e for *_, e in got if e]
        if errors:
            return {"status": "raises", "error": errors[0]}
        writes = sum(n for _, n, _, _ in got)
        rate = sum(n / el for _, n, el, _ in got if el > 0)
        return {
            "status": "ok",
            "writes": writes,
            "writes_per_s": rate,
            "per_writer": [{"writes": n, "seconds": el} for _, n, el, _ in sorted(got)],
        }
