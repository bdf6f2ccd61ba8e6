"""A checkpoint taken while writers run: its fence, what it learns of the writers as it reads, and the ring
state that follows (``lua/README.md``, *Checkpoints while writers run*; ``export_import`` reads the rows).

The fence (``lua/fence.lua``) is the header, the stats and the time to live in one atomic step. A ring
write writes the slot of the fence's oldest row and moves ``rw`` in one call, in write order, so ``rw``
read after a chunk tells which of its rows a writer overwrote before the read (:class:`Stamps`): those,
and every older fence row, are absent (``ring.ho``, weight 0, no sample count).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tdstore._engine import scripts
from tdstore._engine.engine import Engine
from tdstore._format.header_info import MAX_INT
from tdstore._format.sampling_policy import TREE_FAN, tree_bytes
from tdstore._format.schema import Header

#: Bytes a side file is copied by (:func:`append_part`).
COPY_BYTES = 64 << 20


class Moved(Exception):
    """The fence found another version of the store than the header the export planned from."""


@dataclass
class Fence:
    """What one atomic read of a store (``lua/fence.lua``) found: the header fields, the stats counters, the time to live."""

    fields: dict[str, str]
    stats: dict[str, int]
    pttl: int

    def ring_writes(self, engine: Engine) -> int:
        """The ring write count as ring calls see it (a store filled by index is a full ring)."""
        return engine.ring_writes_from(self.fields.get("rw"), self.fields.get("na"))


def read_fence(engine: Engine) -> Fence:
    """The store's header, stats and time to live, read in one atomic step (``lua/fence.lua``)."""
    reply = scripts.call(engine.client, "fence", [engine.keys.meta, engine.keys.stats], [], engine.execute)
    if reply[0] in (b"GONE", "GONE"):
        raise engine.gone()

    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    head = [text(v) for v in reply[1]]
    fields = dict(zip(head[0::2], head[1::2], strict=True))
    raw = [text(v) for v in reply[2]]
    stats = {k: int(v) for k, v in zip(raw[0::2], raw[1::2], strict=True) if v.isdigit() and int(v) <= MAX_INT}
    return Fence(fields, stats, int(reply[3]))


def held_slots(count: int, first: int, rw: int) -> np.ndarray:
    """Which of ``count`` slots hold the rows of ring writes ``first .. rw - 1`` (a bool per slot)."""
    held = np.zeros(count, dtype=bool)
    if rw - first >= count:
        held[:] = True
    elif rw > first:
        held[np.arange(first, rw, dtype=np.int64) % count] = True
    return held


