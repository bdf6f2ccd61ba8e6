"""Read what stores a server holds, for ``tdstore ls``, ``info`` and ``rm``: headers and sizes.

Round trips are batched so a prefix with many stores costs the same few calls:
one ``SMEMBERS``, one pipeline of ``HGETALL`` (one per store), one pipeline of
``STRLEN``/``PTTL`` (one per key of every store).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

import redis

from tdstore._format.header_info import HeaderInfo, StoreFormatError, int_field, parse_header, ring_writes
from tdstore._format.keys import StoreKeys, reference_id, reference_pattern, registry_key
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._inspect.results import LeafInfo, Listing, NoSuchStore, StoreInfo, Unreadable, UnreadableStore

__all__ = ["describe_policy", "inspect_for_delete", "list_stores", "lookup", "read_header", "store_info", "store_layout"]


def _decode_id(raw: bytes | str) -> str:
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw


def read_header(raw: Mapping[bytes | str, bytes | str]) -> tuple[HeaderInfo, int]:
    """The header and its ring write counter (as ring calls see it: ``_format.header_info.ring_writes``);
    :class:`StoreFormatError` for anything unexpected."""
    try:
        header = parse_header(dict(raw))
    except StoreFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # from_fields checks most, never trust it all
        raise StoreFormatError(f"store header is corrupt: {type(err).__name__}: {err}") from None
    rw = int_field(raw.get(b"rw") if b"rw" in raw else raw.get("rw"), "rw", default=0)  # parse_header checked it
    na_raw = raw.get(b"na") if b"na" in raw else raw.get("na")
    na = int_field(na_raw, "na", default=0) if na_raw is not None else None
    return header, ring_writes(rw, na, bool(header.leaves), header.count)


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


def store_layout(client: redis.Redis, keys: StoreKeys, header: HeaderInfo) -> StoreKeys:
    """The store's key names as its header says they are laid out: on Redis Cluster every segment
    in the header's slot unless the store is spread (see ``StoreKeys.segment_tags``)."""
    from redis.cluster import RedisCluster

    return replace(keys, segment_tags=header.spread or not isinstance(client, RedisCluster))


def _size_keys(keys: StoreKeys, header: HeaderInfo) -> list[str]:
    """The string keys of a store (its ``all_keys`` without the header, inventory and reply cache hashes, which have no STRLEN)."""
    return keys.all_keys(header.next_leaf, header.segments)[2:-1]


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
                header, rw = read_header(raw)
            except StoreFormatError as err:
                unreadable.append(Unreadable(td_id, str(err)))
            else:
                parsed.append((store_layout(client, StoreKeys(prefix, td_id), header), header, rw))
    stores: list[StoreInfo] = []
    for (keys, _, _), info in zip(parsed, _measure(client, parsed) if parsed else [], strict=True):
        if info is None:
            stale.append(keys.td_id)
        else:
            stores.append(info)
    known = {*ids}
    return Listing(
        stores=stores, unreadable=unreadable, stale=sorted(stale), reference=[r for r in reference_stores(client, prefix) if r not in known]
    )


def reference_stores(client: redis.Redis, prefix: str) -> list[str]:
    """Ids of the stores the reference ``tensordict.store`` wrote under ``prefix`` (a ``SCAN`` of its metadata keys; reads only)."""
    found = set()
    for key in client.scan_iter(match=reference_pattern(prefix), count=1000):
        td_id = reference_id(prefix, key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key))
        if td_id is not None:
            found.add(td_id)
    return sorted(found)


def lookup(client: redis.Redis, prefix: str, td_id: str) -> tuple[StoreInfo | None, str | None, bool]:
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
        header, rw = read_header(raw)
    except StoreFormatError as err:
        return None, str(err), registered
    (info,) = _measure(client, [(store_layout(client, keys, header), header, rw)])
    return info, None, registered


def store_info(client: redis.Redis, prefix: str, td_id: str) -> StoreInfo:
    """Header facts and schema of one store; :class:`NoSuchStore` or :class:`UnreadableStore` otherwise."""
    info, error, _ = lookup(client, prefix, td_id)
    if error is not None:
        raise UnreadableStore(error)
    if info is None:
        raise NoSuchStore(td_id)
    return info


def inspect_for_delete(client: redis.Redis, prefix: str, td_id: str) -> tuple[StoreInfo | None, str | None, bool]:
    """What ``rm`` is about to delete: see :func:`lookup`."""
    return lookup(client, prefix, td_id)
