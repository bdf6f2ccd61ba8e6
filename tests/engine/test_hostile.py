"""Hostile values: another client edits a store's header fields, priority tree or offset tables by hand.

Every value out of range must raise ``StoreDamagedError`` naming the store and the field (or the
tree, or the table), before anything is read or written: never a raw Lua error, a hang, NaN
weights or rows never written. A call the edited field does not matter to must stay correct.
Priorities whose weights could overflow the tree's sums are refused before writing
(``ValueError`` naming the largest allowed). Each edit runs on redis-server and fakeredis;
every waiting call gets a small ``timeout``, so a hang fails fast as a ``TimeoutError`` (a slow
reply does not: see ``replies_are_never_cut_short``).
"""

from __future__ import annotations

import json
import math
import random
import re
import struct
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Backend
from tensordict import TensorDict, lazy_stack

import tdstore
from tdstore import LazyStackedTensorDictStore, StoreDamagedError
from tdstore._checkpoint.export_import import export_store
from tdstore._format.keys import StoreKeys
from tdstore._ring import policy_calls as _sampling
from tdstore.inspect_store import audit

pytestmark = [pytest.mark.ring, pytest.mark.usefixtures("replies_are_never_cut_short")]

WAIT = 1.0  # every waiting call's timeout: a hostile value that made a call wait would fail the test at once


@pytest.fixture
def backend(one_node: Backend) -> Backend:
    """The redis-server and fakeredis backends (a cluster adds nothing to what a header holds)."""
    return one_node


def batch(lo: int, n: int) -> Any:
    """n elements tagged lo .. lo + n - 1: x = tag, a row-block pair (x, y) and varying-length tokens."""
    return lazy_stack(
        [
            TensorDict(x=torch.tensor([float(i)]), y=torch.full((2,), float(i)), tok=torch.arange(i % 3 + 1) + 10 * i)
            for i in range(lo, lo + n)
        ]
    )


def make(backend: Backend, setup: str) -> tuple[LazyStackedTensorDictStore, StoreKeys]:
    """A ring of 8 slots with 6 written (tags 0..5), under the sampling policy ``setup`` names."""
    td_id = f"h{uuid.uuid4().hex[:8]}"
    store = LazyStackedTensorDictStore(count=8, td_id=td_id, **backend.kwargs())
    store.extend(batch(0, 6))
    if setup == "prio":
        store.enable_priorities(alpha=1.0)
    elif setup == "limit":
        store.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=100.0)
    elif setup == "queue":
        store.set_queue(True)
    return store, StoreKeys(backend.prefix, td_id)


def _check_sample(s: Any, written: int = 6) -> None:
    assert torch.equal(s.td["x"][:, 0].long(), s.indices) and bool((s.indices < written).all()), "a sample read rows never written"
    for j, k in enumerate(s.indices.tolist()):
        assert torch.equal(s.td[j]["tok"], torch.arange(k % 3 + 1) + 10 * k)
    if hasattr(s, "weights"):
        assert bool(torch.isfinite(s.weights).all()) and bool(((s.weights > 0) & (s.weights <= 1)).all())


def calls(store: LazyStackedTensorDictStore, backend: Backend, keys: StoreKeys, setup: str) -> dict[str, Callable[[], None]]:
    """The calls an edit is tried with, each checking its result when it returns."""
    client = backend.client()

    def reopen() -> None:
        again = LazyStackedTensorDictStore.from_store(td_id=keys.td_id, **backend.kwargs())
        assert len(again) == 8

    def element() -> None:
        td = store[4].to_tensordict()
        assert float(td["x"][0]) == 4.0 and torch.equal(td["tok"], torch.arange(2) + 40)

    def sample() -> None:
        _check_sample(store.sample(5, timeout=WAIT))

    def psample() -> None:
        s = store.sample(5, prioritized=True, timeout=WAIT)
        _check_sample(s)

    def update_priority() -> None:
        assert store.update_priority([1], 2.0).tolist() == [True]

    def pop() -> None:
        got = store.pop(2, timeout=WAIT)
        assert got.td["x"][:, 0].tolist() == [0.0, 1.0]

    def extend() -> None:  # the last call: the ring has written 6 rows before it
        store.extend(batch(6, 1), timeout=WAIT)
        assert client.hget(keys.meta, "rw") == b"7"

    def written() -> None:
        assert store.written == range(6) and len(store) == 8

    def update_if() -> None:
        assert store.update_if([3], [1], TensorDict(y=torch.full((1, 2), 3.0), batch_size=[1])).tolist() == [True]
        assert store[3].to_tensordict()["y"].tolist() == [3.0, 3.0]

    def enable_priorities() -> None:  # the last call: every written slot weighs 1
        store.enable_priorities(alpha=1.0)
        assert sorted(set(store.sample(64, prioritized=True, timeout=WAIT).indices.tolist())) == list(store.written)

    def export() -> None:  # a checkpoint holds the ring's counters: never out of range ones
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            meta = export_store(store, f"{tmp}/ckpt")
            assert meta.ring.get("rw") == 6 and meta.count == 8

    out = {"open": reopen, "written": written, "element": element, "sample": sample, "pop": pop, "update_if": update_if}
    out.update(export=export, extend=extend)
    if setup == "plain":
        out["enable_priorities"] = enable_priorities
    if setup == "prio":
        out.update(psample=psample, update_priority=update_priority)
        del out["sample"]  # a prioritized store samples uniformly too, but the point is its tree
    if setup in ("queue",):
        del out["sample"]
    return out


