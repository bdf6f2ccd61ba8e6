#!/usr/bin/env python3
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

    python tools/bench.py                       # full run (10,000 elements, 64 MiB leaf, 10 s mp)
    python tools/bench.py --quick --json out.json   # CI smoke run (1,000 elements, 8 MiB, 1 s mp)
    python tools/bench.py --large               # also a 1 GiB leaf
    python tools/bench.py --url redis://127.0.0.1:7000/0   # a server you started yourself

The JSON (``--json``) holds, per case and operation, each contender's median,
mean, min and p90 in ms (or ``{"status": "raises", "error": ...}``), the number of
server commands one call executed (scripts' inner commands included), and the
two ratios; ``mp`` holds element writes per second per contender.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

REPO = Path(__file__).resolve().parent.parent
# Benchmark the checkout this script lives in (also what CI installed from).
if (REPO / "tdstore" / "__init__.py").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import redis  # noqa: E402
import tensordict  # noqa: E402
import torch  # noqa: E402
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack  # noqa: E402

import tdstore  # noqa: E402
from tdstore import LazyStackedTensorDictStore  # noqa: E402
from tdstore.server import EmbeddedServer, commandstats  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning, module="tensordict")

try:  # the reference is optional: without it its column reads "unavailable"
    from tensordict.store import LazyStackedTensorDictStore as RefLazy
except ImportError:  # pragma: no cover - tensordict 0.15.3 ships it
    RefLazy = None

CONTENDERS = ("tdstore", "reference", "raw")
SYSTEM_REDIS = "/usr/bin/redis-server"
MiB = 1 << 20
GiB = 1 << 30

#: Operations per case, in the order they run (the shape-changing write last: it
#: changes element sizes that the other heterogeneous operations rely on).
OPERATIONS: dict[str, tuple[str, ...]] = {
    "homogeneous": ("upload", "element_read", "element_write", "batch_read", "slice_read", "full_read", "extend", "fill"),
    "heterogeneous": (
        "upload",
        "element_read",
        "element_write",
        "batch_read",
        "slice_read",
        "full_read",
        "padded_batch",
        "nested_batch",
        "padded_slice",
        "nested_slice",
        "padded_full",
        "nested_full",
        "shape_change_write",
    ),
    "large": ("large_read", "large_write"),
}

TOKENS_PERIOD = 17  # element i of the heterogeneous case holds tokens i64[1 + i % 17]
EXTEND_ROWS = 500  # rows per extend (torchrl's benchmark workload: fill 5,000 rows in chunks of 500)
FILL_ROWS = 5_000
LEARNER_BATCH = 256  # the learner's sample under writers; they extend WRITER_ROWS rows at a time
WRITER_ROWS = 100


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """What to run and how often; ``--quick`` shrinks everything."""

    count: int = 10_000
    batch: int = 256
    reps: dict[str, int] = field(default_factory=dict)
    warmup: int = 2
    min_reps: int = 3
    op_budget_s: float = 30.0
    large_leaf_bytes: tuple[int, ...] = (64 * MiB,)
    large_count: int = 16
    mp_seconds: float = 10.0
    mp_writers: int = 4
    seed: int = 0
    quick: bool = False

    def reps_for(self, op: str) -> int:
        """Timed repetitions of ``op`` (each runs every contender once)."""
        return self.reps.get(op, 10)


FULL_REPS = {
    "upload": 5,
    "element_read": 300,
    "element_write": 300,
    "shape_change_write": 300,
    "batch_read": 60,
    "slice_read": 100,
    "full_read": 10,
    "padded_batch": 60,
    "nested_batch": 60,
    "padded_slice": 100,
    "nested_slice": 100,
    "padded_full": 10,
    "nested_full": 10,
    "large_read": 7,
    "large_write": 7,
    "extend": 60,
    "fill": 7,
}
QUICK_REPS = {
    "upload": 2,
    "element_read": 30,
    "element_write": 30,
    "shape_change_write": 30,
    "batch_read": 10,
    "slice_read": 10,
    "full_read": 3,
    "padded_batch": 10,
    "nested_batch": 10,
    "padded_slice": 10,
    "nested_slice": 10,
    "padded_full": 3,
    "nested_full": 3,
    "large_read": 3,
    "large_write": 3,
    "extend": 5,
    "fill": 2,
}


def make_settings(args: argparse.Namespace) -> Settings:
    """Settings from the command line (``--quick`` first, explicit flags override it)."""
    quick = bool(args.quick)
    count = args.count if args.count is not None else (1_000 if quick else 10_000)
    large = (8 * MiB,) if quick else (64 * MiB,)
    if args.large and not quick:
        large = (*large, 1 * GiB)
    mp_seconds = args.mp_seconds if args.mp_seconds is not None else (1.0 if quick else 10.0)
    reps = dict(QUICK_REPS if quick else FULL_REPS)
    if args.reps_scale != 1.0:
        reps = {k: max(1, round(v * args.reps_scale)) for k, v in reps.items()}
    return Settings(
        count=count,
        batch=min(256, count),
        reps=reps,
        warmup=1 if quick else 2,
        min_reps=1 if quick else 3,
        op_budget_s=1.5 if quick else 30.0,
        large_leaf_bytes=large,
        mp_seconds=mp_seconds,
        mp_writers=args.mp_writers,
        seed=args.seed,
        quick=quick,
    )


# --------------------------------------------------------------------------- data
def make_element(i: int, het: bool, gen: torch.Generator, tokens_len: int | None = None) -> TensorDict:
    """Element ``i`` of the workload: obs f32[64], action f32[4], reward f32[1], nested.b i64[3] (+ tokens)."""
    d: dict[str, Any] = {
        "obs": torch.randn(64, generator=gen),
        "action": torch.randn(4, generator=gen),
        "reward": torch.randn(1, generator=gen),
        "nested": {"b": torch.randint(0, 1 << 30, (3,), generator=gen)},
    }
    if het:
        n = tokens_len if tokens_len is not None else 1 + i % TOKENS_PERIOD
        d["tokens"] = torch.randint(0, 50_000, (n,), generator=gen)
    return TensorDict(d, batch_size=[])


