"""The ring buffer's plans: which slots a ring write takes, which ops write its rows, and what the replies
mean (slots, generations, the ring's state). Pure: no I/O; ``_ring.extend`` and ``_ring.sample_pop`` send
the calls these plan.

A store of ``count`` elements doubles as a fixed-capacity ring.  The server keeps one counter in the
store header, ``rw``: how many ring writes the store has had. Everything else follows from it, inside
the script that reads it, so nothing can drift between processes or machines:

* the cursor (next slot to write) is ``rw % count``;
* the written slots are ``0 .. min(rw, count) - 1``; a store holding data the ring never
  wrote (an upload, writes by index) is a full ring, ``rw = count`` (``_format.header_info.ring_writes``),
  so its first ``extend`` overwrites slot 0, the oldest;
* the *generation* of slot ``s`` (how many ring writes it received) is ``0`` when
  ``s >= rw``, else ``(rw - 1 - s) // count + 1``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._errors import DenseShapeError
from tdstore._format import codec, row_block
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.nontensor import NonTensor, element_docs
from tdstore._format.op_kinds import Write, write_kind
from tdstore._format.schema import Header, Leaf, NestedPath, check_paths
from tdstore._plan.leaf_writes import check_dtype, element_checks, het_payload, new_leaf_ops, to_heterogeneous
from tdstore._plan.values import display

#: Draws are uniform integers below 2**53 (exact in a Lua double); the modulo bias is below 2**-33 for any count under 2**20.
DRAW_HIGH = 1 << 53


class RingWrite(NamedTuple):
    """Where an ``extend``/``append`` wrote: one slot and its new generation per element."""

    indices: torch.Tensor
    generations: torch.Tensor


RingWrite.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


class Sample(NamedTuple):
    """A batch drawn by ``sample``: the data, and the slot and generation of each row."""

    td: TensorDictBase
    indices: torch.Tensor
    generations: torch.Tensor


Sample.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


class RingState(NamedTuple):
    """The ring's counters as the server holds them."""

    write_count: int
    cursor: int
    written: int


RingState.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


def generations(slots: torch.Tensor, rw: int, count: int) -> torch.Tensor:
    """The generation of each slot when the ring has had ``rw`` writes (see the module docstring)."""
    return torch.where(slots < rw, torch.div(rw - 1 - slots, count, rounding_mode="floor") + 1, torch.zeros_like(slots))


#: Header fields a read transaction takes with a full ring's sample: the ring write count (and the
#: inventory's size, for a store filled by index), the sampling policy field, and a restored ring's
#: absent rows (``ho``: such a ring is sampled by the server).
RING_FIELDS = ("rw", "na", "sc", "ho")


def state(rw: int, count: int) -> RingState:
    return RingState(rw, rw % count if count else 0, min(rw, count))


def rows_of(path: NestedPath, value: Any, h: Header, n: int, what: str) -> list[torch.Tensor] | torch.Tensor:
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


def batch_len(value: Any, h: Header) -> int:
    """Number of elements of a batch along the store's stack dim."""
    bs = getattr(value, "batch_size", None)
    if bs is not None and len(bs) == len(h.inner) + 1:
        return int(bs[h.stack_pos])
    raise ValueError(
        f"a batch for this store must have batch size {list(h.inner)} with the element dim inserted at {h.stack_pos}; "
        f"got {list(bs) if bs is not None else type(value).__name__}"
    )


