"""Fault case ``eviction``: a full ``allkeys-lru`` server evicts keys of live stores."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from tdstore import TensorDictStore
from tools._probes import raw_snapshot
from tools.faults.base import Check, Env, attempt, describe_exc, elements_of, short, td_difference, upload

# ---------------------------------------------------------------------------------------------
# case: eviction
# ---------------------------------------------------------------------------------------------
EVICTION_ARGS = ("--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru")
#: Stores of each kind the eviction case uploads, and elements (rows) per store.
EVICTION_STORES, EVICTION_ROWS = 5, 32
#: Upper bound of the filler keys written to make the server evict (it evicts after about 220).
EVICTION_FILLERS = 2000
#: How the outcome of one call on an evicted-into store is counted, best first.
EVICTION_OUTCOMES = ("intact", "gone", "damaged", "other error", "silently wrong")


def mixed_element(seq: int, i: int) -> TensorDict:
    """An element with row-block leaves (``obs``, ``act``, ``done``), a leaf of its own (``big``, 6 KiB)
    and heterogeneous leaves (``tokens``, ``("nested", "ragged")``); no value is zero."""
    g = torch.Generator().manual_seed(seq * 100_003 + i)
    return TensorDict(
        {
            "obs": torch.rand(16, generator=g) + 1,
            "act": torch.randint(1, 100, (4,), generator=g),
            "done": torch.tensor([True]),
            "big": torch.rand(1536, generator=g) + 1,
            "tokens": torch.randint(1, 1000, (1 + (seq * 13 + i * 7) % 97,), generator=g),
            "nested": {"ragged": (torch.rand(1 + (seq + i) % 5, 3, generator=g) + 1).half()},
        },
        batch_size=[],
    )


def ragged_element(seq: int, i: int) -> TensorDict:
    """An element whose leaves are all heterogeneous (data, offset and shape keys only); no value is zero."""
    g = torch.Generator().manual_seed(seq * 100_019 + i)
    return TensorDict(
        {
            "tokens": torch.randint(1, 1000, (1 + (seq * 5 + i * 3) % 300,), generator=g),
            "ragged": torch.rand(1 + (seq + i) % 7, 2, generator=g) + 1,
        },
        batch_size=[],
    )


def dense_rows(seq: int, rows: int) -> TensorDict:
    """``rows`` rows of a dense store; no value is zero."""
    g = torch.Generator().manual_seed(seq * 100_043 + rows)
    return TensorDict(
        {"obs": torch.rand(rows, 512, generator=g) + 1, "act": torch.randint(1, 100, (rows, 4), generator=g)}, batch_size=[rows]
    )


def damaged_error_type() -> type[BaseException] | None:
    """``tdstore.StoreDamagedError`` once tdstore has it (issue #15)."""
    import tdstore

    return getattr(tdstore, "StoreDamagedError", None)


@dataclass
class EvictedStore:
    """One store of the eviction case: its handle, a local copy of what it must hold, its keys, what each call saw."""

    kind: str
    handle: Any
    local: Any  # a list of elements (lazy) or a TensorDict (dense)
    keys: list[bytes] = field(default_factory=list)
    lost: list[bytes] = field(default_factory=list)
    header_lost: bool = False
    seen: Counter[str] = field(default_factory=Counter)
    examples: list[tuple[str, str]] = field(default_factory=list)  # (outcome, the call and what it saw)

    @property
    def worst(self) -> str:
        return max(self.seen, key=EVICTION_OUTCOMES.index, default="intact")

    def example(self) -> str:
        """One call of the worst outcome this store saw, and what it returned or raised."""
        text = next((text for outcome, text in self.examples if outcome == self.worst), "")
        return short(re.sub(r"Error running script \(call to f_[0-9a-f]+\): ", "", text), 300)


def _store_keys(client: redis.Redis, prefix: str, td_id: str) -> list[bytes]:
    """Every key of one store (header, data, offset, shape and row-block keys of all its segments)."""
    tags = (f":{{{td_id}}}".encode(), f":{{{td_id}%s".encode())
    return sorted(k for k in raw_snapshot(client, prefix) if any(t in k for t in tags))


def _key_label(key: bytes) -> str:
    """``segment 3 d:5`` for a store key (``header`` for its header)."""
    text = key.decode(errors="replace")
    seg = re.search(r"%s(\d+)", text)
    kind = text.rsplit("}", 1)[-1].lstrip(":")
    return "header" if kind == "m" else f"segment {seg.group(1) if seg else 0} {kind}"


def _classify_error(env: Env, st: EvictedStore, exc: BaseException) -> str:
    """``damaged`` (the one clear error), ``gone`` (a KeyError naming a store whose header was evicted) or ``other error``."""
    damaged = damaged_error_type()
    text = str(exc).lower()
    if (damaged is not None and isinstance(exc, damaged)) or (isinstance(exc, KeyError) and ("lost" in text or "damaged" in text)):
        return "damaged"
    if isinstance(exc, KeyError) and st.handle.td_id.lower() in text and not env.client.exists(st.handle._engine.keys.meta):
        return "gone"
    return "other error"


def _evicted_call(env: Env, st: EvictedStore, label: str, fn: Callable[[], Any], check: Callable[[Any], str | None] | None) -> bool:
    """Run one read (``check`` compares it with the local copy) or write; count what it saw. True when it succeeded."""
    result, exc, _ = attempt(fn)
    problem = None
    if exc is not None:
        outcome = _classify_error(env, st, exc)
    else:
        problem = check(result) if check is not None else None
        outcome = "intact" if problem is None else "silently wrong"
    if not st.seen[outcome]:
        st.examples.append((outcome, f"{label}: {problem or describe_exc(exc, 400)}"))
    st.seen[outcome] += 1
    return exc is None


def _difference_note(got: TensorDictBase, want: TensorDictBase) -> str | None:
    """What differs between a read and the local copy, saying when the read holds zeros that were never written."""
    diff = td_difference(got, want)
    if diff is None:
        return None
    zeros = [str(k) for k in got.keys(True, True) if isinstance(got.get(k), torch.Tensor) and got.get(k).numel() and not got.get(k).any()]
    return diff + (f" (all zeros in {', '.join(zeros[:3])})" if zeros else "")


def _exercise_lazy(env: Env, st: EvictedStore, make: Callable[[int, int], TensorDict]) -> None:
    """Writes (every even element, a slice), then reads of every element, the whole store and a leaf."""
    h, local, n = st.handle, st.local, EVICTION_ROWS
    # every even element alone (a segment holds several: a write that recreated a lost key would
    # leave its neighbours zero), then a slice across segments
    writes = [(f"write [{i}]", [i]) for i in range(0, n, 2)] + [("write [13:19]", list(range(13, 19)))]
    for label, rows in writes:
        new = [make(1, i) for i in rows]
        fn = (
            (lambda r=rows[0], v=new[0]: h.__setitem__(r, v))
            if len(rows) == 1
            else (lambda r=rows, v=new: h.__setitem__(slice(r[0], r[-1] + 1), lazy_stack(v, 0)))
        )
        if _evicted_call(env, st, label, fn, None):
            for r, v in zip(rows, new):
                local[r] = v
    for i in range(n):
        _evicted_call(env, st, f"read [{i}]", lambda i=i: h[i].to_tensordict(), lambda got, i=i: _difference_note(got, local[i]))
    whole = lazy_stack(list(local), 0)
    _evicted_call(
        env,
        st,
        "read all",
        h.to_tensordict,
        lambda got: next((d for i, el in enumerate(elements_of(got)) if (d := _difference_note(el, whole[i]))), None),
    )
    leaf = "big" if "big" in local[0].keys() else None
    if leaf:
        want = torch.stack([el[leaf] for el in local])
        _evicted_call(
            env,
            st,
            f"read ['{leaf}']",
            lambda: h[leaf],
            lambda got: None if torch.equal(got, want) else ("zeros where none were written" if not got.all() else "values differ"),
        )


def _exercise_dense(env: Env, st: EvictedStore) -> None:
    """Writes (every even row, a slice), then reads of every row, the whole store and a leaf."""
    h, n = st.handle, EVICTION_ROWS
    for label, first, rows in [(f"write [{i}]", i, 1) for i in range(0, n, 2)] + [("write [13:19]", 13, 6)]:
        new = dense_rows(1 + first, rows)
        if _evicted_call(env, st, label, lambda f=first, r=rows, v=new: h.__setitem__(slice(f, f + r), v), None):
            st.local[first : first + rows] = new
    for i in range(n):
        _evicted_call(env, st, f"read [{i}]", lambda i=i: h[i], lambda got, i=i: _difference_note(got, st.local[i]))
    _evicted_call(env, st, "read all", h.to_tensordict, lambda got: _difference_note(got, st.local))
    _evicted_call(env, st, "read ['obs']", lambda: h["obs"], lambda got: None if torch.equal(got, st.local["obs"]) else "values differ")


def _eviction_stores(env: Env) -> list[EvictedStore]:
    """Stores of three kinds, cut into many small segments, and the keys of each."""
    stores: list[EvictedStore] = []
    seg = 16 << 10  # small segments: many keys per store, so eviction takes some of a store's keys, not all
    for k in range(EVICTION_STORES):
        els = [mixed_element(0, i) for i in range(EVICTION_ROWS)]
        stores.append(EvictedStore("lazy", upload(env, els, env.td_id(f"ev-mixed{k}"), segment_bytes=seg), els))
        els = [ragged_element(0, i) for i in range(EVICTION_ROWS)]
        stores.append(EvictedStore("ragged", upload(env, els, env.td_id(f"ev-ragged{k}"), segment_bytes=seg // 4), els))
        td = dense_rows(0, EVICTION_ROWS)
        stores.append(
            EvictedStore(
                "dense",
                TensorDictStore.from_tensordict(td, url=env.url, prefix=env.prefix, td_id=env.td_id(f"ev-dense{k}"), segment_bytes=seg),
                td.clone(),
            )
        )
    for st in stores:
        st.keys = _store_keys(env.client, env.prefix, st.handle.td_id)
    return stores


def _evict(env: Env, stores: list[EvictedStore]) -> Check:
    """Filler keys until the server has evicted keys of two stores that kept their header; then the fillers go."""
    # fill until the server has evicted keys of two stores that kept their header
    evicted0 = int(env.client.info("stats")["evicted_keys"])
    fillers: list[str] = []
    damaged: list[EvictedStore] = []
    for k in range(EVICTION_FILLERS):
        fillers.append(f"{env.prefix}-filler:{k}")
        env.client.set(fillers[-1], b"f" * (64 << 10))
        if int(env.client.info("stats")["evicted_keys"]) == evicted0:
            continue
        _census(env, stores)
        damaged = [st for st in stores if st.lost and not st.header_lost]
        if len(damaged) >= 2:
            break
    evicted = int(env.client.info("stats")["evicted_keys"]) - evicted0
    env.client.delete(*fillers)
    # the census again, now that the server is below maxmemory: the one above raced the evictions
    # (the server evicts before any command while it is over the limit, the census's own EXISTS
    # included), so a key could go after its EXISTS answered
    _census(env, stores)
    damaged = [st for st in stores if st.lost and not st.header_lost]
    hit = [st for st in stores if st.lost]
    return Check(
        "eviction hit the stores",
        len(damaged) >= 2,
        proof=f"maxmemory 16mb allkeys-lru: {len(fillers)} fillers of 64 KiB, {evicted} keys evicted; "
        f"{len(hit)}/{len(stores)} stores lost keys "
        f"({len(damaged)} kept their header: " + ", ".join(f"{st.kind} {len(st.lost)}/{len(st.keys)} keys" for st in damaged) + ")",
    )


def _eviction_report(stores: list[EvictedStore]) -> list[Check]:
    """What the calls on the stores saw: nothing silently wrong, every refusal the damaged error, untouched stores intact."""
    hit = [st for st in stores if st.lost]
    checks: list[Check] = []
    calls: Counter[str] = Counter()
    for st in stores:
        calls.update(st.seen)
    per_store = Counter(st.worst for st in stores)
    summary = (
        ", ".join(f"{per_store[o]} {o}" for o in EVICTION_OUTCOMES)
        + " (stores); calls: "
        + ", ".join(f"{calls[o]} {o}" for o in EVICTION_OUTCOMES)
    )
    wrong = [st for st in stores if st.seen["silently wrong"]]
    other = [st for st in stores if st.seen["other error"]]
    false_alarm = [st for st in stores if not st.lost and st.worst != "intact"]
    example = lambda sts: "; ".join(f"{st.kind} store ({len(st.lost)} keys lost): {st.example()}" for st in sts[:2])  # noqa: E731
    checks.append(
        Check(
            "no read silently wrong",
            not wrong,
            summary,
            f"{len(wrong)} stores returned bytes never written" + (f": {example(wrong)}" if wrong else ""),
        )
    )
    damaged_name = "StoreDamagedError" if damaged_error_type() else "KeyError 'lost'/'damaged' (tdstore has no StoreDamagedError yet)"
    checks.append(
        Check(
            "every refusal is the damaged error",
            not other,
            proof=f"{len(other)} stores raised another error than {damaged_name}" + (f": {example(other)}" if other else ""),
        )
    )
    for st in hit:
        ok = not st.seen["silently wrong"] and not st.seen["other error"]
        seen = ", ".join(f"{st.seen[o]} {o}" for o in EVICTION_OUTCOMES if st.seen[o])
        names = ", ".join(_key_label(k) for k in st.lost[:4]) + (", ..." if len(st.lost) > 4 else "")
        lost = f"{len(st.lost)}/{len(st.keys)} keys lost: {names}" + (" (the header too)" if st.header_lost else "")
        checks.append(Check(f"{st.kind} store {st.handle.td_id} ({lost})", ok, seen, st.example()))
    checks.append(
        Check(
            "stores that lost no key are intact",
            not false_alarm,
            proof=f"{sum(not st.lost for st in stores)} stores lost no key, {len(false_alarm)} of them did not come through intact"
            + (f": {example(false_alarm)}" if false_alarm else ""),
        )
    )
    return checks


def case_eviction(env: Env) -> list[Check]:
    """A real ``maxmemory`` server with ``allkeys-lru``: it evicts some keys of some stores; no read may be silently wrong.

    Stores of three kinds (lazy with row-block, own-blob and heterogeneous leaves;
    lazy with heterogeneous leaves only; dense), cut into many small segments so that
    a store has many keys, are uploaded, then filler keys are written until the
    server has evicted keys of at least two stores whose header it kept (a store
    that lost its header is simply gone).  The fillers are deleted, and every store
    gets three writes and a read of each element, of the whole store and of a leaf.
    Each read must return exactly the bytes written (compared with a local copy) or
    raise ``tdstore.StoreDamagedError`` (until tdstore has it: a KeyError saying
    "lost" or "damaged"); a store whose header was evicted must raise a KeyError
    naming it; zeros or any bytes never written fail the case, and so does any
    other error.  Stores that lost no key must come through intact.
    """
    assert env.server is not None
    stores = _eviction_stores(env)
    checks = [_evict(env, stores)]
    # every store: writes, then reads compared with the local copy
    for st in stores:
        if st.kind == "dense":
            _exercise_dense(env, st)
        else:
            _exercise_lazy(env, st, mixed_element if st.kind == "lazy" else ragged_element)
    _census(env, stores)  # and after the calls: what was lost at any point counts as lost
    checks += _eviction_report(stores)
    return checks


def _census(env: Any, stores: list[Any]) -> None:
    """Which keys of each store the server no longer holds (``lost``, ``header_lost``): one pipeline of EXISTS."""
    pipe = env.client.pipeline(transaction=False)
    for st in stores:
        for key in st.keys:
            pipe.exists(key)
    found = iter(pipe.execute())
    for st in stores:
        st.lost = [key for key in st.keys if not next(found)]
        st.header_lost = st.handle._engine.keys.meta.encode() in st.lost
