"""Fault cases of other processes: ``sigkill-writer``, ``store-deleted``, ``store-recreated``."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tools._probes import raw_snapshot
from tools.faults.base import (
    BULK_BYTES,
    MAX_WRITER_OPS,
    ROUND_SEQ,
    Check,
    Env,
    attempt,
    compare_snapshots,
    describe_exc,
    element,
    keyerror_check,
    read_seqs,
    upload,
)
from tools.faults.proxy import Cut, CuttingProxy


# ---------------------------------------------------------------------------------------------
# case: sigkill-writer
# ---------------------------------------------------------------------------------------------
def _writer_main(url: str, prefix: str, td_id: str, n: int, scale: int, base: int, started: Any, done: Any) -> None:
    """Child process: stream ``store[k % n] = element(base + k // n + 1, k % n)`` until killed.

    ``started`` holds the op about to be sent, ``done`` the last op acknowledged.
    """
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
    for k in range(MAX_WRITER_OPS):
        i = k % n
        td = element(base + k // n + 1, i, scale)
        started.value = k
        store[i] = td
        done.value = k
    os._exit(0)


def allowed_seqs(current: list[int], n: int, base: int, started: int, done: int) -> list[set[int]]:
    """Per element, the seqs it may hold after a writer was killed with ``started``/``done`` ops.

    Every op before ``started`` was acknowledged; op ``started`` may or may not have
    been applied (unless ``done`` says it was).
    """
    allowed: list[set[int]] = []
    for j in range(n):
        ops = [k for k in range(j, started + 1, n)] if started >= 0 else []
        if not ops:
            allowed.append({current[j]})
            continue
        last = ops[-1]
        new = base + last // n + 1
        if last == started and done < started:
            old = base + ops[-2] // n + 1 if len(ops) > 1 else current[j]
            allowed.append({old, new})
        else:
            allowed.append({new})
    return allowed


#: Where a writer is killed, round after round: before the first byte of its call reaches the
#: server, with half of it there, or once the server has run it but before any byte of the reply.
KILL_POINTS = ("before the call", "mid-request", "after the server ran it")
#: Bytes of the held EVALSHA forwarded in the ``mid-request`` round (an element write is longer).
MID_REQUEST_BYTES = 100


def kill_cut(point: str, nth: int) -> Cut:
    """The proxy hold for a kill at ``point`` of the writer's ``nth`` EVALSHA (0-based)."""
    if point == "before the call":
        return Cut("request", ("EVALSHA",), 0, nth, hold=True)
    if point == "mid-request":
        return Cut("request", ("EVALSHA",), MID_REQUEST_BYTES, nth, hold=True)
    return Cut("reply", ("EVALSHA",), 0, nth, hold=True)


def _kill_round(
    store: LazyStackedTensorDictStore,
    make: Callable[[int, int], TensorDict],
    current: list[int],
    kill: tuple[int, str, int, Cut],
    started: Any,
    done: Any,
    exitcode: int | None,
) -> tuple[Check, list[int]]:
    """Round ``r``'s check once its writer, killed at ``point`` of a call, is gone: every element holds its last
    acknowledged write, the one in flight old or new as the kill point implies; and the seqs the elements now hold."""
    r, point, base, cut = kill
    n = len(current)
    s, d = int(started.value), int(done.value)
    allowed = allowed_seqs(current, n, base, s, d)
    j = s % n
    old, new = (min(allowed[j]), max(allowed[j])) if len(allowed[j]) == 2 else (None, None)
    if old is not None:  # the element in flight: old unless the server ran the call
        allowed[j] = {new if point == "after the server ran it" else old}
    seqs, problems = read_seqs(store, make)
    bad = [i for i, q in enumerate(seqs) if q not in allowed[i]]
    in_flight = f"element {j} {'new' if seqs[j] == new else 'old' if seqs[j] == old else seqs[j]}"
    ok = not problems and not bad and old is not None and exitcode == -signal.SIGKILL
    detail = problems[:1] or [f"element {i} holds seq {seqs[i]}, allowed {sorted(allowed[i])}" for i in bad[:2]]
    if old is None:
        detail.append(f"no call in flight (started op {s}, acknowledged op {d})")
    check = Check(
        f"round {r}: {point}",
        ok,
        proof=f"killed after {d + 1} writes, {cut.where}; {in_flight}; {n - len(bad) - len(problems)}/{n} as expected"
        + (f": {detail}" if detail else ""),
    )
    return check, [q if q is not None else -1 for q in seqs]


def case_sigkill_writer(env: Env) -> list[Check]:
    """A writer process is SIGKILLed inside a call, a few times: every element old or new, as the kill point implies.

    The writer reaches the server through a :class:`CuttingProxy` that holds its
    connection at a chosen EVALSHA (a seeded random op): before any byte of it is
    forwarded, with its first 100 bytes forwarded (the server holds half a call), or
    with the whole call run by the server and its reply held back.  The writer is
    killed once the proxy holds it, so the kill lands inside that call on any
    machine; the element it was writing must then be old, old, and new respectively.
    """
    n, scale = 16, 8
    rounds = env.opts.kill_rounds or (3 if env.opts.quick else 6)

    def make(s: int, i: int) -> TensorDict:
        return element(s, i, scale)

    checks: list[Check] = []
    td_id = env.td_id("sigkill")
    store = upload(env, [make(0, i) for i in range(n)], td_id)
    ctx = mp.get_context(env.opts.start_method)
    current = [0] * n
    exits: list[int | None] = []
    with CuttingProxy(env.url) as proxy:
        for r in range(1, rounds + 1):
            base = r * ROUND_SEQ
            point = KILL_POINTS[(r - 1) % len(KILL_POINTS)]
            nth = env.rng.randrange(n // 2, 4 * n)
            cut = proxy.arm(kill_cut(point, nth))
            started, done = ctx.Value("q", -1, lock=False), ctx.Value("q", -1, lock=False)
            proc = ctx.Process(target=_writer_main, args=(proxy.url, env.prefix, td_id, n, scale, base, started, done), daemon=True)
            proc.start()
            deadline = time.monotonic() + 120  # a bound against a hang, never reached by a working writer
            while not cut.landed.wait(0.2) and proc.is_alive() and time.monotonic() < deadline:
                pass  # (the wait is for the hold, not for a moment: a writer that died ends it sooner)
            held = cut.landed.is_set()
            proxy.disarm()
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            exits.append(proc.exitcode)
            if not held:
                checks.append(
                    Check(
                        f"round {r}",
                        False,
                        f"the writer never sent EVALSHA #{nth + 1} (exit code {proc.exitcode}, {done.value + 1} writes)",
                    )
                )
                break
            check, current = _kill_round(store, make, current, (r, point, base, cut), started, done, proc.exitcode)
            checks.append(check)
    # the store keeps working: a write and a read through a fresh handle, then a whole check
    fresh = LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix)
    _, exc, _ = attempt(lambda: fresh.__setitem__(0, make(7, 0)))
    seqs, problems = read_seqs(store, make)
    works = exc is None and seqs[0] == 7 and not problems
    codes = Counter("SIGKILL" if c == -signal.SIGKILL else str(c) for c in exits)
    checks.append(
        Check(
            "store works after",
            works,
            f"writer exit codes {dict(codes)}; parent saw no error" if exc is None else describe_exc(exc, 70),
            f"write+read after the kills OK, {n}/{n} elements consistent"
            if works
            else f"store broken: {describe_exc(exc, 60)} {problems[:1]}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# cases: store-deleted, store-recreated
# ---------------------------------------------------------------------------------------------
def _other_process(url: str, prefix: str, td_id: str, recreate: bool, result: Any) -> None:
    """Child process: open the store, delete it, and (``recreate``) create it again with float64 ``obs``."""
    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
    result.value = store.clear_redis()
    if recreate:
        new = lazy_stack([element(0, i, obs_dtype=torch.float64) for i in range(store.batch_size[0])], 0)
        LazyStackedTensorDictStore.from_lazy_stack(new, url=url, prefix=prefix, td_id=td_id)
    os._exit(0)


def _run_other(env: Env, td_id: str, recreate: bool) -> tuple[int | None, int]:
    """Run :func:`_other_process`; return (its exit code, keys it deleted)."""
    ctx = mp.get_context(env.opts.start_method)
    result = ctx.Value("q", -1, lock=False)
    proc = ctx.Process(target=_other_process, args=(env.url, env.prefix, td_id, recreate, result), daemon=True)
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    return proc.exitcode, int(result.value)


def _big_width(n: int) -> int:
    """Float32 per element of a ``big`` leaf on tdstore's bulk read and write paths."""
    return -(-BULK_BYTES // (4 * n))


def _refused_calls(store: LazyStackedTensorDictStore, n: int) -> list[tuple[str, Callable[[], Any]]]:
    """Reads and writes a handle on a deleted (or recreated) store must refuse (``big``: the bulk paths)."""
    width = _big_width(n)
    return [
        ("store['big'] (bulk read)", lambda: store["big"]),
        ("store.set('big') (staged write)", lambda: store.set("big", torch.ones(n, width))),
        ("store[0]", lambda: store[0].to_tensordict()),
        ("store[0]['tokens']", lambda: store[0]["tokens"]),
        ("store[2:5]", lambda: store[2:5]),
        ("store['obs']", lambda: store["obs"]),
        ("store[1] = td", lambda: store.__setitem__(1, element(1, 1))),
        ("store.set(new key)", lambda: store.set("extra", torch.zeros(n, 2))),
        ("store.zero_()", store.zero_),
    ]


def case_store_deleted(env: Env) -> list[Check]:
    """Another process deletes the store while this handle holds it."""
    n = 8
    td_id = env.td_id("deleted")
    store = upload(env, [element(0, i) for i in range(n)], td_id)
    store.set("big", torch.zeros(n, _big_width(n)))  # a leaf on tdstore's bulk paths
    store[1].to_tensordict()  # the handle has used the store
    code, deleted = _run_other(env, td_id, recreate=False)
    checks = [Check("other process deleted it", code == 0 and deleted > 0, proof=f"other process (exit {code}) deleted {deleted} keys")]
    results = [keyerror_check(label, fn, td_id) for label, fn in _refused_calls(store, n)]
    left = raw_snapshot(env.client, env.prefix)
    ok = all(c.ok for c in results) and not left
    saws = Counter(c.saw for c in results)
    saw = "; ".join(f"{k} (x{v})" if v > 1 else k for k, v in saws.items())
    checks.append(
        Check(
            "reads and writes refused",
            ok,
            saw,
            f"{sum(c.ok for c in results)}/{len(results)} reads/writes raised KeyError naming the td_id; "
            f"{len(left)} keys under the prefix after",
        )
    )
    checks.extend(c for c in results if not c.ok)
    return checks


def case_store_recreated(env: Env) -> list[Check]:
    """Another process deletes the store and creates it again (same td_id, obs float64 instead of float32)."""
    n = 8
    td_id = env.td_id("recreated")
    store = upload(env, [element(0, i) for i in range(n)], td_id)
    store.set("big", torch.zeros(n, _big_width(n)))  # a leaf on tdstore's bulk paths
    store[1].to_tensordict()
    code, deleted = _run_other(env, td_id, recreate=True)
    checks = [
        Check(
            "other process recreated it",
            code == 0 and deleted > 0,
            proof=f"other process (exit {code}) deleted {deleted} keys and uploaded float64 obs",
        )
    ]
    before = raw_snapshot(env.client, env.prefix)
    results = [keyerror_check(label, fn, td_id, "created again") for label, fn in _refused_calls(store, n)]
    same, how = compare_snapshots(before, raw_snapshot(env.client, env.prefix))
    new = LazyStackedTensorDictStore.from_store(td_id=td_id, url=env.url, prefix=env.prefix)
    seqs, problems = read_seqs(new, lambda s, i: element(s, i, obs_dtype=torch.float64))
    new_ok = seqs == [0] * n and not problems and new["obs"].dtype == torch.float64
    saws = Counter(c.saw for c in results)
    saw = "; ".join(f"{k} (x{v})" if v > 1 else k for k, v in saws.items())
    ok = all(c.ok for c in results) and same and new_ok
    checks.append(
        Check(
            "old handle refused",
            ok,
            saw,
            f"{sum(c.ok for c in results)}/{len(results)} reads/writes raised KeyError 'created again'; "
            f"new store {how}; new handle reads {n}/{n} float64 elements exact",
        )
    )
    checks.extend(c for c in results if not c.ok)
    return checks
