"""Read what stores a server holds, for ``tdstore ls``, ``info`` and ``rm`` (no printing here).

Everything is read from the store headers and the registry set of a prefix (see
:mod:`tdstore._keys`); nothing the server names is ever imported or unpickled:
dtypes go through tdstore's allow-list and leaf paths stay plain strings.  The
registry may name stores that expired with their TTL; listing skips those
without changing the server, and only ``tdstore rm`` removes such an entry.

Round trips are batched so a prefix with many stores costs the same few calls:
one ``SMEMBERS``, one pipeline of ``HGETALL`` (one per store), one pipeline of
``STRLEN``/``PTTL`` (one per key of every store).  Sizes and TTLs are read just
after the headers, not atomically with them: an inspection is a snapshot for a
human, while every data operation is checked by the server itself.

Nothing here imports torch or tensordict (``tdstore ls`` answers in a fraction
of a second): headers are read by :mod:`tdstore._headerinfo`, and ``rm`` runs
``clear.lua`` itself.  Only deleting a spread store goes through the store class
(its delete takes the schema lock on every node, see ``_spread``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry

from . import _scripts
from ._connection import PASSWORD_ENV, PasswordError, open_client
from ._headerinfo import HeaderInfo, LeafRecord, StoreFormatError, parse_header
from ._keys import StoreKeys, registry_key
from ._policy import SamplingPolicy

__all__ = [
    "Audit",
    "DEFAULT_URL",
    "URL_ENV",
    "Deletion",
    "InvalidURL",
    "LeafInfo",
    "LoginRefused",
    "Listing",
    "NoSuchStore",
    "ServerConnection",
    "ServerUnreachable",
    "StoreBusy",
    "StoreInfo",
    "Unreadable",
    "UnreadableStore",
    "audit",
    "connect",
    "delete_store",
    "inspect_for_delete",
    "list_stores",
    "resolve_url",
    "store_info",
]

URL_ENV = "TDSTORE_URL"
#: Where ``ls``/``info``/``rm`` look without ``--url`` and without ``$TDSTORE_URL``.
DEFAULT_URL = "redis://localhost:6379/0"
#: Seconds to wait for the connection; a wrong address should fail fast, not hang a terminal.
CONNECT_TIMEOUT = 5.0
#: Seconds to wait for one reply; inspection commands are O(1) per key, so this is generous.
REPLY_TIMEOUT = 60.0


def resolve_url(url: str | None) -> str:
    """``url`` if given, else ``$TDSTORE_URL``, else :data:`DEFAULT_URL`."""
    return url or os.environ.get(URL_ENV) or DEFAULT_URL


# -- errors (their messages never hold a password) ---------------------------------------------------


class InvalidURL(ValueError):
    """The URL is not a redis://, rediss:// or unix:// URL redis-py accepts."""


class ServerUnreachable(ConnectionError):
    """No connection, or the server refused it (wrong password, TLS...)."""


class LoginRefused(ServerUnreachable):
    """The server needs a password and got none, or refused the one given (the message says which server)."""


class NoSuchStore(LookupError):
    """Neither a header nor a registry entry for this id under this prefix."""


class UnreadableStore(RuntimeError):
    """The header exists but this tdstore cannot read it (corrupt, foreign, or another format)."""


class StoreBusy(RuntimeError):
    """The store is still being uploaded: deleting it would pull the data from under its uploader."""


