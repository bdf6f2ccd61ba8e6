"""The shared ring buffer: ``extend``, ``update_if`` and ``sample`` planned as one script call each.

A store of ``count`` elements doubles as a fixed-capacity ring.  The server keeps
one counter in the store header, ``rw``: how many ring writes the store has had.
Everything else follows from it, inside the script that reads it, so nothing can
drift between processes or machines:

* the cursor (next slot to write) is ``rw % count``;
* the written slots are ``0 .. min(rw, count) - 1``;
* the *generation* of slot ``s`` (how many ring writes it received) is ``0`` when
  ``s >= rw``, else ``(rw - 1 - s) // count + 1``.

``extend`` reserves its slots, writes them and bumps ``rw`` in one ``write.lua``
call, so concurrent writers never get the same slot in one lap.  ``update_if``
writes only the rows whose generation is still the one the caller read (the slot
was not overwritten by a later lap).  ``sample`` draws its random numbers on the
client (a seeded ``torch.Generator`` gives the same batch again) and the script
maps them onto the written slots it sees, so the batch only holds written slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase, lazy_stack

from . import _codec, _policy, _ragged, _rows, _sampling, _waiting
from ._call import Call, leaf_checks
from ._engine import Engine
from ._keys import KeyTable
from ._leaf_ops import check_dtype, element_checks, het_payload, new_leaf_ops, to_heterogeneous
from ._nontensor import NonTensor, element_docs
from ._ops import Read, Write, write_kind
from ._policy import SamplingPolicy
from ._reads import DenseResult, het_rows, plan_rows_tx, with_tables
from ._schema import Header, Leaf, NestedPath, check_paths
from ._segments import het_row_read_op, row_read_op
from ._values import build_td, columns_maker, display, leaves_of, stack_members, subtree_dims

#: Draws are uniform integers below 2**53 (exact in a Lua double); the modulo bias is below 2**-33 for any count under 2**20.
DRAW_HIGH = 1 << 53


class RingWrite(NamedTuple):
    """Where an ``extend``/``append`` wrote: one slot and its new generation per element."""

    indices: torch.Tensor
    generations: torch.Tensor


class Sample(NamedTuple):
    """A batch drawn by ``sample``: the data, and the slot and generation of each row."""

    td: TensorDictBase
    indices: torch.Tensor
    generations: torch.Tensor


class RingState(NamedTuple):
    """The ring's counters as the server holds them."""

    write_count: int
    cursor: int
    written: int


def generations(slots: torch.Tensor, rw: int, count: int) -> torch.Tensor:
    """The generation of each slot when the ring has had ``rw`` writes (see the module docstring)."""
    return torch.where(slots < rw, torch.div(rw - 1 - slots, count, rounding_mode="floor") + 1, torch.zeros_like(slots))


def state(rw: int, count: int) -> RingState:
    return RingState(rw, rw % count if count else 0, min(rw, count))


def _rows_of(path: NestedPath, value: Any, h: Header, n: int, what: str) -> list[torch.Tensor] | torch.Tensor:
    """``value`` as ``n`` rows: a tensor with the rows first, or a list of element tensors (JSON documents for non-tensor data)."""
    if isinstance(value, NonTensor):
        return element_docs(path, value, n, h.stack_pos)
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"key {display(path)!r}: got {len(value)} elements for {what} of {n}")
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"key {display(path)!r}: expected a tensor, got {type(value).__name__}")
    sp = h.stack_pos
    if value.ndim <= sp or value.shape[sp] != n:
        raise ValueError(f"key {display(path)!r}: a value of shape {list(value.shape)} does not hold {n} elements along dim {sp} ({what})")
    return value.movedim(sp, 0) if sp else value


def _batch_len(value: Any, h: Header) -> int:
    """Number of elements of a batch along the store's stack dim."""
    bs = getattr(value, "batch_size", None)
    if bs is not None and len(bs) == len(h.inner) + 1:
        return int(bs[h.stack_pos])
    raise ValueError(
        f"a batch for this store must have batch size {list(h.inner)} with the element dim inserted at {h.stack_pos}; "
        f"got {list(bs) if bs is not None else type(value).__name__}"
    )


