"""Segments: a stack cut into element ranges, each under its own hash tag (see tdstore/_format/segments.py).

The whole behavioural suite also runs with tiny segments in CI (``pytest --segment-bytes 64``);
these tests pin what segments promise: the layout, that an element write touches one
segment only, that a shape-changing write rewrites one segment's tables, that values larger
than one server string work, and that a random mix of operations across segment boundaries
matches a local lazy stack.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers import assert_same, top_level_commands
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._format.keys import StoreKeys
from tdstore._format.op_kinds import Read
from tdstore._format.segments import Segments, row_read_op, segment_length
from tdstore.server import EmbeddedServer


def element(i: int, width: int = 4) -> TensorDict:
    return TensorDict(
        obs=torch.arange(width, dtype=torch.float32) + 10 * i,
        tokens=torch.arange(1 + i % 5, dtype=torch.int64) + 1000 * i,
        nested=TensorDict(b=torch.tensor([i, -i], dtype=torch.int16)),
    )


def stack(n: int) -> torch.Tensor:
    return lazy_stack([element(i) for i in range(n)])


def raw(client, prefix: str) -> dict[bytes, bytes]:
    return {k: client.get(k) for k in client.keys(prefix + ":*") if client.type(k) == b"string"}


def store_keys(backend) -> list[bytes]:
    """The keys of the test's stores (not the prefix's registry set)."""
    return [k for k in backend.keys() if b"{" in k]


def tag(key: bytes) -> str:
    return re.search(rb"\{([^}]*)\}", key).group(1).decode()


# -- the plan, without a server -----------------------------------------------------------------


def test_segment_arithmetic():
    s = Segments(count=10, per=4)
    assert s.n == 3 and [s.size(k) for k in range(3)] == [4, 4, 2] and s.of(9) == 2
    assert list(s.split(2, 9)) == [(0, 2, 3), (1, 4, 7), (2, 8, 9)]
    assert list(s.split(5, 5)) == [(1, 5, 5)]
    # byte ranges of a leaf of 3-byte elements: segments are 12 bytes
    assert list(s.split_bytes(10, 5, 3)) == [(0, 10, 2), (1, 0, 3)]
    assert Segments(count=3, per=3).n == 1 and Segments(count=0, per=1).n == 1


def test_segment_length_keeps_small_stores_whole():
    assert segment_length(count=1000, element_bytes=100, segment_bytes=4 << 20) == 0  # 100 kB: one segment
    assert segment_length(count=1000, element_bytes=100, segment_bytes=1000) == 10
    assert segment_length(count=5, element_bytes=10 << 20, segment_bytes=4 << 20) == 1  # an element per segment


def test_segment_key_names_never_collide():
    """Segment k's tag '{id%s<k>}' cannot be another id's segment 0: escape() never writes '%s'."""
    ids = ["x", "x%s1", "x%1", "x}", "x{", "x%", "x%s", "a:b"]
    names = set()
    for td_id in ids:
        keys = StoreKeys("p", td_id)
        for seg in range(3):
            for leaf in range(2):
                names.update(keys.leaf_keys(leaf, seg))
        names.add(keys.meta)
    assert len(names) == len(ids) * (3 * 2 * 3 + 1)
    keys = StoreKeys("p", "x")
    assert keys.data(0, 0) == "p:{x}:d:0" and keys.data(0, 2) == "p:{x%s2}:d:0"


# -- layout ------------------------------------------------------------------------------------


@pytest.mark.layout
def test_small_store_keeps_one_segment_and_the_seed_keys(backend):
    s = LazyStackedTensorDictStore.from_lazy_stack(stack(6), **backend.kwargs())
    h = s._engine.header
    assert h.segments.n == 1 and h.seg == 0
    # the header, the inventory, the row block of the homogeneous leaves, blob + offsets + shapes for tokens: O(K) keys
    assert h.row is not None
    assert len(store_keys(backend)) == 1 + 1 + 1 + 3


def test_segments_spread_keys_over_hash_tags(backend):
    s = LazyStackedTensorDictStore.from_lazy_stack(stack(10), segment_bytes=40, **backend.kwargs())  # obs is 16 B, tokens <= 40 B
    h = s._engine.header
    assert h.seg == 1 and h.segments.n == 10
    keys = store_keys(backend)
    tags = {tag(k) for k in keys}
    # segment 0 shares the header's tag; on Redis Cluster every segment does, unless the store is
    # spread (StoreKeys.segment_tags), where each segment k > 0 also has its guard
    spread = getattr(backend, "spread", False)
    assert len(tags) == (1 if backend.name == "cluster" and not spread else 10)
    # the header, the inventory (a spread store keeps none), per segment: the row block, tokens' blob and tables
    assert len(keys) == 1 + (0 if spread else 1) + 10 * (1 + 3) + (9 if spread else 0)
    assert_same(s.to_tensordict(), stack(10))


def test_first_keys_of_an_empty_store_fix_its_segment_length(backend):
    s = LazyStackedTensorDictStore(count=12, segment_bytes=64, **backend.kwargs())
    s.set("obs", torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8))  # 32 B per element: 2 per segment
    assert s._engine.header.seg == 2
    s.set("wide", torch.ones(12, 100))  # a later, wider key keeps the length
    assert s._engine.header.seg == 2
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **backend.kwargs())
    assert other._engine.header.seg == 2
    assert torch.equal(other["obs"], torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8))
    assert torch.equal(other[5:9]["wide"], torch.ones(4, 100))


# -- one element, one segment -------------------------------------------------------------------


@pytest.mark.parametrize("i", [0, 4, 9])
def test_element_write_touches_only_its_segment(backend, i):
    s = LazyStackedTensorDictStore.from_lazy_stack(stack(10), segment_bytes=96, **backend.kwargs())  # 2 elements per segment
    per = s._engine.header.seg
    assert per == 2
    client = backend.client()
    before = raw(client, backend.prefix)
    s[i] = element(100 + i)  # tokens change size: a splice and an offset shift
    after = raw(client, backend.prefix)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed and {tag(k) for k in changed} == {tag(s._engine.keys.data(0, i // per).encode())}
    assert_same(s[i], element(100 + i))
    ref = [element(j) if j != i else element(100 + i) for j in range(10)]
    assert_same(s.to_tensordict(), lazy_stack(ref))


def test_element_calls_are_one_round_trip_on_a_segmented_store(real):
    s = LazyStackedTensorDictStore.from_lazy_stack(stack(10), segment_bytes=96, **real.kwargs())
    s[7] = element(70)
    s[7].to_tensordict()  # both scripts loaded
    assert top_level_commands(real.client, lambda: s.__setitem__(7, element(71))) == ["evalsha"]
    assert top_level_commands(real.client, lambda: s[7].to_tensordict()) == ["evalsha"]
    # a read across every segment is still one call
    assert top_level_commands(real.client, lambda: s[1:9]) == ["evalsha"]
    assert top_level_commands(real.client, lambda: s[torch.tensor([9, 0, 5, 5, 2])]) == ["evalsha"]


# -- values larger than one server string --------------------------------------------------------


@pytest.fixture(scope="module")
def small_strings():
    """A real server whose largest string is 1 MB: it must behave as a default one does past 512 MiB."""
    with EmbeddedServer(extra_args=["--proto-max-bulk-len", "1mb"]) as srv:
        yield srv


def test_leaf_larger_than_a_string_round_trips(small_strings):
    n, width = 24, 65_536  # 24 x 256 KiB = 6 MiB of float32, 6x the largest string
    local = lazy_stack([TensorDict(x=torch.full((width,), float(i)), t=torch.arange(i * 5000, dtype=torch.int32)) for i in range(n)])
    s = LazyStackedTensorDictStore.from_lazy_stack(local, url=small_strings.url, prefix="big")
    client = small_strings.client()
    sizes = [client.strlen(k) for k in client.keys("big:*") if client.type(k) == b"string"]
    assert max(sizes) <= 1 << 20 and sum(sizes) > 6 << 20
    assert s._engine.header.segments.n > 1
    full = s.to_tensordict()
    assert_same(full, local)
    # a whole-key write bigger than a string, a slice across segments, a scattered batch
    new = torch.randn(n, width)
    s.set("x", new)
    assert torch.equal(s["x"], new)
    s[3:21] = lazy_stack([TensorDict(x=torch.zeros(width), t=torch.ones(7, dtype=torch.int32)) for _ in range(18)])
    assert torch.equal(s[2:22]["x"], torch.cat([new[2:3], torch.zeros(18, width), new[21:22]]))
    assert [s[i]["t"].numel() for i in (2, 3, 20, 21)] == [10_000, 7, 7, 105_000]
    idx = torch.tensor([23, 0, 11, 11])
    assert torch.equal(s[idx]["x"], torch.stack([new[23], new[0], torch.zeros(width), torch.zeros(width)]))
    s.clear_redis()
    assert not client.keys("big:*")


def test_dense_store_larger_than_a_string(small_strings):
    td = TensorDict(img=torch.randint(0, 255, (40, 84, 84, 3), dtype=torch.uint8), r=torch.arange(40.0), batch_size=[40])  # 847 kB
    td["img"] = torch.cat([td["img"]] * 3, 1)  # 2.5 MB
    s = TensorDictStore.from_tensordict(td, url=small_strings.url, prefix="dense")
    assert s._store._engine.header.segments.n > 1
    assert torch.equal(s["img"], td["img"]) and torch.equal(s[17:33]["img"], td["img"][17:33])
    s.clear_redis()


# -- a random mix of operations across segment boundaries ---------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.ring
def test_random_operations_match_a_local_stack(backend, seed):
    rng = random.Random(seed)
    n = 13
    ref = [element(i) for i in range(n)]
    s = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([e.clone() for e in ref]), segment_bytes=100, **backend.kwargs())
    assert s._engine.header.segments.n > 3
    for _ in range(40):
        op = rng.choice(["element", "slice", "index", "read", "fill"])
        if op == "element":
            i = rng.randrange(n)
            ref[i] = element(rng.randrange(1000))
            s[i] = ref[i]
        elif op == "slice":
            a = rng.randrange(n)
            b = rng.randrange(a, n) + 1
            new = [element(rng.randrange(1000)) for _ in range(a, b)]
            s[a:b] = lazy_stack(new)
            ref[a:b] = new
        elif op == "index":
            ids = rng.sample(range(n), rng.randrange(1, n))
            got = s[torch.tensor(ids)]
            assert_same(got, lazy_stack([ref[i] for i in ids]))
        elif op == "read":
            a = rng.randrange(n)
            b = rng.randrange(a, n) + 1
            step_ = rng.choice([1, 2, 3])
            assert_same(s[a:b:step_], lazy_stack(ref[a:b:step_]))
        else:
            v = float(rng.randrange(100))
            s.fill_("obs", v)  # on the server, every segment
            for e in ref:
                e["obs"].fill_(v)
    assert_same(s.to_tensordict(), lazy_stack(ref))
    # structural changes across all segments
    s.rename_key_("obs", "o")
    s.set("extra", torch.arange(n, dtype=torch.float64))
    del s["tokens"]
    got = s.to_tensordict()
    assert torch.equal(got["o"], torch.stack([e["obs"] for e in ref])) and torch.equal(got["extra"], torch.arange(n, dtype=torch.float64))
    assert "tokens" not in got.keys()
    s.clear_redis()
    assert not store_keys(backend)


@pytest.mark.ring
def test_first_ring_write_of_heterogeneous_keys_fixes_the_segment_length(backend):
    s = LazyStackedTensorDictStore(count=100, segment_bytes=1000, **backend.kwargs())
    s.extend(lazy_stack([TensorDict(tok=torch.arange(40 + i % 10)) for i in range(5)]))  # rows of up to 392 B
    assert s._engine.header.seg == 2 and s._engine.header.segments.n == 50
    assert [s[i]["tok"].numel() for i in range(5)] == [40, 41, 42, 43, 44]


@pytest.mark.ring
def test_ring_buffer_across_segments(backend):
    s = LazyStackedTensorDictStore(count=7, segment_bytes=24, **backend.kwargs())
    for start in range(0, 30, 4):
        batch = lazy_stack([TensorDict(v=torch.full((2,), float(start + j)), tok=torch.arange((start + j) % 3 + 1)) for j in range(4)])
        s.extend(batch)
    assert s._engine.header.segments.n > 1
    # the last 7 writes (25..31) in slot order
    written = {(w % 7): w for w in range(32)}
    assert s["v"][:, 0].tolist() == [float(written[k]) for k in range(7)]
    out = s.sample(64, generator=torch.Generator().manual_seed(0))
    assert set(out.td["v"][:, 0].tolist()) <= {float(w) for w in range(25, 32)}
    for j, v in enumerate(out.td["v"][:, 0].tolist()):
        assert out.td[j]["tok"].numel() == int(v) % 3 + 1


def test_copy_ttl_and_clear_cover_every_segment(backend):
    td = TensorDict(obs=torch.randn(9, 5), idx=torch.arange(9), batch_size=[9])
    s = TensorDictStore.from_tensordict(td, segment_bytes=40, **backend.kwargs())
    assert s._store._engine.header.segments.n == 9  # a 28 B row (obs and idx side by side): 1 per segment
    n_keys = len(store_keys(backend))
    c = s.clone()  # on the server, every segment
    assert len(store_keys(backend)) == 2 * n_keys
    assert_same(c.to_tensordict(), td)
    s.expire(100)
    client = backend.client()
    assert all(client.pttl(k) > 0 for k in client.keys(f"{backend.prefix}:{{{s.td_id}*"))
    s.clear_redis()
    c.clear_redis()
    assert not store_keys(backend)


# -- scattered rows: one GETRANGE per row, or the blob read whole ------------------------------


def test_row_read_op_reads_small_blobs_whole():
    one = Segments(count=10_000, per=10_000)
    assert row_read_op(one, row_bytes=16, rows=256) is Read.B  # a 160 kB blob for 256 rows
    assert row_read_op(one, row_bytes=256, rows=256) is Read.X  # 2.5 MB for 256 rows: GETRANGE each
    many = Segments(count=10_000, per=100)
    assert row_read_op(many, row_bytes=256, rows=256) is Read.X  # 256 rows over 100 segments: the whole store
    assert row_read_op(Segments(count=1000, per=100), row_bytes=16, rows=256) is Read.B  # 10 segments of 1.6 kB


@pytest.mark.layout
def test_scattered_batch_reads_small_blobs_whole(real):
    n = 900  # one segment
    # obs is too large for the row block (4.4 kB per element), so each key keeps its own blob
    local = lazy_stack([TensorDict(obs=torch.randn(1100), small=torch.tensor([i, -i])) for i in range(n)])
    s = LazyStackedTensorDictStore.from_lazy_stack(local, **real.kwargs())
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:200]
    s[idx]  # warm
    before = real.commandstats()
    got = s[idx]
    after = real.commandstats()
    assert torch.equal(got["obs"], local["obs"][idx]) and torch.equal(got["small"], local["small"][idx])
    # one MULTI/EXEC of plain GETRANGEs (a scattered read of many ranges, see tdstore._format.wire)
    assert after.get("exec", 0) - before.get("exec", 0) == 1 and after.get("evalsha", 0) == before.get("evalsha", 0)
    # 'small' (14 kB) read whole once, 'obs' (4 MB) one range per row (scattered rows are read in the order asked)
    runs = 1 + int((idx.diff() != 1).sum())
    assert after.get("getrange", 0) - before.get("getrange", 0) == runs + 1


@pytest.mark.parametrize("bad", [0, -1, "4MiB", True, 1.5])
def test_bad_segment_bytes_is_refused_before_anything_is_written(backend, bad):
    with pytest.raises(ValueError, match="segment_bytes must be a positive number of bytes"):
        LazyStackedTensorDictStore.from_lazy_stack(stack(4), segment_bytes=bad, **backend.kwargs())
    with pytest.raises(ValueError, match="segment_bytes"):
        LazyStackedTensorDictStore(count=4, segment_bytes=bad, **backend.kwargs())
    with pytest.raises(ValueError, match="segment_bytes"):
        TensorDictStore.from_tensordict(TensorDict(x=torch.zeros(4, 2), batch_size=[4]), segment_bytes=bad, **backend.kwargs())
    assert not store_keys(backend)


def _scattered_het_read(real, transactions: bool):
    """A store of 900 elements (tok heterogeneous, x homogeneous), a random batch of 200 read twice:
    the store and the server's command counts of the second read, checked against the local stack."""
    n = 900
    local = lazy_stack([TensorDict(tok=torch.arange(i % 5 + 1) + 10 * i, x=torch.tensor([i, -i])) for i in range(n)])
    s = LazyStackedTensorDictStore.from_lazy_stack(local, **real.kwargs())
    s._engine.transactions = transactions  # False: the script's way (a server or ACL user without MULTI)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:200]
    s[idx]  # the first read: scripts loaded, (with transactions) tok's offset tables kept
    before = real.commandstats()
    got = s[idx]
    after = real.commandstats()
    for k, i in enumerate(idx.tolist()):
        assert torch.equal(got[k]["tok"], local[i]["tok"]) and torch.equal(got[k]["x"], local[i]["x"])
    return s, idx, {c: after.get(c, 0) - before.get(c, 0) for c in ("evalsha", "exec", "get", "getrange")}


@pytest.mark.layout
def test_scattered_heterogeneous_rows_read_their_small_tables_whole(real):
    _, _, count = _scattered_het_read(real, transactions=False)
    assert count["evalsha"] == 1
    # x's blob, tok's offset table and its shape table read whole once ('B', 'V'); one GETRANGE per row for tok's data
    assert count["get"] == 3
    assert count["getrange"] == 200


def test_scattered_heterogeneous_rows_read_as_a_transaction_once_the_offsets_are_kept(real):
    s, idx, count = _scattered_het_read(real, transactions=True)  # the first read: read.lua, tables sent back
    segs = s._engine.header.segments
    touched = sorted({i // segs.per for i in idx.tolist()})  # one segment, unless the suite runs with tiny ones
    assert s._engine.offsets.nbytes == sum(8 * (segs.size(k) + 1) for k in touched)
    assert count["evalsha"] == 0 and count["exec"] == 1
    # per segment, tok's offset table read back whole (to check the kept one) and the last byte of its
    # shape table (still there?); its rows' bytes; x's rows. No shape records: one-dim elements' byte
    # sizes tell them
    assert count["getrange"] == 2 * len(touched) + 200 + 200
