"""Streaming upload of a lazy stack (or a dense tensordict) into a new store.

1. Scan the input (``_front.upload_scan``): keys, dtypes and shapes, checked before anything is
   written (keys present in only some elements, or a key with two dtypes, raise here).  Plain
   TensorDict members are read key by key with C-level passes, and each key's data is gathered
   in the same step (one ``torch.stack``/``torch.cat`` per key, up to ``chunk_bytes`` in all);
   a dense tensordict's columns are its keys' data as they are.
2. Create the header in state ``uploading:<token>`` with a short TTL.
3. Send the data in chunks bounded by element count *and* bytes, one round trip of plain
   ``SETRANGE`` commands per chunk (bulk bytes through Lua cost 4-5x the server CPU), the
   gathered bytes sent without a copy (:class:`Batch`), each renewing the TTL of every key.
4. ``commit.lua`` flips the state to ``ready`` and removes the TTLs atomically.

A failure deletes everything written so far; an uploader that dies leaves keys
that expire within ``UPLOAD_TTL_MS``.  Readers never see a half-uploaded store.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np
import redis
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensorclass

from tdstore._engine import batches, scripts, whole_store
from tdstore._engine.engine import Engine
from tdstore._engine.spread import deadline as spread_deadline
from tdstore._engine.spread import guard_fields
from tdstore._errors import StoreDamagedError
from tdstore._format import codec, integrity, row_block
from tdstore._format.schema import RAGGED, Header, Leaf, NestedPath, merge_sub
from tdstore._format.segments import Segments, segment_length
from tdstore._front.progress import progress
from tdstore._front.upload_scan import LeafScan, scan, scan_dense, scan_lazy, scan_plain, stack_elements
from tdstore._plan.values import display, gc_paused, refuse_unshown, subtree_classes, subtree_dims

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

    from tdstore._format.keys import StoreKeys

UPLOAD_TTL_MS = 120_000
RENEW_S = 10.0


@dataclass
class Scanned:
    """What the scan found: the stack's count, stack dim and inner batch size, its leaves, its
    sub-trees' extra batch dims (``Header.sub``) and its device."""

    count: int
    stack_dim: int
    inner: tuple[int, ...]
    leaves: list[LeafScan]
    sub: dict[NestedPath, tuple[int, ...]]
    device: Any
    classes: dict[NestedPath, str] = field(default_factory=dict)
    """The tensorclasses of nested sub-trees (``Header.classes``)."""


def _scan(td: Any, budget: int) -> Scanned:
    """The leaves of ``td`` by the fastest scan that applies: a dense tensordict's columns, plain
    TensorDict members key by key (gathering up to ``budget`` bytes), else element by element."""
    source = td._tensordict if is_tensorclass(td) else td
    if isinstance(source, TensorDictBase) and not isinstance(source, LazyStackedTensorDict) and source.batch_dims:
        dense = scan_dense(source)
        if dense is not None:
            inner, leaves = dense
            sub = subtree_dims(source, len(inner) + 1)
            return Scanned(source.batch_size[0], 0, inner, leaves, sub, getattr(td, "device", None), subtree_classes(source))
    elements, stack_dim = stack_elements(td)
    plain = scan_plain(elements, budget) if elements else None
    if plain is not None:  # every member a TensorDict, its sub-trees' batch sizes the same in all
        inner, leaves = plain
        devices = set(map(attrgetter("_device"), elements))
        device = devices.pop() if len(devices) == 1 else None
        return Scanned(len(elements), stack_dim, inner, leaves, subtree_dims(elements[0], len(inner)), device)
    inner, leaves = scan_lazy(source, elements) if isinstance(source, LazyStackedTensorDict) else scan(elements)
    sub = _subtrees(elements, len(inner))
    classes = subtree_classes(elements[0]) if elements else {}
    for el in elements[1:] if classes else ():  # (the classes all elements agree on: none when the first has none)
        other = subtree_classes(el)
        classes = {p: name for p, name in classes.items() if other.get(p) == name}
    return Scanned(len(elements), stack_dim, inner, leaves, sub, getattr(td, "device", None), classes)