def _leaf_ops(
    kt: KeyTable,
    engine: Engine,
    h: Header,
    leaf: Leaf | None,
    number: int,
    path: NestedPath,
    rows: list[torch.Tensor] | torch.Tensor,
    json: bool = False,
) -> tuple[Leaf, list[list[Any]], bool]:
    """Ops writing ``rows`` (one per addressed slot) into leaf ``number``: (leaf after, ops, schema changed).

    A missing leaf is created for the whole ring (zero-filled slots, or empty
    elements for a heterogeneous one); a homogeneous leaf given another element
    shape becomes heterogeneous, in the same call, as ``store[i] = td`` does.
    """
    keys = engine.keys
    dk, ok, sk = keys.data(number), keys.offsets(number), keys.shapes(number)
    ops: list[list[Any]] = []
    changed = False
    if json or (leaf is not None and leaf.json):
        if not json or (leaf is not None and not leaf.json):
            raise TypeError(
                f"key {display(path)!r} holds {'non-tensor data' if leaf is not None and leaf.json else 'tensors'}; "
                "a ring write must keep what each key holds"
            )
        assert isinstance(rows, list)
        if leaf is None:
            leaf = Leaf(path, number, torch.uint8, 1, None, json=True)
            ops += new_leaf_ops(kt, keys, h, leaf)  # slots not written yet read as None
            changed = True
        shapes_b, data, sizes = het_payload(rows)
        return leaf, [*ops, Write.Y(kt.ref(dk), kt.ref(ok), kt.ref(sk), 8, shapes_b, data, *sizes)], changed
    if isinstance(rows, torch.Tensor):
        if leaf is not None:
            check_dtype(path, rows, leaf.dtype)
        elem_shape = tuple(rows.shape[1:])
        if tuple(elem_shape[: len(h.inner)]) != h.inner:
            raise ValueError(
                f"key {display(path)!r}: element shape {list(elem_shape)} does not start with the inner batch size {list(h.inner)}"
            )
        if leaf is None or (not leaf.het and leaf.shape == elem_shape):
            if leaf is None:
                _codec.dtype_name(rows.dtype)
                leaf = Leaf(path, number, rows.dtype, len(elem_shape), elem_shape)
                ops += new_leaf_ops(kt, keys, h, leaf)  # slots not written yet read as zeros
                changed = True
            return leaf, [*ops, _row_op(kt, engine, h, leaf, _codec.to_bytes(rows))], changed
        elems = list(rows.unbind(0))
    else:
        elems = rows
    dtype = leaf.dtype if leaf is not None else (elems[0].dtype if elems else None)
    element_checks(h, path, elems, leaf.ndim if leaf is not None else (elems[0].ndim if elems else None), dtype)
    if leaf is None:
        assert dtype is not None
        _codec.dtype_name(dtype)
        shapes = {tuple(t.shape) for t in elems}
        if len(shapes) == 1:
            return _leaf_ops(kt, engine, h, None, number, path, torch.stack(elems))
        ndim = elems[0].ndim
        leaf = Leaf(path, number, dtype, ndim, None)
        ops += new_leaf_ops(kt, keys, h, leaf)  # slots not written yet hold empty elements
        changed = True
    elif not leaf.het:
        if all(tuple(t.shape) == leaf.shape for t in elems):
            return leaf, [_row_op(kt, engine, h, leaf, _codec.to_bytes(torch.stack(elems)))], False
        leaf, table_ops = to_heterogeneous(kt, keys, leaf, h)
        ops += table_ops
        changed = True
    shapes_b, data, sizes = het_payload(elems)
    ops.append(Write.Y(kt.ref(dk), kt.ref(ok), kt.ref(sk), 8 * leaf.ndim, shapes_b, data, *sizes))
    return leaf, ops, changed


def _row_op(kt: KeyTable, engine: Engine, h: Header, leaf: Leaf, data: Any) -> list[Any]:
    """The op writing one element per addressed row of a homogeneous leaf: 'X' on its blob, 'K' on its column of the row block."""
    if leaf.col is None:
        return Write.X(kt.ref(engine.keys.data(leaf.number)), leaf.element_nbytes, data)
    assert h.row is not None
    return Write.K(kt.ref(engine.keys.data(h.row[0])), leaf.element_nbytes, h.row[1], leaf.col, data)


def _whole_rows(kt: KeyTable, engine: Engine, h: Header, n: int, ops: list[list[Any]]) -> list[list[Any]]:
    """``ops`` with the 'K' ops of every live column of the block (a ring write) joined into one 'X' op of whole rows."""
    assert h.row is not None
    number, width = h.row
    by_col = {op[4]: op for op in ops if op[0] == Write.K.marker}
    grouped = h.grouped()
    if sorted(by_col) != [leaf.col for leaf in grouped]:
        return ops
    rows = _rows.join(width, [(leaf, np.frombuffer(by_col[leaf.col][5], dtype=np.uint8).reshape(n, -1)) for leaf in grouped])
    return [op for op in ops if op[0] != Write.K.marker] + [Write.X(kt.ref(engine.keys.data(number)), width, rows.data.cast("B"))]