# -- results -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LeafInfo:
    """One key of a store as ``info`` shows it."""

    path: tuple[str, ...]
    number: int
    dtype: str
    ndim: int
    shape: tuple[int, ...] | None
    """Shape of one element's tensor (inner batch dims first); ``None`` when it varies (heterogeneous)."""
    data_bytes: int
    table_bytes: int
    """Offset and shape tables of a heterogeneous leaf (0 for a homogeneous one)."""
    segments: int = 1
    """Blobs the key is cut into: one per segment of the store."""
    column: int | None = None
    """Byte offset of the key in the store's row block (its bytes are its share of the block), or ``None``."""

    @property
    def name(self) -> str:
        """Nested keys joined with ``.`` (ambiguous if a key holds a dot: :attr:`path` is exact)."""
        return ".".join(self.path)

    @property
    def layout(self) -> str:
        return "homogeneous" if self.shape is not None else "heterogeneous"

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.name,
            "path": list(self.path),
            "dtype": self.dtype,
            "layout": self.layout,
            "ndim": self.ndim,
            "shape": None if self.shape is None else list(self.shape),
            "bytes": self.data_bytes,
            "table_bytes": self.table_bytes,
            "segments": self.segments,
            "row_block_column": self.column,
        }


@dataclass(frozen=True)
class StoreInfo:
    """Everything ``ls`` and ``info`` report about one readable store."""

    td_id: str
    prefix: str
    kind: str
    count: int
    stack_dim: int
    inner: tuple[int, ...]
    device: str
    version: int
    state: str
    ttl_ms: int | None
    """Milliseconds before the store expires; ``None`` when it has no time to live."""
    bytes: int
    """Every data, offset and shape string of the store (keys of deleted leaves included)."""
    write_count: int
    """Ring writes so far (the header field ``rw``; 0 when absent)."""
    leaves: tuple[LeafInfo, ...] = field(default_factory=tuple)
    server_keys: int = 0
    """Server keys the store owns now (header included): what ``rm`` deletes."""
    tensorclass: str = ""
    """Name of the tensorclass the store was uploaded from ("" for none); a name only, never imported."""
    segments: int = 1
    """Segments (element ranges under their own hash tag) the store is cut into."""
    segment_length: int = 0
    """Elements per segment; 0 when the store has one segment."""
    spread: bool = False
    """Segments under hash tags of their own, spread over a Redis Cluster's nodes (``spread=True``)."""
    batchless: bool = False
    """A dense store of batch size ``[]`` (kept as a stack of one element)."""
    sampling: str = ""
    """The ring's sampling policy in words (priorities, rate limiter, queue); "" for none."""

    @property
    def batch_size(self) -> tuple[int, ...]:
        """The batch size of the store as its class shows it (the stack dim inserted; ``()`` for a batchless dense store)."""
        if self.batchless:
            return ()
        dims = list(self.inner)
        dims.insert(self.stack_dim if self.stack_dim >= 0 else len(self.inner) + 1 + self.stack_dim, self.count)
        return tuple(dims)

    @property
    def cursor(self) -> int:
        """The next ring slot ``extend``/``append`` writes."""
        return self.write_count % self.count if self.count else 0

    @property
    def written(self) -> int:
        """Ring slots written at least once."""
        return min(self.write_count, self.count)

    @property
    def ttl_seconds(self) -> float | None:
        return None if self.ttl_ms is None else self.ttl_ms / 1000

    @property
    def has_ring(self) -> bool:
        """Whether the ring buffer (``extend``/``sample``) applies: lazy stores, not spread ones (they refuse it)."""
        return self.kind == "lazy" and not self.spread

    def to_json(self, *, schema: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "td_id": self.td_id,
            "prefix": self.prefix,
            "type": self.kind,
            "count": self.count,
            "stack_dim": self.stack_dim,
            "inner_batch_size": list(self.inner),
            "device": self.device or None,
            "version": self.version,
            "state": self.state,
            "ttl_seconds": self.ttl_seconds,
            "bytes": self.bytes,
            "server_keys": self.server_keys,
            "keys": len(self.leaves),
            "ring": {"cursor": self.cursor, "write_count": self.write_count, "written": self.written} if self.has_ring else None,
            "segments": self.segments,
            "segment_length": self.segment_length,
            "spread": self.spread,
            "batch_size": list(self.batch_size),
            "tensorclass": self.tensorclass or None,
            "sampling": self.sampling or None,
        }
        if schema:
            out["schema"] = [leaf.to_json() for leaf in self.leaves]
        return out


