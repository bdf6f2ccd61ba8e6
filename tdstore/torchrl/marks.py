"""The counters a torchrl ``StoreStorage`` keeps in its ring's header beside ``rw``.

* ``tr``: in-place writes of rows through torchrl, by any process, counted by the write itself
  (``write.lua``'s 'B' op, see ``Engine.counting_in_place``): with the ring write count and the
  store's creation, the storage's ``_mutation_revision`` (one ``HMGET``), so that a
  ``SliceSampler(cache_values=True)`` anywhere sees every write.
* ``gb``, ``wb``: what an emptied buffer carries over into its new store: a slot's torchrl
  generation is ``gb`` + its ring generation - 1, and ``rb.write_count`` is ``wb`` + ``rw``,
  so a handle taken before ``empty()`` stays stale and ``empty(empty_write_count=False)``
  keeps the count (``lua/marks.lua`` sets them).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from tdstore._engine import scripts as _scripts
from tdstore._format.header_info import int_field


class Marks(NamedTuple):
    """The ring write count (as ring calls see it) and the torchrl counters, read together."""

    rw: int
    tr: int
    gb: int
    wb: int


def read(engine: Any) -> Marks:
    """The ring's and torchrl's counters in one round trip; ``KeyError`` when the store was deleted
    or made again since ``engine`` opened it (``StoreStorage.with_store`` then reopens it).

    A sharded ring's (``engine`` has ``shard_engines``): every shard's at once, summed (``gb`` and
    ``wb``, which :func:`set_base` gives every shard alike, the largest)."""
    if hasattr(engine, "shard_engines"):
        got = engine.each_shard(read)
        return Marks(sum(m.rw for m in got), sum(m.tr for m in got), max(m.gb for m in got), max(m.wb for m in got))
    rw, epoch, na, tr, gb, wb = engine.command("HMGET", engine.keys.meta, "rw", "epoch", "na", "tr", "gb", "wb")
    if epoch is None:
        raise engine.gone()
    if epoch.decode() != engine.header.epoch:
        raise KeyError(f"the store with {engine.where()} was deleted and created again since this handle opened it")
    return Marks(engine.ring_writes_from(rw, na), *(int_field(v, n, default=0) for v, n in ((tr, "tr"), (gb, "gb"), (wb, "wb"))))


def set_base(engine: Any, generation_base: int, write_base: int) -> None:
    """The generation and write-count bases of a store just made again by ``empty()`` (each shard's alike)."""
    if hasattr(engine, "shard_engines"):
        engine.each_shard(lambda e: set_base(e, generation_base, write_base))
        return
    args = [engine.header.epoch, str(int(generation_base)), str(int(write_base))]
    reply = _scripts.call(engine.client, "marks", [engine.keys.meta], args, engine.execute)
    if reply[0] in (b"GONE", "GONE"):
        raise engine.gone()