def _group_first_keys(
    kt: KeyTable, engine: Engine, h: Header, n: int, pre: list[list[Any]], post: list[list[Any]]
) -> tuple[Header, list[list[Any]], list[list[Any]]]:
    """The first ring write of a store without keys: its small homogeneous leaves go to a new row block
    (one zero-filled block instead of their blobs, and one 'X' op of whole rows)."""
    grouped_h = _rows.grouped_header(h, h.next_leaf)
    if grouped_h.row is None:
        return h, pre, post
    number, width = grouped_h.row
    cols = {engine.keys.data(leaf.number): leaf for leaf in grouped_h.leaves.values() if leaf.col is not None}
    columns = []
    keep_post = []
    for op in post:
        leaf = cols.get(kt.keys[op[1] - 1]) if op[0] == Write.X.marker else None
        if leaf is None:
            keep_post.append(op)
        else:
            columns.append((leaf, np.frombuffer(op[3], dtype=np.uint8).reshape(n, -1)))
    keep_pre = [op for op in pre if not (op[0] == Write.Z.marker and kt.keys[op[1] - 1] in cols)]
    block = kt.ref(engine.keys.data(number))
    rows = _rows.join(width, columns)
    alloc = [] if h.tracked else [Write.Z(block, h.count * width)]  # a tracked store allocates each segment when first written
    return grouped_h, [*keep_pre, *alloc], [*keep_post, Write.X(block, width, rows.data.cast("B"))]


#: Ops that set or allocate a whole key (a key a ring write creates): they go before the row-picking head.
_WHOLE_KEY_OPS = (Write.S, Write.Z)


def _plan_rows(
    engine: Engine,
    h: Header,
    kt: KeyTable,
    items: dict[NestedPath, Any],
    n: int,
    head: list[Any],
    *,
    ring: bool,
    sub: dict[NestedPath, tuple[int, ...]] | None = None,
) -> tuple[Header | None, list[list[Any]], list[Leaf]]:
    """The ops of a ring write (``ring``) or a conditional write: ``head`` (the W/G op), then one X/Y op per leaf."""
    what = "a ring write" if ring else "update_if"
    if ring and h.leaves:
        missing = sorted(".".join(p) for p in h.leaves if p not in items)
        extra = sorted(".".join(p) for p in items if p not in h.leaves)
        if missing or extra:
            raise KeyError(
                f"a ring write must hold exactly the store's keys (each slot is written whole); missing {missing}, not in the store {extra}"
            )
    if not ring:
        unknown = [p for p in items if p not in h.leaves]
        if unknown:
            raise KeyError(f"key {display(unknown[0])!r} is not in the store (update_if writes existing keys only)")
    leaves = dict(h.leaves)
    next_leaf = h.next_leaf
    pre: list[list[Any]] = []
    post: list[list[Any]] = []
    changed = False
    for path, value in items.items():
        leaf = leaves.get(path)
        number = leaf.number if leaf is not None else next_leaf
        if leaf is None:
            next_leaf += 1
        new_leaf, ops, ch = _leaf_ops(kt, engine, h, leaf, number, path, _rows_of(path, value, h, n, what), isinstance(value, NonTensor))
        leaves[path] = new_leaf
        changed |= ch
        pre += [op for op in ops if write_kind(op) in _WHOLE_KEY_OPS]
        post += [op for op in ops if write_kind(op) not in _WHOLE_KEY_OPS]
    if len(leaves) != len(h.leaves):
        check_paths(list(leaves))
    new_header = h.with_leaves(leaves, next_leaf, sub=sub if len(leaves) != len(h.leaves) else None) if changed else None
    if ring and not h.leaves and new_header is not None:
        new_header, pre, post = _group_first_keys(kt, engine, new_header, n, pre, post)
    elif ring and (new_header or h).row is not None:
        post = _whole_rows(kt, engine, new_header or h, n, post)
    touched = [h.leaves[p] for p in items if p in h.leaves]
    return new_header, [*pre, head, *post], touched


