"""A call of a store spread over a cluster's nodes (see ``_engine.spread``): cut per segment and node, and
waiting, while another client's schema change holds the store's lock, for it to finish. A read that must go
through the scripts instead is the engine's to run again (:data:`SCRIPT_READS`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import redis

from tdstore._engine import spread, spread_change
from tdstore._engine.transport import refused_for_good
from tdstore._format.schema import Header
from tdstore._plan.call import Call, CallHost
from tdstore._plan.read_results import DenseResult

#: :func:`spread_call`'s answer when the call is to be read through the scripts instead (the engine runs it so):
#: a read transaction a node refused or could not answer, or one whose reply came short.
SCRIPT_READS = object()


def cut_per_segment(header: Header, call: Call) -> bool:
    """Whether ``call`` is cut per segment (a spread store's call that reaches past segment 0's slot)."""
    return (
        header.spread
        and call.script in ("read", "write", "tx")
        and (header.segments.n > 1 or (call.schema is not None and call.schema.segments.n > 1))
    )


def spread_call(engine: CallHost, plan: Callable[[Header], Call], header: Header, call: Call) -> Any:
    """A spread store's call: ``(result,)``, ``_engine.spread.LOCAL`` when it stays in
    segment 0, :data:`SCRIPT_READS` to read through the scripts, or None to plan again. While another
    client's schema change is under way the call waits for it and plans again here, without counting a
    lost race, for at most the lock's lease."""
    deadline = time.monotonic() + spread.LEASE_MS / 1000 + 5
    while True:
        engine.check_argument_sizes(call)
        if call.schema is not None:
            reply = spread_change.run_schema_change(engine, header, call)
        elif call.script == "tx":
            try:
                reply = spread.run_transaction(engine, header, call)
            except redis.exceptions.ResponseError as err:  # as Engine.transaction_refused
                if refused_for_good(err):
                    engine.transactions = False
                return SCRIPT_READS
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                # a node away (a failover, say): read through the scripts, which RedisCluster
                # routes with a fresh slot map, or which raise naming the store
                return SCRIPT_READS
        else:
            reply = spread.run_data(engine, header, call)
        if reply is spread.WAIT:
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
        if reply is None or reply is spread.LOCAL:
            return reply
        if call.script == "tx" and engine.short(call, reply):
            return SCRIPT_READS
        out = call.parse(reply)
        if call.fields and isinstance(out, DenseResult):
            out.fields = call.field_values
        return (out,)
