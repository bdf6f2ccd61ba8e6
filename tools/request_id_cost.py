#!/usr/bin/env python3
"""What a request id costs a ring call (issue #27): the same ``write.lua`` call with and without its 'N' op.

A ring write carries a request id so that a resend (redis-py retrying after a lost reply) gets the
first reply instead of writing again; the script looks the id up and records the call's decision in
the store's reply cache. This times the very ``EVALSHA`` an ``extend`` sends, captured from the
client, against the same call without the 'N' op (which ``write.lua`` still accepts), interleaved
call by call on one server (A B, then B A), each with a fresh id, so that the load of the machine
falls on both alike; then the whole ``store.extend`` (planning included) the same way. The reply
cache fills past its 4096 records, so most recorded calls also drop the oldest record: the steady
state. Prints medians (and 10th percentiles) and their ratios.

Usage::

    python -m tools.request_id_cost [--binary /usr/bin/redis-server] [--calls 4000]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from typing import Any

import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer, find_redis_server


def rows(n: int) -> TensorDict:
    t = torch.arange(n)
    return TensorDict({"obs": t.float().unsqueeze(-1).expand(n, 8).clone(), "tag": t.clone(), "r": t.float().clone()}, [n])


def captured_call(store: LazyStackedTensorDictStore, n: int) -> list[Any]:
    """The EVALSHA that ``store.extend`` of ``n`` rows sends."""
    engine = store._engine
    plain = engine.execute
    seen: list[list[Any]] = []

    def grab(client: Any, *args: Any) -> Any:
        if args[0] == "EVALSHA":
            seen.append(list(args))
        return plain(client, *args)

    engine.execute = grab  # type: ignore[method-assign]
    try:
        store.extend(rows(n))
    finally:
        engine.execute = plain  # type: ignore[method-assign]
    return seen[-1]


def time_pair(raw: Any, call: list[Any], calls: int) -> tuple[list[float], list[float]]:
    """Seconds per call with the request id and without, interleaved (A B, then B A)."""
    nkeys = call[2]
    head, argv = call[: 3 + nkeys], call[3 + nkeys :]
    assert argv[7] == "N", "the captured call carries no request id"
    bare = [*argv[:6], int(argv[6]) - 1, *argv[10:]]  # ARGV[7] is the op count; ARGV[8..10] the 'N' op
    with_id: list[float] = []
    without: list[float] = []
    for i in range(2 * calls):
        argv[9] = secrets.token_hex(16)
        order = (True, False) if i < calls else (False, True)
        for use_id in order:
            t0 = time.perf_counter()
            reply = raw.execute_command(*head, *(argv if use_id else bare))
            (with_id if use_id else without).append(time.perf_counter() - t0)
            assert reply[0] == b"OK", reply
    return with_id, without


def time_whole(store: LazyStackedTensorDictStore, n: int, calls: int) -> tuple[list[float], list[float]]:
    """Seconds per whole ``store.extend`` (planning included) with a request id and without, interleaved."""
    from tdstore._ring import extend as _ring

    made = _ring.request_id
    td = rows(n)
    with_id: list[float] = []
    without: list[float] = []
    try:
        for i in range(2 * calls):
            for use_id in (True, False) if i < calls else (False, True):
                _ring.request_id = made if use_id else (lambda: None)  # type: ignore[assignment,return-value]
                t0 = time.perf_counter()
                store.extend(td)
                (with_id if use_id else without).append(time.perf_counter() - t0)
    finally:
        _ring.request_id = made
    return with_id, without


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", default=None, help="redis-server to start (default: find_redis_server())")
    parser.add_argument("--calls", type=int, default=4000, help="calls of each kind, in each order")
    args = parser.parse_args(argv)
    with EmbeddedServer(binary=args.binary or find_redis_server()) as srv:
        raw = srv.client()
        store = LazyStackedTensorDictStore(count=100_000, url=srv.url, prefix="request-id-cost")
        store.extend(rows(1))
        for n in (1, 32):
            with_id, without = time_pair(raw, captured_call(store, n), args.calls)
            a, b = statistics.median(without) * 1e6, statistics.median(with_id) * 1e6
            qa, qb = statistics.quantiles(without, n=10)[0] * 1e6, statistics.quantiles(with_id, n=10)[0] * 1e6
            print(
                f"extend({n:2d}) EVALSHA  without id {a:6.1f} us  with id {b:6.1f} us  ratio {b / a:5.3f}   "
                f"(10th percentile {qa:6.1f} / {qb:6.1f} us, ratio {qb / qa:5.3f})"
            )
            whole_with, whole_without = time_whole(store, n, args.calls // 4)
            a, b = statistics.median(whole_without) * 1e6, statistics.median(whole_with) * 1e6
            print(f"extend({n:2d}) whole    without id {a:6.1f} us  with id {b:6.1f} us  ratio {b / a:5.3f}")
        records = sum(1 for k in raw.hkeys(store._engine.keys.replies) if not k.startswith(b"#"))
        print(f"reply cache: {records} records, {raw.memory_usage(store._engine.keys.replies)} bytes (MEMORY USAGE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
