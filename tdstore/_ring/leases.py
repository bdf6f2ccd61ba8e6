"""Leased pops: a ring's queue with at-least-once delivery and acknowledgement.

``pop(n, lease=S)`` hands the next items out under a lease of ``S`` seconds on the server's clock
and returns them with a :class:`Receipt`; ``ack(receipt)`` settles them. An item not acknowledged
in time goes to the next pop again (leased or not), before newer items, in write order, with its
delivery count: a reader that dies after its pop loses nothing (Redis Streams' XACK/XAUTOCLAIM,
SQS visibility timeouts). A reader that acknowledges gets each item exactly once in effect:
delivery is at least once, and a late ``ack`` says which items it no longer held.

Both are one round trip: the pop is ``read.lua``'s 'L' op (reading the rows in the same call), the
ack ``ack.lua``; the lease table's layout, and how much one pop reclaims, are in
``lua/_lease.lua``. The receipt is made here, before the call: a pop sent again after a lost reply
(redis-py resends it) finds its lease already recorded and gets the same items, taking no more.
Once a store has had a leased pop (header field ``ls``), its plain pops take the same op with no
lease (:func:`plain_planner`), so they hand out the items waiting for redelivery too.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._engine import deadline
from tdstore._engine.engine import Engine
from tdstore._errors import LeaseLostError
from tdstore._format import codec
from tdstore._format.op_kinds import Read
from tdstore._format.schema import Header, NestedPath
from tdstore._plan.call import Call
from tdstore._plan.ring_plan import Sample
from tdstore._ring import waiting
from tdstore._ring.args import check_batch_size, refuse_spread
from tdstore._ring.row_reads import decode_sample, row_read_call


@dataclass(frozen=True)
class Receipt:
    """What ``ack`` needs: the receipt id the pop was sent with, and the write numbers it leased."""

    id: str
    write_numbers: tuple[int, ...]


#: its public home: pickles name it there (set once made: a dataclass resolves its annotations in its own module)
Receipt.__module__ = "tdstore.ring_interface"


@dataclass
class LeasedSample:
    """Items popped under a lease: the data, per row its slot, generation, ring write number and
    delivery count (1 the first time), and the receipt that ``ack`` takes.

    ``with store.pop(n, lease=S) as got:`` acknowledges on a clean exit and not when the block
    raises (the items then go to another pop once the lease runs out).
    """

    td: TensorDictBase
    indices: torch.Tensor
    generations: torch.Tensor
    write_numbers: torch.Tensor
    deliveries: torch.Tensor
    receipt: Receipt
    deadline_ms: int
    """When the lease ends, in milliseconds on the server's clock (``TIME``), which may differ from this machine's."""
    _store: Any = field(default=None, repr=False, compare=False)
    _timeout: float | None = field(default=None, repr=False, compare=False)
    """The pop's ``timeout=``: the deadline of the ``ack`` that ``with`` sends on a clean exit."""

    @property
    def redelivered(self) -> torch.Tensor:
        """Per row: handed out before (its lease ran out unacknowledged)."""
        return self.deliveries > 1

    def ack(self, timeout: float | None = None) -> int:
        """``store.ack(self.receipt, timeout=...)``; by default within the pop's own ``timeout``."""
        if self._store is None:
            raise RuntimeError("this LeasedSample is not bound to a store: call store.ack(sample.receipt)")
        return int(self._store.ack(self.receipt, timeout=self._timeout if timeout is None else timeout))

    def __enter__(self) -> LeasedSample:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.ack()


LeasedSample.__module__ = "tdstore.ring_interface"  # see Receipt.__module__


def lease_ms(lease: Any) -> int:
    """``lease`` seconds as the whole milliseconds the server counts (at least 1); ``ValueError`` unless a finite number > 0."""
    if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not math.isfinite(lease) or lease <= 0:
        raise ValueError(f"lease must be a finite number of seconds > 0, got {lease!r}")
    ms = max(1, round(lease * 1000))
    if ms > 2**46:
        raise ValueError(f"lease of {lease!r} seconds is too long (at most {2**46 // 1000} s)")
    return ms


def new_receipt() -> str:
    """A receipt id: 16 random hex digits, made once per pop so that a resend carries the same one."""
    return secrets.token_hex(8)


