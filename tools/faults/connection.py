"""Fault cases of the connection: ``restart``, ``script-flush``, ``connection-drop``."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from tensordict import TensorDict, TensorDictBase, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tools._probes import error_count, raw_snapshot, stray_keys
from tools.faults.base import (
    BULK_TEXT,
    Check,
    Env,
    attempt,
    big_element,
    bulk_store,
    bulk_value,
    compare_snapshots,
    decode,
    describe_exc,
    element,
    elements_of,
    keyerror_check,
    read_seqs,
    upload,
)
from tools.faults.proxy import Cut, CuttingProxy


# ---------------------------------------------------------------------------------------------
# case: restart
# ---------------------------------------------------------------------------------------------
def case_restart(env: Env) -> list[Check]:
    """The server restarts between two calls: the next calls name the lost store; a fresh store works."""
    assert env.server is not None
    n = 8
    checks: list[Check] = []
    td_id = env.td_id("restart")
    store = upload(env, [element(0, i) for i in range(n)], td_id)
    store[1] = element(1, 1)
    seqs, problems = read_seqs(store, element)
    bulk_id = env.td_id("restart-bulk")
    bulk = bulk_store(env, bulk_id)
    bulk_ok = torch.equal(bulk["big"], bulk_value(0))
    checks.append(
        Check(
            "before",
            seqs == [0, 1] + [0] * (n - 2) and not problems and bulk_ok,
            proof=f"{n} elements and a {BULK_TEXT} leaf written and read back",
        )
    )
    pid_before = env.server.pid
    env.server.restart()
    pid_after = env.server.pid
    noscript0 = error_count(env.client, "NOSCRIPT") or 0
    left = raw_snapshot(env.client, env.prefix)
    checks.append(keyerror_check("read", lambda: store[0].to_tensordict(), td_id))
    checks.append(keyerror_check("write", lambda: store.__setitem__(1, element(2, 1)), td_id))
    checks.append(keyerror_check("to_tensordict", store.to_tensordict, td_id))
    checks.append(
        keyerror_check("from_store", lambda: LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix), td_id)
    )
    checks.append(keyerror_check("bulk read", lambda: bulk["big"], bulk_id))
    checks.append(keyerror_check("bulk write", lambda: bulk.set("big", bulk_value(1)), bulk_id))
    noscript = (error_count(env.client, "NOSCRIPT") or 0) - noscript0
    after_calls = raw_snapshot(env.client, env.prefix)
    checks.append(
        Check(
            "nothing left or recreated",
            not left and not after_calls,
            proof=f"server pid {pid_before}->{pid_after}; keys under prefix: {len(left)} after restart, "
            f"{len(after_calls)} after the refused calls; NOSCRIPT answered {noscript}x and reloaded",
        )
    )
    # a fresh store on the restarted server
    fresh = upload(env, [element(0, i, 2) for i in range(n)], env.td_id("fresh"))
    fresh[3] = element(5, 3, 2)
    seqs, problems = read_seqs(fresh, lambda s, i: element(s, i, 2))
    ok = seqs == [0, 0, 0, 5] + [0] * (n - 4) and not problems
    checks.append(
        Check(
            "fresh store",
            ok,
            "works",
            f"fresh store: {n}/{n} elements exact after upload+write" if ok else f"fresh store wrong: {problems[:2]}",
        )
    )
    # the same id created again: the old handle must not touch the new store
    again = upload(env, [element(0, i) for i in range(n)], td_id)
    snap = raw_snapshot(env.client, env.prefix)
    checks.append(
        keyerror_check("old handle on same id created again", lambda: store.__setitem__(0, element(9, 0)), td_id, "created again")
    )
    same, how = compare_snapshots(snap, raw_snapshot(env.client, env.prefix))
    seqs, problems = read_seqs(again, element)
    checks.append(Check("recreated store untouched", same and seqs == [0] * n and not problems, proof=f"same id created again: {how}"))
    return checks


# ---------------------------------------------------------------------------------------------
# case: script-flush
# ---------------------------------------------------------------------------------------------
def _flush_op(store: LazyStackedTensorDictStore, k: int, n: int, expected: list[int], maybe: dict[int, int]) -> None:
    """Op ``k`` of the script-flush stream: a write, an element read or a whole read (checked)."""
    i = k % n
    kind = k % 3
    if kind == 0:
        seq = k + 1
        maybe[i] = seq
        store[i] = element(seq, i)
        expected[i] = seq
        maybe.pop(i, None)
    elif kind == 1:
        seq, problem = decode(store[i].to_tensordict(), i, element)
        if problem or (seq != expected[i] and seq != maybe.get(i)):
            raise AssertionError(problem or f"element {i}: read seq {seq}, expected {expected[i]}")
    else:
        seqs, problems = read_seqs(store, element)
        bad = [j for j, s in enumerate(seqs) if s != expected[j] and s != maybe.get(j)]
        if problems or bad:
            raise AssertionError(problems[:1] or f"elements {bad[:4]} do not hold their last write")


def case_script_flush(env: Env) -> list[Check]:
    """SCRIPT FLUSH between calls, then from a thread while a client streams: every call must succeed."""
    n = 16
    checks: list[Check] = []
    store = upload(env, [element(0, i) for i in range(n)], env.td_id("flush"))
    expected = [0] * n
    maybe: dict[int, int] = {}
    flusher = env.client
    # phase 1: a flush before every call
    calls = 45 if env.opts.quick else 150
    noscript0 = error_count(flusher, "NOSCRIPT") or 0
    errors: Counter[str] = Counter()
    first_error = ""
    for k in range(calls):
        flusher.script_flush()
        _, exc, _ = attempt(lambda k=k: _flush_op(store, k, n, expected, maybe))
        if exc is not None:
            errors[type(exc).__name__] += 1
            first_error = first_error or describe_exc(exc, 80)
    # staged bulk writes (plain SETRANGEs and the script in one pipeline), each after a flush
    bulk = bulk_store(env, env.td_id("flush-bulk"))
    bulk_calls = 4
    bulk_last = 0.0
    for k in range(1, bulk_calls + 1):
        flusher.script_flush()
        _, exc, _ = attempt(lambda k=k: bulk.set("big", bulk_value(1000.0 * k)))
        if exc is not None:
            errors[type(exc).__name__] += 1
            first_error = first_error or describe_exc(exc, 80)
        else:
            bulk_last = 1000.0 * k
    calls += bulk_calls
    noscript = (error_count(flusher, "NOSCRIPT") or 0) - noscript0
    seqs, problems = read_seqs(store, element)
    intact = (
        not problems
        and all(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))
        and torch.equal(bulk["big"], bulk_value(bulk_last))
    )
    checks.append(
        Check(
            "flush between calls",
            not errors and intact and noscript >= calls,
            f"{calls - sum(errors.values())}/{calls} calls succeeded" + (f", {dict(errors)} e.g. {first_error}" if errors else ""),
            f"{calls} flushes ({bulk_calls} before staged {BULK_TEXT} writes), {noscript} NOSCRIPT replies reloaded; "
            f"{sum(s == e for s, e in zip(seqs, expected))}/{n} elements and the {BULK_TEXT} leaf = last write",
        )
    )
    # phase 2: the cache is flushed inside the calls, right before an EVALSHA reaches the server
    checks.extend(_flush_inside_calls(env, store, expected, maybe, calls))
    return checks


def _flush_inside_calls(env: Env, store: LazyStackedTensorDictStore, expected: list[int], maybe: dict[int, int], first: int) -> list[Check]:
    """Stream calls through a :class:`CuttingProxy` that flushes the script cache before EVALSHAs reach the server.

    The flush goes out on another connection and is answered before the proxy
    forwards the end of the EVALSHA's name, so the server runs that EVALSHA with an
    empty cache: the fault lands inside the call (between a call's ``SCRIPT LOAD``
    and its retry, between the staged SETRANGEs of a bulk write and its script) on
    any machine.  Two EVALSHAs out of three are flushed, the third not, so every
    recovery path runs: the reload, the reload then the text (``EVAL``), no fault.
    """
    n = len(expected)
    ops = 150 if env.opts.quick else 600
    flusher = redis.Redis.from_url(env.url)
    sent: Counter[str] = Counter()
    lock = threading.Lock()

    def on_command(name: str) -> None:
        with lock:
            sent[name] += 1
            if name != "EVALSHA" or sent[name] % 3 == 0:
                return
            sent["flushes"] += 1
        flusher.script_flush()

    noscript0 = error_count(env.client, "NOSCRIPT") or 0
    errors: Counter[str] = Counter()
    first_error = ""
    with CuttingProxy(env.url, on_command=on_command) as proxy:
        through = LazyStackedTensorDictStore.from_store(td_id=store.td_id, url=proxy.url, prefix=env.prefix)
        bulk = bulk_store(env, env.td_id("flush-bulk2"))
        bulk_through = LazyStackedTensorDictStore.from_store(td_id=bulk.td_id, url=proxy.url, prefix=env.prefix)
        bulk_last = 0.0
        for k in range(first, first + ops):
            if k % 10 == 9:  # a staged bulk write: SETRANGEs, then the script in the same pipeline
                _, exc, _ = attempt(lambda k=k: bulk_through.set("big", bulk_value(float(k))))
                bulk_last = float(k) if exc is None else bulk_last
            else:
                _, exc, _ = attempt(lambda k=k: _flush_op(through, k, n, expected, maybe))
            if exc is not None:
                errors[type(exc).__name__] += 1
                first_error = first_error or describe_exc(exc, 80)
        through.close()
        bulk_through.close()
    flusher.close()
    noscript = (error_count(env.client, "NOSCRIPT") or 0) - noscript0
    seqs, problems = read_seqs(store, element)
    intact = (
        not problems
        and all(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))
        and torch.equal(bulk["big"], bulk_value(bulk_last))
    )
    failed = sum(errors.values())
    flushes = sent["flushes"]
    return [
        Check(
            "flushes inside calls",
            failed == 0 and flushes > 0 and noscript >= flushes and sent["EVAL"] > 0 and sent["SCRIPT"] > 0,
            f"{ops - failed}/{ops} calls succeeded" + (f", {failed} raised {dict(errors)}, e.g. {first_error}" if failed else ""),
            f"{flushes} flushes, each right before an EVALSHA reached the server; {noscript} NOSCRIPT replies; "
            f"sent {sent['EVALSHA']} EVALSHA, {sent['SCRIPT']} SCRIPT LOAD, {sent['EVAL']} EVAL",
        ),
        Check(
            "data intact",
            intact,
            proof=f"{sum(s == expected[j] or s == maybe.get(j) for j, s in enumerate(seqs))}/{n} elements "
            "and the bulk leaf = last successful write, none torn"
            if intact
            else f"NOT intact: {problems[:2]}",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# case: connection-drop
# ---------------------------------------------------------------------------------------------
def cut_during(proxy: CuttingProxy, call: Callable[[], Any], cut: Cut) -> tuple[str, Any, BaseException | None, str]:
    """Run ``call`` with ``cut`` armed on ``proxy``: the connection is cut at that byte of that command.

    Returns (outcome, result, exception, detail): outcome is ``ConnectionError`` (the
    user saw it), ``retried`` (the cut landed and redis-py reconnected and the call
    succeeded), ``other`` (another exception) or ``missed`` (the call never sent the
    command the cut names: a bug of the case, never a matter of timing).
    """
    accepted0 = proxy.accepted
    proxy.arm(cut)
    try:
        result, exc, _ = attempt(call)
    finally:
        proxy.disarm()
    reconnects = proxy.accepted - accepted0
    if not cut.landed.is_set():
        return "missed", None, exc, f"no {'/'.join(cut.names)} #{cut.nth + 1} was sent"
    detail = cut.where + (f", {reconnects} reconnect" if reconnects else "")
    if isinstance(exc, redis.ConnectionError):
        return "ConnectionError", None, exc, detail
    if exc is not None:
        return "other", None, exc, detail
    return ("retried" if reconnects else "other"), result, None, detail


#: For each path of tdstore, where its connection is cut: (kind, command names, bytes kept) per cut;
#: ``size`` (the payload of the call) is filled in per call.
DROP_CUTS: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    # a Lua script read: mid-request (the server never runs it) and half-way through the reply
    "script read": [("request", ("EVALSHA",), "24"), ("reply", ("EVALSHA",), "size/2")],
    # a MULTI/EXEC of GETRANGEs: inside the transaction's request, half-way through the EXEC reply
    "bulk read": [("request", ("MULTI",), "24"), ("reply", ("EXEC",), "size/2")],
    # staged SETRANGEs then the script: half-way through the staged bytes; before any byte of the script's reply
    "bulk write": [("request", ("SETRANGE",), "size/2"), ("reply", ("EVALSHA",), "0")],
    # one script call carrying the bytes: half-way through it; before any byte of its reply
    "script write": [("request", ("EVALSHA",), "size/2"), ("reply", ("EVALSHA",), "0")],
}


def case_connection_drop(env: Env) -> list[Check]:
    """The connection drops inside a large read or write, on each of tdstore's paths, at a byte chosen in advance.

    The handles reach the server through a :class:`CuttingProxy` that cuts the
    connection mid-request (the server never gets the whole call) or mid-reply (the
    server ran it, the client never gets the whole answer).  Reads:
    ``to_tensordict()`` (a Lua script, since ``tokens`` is heterogeneous) and
    ``store["big"]`` (a MULTI/EXEC of plain GETRANGEs).  Writes: ``store[0:n] = batch``
    (the whole ``big`` leaf: staged SETRANGEs, then the script moves it) and
    ``store[0:n - 1] = batch`` (byte ranges through the script).  Each with redis-py's
    default retry policy and with retries off.  A write cut mid-request must be all
    old unless retried, one cut mid-reply all new; a read must be exact.
    """
    n, width = (32, 65536) if env.opts.quick else (64, 65536)
    checks: list[Check] = []
    td_id = env.td_id("drop")

    def make(s: int, i: int) -> TensorDict:
        return big_element(s, i, width)

    store = upload(env, [make(0, i) for i in range(n)], td_id)
    proxy = CuttingProxy(env.url)
    try:
        handles = {
            "default retry": LazyStackedTensorDictStore.from_store(td_id=td_id, url=proxy.url, prefix=env.prefix),
            "retries off": LazyStackedTensorDictStore.from_store(
                td_id=td_id, url=proxy.url, prefix=env.prefix, retry=Retry(NoBackoff(), 0)
            ),
        }
        current = [0] * n  # the seq each element holds
        seq = 0
        for path, cuts in DROP_CUTS.items():
            for direction, names, keep_rule in cuts:
                for retry, handle in handles.items():
                    label = f"{path}, cut mid-{direction}, {retry}"
                    rows: list[int] = []
                    if path == "script read":
                        call: Callable[[], Any] = handle.to_tensordict
                        size = n * (width * 4 + 64)
                    elif path == "bulk read":
                        call = lambda handle=handle: handle["big"]  # noqa: E731
                        size = n * width * 4
                    else:
                        seq += 7  # same token counts as every earlier seq: the same bytes on the wire
                        rows = list(range(n)) if path == "bulk write" else list(range(n - 1))
                        batch = lazy_stack([make(seq, i) for i in rows], 0)
                        size = len(rows) * width * 4

                        def call(handle: LazyStackedTensorDictStore = handle, batch: TensorDictBase = batch, stop: int = len(rows)) -> None:
                            handle[0:stop] = batch

                    keep = {"24": 24, "0": 0, "size/2": size // 2}[keep_rule]
                    outcome, result, exc, detail = cut_during(proxy, call, Cut(direction, names, keep))
                    checks.append(
                        _drop_check(
                            env,
                            store,
                            handle,
                            make,
                            label,
                            (outcome, result, exc, detail),
                            path,
                            direction,
                            retry,
                            rows,
                            seq,
                            current,
                            size,
                        )
                    )
    finally:
        proxy.close()
    return checks


def _drop_check(
    env: Env,
    store: LazyStackedTensorDictStore,
    handle: LazyStackedTensorDictStore,
    make: Callable[[int, int], TensorDict],
    label: str,
    seen: tuple[str, Any, BaseException | None, str],
    path: str,
    direction: str,
    retry: str,
    rows: list[int],
    seq: int,
    current: list[int],
    size: int,
) -> Check:
    """What the user saw after one cut, and the state of the store: exact, all old or all new as the cut implies."""
    n = len(current)
    outcome, result, exc, detail = seen
    if outcome == "retried":
        saw = "transparent success (redis-py reconnected and retried)"
    elif outcome == "missed":
        saw = f"the cut never landed: {detail}"
    else:
        saw = describe_exc(exc, 70)
    ok = outcome == "ConnectionError" or (outcome == "retried" and retry == "default retry")
    if result is not None and path == "script read":
        ok = ok and all(decode(el, i, make) == (current[i], None) for i, el in enumerate(elements_of(result)))
    elif result is not None and path == "bulk read":
        ok = ok and torch.equal(result, torch.stack([make(current[i], i)["big"] for i in range(n)]))
    # the handle's next call works, and the store is as the cut implies
    nxt, nexc, _ = attempt(lambda: decode(handle[n // 2].to_tensordict(), n // 2, make))
    seqs, problems = read_seqs(store, make)
    if rows:
        written = {seqs[i] for i in rows}
        untouched = all(seqs[i] == current[i] for i in range(n) if i not in rows)
        all_new, all_old = written == {seq}, all(seqs[i] == current[i] for i in rows)
        # cut mid-request: the server never got the whole call, so only a retry applies it;
        # cut mid-reply: the server ran it, so it is applied whatever the client saw
        must_be_new = direction == "reply" or outcome == "retried"
        consistent = not problems and untouched and (all_new if must_be_new else all_old)
        state = "all new" if all_new else "all old" if all_old else f"MIXED {sorted(written, key=str)}"
        if not consistent:
            state += f" (expected all {'new' if must_be_new else 'old'})"
    else:
        consistent = not problems and seqs == current
        state = "exact" if consistent else f"WRONG {problems[:1]}"
    if not problems and None not in seqs:
        current[:] = [int(q) for q in seqs]  # type: ignore[arg-type]
    strays = stray_keys(env.client, env.prefix)
    stray_text = f"; {len(strays)} staging key left, expiring in {max(t for _, t in strays) / 1000:.0f} s" if strays else ""
    next_ok = nexc is None and nxt is not None and nxt[1] is None
    ok = ok and next_ok and consistent and all(t > 0 for _, t in strays)
    nxt_text = "next call OK" if next_ok else f"next call: {describe_exc(nexc, 60)}"
    for key, _ in strays:  # do not let a staging key of this call count for the next
        env.client.delete(key)
    return Check(label, ok, saw, f"{path} of {size / 2**20:.0f} MB, {detail}; {nxt_text}; {n}/{n} elements {state}{stray_text}")
