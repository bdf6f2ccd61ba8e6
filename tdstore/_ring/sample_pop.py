"""Reading the ring buffer (see ``_plan.ring_plan``): ``sample`` and ``pop``, one call each.

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
from typing import Any

import numpy as np
import torch

from tdstore._engine import deadline, scripts
from tdstore._engine.engine import Engine, request_id
from tdstore._format import codec, row_block
from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Read
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan.call import Call
from tdstore._plan.read_plan import plan_rows_tx, with_tables
from tdstore._plan.read_results import DenseResult
from tdstore._plan.ring_plan import DRAW_HIGH, RING_FIELDS, Sample, check_batch_size, check_sample_args, generations
from tdstore._plan.values import build_td
from tdstore._ring import policy_calls, waiting
from tdstore._ring.args import refuse_spread
from tdstore._ring.extend import ring_writes_of
from tdstore._ring.leases import Planner
from tdstore._ring.row_reads import RolloutsOn, RowRead, decode_sample, row_read_call, selected_leaves, with_masks


@deadline.honours_timeout("sample")
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
) -> Sample | policy_calls.PrioritizedSample:
    """Draw ``batch_size`` written slots (with replacement) and read them, in one call.

    Uniformly, or by priority on a store with priorities (see ``_ring.policy_calls``); waiting
    for ``min_size`` written slots or the store's rate limiter when they say so.
    ``ragged`` (``as_padded_tensor=True`` or ``as_nested_tensor=True``, with ``padding_side``,
    ``padding_value``, ``layout``) makes each heterogeneous key one padded or jagged tensor of
    the batch (see ``_format.ragged``), so the sample is a TensorDict instead of a lazy stack. ``keys``
    reads only those keys (and the keys below them). ``heads``: a prioritized sample appends to it its
    tree's sum and smallest probability and ``rw`` as the script drew (a sharded ring's next split; NaN: not sent).
    ``again``: the draws and request id of a counted sample sent before (its resend: the same rows, counted once)."""
    check_sample_args(batch_size, min_size, beta)
    draws = again[0] if again is not None else torch.randint(0, DRAW_HIGH, (batch_size,), generator=generator, dtype=torch.int64)
    refuse_spread(engine)
    h = engine.header
    if h.rollouts:  # incomplete groups hidden: _ring.rollouts samples it
        raise RolloutsOn
    asked = prioritized  # as the caller gave it (None: the store's policy decides)
    policy = _sample_policy(engine, h, prioritized, alpha, min_size)
    by_policy = policy.prioritized if prioritized is None else prioritized
    by_policy = by_policy or min_size is not None or h.sampling is not None
    chosen = selected_leaves(h, keys)
    # (a ring restored with rows absent is drawn by the server, which skips them: lua/_absent.lua)
    client_draws = engine.ring_full and engine.tx_reads and h.stack_pos == 0 and not h.absent_rows
    if not by_policy and client_draws and chosen and not any(leaf.het for leaf in chosen):
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

    def resend(later: float | None) -> Sample | policy_calls.PrioritizedSample:
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

    with deadline.resolvable(planner.request, resend):
        return policy_calls.wait_or_raise(
            engine, run, timeout, min_size is not None or timeout is not None or policy.limit is not None, "sample"
        )


def _sample_policy(engine: Engine, h: Header, prioritized: bool | None, alpha: float | None, min_size: int | None) -> SamplingPolicy:
    """The store's sampling policy, once the sample's arguments are checked against it."""
    policy = policy_calls.policy_of(engine)
    if prioritized is None:
        prioritized = policy.prioritized
    elif prioritized and not policy.prioritized:
        policy = policy_calls.policy_of(engine, fresh=True)
        if not policy.prioritized:
            raise policy_calls.no_priorities(engine)
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
    _, res = engine.read(slots, paths, fields=_TX_FIELDS, counts=tx_counts(engine, h, slots))
    fields = res.fields if isinstance(res, DenseResult) and res.fields is not None else {}
    rw = ring_writes_of(engine, fields, h)
    if isinstance(res, DenseResult) and rw >= h.count and fields.get("sc") is None and fields.get("ho") is None:
        distinct_caught_up(engine, h, fields, slots)
        if ragged and ragged.get("return_mask"):
            with_masks(h, res.leaves, {}, ragged)
        return Sample(build_td(res.leaves, res.batch_size, device, sub=h.sub_dims), slots, generations(slots, rw, h.count))
    if fields.get("sc") is not None:
        engine.set_header(engine.fetch_header())
        return _UNDER_POLICY
    if fields.get("ho") is not None:  # restored with rows absent since this header was read: the server draws
        engine.set_header(engine.fetch_header())
    return None


def sample_seen(engine: Engine, batch_size: int, generator: torch.Generator | None, device: torch.device | None) -> Sample | None:
    """A uniform batch drawn on the client below the written length this handle last saw (``engine.written_seen``;
    read first, one round trip, when it saw none) and read with ``rw`` in one transaction of plain GETRANGEs.

    Written slots stay written (``rw`` only grows until the store is made again), so every slot drawn below
    the bound holds a written row; ``rw`` read with the rows proves it and moves the bound on. None where the
    server must draw: heterogeneous keys, a sampling policy, no transactions, a stack dim other than 0, nothing
    written, or a draw beyond ``rw`` (the store was made again meanwhile)."""
    h = engine.header
    if not (engine.tx_reads and h.stack_pos == 0 and h.sampling is None and h.leaves and not h.absent_rows) or any(
        leaf.het for leaf in h.leaves.values()
    ):
        return None
    if engine.written_seen == 0:  # (a ring this handle saw full stays full: no round trip)
        engine.written_seen = h.count if engine.ring_full else min(engine.ring_writes(), h.count)
    if engine.written_seen == 0:
        return None
    slots = torch.randint(0, engine.written_seen, (batch_size,), generator=generator)
    _, res = engine.read(slots, fields=_TX_FIELDS, counts=tx_counts(engine, h, slots.numpy()))
    if not isinstance(res, DenseResult) or res.fields is None:
        return None
    rw = ring_writes_of(engine, res.fields, h)
    if rw == 0 or res.fields.get("sc") is not None or res.fields.get("ho") is not None:  # (a policy set since, or absent rows)
        return None
    engine.written_seen = min(rw, h.count)
    engine.ring_full = engine.ring_full or rw >= h.count
    if int(slots.max()) >= engine.written_seen:
        return None
    distinct_caught_up(engine, h, res.fields, slots.numpy())
    return Sample(build_td(res.leaves, res.batch_size, device, sub=h.sub_dims), slots, generations(slots, rw, h.count))  # sub-trees' dims


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
        self.packed = codec.pack_i64(self.draws.numpy())
        self.request = request_id()

    def plan(self, h: Header) -> Call:
        engine, keys = self.engine, self.keys
        by_prio = self.asked if self.asked is not None else (h.sampling is not None and h.sampling.prioritized)
        use_policy = by_prio or self.min_size is not None or h.sampling is not None
        if use_policy and h.sampling is not None and (h.sampling.limit is not None or h.sampling.max_times is not None):
            deadline.arm()  # a sample that counts, sent next: from now on it may have been counted
        if self.as_tx and not use_policy and engine.ring_full and h.stack_pos == 0 and not h.absent_rows:
            tx = _tx_sample_call(engine, h, keys, self.draws, self.device, self.ragged)
            if tx is not None:
                return tx
        packed = self.packed

        def head(kt: KeyTable) -> list[Any]:
            if use_policy:
                tree, counts = kt.ref(engine.keys.priorities), kt.ref(engine.keys.times_sampled)
                return Read.P(self.batch_size, packed, tree, counts, engine.keys.events, self.min_size or 0, "1" if by_prio else "0")
            return Read.U(self.batch_size, packed)

        def parse(reply: list, rows: RowRead) -> Sample | policy_calls.PrioritizedSample:
            pieces = 6 if use_policy else 4
            got = decode_sample(h, rows.leaves, reply, pieces, self.device, rows.block, rows.grouped, self.ragged, rows.wanted)
            engine.ring_full = engine.ring_full or int(reply[3]) >= h.count
            if not by_prio:
                return got
            probs, low = policy_calls.probabilities(reply)
            if self.heads is not None:
                mass = np.frombuffer(reply[5], dtype="<f8")[1:2]
                self.heads.append((float(mass[0]) if len(mass) else math.nan, low, int(reply[3])))
            return policy_calls.PrioritizedSample(
                got.td, got.indices, got.generations, policy_calls.weights_of(probs, low, self.beta), probs
            )

        call = row_read_call(engine, h, keys, self.batch_size, head, parse, self.request if use_policy else None)
        if use_policy:
            return call
        # a uniform sample: bring back the offset tables the handle does not keep (of the segments the
        # draws fall in once the ring is full), so that the next samples of a full ring go as transactions
        units = row_block.units(h, selected_leaves(h, keys))[0]
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
    selected = selected_leaves(h, keys)
    if not selected or not any(leaf.het for leaf in selected):
        return None
    leaves, block, grouped = row_block.units(h, selected)
    slots = (draws % h.count).numpy()
    tx = plan_rows_tx(engine, h, slots, leaves)
    if tx is None:
        return None
    wanted = None if keys is None else {leaf.path for leaf in selected}
    guards = {"epoch": h.epoch, "kv": str(h.keyset_version), **{f"lv:{leaf.number}": str(leaf.version) for leaf in selected}}

    def parse(reply: list) -> Sample:
        fields = call.field_values or {}
        rw = ring_writes_of(engine, fields, h)
        if rw < h.count or fields.get("sc") is not None or fields.get("ho") is not None:
            raise _RingMoved
        distinct_caught_up(engine, h, fields, slots)
        piece = str(rw).encode()
        return decode_sample(h, leaves, [*reply[:2], codec.pack_i64(slots), piece, *reply[2:]], 4, device, block, grouped, ragged, wanted)

    counts = tx_counts(engine, h, slots)
    call = Call("tx", [], [], parse, ranges=tx[0], guards=guards, fields=list(_TX_FIELDS), verify=tx[1], counts=counts)
    return call


#: The header fields a full ring's transaction sample reads with its rows: the ring's, and whether it tracks distinct rows.
_TX_FIELDS = (*RING_FIELDS, "sd")


def tx_counts(engine: Engine, h: Header, slots: Any) -> list[list[Any]] | None:
    """The commands a full ring's sample of the rows in ``slots`` read as a transaction ends with (``_inspect.stats``).

    A ring that does not track distinct rows (the default): one ``HINCRBY smpx n`` (their ages are not measured, the
    client maps the draws before it knows ``rw``); when it makes the field, the transport gives the hash the store's
    deadline (``lua/sampled.lua`` with 0 rows, a round trip of its own once per store). One that does
    (``track_distinct``): a plain ``BITFIELD`` setting their bits in the sampled-rows bitmap (cheaper than from Lua),
    then ``lua/sampled.lua``, which counts them and gives the keys the store's deadline, which a transaction cannot
    read. The transaction reads the header's ``sd`` with the rows: :func:`distinct_caught_up` mends a handle that
    did not know the setting. None for a read-only handle."""
    if engine.readonly or not np.asarray(slots).size:
        return None
    keys = engine.keys
    if not h.distinct:
        return [["HINCRBY", keys.stats, "smpx", int(np.asarray(slots).size)]]
    script = ["EVALSHA", scripts.script_source("sampled")[1]] if engine.__dict__.get("_sampled_sent") else None
    # the handle's first one sends the text (EVAL caches it), so that no NOSCRIPT costs a round trip
    engine.__dict__["_sampled_sent"] = True
    return [_marks(engine, slots), [*(script or _eval_sampled()), 3, keys.meta, keys.stats, keys.sampled_rows, int(np.asarray(slots).size)]]


def _eval_sampled() -> list[Any]:
    return ["EVAL", scripts.script_source("sampled")[0]]


def _marks(engine: Engine, slots: Any) -> list[Any]:
    """``BITFIELD`` setting the bits of the rows in ``slots`` in the sampled-rows bitmap."""
    rows = np.unique(np.asarray(slots))
    marks: list[Any] = ["BITFIELD", engine.keys.sampled_rows, *(["SET", "u1", 0, 1] * rows.size)]
    marks[4::4] = rows.tolist()
    return marks


def distinct_caught_up(engine: Engine, h: Header, fields: dict[str, Any], slots: Any) -> None:
    """After a full ring's transaction sample planned from ``h``: when the header's ``sd`` read with the rows says
    otherwise (another handle turned distinct tracking on or off since), adopt the header again; when it was turned
    on, mark the rows now (a round trip of its own, once per such change: ``lua/sampled.lua`` with 0 rows gives the
    bitmap the store's deadline, or deletes it for a store gone)."""
    on = fields.get("sd") in (b"1", "1")
    if on == h.distinct or engine.readonly or "sd" not in fields:
        return
    engine.set_header(engine.fetch_header())
    if on and np.asarray(slots).size:
        keys = engine.keys
        engine.commands([tuple(_marks(engine, slots)), (*_eval_sampled(), 3, keys.meta, keys.stats, keys.sampled_rows, 0)])


@deadline.honours_timeout("pop")
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
    request = request or request_id()  # one per pop, sent with every attempt: a resend never moves the cursor twice
    leased = Planner(engine, batch_size, device, keys, 0, receipt=request[:16])

    def plan_call(h: Header) -> Call:
        if h.leased:  # items whose lease ran out go to plain pops too: through the lease table
            return leased.plan(h)
        deadline.arm()  # sent next: from now on the pop may have taken its items
        return row_read_call(
            engine,
            h,
            keys,
            batch_size,
            lambda kt: Read.F(batch_size, channel),
            lambda reply, rows: decode_sample(h, rows.leaves, reply, 4, device, rows.block, rows.grouped, None, rows.wanted),
            request,
        )

    def resend(again: float | None) -> Sample:
        # the same pop under the same id: the server answers with the items it took (read.lua 'N')
        return pop(engine, batch_size, device, again, keys, request)

    with deadline.resolvable(request, resend, keyword=True):
        return waiting.until_ready(engine, lambda: engine.run(plan_call), timeout, "pop")