def extend(engine: Engine, value: Any, priority: Any = None, timeout: float | None = None) -> RingWrite:
    """Append the elements of ``value`` at the ring's cursor (see ``LazyStackedTensorDictStore.extend``)."""
    refuse_spread(engine)
    h0 = engine.header
    n = _batch_len(value, h0)
    if not 1 <= n <= h0.count:
        raise ValueError(f"extend got {n} elements for a ring of {h0.count} slots (1 to {h0.count} per call)")
    items = leaves_of(value, h0.stack_pos)
    if not items:
        raise ValueError("extend got a batch with no keys")
    sub = subtree_dims(value, value.batch_dims) if isinstance(value, TensorDictBase) else None  # for keys the first extend creates
    prios = ""
    if priority is not None:
        prios = _policy.format_priorities(_sampling.priority_values(priority, n))
        if not _sampling.policy_of(engine).prioritized and not _sampling.policy_of(engine, fresh=True).prioritized:
            raise ValueError(
                f"extend got priorities, but the store with {engine.where()} has none: call enable_priorities(alpha=...) first"
            )
    channel = engine.keys.events

    def plan(h: Header, kt: KeyTable) -> Any:
        new_header, ops, touched = _plan_rows(engine, h, kt, items, n, Write.W(n, channel), ring=True, sub=sub)
        if h.sampling is not None and h.sampling.prioritized:
            ops.append(Write.P(kt.ref(engine.keys.priorities), kt.ref(engine.keys.times_sampled), prios))
        elif prios:
            raise ValueError(f"extend got priorities, but the store with {engine.where()} has none")
        return new_header, ops, touched

    def attempt() -> tuple[Header, bytes | None]:
        return engine.run_write_reply(plan, keyset=True)

    h, extra = _waiting.until_ready(engine, attempt, timeout, "extend")
    assert extra is not None
    start = int(extra)
    writes = torch.arange(start, start + n, dtype=torch.int64)
    return RingWrite(writes % h.count, torch.div(writes, h.count, rounding_mode="floor") + 1)


def refuse_spread(engine: Engine) -> None:
    """Ring calls reserve slots and pick rows on the server, over every segment at once: one slot only."""
    if engine.header.spread:
        raise NotImplementedError(
            f"the store with {engine.where()} is spread over several cluster nodes (spread=True); the ring buffer "
            "(extend, sample, update_if) needs every segment in one slot: create the store without spread=True"
        )


def _int_tensor(value: Any) -> torch.Tensor:
    """``torch.as_tensor``, except that an empty list is an empty int64 tensor (not float32)."""
    if isinstance(value, (list, tuple)) and not value:
        return torch.zeros(0, dtype=torch.int64)
    return torch.as_tensor(value)


def slots_of(index: Any, count: int, what: str = "index") -> torch.Tensor:
    """A 1-D int64 tensor of slots from an int, list or tensor (negative ints count from the end)."""
    t = _int_tensor(index)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise IndexError(f"{what} must hold integer slots, got {t.dtype}")
    t = t.reshape(-1).to(torch.int64)
    if t.numel():
        bad = t[(t < -count) | (t >= count)]
        if bad.numel():
            raise IndexError(f"slot {int(bad[0])} is out of range for a ring of {count} slots")
    return torch.where(t < 0, t + count, t)


def generations_arg(generation: Any, n: int, what: str) -> torch.Tensor:
    """The generations a caller gives for ``n`` slots as a 1-D int64 tensor (``TypeError`` for a
    non-integer dtype, ``ValueError`` for another count or a negative one)."""
    g = _int_tensor(generation)
    if g.dtype == torch.bool or g.is_floating_point() or g.is_complex():
        raise TypeError(f"generations must be integers, got {g.dtype}")
    gens = g.reshape(-1).to(torch.int64)
    if gens.numel() != n:
        raise ValueError(f"{what} got {n} slots and {gens.numel()} generations")
    if bool((gens < 0).any()):
        raise ValueError(f"generations are never negative, got {gens.tolist()}")
    return gens


def _last_of_each(slots: torch.Tensor, gens: torch.Tensor) -> tuple[list[int], list[int]]:
    """Rows to send (the last row naming each slot, as sequential writes would leave it) and, per row, its kept row's position.

    A batch from :meth:`sample` names a slot twice when it drew it twice; both rows
    then carry the same generation. Rows naming one slot with two generations are a
    caller's mistake (one of them cannot be current), refused before any write.
    """
    last: dict[int, int] = {}
    gen_of: dict[int, int] = {}
    for k, (s, g) in enumerate(zip(slots.tolist(), gens.tolist())):
        if gen_of.setdefault(s, g) != g:
            raise ValueError(f"update_if names slot {s} with two generations ({gen_of[s]} and {g})")
        last[s] = k
    keep = sorted(last.values())
    pos = {slots[k].item(): j for j, k in enumerate(keep)}
    return keep, [pos[s] for s in slots.tolist()]


