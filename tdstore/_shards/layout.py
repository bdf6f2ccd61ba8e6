"""A sharded ring's layout: its key, the placement of its shards on primaries, its global slots."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis

from tdstore._format.header_info import check_new_layout
from tdstore._format.keys import StoreKeys, shard_id


@dataclass(frozen=True)
class Layout:
    """What the layout key holds: the ring's count and batch layout, its shards' ids and counts."""

    count: int
    stack_dim: int
    inner: tuple[int, ...]
    ids: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def offsets(self) -> list[int]:
        return [0, *np.cumsum(self.counts).tolist()][:-1]

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": 1,
                "count": self.count,
                "stack_dim": self.stack_dim,
                "inner": list(self.inner),
                "shards": list(zip(self.ids, self.counts)),
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> Layout:
        try:
            d = json.loads(text)
            ids, counts = zip(*d["shards"]) if d["shards"] else ((), ())
            out = cls(
                int(d["count"]),
                int(d["stack_dim"]),
                tuple(int(i) for i in d["inner"]),
                tuple(str(i) for i in ids),
                tuple(int(c) for c in counts),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise KeyError(f"the sharded ring {where} has a damaged layout key ({err})") from None
        if not out.ids or sum(out.counts) != out.count or min(out.counts) < 1:
            raise KeyError(
                f"the sharded ring {where} has a damaged layout key (shards {list(zip(out.ids, out.counts))}, count {out.count})"
            )
        return out


def is_cluster(url: str | None, client: Any) -> bool:
    """Whether a store opened with ``url``/``client`` is on a Redis Cluster (where ``spread=True`` shards a ring)."""
    if client is not None:
        return isinstance(client, redis.cluster.RedisCluster)
    return bool(url) and str(url).lower().startswith(("redis+cluster://", "rediss+cluster://"))


def wants_shards(kwargs: dict[str, Any]) -> bool:
    """Whether a replay buffer opened with these keywords is a sharded ring: ``sharded=True``, or the older
    spelling ``spread=True`` on a cluster without ``shards=0`` (``spread="segments"`` is a spread store)."""
    if kwargs.get("sharded") is True:
        return True
    return kwargs.get("spread") is True and kwargs.get("shards") != 0 and is_cluster(kwargs.get("url"), kwargs.get("client"))


def ring_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the words that chose a sharded ring (``sharded``, ``spread``): what its constructor takes."""
    return {k: v for k, v in kwargs.items() if k not in ("sharded", "spread")}


def plan_layout(client: Any, prefix: str, td_id: str, count: int, shards: int | None, stack_dim: int, inner: tuple[int, ...]) -> Layout:
    """Shard counts as even as can be, shard ``k`` on the ``k % P``-th primary (by name)."""
    primaries = sorted(client.get_primaries(), key=lambda n: n.name)
    k_total = len(primaries) if shards is None else shards
    if isinstance(k_total, bool) or not isinstance(k_total, int) or k_total < 1:
        raise ValueError(f"shards must be None (one per primary) or an int >= 1, got {shards!r}")
    if k_total > count:
        raise ValueError(f"a ring of {count} slots cannot be cut into {k_total} shards (at least one slot each)")
    from redis.crc import key_slot

    slots = client.nodes_manager.slots_cache
    ids = []
    for k in range(k_total):
        target = primaries[k % len(primaries)].name
        for attempt in range(1 << 16):
            sid = shard_id(td_id, k, attempt)
            if slots[key_slot(StoreKeys(prefix, sid).meta.encode())][0].name == target:
                break
        ids.append(sid)
    counts = tuple(count // k_total + (1 if k < count % k_total else 0) for k in range(k_total))
    return Layout(count, stack_dim, inner, tuple(ids), counts)


class WrittenSlots(Sequence[int]):
    """The written slots of a sharded ring: each shard's first ``written`` slots, in global numbering."""

    def __init__(self, offsets: list[int], written: list[int]) -> None:
        self._ranges = [range(o, o + w) for o, w in zip(offsets, written)]
        self._n = sum(written)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        for r in self._ranges:
            yield from r

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        i = int(i) + (self._n if int(i) < 0 else 0)
        if not 0 <= i < self._n:
            raise IndexError("written slot index out of range")
        for r in self._ranges:
            if i < len(r):
                return r[i]
            i -= len(r)
        raise IndexError("written slot index out of range")

    def __repr__(self) -> str:
        return f"WrittenSlots({[f'{r.start}..{r.stop - 1}' for r in self._ranges if len(r)]}, n={self._n})"


def open_layout(
    rc: Any, keys: StoreKeys, count: int | None, shards: int | None, stack_dim: int, inner_batch_size: Sequence[int], readonly: bool
) -> Layout:
    """The layout of the sharded ring ``keys`` names: with ``count``, written first if there is none yet (``SET NX``:
    concurrent creators agree), and checked against the arguments."""
    where = f"td_id={keys.td_id!r} (prefix {keys.prefix!r})"
    inner: tuple[int, ...] = ()
    if count is not None:
        count, inner = check_new_layout(count, stack_dim, inner_batch_size)
        stack_dim = stack_dim if stack_dim >= 0 else stack_dim + len(inner) + 1
        if readonly:
            raise ValueError("readonly=True opens an existing store: leave count out")
        plan = plan_layout(rc, keys.prefix, keys.td_id, count, shards, stack_dim, inner)
        rc.set(keys.shards, plan.to_json(), nx=True)
    text = rc.get(keys.shards)
    if text is None:
        raise KeyError(f"No sharded ring with {where} on the cluster")
    layout = Layout.from_json(text, where)
    if count is not None:
        mismatch = [
            f"{name} {got!r} != stored {have!r}"
            for name, got, have in (
                ("count", count, layout.count),
                ("stack_dim", stack_dim, layout.stack_dim),
                ("inner_batch_size", inner, layout.inner),
            )
            if got != have
        ]
        if shards is not None and shards != len(layout.ids):
            mismatch.append(f"shards {shards} != stored {len(layout.ids)}")
        if mismatch:
            raise ValueError(f"a sharded ring with {where} already exists with another layout: {'; '.join(mismatch)}")
    return layout


def open_shard(layout: Layout, k: int, opts: dict[str, Any], readonly: bool, create: bool = True) -> Any:
    """Shard ``k``'s one-node ring store (created with the layout's count, stack dim and inner batch size if new;
    with ``create=False`` or ``readonly``, only opened: a missing shard raises ``KeyError``)."""
    # In here, not at the top: tdstore.lazy sits above the layers (the layer rule of tests/project/test_layout.py), and
    # _shards.info imports this module for the torch-free CLI (``tdstore ls``/``info``), which tdstore.lazy would load torch into.
    from tdstore.lazy import LazyStackedTensorDictStore

    if readonly or not create:
        return LazyStackedTensorDictStore.from_store(readonly=readonly, td_id=layout.ids[k], **opts)
    return LazyStackedTensorDictStore(
        count=layout.counts[k], stack_dim=layout.stack_dim, inner_batch_size=layout.inner, td_id=layout.ids[k], **opts
    )
