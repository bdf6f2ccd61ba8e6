"""The counters an adapter (torchrl's ``StoreStorage``) keeps in a ring's header beside ``rw``: ``Ring.marks``.

* ``tr``: in-place writes of rows through torchrl, by any process, counted by the write itself
  (``write.lua``'s 'B' op, see ``Engine.counting_in_place``): with the ring write count and the
  store's creation, the storage's ``_mutation_revision`` (one ``HMGET``), so that a
  ``SliceSampler(cache_values=True)`` anywhere sees every write.
* ``gb``, ``wb``: what an emptied buffer carries over into its new store: a slot's torchrl
  generation is ``gb`` + its ring generation - 1, and ``rb.write_count`` is ``wb`` + ``rw``,
  so a handle taken before ``empty()`` stays stale and ``empty(empty_write_count=False)``
  keeps the count (``lua/marks.lua`` sets them).

One node's here; a sharded ring sums its shards' (``_shards``).
"""

from __future__ import annotations

from typing import NamedTuple

from tdstore._engine import scripts
from tdstore._engine.engine import Engine
from tdstore._format.header_info import int_field


class Marks(NamedTuple):
    """The ring write count (as ring calls see it) and the torchrl counters, read together."""

    rw: int
    tr: int
    gb: int
    wb: int


Marks.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


def read(engine: Engine) -> Marks:
    """The ring's and the adapter's counters in one round trip; ``KeyError`` when the store was deleted
    or made again since ``engine`` opened it."""
    rw, epoch, na, tr, gb, wb = engine.command("HMGET", engine.keys.meta, "rw", "epoch", "na", "tr", "gb", "wb")
    if epoch is None:
        raise engine.gone()
    if epoch.decode() != engine.header.epoch:
        raise KeyError(f"the store with {engine.where()} was deleted and created again since this handle opened it")
    return Marks(engine.ring_writes_from(rw, na), *(int_field(v, n, default=0) for v, n in ((tr, "tr"), (gb, "gb"), (wb, "wb"))))


def add_up(parts: list[Marks]) -> Marks:
    """A sharded ring's marks from its shards': counts summed, bases (set alike on every shard) the largest."""
    return Marks(sum(m.rw for m in parts), sum(m.tr for m in parts), max(m.gb for m in parts), max(m.wb for m in parts))


def set_base(engine: Engine, generation_base: int, write_base: int) -> None:
    """The generation and write-count bases of a store just made again (torchrl's ``empty()``)."""
    args = [engine.header.epoch, str(int(generation_base)), str(int(write_base))]
    reply = scripts.call(engine.client, "marks", [engine.keys.meta], args, engine.execute)
    if reply[0] in (b"GONE", "GONE"):
        raise engine.gone()