def update_if(engine: Engine, index: Any, generation: Any, value: Any) -> torch.Tensor:
    """Write ``value`` at the slots whose generation still matches; returns which rows were applied."""
    refuse_spread(engine)
    h0 = engine.header
    scalar = isinstance(index, int) or (isinstance(index, torch.Tensor) and index.ndim == 0)
    slots = slots_of(index, h0.count)
    gens = generations_arg(generation, int(slots.numel()), "update_if")
    n = int(slots.numel())
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    if scalar:
        # one element: each leaf becomes a batch of one
        items = {p: v.unsqueeze(h0.stack_pos) if isinstance(v, torch.Tensor) else v for p, v in leaves_of(value, h0.stack_pos).items()}
    else:
        if _batch_len(value, h0) != n:
            raise ValueError(f"update_if got {n} slots and a batch of {_batch_len(value, h0)} elements")
        items = leaves_of(value, h0.stack_pos)
    if not items:
        raise ValueError("update_if got a value with no keys")
    keep, back = _last_of_each(slots, gens)
    if len(keep) < n:
        rows = {p: _rows_of(p, v, h0, n, "update_if") for p, v in items.items()}
        items = {p: [r[k] for k in keep] if isinstance(r, list) else r[torch.tensor(keep)] for p, r in rows.items()}
        if h0.stack_pos:
            items = {p: v.movedim(0, h0.stack_pos) if isinstance(v, torch.Tensor) else v for p, v in items.items()}
        slots, gens = slots[keep], gens[keep]
    m = len(keep)
    pairs = _codec.pack_i64(torch.stack([slots, gens], 1).reshape(-1).numpy())

    def plan(h: Header, kt: KeyTable) -> Any:
        return _plan_rows(engine, h, kt, items, m, Write.G(m, pairs), ring=False)

    _, extra = engine.run_write_reply(plan)
    assert extra is not None
    applied = torch.tensor([c == ord("1") for c in extra], dtype=torch.bool)
    return applied[torch.tensor(back)]


def _selected(h: Header, keys: list[NestedPath] | None) -> list[Leaf]:
    """The leaves a sample reads: every one, or those at or below ``keys`` (``KeyError`` naming a key that matches none)."""
    if keys is None:
        return list(h.leaves.values())
    out = []
    for key in keys:
        found = [leaf for path, leaf in h.leaves.items() if path[: len(key)] == key]
        if not found:
            raise KeyError(f"key {display(key)!r} is not in the store")
        out += [leaf for leaf in found if leaf not in out]
    return out


def sample(
    engine: Engine,
    batch_size: int,
    generator: torch.Generator | None,
    device: torch.device | None,
    ragged: dict[str, Any] | None = None,
    keys: list[NestedPath] | None = None,
    *,
    prioritized: bool | None = None,
    alpha: float | None = None,
    beta: float = 1.0,
    min_size: int | None = None,
    timeout: float | None = None,
) -> Sample | _sampling.PrioritizedSample:
    """Draw ``batch_size`` written slots (with replacement) and read them, in one call.

    Uniformly, or by priority on a store with priorities (see ``_sampling``); waiting
    for ``min_size`` written slots or the store's rate limiter when they say so.
    ``ragged`` (``as_padded_tensor=True`` or ``as_nested_tensor=True``, with ``padding_side``,
    ``padding_value``, ``layout``) makes each heterogeneous key one padded or jagged tensor of
    the batch (see ``_ragged``), so the sample is a TensorDict instead of a lazy stack. ``keys``
    reads only those keys (and the keys below them)."""
    _check_sample_args(batch_size, min_size, beta)
    draws = torch.randint(0, DRAW_HIGH, (batch_size,), generator=generator, dtype=torch.int64)
    refuse_spread(engine)
    h = engine.header
    asked = prioritized  # as the caller gave it (None: the store's policy decides)
    policy = _sample_policy(engine, h, prioritized, alpha, min_size)
    by_policy = policy.prioritized if prioritized is None else prioritized
    by_policy = by_policy or min_size is not None or h.sampling is not None
    chosen = _selected(h, keys)
    if not by_policy and engine.ring_full and engine.tx_reads and h.stack_pos == 0 and chosen and not any(leaf.het for leaf in chosen):
        got = _full_ring_sample(engine, h, draws, keys, chosen, device, ragged)
        if isinstance(got, Sample):
            return got
        if got is _UNDER_POLICY:  # the cached header predated a sampling policy: sample under it
            return sample(
                engine,
                batch_size,
                generator,
                device,
                ragged,
                keys,
                prioritized=asked,
                alpha=alpha,
                beta=beta,
                min_size=min_size,
                timeout=timeout,
            )
    planner = _SamplePlanner(engine, batch_size, draws, keys, device, ragged, asked, min_size, beta, as_tx=not by_policy)

    def run() -> Any:
        try:
            return engine.run(planner.plan)
        except _RingMoved:  # the ring is under a policy now (or was recreated): the script samples
            planner.as_tx = False
            engine.set_header(engine.fetch_header())
            return engine.run(planner.plan)

    return _sampling.wait_or_raise(engine, run, timeout, min_size is not None or timeout is not None or policy.limit is not None, "sample")


