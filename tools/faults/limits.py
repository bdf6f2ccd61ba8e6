"""Fault cases of server limits: ``maxmemory``, ``proto-max-bulk-len``, ``client-query-buffer-limit``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tools._probes import raw_snapshot
from tools.faults.base import (
    BULK_BYTES,
    BULK_TEXT,
    MAXMEMORY,
    SAME_SHAPE_STEP,
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
    is_clear_size_error,
    is_oom,
    read_seqs,
    td_difference,
    upload,
    wide_element,
)

# ---------------------------------------------------------------------------------------------
# case: maxmemory
# ---------------------------------------------------------------------------------------------
_FILL_SCRIPT = "redis.call('SET', KEYS[1], string.rep('x', tonumber(ARGV[1]))) return 1"


def fill_memory(client: redis.Redis, prefix: str, limit: int, over: int = 6 << 20, keys: list[str] | None = None) -> list[str]:
    """Fill the server with keys under ``prefix`` until ``used_memory`` exceeds ``limit`` by about ``over``.

    Writes go through a script: a script that starts below the limit may write past
    it, so the server ends up clearly (not marginally) over its limit, even after it
    shrinks the query buffers of idle clients (megabytes after a bulk upload).
    Returns ``keys`` with the filler keys added; does nothing when already over.
    """
    keys = [] if keys is None else keys
    for k in range(len(keys), len(keys) + 1000):
        used = int(client.info("memory")["used_memory"])
        if used > limit:
            break
        room = limit - used
        size = 1 << 20 if room > 3 * (1 << 20) else room + over
        key = f"{prefix}:{k}"
        try:
            client.eval(_FILL_SCRIPT, 1, key, size)
        except redis.exceptions.OutOfMemoryError:
            break
        keys.append(key)
    return keys


def _upload_too_large(env: Env) -> Check:
    """An upload larger than maxmemory: a clear error, nothing left under its prefix."""
    width = 65536
    up_prefix = f"{env.prefix}-upload"
    count = 120  # 120 x 256 KiB = 30 MiB
    used0 = int(env.client.info("memory")["used_memory"])
    _, exc, secs = attempt(
        lambda: upload(env, [big_element(0, i, width) for i in range(count)], env.td_id("toolarge"), prefix=up_prefix, chunk_bytes=2 << 20)
    )
    mem = env.client.info("memory")
    left = raw_snapshot(env.client, up_prefix)
    return Check(
        "upload of 30 MB",
        is_oom(exc) and not left,
        describe_exc(exc, 90) + f" ({secs:.1f} s)",
        f"upload: peak {int(mem['used_memory_peak']) / 2**20:.1f} MB, {len(left)} keys left under its prefix, "
        f"used {used0 / 2**20:.1f}->{int(mem['used_memory']) / 2**20:.1f} MB",
    )


def _ensure_full(env: Env, fillers: list[str], lowest: list[float]) -> bool:
    """Put the server a few MB past maxmemory; True when a probe SET is then refused.

    When it is only marginally over (idle clients' buffers shrink by megabytes),
    filler keys are dropped until it is under, and one script write puts it well over.
    """
    for _ in range(len(fillers) + 1):
        used = int(env.client.info("memory")["used_memory"])
        if used < MAXMEMORY or used > MAXMEMORY + (2 << 20) or not fillers:
            break
        env.client.delete(fillers.pop())
    fill_memory(env.client, f"{env.prefix}-filler", MAXMEMORY, keys=fillers)
    lowest[0] = min(lowest[0], int(env.client.info("memory")["used_memory"]) / 2**20)
    _, probe, _ = attempt(lambda: env.client.set(f"{env.prefix}-probe", b"x"))
    return is_oom(probe)


def _after_freeing(
    env: Env, store: LazyStackedTensorDictStore, make: Callable[[int, int], TensorDict], fillers: list[str], n: int
) -> Check:
    """Memory freed: writes work again (``n`` elements)."""
    if fillers:
        env.client.delete(*fillers)
    _, exc1, _ = attempt(lambda: store.__setitem__(0, make(SAME_SHAPE_STEP, 0)))
    _, exc2, _ = attempt(lambda: store.__setitem__(1, make(1, 1)))
    seqs, problems = read_seqs(store, make)
    ok = exc1 is None and exc2 is None and seqs[:2] == [SAME_SHAPE_STEP, 1] and not problems
    return Check(
        "after freeing memory",
        ok,
        "writes work" if exc1 is None and exc2 is None else describe_exc(exc1 or exc2, 70),
        f"fillers deleted; 2 writes OK, {n}/{n} elements consistent" if ok else f"after freeing: {problems[:1]} {seqs[:2]}",
    )


def case_maxmemory(env: Env) -> list[Check]:
    """A 20 MB server: an upload too large for it, and writes while it is full."""
    assert env.server is not None
    checks = [_upload_too_large(env)]
    # writes while memory is full
    n, scale = 16, 4

    def make(s: int, i: int) -> TensorDict:
        return element(s, i, scale)

    store = upload(env, [make(0, i) for i in range(n)], env.td_id("full"))
    bulk = bulk_store(env, env.td_id("full-bulk"))
    before = raw_snapshot(env.client, env.prefix)
    fillers: list[str] = []
    lowest = [float("inf")]

    def ensure_full() -> bool:
        return _ensure_full(env, fillers, lowest)

    full = [ensure_full()]
    attempts: list[tuple[str, Callable[[], Any]]] = [
        ("same-size element write", lambda: store.__setitem__(0, make(SAME_SHAPE_STEP, 0))),
        ("shape-changing element write", lambda: store.__setitem__(1, make(1, 1))),
        ("slice write", lambda: store.__setitem__(slice(2, 5), lazy_stack([make(1, j) for j in range(2, 5)], 0))),
        ("new key", lambda: store.set("extra", torch.ones(n, 3))),
        ("fill_", lambda: store.fill_("obs", 5.0)),
        (f"{BULK_TEXT} leaf write (staged)", lambda: bulk.set("big", bulk_value(1))),
    ]
    refused: list[str] = []
    for label, fn in attempts:
        full.append(ensure_full())
        _, exc, _ = attempt(fn)
        if is_oom(exc):
            refused.append(label)
        checks.append(Check(label, is_oom(exc), describe_exc(exc, 70)))
    after = raw_snapshot(env.client, env.prefix)
    same, how = compare_snapshots(before, after)
    seqs, problems = read_seqs(store, make)
    ok = same and seqs == [0] * n and not problems
    checks.append(
        Check("store unchanged", ok, proof=f"{len(refused)}/{len(attempts)} writes refused; {how}; {n}/{n} elements hold their old value")
    )
    # reads need no memory: they must keep working on a full server
    full.append(ensure_full())
    _, exc1, _ = attempt(lambda: read_seqs(store, make))
    full.append(ensure_full())
    got, exc2, _ = attempt(lambda: bulk["big"])
    checks.insert(
        1,
        Check(
            "memory full",
            all(full),
            proof=f"{len(fillers)} filler keys; before each of {len(full)} calls: "
            f"used >= {lowest[0]:.1f} MB > 20 MB and a probe SET refused",
        ),
    )
    checks.append(Check("script read while full", exc1 is None, "works" if exc1 is None else describe_exc(exc1, 70)))
    checks.append(
        Check(
            f"{BULK_TEXT} read while full",
            exc2 is None and torch.equal(got, bulk_value(0)),
            "works" if exc2 is None else describe_exc(exc2, 90),
        )
    )
    checks.append(_after_freeing(env, store, make, fillers, n))
    return checks


# ---------------------------------------------------------------------------------------------
# case: proto-max-bulk-len
# ---------------------------------------------------------------------------------------------
def case_proto_max_bulk_len(env: Env) -> list[Check]:
    """A server whose largest string is 1 MB: oversized values fail clearly and write nothing."""
    checks: list[Check] = []
    n, n_tok = 8, 15_000  # a tokens blob of 8 x 120 KB = 960 KB, just under the limit
    store = upload(env, [wide_element(0, i, n_tok) for i in range(n)], env.td_id("bulk"))

    def make(s: int, i: int) -> TensorDict:
        return wide_element(s, i, n_tok)

    def nothing_written(label: str, fn: Callable[[], Any]) -> Check:
        before = raw_snapshot(env.client, env.prefix)
        _, exc, secs = attempt(fn)
        same, how = compare_snapshots(before, raw_snapshot(env.client, env.prefix))
        return Check(label, is_clear_size_error(exc) and same, describe_exc(exc, 70) + f" ({secs:.1f} s)", f"{label}: {how}")

    checks.append(nothing_written("set a 2 MB leaf", lambda: store.set("big", torch.zeros(n, 65536))))
    staged = -(-(BULK_BYTES + (1 << 20)) // (4 * n))  # float32 per element: a leaf past tdstore's bulk-write size
    checks.append(
        nothing_written(f"set a {4 * n * staged / 2**20:.0f} MB leaf (staged)", lambda: store.set("bigger", torch.zeros(n, staged)))
    )
    checks.append(nothing_written("element write growing the blob past 1 MB", lambda: store.__setitem__(0, wide_element(1, 0, 50_000))))
    if not env.opts.quick:  # the same root cause as the 2 MB leaf: one argument larger than the limit
        checks.append(nothing_written("element write of a 2 MB element", lambda: store.__setitem__(1, wide_element(1, 1, 262_144))))
    # a leaf larger than one string is cut into segments that each fit: it uploads and reads back
    sizes = [("upload of a 1.3 MB leaf, 256 KiB chunks", 256 << 10)]
    if not env.opts.quick:
        sizes.append(("upload of a 1.3 MB leaf, default chunks", 64 << 20))
    for label, chunk in sizes:
        prefix = f"{env.prefix}-up{chunk}"
        elements = [wide_element(0, i, 20_000) for i in range(8)]
        big, exc, secs = attempt(
            lambda prefix=prefix, chunk=chunk, elements=elements: upload(
                env, elements, env.td_id("bulkup"), prefix=prefix, chunk_bytes=chunk
            )
        )
        same = big is not None and all(torch.equal(big[i]["tokens"], el["tokens"]) for i, el in enumerate(elements))
        segs = big._engine.header.segments.n if big is not None else 0
        checks.append(
            Check(
                label,
                exc is None and same and segs > 1,
                describe_exc(exc, 70) + f" ({secs:.1f} s)",
                f"{label}: {segs} segments, read back {'equal' if same else 'DIFFERENT'}",
            )
        )
    # one element larger than a string cannot be cut: refused, nothing left behind
    prefix = f"{env.prefix}-up-one"
    label = "upload of one 1.3 MB element"
    _, exc, secs = attempt(lambda: upload(env, [wide_element(0, 0, 170_000)], env.td_id("bulkone"), prefix=prefix))
    left = raw_snapshot(env.client, prefix)
    checks.append(
        Check(label, is_clear_size_error(exc) and not left, describe_exc(exc, 70) + f" ({secs:.1f} s)", f"{label}: {len(left)} keys left")
    )
    # the store still works and holds its old content
    seqs, problems = read_seqs(store, make)
    intact = seqs == [0] * n and not problems
    _, exc, _ = attempt(lambda: store.__setitem__(2, wide_element(3, 2, n_tok)))
    got, problem = decode(store[2].to_tensordict(), 2, lambda s, i: wide_element(s, i, n_tok))
    ok = intact and exc is None and got == 3 and problem is None
    checks.append(
        Check(
            "store works after",
            ok,
            "" if exc is None else describe_exc(exc, 60),
            f"{n}/{n} elements held their old value, then a write+read OK"
            if ok
            else f"store wrong: {problems[:1]} {describe_exc(exc, 50)}",
        )
    )
    return checks


# ---------------------------------------------------------------------------------------------
# case: client-query-buffer-limit
# ---------------------------------------------------------------------------------------------
QUERY_BUFFER_ARGS = ("--client-query-buffer-limit", "1mb")


def query_buffer_closes(env: Env) -> int:
    """Clients the server has closed for passing ``client-query-buffer-limit`` (lines of its log)."""
    assert env.server is not None and env.server.log_path is not None
    return Path(env.server.log_path).read_text(errors="replace").count("max query buffer length")


def names_query_buffer_limit(exc: BaseException | None) -> bool:
    """A clear error: not a dropped connection, and it names the server setting."""
    return exc is not None and not isinstance(exc, redis.ConnectionError) and "client-query-buffer-limit" in str(exc)


def _query_buffer_outcome(env: Env, label: str, fn: Callable[[], Any], verify: Callable[[Any], str | None], prefix: str) -> Check:
    """``fn`` succeeds and ``verify`` finds its result right, or it fails naming the limit having written nothing under
    ``prefix``; either way the server closes no client for its query buffer."""
    before = raw_snapshot(env.client, prefix)
    closes0 = query_buffer_closes(env)
    result, exc, secs = attempt(fn)
    closes = query_buffer_closes(env) - closes0
    if exc is None:
        problem = verify(result)
        ok, state = problem is None, "read back equal" if problem is None else f"read back WRONG: {problem}"
    else:
        same, how = compare_snapshots(before, raw_snapshot(env.client, prefix))
        ok, state = names_query_buffer_limit(exc) and same, how
    ok = ok and closes == 0
    return Check(
        label,
        ok,
        describe_exc(exc, 90) + f" ({secs:.1f} s)",
        f"{label}: {state}; the server closed {closes} client(s) for its query buffer",
    )


def _query_buffer_uploads(env: Env, elements: list[TensorDict], n: int, width: int) -> list[Check]:
    """Uploads: a lazy stack and a dense tensordict of 3-4 MiB."""
    lazy_prefix = f"{env.prefix}-lazy"

    def lazy_equal(store: LazyStackedTensorDictStore) -> str | None:
        return next((d for i, el in enumerate(elements_of(store.to_tensordict())) if (d := td_difference(el, elements[i]))), None)

    checks = [
        _query_buffer_outcome(
            env,
            f"upload of {n * width * 4 / 2**20:.0f} MiB (lazy)",
            lambda: upload(env, elements, env.td_id("qb-lazy"), prefix=lazy_prefix),
            lazy_equal,
            lazy_prefix,
        )
    ]
    dense_prefix = f"{env.prefix}-dense"
    dense = TensorDict({"x": torch.arange(16 * width, dtype=torch.float32).reshape(16, width), "y": torch.arange(16)}, batch_size=[16])
    checks.append(
        _query_buffer_outcome(
            env,
            f"upload of {16 * width * 4 / 2**20:.0f} MiB (dense)",
            lambda: TensorDictStore.from_tensordict(dense, url=env.url, prefix=dense_prefix, td_id=env.td_id("qb-dense")),
            lambda store: td_difference(store.to_tensordict(), dense),
            dense_prefix,
        )
    )
    return checks


def _query_buffer_slice_write(env: Env, elements: list[TensorDict], n: int, width: int) -> Check:
    """A slice write past 1 MB on a store uploaded in small chunks."""
    grow_prefix = f"{env.prefix}-chunked"
    chunked, exc, _ = attempt(lambda: upload(env, elements, env.td_id("qb-chunked"), prefix=grow_prefix, chunk_bytes=256 << 10))
    if chunked is None:
        return Check("upload in 256 KiB chunks (for the slice write)", False, describe_exc(exc, 90))
    rewrite = [big_element(7, i, width) for i in range(n)]

    def rewritten(_: Any) -> str | None:
        return next((d for i, el in enumerate(elements_of(chunked.to_tensordict())) if (d := td_difference(el, rewrite[i]))), None)

    return _query_buffer_outcome(
        env,
        f"slice write of {n * width * 4 / 2**20:.0f} MiB",
        lambda: chunked.__setitem__(slice(0, n), lazy_stack(rewrite, 0)),
        rewritten,
        grow_prefix,
    )


def case_query_buffer_limit(env: Env) -> list[Check]:
    """A server that accepts at most 1 MB of unprocessed request per client: uploads and writes past it.

    Each call must either succeed with every byte read back equal, or fail with an
    error naming ``client-query-buffer-limit`` having written nothing; and the
    server must close no client for its query buffer (the handle never sent more
    than the server takes: a clear error is raised before sending, so it is fast
    without a clock to say so).  A ``ConnectionError`` (today: "Broken pipe" after
    seconds of retries) fails the check.
    """
    n, width = 12, 65536  # 12 elements of 256 KiB: 3 MiB in one leaf
    # (a) uploads: a lazy stack and a dense tensordict of 3-4 MiB
    elements = [big_element(0, i, width) for i in range(n)]
    checks = _query_buffer_uploads(env, elements, n, width)
    # (b) writes past 1 MB: a new leaf on a small store; a slice write on a store uploaded in small chunks
    small = upload(env, [big_element(0, i, 256) for i in range(n)], env.td_id("qb-small"))
    new_leaf = torch.arange(n * width, dtype=torch.float32).reshape(n, width)
    checks.append(
        _query_buffer_outcome(
            env,
            f"set a new {n * width * 4 / 2**20:.0f} MiB leaf",
            lambda: small.set("new", new_leaf),
            lambda _: None if torch.equal(small["new"], new_leaf) else "leaf 'new' differs",
            env.prefix,
        )
    )
    with contextlib.suppress(KeyError):
        small.del_("new")
    checks.append(_query_buffer_slice_write(env, elements, n, width))
    # (c) the stores still work
    seqs, problems = read_seqs(small, lambda s, i: big_element(s, i, 256))
    _, exc, _ = attempt(lambda: small.__setitem__(1, big_element(5, 1, 256)))
    ok = seqs == [0] * n and not problems and exc is None and small[1]["stamp"].tolist() == [5, 1]
    checks.append(
        Check(
            "store works after",
            ok,
            "" if exc is None else describe_exc(exc, 60),
            f"{n}/{n} elements held their value, then a write+read OK" if ok else f"store wrong: {problems[:1]} {describe_exc(exc, 50)}",
        )
    )
    return checks