def _subtrees(elements: list[TensorDictBase], n_inner: int) -> dict[NestedPath, tuple[int, ...]]:
    """The extra batch dims of nested sub-trees (``Header.sub``): a dim that differs between elements is
    ``RAGGED`` (chats of several lengths); a number of dims that differs raises (before anything is written)."""
    sub = subtree_dims(elements[0], n_inner) if elements else {}
    if sub:
        for i, el in enumerate(elements[1:], 1):
            other = subtree_dims(el, n_inner)
            if other != sub:
                try:
                    sub = merge_sub(sub, other)
                except ValueError as err:
                    raise ValueError(f"{err} (element {i})") from None
        for i, el in enumerate(elements):
            _refuse_other_dim_counts(el, sub, i)
        varying = [p for p, d in sub.items() if RAGGED in d]
        for i, el in enumerate(elements if varying else []):
            try:
                refuse_unshown(el, varying)
            except ValueError as err:
                raise ValueError(f"{err} (element {i})") from None
    return sub


def _refuse_other_dim_counts(element: TensorDictBase, sub: dict[NestedPath, tuple[int, ...]], i: int) -> None:
    """An element holding a recorded sub-tree with no extra batch dims (or another number of them) is
    refused: ``subtree_dims`` lists only sub-trees with extra dims, so a merge cannot see that one."""
    for path, dims in sub.items():
        node = element.get(path, None)
        if node is None or not hasattr(node, "batch_size"):
            continue  # absent here (a heterogeneous element), or a leaf: the key checks name it
        extra = len(node.batch_size) - element.batch_dims
        if extra != len(dims):
            raise ValueError(
                f"sub-tree {path!r} has {extra} batch dims beyond the element's in element {i} but {len(dims)} in others: "
                "they may differ in size, not in number"
            )


def _chunks(count: int, scans: list[LeafScan], segs: Segments, max_elements: int, max_bytes: int) -> Iterator[tuple[int, int]]:
    """Ranges [lo, hi) of elements inside one segment, each at most ``max_elements`` long and ``max_bytes`` big (or one element)."""
    ends = np.zeros(count + 1, dtype=np.int64)  # where each element ends, all leaves counted
    for s in scans:
        ends[1:] += s.element_bytes()
    np.cumsum(ends, out=ends)
    lo = 0
    while lo < count:
        end = min(count, segs.start(segs.of(lo) + 1), lo + max_elements)
        fits = int(np.searchsorted(ends, ends[lo] + max_bytes, side="right")) - 1  # the last hi within max_bytes
        hi = max(lo + 1, min(end, fits))
        yield lo, hi
        lo = hi


def upload(
    engine: Engine,
    lazy_td: Any,
    *,
    device: Any,
    pbar: bool,
    chunk_elements: int,
    chunk_bytes: int,
    ttl_ms: int = 0,
    kind: str = "lazy",
    tensorclass: str = "",
    batchless: bool = False,
) -> Header:
    """Upload the elements of ``lazy_td`` into the new store of ``engine`` and return its ready header.

    The garbage collector is paused meanwhile: the scan and the chunks make many small objects.
    """
    with gc_paused():
        return _upload(
            engine,
            lazy_td,
            device=device,
            pbar=pbar,
            chunk_elements=chunk_elements,
            chunk_bytes=chunk_bytes,
            ttl_ms=ttl_ms,
            kind=kind,
            tensorclass=tensorclass,
            batchless=batchless,
        )