def _check_sample_args(batch_size: Any, min_size: Any, beta: Any) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"sample needs a positive int batch_size, got {batch_size!r}")
    if min_size is not None and (isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0):
        raise ValueError(f"min_size must be None or an int >= 0, got {min_size!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")


def _sample_policy(engine: Engine, h: Header, prioritized: bool | None, alpha: float | None, min_size: int | None) -> SamplingPolicy:
    """The store's sampling policy, once the sample's arguments are checked against it."""
    policy = _sampling.policy_of(engine)
    if prioritized is None:
        prioritized = policy.prioritized
    elif prioritized and not policy.prioritized:
        policy = _sampling.policy_of(engine, fresh=True)
        if not policy.prioritized:
            raise ValueError(f"the store with {engine.where()} has no priorities: call enable_priorities(alpha=...) first")
    if prioritized and alpha is not None and float(alpha) != policy.alpha:
        raise ValueError(
            f"the store with {engine.where()} keeps priorities with alpha={policy.alpha:g} (set by enable_priorities); got alpha={alpha!r}"
        )
    if not prioritized and policy.max_times is not None:
        raise ValueError(
            f"the store with {engine.where()} retires slots after max_times_sampled={policy.max_times} samples, "
            "which only a prioritized sample counts: sample with prioritized=True"
        )
    if min_size is not None and min_size > h.count:
        raise ValueError(f"min_size={min_size} can never be reached by a ring of {h.count} slots")
    if engine.readonly and (policy.limit is not None or policy.max_times is not None):
        raise PermissionError(
            f"the store with {engine.where()} counts samples (rate limiter or max_times_sampled): a read-only handle cannot sample it"
        )
    return policy


#: :func:`_full_ring_sample`: the ring is under a sampling policy that the cached header did not know.
_UNDER_POLICY = object()


def _full_ring_sample(
    engine: Engine,
    h: Header,
    draws: torch.Tensor,
    keys: list[NestedPath] | None,
    chosen: list[Leaf],
    device: torch.device | None,
    ragged: dict[str, Any] | None,
) -> Sample | object | None:
    """A uniform sample of a full ring of homogeneous keys as one transaction of plain GETRANGEs.

    A full ring stays full (rw only grows): the client maps the draws to slots as read.lua would,
    and reads rw in the same transaction for the generations, and the policy field: a policy set
    since this header was read sends the sample through read.lua (the header is read again, and
    :data:`_UNDER_POLICY` returned). None when the ring turns out not to be full.
    """
    slots = draws % h.count
    _, res = engine.read(slots, None if keys is None else [leaf.path for leaf in chosen], fields=("rw", "sc"))
    fields = res.fields if isinstance(res, DenseResult) and res.fields is not None else {}
    rw = fields.get("rw")
    if isinstance(res, DenseResult) and rw is not None and int(rw) >= h.count and fields.get("sc") is None:
        if ragged and ragged.get("return_mask"):
            with_masks(h, res.leaves, {}, ragged)
        return Sample(build_td(res.leaves, res.batch_size, device, sub=h.sub_dims), slots, generations(slots, int(rw), h.count))
    if fields.get("sc") is not None:
        engine.set_header(engine.fetch_header())
        return _UNDER_POLICY
    return None


@dataclass
class _SamplePlanner:
    """Plans a sample's call from the header it is sent with: a policy set since the first plan (a
    STALE reply brings it) decides the call too."""

    engine: Engine
    batch_size: int
    draws: torch.Tensor
    keys: list[NestedPath] | None
    device: torch.device | None
    ragged: dict[str, Any] | None
    asked: bool | None  # prioritized, as the caller gave it (None: the store's policy decides)
    min_size: int | None
    beta: float
    as_tx: bool  # a full ring's uniform sample may go as a transaction (see _tx_sample_call)

    def plan(self, h: Header) -> Call:
        engine, keys = self.engine, self.keys
        by_prio = self.asked if self.asked is not None else (h.sampling is not None and h.sampling.prioritized)
        use_policy = by_prio or self.min_size is not None or h.sampling is not None
        if self.as_tx and not use_policy and engine.ring_full and h.stack_pos == 0:
            tx = _tx_sample_call(engine, h, keys, self.draws, self.device, self.ragged)
            if tx is not None:
                return tx
        packed = _codec.pack_i64(self.draws.numpy())

        def head(kt: KeyTable) -> list[Any]:
            if use_policy:
                tree, counts = kt.ref(engine.keys.priorities), kt.ref(engine.keys.times_sampled)
                return Read.P(self.batch_size, packed, tree, counts, engine.keys.events, self.min_size or 0, "1" if by_prio else "0")
            return Read.U(self.batch_size, packed)

        def parse(reply: list, rows: _RowRead) -> Sample | _sampling.PrioritizedSample:
            pieces = 6 if use_policy else 4
            got = _decode_sample(h, rows.leaves, reply, pieces, self.device, rows.block, rows.grouped, self.ragged, rows.wanted)
            engine.ring_full = engine.ring_full or int(reply[3]) >= h.count
            if not by_prio:
                return got
            probs, low = _sampling.probabilities(reply)
            return _sampling.PrioritizedSample(got.td, got.indices, got.generations, _sampling.weights_of(probs, low, self.beta), probs)

        call = _row_read_call(engine, h, keys, self.batch_size, head, parse)
        if use_policy:
            return call
        # a uniform sample: bring back the offset tables the handle does not keep (of the segments the
        # draws fall in once the ring is full), so that the next samples of a full ring go as transactions
        units = _rows.units(h, _selected(h, keys))[0]
        return with_tables(engine, h, call, KeyTable(*call.keys), units, (self.draws % h.count).numpy(), count_at=2)


