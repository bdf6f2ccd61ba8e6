"""Fault case ``ambiguous-timeout``: a deadline that passes after the call was sent (issue 38, item 1).

The adversary's cases replayed: ``pop(1, timeout=0)`` on items of 64 MiB (16 MiB with ``--quick``)
whose replies take longer than the shortest socket read a deadline allows; the same pop sent to a
stopped server (SIGSTOP: its reply deterministically late); ``pop(2, timeout=0.2)`` while another
client's 1 s script holds the server; ``extend(..., timeout=0.05)`` sent to a stopped server, and
of big rows to a running one. What the user sees is reported as it comes (a call may finish in time
on a fast machine); what is checked never depends on it: every item the read cursor passed reached
the caller exactly once (returned, or returned by ``err.retry()``), with the bytes it was written
with, and every extend wrote its rows once (``write_count``, and the rows read back).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
import torch
from tensordict import TensorDict

from tdstore import AmbiguousTimeoutError, LazyStackedTensorDictStore
from tools.faults.base import Check, Env

#: What a call's outcome is called in the report.
_AMBIGUOUS, _PLAIN, _IN_TIME = "AmbiguousTimeoutError", "TimeoutError", "in time"


def _outcome(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except TimeoutError as err:
        return None, err


def _kind(err: BaseException | None) -> str:
    return _IN_TIME if err is None else _AMBIGUOUS if isinstance(err, AmbiguousTimeoutError) else _PLAIN


def _tally(kinds: list[str]) -> str:
    return ", ".join(f"{n}x {k}" for k, n in Counter(kinds).items())


@contextmanager
def _stopped(env: Env) -> Iterator[None]:
    """The case's server stopped (SIGSTOP) in the block: what is sent meanwhile waits, unanswered."""
    assert env.server is not None and env.server.pid is not None
    os.kill(env.server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(env.server.pid, signal.SIGCONT)


def _item(i: int, n: int) -> torch.Tensor:
    """Item ``i`` of ``n`` int32: every element tells the item and its place."""
    return torch.arange(n, dtype=torch.int32) * 7 + i


def _cursor(env: Env, store: LazyStackedTensorDictStore) -> int:
    return int(env.client.hget(store._engine.keys.meta, "rr") or 0)


def _pops(
    env: Env, store: LazyStackedTensorDictStore, calls: list[Callable[[], Any]], width: int, first: int
) -> tuple[list[str], bool, str]:
    """Run the pops ``calls``, then retry each ambiguous one: (outcomes, every item passed by the cursor
    reached the caller once with its bytes, the proof)."""
    kinds: list[str] = []
    got: list[Any] = []
    for call in calls:
        out, err = _outcome(call)
        kinds.append(_kind(err))
        if isinstance(err, AmbiguousTimeoutError):
            got.append(err.retry(timeout=120))
        elif out is not None:
            got.append(out)
    slots = [int(s) for g in got for s in g.indices.tolist()]
    exact = all(torch.equal(g.td["x"][k], _item(int(s), width)) for g in got for k, s in enumerate(g.indices.tolist()))
    passed = _cursor(env, store) - first
    ok = exact and len(slots) == len(set(slots)) == passed
    return kinds, ok, f"cursor moved {passed}, {len(slots)} items reached the caller, {len(set(slots))} distinct, bytes exact: {exact}"


def case_ambiguous_timeout(env: Env) -> list[Check]:
    """Pops and extends whose deadline passes after they were sent: ``AmbiguousTimeoutError`` and a retry
    that answers once; a plain ``TimeoutError`` only for a call that did not run."""
    assert env.server is not None
    quick = env.opts.quick
    width = (16 if quick else 64) << 18  # int32 elements: 16 or 64 MiB per item
    n_big = 2 if quick else 4
    checks: list[Check] = []

    # pop(1, timeout=0) of big items on a running server: the reply takes longer than the socket floor
    store = LazyStackedTensorDictStore(count=n_big + 2, url=env.url, prefix=env.prefix, td_id=env.td_id("big"))
    for i in range(n_big + 1):
        store.extend(TensorDict(x=_item(i, width).unsqueeze(0), batch_size=[1]))
    store.pop(1, timeout=120)  # item 0: the server knows the script
    first = _cursor(env, store)
    kinds, ok, proof = _pops(env, store, [lambda: store.pop(1, timeout=0)] * (n_big - 1), width, first)
    checks.append(Check(f"pop(1, timeout=0) of {width >> 18} MiB items", ok, _tally(kinds), proof))

    # the same pop sent to a stopped server: its reply is late whatever the machine's speed
    first = _cursor(env, store)
    with _stopped(env):
        _, err = _outcome(lambda: store.pop(1, timeout=0))
    kinds, ok, proof = [_kind(err)], err is not None, ""
    if isinstance(err, AmbiguousTimeoutError):
        got = err.retry(timeout=120)
        again = store.pop(1, request_id=err.request_id, timeout=120)
        ok = torch.equal(got.td["x"][0], _item(n_big, width)) and torch.equal(again.td["x"][0], got.td["x"][0])
        ok = ok and _cursor(env, store) == first + 1
        proof = f"retry and request_id= both gave item {int(got.indices[0])}, its bytes exact; cursor moved {_cursor(env, store) - first}"
    checks.append(Check("pop(1, timeout=0) sent to a stopped server", ok and kinds == [_AMBIGUOUS], _tally(kinds), proof))

    # pop(2, timeout=0.2) while another client's 1 s script holds the server
    queue = LazyStackedTensorDictStore(count=8, url=env.url, prefix=env.prefix, td_id=env.td_id("busy"))
    queue.extend(TensorDict(x=torch.stack([_item(i, 4) for i in range(6)]), batch_size=[6]))
    queue.pop(1, timeout=120)
    first = _cursor(env, queue)
    busy = redis.Redis.from_url(env.url)
    spin = "local e = tonumber(redis.call('TIME')[1]) + 2 while tonumber(redis.call('TIME')[1]) < e do end return 1"
    conn = busy.connection_pool.get_connection()
    conn.send_command("EVAL", spin, 0)  # from 1 to 2 s: until the second after the next one starts
    kinds, ok, proof = _pops(env, queue, [lambda: queue.pop(2, timeout=0.2)], 4, first)
    conn.read_response()
    busy.connection_pool.release(conn)
    busy.close()
    checks.append(Check("pop(2, timeout=0.2) under another client's 1-2 s script", ok, _tally(kinds), proof))

    # extend(..., timeout=0.05) sent to a stopped server, three times, then each retried
    ring = LazyStackedTensorDictStore(count=64, url=env.url, prefix=env.prefix, td_id=env.td_id("extend"))
    ring.extend(TensorDict(x=torch.stack([_item(100 + i, 4) for i in range(2)]), batch_size=[2]))
    errors: list[BaseException | None] = []
    for k in range(3):
        rows = TensorDict(x=torch.stack([_item(10 * k + i, 4) for i in range(3)]), batch_size=[3])
        ring.ring_state()  # the handle's connection open again (a timed-out call drops it): the extend is sent
        with _stopped(env):
            errors.append(_outcome(lambda rows=rows: ring.extend(rows, timeout=0.05))[1])
    kinds = [_kind(e) for e in errors]
    slots = [err.retry(timeout=120).indices.tolist() for err in errors if isinstance(err, AmbiguousTimeoutError)]
    rows_ok = all(torch.equal(ring[s]["x"], torch.stack([_item(10 * k + i, 4) for i in range(3)])) for k, s in enumerate(slots))
    ok = kinds == [_AMBIGUOUS] * 3 and ring.write_count == 2 + 9 and rows_ok
    proof = f"write_count {ring.write_count} (2 + 3 x 3 rows: each written once), retries' slots {slots}, rows read back exact: {rows_ok}"
    checks.append(Check("extend(timeout=0.05) sent to a stopped server, 3x", ok, _tally(kinds), proof))

    # extend of big rows with timeout=0.05 on a running server (the adversary's first figure)
    wide = LazyStackedTensorDictStore(count=8, url=env.url, prefix=env.prefix, td_id=env.td_id("wide"))
    wide.extend(TensorDict(x=_item(0, width // 4).unsqueeze(0), batch_size=[1]))
    before = wide.write_count
    kinds, written = [], 0
    for k in range(3):
        rows = TensorDict(x=_item(k + 1, width // 4).unsqueeze(0), batch_size=[1])
        out, err = _outcome(lambda rows=rows: wide.extend(rows, timeout=0.05))
        kinds.append(_kind(err))
        if isinstance(err, AmbiguousTimeoutError):
            out = err.retry(timeout=120)
        if out is not None:
            written += 1
    ok = wide.write_count - before == written == 3 - kinds.count(_PLAIN)
    proof = f"write_count +{wide.write_count - before} for {written} writes answered (retries included), none twice"
    checks.append(Check(f"extend of a {width >> 20} MiB row, timeout=0.05, 3x", ok, _tally(kinds), proof))
    for done in (store, queue, ring, wide):
        done.clear_redis()
    return checks


__all__ = ["case_ambiguous_timeout"]