def _upload(
    engine: Engine,
    lazy_td: Any,
    *,
    device: Any,
    pbar: bool,
    chunk_elements: int,
    chunk_bytes: int,
    ttl_ms: int,
    kind: str,
    tensorclass: str,
    batchless: bool,
) -> Header:
    """The steps of the module docstring; a failure after the header is created deletes what was written."""
    found = _scan(lazy_td, chunk_bytes)
    scans = found.leaves
    token = uuid.uuid4().hex
    sizes = {s.path: s.element_bytes() for s in scans}
    dev = device if device is not None else found.device
    header = _new_header(engine, found, sizes, token=token, device=dev, kind=kind, tensorclass=tensorclass, batchless=batchless)
    chunk_bytes = _check_fits(engine, header, scans, sizes, chunk_bytes)
    spread = engine.spread and header.segments.n > 1  # segments on several cluster nodes, each with its guard (see _spread)
    existing = engine.create(header, ttl_ms=UPLOAD_TTL_MS)
    if existing is not None:
        raise ValueError(f"a store with {engine.where()} already exists; pick another td_id or delete it first")
    header = engine.header  # as created (a store on one slot keeps an inventory of its keys)
    try:
        _send(engine, header, scans, sizes, pbar=pbar, chunk_elements=chunk_elements, chunk_bytes=chunk_bytes, spread=spread)
        _commit(engine, header, token, ttl_ms, spread)
    except BaseException:
        try:
            whole_store.abort_upload(engine, header.next_leaf, header.segments.n)
        finally:
            engine.set_header(None)
        raise
    header = header.ready()
    engine.set_header(header)
    return header


def _new_header(
    engine: Engine,
    found: Scanned,
    sizes: dict[NestedPath, np.ndarray],
    *,
    token: str,
    device: Any,
    kind: str,
    tensorclass: str,
    batchless: bool,
) -> Header:
    """The header the upload creates, in state ``uploading:<token>``: one leaf per scanned key, the
    row block, and segments long enough for the largest element (a leaf is one string per segment)."""
    count, stack_dim, inner = found.count, found.stack_dim, found.inner
    if stack_dim < 0:
        stack_dim += len(inner) + 1
    leaves = {}
    for n, s in enumerate(found.leaves):
        leaves[s.path] = Leaf(s.path, n, s.dtype, s.ndim, s.shape, json=s.json)
    header = Header(
        version=1,
        count=count,
        stack_dim=stack_dim,
        inner=inner,
        device=str(torch.device(device)) if device is not None else "",
        leaves=leaves,
        next_leaf=len(leaves),
        state=f"uploading:{token}",
        kind=kind,
        tensorclass=tensorclass,
        batchless=batchless,
        sub=found.sub,
        classes=found.classes,
    )
    header = row_block.grouped_header(header, len(leaves))
    width = header.row[1] if header.row is not None else 0
    largest = max((int(v.max()) for v in sizes.values() if v.size), default=1)
    return replace(header, seg=segment_length(count, max(largest, width), engine.segment_size), spread=engine.spread)