def make_batch(n: int, gen: torch.Generator) -> TensorDict:
    """``n`` rows of the homogeneous workload as one dense tensordict (what an actor extends a ring with)."""
    return TensorDict(
        {
            "obs": torch.randn(n, 64, generator=gen),
            "action": torch.randn(n, 4, generator=gen),
            "reward": torch.randn(n, 1, generator=gen),
            "nested": {"b": torch.randint(0, 1 << 30, (n, 3), generator=gen)},
        },
        batch_size=[n],
    )


def make_stack(count: int, het: bool, seed: int) -> LazyStackedTensorDict:
    """The lazy stack every contender uploads (the same object for all of them)."""
    gen = torch.Generator().manual_seed(seed)
    return lazy_stack([make_element(i, het, gen) for i in range(count)])


def make_large_stack(count: int, leaf_bytes: int, seed: int) -> LazyStackedTensorDict:
    """``count`` elements of one f32 leaf ``big``, ``leaf_bytes`` in all."""
    per = leaf_bytes // count // 4
    gen = torch.Generator().manual_seed(seed)
    return lazy_stack([TensorDict(big=torch.randn(per, generator=gen), batch_size=[]) for _ in range(count)])


def _path_key(path: tuple[str, ...]) -> str | tuple[str, ...]:
    return path[0] if len(path) == 1 else path