class _RingMoved(Exception):
    """A transaction sample found the ring not full, or under a sampling policy: ``read.lua`` samples it."""


def _tx_sample_call(
    engine: Engine,
    h: Header,
    keys: list[NestedPath] | None,
    draws: torch.Tensor,
    device: torch.device | None,
    ragged: dict[str, Any] | None,
) -> Call | None:
    """A uniform sample of a full ring with heterogeneous keys as one read transaction: the client maps
    the draws to slots as ``read.lua``'s ``U`` op would (``draw % count``) and reads the rows from the
    offset tables it keeps (``_reads.plan_rows_tx``), ``rw`` and the policy field with them. None when
    a table is not kept, or every key read is homogeneous (``engine.read`` samples those)."""
    selected = _selected(h, keys)
    if not selected or not any(leaf.het for leaf in selected):
        return None
    leaves, block, grouped = _rows.units(h, selected)
    slots = (draws % h.count).numpy()
    tx = plan_rows_tx(engine, h, slots, leaves)
    if tx is None:
        return None
    wanted = None if keys is None else {leaf.path for leaf in selected}
    guards = {"epoch": h.epoch, "kv": str(h.keyset_version), **{f"lv:{leaf.number}": str(leaf.version) for leaf in selected}}

    def parse(reply: list) -> Sample:
        fields = call.field_values or {}
        rw = fields.get("rw")
        if rw is None or int(rw) < h.count or fields.get("sc") is not None:
            raise _RingMoved
        return _decode_sample(h, leaves, [*reply[:2], _codec.pack_i64(slots), rw, *reply[2:]], 4, device, block, grouped, ragged, wanted)

    call = Call("tx", [], [], parse, ranges=tx[0], guards=guards, fields=["rw", "sc"], verify=tx[1])
    return call