def _check_fits(engine: Engine, header: Header, scans: list[LeafScan], sizes: dict[NestedPath, np.ndarray], chunk_bytes: int) -> int:
    """Refuse, before anything is written, an upload the server cannot hold; return the bytes one
    ``SETRANGE`` of a chunk may carry (within what the server reads as one request)."""
    count, segs = header.count, header.segments
    total_bytes = sum(int(v.sum()) for v in sizes.values())
    engine.check_room(header, -(-total_bytes // max(count, 1)), declared=total_bytes)
    # a leaf is one string per segment: no segment may need more than one string holds
    limit = engine.max_value_bytes
    for s in scans:
        for k in range(segs.n):
            total = int(sizes[s.path][segs.start(k) : segs.start(k) + segs.size(k)].sum())
            if total > limit:
                raise ValueError(
                    f"key {display(s.path)!r} needs {total} bytes for elements {segs.start(k)}..{segs.start(k) + segs.size(k) - 1}, "
                    f"more than the server accepts for one string ({limit}, proto-max-bulk-len); nothing was written"
                )
    width = header.row[1] if header.row is not None else 0
    if width and min(count, segs.per) * width > limit:
        raise ValueError(
            f"the row block needs {min(count, segs.per) * width} bytes per segment, "
            f"more than the server accepts for one string ({limit}); nothing was written"
        )
    chunk_bytes = max(1, min(chunk_bytes, limit, engine.limits.query_bytes // 2))
    biggest = max((int(sizes[s.path].max()) for s in scans if count), default=0)
    if biggest > engine.limits.query_bytes // 2:
        raise ValueError(
            f"an element of {biggest} bytes of one key is more than half of what the server reads from a client in one request "
            f"(client-query-buffer-limit {engine.limits.query_bytes}); raise client-query-buffer-limit; nothing was written"
        )
    return chunk_bytes


def _send(
    engine: Engine,
    header: Header,
    scans: list[LeafScan],
    sizes: dict[NestedPath, np.ndarray],
    *,
    pbar: bool,
    chunk_elements: int,
    chunk_bytes: int,
    spread: bool,
) -> None:
    """Write every element, one pipelined round trip of plain ``SETRANGE``s per chunk.

    Each round trip gives the keys it wrote the upload's TTL, and all the upload's keys
    again every ``RENEW_S`` seconds, so a long upload of many segments does not lose its
    first ones.  A spread store's segment gets its guard with its first chunk.
    """
    keys = engine.keys
    segs = header.segments
    all_keys = [*keys.all_keys(header.next_leaf, segs.n), *([keys.guard(k) for k in range(1, segs.n)] if spread else [])]
    guard: dict[FieldT, EncodableT] = {f: v for f, v in guard_fields(header).items()} if spread else {}
    het_pos = {s.path: 0 for s in scans if not s.homogeneous}  # bytes written so far in the current segment
    renewed = time.monotonic()
    with progress(pbar, header.count, "upload") as bar:
        for lo, hi in _chunks(header.count, scans, segs, chunk_elements, chunk_bytes):
            batch = Batch()
            k = segs.of(lo)
            _queue_chunk(batch, keys, header, scans, sizes, het_pos, lo, hi)
            if spread and k:
                batch.hset(keys.guard(k), mapping=guard)
            if time.monotonic() - renewed > RENEW_S:
                renew = all_keys
                renewed = time.monotonic()
            else:
                renew = [keys.meta, *keys.segment_keys(header.next_leaf, k), *([keys.guard(k)] if spread and k else [])]
            for key in renew:
                batch.pexpire(key, UPLOAD_TTL_MS)
            for reply in batch.execute(engine.client):
                if isinstance(reply, Exception):
                    raise scripts.translate(reply)
            if bar is not None:
                bar.update(hi - lo)


class Batch:
    """The commands of one round trip of an upload, queued as on a redis-py pipeline.

    On a plain ``redis.Redis`` client they are packed here and sent without copying the data:
    redis-py's pipeline copies every ``memoryview`` into ``bytes`` and hiredis packs the command
    into another copy, which costs an upload of small elements about as much as the server's
    part of it.  Other clients (Redis Cluster, fakeredis) get a non-transactional pipeline.
    """

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def setrange(self, key: str, offset: int, value: bytes | memoryview) -> None:
        self.commands.append(("SETRANGE", key, offset, value))

    def hset(self, key: str, mapping: dict[FieldT, EncodableT]) -> None:
        self.commands.append(("HSET", key, *(x for pair in mapping.items() for x in pair)))

    def pexpire(self, key: str, ms: int) -> None:
        self.commands.append(("PEXPIRE", key, ms))

    def execute(self, client: Any) -> list[Any]:
        """Every command's reply in order, an error reply as its exception (none is raised)."""
        if type(client) is not redis.Redis or not self.commands:
            pipe = client.pipeline(transaction=False)
            for command in self.commands:
                pipe.execute_command(*command)
            return pipe.execute(raise_on_error=False)
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            return conn.retry.call_with_retry(lambda: self._exchange(conn), lambda _: conn.disconnect())
        except BaseException:
            conn.disconnect()  # a reply may be left unread
            raise
        finally:
            pool.release(conn)

    def _exchange(self, conn: Any) -> list[Any]:
        conn.send_packed_command(_pack(conn.encoder.encode, self.commands))
        replies: list[Any] = []
        for _ in self.commands:
            try:
                replies.append(conn.read_response(disable_decoding=True))
            except redis.ResponseError as err:
                replies.append(err)
        return replies


_BIG = 1 << 16
"""A value at least this large is sent as it is, the other pieces of the round trip joined around it."""


def _pack(encode: Any, commands: list[tuple[Any, ...]]) -> list[bytes | bytearray | memoryview]:
    """``commands`` in RESP: small pieces joined into one buffer, each large value as its own."""
    out: list[bytes | bytearray | memoryview] = []
    small = bytearray()
    for command in commands:
        small += b"*%d\r\n" % len(command)
        for arg in command:
            value = arg if isinstance(arg, bytes | bytearray | memoryview) else encode(arg)
            size = value.nbytes if isinstance(value, memoryview) else len(value)
            small += b"$%d\r\n" % size
            if size >= _BIG:
                out += (bytes(small), value)
                small = bytearray(b"\r\n")
            else:
                small += value
                small += b"\r\n"
    if small:
        out.append(bytes(small))
    return out


def _queue_chunk(
    pipe: Batch,
    keys: StoreKeys,
    header: Header,
    scans: list[LeafScan],
    sizes: dict[NestedPath, np.ndarray],
    het_pos: dict[NestedPath, int],
    lo: int,
    hi: int,
) -> None:
    """Queue on ``pipe`` the ``SETRANGE``s writing elements ``[lo, hi)``, all in one segment: the row
    block's rows, each other homogeneous leaf's elements, each heterogeneous leaf's bytes, offsets
    and shapes (``het_pos``: where each heterogeneous leaf's bytes end in the segment so far)."""
    segs = header.segments
    k = segs.of(lo)
    local = lo - segs.start(k)  # the chunk's first element within its segment
    columns: list[tuple[Leaf, np.ndarray]] = []
    for s in scans:
        leaf = header.leaves[s.path]
        if leaf.col is not None:
            columns.append((leaf, np.frombuffer(codec.to_bytes(s.data(lo, hi)), dtype=np.uint8).reshape(hi - lo, -1)))
        elif leaf.shape is not None:
            if leaf.element_nbytes:
                pipe.setrange(keys.data(leaf.number, k), local * leaf.element_nbytes, codec.to_bytes(s.data(lo, hi)))
        else:
            start = het_pos[s.path] if local else 0
            het_pos[s.path] = _queue_ragged(pipe, keys, leaf, k, local, start, s.data(lo, hi), sizes[s.path][lo:hi], s.shape_rows(lo, hi))
    if columns:
        assert header.row is not None
        block, width = header.row
        pipe.setrange(keys.data(block, k), local * width, row_block.join(width, columns).data.cast("B"))


def _queue_ragged(
    pipe: Batch,
    keys: StoreKeys,
    leaf: Leaf,
    k: int,
    local: int,
    start: int,
    data: torch.Tensor,
    sizes: np.ndarray,
    shapes: np.ndarray,
) -> int:
    """Queue one heterogeneous leaf's part of a chunk in segment ``k``: its bytes (``data``) at ``start``
    of the segment's blob, their ends in the offset table (which starts with a 0 at element 0 of the
    segment), and their shapes.  Returns where the leaf's bytes end now."""
    ends = start + np.cumsum(sizes, dtype=np.int64)
    raw = codec.to_bytes(data)
    if len(raw):
        pipe.setrange(keys.data(leaf.number, k), start, raw)
    table = ends.astype("<i8").tobytes() if local else np.concatenate(([0], ends)).astype("<i8").tobytes()
    pipe.setrange(keys.offsets(leaf.number, k), 8 * (local + 1) if local else 0, table)
    pipe.setrange(keys.shapes(leaf.number, k), local * 8 * leaf.ndim, shapes.astype("<i8").tobytes())
    return int(ends[-1]) if len(ends) else start


def _commit(engine: Engine, header: Header, token: str, ttl_ms: int, spread: bool) -> None:
    """Make the store ready: ``commit.lua`` flips the state and drops the upload's TTLs atomically
    (of a spread store, the header's and segment 0's, once every other segment is released)."""
    keys = engine.keys
    if spread:
        at = _release_segments(engine, header, ttl_ms)
        commit_keys = [keys.meta, *keys.segment_keys(header.next_leaf, 0)]
    else:
        at = ""
        commit_keys = keys.all_keys(header.next_leaf, header.segments.n)
    try:
        reply = _commit_batches(engine, header, token, ttl_ms, at, commit_keys)
    except scripts.ServerScriptError as err:
        if "upload lost" in str(err) and _committed(engine, header):
            return  # the commit ran and its reply was lost: redis-py's resend found the store ready
        raise
    except StoreDamagedError as err:
        raise StoreDamagedError(
            f"the upload of {engine.where()} lost keys before it finished ({err}); the server evicted or someone deleted them. "
            "Nothing of the upload was kept; run the server with maxmemory-policy noeviction and enough memory"
        ) from None
    if reply[0] != b"OK":
        raise _lost_header(engine)


def _commit_batches(engine: Engine, header: Header, token: str, ttl_ms: int, at: str, commit_keys: list[str]) -> list:
    """``commit.lua`` on ``commit_keys`` (the header first, then the inventory): one call, or, above
    ``_engine.batches.BATCH_KEYS`` keys, one per batch under the deadline the first read, the header
    turning ``ready`` in the last (see ``lua/commit.lua``). The first reply that is not OK ends it."""
    head, rest = commit_keys[:2], commit_keys[2:]
    parts = batches.batches(rest)
    if len(parts) == 1 or head[1] != engine.keys.inventory:  # a spread store commits segment 0 only
        return scripts.call(engine.client, "commit", commit_keys, [token, ttl_ms, at, integrity.checks(engine.keys, header, commit_keys)])
    reply: list = []
    for i, part in enumerate(parts):
        phase = "first" if i == 0 else "last" if i == len(parts) - 1 else "next"
        names = [*head, *part]
        reply = scripts.call(engine.client, "commit", names, [token, ttl_ms, at, integrity.checks(engine.keys, header, names), phase])
        if reply[0] != b"OK":
            return reply
        at = reply[1].decode()
    return reply


def _committed(engine: Engine, header: Header) -> bool:
    """Whether the store is ready under this upload's creation (its epoch, made fresh for the upload): only
    this upload's commit, which knows the token, makes it so."""
    state, epoch = engine.command("HMGET", engine.keys.meta, "state", "epoch")
    return state == b"ready" and epoch == header.epoch.encode()


def _release_segments(engine: Engine, header: Header, ttl_ms: int) -> str:
    """A spread store's segments other than 0: their keys and guard lose the upload's TTL (and get
    the store's, ``ttl_ms``).  The header and segment 0 follow in one call (:func:`_commit`): until
    then the store is not ready, and nobody reads it.  Returns the deadline of the store's TTL."""
    keys = engine.keys
    at = spread_deadline(engine, ttl_ms)
    calls: list[tuple[str, list[str], list[Any]]] = [
        ("expire", [keys.guard(k), *keys.segment_keys(header.next_leaf, k)], [f"{header.epoch}:V{header.version}", ttl_ms, at])
        for k in range(1, header.segments.n)
    ]
    for r in scripts.call_many(engine.cluster, calls):
        if isinstance(r, Exception):
            raise r
        if r[0] != b"OK":
            raise _lost_header(engine)
    return at


def _lost_header(engine: Engine) -> KeyError:
    return KeyError(
        f"the upload of {engine.where()} lost its header before it finished "
        "(its time to live ran out, the server evicted it, or someone deleted it)"
    )