@dataclass
class RawLeaf:
    """One leaf of the raw floor, in tdstore's layout: an element-major blob (+ tables if heterogeneous)."""

    path: tuple[str, ...]
    number: int
    dtype: torch.dtype
    ndim: int
    het: bool
    offsets: np.ndarray  # count + 1 byte offsets of the elements in the blob
    blob: bytes
    offsets_bytes: bytes = b""
    shapes_bytes: bytes = b""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def raw_layout(stack: LazyStackedTensorDict) -> list[RawLeaf]:
    """The bytes the raw floor stores, computed once, outside any timing."""
    elements = stack.tensordicts
    out = []
    paths = [k if isinstance(k, tuple) else (k,) for k in elements[0].keys(include_nested=True, leaves_only=True)]
    for number, path in enumerate(paths):
        key = _path_key(path)
        tensors = [el.get(key) for el in elements]
        shapes = {tuple(t.shape) for t in tensors}
        sizes = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
        offsets = np.zeros(len(tensors) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        blob = b"".join(bytes(tensor_bytes(t)) for t in tensors)
        het = len(shapes) > 1
        leaf = RawLeaf(path, number, tensors[0].dtype, tensors[0].ndim, het, offsets, blob)
        if het:
            leaf.offsets_bytes = offsets.astype("<i8").tobytes()
            leaf.shapes_bytes = np.asarray([s for t in tensors for s in t.shape], dtype="<i8").tobytes()
        out.append(leaf)
    return out


def runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Inclusive ``(lo, hi)`` runs of consecutive ids (as tdstore groups a batch read)."""
    if sorted_ids.size == 0:
        return []
    breaks = np.nonzero(np.diff(sorted_ids) != 1)[0]
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [sorted_ids.size - 1]))
    return [(int(sorted_ids[a]), int(sorted_ids[b])) for a, b in zip(starts, ends, strict=True)]


# --------------------------------------------------------------------------- raw floor
class RawFloor:
    """One pipeline of plain commands per operation, moving the bytes tdstore moves.

    The floor keeps its own copy of the data under its own keys, knows every
    offset client-side (so a heterogeneous element costs one pipeline, not a
    lookup first), never decodes what it reads and never builds a TensorDict.
    """

    def __init__(self, client: redis.Redis, base: str, leaves: list[RawLeaf]) -> None:
        self.client = client
        self.base = base
        self.leaves = leaves

    def key(self, kind: str, leaf: RawLeaf, base: str | None = None) -> str:
        """Server key of a leaf's data ('d'), offsets ('o') or shapes ('s')."""
        return f"{base or self.base}:{kind}:{leaf.number}"

    def _pipe(self) -> Any:
        return self.client.pipeline(transaction=False)

    def upload(self, base: str | None = None) -> list:
        """SET every blob and table (the bytes ``from_lazy_stack`` sends)."""
        pipe = self._pipe()
        for leaf in self.leaves:
            pipe.set(self.key("d", leaf, base), leaf.blob)
            if leaf.het:
                pipe.set(self.key("o", leaf, base), leaf.offsets_bytes)
                pipe.set(self.key("s", leaf, base), leaf.shapes_bytes)
        return pipe.execute()

    def drop(self, base: str) -> None:
        """Delete the keys of an upload made under ``base`` (untimed clean-up)."""
        keys = [self.key(k, leaf, base) for leaf in self.leaves for k in ("d", "o", "s")]
        self.client.delete(*keys)

    def _read_runs(self, pipe: Any, lohi: Sequence[tuple[int, int]]) -> None:
        for leaf in self.leaves:
            d = self.key("d", leaf)
            for lo, hi in lohi:
                a, b = int(leaf.offsets[lo]), int(leaf.offsets[hi + 1])
                if leaf.het:
                    pipe.getrange(self.key("o", leaf), 8 * lo, 8 * (hi + 2) - 1)
                    pipe.getrange(self.key("s", leaf), 8 * leaf.ndim * lo, 8 * leaf.ndim * (hi + 1) - 1)
                pipe.getrange(d, a, b - 1)

    def read_runs(self, lohi: Sequence[tuple[int, int]]) -> list:
        """GETRANGE each run of every leaf (plus its offset and shape records when heterogeneous)."""
        pipe = self._pipe()
        self._read_runs(pipe, lohi)
        return pipe.execute()

    def read_element(self, i: int) -> list:
        """Element ``i`` of every leaf."""
        return self.read_runs([(i, i)])

    def read_batch(self, idx: np.ndarray) -> list:
        """The distinct elements of ``idx``, grouped in runs of consecutive ids as tdstore does."""
        return self.read_runs(runs(np.unique(idx)))

    def read_all(self) -> list:
        """GET every blob and table."""
        pipe = self._pipe()
        for leaf in self.leaves:
            pipe.get(self.key("d", leaf))
            if leaf.het:
                pipe.get(self.key("o", leaf))
                pipe.get(self.key("s", leaf))
        return pipe.execute()

    def write_ops(self, i: int, td: TensorDict) -> list[tuple[str, int, bytes | memoryview]]:
        """The SETRANGEs that write element ``i`` = ``td`` (computed outside the timing)."""
        ops: list[tuple[str, int, bytes | memoryview]] = []
        for leaf in self.leaves:
            t = td.get(_path_key(leaf.path))
            ops.append((self.key("d", leaf), int(leaf.offsets[i]), tensor_bytes(t)))
            if leaf.het and leaf.ndim:
                ops.append((self.key("s", leaf), 8 * leaf.ndim * i, np.asarray(t.shape, dtype="<i8").tobytes()))
        return ops

    def write(self, ops: list[tuple[str, int, bytes | memoryview]]) -> list:
        """One pipeline of SETRANGEs."""
        pipe = self._pipe()
        for key, offset, data in ops:
            pipe.setrange(key, offset, data)
        return pipe.execute()


# --------------------------------------------------------------------------- measuring
@dataclass
class Contender:
    """How one contender runs one operation: ``call(args)``, then ``post(result)`` untimed."""

    name: str
    call: Callable[[Any], Any]
    post: Callable[[Any], None] | None = None


@dataclass
class OpOutcome:
    """What was measured for one contender on one operation."""

    samples_ns: list[int] = field(default_factory=list)
    error: str | None = None
    commands: dict[str, int] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON form: timings in ms, or the error it raised."""
        if self.error is not None:
            return {"status": "raises", "error": self.error, "commands": self.commands}
        if not self.samples_ns:
            return {"status": "not run"}
        ms = sorted(s / 1e6 for s in self.samples_ns)
        return {
            "status": "ok",
            "n": len(ms),
            "median_ms": statistics.median(ms),
            "mean_ms": statistics.fmean(ms),
            "min_ms": ms[0],
            "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "commands": self.commands,
        }


def _describe(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:200]}"


def _command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands executed between two ``commandstats`` snapshots, minus the first INFO itself."""
    out = {}
    for name, n in after.items():
        if "|" in name:  # redis 7 lists subcommands both as 'script|load' and 'script'
            continue
        d = n - before.get(name, 0) - (1 if name == "info" else 0)
        if d:
            out[name] = d
    return out


def measure(
    contenders: Sequence[Contender],
    next_args: Callable[[], Any],
    *,
    reps: int,
    settings: Settings,
    stats_client: redis.Redis | None,
) -> dict[str, OpOutcome]:
    """Run warm-up rounds, one command-counting round, then ``reps`` timed rounds.

    Every round draws its arguments once and runs each contender on them, the
    order rotating from round to round.  A contender that raises is recorded
    with its error and skipped from then on.  Rounds stop early once
    ``settings.min_reps`` are done and the operation took ``op_budget_s``.
    """
    out = {c.name: OpOutcome() for c in contenders}

    def one(c: Contender, args: Any, timed: bool, count_commands: bool = False) -> None:
        res = out[c.name]
        if res.error is not None:
            return
        before = commandstats(stats_client) if count_commands and stats_client is not None else None
        try:
            t0 = time.perf_counter_ns()
            result = c.call(args)
            t1 = time.perf_counter_ns()
        except Exception as err:  # recorded, e.g. the reference on heterogeneous batches
            res.error = _describe(err)
            return
        finally:
            if before is not None:
                res.commands = _command_delta(before, commandstats(stats_client))
        if c.post is not None:
            c.post(result)
        if timed:
            res.samples_ns.append(t1 - t0)

    for _ in range(settings.warmup):
        args = next_args()
        for c in contenders:
            one(c, args, False)
    if stats_client is not None:
        args = next_args()
        for c in contenders:
            one(c, args, False, count_commands=True)
    start = time.monotonic()
    for rep in range(reps):
        args = next_args()
        k = rep % len(contenders)
        for c in (*contenders[k:], *contenders[:k]):
            one(c, args, True)
        if rep + 1 >= settings.min_reps and time.monotonic() - start > settings.op_budget_s:
            break
    return out


# --------------------------------------------------------------------------- server
@dataclass
class Target:
    """Where the contenders connect: a URL (tdstore, raw) and the reference's keywords."""

    url: str
    ref_kwargs: dict[str, Any]
    server_version: str
    started_here: bool

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


def reference_kwargs(url: str) -> dict[str, Any]:
    """``host``/``port``/``db`` or ``unix_socket_path`` for the reference, from a URL."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    kw: dict[str, Any] = {}
    if parts.scheme == "unix":
        kw["unix_socket_path"] = unquote(parts.path)
        kw["db"] = int(query.get("db", ["0"])[0])
    elif parts.scheme in ("redis", "rediss"):
        kw["host"] = parts.hostname or "localhost"
        kw["port"] = parts.port or 6379
        path_db = parts.path.lstrip("/")
        kw["db"] = int(path_db) if path_db else int(query.get("db", ["0"])[0])
        if parts.scheme == "rediss":
            kw["ssl"] = True
    else:
        raise SystemExit(f"--url must be redis://, rediss:// or unix://, got {url!r}")
    if parts.password:
        kw["password"] = unquote(parts.password)
    if parts.username:
        kw["username"] = unquote(parts.username)
    return kw


@contextlib.contextmanager
def open_target(args: argparse.Namespace, settings: Settings) -> Iterator[Target]:
    """Start a private redis-server (or use ``--url``) for the whole run."""
    if args.url:
        client = redis.Redis.from_url(args.url)
        version = str(client.info("server")["redis_version"])
        client.close()
        yield Target(args.url, reference_kwargs(args.url), version, False)
        return
    binary = SYSTEM_REDIS if os.path.exists(SYSTEM_REDIS) else None
    extra: list[str] = []
    if max(settings.large_leaf_bytes) >= 256 * MiB:
        # one command then carries a whole leaf: raise the 512 MiB / 1 GiB defaults
        extra += ["--proto-max-bulk-len", "4gb", "--client-query-buffer-limit", "4gb"]
    with EmbeddedServer(unix_socket=not args.tcp, binary=binary, extra_args=extra) as srv:
        yield Target(srv.url, reference_kwargs(srv.url), srv.version, True)


# --------------------------------------------------------------------------- cases
def _materialize(x: Any) -> Any:
    """A slice read's result as local tensors (tdstore and the reference already return them)."""
    if type(x) in (TensorDict, LazyStackedTensorDict):
        return x
    return x.to_tensordict()


@dataclass
class Stores:
    """The working stores of one case, one per contender."""

    tdstore: LazyStackedTensorDictStore
    reference: Any
    raw: RawFloor
    stack: LazyStackedTensorDict
    leaves: list[RawLeaf]


class Runner:
    """Runs the cases and collects the report."""

    def __init__(self, target: Target, settings: Settings) -> None:
        self.target = target
        self.settings = settings
        self.run_id = uuid.uuid4().hex[:8]
        self.prefix = f"tdbench-{self.run_id}"
        self.client = target.client()
        self.stats_client: redis.Redis | None = target.client()
        try:
            commandstats(self.stats_client)
        except redis.RedisError:
            self.stats_client = None
        self.rng = np.random.default_rng(settings.seed)
        self.gen = torch.Generator().manual_seed(settings.seed + 1)
        self.results: list[dict[str, Any]] = []
        self.problems: list[str] = []  # tdstore or the raw floor failed: the run exits 1
        self.notes: list[str] = []  # the reference misbehaved: reported only
        self.mp_stores: dict[str, Stores] = {}
        self._refs: list[Any] = []

    # -- stores --------------------------------------------------------------
    def upload_all(self, case: str, stack: LazyStackedTensorDict) -> Stores:
        """The working stores of a case (untimed), checked against the local data."""
        td = LazyStackedTensorDictStore.from_lazy_stack(stack, url=self.target.url, prefix=f"{self.prefix}-td-{case}")
        ref = None
        if RefLazy is not None:
            try:
                ref = RefLazy.from_lazy_stack(stack, prefix=f"{self.prefix}-ref-{case}", **self.target.ref_kwargs)
                self._refs.append(ref)
            except Exception as err:  # pragma: no cover - reported, the run goes on
                self.notes.append(f"{case}: the reference could not upload: {_describe(err)}")
        leaves = raw_layout(stack)
        raw = RawFloor(self.client, f"{self.prefix}-raw-{case}", leaves)
        raw.upload()
        stores = Stores(td, ref, raw, stack, leaves)
        self.verify(case, stores)
        return stores

    def verify(self, case: str, s: Stores) -> None:
        """Spot-check a few elements of every contender against the local stack (untimed)."""
        count = len(s.stack.tensordicts)
        for i in sorted({0, count - 1, int(self.rng.integers(count))}):
            want = s.stack.tensordicts[i]
            got = s.tdstore[i].to_tensordict()
            if not _same(got, want):
                self.problems.append(f"{case}: tdstore element {i} differs from the uploaded data")
            if s.reference is not None:
                with contextlib.suppress(Exception):
                    if not _same(s.reference[i].to_tensordict(), want):
                        self.notes.append(f"{case}: reference element {i} differs from the uploaded data")
            pieces = iter(s.raw.read_element(i))
            for leaf in s.leaves:
                if leaf.het:
                    next(pieces), next(pieces)  # offset and shape records
                data = next(pieces)
                if data != bytes(tensor_bytes(want.get(_path_key(leaf.path)))):
                    self.problems.append(f"{case}: the raw floor's copy of element {i}, leaf {leaf.path}, differs")

    def check_written(self, case: str, op: str, s: Stores, written: tuple[int, TensorDict]) -> None:
        """The element written last (by every contender, in the last round) reads back from tdstore."""
        i, td = written
        if not _same(s.tdstore[i].to_tensordict(), td):
            self.problems.append(f"{case}/{op}: tdstore element {i} does not read back what was written")

    def drop(self, s: Stores) -> None:
        with contextlib.suppress(Exception):
            s.tdstore.clear_redis()
            s.tdstore.close()
        if s.reference is not None:
            with contextlib.suppress(Exception):
                s.reference.clear_redis()
        keys = [s.raw.key(k, leaf) for leaf in s.leaves for k in ("d", "o", "s")]
        self.client.delete(*keys)

    def close(self) -> None:
        for ref in self._refs:
            with contextlib.suppress(Exception):
                ref.close()
        self.client.close()
        if self.stats_client is not None:
            self.stats_client.close()

    # -- recording -------------------------------------------------------------
    def record(self, case: str, op: str, outcomes: dict[str, OpOutcome], extra: dict[str, Any] | None = None) -> None:
        entry: dict[str, Any] = {"case": case, "op": op}
        for name in CONTENDERS:
            entry[name] = outcomes[name].summary() if name in outcomes else {"status": "unavailable"}
        td = entry["tdstore"].get("median_ms")
        for name, label in (("reference", "ratio_ref"), ("raw", "ratio_raw")):
            other = entry[name].get("median_ms")
            entry[label] = td / other if td and other else None
        if extra:
            entry.update(extra)
        self.results.append(entry)
        for name in ("tdstore", "raw"):
            if entry[name].get("status") != "ok":
                self.problems.append(f"{case}/{op}: {name} {entry[name].get('status')}: {entry[name].get('error', '')}")
        print(_row(entry), flush=True)

    def run(
        self, case: str, op: str, contenders: list[Contender], next_args: Callable[[], Any], extra: dict[str, Any] | None = None
    ) -> None:
        t0 = time.monotonic()
        outcomes = measure(contenders, next_args, reps=self.settings.reps_for(op), settings=self.settings, stats_client=self.stats_client)
        self.record(case, op, outcomes, {**(extra or {}), "seconds": round(time.monotonic() - t0, 2)})

    # -- the element cases -----------------------------------------------------
    def element_case(self, case: str, het: bool) -> None:
        """Upload, element/batch/slice/full reads and element writes on count elements."""
        st = self.settings
        stack = make_stack(st.count, het, st.seed + (1 if het else 0))
        s = self.upload_all(case, stack)
        count, batch = st.count, st.batch
        lengths = np.array([1 + i % TOKENS_PERIOD for i in range(count)], dtype=np.int64)
        ref = s.reference

        def with_ref(make: Callable[[Any], Contender]) -> list[Contender]:
            return [c for c in (make("tdstore"), make("reference") if ref is not None else None, make("raw")) if c is not None]

        # upload: a fresh store per call, deleted untimed
        def upload_td(_: Any) -> Any:
            return LazyStackedTensorDictStore.from_lazy_stack(stack, url=self.target.url, prefix=f"{self.prefix}-up")

        def upload_ref(_: Any) -> Any:
            return RefLazy.from_lazy_stack(stack, prefix=f"{self.prefix}-upref", **self.target.ref_kwargs)

        def drop_td(store: Any) -> None:
            store.clear_redis()
            store.close()

        def upload_raw(_: Any) -> str:
            base = f"{self.prefix}-upraw-{uuid.uuid4().hex[:6]}"
            s.raw.upload(base)
            return base

        up = [Contender("tdstore", upload_td, drop_td)]
        if ref is not None:
            up.append(Contender("reference", upload_ref, drop_td))
        up.append(Contender("raw", upload_raw, s.raw.drop))
        self.run(case, "upload", up, lambda: None)

        def elem_args() -> tuple[int, None]:
            return int(self.rng.integers(count)), None

        reads = {
            "tdstore": lambda a: s.tdstore[a[0]].to_tensordict(),
            "reference": lambda a: ref[a[0]].to_tensordict(),
            "raw": lambda a: s.raw.read_element(a[0]),
        }
        self.run(case, "element_read", with_ref(lambda n: Contender(n, reads[n])), elem_args)

        last: dict[str, Any] = {}

        def write_args() -> tuple[int, TensorDict, list]:
            i = int(self.rng.integers(count))
            td = make_element(i, het, self.gen, int(lengths[i]))
            last["write"] = (i, td)
            return i, td, s.raw.write_ops(i, td)

        writes = {
            "tdstore": lambda a: s.tdstore.__setitem__(a[0], a[1]),
            "reference": lambda a: ref.__setitem__(a[0], a[1]),
            "raw": lambda a: s.raw.write(a[2]),
        }
        self.run(case, "element_write", with_ref(lambda n: Contender(n, writes[n])), write_args)
        self.check_written(case, "element_write", s, last["write"])

        def batch_args() -> tuple[torch.Tensor, np.ndarray]:
            idx = torch.from_numpy(self.rng.integers(0, count, size=batch, dtype=np.int64))
            return idx, idx.numpy()

        batches = {
            "tdstore": lambda a: s.tdstore[a[0]],
            "reference": lambda a: ref[a[0]],
            "raw": lambda a: s.raw.read_batch(a[1]),
        }
        self.run(case, "batch_read", with_ref(lambda n: Contender(n, batches[n])), batch_args, {"batch": batch})

        def slice_args() -> int:
            return int(self.rng.integers(0, count - batch + 1))

        slices = {
            "tdstore": lambda a: _materialize(s.tdstore[a : a + batch]),
            "reference": lambda a: _materialize(ref[a : a + batch]),
            "raw": lambda a: s.raw.read_runs([(a, a + batch - 1)]),
        }
        self.run(case, "slice_read", with_ref(lambda n: Contender(n, slices[n])), slice_args, {"batch": batch})

        fulls = {
            "tdstore": lambda a: s.tdstore.to_tensordict(),
            "reference": lambda a: ref.to_tensordict(),
            "raw": lambda a: s.raw.read_all(),
        }
        self.run(case, "full_read", with_ref(lambda n: Contender(n, fulls[n])), lambda: None)

        if het:
            # one tensor of the heterogeneous key instead of a lazy stack (the reference has no such read;
            # the raw floor moves every key of the same rows)
            padded = {
                "tdstore": lambda a: s.tdstore.get_at("tokens", a[0], as_padded_tensor=True),
                "reference": lambda a: ref[a[0]].get("tokens", as_padded_tensor=True),
                "raw": lambda a: s.raw.read_batch(a[1]),
            }
            self.run(case, "padded_batch", with_ref(lambda n: Contender(n, padded[n])), batch_args, {"batch": batch})
            nested = {
                "tdstore": lambda a: s.tdstore.get_at("tokens", a[0], as_nested_tensor=True),
                "reference": lambda a: ref[a[0]].get("tokens", as_nested_tensor=True),
                "raw": lambda a: s.raw.read_batch(a[1]),
            }
            self.run(case, "nested_batch", with_ref(lambda n: Contender(n, nested[n])), batch_args, {"batch": batch})
            padded_slices = {
                "tdstore": lambda a: s.tdstore.get_at("tokens", slice(a, a + batch), as_padded_tensor=True),
                "reference": lambda a: ref[a : a + batch].get("tokens", as_padded_tensor=True),
                "raw": lambda a: s.raw.read_runs([(a, a + batch - 1)]),
            }
            self.run(case, "padded_slice", with_ref(lambda n: Contender(n, padded_slices[n])), slice_args, {"batch": batch})
            jagged_slices = {
                "tdstore": lambda a: s.tdstore.get_at("tokens", slice(a, a + batch), as_nested_tensor=True),
                "reference": lambda a: ref[a : a + batch].get("tokens", as_nested_tensor=True),
                "raw": lambda a: s.raw.read_runs([(a, a + batch - 1)]),
            }
            self.run(case, "nested_slice", with_ref(lambda n: Contender(n, jagged_slices[n])), slice_args, {"batch": batch})
            whole = {
                "tdstore": lambda a: s.tdstore.get("tokens", as_padded_tensor=True),
                "reference": lambda a: ref.get("tokens", as_padded_tensor=True),
                "raw": lambda a: s.raw.read_all(),
            }
            self.run(case, "padded_full", with_ref(lambda n: Contender(n, whole[n])), lambda: None)
            jagged = {
                "tdstore": lambda a: s.tdstore.get("tokens", as_nested_tensor=True),
                "reference": lambda a: ref.get("tokens", as_nested_tensor=True),
                "raw": lambda a: s.raw.read_all(),
            }
            self.run(case, "nested_full", with_ref(lambda n: Contender(n, jagged[n])), lambda: None)

            def change_args() -> tuple[int, TensorDict, list]:
                i = int(self.rng.integers(count))
                new = int(lengths[i]) % TOKENS_PERIOD + 1  # always differs from the stored length
                lengths[i] = new
                td = make_element(i, het, self.gen, new)
                last["write"] = (i, td)
                return i, td, s.raw.write_ops(i, td)

            self.run(case, "shape_change_write", with_ref(lambda n: Contender(n, writes[n])), change_args)
            self.check_written(case, "shape_change_write", s, last["write"])

        if not het:
            self.ring_ops(case, s)
        self.mp_stores[case] = s  # kept for the side-by-side pass (and, homogeneous, the multi-process case)

    def ring_ops(self, case: str, s: Stores) -> None:
        """``extend`` of ``EXTEND_ROWS`` rows at the ring's cursor, and a ``fill`` of ``FILL_ROWS`` rows in
        such extends (torchrl's benchmark workload). tdstore: ``store.extend`` (slots reserved and written
        in one atomic call); the reference: ``ref[a:a + n] = batch`` at the same cursor (what torchrl's
        ``StoreStorage`` does over it); raw: one ``SETRANGE`` per leaf of the rows' bytes, converted from
        the tensors in the call as the others do."""
        count, ref = self.settings.count, s.reference
        n = min(EXTEND_ROWS, count)
        layout = [(s.raw.key("d", leaf), _path_key(leaf.path), int(leaf.offsets[1])) for leaf in s.leaves]
        cursor = {"tdstore": 0, "reference": 0, "raw": 0}

        def at(name: str) -> int:
            a = cursor[name]
            cursor[name] = (a + n) % (count - count % n) if count >= n else 0
            return a

        def raw_rows(a: int, td: TensorDict) -> list:
            pipe = self.client.pipeline(transaction=False)
            for key, path, eb in layout:
                pipe.setrange(key, a * eb, tensor_bytes(td.get(path)))
            return pipe.execute()

        def ref_rows(td: TensorDict) -> None:
            a = at("reference")
            ref[a : a + n] = td

        ring: dict[str, Callable[[TensorDict], Any]] = {
            "tdstore": lambda td: s.tdstore.extend(td),
            "reference": ref_rows,
            "raw": lambda td: raw_rows(at("raw"), td),
        }
        names = [name for name in ring if name != "reference" or ref is not None]
        self.run(
            case, "extend", [Contender(name, lambda a, f=ring[name]: f(a)) for name in names], lambda: make_batch(n, self.gen), {"rows": n}
        )
        batches = [make_batch(n, self.gen) for _ in range(max(1, min(FILL_ROWS, count) // n))]
        fills = [Contender(name, lambda a, f=ring[name]: [f(b) for b in batches]) for name in names]
        self.run(case, "fill", fills, lambda: None, {"rows": n * len(batches), "per_extend": n})
        if not _same(s.tdstore[(s.tdstore.write_count - 1) % count].to_tensordict(), batches[-1][-1]):
            self.problems.append(f"{case}/fill: tdstore's last extended row does not read back")

    # -- heterogeneous against homogeneous ------------------------------------------
    def het_vs_hom_case(self) -> list[dict[str, Any]]:
        """tdstore's heterogeneous reads against the same reads of the homogeneous store (same rows),
        or against the raw floor of the heterogeneous store for whole reads: timed side by side,
        alternating within each round, away from the reference's much slower calls (whose
        aftermath would fall on whichever read comes next)."""
        het, hom = self.mp_stores["heterogeneous"], self.mp_stores["homogeneous"]
        count, batch = self.settings.count, self.settings.batch

        def batch_args() -> torch.Tensor:
            return torch.from_numpy(self.rng.integers(0, count, size=batch, dtype=np.int64))

        def slice_args() -> slice:
            a = int(self.rng.integers(0, count - batch + 1))
            return slice(a, a + batch)

        tokens = {"padded": {"as_padded_tensor": True}, "nested": {"as_nested_tensor": True}}
        pairs: list[tuple[str, Callable[[Any], Any], str, Callable[[Any], Any], Callable[[], Any]]] = [
            ("batch_read", lambda a: het.tdstore[a], "homogeneous batch_read", lambda a: hom.tdstore[a], batch_args),
            (
                "slice_read",
                lambda a: _materialize(het.tdstore[a]),
                "homogeneous slice_read",
                lambda a: _materialize(hom.tdstore[a]),
                slice_args,
            ),
            (
                "full_read",
                lambda a: het.tdstore.to_tensordict(),
                "raw floor of heterogeneous full_read",
                lambda a: het.raw.read_all(),
                lambda: None,
            ),
        ]
        for kind, kw in tokens.items():
            pairs += [
                (
                    f"{kind}_batch",
                    lambda a, kw=kw: het.tdstore.get_at("tokens", a, **kw),
                    "homogeneous batch_read",
                    lambda a: hom.tdstore[a],
                    batch_args,
                ),
                (
                    f"{kind}_slice",
                    lambda a, kw=kw: het.tdstore.get_at("tokens", a, **kw),
                    "homogeneous slice_read",
                    lambda a: _materialize(hom.tdstore[a]),
                    slice_args,
                ),
                (
                    f"{kind}_full",
                    lambda a, kw=kw: het.tdstore.get("tokens", **kw),
                    "raw floor of heterogeneous full_read",
                    lambda a: het.raw.read_all(),
                    lambda: None,
                ),
            ]
        out = []
        for op, mine, label, theirs, next_args in pairs:
            reps = self.settings.reps_for(op)
            got = measure(
                [Contender("het", mine), Contender("against", theirs)], next_args, reps=reps, settings=self.settings, stats_client=None
            )
            a, b = got["het"].summary().get("median_ms"), got["against"].summary().get("median_ms")
            out.append({"op": op, "against": label, "ms": a, "against_ms": b, "ratio": a / b if a and b else None})
            print(f"  {op:<14} {_ratio(out[-1]['ratio']):>8}  against {label}", flush=True)
        return out

    # -- the large leaf ----------------------------------------------------------
    def large_case(self, leaf_bytes: int) -> None:
        """A leaf of ``leaf_bytes`` over ``large_count`` elements, read and written whole."""
        st = self.settings
        case = "large" if leaf_bytes == min(st.large_leaf_bytes) else f"large_{_size(leaf_bytes)}"
        stack = make_large_stack(st.large_count, leaf_bytes, st.seed + 7)
        s = self.upload_all(case, stack)
        ref = s.reference
        (leaf,) = s.leaves
        key = s.raw.key("d", leaf)
        value = torch.randn(st.large_count, leaf_bytes // st.large_count // 4, generator=self.gen)
        value_bytes = tensor_bytes(value)
        extra = {"leaf_bytes": leaf_bytes, "count": st.large_count}
        reads = [Contender("tdstore", lambda a: s.tdstore["big"])]
        writes = [Contender("tdstore", lambda a: s.tdstore.__setitem__("big", value))]
        if ref is not None:
            reads.append(Contender("reference", lambda a: ref["big"]))
            writes.append(Contender("reference", lambda a: ref.__setitem__("big", value)))
        reads.append(Contender("raw", lambda a: self.client.get(key)))
        # the whole value is replaced: SET is the cheaper plain command for the same bytes
        writes.append(Contender("raw", lambda a: self.client.set(key, value_bytes)))
        self.run(case, "large_read", reads, lambda: None, extra)
        self.run(case, "large_write", writes, lambda: None, extra)
        if not torch.equal(s.tdstore["big"], value):
            self.problems.append(f"{case}: tdstore does not read back the large leaf it wrote")
        self.drop(s)

    # -- multi-process ------------------------------------------------------------
    def mp_case(self) -> dict[str, Any]:
        """``mp_writers`` processes doing ``store[i] = td`` for ``mp_seconds``, per contender."""
        st = self.settings
        s: Stores = self.mp_stores["homogeneous"]
        jobs: list[tuple[str, Any]] = [("tdstore", s.tdstore)]
        if s.reference is not None:
            jobs.append(("reference", s.reference))
        raw_spec = (self.target.url, [(s.raw.key("d", leaf), _path_key(leaf.path), int(leaf.offsets[1])) for leaf in s.leaves])
        jobs.append(("raw", raw_spec))
        report: dict[str, Any] = {"writers": st.mp_writers, "seconds": st.mp_seconds, "count": st.count}
        with WriterPool(st.mp_writers) as pool:
            for name, target in jobs:
                report[name] = pool.run(name, target, st.mp_seconds, st.count, st.seed)
                line = report[name]
                if line.get("status") == "ok":
                    print(
                        f"  mp {name:<10} {line['writes_per_s']:>12,.0f} element writes/s  "
                        f"({st.mp_writers} writers, {line['writes']:,} writes)",
                        flush=True,
                    )
                else:
                    print(f"  mp {name:<10} {line.get('status')}: {line.get('error')}", flush=True)
            report["learner"] = self.learner_case(pool, s, jobs)
        td = report["tdstore"].get("writes_per_s")
        for name, label in (("reference", "ratio_ref"), ("raw", "ratio_raw")):
            other = report.get(name, {}).get("writes_per_s")
            report[label] = td / other if td and other else None
        for name in ("tdstore", "raw"):
            if report[name].get("status") != "ok":
                self.problems.append(f"mp: {name} {report[name].get('status')}: {report[name].get('error')}")
        self.drop(s)
        return report

    def learner_case(self, pool: WriterPool, s: Stores, jobs: list[tuple[str, Any]]) -> dict[str, Any]:
        """The learner under load: ``sample(LEARNER_BATCH)`` per second alone, then while every writer
        process extends ``WRITER_ROWS``-row batches as fast as it can (per contender: tdstore samples
        and extends its ring; the reference reads random rows and writes row slices; raw pipelines
        GETRANGEs and SETRANGEs of the same bytes). ``kept`` is the loaded rate over the idle one."""
        st, count = self.settings, self.settings.count
        samplers: dict[str, Callable[[], Any]] = {
            "tdstore": lambda: s.tdstore.sample(LEARNER_BATCH),
            "reference": lambda: s.reference[torch.from_numpy(self.rng.integers(0, count, LEARNER_BATCH))],
            "raw": lambda: s.raw.read_batch(np.sort(self.rng.integers(0, count, LEARNER_BATCH))),
        }

        def rate(sample: Callable[[], Any], seconds: float) -> float:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                sample()
                n += 1
            return n / (time.perf_counter() - t0)

        out: dict[str, Any] = {"batch": LEARNER_BATCH, "writer_rows": WRITER_ROWS, "writers": st.mp_writers}
        for name, target in jobs:
            sample = samplers[name]
            try:
                sample()
                idle = rate(sample, st.mp_seconds / 2)
                box: dict[str, Any] = {}
                writers = threading.Thread(
                    target=lambda b=box, k=f"{name}+extend", t=target: b.update(pool.run(k, t, st.mp_seconds, count, st.seed))
                )
                writers.start()
                time.sleep(min(1.0, st.mp_seconds / 5))  # the writers are past their barrier and warm
                loaded = rate(sample, st.mp_seconds / 2)
                writers.join()
            except Exception as err:  # recorded; the reference may not run under load
                out[name] = {"status": "raises", "error": _describe(err)}
                continue
            if box.get("status") != "ok":
                out[name] = {"status": "raises", "error": box.get("error")}
                continue
            rows = box["writes_per_s"] * WRITER_ROWS
            out[name] = {"status": "ok", "idle_per_s": idle, "loaded_per_s": loaded, "kept": loaded / idle, "writer_rows_per_s": rows}
            print(
                f"  learner {name:<10} sample({LEARNER_BATCH}) {idle:8,.0f}/s idle, {loaded:8,.0f}/s under {st.mp_writers} writers "
                f"({loaded / idle:.2f}x kept; writers {rows:,.0f} rows/s)",
                flush=True,
            )
        if out.get("tdstore", {}).get("status") != "ok":
            self.problems.append(f"learner: tdstore {out.get('tdstore')}")
        return out


def _same(a: Any, b: Any) -> bool:
    keys_a = {k if isinstance(k, tuple) else (k,) for k in a.keys(True, True)}
    keys_b = {k if isinstance(k, tuple) else (k,) for k in b.keys(True, True)}
    return keys_a == keys_b and all(torch.equal(a.get(_path_key(k)), b.get(_path_key(k))) for k in keys_a)


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


# --------------------------------------------------------------------------- report
def _size(n: int) -> str:
    return f"{n // GiB}GiB" if n >= GiB and n % GiB == 0 else f"{n / MiB:g}MiB"


def _cell(summary: dict[str, Any]) -> str:
    status = summary.get("status")
    if status == "ok":
        return f"{summary['median_ms']:.3f}"
    return str(status)


def _ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x else "-"


def _cmds(summary: dict[str, Any]) -> str:
    c = summary.get("commands")
    return str(sum(c.values())) if c else "-"


HEADER = (
    f"{'case':<14} {'op':<19} {'tdstore ms':>11} {'reference ms':>13} {'raw ms':>9} {'td/ref':>8} {'td/raw':>8} {'n':>5}  cmds td/ref/raw"
)


def _row(e: dict[str, Any]) -> str:
    n = e["tdstore"].get("n", "-")
    cmds = "/".join(_cmds(e[c]) for c in CONTENDERS)
    return (
        f"{e['case']:<14} {e['op']:<19} {_cell(e['tdstore']):>11} {_cell(e['reference']):>13} {_cell(e['raw']):>9} "
        f"{_ratio(e['ratio_ref']):>8} {_ratio(e['ratio_raw']):>8} {n!s:>5}  {cmds}"
    )


def print_table(report: dict[str, Any]) -> None:
    """The summary table: medians in ms and the two ratios (below 1: tdstore is faster)."""
    print()
    print(HEADER)
    print("-" * len(HEADER))
    for e in report["results"]:
        print(_row(e))
    if report.get("het_vs_hom"):
        print()
        print("heterogeneous reads against the homogeneous store's (tdstore ms / tdstore ms, side by side) or the raw floor:")
        for r in report["het_vs_hom"]:
            print(f"  {r['op']:<14} {_ratio(r['ratio']):>8}  against {r['against']}")
    mp = report.get("mp")
    if mp:
        print()
        print(
            f"multi-process: {mp['writers']} writers x {mp['seconds']:g} s of store[i] = td on {mp['count']:,} elements "
            "(element writes/s, higher is better)"
        )
        for name in CONTENDERS:
            line = mp.get(name, {"status": "unavailable"})
            value = f"{line['writes_per_s']:,.0f}" if line.get("status") == "ok" else f"{line.get('status')}: {line.get('error', '')}"
            print(f"  {name:<10} {value}")
        print(f"  tdstore/reference {_ratio(mp.get('ratio_ref'))}   tdstore/raw {_ratio(mp.get('ratio_raw'))}")
        learner = mp.get("learner") or {}
        if learner:
            print(
                f"learner under writers: sample({learner['batch']})/s alone and while {learner['writers']} processes extend "
                f"{learner['writer_rows']}-row batches (kept: loaded / idle, at least 0.5 is the goal)"
            )
            for name in CONTENDERS:
                line = learner.get(name, {"status": "unavailable"})
                if line.get("status") == "ok":
                    print(
                        f"  {name:<10} {line['idle_per_s']:,.0f}/s idle  {line['loaded_per_s']:,.0f}/s loaded  "
                        f"kept {line['kept']:.2f}x  writers {line['writer_rows_per_s']:,.0f} rows/s"
                    )
                else:
                    print(f"  {name:<10} {line.get('status')}: {line.get('error', '')}")
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    for note in report["notes"]:
        print(f"note: {note}")


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
        prog=os.environ.get("TDSTORE_BENCH_PROG") or "python tools/bench.py",
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