@dataclass(frozen=True)
class Unreadable:
    """A registry entry whose header exists but cannot be read (listed, never guessed at)."""

    td_id: str
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"td_id": self.td_id, "error": self.error}


@dataclass(frozen=True)
class Listing:
    """The stores of one prefix."""

    stores: list[StoreInfo]
    unreadable: list[Unreadable]
    stale: list[str]
    """Registry entries whose store is gone (expired): skipped, and left for ``tdstore rm``."""


@dataclass(frozen=True)
class Deletion:
    """What ``rm`` did."""

    td_id: str
    keys_deleted: int
    """Server keys deleted (0 when only a stale registry entry was removed)."""
    registry_only: bool
    """True when the store was already gone (or unreadable) and only its registry entry was removed."""
    reason: str = ""


# -- connection ----------------------------------------------------------------------------------------


@dataclass
class ServerConnection:
    """An open client and a description of where it points, safe to print."""

    client: redis.Redis
    where: str
    secret: str | None = field(default=None, repr=False)

    def scrub(self, text: str) -> str:
        """``text`` with the password masked, for messages built from server errors."""
        return _scrub(text, self.secret)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ServerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scrub(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` masked: a belt on top of messages that should never hold it anyway."""
    return text.replace(secret, "***") if secret else text


def connect(url: str, *, timeout: float = CONNECT_TIMEOUT) -> ServerConnection:
    """Open a client on ``url`` and PING it once, so a wrong address fails here with one clear message.

    The URL is parsed by :func:`tdstore._connection.open_client`, which keeps the
    password out of the spec, so ``where`` can be printed.  Raises
    :class:`InvalidURL` or :class:`ServerUnreachable`.
    """
    try:
        secret = parse_url(url.replace("+cluster://", "://", 1)).get("password") or os.environ.get(PASSWORD_ENV)
    except ValueError as err:
        raise InvalidURL(str(err)) from None
    try:
        client, spec, _ = open_client(
            url=url,
            host="localhost",
            port=6379,
            db=0,
            unix_socket_path=None,
            client=None,
            # redis-py retries a refused connection 10 times with backoff (seconds); one quick retry is
            # enough for a command a person is waiting on, and a wrong --url fails at once
            redis_kwargs={
                "socket_connect_timeout": timeout,
                "socket_timeout": REPLY_TIMEOUT,
                "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
            },
        )
    except PasswordError as err:  # a cluster's seed node is reached when the client is made (tdstore's text, no secret)
        raise LoginRefused(str(err)) from None
    except (ValueError, TypeError) as err:
        raise InvalidURL(_scrub(str(err), secret)) from None
    where = spec.describe()
    try:
        client.ping()
    except PasswordError as err:  # tdstore's own sentence: no server text, no secret
        client.close()
        raise LoginRefused(str(err)) from None
    except redis.RedisError as err:  # refused, timed out, NOPERM...
        client.close()
        raise ServerUnreachable(f"cannot reach the server at {where}: {_scrub(str(err), secret)}") from None
    except OSError as err:  # e.g. a TLS setup problem raised before redis-py wraps it
        client.close()
        raise ServerUnreachable(f"cannot reach the server at {where}: {_scrub(str(err), secret)}") from None
    return ServerConnection(client, where, secret)


# -- reading -----------------------------------------------------------------------------------------


def _decode_id(raw: bytes | str) -> str:
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw


def _parse(raw: Mapping[bytes | str, bytes | str]) -> tuple[HeaderInfo, int]:
    """The header and its ring write counter; :class:`StoreFormatError` for anything unexpected."""
    try:
        header = parse_header(dict(raw))
    except StoreFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # from_fields checks most, never trust it all
        raise StoreFormatError(f"store header is corrupt: {type(err).__name__}: {err}") from None
    rw_raw = raw.get(b"rw") if b"rw" in raw else raw.get("rw")
    try:
        rw = int(rw_raw) if rw_raw is not None else 0
    except ValueError:
        raise StoreFormatError(f"store header has a bad ring write counter {rw_raw!r}") from None
    if rw < 0:
        raise StoreFormatError(f"store header has a negative ring write counter {rw}")
    return header, rw


def describe_policy(policy: SamplingPolicy | None) -> str:
    """A sampling policy in words, for ``info`` ("" for none)."""
    if policy is None:
        return ""
    parts = []
    if policy.alpha is not None:
        parts.append(f"priorities (alpha={policy.alpha:g}" + (f", max_times_sampled={policy.max_times})" if policy.max_times else ")"))
    if policy.limit is not None:
        parts.append(f"rate limit ({policy.limit.describe()})")
    if policy.queue:
        parts.append("queue (writers wait for readers)")
    return ", ".join(parts)


def _layout(client: redis.Redis, keys: StoreKeys, header: HeaderInfo) -> StoreKeys:
    """The store's key names as its header says they are laid out: on Redis Cluster every segment
    in the header's slot unless the store is spread (see ``StoreKeys.spread``)."""
    from redis.cluster import RedisCluster

    return replace(keys, spread=header.spread or not isinstance(client, RedisCluster))


def _size_keys(keys: StoreKeys, header: HeaderInfo) -> list[str]:
    """The string keys of a store (its ``all_keys`` without the header and inventory hashes, which have no STRLEN)."""
    return keys.all_keys(header.next_leaf, header.segments)[2:]


def _summarise(keys: StoreKeys, header: HeaderInfo, rw: int, lengths: Iterable[int], pttl: int, exists: int) -> StoreInfo:
    """Combine a parsed header with the ``STRLEN`` of :func:`_size_keys` (in that order) and ``PTTL``."""
    size = dict(zip(_size_keys(keys, header), lengths, strict=True))
    leaves = []
    for leaf in sorted(header.leaves, key=lambda lf: lf.path):
        leaves.append(
            LeafInfo(
                path=leaf.path,
                number=leaf.number,
                dtype=leaf.dtype,
                ndim=leaf.ndim,
                shape=leaf.shape,
                data_bytes=sum(size[keys.data(leaf.number, k)] for k in range(header.segments))
                if leaf.col is None
                else leaf.element_nbytes * header.count,
                table_bytes=sum(size[keys.offsets(leaf.number, k)] + size[keys.shapes(leaf.number, k)] for k in range(header.segments)),
                segments=header.segments,
                column=leaf.col,
            )
        )
    return StoreInfo(
        td_id=keys.td_id,
        prefix=keys.prefix,
        kind=header.kind,
        count=header.count,
        stack_dim=header.stack_dim,
        inner=header.inner,
        device=header.device,
        version=header.version,
        state=header.state,
        ttl_ms=None if pttl < 0 else pttl,
        bytes=sum(size.values()),
        write_count=rw,
        leaves=tuple(leaves),
        server_keys=exists,
        tensorclass=header.tensorclass,
        segments=header.segments,
        segment_length=header.seg,
        spread=header.spread,
        batchless=header.batchless,
        sampling=describe_policy(header.sampling),
    )


def _measure(client: redis.Redis, parsed: list[tuple[StoreKeys, HeaderInfo, int]]) -> list[StoreInfo | None]:
    """Sizes, TTLs and key counts of parsed stores in one pipeline; ``None`` for a store gone meanwhile."""
    pipe = client.pipeline(transaction=False)
    groups = []
    for keys, header, _ in parsed:
        size_keys = _size_keys(keys, header)
        for key in size_keys:
            pipe.strlen(key)
        pipe.pttl(keys.meta)
        # one EXISTS per slot: a spread store's segments (and their guards) live in several
        by_slot: dict[int, list[str]] = {}
        for key in (keys.meta, keys.inventory, *size_keys, *(keys.guard(k) for k in range(1, header.segments) if header.spread)):
            by_slot.setdefault(keys.segment_of(key) if header.spread else 0, []).append(key)
        for group in by_slot.values():
            pipe.exists(*group)
        groups.append(len(by_slot))
    replies = pipe.execute(raise_on_error=False)
    out: list[StoreInfo | None] = []
    pos = 0
    for (keys, header, rw), g in zip(parsed, groups):
        n = len(_size_keys(keys, header))
        lengths, pttl, exists = replies[pos : pos + n], replies[pos + n], replies[pos + n + 1 : pos + n + 1 + g]
        pos += n + 1 + g
        if any(isinstance(r, Exception) for r in (*lengths, pttl, *exists)) or pttl == -2:
            out.append(None)  # a key of another type under our name, or the store expired between the calls
            continue
        out.append(_summarise(keys, header, rw, lengths, pttl, sum(exists)))
    return out


def list_stores(client: redis.Redis, prefix: str) -> Listing:
    """Every store named in the registry of ``prefix``, sorted by id; reads only."""
    ids = sorted(_decode_id(m) for m in client.smembers(registry_key(prefix)))
    pipe = client.pipeline(transaction=False)
    for td_id in ids:
        pipe.hgetall(StoreKeys(prefix, td_id).meta)
    raws = pipe.execute(raise_on_error=False)
    stale: list[str] = []
    unreadable: list[Unreadable] = []
    parsed: list[tuple[StoreKeys, HeaderInfo, int]] = []
    for td_id, raw in zip(ids, raws, strict=True):
        if isinstance(raw, Exception):  # e.g. WRONGTYPE: something that is not a hash sits under the header's name
            unreadable.append(Unreadable(td_id, f"cannot read the header: {raw}"))
        elif not raw:
            stale.append(td_id)
        else:
            try:
                header, rw = _parse(raw)
            except StoreFormatError as err:
                unreadable.append(Unreadable(td_id, str(err)))
            else:
                parsed.append((_layout(client, StoreKeys(prefix, td_id), header), header, rw))
    stores: list[StoreInfo] = []
    for (keys, _, _), info in zip(parsed, _measure(client, parsed) if parsed else [], strict=True):
        if info is None:
            stale.append(keys.td_id)
        else:
            stores.append(info)
    return Listing(stores=stores, unreadable=unreadable, stale=sorted(stale))


def _lookup(client: redis.Redis, prefix: str, td_id: str) -> tuple[StoreInfo | None, str | None, bool]:
    """``(info, error, registered)``: the store, or why its header is unreadable, and whether the registry names it."""
    keys = StoreKeys(prefix, td_id)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.meta)
    pipe.sismember(keys.registry, td_id)
    raw, registered = pipe.execute(raise_on_error=False)
    registered = bool(registered) and not isinstance(registered, Exception)
    if isinstance(raw, Exception):
        return None, f"cannot read the header: {raw}", registered
    if not raw:
        return None, None, registered
    try:
        header, rw = _parse(raw)
    except StoreFormatError as err:
        return None, str(err), registered
    (info,) = _measure(client, [(_layout(client, keys, header), header, rw)])
    return info, None, registered


@dataclass(frozen=True)
class Audit:
    """What ``tdstore check`` found: every data and table key of a store against its header (``_integrity``)."""

    td_id: str
    checked: int
    """Keys checked (each leaf's data and tables in every segment)."""
    never_written: int
    """Keys absent because their segment was never written (the inventory vouches for them)."""
    problems: tuple[str, ...]
    """One line per key lost, short or too long, and for an inventory that lost entries."""

    @property
    def intact(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "td_id": self.td_id,
            "intact": self.intact,
            "checked": self.checked,
            "never_written": self.never_written,
            "problems": list(self.problems),
        }


def audit(client: redis.Redis, prefix: str, td_id: str) -> Audit:
    """Check every data and table key of a store against what its header implies (two pipelines).

    The rules are the ones every write and read applies to the keys it touches (see
    ``tdstore._integrity``): a key holds exactly what its layout implies (a heterogeneous
    leaf's data at least its last offset); an absent key is fine only when the store's
    inventory is whole and does not list it (a segment never written). Read-only; a snapshot
    (not atomic with writes other processes make meanwhile).
    """
    from ._integrity import EXACT, HET_DATA, expected

    keys = StoreKeys(prefix, td_id)
    raw = client.hgetall(keys.meta)
    if not raw:
        raise NoSuchStore(td_id)
    try:
        header, _ = _parse(raw)
    except StoreFormatError as err:
        raise UnreadableStore(str(err)) from None
    keys = _layout(client, keys, header)
    na_raw = raw.get(b"na") if b"na" in raw else raw.get("na")
    tracked = na_raw is not None
    leaves = [leaf for leaf in header.leaves]
    if header.row is not None:
        leaves.append(LeafRecord(("\0row",), header.row[0], "uint8", 1, (header.row[1],)))
    per = header.seg or max(header.count, 1)
    wanted: list[tuple[str, tuple[int, int, int], str | None]] = []  # key, check, offsets key of a heterogeneous data key
    for seg in range(header.segments):
        m = min(per, header.count - seg * per)
        for leaf in leaves:
            for role, name in (("d", keys.data), ("o", keys.offsets), ("s", keys.shapes)):
                check = expected(role, leaf, m)
                if check[0] in (EXACT, HET_DATA):
                    wanted.append((name(leaf.number, seg), check, keys.offsets(leaf.number, seg) if check[0] == HET_DATA else None))
    pipe = client.pipeline(transaction=False)
    for key, _, okey in wanted:
        pipe.exists(key)
        pipe.strlen(key)
        if okey is not None:
            pipe.getrange(okey, -8, -1)
    if tracked:
        pipe.hlen(keys.inventory)
        for key, _, _ in wanted:
            pipe.hexists(keys.inventory, key)
    replies = pipe.execute()
    pos = 0
    state = []
    for key, check, okey in wanted:
        exists, have = bool(replies[pos]), int(replies[pos + 1])
        pos += 2
        last = None
        if okey is not None:
            tail = replies[pos]
            pos += 1
            last = int.from_bytes(tail, "little") if len(tail) == 8 else 0
        state.append((key, check, exists, have, last))
    problems: list[str] = []
    listed: list[bool] = [False] * len(wanted)
    whole = True
    if tracked:
        count = int(replies[pos])
        pos += 1
        listed = [bool(r) for r in replies[pos : pos + len(wanted)]]
        if count != int(na_raw):
            whole = False
            problems.append(f"{keys.inventory}: the inventory lists {count} keys, the header counts {int(na_raw)} (it lost entries)")
    never = 0
    for (key, (code, length, _), exists, have, last), in_inventory in zip(state, listed):
        if code == HET_DATA:
            if have < (last or 0):
                problems.append(f"{key}: holds {have} bytes, its offset table says {last}" + ("" if exists else " (lost)"))
        elif have != length:
            if not exists and length and tracked and whole and not in_inventory:
                never += 1
            elif not exists:
                problems.append(f"{key}: lost (the header implies {length} bytes)")
            else:
                problems.append(f"{key}: holds {have} bytes, the header implies {length}")
    return Audit(td_id, len(wanted), never, tuple(problems))


def store_info(client: redis.Redis, prefix: str, td_id: str) -> StoreInfo:
    """Header facts and schema of one store; :class:`NoSuchStore` or :class:`UnreadableStore` otherwise."""
    info, error, _ = _lookup(client, prefix, td_id)
    if error is not None:
        raise UnreadableStore(error)
    if info is None:
        raise NoSuchStore(td_id)
    return info


def inspect_for_delete(client: redis.Redis, prefix: str, td_id: str) -> tuple[StoreInfo | None, str | None, bool]:
    """What ``rm`` is about to delete: see :func:`_lookup`."""
    return _lookup(client, prefix, td_id)


def delete_store(client: redis.Redis, prefix: str, td_id: str) -> Deletion:
    """Delete one store in one atomic call, or drop a registry entry whose store is gone or unreadable.

    A readable store is deleted by ``clear.lua``, as ``clear_redis()`` does: every
    key of every leaf number the header ever gave out, registry entry included,
    guarded by the header's epoch and version (a schema change in between makes
    the script refuse, and the header is read again).  A spread store goes through
    :meth:`tdstore.TensorDictStore.from_store` and ``clear_redis`` (its delete takes
    the schema lock on every node).  An unreadable header is *not* deleted: its
    layout is unknown, so which keys belong to it cannot be listed safely; only its
    registry entry is removed so ``ls`` stops showing it.
    """
    info, error, registered = _lookup(client, prefix, td_id)
    if info is None:
        if not registered:
            if error is not None:
                raise UnreadableStore(error)
            raise NoSuchStore(td_id)
        client.srem(registry_key(prefix), td_id)
        reason = (
            "its header is gone (expired or deleted)"
            if error is None
            else f"its header is unreadable ({error}); its keys were left on the server"
        )
        return Deletion(td_id, 0, registry_only=True, reason=reason)
    for _ in range(CLEAR_TRIES):
        raw = client.hgetall(StoreKeys(prefix, td_id).meta)
        if not raw:
            raise NoSuchStore(td_id)  # deleted or expired since it was read
        try:
            header, _ = _parse(raw)
        except StoreFormatError as err:
            raise UnreadableStore(str(err)) from None
        if header.state != "ready":
            raise StoreBusy(f"store {td_id!r} is still being uploaded (state {header.state!r}); an abandoned upload expires by itself")
        if header.spread:
            return _delete_spread(client, prefix, td_id)
        deleted = _clear(client, _layout(client, StoreKeys(prefix, td_id), header), header)
        if deleted is not None:
            return Deletion(td_id, deleted, registry_only=False)
    raise StoreBusy(f"the schema of store {td_id!r} changed on each of {CLEAR_TRIES} tries to delete it; try again")


#: Header reads and deletes ``rm`` tries while other clients keep changing the store's schema.
CLEAR_TRIES = 20


def _clear(client: redis.Redis, keys: StoreKeys, header: HeaderInfo) -> int | None:
    """``clear.lua`` on a store whose keys are all in one slot: keys deleted, or None when the header moved on."""
    from redis.cluster import RedisCluster

    cluster = isinstance(client, RedisCluster)
    every = keys.all_keys(header.next_leaf, header.segments)
    # on Redis Cluster the registry lives in another slot: the script leaves it, and it is updated after
    script_keys = every if cluster else [every[0], keys.registry, *every[1:]]
    args = [f"{header.epoch}:V{header.version}", keys.td_id, *(["noreg"] if cluster else [])]
    reply = _scripts.call(client, "clear", script_keys, args)
    status = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    if status == "GONE":
        raise NoSuchStore(keys.td_id)
    if status != "OK":
        return None  # STALE: read the header again
    if cluster:
        client.srem(keys.registry, keys.td_id)
    return int(reply[1])


def _delete_spread(client: redis.Redis, prefix: str, td_id: str) -> Deletion:
    """A spread store, through the store class (this imports torch)."""
    from .store import TensorDictStore

    try:
        store = TensorDictStore.from_store(client=client, prefix=prefix, td_id=td_id)
    except KeyError:  # deleted or expired since it was read
        raise NoSuchStore(td_id) from None
    except (TypeError, StoreFormatError) as err:  # e.g. a kind of store this version cannot open
        raise UnreadableStore(str(err)) from None
    try:
        n = store.clear_redis()
    finally:
        store.close()  # the client is ours (client=), so this leaves it open
    return Deletion(td_id, n, registry_only=False)
