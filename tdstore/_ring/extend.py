"""The shared ring buffer: ``extend`` and ``update_if`` planned as one script call each (its reads,
``sample`` and ``pop``, are in ``_ring.sample_pop``).

A store of ``count`` elements doubles as a fixed-capacity ring.  The server keeps
one counter in the store header, ``rw``: how many ring writes the store has had.
Everything else follows from it, inside the script that reads it, so nothing can
drift between processes or machines:

* the cursor (next slot to write) is ``rw % count``;
* the written slots are ``0 .. min(rw, count) - 1``; a store holding data the ring never
  wrote (an upload, writes by index) is a full ring, ``rw = count`` (``_format.header_info.ring_writes``),
  so its first ``extend`` overwrites slot 0, the oldest;
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

import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._engine import deadline as _deadline
from tdstore._engine.engine import Engine, request_id
from tdstore._engine.write_call import first_keys
from tdstore._errors import DenseShapeError
from tdstore._format import codec as _codec
from tdstore._format import row_block as _rows
from tdstore._format import sampling_policy as _policy
from tdstore._format.keys import KeyTable
from tdstore._format.nontensor import NonTensor, element_docs
from tdstore._format.op_kinds import Write, write_kind
from tdstore._format.schema import Header, Leaf, NestedPath, check_paths
from tdstore._plan import index as _index
from tdstore._plan.leaf_writes import check_dtype, element_checks, het_payload, new_leaf_ops, to_heterogeneous
from tdstore._plan.values import display, leaves_of, subtree_layout
from tdstore._ring import direct_extend as _direct
from tdstore._ring import episodes as _episodes
from tdstore._ring import policy_calls as _sampling
from tdstore._ring import waiting as _waiting
from tdstore._ring.args import generations_arg, refuse_spread

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


#: Header fields a read transaction takes with a full ring's sample: the ring write count (and the
#: inventory's size, for a store filled by index) and the sampling policy field.
RING_FIELDS = ("rw", "na", "sc")


def ring_writes_of(engine: Engine, fields: Mapping[str, Any], h: Header) -> int:
    """The ring write count from the header fields :data:`RING_FIELDS` a transaction read
    (``_format.header_info.ring_writes``: a store filled by index is a full ring), range-checked."""
    return engine.ring_writes_from(fields.get("rw"), fields.get("na"), h)


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


def _plan_leaf_rows(
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
            return _plan_leaf_rows(kt, engine, h, None, number, path, torch.stack(elems))
        _refuse_ragged(h, path, None, shapes)
        ndim = elems[0].ndim
        leaf = Leaf(path, number, dtype, ndim, None)
        ops += new_leaf_ops(kt, keys, h, leaf)  # slots not written yet hold empty elements
        changed = True
    elif not leaf.het:
        if all(tuple(t.shape) == leaf.shape for t in elems):
            return leaf, [_row_op(kt, engine, h, leaf, _codec.to_bytes(torch.stack(elems)))], False
        _refuse_ragged(h, path, leaf, {tuple(t.shape) for t in elems})
        leaf, table_ops = to_heterogeneous(kt, keys, leaf, h)
        ops += table_ops
        changed = True
    shapes_b, data, sizes = het_payload(elems)
    ops.append(Write.Y(kt.ref(dk), kt.ref(ok), kt.ref(sk), 8 * leaf.ndim, shapes_b, data, *sizes))
    return leaf, ops, changed


def _refuse_ragged(h: Header, path: NestedPath, leaf: Leaf | None, shapes: set[tuple[int, ...]]) -> None:
    """A dense store keeps one row shape per key: rows of other shapes raise (where a lazy store's key turns heterogeneous)."""
    if h.kind != "dense":
        return
    got = sorted(list(s) for s in shapes if leaf is None or s != leaf.shape)
    more = f" and {len(got) - 3} more" if len(got) > 3 else ""
    have = f"rows of shape {list(leaf.shape or ())}" if leaf is not None else "one row shape"
    raise DenseShapeError(
        f"key {display(path)!r}: this dense store holds {have}, the write gives rows of shape(s) {got[:3]}{more}; "
        "a dense store keeps one shape per key (ragged rows need a LazyStackedTensorDictStore)"
    )


def _row_op(kt: KeyTable, engine: Engine, h: Header, leaf: Leaf, data: Any) -> list[Any]:
    """The op writing one element per addressed row of a homogeneous leaf: 'X' on its blob, 'K' on its column of the row block."""
    if leaf.col is None:
        return Write.X(kt.ref(engine.keys.data(leaf.number)), leaf.element_nbytes, data)
    assert h.row is not None
    return Write.K(kt.ref(engine.keys.data(h.row[0])), leaf.element_nbytes, h.row[1], leaf.col, data)


def _block_op(block: int, width: int, columns: list[tuple[Leaf, np.ndarray]]) -> list[Any]:
    """The 'X' op writing whole rows of the row block (KEYS index ``block``, ``width`` bytes per row): the
    columns ``(leaf, data (n, element bytes))`` joined."""
    return Write.X(block, width, _rows.join(width, columns).data.cast("B"))


def _whole_rows(kt: KeyTable, engine: Engine, h: Header, n: int, ops: list[list[Any]]) -> list[list[Any]]:
    """``ops`` with the 'K' ops of every live column of the block (a ring write) joined into one 'X' op of whole rows."""
    assert h.row is not None
    number, width = h.row
    by_col = {op[4]: op for op in ops if op[0] == Write.K.marker}
    grouped = h.grouped()
    if sorted(by_col) != [leaf.col for leaf in grouped]:
        return ops
    columns = [(leaf, np.frombuffer(by_col[leaf.col][5], dtype=np.uint8).reshape(n, -1)) for leaf in grouped]
    return [op for op in ops if op[0] != Write.K.marker] + [_block_op(kt.ref(engine.keys.data(number)), width, columns)]


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
    alloc = [] if h.tracked else [Write.Z(block, h.count * width)]  # a tracked store allocates each segment when first written
    return grouped_h, [*keep_pre, *alloc], [*keep_post, _block_op(block, width, columns)]


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
        # a key the store lacks is created for every slot (zeros elsewhere), as store[i] = td does;
        # a key the batch lacks would leave its slots holding an older element's value
        missing = sorted(".".join(p) for p in h.leaves if p not in items)
        if missing:
            raise KeyError(
                f"a ring write must hold every key of the store (each slot is written whole); missing {missing}: "
                "add them to the batch, or delete the key first (del store[key])"
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
        new_leaf, ops, ch = _plan_leaf_rows(
            kt, engine, h, leaf, number, path, _rows_of(path, value, h, n, what), isinstance(value, NonTensor)
        )
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
    """The plan of a ring write (``_plan_rows``'s ops: 'W', then one 'X' of whole rows) when every key of the
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
        columns.append((leaf, np.frombuffer(_codec.to_bytes(t), dtype=np.uint8).reshape(n, -1)))
    return b.kt, [Write.W(n, engine.keys.events), _block_op(b.block, h.row[1], columns)], list(b.grouped)


def _extend_direct(
    engine: Engine, plan: Callable[[Header, KeyTable], Any], n: int, request: str, items: dict[NestedPath, Any]
) -> int | None:
    """The first slot of an extend sent with its rows as plain SETRANGEs (``_ring.direct_extend``), or None when it
    goes through ``write.lua`` (planned there again: bad input raises here, before anything is sent)."""
    h = engine.header
    if not _direct.usable(engine, h):
        return None
    fast = _block_plan(engine, h, items, n)
    if fast is not None:
        with engine.naming_errors():
            return _direct.extend(engine, h, *fast, n, request)
    kt = engine.key_table(h)
    new_header, ops, touched = plan(h, kt)
    if new_header is not None:
        if h.leaves or not h.tracked:  # a schema change of a store with keys: write.lua's
            return None
        new_header = first_keys(engine, h, new_header, ops, kt)  # the first keys, allocated by direct.lua 'open'
        if new_header.segments.n != 1:
            return None
    with engine.naming_errors():
        return _direct.extend(engine, h, kt, ops, touched, n, request, new_header)


@_deadline.honours_timeout("extend")
def extend(engine: Engine, value: Any, priority: Any = None, timeout: float | None = None, request: str | None = None) -> RingWrite:
    """Append the elements of ``value`` at the ring's cursor (see ``LazyStackedTensorDictStore.extend``).

    ``request``: the write's id (a resend of a write that may have run: the server answers with where it wrote)."""
    refuse_spread(engine)
    h0 = engine.header
    n = _batch_len(value, h0)
    if not 1 <= n <= h0.count:
        raise ValueError(f"extend got {n} elements for a ring of {h0.count} slots (1 to {h0.count} per call)")
    items = leaves_of(value, h0.stack_pos)
    if not items:
        raise ValueError("extend got a batch with no keys")
    prios = ""
    if priority is not None:
        prios = _policy.format_priorities(_sampling.priority_values(priority, n, policy=_sampling.policy_of(engine), slots=h0.count))
        if not _sampling.policy_of(engine).prioritized and not _sampling.policy_of(engine, fresh=True).prioritized:
            raise ValueError(
                f"extend got priorities, but the store with {engine.where()} has none: call enable_priorities(alpha=...) first"
            )
    channel = engine.keys.events

    def plan(h: Header, kt: KeyTable) -> Any:
        _deadline.arm()  # sent once planned: from now on the rows may be written
        # the nested sub-trees' batch dims, for keys the write creates (a store's first extend)
        new_keys = isinstance(value, TensorDictBase) and any(p not in h.leaves for p in items)
        # (and their tensorclasses; of a lazy ring, RAGGED: later rows may hold chats of other lengths)
        sub = subtree_layout(value, value.batch_dims, vary=h.kind == "lazy") if new_keys else None
        new_header, ops, touched = _plan_rows(engine, h, kt, items, n, Write.W(n, channel), ring=True, sub=sub)
        if h.sampling is not None and h.sampling.prioritized:
            ops.append(Write.P(kt.ref(engine.keys.priorities), kt.ref(engine.keys.times_sampled), prios))
        elif prios:
            raise ValueError(f"extend got priorities, but the store with {engine.where()} has none")
        if h.trajectories is not None:  # the rows' trajectory ids or end flags: the server keeps its episode index
            ops.append(_episodes.episode_op(kt, engine.keys.episodes, h, items, n))
        return new_header, ops, touched

    rid = request or request_id()  # one per extend, sent with every attempt: a resend never writes twice

    def resend(again: float | None) -> RingWrite:
        # the same rows under the same id: the server answers with where the first attempt wrote them
        return extend(engine, value, priority, again, rid)

    with _deadline.resolvable(rid, resend, keyword=True):
        start = _extend_direct(engine, plan, n, rid, items) if not prios else None
        if start is not None:
            h = engine.header
        else:

            def attempt() -> tuple[Header, bytes | None]:
                return engine.run_write_reply(plan, keyset=True, request=rid)

            h, extra = _waiting.until_ready(engine, attempt, timeout, "extend")
            assert extra is not None
            start = int(extra)
            _direct.learn(engine, start + n)
    return ring_write(start, n, h.count)


def ring_write(start: int, n: int, count: int) -> RingWrite:
    """The slots and new generations of ``n`` rows written from ring write ``start`` on."""
    s0, lap = start % count, start // count
    if s0 + n <= count:  # no wrap: one run of slots, one generation
        return RingWrite(torch.arange(s0, s0 + n, dtype=torch.int64), torch.full((n,), lap + 1, dtype=torch.int64))
    writes = torch.arange(start, start + n, dtype=torch.int64)
    return RingWrite(writes % count, torch.div(writes, count, rounding_mode="floor") + 1)


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
    slots, scalar = _index.positions(index, h0.count)
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
        _deadline.arm()  # sent once planned: from now on the rows may be written
        return _plan_rows(engine, h, kt, items, m, Write.G(m, pairs), ring=False)

    request = request_id()
    with _deadline.resolvable(request, None):  # a timeout says whether the rows may be written
        _, extra = engine.run_write_reply(plan, request=request)
    assert extra is not None
    applied = torch.tensor([c == ord("1") for c in extra], dtype=torch.bool)
    return applied[torch.tensor(back)]
