"""The ``write.lua`` call of one planned write: from the planner's ops to the script's ARGV.

The planner (``_plan.write_plan``, ``_plan.element_write``, ``_plan.ring_plan``) gives (new header or None,
ops, leaves touched); :func:`write_call` adds what the script checks first (the header's epoch and versions,
what each key must hold), fixes the segment length of a store's first keys, cuts the ops per segment,
and stages large new blobs by plain SETRANGE in the same round trip.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tdstore._engine import held, spread_change
from tdstore._format import segments
from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf
from tdstore._plan import write_plan
from tdstore._plan.call import Call, CallHost, leaf_checks

#: Whole blobs of at least this many bytes are staged with plain SETRANGE and moved into place by the script
#: (measured, store.set of a key of 1 MiB: 0.94 ms staged against 2.12 ms through the script on Redis 7.0;
#: 1.00 / 0.93 on 6.2; at 256 KiB 0.57 / 0.71 and 0.50 / 0.87).
BULK_WRITE_BYTES = 256 << 10


def leaf_shapes(*headers: Header) -> Callable[[int], segments.LeafShape]:
    """Leaf number -> what localizing its ops needs; the first header that knows the number wins."""
    table = {}
    for h in reversed(headers):
        for leaf in (*h.leaves.values(), *([h.block] if h.block is not None else [])):
            table[leaf.number] = segments.LeafShape(leaf.het, 0 if leaf.het else leaf.element_nbytes, 8 * leaf.ndim)
    return table.__getitem__


def first_keys(engine: CallHost, h: Header, new_header: Header, ops: list[list[Any]], kt: KeyTable) -> Header:
    """``new_header`` with its segment length fixed when it gives a store created empty its first keys
    (which say how large it may grow), after refusing a store that cannot fit the server; else as it is."""
    if h.seg or h.leaves or not new_header.leaves:
        return new_header
    sizes = write_plan.first_element_sizes(engine.keys, new_header, ops, kt)
    new_header = replace(new_header, seg=segments.segment_length(h.count, max((big for _, big in sizes), default=1), engine.segment_size))
    engine.check_room(new_header, sum(mean for mean, _ in sizes))
    return new_header


def write_call(
    engine: CallHost,
    plan: Callable[[Header, KeyTable], tuple[Header | None, list[list[Any]], list[Leaf]]],
    h: Header,
    *,
    keyset: bool,
    request: str | None,
    state: dict[str, Header],
) -> Call:
    """The call of ``plan`` planned against ``h`` (see ``Engine.run_write_reply``); the header the write
    leaves goes into ``state["new"]`` for the reply's parse."""
    kt = engine.key_table(h)
    new_header, ops, touched = plan(h, kt)
    if new_header is not None:
        new_header = first_keys(engine, h, new_header, ops, kt)
    if h.row is not None and new_header is not None and new_header.row is None:
        ops = [*ops, Write.D(kt.ref(engine.keys.data(h.row[0])))]  # the block's last leaf left it
    if new_header is not None and h.spread:  # nothing the old schema uses is written before the commit
        new_header, ops = spread_change.copy_on_write(engine.keys, h, new_header, kt, ops)
    after = new_header or h
    if after.segments.n > 1:
        kt, ops = segments.localize_write(after.segments, engine.keys, leaf_shapes(after, h), kt, ops)
    if any(op[0] == Write.W.marker for op in ops):  # a ring write: counted in the store's stats (lua/_lib.lua tds_stat)
        ops = [Write.A(kt.block([engine.keys.stats, engine.keys.sampled_rows]), held.held_ms()), *ops]
    if request is not None:
        ops = [Write.N(kt.ref(engine.keys.replies), request), *ops]
    if engine.counts_in_place:
        ops = [*ops, Write.B(1)]  # KEYS[1]: the header (a spread store's segment 0 part holds it)
    if new_header is not None:
        args: list[Any] = [
            f"{h.epoch}:V{h.version}",
            "",
            new_header.schema_json(),
            new_header.version_fields(h),
            engine.max_value_bytes,
        ]
    else:
        args = [f"{h.epoch}:K{h.keyset_version}" if keyset else f"{h.epoch}:*", leaf_checks(touched), "", "", engine.max_value_bytes]
    staged: list[tuple[str, Any]] = []
    sent = []
    for op in ops:
        if op[0] == Write.S.marker and len(op[2]) >= BULK_WRITE_BYTES:
            # a large new blob: staged by plain SETRANGE in the same round trip, moved by the script
            target = kt.keys[op[1] - 1]
            stage = engine.keys.staging(target, uuid.uuid4().hex[:12])
            staged.append((stage, op[2]))
            op = Write.M(kt.ref(stage), op[1], len(op[2]))
        sent.append(op)
    args += [engine.checks_memo.checks(engine.keys, h, kt.keys, new_header), len(sent)]
    for op in sent:
        args.extend(op)
    state["new"] = new_header or h

    def parse(reply: list) -> tuple[Header, bytes | None]:
        return state["new"], reply[2] if len(reply) > 2 else None

    return Call("write", kt.keys, args, parse, staged=staged or None, ops=sent, schema=new_header)