def _hostile(what: str, must: set[str], run: dict[str, Callable[[], None]], names: tuple[str, ...], td_id: str) -> None:
    """Run every call: those in ``must`` raise StoreDamagedError naming one of ``names`` and the store; the
    others raise the same or stay correct (their own checks). Any other exception fails the test."""
    for name, call in run.items():
        try:
            call()
        except StoreDamagedError as err:
            text = str(err)
            assert any(n in text for n in names), f"{what}: {name} raised without naming {names}: {text}"
            assert td_id in text, f"{what}: {name} raised without naming the store: {text}"
            assert "user_script" not in text and "stack traceback" not in text, text
            continue
        assert name not in must, f"{what}: {name} did not raise StoreDamagedError"


BIG = "1e300"
HUGE_INT = str(2**63)
# (field, hostile value (None: the field deleted), policy setup, calls that must raise)
RING = {"open", "sample", "pop", "update_if", "extend", "enable_priorities"}
HEADER_EDITS: list[tuple[str, str | None, str, set[str]]] = [
    *[("count", v, "plain", RING | {"export"}) for v in ("-5", "abc", BIG, HUGE_INT, "2.5", "", None, "100", "7", "4")],
    *[("rw", v, "plain", RING | {"written", "export"}) for v in ("-100", "abc", BIG, HUGE_INT, "2.5", "", "-0")],
    *[("rr", v, "queue", {"open", "pop", "extend", "export"}) for v in ("-50", "99", "x", "1.5")],
    *[("sn", v, "limit", {"open", "sample", "extend", "export"}) for v in ("-1", "x", BIG)],
    *[("lb", v, "limit", {"open", "sample", "extend", "export"}) for v in ("-1", "99", "x")],
    *[("pm", v, "prio", {"open", "extend", "export"}) for v in ("inf", "nan", "-1", "x", "1e305")],
    *[
        ("sc", v, "plain", {"open", "sample", "extend"})
        for v in (
            "{bad",
            "[]",
            '{"alpha":-1}',
            '{"alpha":"x"}',
            '{"alpha":1e999}',
            '{"mt":0}',
            '{"limit":[1,2]}',
            '{"queue":3}',
            '{"zz":1}',
        )
    ],
    *[("sc", v, "prio", {"open", "psample", "extend", "update_priority"}) for v in ('{"alpha":null}', '{"alpha":1,"mt":1.5}')],
    *[("na", v, "plain", {"open"}) for v in ("x", "-1", "")],
    *[("seg", v, "plain", {"open"}) for v in ("-2", "x", "0.5")],
    *[("version", v, "plain", {"open"}) for v in ("-1", "x", "", None, "0002")],
    *[("kv", v, "plain", {"open", "extend"}) for v in ("x", "-3")],
    *[("lv:0", v, "plain", {"open", "element"}) for v in ("x", "-1", "99")],
    *[("stack_dim", v, "plain", {"open"}) for v in ("7", "x")],
    *[("schema", v, "plain", {"open"}) for v in ("{}", "x", None)],
    *[("inner", v, "plain", {"open"}) for v in ("[-1]", "x")],
    *[("format", v, "plain", {"open"}) for v in ("abc", "", "-1", None)],
    *[("type", v, "plain", {"open"}) for v in ("weird", None)],
    ("state", "broken", "plain", {"open"}),
]


