"""The shared ring buffer's writes: ``extend`` and ``update_if``, one script call each (its reads,
``sample`` and ``pop``, are in ``_ring.sample_pop``; what the ring is and how its writes are planned:
``_plan.ring_plan``).

``extend`` reserves its slots, writes them and bumps ``rw`` in one ``write.lua``
call, so concurrent writers never get the same slot in one lap.  ``update_if``
writes only the rows whose generation is still the one the caller read (the slot
was not overwritten by a later lap).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._engine import deadline
from tdstore._engine.engine import Engine, request_id
from tdstore._engine.write_call import first_keys
from tdstore._format import codec, sampling_policy
from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan.index import positions
from tdstore._plan.ring_plan import (
    DRAW_HIGH,
    RING_FIELDS,
    RingState,
    RingWrite,
    Sample,
    batch_len,
    block_op,
    generations,
    generations_arg,
    last_of_each,
    plan_rows,
    ring_write,
    rows_of,
    state,
)
from tdstore._plan.values import leaves_of, subtree_layout
from tdstore._ring import direct_extend, episodes, policy_calls, waiting
from tdstore._ring.args import refuse_spread

#: Named here too for the modules that import them from here (``_shards``, ``tdstore.torchrl``; pickles name
#: ``tdstore._ring.extend.RingWrite``, ``Sample``, ``RingState`` made before they named ``tdstore.ring_interface``).
__all__ = ["update_if", "ring_writes_of", "DRAW_HIGH", "RING_FIELDS", "RingState", "RingWrite", "Sample", "generations", "state"]


def ring_writes_of(engine: Engine, fields: Mapping[str, Any], h: Header) -> int:
    """The ring write count from the header fields :data:`RING_FIELDS` a transaction read
    (``_format.header_info.ring_writes``: a store filled by index is a full ring), range-checked."""
    return engine.ring_writes_from(fields.get("rw"), fields.get("na"), h)


class _BlockRows(NamedTuple):
    """What a ring write of a store whose every key lives in the row block needs of its header (see :func:`_block_plan`)."""

    grouped: tuple[Leaf, ...]  # by column
    kt: KeyTable  # the header, the inventory if kept, the row block
    block: int  # the row block's index in ``kt``


#: Per handle: the header it last wrote with, and that header's row block (None: a key outside the block).
_BLOCKS: weakref.WeakKeyDictionary[Engine, tuple[Header, _BlockRows | None]] = weakref.WeakKeyDictionary()


def _block_rows(engine: Engine, h: Header) -> _BlockRows | None:
    cached = _BLOCKS.get(engine)
    if cached is not None and cached[0] is h:
        return cached[1]
    grouped = tuple(h.grouped())
    fits = h.row is not None and h.stack_pos == 0 and len(grouped) == len(h.leaves)
    fits = fits and all(not leaf.het and not leaf.json and leaf.element_nbytes > 0 for leaf in grouped)
    out = None
    if fits:
        assert h.row is not None
        kt = engine.key_table(h)
        out = _BlockRows(grouped, kt, kt.ref(engine.keys.data(h.row[0])))
    _BLOCKS[engine] = (h, out)
    return out


def _block_plan(engine: Engine, h: Header, items: dict[NestedPath, Any], n: int) -> tuple[KeyTable, list[list[Any]], list[Leaf]] | None:
    """The plan of a ring write (``plan_rows``'s ops: 'W', then one 'X' of whole rows) when every key of the
    store is a column of the row block and the batch gives each one as a plain tensor of its leaf's dtype
    and element shape, rows first: the common write, planned without the general planner. None for anything
    else, which the general planner plans (and words the error of)."""
    b = _block_rows(engine, h)
    if b is None or len(items) != len(b.grouped):
        return None
    assert h.row is not None
    columns = []
    for leaf in b.grouped:
        t = items.get(leaf.path)
        if t.__class__ is not torch.Tensor or t.dtype != leaf.dtype or t.shape[0] != n or t.shape[1:] != leaf.shape:
            return None
        columns.append((leaf, np.frombuffer(codec.to_bytes(t), dtype=np.uint8).reshape(n, -1)))
    return b.kt, [Write.W(n, engine.keys.events), block_op(b.block, h.row[1], columns)], list(b.grouped)


def _extend_direct(
    engine: Engine, plan: Callable[[Header, KeyTable], Any], n: int, request: str, items: dict[NestedPath, Any]
) -> int | None:
    """The first slot of an extend sent with its rows as plain SETRANGEs (``_ring.direct_extend``), or None when it
    goes through ``write.lua`` (planned there again: bad input raises here, before anything is sent)."""
    h = engine.header
    if not direct_extend.usable(engine, h):
        return None
    fast = _block_plan(engine, h, items, n)
    if fast is not None:
        with engine.naming_errors():
            return direct_extend.extend(engine, h, *fast, n, request)
    kt = engine.key_table(h)
    new_header, ops, touched = plan(h, kt)
    if new_header is not None:
        if h.leaves or not h.tracked:  # a schema change of a store with keys: write.lua's
            return None
        new_header = first_keys(engine, h, new_header, ops, kt)  # the first keys, allocated by direct.lua 'open'
        if new_header.segments.n != 1:
            return None
    with engine.naming_errors():
        return direct_extend.extend(engine, h, kt, ops, touched, n, request, new_header)


@deadline.honours_timeout("extend")
def extend(
    engine: Engine,
    value: Any,
    priority: Any = None,
    timeout: float | None = None,
    request: str | None = None,
    rollout: tuple[str, str, str, str] | None = None,
) -> RingWrite:
    """Append the elements of ``value`` at the ring's cursor (see ``LazyStackedTensorDictStore.extend``).

    ``request``: the write's id (a resend of a write that may have run: the server answers with where it wrote).
    ``rollout``: the 'V' op's version, max_ahead, group and size (``_ring.rollouts.write_args``); a store
    whose rollout index is on gets one anyway (the published version, no group)."""
    refuse_spread(engine)
    h0 = engine.header
    n = batch_len(value, h0)
    if not 1 <= n <= h0.count:
        raise ValueError(f"extend got {n} elements for a ring of {h0.count} slots (1 to {h0.count} per call)")
    items = leaves_of(value, h0.stack_pos)
    if not items:
        raise ValueError("extend got a batch with no keys")
    prios = ""
    if priority is not None:
        prios = sampling_policy.format_priorities(
            policy_calls.priority_values(priority, n, policy=policy_calls.policy_of(engine), slots=h0.count)
        )
        if not policy_calls.policy_of(engine).prioritized and not policy_calls.policy_of(engine, fresh=True).prioritized:
            raise ValueError(
                f"extend got priorities, but the store with {engine.where()} has none: call enable_priorities(alpha=...) first"
            )
    channel = engine.keys.events

    def plan(h: Header, kt: KeyTable) -> Any:
        deadline.arm()  # sent once planned: from now on the rows may be written
        # the nested sub-trees' batch dims, for keys the write creates (a store's first extend)
        new_keys = isinstance(value, TensorDictBase) and any(p not in h.leaves for p in items)
        # (and their tensorclasses; of a lazy ring, RAGGED: later rows may hold chats of other lengths)
        sub = subtree_layout(value, value.batch_dims, vary=h.kind == "lazy") if new_keys else None
        new_header, ops, touched = plan_rows(engine.keys, h, kt, items, n, Write.W(n, channel), ring=True, sub=sub)
        if h.sampling is not None and h.sampling.prioritized:
            ops.append(Write.P(kt.ref(engine.keys.priorities), kt.ref(engine.keys.times_sampled), prios))
        elif prios:
            raise ValueError(f"extend got priorities, but the store with {engine.where()} has none")
        if rollout is not None or h.rollouts:  # after 'W': the rows' version and group (lua/_rollouts.lua)
            ops.append(Write.V(*(kt.ref(k) for k in engine.keys.rollout_keys), *(rollout or ("", "", "", ""))))
        if h.trajectories is not None:  # the rows' trajectory ids or end flags: the server keeps its episode index
            ops.append(episodes.episode_op(kt, engine.keys.episodes, h, items, n))
        return new_header, ops, touched

    rid = request or request_id()  # one per extend, sent with every attempt: a resend never writes twice

    def resend(again: float | None) -> RingWrite:
        # the same rows under the same id: the server answers with where the first attempt wrote them
        return extend(engine, value, priority, again, rid, rollout)

    with deadline.resolvable(rid, resend, keyword=True):
        direct = not prios and rollout is None and not engine.header.rollouts
        start = _extend_direct(engine, plan, n, rid, items) if direct else None
        if start is not None:
            h = engine.header
        else:

            def attempt() -> tuple[Header, bytes | None]:
                return engine.run_write_reply(plan, keyset=True, request=rid)

            h, extra = waiting.until_ready(engine, attempt, timeout, "extend")
            assert extra is not None
            start = int(extra)
            direct_extend.learn(engine, start + n)
    return ring_write(start, n, h.count)


def update_if(engine: Engine, index: Any, generation: Any, value: Any) -> torch.Tensor:
    """Write ``value`` at the slots whose generation still matches; returns which rows were applied."""
    refuse_spread(engine)
    h0 = engine.header
    slots, scalar = positions(index, h0.count)
    gens = generations_arg(generation, int(slots.numel()), "update_if")
    n = int(slots.numel())
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    if scalar:
        # one element: each leaf becomes a batch of one
        items = {p: v.unsqueeze(h0.stack_pos) if isinstance(v, torch.Tensor) else v for p, v in leaves_of(value, h0.stack_pos).items()}
    else:
        if batch_len(value, h0) != n:
            raise ValueError(f"update_if got {n} slots and a batch of {batch_len(value, h0)} elements")
        items = leaves_of(value, h0.stack_pos)
    if not items:
        raise ValueError("update_if got a value with no keys")
    keep, back = last_of_each(slots, gens)
    if len(keep) < n:
        rows = {p: rows_of(p, v, h0, n, "update_if") for p, v in items.items()}
        items = {p: [r[k] for k in keep] if isinstance(r, list) else r[torch.tensor(keep)] for p, r in rows.items()}
        if h0.stack_pos:
            items = {p: v.movedim(0, h0.stack_pos) if isinstance(v, torch.Tensor) else v for p, v in items.items()}
        slots, gens = slots[keep], gens[keep]
    m = len(keep)
    pairs = codec.pack_i64(torch.stack([slots, gens], 1).reshape(-1).numpy())

    def plan(h: Header, kt: KeyTable) -> Any:
        deadline.arm()  # sent once planned: from now on the rows may be written
        return plan_rows(engine.keys, h, kt, items, m, Write.G(m, pairs), ring=False)

    request = request_id()
    with deadline.resolvable(request, None):  # a timeout says whether the rows may be written
        _, extra = engine.run_write_reply(plan, request=request)
    assert extra is not None
    applied = torch.tensor([c == ord("1") for c in extra], dtype=torch.bool)
    return applied[torch.tensor(back)]