class Planner:
    """Plans one pop through the lease table ('L' op): leased (``ms > 0``, a :class:`LeasedSample`)
    or a plain pop on a store that has leases (``ms == 0``, a ``Sample``)."""

    def __init__(
        self,
        engine: Engine,
        batch_size: int,
        device: torch.device | None,
        keys: list[NestedPath] | None,
        ms: int,
        receipt: str | None = None,
    ) -> None:
        self.engine, self.batch_size, self.device, self.keys, self.ms = engine, batch_size, device, keys, ms
        self.receipt = receipt or new_receipt()
        self.store: Any = None
        self.timeout: float | None = None

    def plan(self, h: Header) -> Call:
        engine = self.engine
        lease_keys = engine.keys.lease_keys
        deadline.arm()  # sent next: from now on the pop may have taken its items

        def head(kt: Any) -> list[Any]:
            refs = [kt.ref(key) for key in lease_keys]
            return Read.L(self.batch_size, engine.keys.events, self.ms, self.receipt, *refs)

        def parse(reply: list, rows: Any) -> Sample | LeasedSample:
            got = decode_sample(
                h, rows.leaves, reply, 2 + Read.L.reply_pieces([]), self.device, rows.block, rows.grouped, None, rows.wanted
            )
            ends_ms, kv = (int(x) for x in _text(reply[6]).split())
            if not h.leased and engine.header is h:
                # this pop turned leases on (and moved kv): adopt that, instead of a STALE on the next call
                engine.set_header(_with_leases(h, kv))
            if self.ms == 0:
                return got
            ws = torch.from_numpy(codec.unpack_i64(reply[4]).astype(np.int64))
            deliveries = torch.from_numpy(codec.unpack_i64(reply[5]).astype(np.int64))
            gens = torch.div(ws, h.count, rounding_mode="floor") + 1
            receipt = Receipt(self.receipt, tuple(int(w) for w in ws.tolist()))
            return LeasedSample(got.td, got.indices, gens, ws, deliveries, receipt, ends_ms, self.store, self.timeout)

        return row_read_call(engine, h, self.keys, self.batch_size, head, parse)


def _with_leases(h: Header, kv: int) -> Header:
    return replace(h, leased=True, keyset_version=kv)


def _text(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


def ack(engine: Engine, receipt: Any, timeout: float | None = None) -> int:
    """Settle the items of a leased pop (see ``LazyStackedTensorDictStore.ack``): how many it settled."""
    if isinstance(receipt, LeasedSample):
        receipt = receipt.receipt
    rid = receipt.id if isinstance(receipt, Receipt) else receipt
    if not isinstance(rid, str) or not rid or len(rid) > 64 or not all(c.isalnum() or c in "-_" for c in rid):
        raise ValueError(f"ack takes the receipt of a leased pop (store.pop(n, lease=S).receipt), got {receipt!r}")
    engine.refuse_if_readonly()

    def plan_call(h: Header) -> Call:
        deadline.arm()  # sent next: from now on the ack may have settled the items
        keys = [engine.keys.meta, *engine.keys.lease_keys, engine.keys.stats]  # the stats hash: ack.lua counts the items settled
        return Call("ack", keys, [f"{h.epoch}:*", rid, engine.keys.events], lambda r: r)

    def resend(again: float | None) -> int:
        return ack(engine, rid, again)  # an ack is safe to resend: the same answer

    try:
        with deadline.within(timeout, "ack", engine.where), deadline.resolvable(rid, resend):
            reply = engine.run(plan_call)
    except ValueError as err:  # the script's refusal: name the store (fakeredis appends a Lua traceback)
        raise ValueError(f"the store with {engine.where()}: {str(err).splitlines()[0]}") from None
    settled = int(reply[1])
    missed = [int(w) for w in codec.unpack_i64(reply[2]).tolist()] if reply[2] else []
    if missed:
        raise LeaseLostError(
            f"the lease of receipt {rid} on the store with {engine.where()} ran out before this ack: "
            f"{len(missed)} of its items were handed to another pop or settled there (write numbers {_brief(missed)}); "
            f"{settled} were settled",
            settled=settled,
            not_held=missed,
        )
    return settled


def _brief(ws: list[int]) -> str:
    return ", ".join(map(str, ws[:8])) + (", ..." if len(ws) > 8 else "")


def pop(
    engine: Engine,
    store: Any,
    batch_size: int,
    device: torch.device | None,
    timeout: float | None,
    keys: list[NestedPath] | None,
    lease: Any,
    request: str | None = None,
) -> LeasedSample:
    """Up to ``batch_size`` items under a lease of ``lease`` seconds (see ``LazyStackedTensorDictStore.pop_items``;
    ``request`` as ``sample_pop.pop``'s: its first 16 hex digits are the receipt)."""
    check_batch_size(batch_size, "pop")
    ms = lease_ms(lease)
    engine.refuse_if_readonly()
    refuse_spread(engine)
    # one receipt for every try and resend of this pop
    planner = Planner(engine, batch_size, device, keys, ms, receipt=None if request is None else request[:16])
    planner.store, planner.timeout = store, timeout

    def resend(again: float | None) -> LeasedSample:
        # the same pop under the same receipt: the lease table gives back the items it leased
        return pop(engine, store, batch_size, device, again, keys, lease, planner.receipt)

    with deadline.within(timeout, "pop", engine.where), deadline.resolvable(planner.receipt, resend, keyword=True):
        return waiting.until_ready(engine, lambda: engine.run(planner.plan), timeout, "pop")