def rebuild_tree(file: Path, count: int, held: np.ndarray) -> None:
    """The priority tree in ``file`` with the weights of the slots not ``held`` set to 0 and every node
    above the leaves computed again from its children (``lua/_tree.lua``'s layout: a node is the sum of
    its children's weights, summed in order as the server does, and the smallest positive one)."""
    tree = np.memmap(file, dtype="<f8", mode="r+", shape=(tree_bytes(count) // 8,))
    try:
        leaves = tree[:count]
        leaves[~held] = 0.0
        sums, mins, at, n = np.asarray(leaves, dtype=np.float64), np.asarray(leaves, dtype=np.float64), count, count
        while n > 1:
            up = -(-n // TREE_FAN)
            pad = up * TREE_FAN - n
            s2 = np.concatenate([sums, np.zeros(pad)]).reshape(up, TREE_FAN)
            m2 = np.concatenate([np.where(mins > 0, mins, np.inf), np.full(pad, np.inf)]).reshape(up, TREE_FAN)
            total = np.zeros(up)
            for k in range(TREE_FAN):  # in order, as the server adds them
                total = total + s2[:, k]
            low = m2.min(axis=1)
            low = np.where(np.isinf(low), 0.0, low)
            node = tree[at : at + 2 * up].reshape(up, 2)
            node[:, 0], node[:, 1] = total, low
            sums, mins, at, n = total, low, at + 2 * up, up
        tree.flush()
    finally:
        del tree


def clear_counts(file: Path, count: int, held: np.ndarray) -> None:
    """The sample counts in ``file`` with those of the slots not ``held`` set to 0."""
    times = np.memmap(file, dtype="<u4", mode="r+", shape=(count,))
    try:
        times[~held] = 0
        times.flush()
    finally:
        del times


class Stamps:
    """What the export learns of the writers as it reads (see the module docstring): the fence's ring write
    count, and the oldest fence row no writer had overwritten when it was read (``first``)."""

    def __init__(self, engine: Engine, h: Header, fence: Fence) -> None:
        self.engine, self.h, self.count = engine, h, h.count
        self.fence_rw = fence.ring_writes(engine)
        self.oldest = max(0, self.fence_rw - self.count)  # the oldest ring write whose row the fence holds
        self.first = self.oldest

    def order(self) -> list[tuple[int, int]]:
        """Slot ranges in the order they are read: the fence's oldest row first, as writers overwrite them."""
        c = self.fence_rw % self.count if self.fence_rw >= self.count else 0
        return [(c, self.count), (0, c)] if c else [(0, self.count)]

    def writes(self, lo: int, hi: int) -> np.ndarray:
        """The ring write whose row the fence holds in each slot ``lo .. hi - 1`` (-1: none, a slot not written then)."""
        s = np.arange(lo, hi, dtype=np.int64)
        if self.fence_rw >= self.count:
            return self.fence_rw - self.count + (s - self.fence_rw) % self.count
        return np.where(s < self.fence_rw, s, -1)

    def read(self, lo: int, hi: int, tree: np.memmap | None, times: np.memmap | None) -> None:
        """After slots ``lo .. hi - 1`` were read: their weights and sample counts, then the ring write count,
        in one round trip; the fence rows of the chunk writers overwrote before (the count says which) move
        ``first`` past them."""
        keys = self.engine.keys
        pipe = self.engine.client.pipeline(transaction=False)
        if tree is not None:
            pipe.getrange(keys.priorities, 8 * lo, 8 * hi - 1)
        if times is not None:
            pipe.getrange(keys.times_sampled, 4 * lo, 4 * hi - 1)
        pipe.hmget(keys.meta, ["rw", "na", "epoch", "version"])
        got = pipe.execute()
        if tree is not None:
            tree[lo:hi] = np.frombuffer(got.pop(0), dtype="<f8")
        if times is not None:
            times[lo:hi] = np.frombuffer(got.pop(0), dtype="<u4")
        rw, na, epoch, version = (v.decode() if isinstance(v, bytes) else v for v in got[0])
        if epoch is None:
            raise self.engine.gone()
        if (epoch, version) != (self.h.epoch, str(self.h.version)):
            what = "was deleted and made again" if epoch != self.h.epoch else "had its schema or policy changed"
            raise RuntimeError(f"the store with {self.engine.where()} {what} while it was exported: export it again")
        over = self.writes(lo, hi)
        over = over[(over >= 0) & (over < self.engine.ring_writes_from(rw, na) - self.count)]
        if over.size:
            self.first = max(self.first, min(self.fence_rw, int(over.max()) + 1))


def append_part(main: list[Any], part: list[Any], parts: dict[str, Path]) -> None:
    """A ragged key's files of the slots read first (``part``: written as if from slot 0) appended to its main
    files (the slots before them), the offsets moved by the main data's length."""
    shift = main[3]
    for k, name in enumerate(("data", "offsets", "shapes")):
        part[k].flush()
        with open(parts[name], "rb") as src:
            while piece := src.read(COPY_BYTES):
                if name == "offsets":
                    piece = (np.frombuffer(piece, dtype="<i8") + shift).astype("<i8").tobytes()
                main[k].write(piece)
    main[3] = shift + part[3]


def open_ragged(stem: Path, header: bool) -> list[Any]:
    handles: list[Any] = [open(f"{stem}.{ext}", "wb") for ext in ("data", "offsets", "shapes")]
    if header:
        handles[1].write(b"\0" * 8)
    return [*handles, 0]
