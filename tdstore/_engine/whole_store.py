"""Operations on a store as a whole: delete it, copy it, give it a time to live, undo an upload.

Each is one atomic call of its own script (``clear.lua``, ``copy.lua``, ``expire.lua``) naming
every key the store may own; above ``_engine.batches.BATCH_KEYS`` keys, deletes and deadlines go in
batches (``_engine.batches``: a tombstone header, a header that outlives its keys) and a copy is refused.
On a store spread over a cluster's nodes: one call per segment (``_engine.spread.clear`` /
``_engine.spread.expire``, the header last).
"""

from __future__ import annotations

import secrets
from dataclasses import replace

from tdstore._engine import batches, scripts, spread
from tdstore._engine.engine import Engine, StaleSchemaError
from tdstore._format.keys import StoreKeys
from tdstore._format.schema import Header
from tdstore._plan.call import Call

#: The most bytes a server-side clone() copies in one call: COPY duplicates every byte while the
#: server holds everything else (10-40 ms for 30 MiB on a 2-core machine, see lua/README.md).
COPY_BYTES = 32 << 20

#: Tries of a whole-store call cut in batches whose first batch finds the schema changed.
STALE_TRIES = 64


def clear(engine: Engine) -> int:
    """Delete every key of this store (one round trip; a store of more keys than
    ``_engine.batches.BATCH_KEYS``: one per batch, under a tombstone header); 0 when it is already gone."""
    engine.refuse_if_readonly()
    try:
        deleted = engine.run_spread(spread.clear) if spread.spreads(engine.header) else _clear_batched(engine)
    except KeyError:
        deleted = 0
    finally:
        engine.set_header(None)
    if engine.spec.cluster:  # the registry lives in another slot (see create)
        engine.client.srem(engine.keys.registry, engine.keys.td_id)
    return deleted


def _clear_batched(engine: Engine) -> int:
    """``clear.lua`` through ``_engine.batches.clear``; a STALE first batch (a schema change) is planned again."""
    with engine.naming_errors():
        return _clear_batches(engine)


def _clear_batches(engine: Engine) -> int:
    for _ in range(STALE_TRIES):
        h = engine.header
        every = engine.keys.all_keys(h.next_leaf, h.segments.n) + engine.keys.side_keys
        registry = None if engine.spec.cluster else engine.keys.registry
        reply = batches.clear(engine.client, every[0], registry, every[1:], f"{h.epoch}:V{h.version}", engine.keys.td_id, engine.execute)
        marker = batches.status(reply)
        if marker == "GONE":
            raise engine.gone()
        if marker == "OK":
            return int(reply[1])
        engine.adopt_stale(reply)
    raise _stale(engine)


def _stale(engine: Engine) -> Exception:
    return StaleSchemaError(f"the schema of the store with {engine.where()} changed on each of {STALE_TRIES} tries; try again")


def _clear_args(engine: Engine) -> list[str]:
    """ARGV after the version check of ``clear.lua``: the td_id, and on Cluster no registry key."""
    return [engine.keys.td_id, "noreg"] if engine.spec.cluster else [engine.keys.td_id]


def abort_upload(engine: Engine, next_leaf: int, segments: int) -> None:
    """Delete what an upload cut short wrote (its header was never committed)."""
    if engine.spec.cluster and engine.keys.segment_tags and segments > 1:  # one call per segment: they live on several nodes
        calls = [
            ("clear", [engine.keys.guard(seg), *engine.keys.segment_keys(next_leaf, seg)], ["*", engine.keys.td_id, "noreg"])
            for seg in range(1, segments)
        ]
        scripts.call_many(engine.cluster, calls)
        segments = 1
    every = engine.keys.all_keys(next_leaf, segments) + engine.keys.side_keys
    batches.clear(engine.client, every[0], None if engine.spec.cluster else engine.keys.registry, every[1:], "*", engine.keys.td_id)
    if engine.spec.cluster:
        engine.client.srem(engine.keys.registry, engine.keys.td_id)


def copy_to(engine: Engine, keys: StoreKeys) -> Header:
    """Copy the whole store to the keys ``keys`` on the server, in one atomic call (see ``lua/copy.lua``).

    Returns the copy's header: the one the call was checked against, with the new
    epoch, so the new handle needs no round trip of its own.
    """

    def plan_call(h: Header) -> Call:
        # not a priority tree being built (the copy starts its own, see lua/tree_build.lua), nor the reply
        # cache (its request ids are the source's calls)
        src = [k for k in _without_build(engine.keys, engine.keys.all_keys(h.next_leaf, h.segments.n)[1:]) if k != engine.keys.replies]
        dst = [k for k in _without_build(keys, keys.all_keys(h.next_leaf, h.segments.n)[1:]) if k != keys.replies]
        src += engine.keys.side_keys
        dst += keys.side_keys
        if len(src) > batches.BATCH_KEYS:
            raise ValueError(
                f"a server-side clone() copies at most {batches.BATCH_KEYS} keys in one call (the server holds everything "
                f"meanwhile), and the store with {engine.where()} has {len(src)} ({h.segments.n} segments); copy it in chunks "
                "with tdstore.export_checkpoint(store, path) and tdstore.import_checkpoint(path, ...) instead"
            )
        epoch = secrets.token_hex(8)
        return Call(
            "copy",
            [engine.keys.meta, keys.meta, keys.registry, *src, *dst],
            [f"{h.epoch}:V{h.version}", keys.td_id, epoch, COPY_BYTES],
            lambda r: replace(h, epoch=epoch),
        )

    return engine.run(plan_call)


def _without_build(keys: StoreKeys, names: list[str]) -> list[str]:
    """``names`` without the keys of a priority tree being built (``StoreKeys.build_keys``)."""
    build = set(keys.build_keys)
    return [k for k in names if k not in build]


def _clear_keys(engine: Engine, next_leaf: int, segments: int) -> list[str]:
    """``clear.lua``'s KEYS: every key the store may own (and the registry, but on Cluster)."""
    keys = engine.keys.all_keys(next_leaf, segments) + engine.keys.side_keys
    if engine.spec.cluster:
        return keys
    return [keys[0], engine.keys.registry, *keys[1:]]


def expire(engine: Engine, ttl_ms: int) -> None:
    """Give every key of the store a time to live of ``ttl_ms`` (0: none), in one atomic call."""
    engine.refuse_if_readonly()

    def plan_call(h: Header) -> Call:
        # a priority tree being built keeps its lease (its next step takes the store's time to live when shorter)
        every = _without_build(engine.keys, engine.keys.all_keys(h.next_leaf, h.segments.n)) + engine.keys.side_keys
        return Call("expire", every, [f"{h.epoch}:V{h.version}", ttl_ms], lambda r: None)

    if spread.spreads(engine.header):
        engine.run_spread(lambda engine, h: spread.expire(engine, h, ttl_ms))
        return
    with engine.naming_errors():
        for _ in range(STALE_TRIES):
            h = engine.header
            every = plan_call(h).keys
            reply = batches.expire(engine.client, every[0], every[1:], f"{h.epoch}:V{h.version}", ttl_ms, engine.execute)
            marker = batches.status(reply)
            if marker == "GONE":
                raise engine.gone()
            if marker == "OK":
                return
            engine.adopt_stale(reply)
        raise _stale(engine)
