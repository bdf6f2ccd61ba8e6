"""A call of a store spread over a cluster's nodes (see ``_engine.spread``): cut per segment and node, and
waiting, while another client's schema change holds the store's lock, for it to finish."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from tdstore._engine import spread as _spread
from tdstore._engine import spread_change as _spread_change
from tdstore._format.schema import Header
from tdstore._plan.call import Call
from tdstore._plan.read_results import DenseResult

if TYPE_CHECKING:
    from tdstore._engine.engine import Engine


def cut_per_segment(header: Header, call: Call) -> bool:
    """Whether ``call`` is cut per segment (a spread store's call that reaches past segment 0's slot)."""
    return (
        header.spread
        and call.script in ("read", "write", "tx")
        and (header.segments.n > 1 or (call.schema is not None and call.schema.segments.n > 1))
    )


def spread_call(engine: Engine, plan: Callable[[Header], Call], header: Header, call: Call) -> Any:
    """A spread store's call: ``(result,)``, ``_engine.spread.LOCAL`` when it stays in
    segment 0, or None to plan again. While another client's schema change is under way the call
    waits for it and plans again here, without counting a lost race, for at most the lock's lease."""
    deadline = time.monotonic() + _spread.LEASE_MS / 1000 + 5
    while True:
        engine.check_argument_sizes(call)
        if call.schema is not None:
            reply = _spread_change.run_schema_change(engine, header, call)
        elif call.script == "tx":
            try:
                reply = _spread.run_transaction(engine, header, call)
            except redis.exceptions.ResponseError as err:
                return (engine.transaction_refused(err, plan),)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                # a node away (a failover, say): read through the scripts, which RedisCluster
                # routes with a fresh slot map, or which raise naming the store
                return (engine.run_with_script_reads(plan),)
        else:
            reply = _spread.run_data(engine, header, call)
        if reply is _spread.WAIT:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001 * random.random())
            header = engine.header
            call = plan(header)
            if header.segments.n > 1 and call.script in ("read", "tx"):
                engine.localize_read(header, call)
            if not cut_per_segment(header, call):
                return None
            continue
        if reply is None or reply is _spread.LOCAL:
            return reply
        if call.script == "tx" and engine.short(call, reply):
            return (engine.run_with_script_reads(plan),)
        out = call.parse(reply)
        if call.fields and isinstance(out, DenseResult):
            out.fields = call.field_values
        return (out,)
