"""Reading the ring buffer (see ``_ring.extend``): ``sample`` and ``pop``, one call each.

``sample`` draws its random numbers on the client (a seeded ``torch.Generator`` gives the same
batch again); ``read.lua`` maps them onto the written slots it sees ('U'), or walks the priority
tree under the store's sampling policy ('P'), and reads those rows of every key selected in the
same call. A full ring's uniform sample needs no script: the client maps the draws itself and
reads the rows in one transaction that also reads ``rw`` (for the generations) and the policy
field. ``pop`` hands the next unread items to one reader ('F').
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import lazy_stack

from tdstore._engine import deadline as _deadline
from tdstore._engine import held as _held
from tdstore._engine.engine import Engine, request_id
from tdstore._format import codec as _codec
from tdstore._format import ragged as _ragged
from tdstore._format import row_block as _rows
from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Read
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._format.segments import het_row_read_op, row_read_op
from tdstore._plan.call import Call, leaf_checks
from tdstore._plan.read_plan import plan_rows_tx, with_tables
from tdstore._plan.read_results import DenseResult, het_rows
from tdstore._plan.values import build_td, columns_maker, display, stack_members
from tdstore._ring import policy_calls as _sampling
from tdstore._ring import waiting as _waiting
from tdstore._ring.args import check_batch_size, refuse_spread
from tdstore._ring.extend import DRAW_HIGH, RING_FIELDS, Sample, generations, ring_writes_of


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


@_deadline.honours_timeout("sample")
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
    heads: list[tuple[float, float, int]] | None = None,
    again: tuple[torch.Tensor, str] | None = None,
) -> Sample | _sampling.PrioritizedSample:
    """Draw ``batch_size`` written slots (with replacement) and read them, in one call.

    Uniformly, or by priority on a store with priorities (see ``_ring.policy_calls``); waiting
    for ``min_size`` written slots or the store's rate limiter when they say so.
    ``ragged`` (``as_padded_tensor=True`` or ``as_nested_tensor=True``, with ``padding_side``,
    ``padding_value``, ``layout``) makes each heterogeneous key one padded or jagged tensor of
    the batch (see ``_format.ragged``), so the sample is a TensorDict instead of a lazy stack. ``keys``
    reads only those keys (and the keys below them). ``heads``: a prioritized sample appends to it its
    tree's sum and smallest probability and ``rw`` as the script drew (a sharded ring's next split; NaN: not sent).
    ``again``: the draws and request id of a counted sample sent before (its resend: the same rows, counted once)."""
    _check_sample_args(batch_size, min_size, beta)
    draws = again[0] if again is not None else torch.randint(0, DRAW_HIGH, (batch_size,), generator=generator, dtype=torch.int64)
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
    planner.heads = heads
    if again is not None:
        planner.request = again[1]

    def run() -> Any:
        try:
            return engine.run(planner.plan)
        except _RingMoved:  # the ring is under a policy now (or was recreated): the script samples
            planner.as_tx = False
            engine.set_header(engine.fetch_header())
            return engine.run(planner.plan)

    def resend(later: float | None) -> Sample | _sampling.PrioritizedSample:
        # a sample that counts (rate limiter, max_times_sampled), sent again: the rows it drew, counted once
        return sample(
            engine,
            batch_size,
            None,
            device,
            ragged,
            keys,
            prioritized=asked,
            alpha=alpha,
            beta=beta,
            min_size=min_size,
            timeout=later,
            again=(draws, planner.request),
        )

    with _deadline.resolvable(planner.request, resend):
        return _sampling.wait_or_raise(
            engine, run, timeout, min_size is not None or timeout is not None or policy.limit is not None, "sample"
        )


def _check_sample_args(batch_size: Any, min_size: Any, beta: Any) -> None:
    check_batch_size(batch_size, "sample")
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
            raise _sampling.no_priorities(engine)
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
    paths = None if keys is None else [leaf.path for leaf in chosen]
    _, res = engine.read(slots, paths, fields=RING_FIELDS, counts=tx_counts(engine, len(slots)))
    fields = res.fields if isinstance(res, DenseResult) and res.fields is not None else {}
    rw = ring_writes_of(engine, fields, h)
    if isinstance(res, DenseResult) and rw >= h.count and fields.get("sc") is None:
        if ragged and ragged.get("return_mask"):
            with_masks(h, res.leaves, {}, ragged)
        return Sample(build_td(res.leaves, res.batch_size, device, sub=h.sub_dims), slots, generations(slots, rw, h.count))
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
    heads: list[tuple[float, float, int]] | None = field(init=False, default=None)  # see sample()
    packed: bytes = field(init=False)  # the draws as read.lua takes them, packed once for every try
    request: str = field(init=False)  # one per sample, sent with every try: a resend never counts twice

    def __post_init__(self) -> None:
        self.packed = _codec.pack_i64(self.draws.numpy())
        self.request = request_id()

    def plan(self, h: Header) -> Call:
        engine, keys = self.engine, self.keys
        by_prio = self.asked if self.asked is not None else (h.sampling is not None and h.sampling.prioritized)
        use_policy = by_prio or self.min_size is not None or h.sampling is not None
        if use_policy and h.sampling is not None and (h.sampling.limit is not None or h.sampling.max_times is not None):
            _deadline.arm()  # a sample that counts, sent next: from now on it may have been counted
        if self.as_tx and not use_policy and engine.ring_full and h.stack_pos == 0:
            tx = _tx_sample_call(engine, h, keys, self.draws, self.device, self.ragged)
            if tx is not None:
                return tx
        packed = self.packed

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
            if self.heads is not None:
                mass = np.frombuffer(reply[5], dtype="<f8")[1:2]
                self.heads.append((float(mass[0]) if len(mass) else math.nan, low, int(reply[3])))
            return _sampling.PrioritizedSample(got.td, got.indices, got.generations, _sampling.weights_of(probs, low, self.beta), probs)

        call = _row_read_call(engine, h, keys, self.batch_size, head, parse, self.request if use_policy else None)
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
    offset tables it keeps (``_plan.read_plan.plan_rows_tx``), ``rw`` and the policy field with them. None when
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
        rw = ring_writes_of(engine, fields, h)
        if rw < h.count or fields.get("sc") is not None:
            raise _RingMoved
        piece = str(rw).encode()
        return _decode_sample(h, leaves, [*reply[:2], _codec.pack_i64(slots), piece, *reply[2:]], 4, device, block, grouped, ragged, wanted)

    counts = tx_counts(engine, len(slots))
    call = Call("tx", [], [], parse, ranges=tx[0], guards=guards, fields=list(RING_FIELDS), verify=tx[1], counts=counts)
    return call


def tx_counts(engine: Engine, n: int) -> list[list[Any]] | None:
    """The counter a full ring's sample of ``n`` rows read as a transaction ends with (``_inspect.stats``): rows
    sampled whose age is not measured (the client maps the draws before it knows ``rw``); none for a read-only handle."""
    return None if engine.readonly else [["HINCRBY", engine.keys.stats, "smpx", n]]


@_deadline.honours_timeout("pop")
def pop(
    engine: Engine,
    batch_size: int,
    device: torch.device | None,
    timeout: float | None,
    keys: list[NestedPath] | None = None,
    request: str | None = None,
) -> Sample:
    """The next unread items, in write order, each handed to exactly one caller (see ``LazyStackedTensorDictStore.pop``).

    ``request``: the pop's id, given by a caller that may send the same pop again after this call raised
    (a sharded ring, when a shard's reply came too late): the server answers it with the items it took."""
    check_batch_size(batch_size, "pop")
    engine.refuse_if_readonly()
    refuse_spread(engine)
    channel = engine.keys.events
    from tdstore._ring.leases import Planner  # it imports this module's row reads

    request = request or request_id()  # one per pop, sent with every attempt: a resend never moves the cursor twice
    leased = Planner(engine, batch_size, device, keys, 0, receipt=request[:16])

    def plan_call(h: Header) -> Call:
        if h.leased:  # items whose lease ran out go to plain pops too: through the lease table
            return leased.plan(h)
        _deadline.arm()  # sent next: from now on the pop may have taken its items
        return _row_read_call(
            engine,
            h,
            keys,
            batch_size,
            lambda kt: Read.F(batch_size, channel),
            lambda reply, rows: _decode_sample(h, rows.leaves, reply, 4, device, rows.block, rows.grouped, None, rows.wanted),
            request,
        )

    def resend(again: float | None) -> Sample:
        # the same pop under the same id: the server answers with the items it took (read.lua 'N')
        return pop(engine, batch_size, device, again, keys, request)

    with _deadline.resolvable(request, resend, keyword=True):
        return _waiting.until_ready(engine, lambda: engine.run(plan_call), timeout, "pop")


class _RowRead(NamedTuple):
    """What a row read reads: its units (leaves, with the row block standing for its columns) and which keys were asked for."""

    leaves: list[Leaf]
    block: Leaf | None
    grouped: list[Leaf]
    wanted: set[NestedPath] | None


def _row_read_call(
    engine: Engine, h: Header, keys: list[NestedPath] | None, rows: int, head: Any, parse: Any, request: str | None = None
) -> Call:
    """A ``read.lua`` call whose rows one op picks (``head(kt)``: 'U', 'P' or 'F') and whose other ops read
    every selected leaf at those rows; ``parse(reply, _RowRead)`` makes the result. ``request`` (a 'P' or 'F'
    op: a request id) goes before it as an 'N' op, so that a resend reads the rows the first attempt took."""
    selected = _selected(h, keys)
    wanted = None if keys is None else {leaf.path for leaf in selected}
    kt = engine.key_table(h)
    checks = leaf_checks(selected)
    leaves, block, grouped = _rows.units(h, selected)
    named = Read.N(kt.ref(engine.keys.replies), request) if request is not None else []
    # the rows it samples or pops are counted in the store's stats (lua/_lib.lua tds_stat); a read-only handle writes nothing
    counted = [] if engine.readonly else Read.A(kt.ref(engine.keys.stats), _held.held_ms())
    ops = 1 + len(leaves) + bool(named) + bool(counted)
    args: list[Any] = [f"{h.epoch}:K{h.keyset_version}", checks, ops, *named, *counted, *head(kt)]
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