@pytest.mark.parametrize(("field", "value", "setup", "must"), HEADER_EDITS, ids=[f"{f}={v}" for f, v, _, _ in HEADER_EDITS])
def test_a_header_field_out_of_range_is_a_damaged_store(backend, field, value, setup, must):
    store, keys = make(backend, setup)
    client = backend.client()
    if value is None:
        client.hdel(keys.meta, field)
    else:
        client.hset(keys.meta, field, value)
    run = calls(store, backend, keys, setup)
    if field == "count" and value is not None and value.isdigit():
        # another count in range: a new handle cannot tell from the header alone (it reads no data key);
        # every ring call that reads or writes data can (tds_count_agrees in lua/_lib.lua)
        del run["open"]
    _hostile(f"{field}={value!r}", must - {"open"} if "open" not in run else must, run, (field,), keys.td_id)


def test_tdstore_check_reports_a_header_field_out_of_range(backend):
    store, keys = make(backend, "plain")
    assert audit(backend.client(), backend.prefix, keys.td_id).intact
    backend.client().hset(keys.meta, "rr", "-4")
    found = audit(backend.client(), backend.prefix, keys.td_id)
    assert not found.intact and "rr" in found.problems[0]


def _tree_edit(kind: str) -> Callable[[bytes], bytes]:
    """An edit of the tree of a ring of 8 slots: leaves at bytes 0..63 (one float64 each), the root's
    sum and min at 64 and 72 (see lua/_tree.lua)."""

    def put(at: int, v: float) -> Callable[[bytes], bytes]:
        return lambda raw: raw[:at] + struct.pack("<d", v) + raw[at + 8 :]

    if kind == "random":
        rnd = random.Random(7)
        return lambda raw: bytes(rnd.getrandbits(8) for _ in raw)
    return {
        "leaf-inf": put(8, math.inf),
        "leaf-nan": put(8, math.nan),
        "leaf-negative": put(8, -1.0),
        "leaf-huge": put(8, 1e300),  # finite, but the root no longer holds the sum of its children
        "root-sum": put(64, 100.0),
        "root-inf": put(64, math.inf),
        "root-min-zero": put(72, 0.0),
        "root-min-above-sum": put(72, 1e9),
        "cut-short": lambda raw: raw[:-8],
    }[kind]


TREE_EDITS = [
    "random",
    "leaf-inf",
    "leaf-nan",
    "leaf-negative",
    "leaf-huge",
    "root-sum",
    "root-inf",
    "root-min-zero",
    "root-min-above-sum",
    "cut-short",
]


@pytest.mark.parametrize("kind", TREE_EDITS)
def test_a_priority_tree_edited_by_hand_is_a_damaged_store(backend, kind):
    store, keys = make(backend, "prio")
    client = backend.client()
    raw = client.get(keys.priorities)
    assert raw is not None and len(raw) == 80
    client.set(keys.priorities, _tree_edit(kind)(raw))
    found = audit(client, backend.prefix, keys.td_id)  # (update_priority recomputes the sums it touches: audit first)
    assert not found.intact and "priority tree" in found.problems[-1]
    run = calls(store, backend, keys, "prio")
    _hostile(
        f"tree {kind}", {"psample"}, {k: run[k] for k in ("psample", "update_priority", "extend", "pop")}, ("priority tree",), keys.td_id
    )


def _leaf_number(client: Any, keys: StoreKeys, path: str) -> int:
    schema = json.loads(client.hget(keys.meta, "schema"))
    return next(rec["n"] for rec in schema["leaves"] if rec["path"] == [path])


def _offsets_edit(kind: str) -> Callable[[list[int]], list[int]]:
    def swap(o: list[int]) -> list[int]:
        o = list(o)
        o[2], o[3] = o[3], o[2]
        return o

    return {
        "reversed": lambda o: o[::-1],
        "swapped": swap,
        "past-the-data": lambda o: [*o[:6], *(v + 10_000 for v in o[6:])],  # element 5 ends past the data
        "huge": lambda o: [*o[:3], 2**62, *o[4:]],
        "start-not-zero": lambda o: [8, *o[1:]],
    }[kind]


OFFSET_EDITS = ["reversed", "swapped", "past-the-data", "huge", "start-not-zero"]


