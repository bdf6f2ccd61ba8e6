"""The upload's fast paths (``_front.upload_scan``: plain members key by key, dense columns, gathered
columns sliced into chunks) store what the general element-by-element path stores."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch
from helpers import assert_same, make_stack
from tensordict import NonTensorData, TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._front import upload as _upload
from tdstore._front import upload_scan as _upload_scan


def ragged_2d(n: int = 7) -> TensorDict:
    """Elements whose key ``m`` differs in its first dim only, and ``w`` in its last (torch.cat of ``w`` needs reshapes)."""
    return lazy_stack(
        [
            TensorDict(
                m=torch.arange(6 * (1 + i % 3), dtype=torch.float64).reshape(1 + i % 3, 6) + i,
                w=torch.arange(2 * (1 + i % 4), dtype=torch.int16).reshape(2, 1 + i % 4) - i,
                x=torch.tensor(float(i)),
            )
            for i in range(n)
        ]
    )


def upload_back(backend, local, **kw) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs(**kw.pop("store", {})), **kw)
    try:
        assert_same(store.to_tensordict(), local)
    finally:
        store.clear_redis()


@pytest.mark.parametrize("block", [512, 4], ids=["one-block", "blocks-of-4"])
@pytest.mark.parametrize("chunk_bytes", [64 << 20, 150], ids=["gathered", "per-chunk"])
def test_plain_members_round_trip(backend, monkeypatch, chunk_bytes, block):
    """Gathered in the scan (sliced per chunk) or stacked chunk by chunk, in one block or many: the same store."""
    monkeypatch.setattr(_upload_scan, "_BLOCK", block)
    upload_back(backend, make_stack(13), chunk_bytes=chunk_bytes)
    upload_back(backend, ragged_2d(), chunk_bytes=chunk_bytes, chunk_elements=3)


def test_ragged_keys_gathered_in_pieces(backend, monkeypatch):
    """Keys are joined in pieces of at most ``_SERIAL`` items, in blocks of ``_BLOCK`` elements; the seams move nothing."""
    monkeypatch.setattr(_upload_scan, "_SERIAL", 5)
    monkeypatch.setattr(_upload_scan, "_BLOCK", 7)
    upload_back(backend, make_stack(40))
    upload_back(backend, ragged_2d(11))


def test_small_segments_cut_gathered_columns(backend):
    local = make_stack(30)
    upload_back(backend, local, store={"segment_bytes": 64})


@pytest.mark.parametrize("inner", [(), (2,)], ids=["flat", "inner"])
def test_dense_tensordicts_upload_their_columns(backend, inner):
    """A dense tensordict is never unbound: its columns are the stack, sub-trees with more batch dims included."""
    n = 9
    local = TensorDict(
        obs=torch.randn(n, *inner, 3),
        flag=torch.arange(n * int(np.prod(inner or (1,)))).reshape(n, *inner) % 2 == 0,
        chat=TensorDict(prompt=torch.arange(n * int(np.prod(inner or (1,))) * 5).reshape(n, *inner, 5, 1), batch_size=[n, *inner, 5]),
        batch_size=[n, *inner],
    )
    found = _upload._scan(local, 1 << 20)
    assert found.count == n and found.inner == inner and found.sub == {("chat",): (5,)}
    assert all(leaf.packed is not None and not leaf.tensors for leaf in found.leaves)
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    try:
        assert_same(store.to_tensordict(), local)
    finally:
        store.clear_redis()
    upload_back(backend, local)


def test_dense_non_tensor_data_goes_element_by_element(backend):
    local = TensorDict(x=torch.arange(4), note=NonTensorData("hi", batch_size=[4]), batch_size=[4])
    assert _upload_scan.scan_dense(local) is None
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    try:
        assert store[2]["note"] == "hi" and torch.equal(store["x"], local["x"])
    finally:
        store.clear_redis()


@pytest.mark.parametrize(
    "bad",
    [
        lambda els: els[5].set("obs", els[5]["obs"].double()),  # two dtypes
        lambda els: els[5].set("obs", els[5]["obs"][None]),  # two numbers of dims
        lambda els: els[5].del_("obs"),  # a key some elements lack
        lambda els: els[5].set("extra", torch.zeros(1)),  # a key some elements add
        lambda els: els[5].set(("nested", "c"), torch.zeros(1)),  # the same, one level down
    ],
    ids=["dtype", "ndim", "missing", "extra", "nested-extra"],
)
@pytest.mark.parametrize("block", [512, 4], ids=["one-block", "blocks-of-4"])
def test_fast_scan_hands_bad_input_to_the_general_scan(backend, monkeypatch, bad, block):
    """Anything unusual leaves the fast scan (None), and the upload raises, naming the key, before writing."""
    monkeypatch.setattr(_upload_scan, "_BLOCK", block)
    local = make_stack(7)
    els = list(local.tensordicts)
    bad(els)
    assert _upload_scan.scan_plain(els, 1 << 20) is None
    with pytest.raises((TypeError, ValueError), match="obs|keys|nested"):
        LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(els), **backend.kwargs())
    assert backend.keys() == []


def test_batch_packs_the_commands_redis_py_packs():
    """An upload's round trip, packed without copying its values, is byte for byte what redis-py sends."""
    conn = redis.Connection()
    big = memoryview(bytes(range(256)) * 300)  # above _BIG: sent as it is
    commands = [("SETRANGE", "k:é", 7, big), ("SETRANGE", "k2", 0, b"ab"), ("PEXPIRE", "k", 120_000), ("HSET", "g", "f", 1.5)]
    packed = _upload._pack(conn.encoder.encode, commands)
    assert any(part is big for part in packed)
    expected = b"".join(bytes(p) for p in conn.pack_commands(commands))
    assert b"".join(bytes(p) for p in packed) == expected


def test_upload_on_redis_sends_no_pipeline(real, monkeypatch):
    """On redis-py's plain client the chunks go through ``Batch`` (values uncopied), not a pipeline."""

    def refuse(*args, **kwargs):
        raise AssertionError("a pipeline was used")

    monkeypatch.setattr(redis.Redis, "pipeline", refuse)
    upload_back(real, make_stack(8), chunk_elements=3)