def pop(
    engine: Engine, batch_size: int, device: torch.device | None, timeout: float | None, keys: list[NestedPath] | None = None
) -> Sample:
    """The next unread items, in write order, each handed to exactly one caller (see ``LazyStackedTensorDictStore.pop``)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"pop needs a positive int batch_size, got {batch_size!r}")
    engine.refuse_if_readonly()
    refuse_spread(engine)
    channel = engine.keys.events

    def plan_call(h: Header) -> Call:
        return _row_read_call(
            engine,
            h,
            keys,
            batch_size,
            lambda kt: Read.F(batch_size, channel),
            lambda reply, rows: _decode_sample(h, rows.leaves, reply, 4, device, rows.block, rows.grouped, None, rows.wanted),
        )

    return _waiting.until_ready(engine, lambda: engine.run(plan_call), timeout, "pop")


class _RowRead(NamedTuple):
    """What a row read reads: its units (leaves, with the row block standing for its columns) and which keys were asked for."""

    leaves: list[Leaf]
    block: Leaf | None
    grouped: list[Leaf]
    wanted: set[NestedPath] | None


def _row_read_call(engine: Engine, h: Header, keys: list[NestedPath] | None, rows: int, head: Any, parse: Any) -> Call:
    """A ``read.lua`` call whose rows one op picks (``head(kt)``: 'U', 'P' or 'F') and whose other ops read
    every selected leaf at those rows; ``parse(reply, _RowRead)`` makes the result."""
    selected = _selected(h, keys)
    wanted = None if keys is None else {leaf.path for leaf in selected}
    kt = engine.key_table(h)
    checks = leaf_checks(selected)
    leaves, block, grouped = _rows.units(h, selected)
    args: list[Any] = [f"{h.epoch}:K{h.keyset_version}", checks, 1 + len(leaves), *head(kt)]
    for leaf in leaves:
        if leaf.het:
            d, o, s = (kt.ref(key) for key in engine.keys.leaf_keys(leaf.number))
            args += het_row_read_op(h.segments, leaf.ndim, rows)(d, o, s, 8 * leaf.ndim)
        else:
            args += row_read_op(h.segments, leaf.element_nbytes, rows)(kt.ref(engine.keys.data(leaf.number)), leaf.element_nbytes)
    unit = _RowRead(leaves, block, grouped, wanted)
    return Call("read", kt.keys, args, lambda reply: parse(reply, unit))


def with_masks(h: Header, dense: dict[NestedPath, torch.Tensor], masks: dict[NestedPath, torch.Tensor], ragged: dict[str, Any]) -> None:
    """Add to a sample's ``dense`` leaves the masks ``return_mask`` asks for, where ``tensordict.pad_sequence``
    puts them (under ``"masks"`` or the key it names): a padded key's own, every other key's all True
    along its first dim (a key whose elements all have one length so far is masked like the others)."""
    where = _ragged.mask_root(ragged, h.leaves)
    for path, t in list(dense.items()):
        m = masks.get(path)
        dense[(*where, *path)] = m if m is not None else torch.ones(t.shape[: min(2, t.ndim)], dtype=torch.bool, device=t.device)


def _decode_sample(
    h: Header,
    leaves: list[Leaf],
    reply: list,
    first: int,
    device: torch.device | None,
    block: Leaf | None,
    grouped: list[Leaf],
    ragged: dict[str, Any] | None = None,
    wanted: set[NestedPath] | None = None,
) -> Sample:
    """The batch a 'U', 'P' or 'F' op read: slots in ``reply[2]``, rw in ``reply[3]``, the leaves' pieces from ``reply[first]``."""
    slots = torch.from_numpy(_codec.unpack_i64(reply[2]).astype(np.int64))
    n = int(slots.numel())
    rw = int(reply[3])
    pieces = reply[first:]
    pos = 0
    dense: dict[NestedPath, torch.Tensor] = {}
    masks: dict[NestedPath, torch.Tensor] = {}
    per_el: dict[NestedPath, list[torch.Tensor]] = {}
    for leaf in leaves:
        if not leaf.het:
            assert leaf.shape is not None
            rows = _codec.from_bytes(pieces[pos], leaf.dtype, (n, *leaf.shape))
            if leaf is block:
                dense.update(_rows.split(rows, grouped))
            else:
                dense[leaf.path] = rows
            pos += 1
            continue
        one = None
        if ragged and not leaf.json and not h.inner and h.stack_pos == 0:
            # the rows' shape records and bytes, joined: one padded or jagged tensor, no tensor per row
            one = _ragged.build(leaf, _codec.unpack_i64(pieces[pos + 1]).reshape(n, leaf.ndim), pieces[pos + 2], ragged)
        elif ragged:
            _ragged.check_mask(ragged, display(leaf.path))
        if isinstance(one, tuple):
            dense[leaf.path], masks[leaf.path] = one
        elif one is not None:
            dense[leaf.path] = one
        else:
            per_el[leaf.path] = het_rows(leaf, h.leaf_inner(leaf.path), n, pieces[pos], pieces[pos + 1], pieces[pos + 2])
        pos += 3
    if block is not None or ragged or wanted is not None:  # the store's key order (and only the keys asked for)
        dense = {path: dense[path] for path in h.leaves if path in dense and (wanted is None or path in wanted)}
    if ragged and ragged.get("return_mask"):
        if per_el:
            _ragged.check_mask(ragged, display(next(iter(per_el))))
        with_masks(h, dense, masks, ragged)
    sp = h.stack_pos
    if not per_el:
        bs = (*h.inner[:sp], n, *h.inner[sp:])
        td = build_td({p: t.movedim(0, sp) if sp else t for p, t in dense.items()}, bs, device, sub=h.sub_dims)
    else:
        rows_of: dict[NestedPath, Any] = {p: t.unbind(0) for p, t in dense.items()}  # one view per row, made in one call
        rows_of.update(per_el)
        if device is None or device.type == "cpu":
            td = stack_members(columns_maker(list(rows_of), 0, torch.Size(h.inner), device, h.sub_dims)(rows_of, n), sp)
        else:  # build_td moves each element to the device
            td = lazy_stack(
                [build_td({p: rows[k] for p, rows in rows_of.items()}, h.inner, device, sub=h.sub_dims) for k in range(n)], dim=sp
            )
    return Sample(td, slots, generations(slots, rw, h.count))