def _het_calls(store: LazyStackedTensorDictStore) -> dict[str, Callable[[], None]]:
    want = [torch.arange(i % 3 + 1) + 10 * i for i in range(6)]

    def element() -> None:
        for i in range(6):
            assert torch.equal(store[i].to_tensordict()["tok"], want[i])

    def padded() -> None:
        got = store.get_at("tok", [0, 2, 4, 5], as_padded_tensor=True)
        assert [row[: k % 3 + 1].tolist() for row, k in zip(got, (0, 2, 4, 5))] == [want[k].tolist() for k in (0, 2, 4, 5)]

    def sample() -> None:  # seeded: draws every written slot (the one an edit damaged among them)
        s = store.sample(64, torch.Generator().manual_seed(0), timeout=WAIT)
        _check_sample(s)
        assert set(s.indices.tolist()) == set(range(6))

    def pop() -> None:
        got = store.pop(3, timeout=WAIT)
        assert [got.td[j]["tok"].tolist() for j in range(3)] == [w.tolist() for w in want[:3]]

    return {"element": element, "padded": padded, "sample": sample, "pop": pop}


@pytest.mark.parametrize("kind", OFFSET_EDITS)
def test_an_offset_table_edited_by_hand_is_a_damaged_store(backend, kind):
    store, keys = make(backend, "plain")
    client = backend.client()
    okey = keys.offsets(_leaf_number(client, keys, "tok"), 0)
    table = client.get(okey)
    offs = list(struct.unpack(f"<{len(table) // 8}q", table))
    assert offs[:7] == [0, 8, 24, 48, 56, 72, 96]  # 6 elements of 1, 2, 3, 1, 2, 3 int64; slots 6, 7 never written
    client.set(okey, struct.pack(f"<{len(offs)}q", *_offsets_edit(kind)(offs)))
    _hostile(f"offsets {kind}", {"element", "padded", "sample"}, _het_calls(store), ("offset", "tok", "holds fewer bytes"), keys.td_id)


@pytest.mark.parametrize("record", [7, -1, 2**60])
def test_shape_records_that_disagree_with_the_data_are_a_damaged_store(backend, record):
    store, keys = make(backend, "plain")
    client = backend.client()
    skey = keys.shapes(_leaf_number(client, keys, "tok"), 0)
    client.setrange(skey, 8 * 2, struct.pack("<q", record))  # element 2 (3 tokens) said to hold `record`
    _hostile(f"shape record {record}", {"element", "padded"}, _het_calls(store), ("tok",), keys.td_id)


def test_a_header_edited_back_reads_as_before(backend):
    """Damage is reported, never cached: the same handle works again once the field is put back."""
    store, keys = make(backend, "queue")
    client = backend.client()
    client.hset(keys.meta, "rr", "-50")
    with pytest.raises(StoreDamagedError, match="rr"):
        store.pop(1, timeout=WAIT)
    client.hset(keys.meta, "rr", "0")
    assert store.pop(2, timeout=WAIT).td["x"][:, 0].tolist() == [0.0, 1.0]


def test_header_damage_is_also_a_format_error():
    """A header value out of range is a StoreDamagedError naming the field, and stays a StoreFormatError
    (what a header this tdstore cannot read has always raised)."""
    from tdstore._format.header_info import HeaderDamagedError, int_field

    with pytest.raises(HeaderDamagedError, match="header field rw holds '-1'") as err:
        int_field("-1", "rw")
    assert isinstance(err.value, StoreDamagedError) and isinstance(err.value, tdstore.StoreFormatError)
    for bad in (" 5", "+5", "5_0", "٥", "0x10", "1e3", "007", "-0", "5\n"):
        with pytest.raises(HeaderDamagedError):
            int_field(bad, "count")


# -- priorities that would overflow the tree ---------------------------------------------------


def test_priorities_whose_weights_could_overflow_are_refused_before_writing(backend):
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    store.enable_priorities(alpha=2.0)
    top = _sampling.max_priority(2.0, 4)
    assert 1e152 < top < 1e154
    with pytest.raises(ValueError, match=re.escape(f"largest allowed priority is {top:.6g}")):
        store.extend(batch(0, 4), priority=[1e154, 1e154, 1.0, 1.0])
    assert store.write_count == 0
    store.extend(batch(0, 4), priority=[top, top, 1.0, 1.0])  # the largest allowed: sums stay finite
    with pytest.raises(ValueError, match="largest allowed priority"):
        store.update_priority([2], 1e154)
    s = store.sample(64, torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(s.weights).all()) and bool(((s.weights >= 0) & (s.weights <= 1)).all())  # (tiny ones: 0 in float32)
    assert set(s.indices.tolist()) <= {0, 1, 2, 3} and {0, 1} <= set(s.indices.tolist())


