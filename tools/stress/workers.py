"""The stress test's worker processes: writers, readers and the schema racer, and their tallies."""

from __future__ import annotations

import os
import pickle
import random
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDictBase

from tdstore import LazyStackedTensorDictStore
from tdstore._ring import direct_extend as _direct
from tools.stress.elements import (
    EXTRA_VALUE,
    MAX_EXAMPLES,
    READ_KINDS,
    READ_WEIGHTS,
    RING_READ_KINDS,
    RING_SLOTS,
    SCHEMA_KINDS,
    SEQ_LIMIT,
    SPARE_VALUES,
    SPARE_WIDTHS,
    WRITE_KINDS,
    _describe,
    check_element,
    check_ring_row,
    make_element,
    make_ring_rows,
    stack_batch,
)


# ---------------------------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------------------------
@dataclass
class Layout:
    """Rows, their owners and the writers' kinds."""

    writers: int
    rows_per_writer: int

    @property
    def count(self) -> int:
        return self.writers * self.rows_per_writer

    @property
    def owner(self) -> list[int]:
        return [r // self.rows_per_writer for r in range(self.count)]

    def block(self, w: int) -> tuple[int, int]:
        """The rows ``[lo, hi)`` that writer ``w`` owns."""
        return w * self.rows_per_writer, (w + 1) * self.rows_per_writer

    def kinds(self, w: int) -> tuple[str, ...]:
        """Write kinds of writer ``w``: one each with 5+ writers, else a share of all five."""
        if self.writers >= len(WRITE_KINDS):
            return (WRITE_KINDS[w % len(WRITE_KINDS)],)
        return WRITE_KINDS[w :: self.writers]


@dataclass
class WorkerConfig:
    """What every child process gets (picklable)."""

    store_blob: bytes
    layout: Layout
    seconds: float
    max_ops: int
    max_errors: int
    seed: int
    schema_interval: float = 0.0
    fault: str = "none"
    ring_blob: bytes = b""  # the ring store of --ring-writers (pickled), if any
    ring_writers: int = 0


@dataclass
class Tally:
    """What one process saw; merged by the parent."""

    name: str
    ops: Counter = field(default_factory=Counter)
    max_ms: dict[str, float] = field(default_factory=dict)
    torn: int = 0
    torn_examples: list[str] = field(default_factory=list)
    regressed: int = 0
    regress_examples: list[str] = field(default_factory=list)
    errors: int = 0
    error_kinds: Counter = field(default_factory=Counter)
    first_traceback: str | None = None
    last_seq: dict[int, int] = field(default_factory=dict)
    maybe_seq: dict[int, int] = field(default_factory=dict)
    elapsed: float = 0.0
    ring_rows: int = 0  # rows a ring writer extended
    ring_maybe: int = 0  # rows of extends that raised (they may or may not have gone in)
    ring_paths: Counter = field(default_factory=Counter)  # how the extends went (tdstore._ring.direct_extend.outcomes)

    def timed(self, kind: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as one op of ``kind``: count it and keep its worst latency."""
        t = time.perf_counter()
        out = fn()
        ms = (time.perf_counter() - t) * 1e3
        self.ops[kind] += 1
        if ms > self.max_ms.get(kind, 0.0):
            self.max_ms[kind] = ms
        return out

    def error(self, where: str) -> None:
        """Record the exception being handled."""
        exc = sys.exc_info()[1]
        self.errors += 1
        text = _normalise(str(exc).splitlines()[0])[:200] if str(exc) else ""
        self.error_kinds[f"{where}: {type(exc).__name__}: {text}"] += 1
        if self.first_traceback is None:
            self.first_traceback = f"[{self.name}, {where}]\n{traceback.format_exc()}"

    def torn_element(self, problem: str) -> None:
        self.torn += 1
        if len(self.torn_examples) < MAX_EXAMPLES:
            self.torn_examples.append(f"[{self.name}] {problem}")

    def regress(self, problem: str) -> None:
        self.regressed += 1
        if len(self.regress_examples) < MAX_EXAMPLES:
            self.regress_examples.append(f"[{self.name}] {problem}")


def _normalise(message: str) -> str:
    """Drop the run-specific parts of an error message (store id, prefix, socket) so that equal errors group."""
    message = re.sub(r"td_id '[^']*'", "td_id <id>", message)
    message = re.sub(r"prefix '[^']*'", "prefix <prefix>", message)
    return re.sub(r"(unix|rediss?)://[^\s)]+", "<server>", message)


class _Run:
    """The loop shared by every child: wait for the start, then do ops until stopped or bounded."""

    def __init__(self, name: str, cfg: WorkerConfig, go: Any, stop: Any) -> None:
        self.name = name
        self.cfg = cfg
        self.go = go
        self.stop = stop
        self.tally = Tally(name)
        self.store: LazyStackedTensorDictStore = pickle.loads(cfg.store_blob)
        self.rng = random.Random(f"{cfg.seed}:{name}")
        self.n = 0  # ops started so far

    def pick(self, kinds: Sequence[str], weights: Sequence[float] | None = None) -> str:
        """The kind of the next op: each kind once in turn first (so that short runs cover all), then at random."""
        if self.n <= len(kinds):
            return kinds[(self.n - 1) % len(kinds)]
        return self.rng.choices(kinds, weights)[0]

    def loop(self, step: Callable[[], bool]) -> None:
        """Call ``step`` until it returns False, the stop event, ``max_ops``, ``max_errors`` or the time bound."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.seconds + 5.0  # a bound of its own, should the stop event be missed
        while not self.stop.is_set() and self.n < self.cfg.max_ops and time.monotonic() < deadline:
            if self.tally.errors >= self.cfg.max_errors:
                break
            self.n += 1
            if not step():
                break
        self.tally.elapsed = time.monotonic() - t0


def _writer_step(run: _Run, w: int, seq_box: list[int]) -> bool:
    """One write of writer ``w`` with the next sequence number; False once the numbers run out."""
    layout, store, rng, tally = run.cfg.layout, run.store, run.rng, run.tally
    if seq_box[0] >= SEQ_LIMIT - 1:
        return False
    seq_box[0] += 1
    seq = seq_box[0]
    lo, hi = layout.block(w)
    kind = run.pick(layout.kinds(w))
    rows: list[int]
    if kind in ("element", "update"):
        rows = [rng.randrange(lo, hi)]
    elif kind in ("slice", "step"):
        a = rng.randrange(lo, hi)
        b = rng.randrange(a + 1, hi + 1)
        k = 1 if kind == "slice" else rng.randint(2, 4)
        rows = list(range(a, b, k))
    else:
        rows = rng.sample(range(lo, hi), rng.randint(1, min(8, hi - lo)))
        if rng.random() < 0.2:
            rows.append(rows[0])  # a duplicate: the later one wins, with the same value
    fault = run.cfg.fault
    # --fault rewind: now and then write an older seq (what a lost update looks like to readers)
    write_seq = seq - 5 if fault == "rewind" and seq > 5 and rng.random() < 0.2 else seq
    tds = [make_element(w, write_seq, r) for r in rows]
    value: TensorDictBase = tds[0] if kind in ("element", "update") else stack_batch(tds)

    def write(v: TensorDictBase) -> None:
        if kind == "element":
            store[rows[0]] = v
        elif kind == "update":
            store[rows[0]].update(v)
        elif kind == "slice":
            store[rows[0] : rows[-1] + 1] = v
        elif kind == "step":
            store[rows[0] : rows[-1] + 1 : rows[1] - rows[0] if len(rows) > 1 else 2] = v
        else:
            store[torch.tensor(rows, dtype=torch.int64)] = v

    try:
        if fault == "split":
            # --fault split: two calls, so readers can see the new leaves with the old stamp
            tally.timed(f"write.{kind}", lambda: write(value.exclude("stamp")))
            write(value.select("stamp"))
        else:
            tally.timed(f"write.{kind}", lambda: write(value))
    except Exception:
        tally.error(f"write.{kind}")
        for r in rows:  # the write may or may not have landed
            tally.maybe_seq[r] = seq
        return True
    for r in rows:
        tally.last_seq[r] = seq
    return True


class _Observer:
    """A reader's memory: the last seq it saw per row, to catch rows going back in time."""

    def __init__(self, tally: Tally, owner: Sequence[int]) -> None:
        self.tally = tally
        self.owner = owner
        self.last: dict[int, int] = {}

    def seq(self, row: int, seq: int, what: str) -> None:
        prev = self.last.get(row, 0)
        if seq < prev:
            self.tally.regress(f"row {row}: seq {seq} read by {what} after seq {prev} was seen")
        else:
            self.last[row] = seq

    def element(self, row: int, td: TensorDictBase, what: str) -> None:
        seq, problem = check_element(td, row, self.owner)
        if problem is not None:
            self.tally.torn_element(f"{what}: {problem}")
            return
        assert seq is not None
        self.seq(row, seq, what)

    def batch(self, rows: list[int], result: TensorDictBase, what: str) -> None:
        if tuple(result.batch_size) != (len(rows),):
            self.tally.torn_element(f"{what}: batch size {list(result.batch_size)} for {len(rows)} rows")
            return
        for row, td in zip(rows, result.unbind(0), strict=True):
            self.element(row, td, what)


def _reader_step(run: _Run, obs: _Observer) -> bool:
    """One read of a random kind, checked element by element."""
    store, rng, tally, n = run.store, run.rng, run.tally, run.cfg.layout.count
    kind = run.pick(READ_KINDS, READ_WEIGHTS)
    try:
        if kind == "element":
            row = rng.randrange(n)
            td = tally.timed("read.element", lambda: store[row].to_tensordict())
            obs.element(row, td, f"store[{row}].to_tensordict()")
        elif kind in ("slice", "step"):
            a = rng.randrange(n)
            b = rng.randrange(a + 1, min(n, a + 24) + 1)
            k = 1 if kind == "slice" else rng.randint(2, 5)
            res = tally.timed(f"read.{kind}", lambda: store[a:b:k])
            obs.batch(list(range(a, b, k)), res, f"store[{a}:{b}:{k}]")
        elif kind == "batch":
            # small batches go through read.lua, larger scattered ones through a MULTI/EXEC of plain GETRANGEs
            idx = torch.randint(0, n, (rng.randint(1, 16) if rng.random() < 0.5 else rng.randint(32, 96),))
            res = tally.timed("read.batch", lambda: store[idx])
            obs.batch(idx.tolist(), res, f"store[{idx.tolist()}]")
        elif kind == "rows":
            # one homogeneous key at many scattered rows: a MULTI/EXEC of plain GETRANGEs
            idx = torch.randint(0, n, (rng.randint(32, 128),))
            got = tally.timed("read.rows", lambda: store.get_at("obs", idx))
            for row, o in zip(idx.tolist(), got.unbind(0)):
                w, seq = int(o[0]), int(o[1])
                want = make_element(w, seq, row)["obs"] if w == obs.owner[row] and 0 <= seq < SEQ_LIMIT else None
                if want is None or not torch.equal(o, want):
                    tally.torn_element(f"store.get_at('obs', ...) row {row}: {_describe(o)}, not what writer {obs.owner[row]} writes")
                    return True
                obs.seq(row, seq, f"store.get_at('obs', {idx.tolist()})")
        else:
            col = tally.timed("read.column", lambda: store["stamp"])
            if tuple(col.shape) != (n, 2):
                tally.torn_element(f"store['stamp'] has shape {list(col.shape)}")
                return True
            for row, (w, seq) in enumerate(col.tolist()):
                if w != obs.owner[row]:
                    tally.torn_element(f"store['stamp']: row {row} stamped by writer {w}, owned by {obs.owner[row]}")
                else:
                    obs.seq(row, seq, "store['stamp']")
    except Exception:
        tally.error(f"read.{kind}")
    return True


def _ring_writer_step(run: _Run, ring: LazyStackedTensorDictStore, w: int, seq_box: list[int]) -> bool:
    """One extend of ring writer ``w``: 1-24 rows stamped with its next sequence number."""
    if seq_box[0] >= SEQ_LIMIT - 1:
        return False
    seq_box[0] += 1
    n = run.rng.randint(1, 24)
    rows = make_ring_rows(w, seq_box[0], n)
    try:
        run.tally.timed("write.ring_extend", lambda: ring.extend(rows))
    except Exception:
        run.tally.error("write.ring_extend")
        run.tally.ring_maybe += n
        return True
    run.tally.ring_rows += n
    return True


def _ring_reader_step(run: _Run, ring: LazyStackedTensorDictStore) -> bool:
    """One read of the ring (a sample, a slice or a random batch), checked row by row."""
    rng, tally, writers = run.rng, run.tally, run.cfg.ring_writers
    kind = run.pick(RING_READ_KINDS)
    try:
        if kind == "sample":
            if ring.write_count == 0:
                return True
            res = tally.timed("read.ring_sample", lambda: ring.sample(rng.randint(1, 48)).td)
            where = "ring.sample"
        elif kind == "slice":
            a = rng.randrange(RING_SLOTS)
            b = rng.randrange(a + 1, RING_SLOTS + 1)
            res = tally.timed("read.ring_slice", lambda: ring[a:b])
            where = f"ring[{a}:{b}]"
        else:
            idx = torch.randint(0, RING_SLOTS, (rng.randint(1, 64),))
            res = tally.timed("read.ring_batch", lambda: ring[idx])
            where = f"ring[{idx.tolist()}]"
        for k, td in enumerate(res.unbind(0)):
            if int(td["stamp"][0]) < 0:  # a slot no extend reached yet (zeros but for this mark)
                continue
            problem = check_ring_row(td, f"{where} row {k}", writers)
            if problem is not None:
                tally.torn_element(problem)
                return True
    except Exception:
        tally.error(f"read.ring_{kind}")
    return True


class _SchemaRacer:
    """Changes the schema over and over; keeps its own idea of the current schema."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.extra = False
        self.aux = "aux"
        self.spare = 0

    def step(self) -> bool:
        """One schema change of a random kind."""
        store, tally, n = self.run.store, self.run.tally, self.run.cfg.layout.count
        allowed = [k for k in SCHEMA_KINDS if k != ("add" if self.extra else "delete")]
        first = ("add", "rename", "dtype", "delete")  # every kind once first, so that short runs cover all
        kind = first[self.run.n - 1] if self.run.n <= len(first) and first[self.run.n - 1] in allowed else self.run.rng.choice(allowed)
        try:
            if kind == "add":
                tally.timed("schema.add", lambda: store.set("extra_k", torch.full((n, 3), EXTRA_VALUE, dtype=torch.float32)))
                self.extra = True
            elif kind == "delete":
                tally.timed("schema.delete", lambda: store.__delitem__("extra_k"))
                self.extra = False
            elif kind == "rename":
                new = "aux_renamed" if self.aux == "aux" else "aux"
                tally.timed("schema.rename", lambda: store.rename_key_(self.aux, new))
                self.aux = new
            else:
                nxt = (self.spare + 1) % len(SPARE_VALUES)
                dtype, value = SPARE_VALUES[nxt]
                width = SPARE_WIDTHS[nxt % len(SPARE_WIDTHS)]  # the dtype and the shape change together
                tally.timed("schema.dtype", lambda: store.set("spare", torch.full((n, width), value, dtype=dtype)))
                self.spare = nxt
        except Exception:
            tally.error(f"schema.{kind}")
            # resynchronise with the server, whatever happened
            keys = set(store.keys())
            self.extra = "extra_k" in keys
            self.aux = "aux_renamed" if "aux_renamed" in keys else "aux"
        if self.run.cfg.schema_interval > 0:
            time.sleep(self.run.cfg.schema_interval)
        return True


def child_main(role: str, index: int, cfg: WorkerConfig, go: Any, stop: Any, out: Any) -> None:
    """Entry point of every child process: ``role`` is "writer", "reader" or "schema"."""
    name = f"{role}{index}"
    torch.set_num_threads(1)
    tally = Tally(name)
    try:
        run = _Run(name, cfg, go, stop)
        tally = run.tally
        ring = pickle.loads(cfg.ring_blob) if role.startswith("ring") else None
        if ring is not None:
            ring[0].to_tensordict()  # connect before the clock starts
        else:
            run.store[0].to_tensordict()  # connect and load the scripts before the clock starts
        out.put(("ready", name, None))
        if not go.wait(timeout=600):
            raise TimeoutError("the parent never gave the start signal")
        if role == "writer":
            seq_box = [0]
            run.loop(lambda: _writer_step(run, index, seq_box))
        elif role == "reader":
            observer = _Observer(tally, cfg.layout.owner)
            run.loop(lambda: _reader_step(run, observer))
        elif role == "schema":
            racer = _SchemaRacer(run)
            run.loop(racer.step)
        elif role == "ringwriter" and ring is not None:
            ring_seq = [0]
            run.loop(lambda: _ring_writer_step(run, ring, index, ring_seq))
            tally.ring_paths.update(_direct.outcomes)
        elif role == "ringreader" and ring is not None:
            run.loop(lambda: _ring_reader_step(run, ring))
        else:
            raise ValueError(f"unknown role {role!r}")
    except Exception:
        tally.error("process")
        out.put(("ready", name, None))  # so that the parent does not wait for it
    out.put(("result", name, tally))
    out.close()
    out.join_thread()  # the result is in the pipe now
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter teardown: under load, a spawned child can spend many
    # seconds in the final GC of torch's objects (fork children skip it anyway).
    os._exit(0)
