"""Read planning: which bytes a read needs, as one ``Call``, and how its reply becomes tensors.

No I/O: each planner takes the header the call is planned from and a ``ReadHost`` (the
engine: key names, whether reads may go as transactions, the offset tables it keeps) and
returns a ``Call``: a ``read.lua`` script call, or a ``MULTI``/``EXEC`` of plain ``GETRANGE``s
(``script == "tx"``) when the client can name every byte range itself (homogeneous keys, and
heterogeneous rows whose offset tables are kept, see ``_format.offsets``). ``Engine.read`` and
``Engine.read_ragged`` run them; ``_plan.write_plan`` is the same for writes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from tdstore._format import codec, nontensor, row_block, segments, wire
from tdstore._format.keys import KeyTable, StoreKeys
from tdstore._format.offsets import RowPlan
from tdstore._format.op_kinds import Read
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan.call import Call, leaf_checks
from tdstore._plan.index import PAIR, Component, Plan, normalize, pack_pairs, plan, run_bounds, storage_rows, whole_element
from tdstore._plan.read_results import (
    DenseResult,
    ElementsResult,
    NotRagged,
    ReadHost,
    _columns,
    _shape,
    check_elements,
    het_rows,
    split_elements,
)

#: Replies of many small ranges are joined on the server up to this many bytes per leaf.
JOIN_LIMIT = 4 << 20
#: Dense reads (homogeneous leaves only) go through MULTI/EXEC of plain GETRANGE (see Call) at any size:
#: a GETRANGE costs about 2 us through ``redis.call`` in a script on Redis 7.0 and under 1 us as a
#: queued command, and bulk bytes through Lua cost more again. Measured (the benchmark's rows, one
#: slice, script against transaction): 4 rows 0.29 / 0.27 ms, 256 rows 0.43 / 0.34 ms, 4,096 rows
#: 2.53 / 0.78 ms; a random batch of 256 rows 0.72 / 0.38 ms (``tools/batch_server_time.py``).
#: A random batch of at least this many rows is read in the order asked, duplicates included
#: (smaller ones are sorted and deduplicated, which costs less than it saves there).
SCATTERED_MIN_ROWS = 32
#: A read of more ranges than this (a random batch of many thousands of rows) goes through read.lua:
#: the server keeps every queued command of a transaction until EXEC (about 200 bytes each).
TX_MAX_RANGES = 50_000


def read_call(
    host: ReadHost,
    h: Header,
    index: Any,
    wanted: list[NestedPath] | None,
    under: NestedPath,
    per_element: bool,
    fields: Sequence[str],
    result: dict[str, Any],
    counts: list[list[Any]] | None = None,
) -> Call:
    """The call reading leaves ``wanted`` (None: every leaf below ``under``) at ``index`` (see
    ``Engine.read``); its index plan goes into ``result["plan"]``."""
    if wanted is None:
        leaves = [leaf for path, leaf in h.leaves.items() if path[: len(under)] == under]
        if under and not leaves:
            raise KeyError(f"key {under if len(under) > 1 else under[0]!r} is not in the store ({host.where()})")
        check = [f"{h.epoch}:K{h.keyset_version}", leaf_checks(leaves)]
    else:
        leaves = _select(host, h, wanted)
        check = [f"{h.epoch}:*", leaf_checks(leaves)]
    e = None if per_element else whole_element(index, h.batch_size, h.stack_pos)
    if e is not None:
        # store[i] and element views: no index planning at all
        result["plan"] = None
        call = _plan_one_element_read(host, h, e, leaves)
        call.args[:0] = check
        return call
    norm = normalize(index, h.batch_size)
    if len(norm) == 1 and type(norm[0]) is torch.Tensor and norm[0].numel() and not per_element and not any(leaf.het for leaf in leaves):
        # a random batch of a one-dim store: the rows are the index itself (no plan, nothing sorted)
        result["plan"] = None
        call = _plan_dense_read(host, h, norm[0], leaves)
    else:
        call = _plan_read(host, h, norm, leaves, per_element, result)
    if call.script == "tx":
        call.guards = {
            "epoch": h.epoch,
            **({"kv": str(h.keyset_version)} if wanted is None else {}),
            **{f"lv:{leaf.number}": str(leaf.version) for leaf in leaves},
        }
        call.fields = list(fields)
        call.counts = counts
    else:
        call.args[:0] = check
    return call


def ragged_call(host: ReadHost, h: Header, path: NestedPath, ids: np.ndarray) -> Call:
    """The call reading elements ``ids`` of the heterogeneous leaf ``path`` as raw pieces (see
    ``Engine.read_ragged``); ``NotRagged`` when the leaf holds no heterogeneous tensor data."""
    leaf = h.leaves.get(path)
    if leaf is None:
        raise KeyError(f"key {path if len(path) > 1 else path[0]!r} is not in the store ({host.where()})")
    if not leaf.het or leaf.json:
        raise NotRagged
    lo, hi = run_bounds(ids)
    n = int(ids.size)
    scattered = not h.spread and int(lo.size) > 8 and 2 * int(lo.size) > n

    def parse(reply: list) -> tuple[Leaf, np.ndarray, Any]:
        pieces = reply[2:]
        if scattered:  # bounds, shape records, data, each joined in row order
            b = codec.unpack_i64(pieces[0]).reshape(n, 2)
            shapes, data, sizes = codec.unpack_i64(pieces[1]), pieces[2], b[:, 1] - b[:, 0]
        else:
            shapes = codec.unpack_i64(b"".join(pieces[1::3]))
            data = pieces[2] if len(pieces) == 3 else b"".join(pieces[2::3])
            sizes = np.concatenate([np.diff(codec.unpack_i64(offs)) for offs in pieces[0::3]])
        check_elements(leaf, n, sizes, shapes, len(data))
        return leaf, shapes.reshape(n, leaf.ndim), data

    if scattered:
        tx = plan_rows_tx(host, h, ids, [leaf])
        if tx is not None:  # the leaf's offset tables are kept: plain GETRANGEs, checked (see _offsets)
            guards = {"epoch": h.epoch, f"lv:{leaf.number}": str(leaf.version)}
            return Call("tx", [], [], parse, ranges=tx[0], guards=guards, verify=tx[1])
    kt = host.key_table(h)
    keys = host.keys
    d, o, sk = kt.ref(keys.data(leaf.number)), kt.ref(keys.offsets(leaf.number)), kt.ref(keys.shapes(leaf.number))
    args: list[Any] = [f"{h.epoch}:*", leaf_checks([leaf])]
    if scattered:
        # mostly single rows (a random batch): the ids travel once and the offset and shape
        # tables are cut on the server ('I' + 'Y'/'V'), one data GETRANGE per row
        args += [2, *Read.I(n, codec.pack_i64(ids)), *segments.het_row_read_op(h.segments, leaf.ndim, n)(d, o, sk, 8 * leaf.ndim)]
        return with_tables(host, h, Call("read", kt.keys, args, parse), kt, [leaf], ids, count_at=2)
    args += [1, *Read.E(d, o, sk, 8 * leaf.ndim, int(lo.size), pack_pairs(lo, hi))]
    return Call("read", kt.keys, args, parse)


def plan_rows_tx(
    host: ReadHost, h: Header, ids: np.ndarray, units: list[Leaf]
) -> tuple[list[list[wire.Piece]], Callable[[list], list | None]] | None:
    """A read transaction of rows ``ids`` (in that order, duplicates included) of every leaf of
    ``units``: its buffers, and the check that turns its reply into the one ``read.lua``'s
    ``X``/``Y`` ops give (a homogeneous leaf: its rows; a heterogeneous one: bounds, shape records,
    data). None when a heterogeneous leaf's offset tables are not kept (see ``_format.offsets``) or reads
    go through the script."""
    if not host.tx_reads or h.spread or 3 * len(units) * int(ids.size) > TX_MAX_RANGES:
        return None
    ranges: list[list[wire.Piece]] = []
    layout: list[tuple[Leaf, RowPlan | None]] = []
    for leaf in units:
        if not leaf.het:
            nb = leaf.element_nbytes
            ranges.append([(host.keys.data(leaf.number), ids * nb, np.full(ids.size, nb, dtype=np.int64))])
            layout.append((leaf, None))
            continue
        rows = host.offsets.plan(h, host.keys, leaf, ids)
        if rows is None:
            return None
        ranges += rows.buffers
        layout.append((leaf, rows))

    def verify(reply: list) -> list | None:
        out, pos, moved = reply[:2], 2, []
        for leaf, rows in layout:
            if rows is None:
                out.append(reply[pos])
                pos += 1
                continue
            k = len(rows.buffers)
            pieces = rows.pieces(reply[pos : pos + k])
            pos += k
            if pieces is None:
                moved.append(leaf)
            else:
                out += pieces
        for leaf, rows in layout:
            if rows is not None:
                (host.offsets.changed if leaf in moved else host.offsets.confirmed)(h, leaf)
        return None if moved else out

    return ranges, verify


def with_tables(host: ReadHost, h: Header, call: Call, kt: KeyTable, leaves: list[Leaf], ids: np.ndarray, count_at: int = 0) -> Call:
    """``call`` (a ``read.lua`` read of rows ``ids`` of ``leaves`` whose op count is ``call.args[count_at]``)
    also bringing back the offset tables the handle should keep (its ``T`` ops, last), so later reads
    of those rows go as transactions."""
    if not host.transactions or h.spread:
        return call
    fills = [(leaf, seg) for leaf in leaves if leaf.het for seg in host.offsets.wanted(h, leaf, ids)]
    if not fills:
        return call
    call.args[count_at] += len(fills)
    for leaf, seg in fills:
        call.args += Read.T(kt.ref(host.keys.offsets(leaf.number, seg)))
    call.keys = kt.keys
    parse, k = call.parse, len(fills)

    def parse_and_keep(reply: list) -> Any:
        for (leaf, seg), table in zip(fills, reply[len(reply) - k :]):
            host.offsets.keep(h, leaf, seg, table)
        return parse(reply[: len(reply) - k])

    call.parse = parse_and_keep
    return call


def _plan_read(
    host: ReadHost, h: Header, norm: tuple[Component, ...], leaves: list[Leaf], per_element: bool, result: dict[str, Any]
) -> Call:
    """Plan a read of any index (its plan goes into ``result``, which ``read`` returns)."""
    p = plan(norm, h.batch_size, h.stack_pos)
    result["plan"] = p
    if p.n == 0:
        call = _plan_empty_read(host, h, tuple(storage_rows(p, h.inner).shape), leaves)
    elif p.element_int and p.inner_full and not per_element:
        call = _plan_one_element_read(host, h, int(p.elements[0]), leaves)
    elif per_element or any(leaf.het for leaf in leaves):
        call = _plan_element_read(host, h, p, leaves)
    else:
        call = _plan_dense_read(host, h, storage_rows(p, h.inner), leaves)
    return call


def _select(host: ReadHost, h: Header, wanted: list[NestedPath]) -> list[Leaf]:
    leaves = []
    for path in wanted:
        leaf = h.leaves.get(path)
        if leaf is None:
            raise KeyError(f"key {path if len(path) > 1 else path[0]!r} is not in the store ({host.where()})")
        leaves.append(leaf)
    return leaves


def _plan_empty_read(host: ReadHost, h: Header, shape: tuple[int, ...], leaves: list[Leaf]) -> Call:
    """An index that selects nothing still checks the version (the keys and dtypes must be current)."""
    empty = {}
    for leaf in leaves:
        feat = leaf.shape[len(h.inner) :] if leaf.shape is not None else (0,) * (leaf.ndim - len(h.inner))
        empty[leaf.path] = torch.empty(shape + tuple(feat), dtype=leaf.dtype)
    return Call("read", [host.keys.meta], [0], lambda reply: DenseResult(torch.Size(shape), empty))


def _plan_one_element_read(host: ReadHost, h: Header, e: int, leaves: list[Leaf]) -> Call:
    """``store[i]``: one byte range per homogeneous leaf, one element run per heterogeneous one, no planning arrays."""
    kt = host.key_table(h)
    order = [leaf.path for leaf in leaves]
    leaves, block, grouped = row_block.units(h, leaves)
    args: list[Any] = [len(leaves)]
    seg = h.segments.of(e)
    e -= h.segments.start(seg)  # the element lives in one segment: address it there
    run = PAIR.pack(e, e)
    keys = host.keys
    for leaf in leaves:
        if leaf.het:
            d, o, s = (kt.ref(key) for key in keys.leaf_keys(leaf.number, seg))
            args += Read.E(d, o, s, 8 * leaf.ndim, 1, run)
        else:
            eb = leaf.element_nbytes
            args += Read.R(kt.ref(keys.data(leaf.number, seg)), 1, PAIR.pack(e * eb, eb), "0")

    def parse(reply: list) -> DenseResult:
        out: dict[NestedPath, Any] = {}
        pos = 2
        for leaf in leaves:
            if leaf is block:
                out.update(row_block.split(np.frombuffer(reply[pos], dtype=np.uint8), grouped))
                pos += 1
                continue
            if not leaf.het:
                out[leaf.path] = codec.from_bytes(reply[pos], leaf.dtype, _shape(leaf))
                pos += 1
                continue
            shape_rec, data = reply[pos + 1], reply[pos + 2]
            first, last = struct.unpack("<2q", reply[pos]) if len(reply[pos]) == 16 else (0, -1)  # -1: damaged, named below
            check_elements(leaf, 1, [last - first], None if leaf.json else shape_rec, len(data))
            pos += 3
            if leaf.json:
                out[leaf.path] = nontensor.decode(data, h.leaf_inner(leaf.path))
            else:
                out[leaf.path] = codec.from_bytes(data, leaf.dtype, codec.unpack_i64(shape_rec).tolist() if leaf.ndim else [])
        if block is not None:  # the store's key order
            out = {path: out[path] for path in order}
        return DenseResult(torch.Size(h.inner), out)

    return Call("read", kt.keys, args, parse)


def _plan_dense_read(host: ReadHost, h: Header, rows: torch.Tensor, leaves: list[Leaf]) -> Call:
    """Homogeneous leaves at storage ``rows`` (the shape of the indexed batch), as tensors of that shape."""
    flat = rows.reshape(-1).numpy()
    if flat.size == 0:
        return _plan_empty_read(host, h, tuple(rows.shape), leaves)
    uniq, inverse = _rows_to_read(host, flat, len(leaves))
    lo, hi = run_bounds(uniq)
    n_runs = int(lo.size)
    kt = host.key_table(h)
    order = [leaf.path for leaf in leaves]
    leaves, block, grouped = row_block.units(h, leaves)
    args: list[Any] = [len(leaves)]
    feats = []
    row_bytes = [codec.nbytes(_shape(leaf)[len(h.inner) :], leaf.dtype) for leaf in leaves]
    # plain GETRANGEs in MULTI/EXEC (see Call and SCATTERED_MIN_ROWS); read.lua only when a server refuses those
    tx = host.tx_reads and n_runs * len(leaves) <= TX_MAX_RANGES
    ranges: list[list[wire.Piece]] = []
    # scattered whole elements (a random batch): the ids travel once and each leaf reads its rows
    by_rows = (
        not tx
        and not h.spread
        and not h.inner
        and 2 * n_runs > int(uniq.size) > 8
        and int(uniq.size) * max(row_bytes, default=0) <= JOIN_LIMIT
    )
    if by_rows:
        args = [1 + len(leaves), *Read.I(int(uniq.size), codec.pack_i64(uniq))]
    for leaf, rb in zip(leaves, row_bytes):
        feat = _shape(leaf)[len(h.inner) :]
        if by_rows:
            feats.append((feat, True, False))
            args += segments.row_read_op(h.segments, rb, int(uniq.size))(kt.ref(host.keys.data(leaf.number)), rb)
            continue
        blob = h.count * leaf.element_nbytes
        # a small blob read whole and cut on the client costs less than one range per run
        whole = tx and n_runs > 1 and rb > 0 and blob <= n_runs * wire.TX_WHOLE_BYTES_PER_RANGE
        join = tx or (n_runs > 1 and int(uniq.size) * rb <= JOIN_LIMIT)  # a transaction joins each leaf's ranges
        feats.append((feat, join, whole))
        if whole:
            ranges.append([(host.keys.data(leaf.number), np.zeros(1, np.int64), np.full(1, blob, np.int64))])
        elif tx:
            ranges.append([(host.keys.data(leaf.number), lo * rb, (hi - lo + 1) * rb)])
        else:
            pairs = pack_pairs(lo * rb, (hi - lo + 1) * rb)
            args += Read.R(kt.ref(host.keys.data(leaf.number)), n_runs, pairs, "1" if join else "0")

    parse = partial(_parse_dense, rows, uniq, inverse, n_runs, leaves, feats, block, grouped, order)
    if tx:
        return Call("tx", kt.keys, [], parse, ranges=ranges)
    return Call("read", kt.keys, args, parse)


def _rows_to_read(host: ReadHost, flat: np.ndarray, n_leaves: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The storage rows a dense read reads, in order, and where each row asked for is among them
    (None: the rows as asked)."""
    if flat.size == 1 or (int(flat[-1]) - int(flat[0]) == flat.size - 1 and bool(np.all(np.diff(flat) == 1))):
        return flat, None  # one contiguous run, already in order
    if (
        host.tx_reads
        and SCATTERED_MIN_ROWS <= flat.size
        and flat.size * n_leaves <= TX_MAX_RANGES
        and 2 * int(np.count_nonzero(np.diff(np.sort(flat)) != 1)) >= flat.size
    ):
        # scattered rows (a random batch), scattered even once sorted: read in the order asked for,
        # one range per row (duplicates included), so nothing is sorted, deduplicated or reordered back
        return flat, None
    return np.unique(flat, return_inverse=True)