def test_the_server_refuses_an_overflowing_priority_the_client_let_through(backend, monkeypatch):
    """The script's own bound (lua/_tree.lua tds_weight), for a client that does not check."""
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    store.enable_priorities(alpha=2.0)
    monkeypatch.setattr(_sampling, "max_priority", lambda alpha, slots: math.inf)
    with pytest.raises(ValueError, match="largest allowed priority is 1.58114e\\+153"):
        store.extend(batch(0, 4), priority=[1e154, 1e154, 1.0, 1.0])
    assert store.write_count == 0
    store.extend(batch(0, 4))
    with pytest.raises(ValueError, match="largest allowed priority"):
        store.update_priority([0], 1e154)
    assert store.sample(8, torch.Generator().manual_seed(0)).weights.tolist() == [1.0] * 8  # all still weigh 1


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf, -math.inf])
def test_priorities_that_are_not_finite_numbers_are_refused(backend, bad):
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    store.enable_priorities(alpha=1.0)
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        store.extend(batch(0, 2), priority=[1.0, bad])
    store.extend(batch(0, 2))
    with pytest.raises(ValueError, match="finite numbers >= 0"):
        store.update_priority([0], bad)
    assert store.write_count == 2


@pytest.mark.parametrize("value", ["abc", "-1", BIG])
def test_a_full_ring_sampled_by_transaction_checks_rw(backend, value):
    """A full ring samples as a read transaction that reads rw itself (``_ring.sample_pop``): the same range."""
    store, keys = make(backend, "plain")
    store.extend(batch(6, 2))
    _check_sample(store.sample(8, timeout=WAIT), written=8)  # the ring is full: the next sample goes as a transaction
    assert store._engine.ring_full
    backend.client().hset(keys.meta, "rw", value)
    with pytest.raises(StoreDamagedError, match=f"header field rw holds '{re.escape(value)}'") as err:
        store.sample(8, timeout=WAIT)
    assert keys.td_id in str(err.value)


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_an_inventory_count_out_of_range_refuses_a_write_that_allocates(backend, value):
    """``na`` is counted with HINCRBY when a write allocates a segment: checked before anything is written."""
    td_id = f"h{uuid.uuid4().hex[:8]}"
    store = LazyStackedTensorDictStore(count=8, td_id=td_id, segment_bytes=64, **backend.kwargs())
    store.extend(batch(0, 2))
    keys = StoreKeys(backend.prefix, td_id)
    client = backend.client()
    assert int(client.hget(keys.meta, "seg")) < 8  # several segments, each allocated when first written
    client.hset(keys.meta, "na", value)
    for lo in range(2, 8, 2):  # until a write reaches a segment never written
        snapshot = {k: client.get(k) for k in client.keys(f"{backend.prefix}:*") if client.type(k) == b"string"}
        try:
            store.extend(batch(lo, 2), timeout=WAIT)
        except StoreDamagedError as err:
            assert "header field na" in str(err) and td_id in str(err)
            break
    else:
        pytest.fail("no extend allocated a segment")
    assert client.hget(keys.meta, "rw") == str(lo).encode()  # the refused extend wrote nothing
    assert snapshot == {k: client.get(k) for k in client.keys(f"{backend.prefix}:*") if client.type(k) == b"string"}


@pytest.mark.parametrize(("field", "value"), [("#", "abc"), ("#o", "-5"), ("#o", "1"), ("#b", "x"), ("#1", "junk")])
def test_a_reply_cache_edited_by_hand_is_a_damaged_store(backend, field, value):
    """The reply cache's bookkeeping (lua/_lib.lua tds_request, tds_remember) is range-checked like a
    header field: an edit is StoreDamagedError naming it, never a raw error or a long loop."""
    store, keys = make(backend, "plain")
    client = backend.client()
    for i in range(3):
        store.extend(batch(6 + i, 1))  # three records: '#' = 4 (the first extend made one)
    if field == "#o":  # '1' is in range only while fewer than 4096 records are kept: claim 5000
        client.hset(keys.replies, mapping={"#": "5000", "#o": value} if value == "1" else {"#o": value})
    else:
        client.hset(keys.replies, field, value)
        if field == "#1":  # a record the next call drops: push the bound so that it must
            client.hset(keys.replies, mapping={"#": "4096", "#o": "1"})
    with pytest.raises(StoreDamagedError, match="reply cache"):
        store.extend(batch(9, 1))