def plan_leaf_rows(
    kt: KeyTable,
    keys: StoreKeys,
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
                codec.dtype_name(rows.dtype)
                leaf = Leaf(path, number, rows.dtype, len(elem_shape), elem_shape)
                ops += new_leaf_ops(kt, keys, h, leaf)  # slots not written yet read as zeros
                changed = True
            return leaf, [*ops, row_op(kt, keys, h, leaf, codec.to_bytes(rows))], changed
        elems = list(rows.unbind(0))
    else:
        elems = rows
    dtype = leaf.dtype if leaf is not None else (elems[0].dtype if elems else None)
    element_checks(h, path, elems, leaf.ndim if leaf is not None else (elems[0].ndim if elems else None), dtype)
    if leaf is None:
        assert dtype is not None
        codec.dtype_name(dtype)
        shapes = {tuple(t.shape) for t in elems}
        if len(shapes) == 1:
            return plan_leaf_rows(kt, keys, h, None, number, path, torch.stack(elems))
        refuse_ragged(h, path, None, shapes)
        ndim = elems[0].ndim
        leaf = Leaf(path, number, dtype, ndim, None)
        ops += new_leaf_ops(kt, keys, h, leaf)  # slots not written yet hold empty elements
        changed = True
    elif not leaf.het:
        if all(tuple(t.shape) == leaf.shape for t in elems):
            return leaf, [row_op(kt, keys, h, leaf, codec.to_bytes(torch.stack(elems)))], False
        refuse_ragged(h, path, leaf, {tuple(t.shape) for t in elems})
        leaf, table_ops = to_heterogeneous(kt, keys, leaf, h)
        ops += table_ops
        changed = True
    shapes_b, data, sizes = het_payload(elems)
    ops.append(Write.Y(kt.ref(dk), kt.ref(ok), kt.ref(sk), 8 * leaf.ndim, shapes_b, data, *sizes))
    return leaf, ops, changed


def refuse_ragged(h: Header, path: NestedPath, leaf: Leaf | None, shapes: set[tuple[int, ...]]) -> None:
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


def row_op(kt: KeyTable, keys: StoreKeys, h: Header, leaf: Leaf, data: Any) -> list[Any]:
    """The op writing one element per addressed row of a homogeneous leaf: 'X' on its blob, 'K' on its column of the row block."""
    if leaf.col is None:
        return Write.X(kt.ref(keys.data(leaf.number)), leaf.element_nbytes, data)
    assert h.row is not None
    return Write.K(kt.ref(keys.data(h.row[0])), leaf.element_nbytes, h.row[1], leaf.col, data)


def block_op(block: int, width: int, columns: list[tuple[Leaf, np.ndarray]]) -> list[Any]:
    """The 'X' op writing whole rows of the row block (KEYS index ``block``, ``width`` bytes per row): the
    columns ``(leaf, data (n, element bytes))`` joined."""
    return Write.X(block, width, row_block.join(width, columns).data.cast("B"))


def whole_rows(kt: KeyTable, keys: StoreKeys, h: Header, n: int, ops: list[list[Any]]) -> list[list[Any]]:
    """``ops`` with the 'K' ops of every live column of the block (a ring write) joined into one 'X' op of whole rows."""
    assert h.row is not None
    number, width = h.row
    by_col = {op[4]: op for op in ops if op[0] == Write.K.marker}
    grouped = h.grouped()
    if sorted(by_col) != [leaf.col for leaf in grouped]:
        return ops
    columns = [(leaf, np.frombuffer(by_col[leaf.col][5], dtype=np.uint8).reshape(n, -1)) for leaf in grouped]
    return [op for op in ops if op[0] != Write.K.marker] + [block_op(kt.ref(keys.data(number)), width, columns)]


def group_first_keys(
    kt: KeyTable, keys: StoreKeys, h: Header, n: int, pre: list[list[Any]], post: list[list[Any]]
) -> tuple[Header, list[list[Any]], list[list[Any]]]:
    """The first ring write of a store without keys: its small homogeneous leaves go to a new row block
    (one zero-filled block instead of their blobs, and one 'X' op of whole rows)."""
    grouped_h = row_block.grouped_header(h, h.next_leaf)
    if grouped_h.row is None:
        return h, pre, post
    number, width = grouped_h.row
    cols = {keys.data(leaf.number): leaf for leaf in grouped_h.leaves.values() if leaf.col is not None}
    columns = []
    keep_post = []
    for op in post:
        leaf = cols.get(kt.keys[op[1] - 1]) if op[0] == Write.X.marker else None
        if leaf is None:
            keep_post.append(op)
        else:
            columns.append((leaf, np.frombuffer(op[3], dtype=np.uint8).reshape(n, -1)))
    keep_pre = [op for op in pre if not (op[0] == Write.Z.marker and kt.keys[op[1] - 1] in cols)]
    block = kt.ref(keys.data(number))
    alloc = [] if h.tracked else [Write.Z(block, h.count * width)]  # a tracked store allocates each segment when first written
    return grouped_h, [*keep_pre, *alloc], [*keep_post, block_op(block, width, columns)]


#: Ops that set or allocate a whole key (a key a ring write creates): they go before the row-picking head.
WHOLE_KEY_OPS = (Write.S, Write.Z)


def plan_rows(
    keys: StoreKeys,
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
        new_leaf, ops, ch = plan_leaf_rows(kt, keys, h, leaf, number, path, rows_of(path, value, h, n, what), isinstance(value, NonTensor))
        leaves[path] = new_leaf
        changed |= ch
        pre += [op for op in ops if write_kind(op) in WHOLE_KEY_OPS]
        post += [op for op in ops if write_kind(op) not in WHOLE_KEY_OPS]
    if len(leaves) != len(h.leaves):
        check_paths(list(leaves))
    new_header = h.with_leaves(leaves, next_leaf, sub=sub if len(leaves) != len(h.leaves) else None) if changed else None
    if ring and not h.leaves and new_header is not None:
        new_header, pre, post = group_first_keys(kt, keys, new_header, n, pre, post)
    elif ring and (new_header or h).row is not None:
        post = whole_rows(kt, keys, new_header or h, n, post)
    touched = [h.leaves[p] for p in items if p in h.leaves]
    return new_header, [*pre, head, *post], touched


def ring_write(start: int, n: int, count: int) -> RingWrite:
    """The slots and new generations of ``n`` rows written from ring write ``start`` on."""
    s0, lap = start % count, start // count
    if s0 + n <= count:  # no wrap: one run of slots, one generation
        return RingWrite(torch.arange(s0, s0 + n, dtype=torch.int64), torch.full((n,), lap + 1, dtype=torch.int64))
    writes = torch.arange(start, start + n, dtype=torch.int64)
    return RingWrite(writes % count, torch.div(writes, count, rounding_mode="floor") + 1)


def last_of_each(slots: torch.Tensor, gens: torch.Tensor) -> tuple[list[int], list[int]]:
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


#: The most rows one ``sample`` or ``pop`` call takes. A sample allocates its draws on the client before
#: anything is sent (``sample(10**8)``: 2.6 GB), and the server draws and reads every row in one script
#: (65,536 rows: 53-294 ms, lua/README.md, Worst cases; 10^7 rows held the server past its 5 s BUSY limit):
#: larger batches are asked for in several calls.
MAX_BATCH = 1 << 20


def check_batch_size(batch_size: Any, what: str) -> None:
    """``sample``'s and ``pop``'s batch size: an int from 1 to :data:`MAX_BATCH` (``ValueError`` naming the
    call otherwise), checked before anything is allocated or sent."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"{what} needs a positive int batch_size, got {batch_size!r}")
    if batch_size > MAX_BATCH:
        raise ValueError(
            f"{what} takes at most {MAX_BATCH:,} rows per call (one call holds the server for all of them), "
            f"got batch_size={batch_size:,}: take them in several calls"
        )


def check_request_id(request_id: Any) -> str | None:
    """A caller's ``request_id=`` (the ``request_id`` of an ``AmbiguousTimeoutError``, or one of its own):
    None, or 16 to 64 hex digits, as the scripts take it (``lua/_lib.lua`` ``tds_request``)."""
    if request_id is None:
        return None
    if not isinstance(request_id, str) or not 16 <= len(request_id) <= 64 or any(c not in "0123456789abcdefABCDEF" for c in request_id):
        raise ValueError(
            f"request_id must be 16 to 64 hex digits (an AmbiguousTimeoutError's request_id, or secrets.token_hex(16)), got {request_id!r}"
        )
    return request_id


def _int_tensor(value: Any) -> torch.Tensor:
    """``torch.as_tensor``, except that an empty list is an empty int64 tensor (not float32)."""
    if isinstance(value, (list, tuple)) and not value:
        return torch.zeros(0, dtype=torch.int64)
    return torch.as_tensor(value)


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


def check_sample_args(batch_size: Any, min_size: Any, beta: Any) -> None:
    """``sample``'s batch size, ``min_size`` and ``beta``, checked before anything is drawn or sent."""
    check_batch_size(batch_size, "sample")
    if min_size is not None and (isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0):
        raise ValueError(f"min_size must be None or an int >= 0, got {min_size!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