def _parse_dense(
    rows: torch.Tensor,
    uniq: np.ndarray,
    inverse: np.ndarray | None,
    n_runs: int,
    leaves: list[Leaf],
    feats: list[tuple[Any, bool, bool]],
    block: Leaf | None,
    grouped: list[Leaf],
    order: list[NestedPath],
    reply: list,
) -> DenseResult:
    """A dense read's reply (per leaf: its blob read whole, its runs joined, or one piece per run)
    as tensors of the indexed batch shape."""
    pos = 2
    out = {}
    shape = (int(uniq.size),)
    for leaf, (feat, join, whole) in zip(leaves, feats):
        if whole:
            every = codec.from_bytes(reply[pos], leaf.dtype, (len(reply[pos]) // codec.nbytes(feat, leaf.dtype), *feat))
            pos += 1
            pick = uniq if inverse is None else uniq[inverse]
            buf = codec.index_select(every, 0, torch.from_numpy(pick.astype(np.int64, copy=False)))
            out[leaf.path] = buf.reshape(tuple(rows.shape) + tuple(feat))
            if leaf is block:
                out.update(row_block.split(out.pop(leaf.path), grouped))
            continue
        if join or n_runs == 1:
            buf = codec.from_bytes(reply[pos], leaf.dtype, shape + tuple(feat))
            pos += 1
        else:
            buf = codec.from_pieces(reply[pos : pos + n_runs], leaf.dtype, shape + tuple(feat))
            pos += n_runs
        if inverse is not None:
            buf = codec.index_select(buf, 0, torch.from_numpy(inverse.astype(np.int64, copy=False)))
        if leaf is block:
            out.update(row_block.split(buf.reshape(tuple(rows.shape) + tuple(feat)), grouped))
        else:
            out[leaf.path] = buf.reshape(tuple(rows.shape) + tuple(feat))
    if block is not None:  # the store's key order, not the order the block gathered them in
        out = {path: out[path] for path in order}
    return DenseResult(rows.shape, out)


def _plan_element_read(host: ReadHost, h: Header, p: Plan, leaves: list[Leaf]) -> Call:
    ids = p.elements.numpy()
    lo, hi = run_bounds(ids)
    order = [leaf.path for leaf in leaves]
    units, block, grouped = row_block.units(h, leaves)
    widest = max((leaf.element_nbytes for leaf in units if not leaf.het), default=0)  # the block's rows come whole
    if not h.spread and 2 * int(lo.size) > int(ids.size) > 8 and int(ids.size) * widest <= JOIN_LIMIT:
        return _plan_scattered_elements(host, h, ids, leaves)
    el_runs = list(zip(lo.tolist(), hi.tolist()))
    packed_runs = pack_pairs(lo, hi)
    kt = host.key_table(h)
    leaves = units
    args: list[Any] = [len(leaves)]
    joined: list[bool] = []  # per homogeneous leaf: its ranges come back as one string
    for leaf in leaves:
        if leaf.het:
            d, o, s = (kt.ref(key) for key in host.keys.leaf_keys(leaf.number))
            args += Read.E(d, o, s, 8 * leaf.ndim, len(el_runs), packed_runs)
        else:
            eb = leaf.element_nbytes
            join = len(el_runs) > 1 and int(ids.size) * eb <= JOIN_LIMIT
            joined.append(join)
            pairs = pack_pairs(lo * eb, (hi - lo + 1) * eb)
            args += Read.R(kt.ref(host.keys.data(leaf.number)), len(el_runs), pairs, "1" if join else "0")

    def parse(reply: list) -> ElementsResult:
        pieces = reply[2:]
        columns: dict[NestedPath, list[Any]] = {}  # per leaf: one tensor (or value) per element, in id order
        pos = 0
        homog_seen = 0
        for leaf in leaves:
            if leaf.het:
                elements = columns[leaf.path] = []
                for rlo, rhi in el_runs:
                    offs, shapes, data = pieces[pos], pieces[pos + 1], pieces[pos + 2]
                    pos += 3
                    sizes = np.diff(codec.unpack_i64(offs)).tolist()
                    # one buffer per run, split into one view per element in a single call
                    elements += split_elements(leaf, h.leaf_inner(leaf.path), rhi - rlo + 1, sizes, shapes, data)
            elif joined[homog_seen]:
                # every touched element of this leaf in one buffer: one view per element
                homog_seen += 1
                rows = codec.from_bytes(pieces[pos], leaf.dtype, (int(ids.size), *_shape(leaf)))
                pos += 1
                columns.update((path, list(col.unbind(0))) for path, col in _columns(leaf, rows, block, grouped))
            else:
                homog_seen += 1
                shape = leaf.shape
                assert shape is not None
                for rlo, rhi in el_runs:
                    rows = codec.from_bytes(pieces[pos], leaf.dtype, (rhi - rlo + 1, *shape))
                    for path, col in _columns(leaf, rows, block, grouped):
                        columns.setdefault(path, []).extend(col.unbind(0))
                    pos += 1
        return ElementsResult([int(i) for i in ids], order, columns)

    return Call("read", kt.keys, args, parse)


def leaf_read_ops(keys: StoreKeys, h: Header, kt: KeyTable, leaves: list[Leaf], rows: int) -> list[Any]:
    """The ops of a ``read.lua`` call reading every unit in ``leaves`` at the ``rows`` rows an earlier op
    picked ('I', or a ring read's 'U'/'P'/'F'/'G'): 'X'/'B' per homogeneous leaf, 'Y' per heterogeneous one."""
    args: list[Any] = []
    for leaf in leaves:
        if leaf.het:  # (only a heterogeneous leaf's offsets and shapes keys go into the call's KEYS)
            d, o, s = (kt.ref(key) for key in keys.leaf_keys(leaf.number))
            args += segments.het_row_read_op(h.segments, leaf.ndim, rows)(d, o, s, 8 * leaf.ndim)
        else:
            args += segments.row_read_op(h.segments, leaf.element_nbytes, rows)(kt.ref(keys.data(leaf.number)), leaf.element_nbytes)
    return args


def _plan_scattered_elements(host: ReadHost, h: Header, ids: np.ndarray, leaves: list[Leaf]) -> Call:
    """Mostly scattered whole elements (a random batch with a heterogeneous key): the ids travel
    once ('I'), each homogeneous leaf comes back as one block of rows ('X'/'B') and each
    heterogeneous one as three joined pieces ('Y'), split on the client without a loop per run."""
    n = int(ids.size)
    kt = host.key_table(h)
    order = [leaf.path for leaf in leaves]
    leaves, block, grouped = row_block.units(h, leaves)
    tx = plan_rows_tx(host, h, ids, leaves)
    args: list[Any] = [] if tx is not None else [1 + len(leaves), *Read.I(n, codec.pack_i64(ids))]
    if tx is None:
        args += leaf_read_ops(host.keys, h, kt, leaves, n)

    def parse(reply: list) -> ElementsResult:
        columns: dict[NestedPath, Any] = {}
        pos = 2
        for leaf in leaves:
            if leaf.het:
                columns[leaf.path] = het_rows(leaf, h.leaf_inner(leaf.path), n, reply[pos], reply[pos + 1], reply[pos + 2])
                pos += 3
            else:
                rows = codec.from_bytes(reply[pos], leaf.dtype, (n, *_shape(leaf)))
                columns.update((path, col.unbind(0)) for path, col in _columns(leaf, rows, block, grouped))
                pos += 1
        return ElementsResult(ids.tolist(), order, columns)

    if tx is not None:  # every heterogeneous leaf's offset tables are kept (see _offsets)
        return Call("tx", [], [], parse, ranges=tx[0], verify=tx[1])
    return with_tables(host, h, Call("read", kt.keys, args, parse), kt, leaves, ids)
