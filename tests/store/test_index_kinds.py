"""One meaning per index: every call that takes an index reads it as torch indexing does.

A table of index kinds (ints, lists, ranges, slices, int tensors and arrays: positions; bool and
uint8 tensors, lists and arrays: masks) crossed with every call that takes one (``store[i]``,
``store[i] = x``, ``get_at``, ``set_at_``, ``update_priority``, ``update_if``), each compared with
what ``torch.arange(CAP)[index]`` selects. Before, ``update_priority(mask_u8, p)`` read a uint8
mask's 0/1 values as slots 0 and 1. Kinds a store refuses (floats, a 0-dim mask, a mask of the
wrong length, a slot out of range) raise ``IndexError`` from every call, before anything changes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore

CAP = 8
MARK = -7

MASK = [True, False, True, True, False, False, False, True]
KINDS: dict[str, Any] = {
    "int": 3,
    "negative int": -2,
    "numpy int": np.int64(5),
    "0-dim int64 tensor": torch.tensor(4),
    "list": [1, 6, 3],
    "list with negatives": [-1, 0],
    "list with a repeat": [2, 2, 5],
    "empty list": [],
    "range": range(2, 5),
    "slice": slice(1, 7, 2),
    "reversed slice": slice(None, None, -3),
    "ellipsis": ...,
    "int64 tensor": torch.tensor([7, 0, 4]),
    "int32 tensor": torch.tensor([6, 1], dtype=torch.int32),
    "2-d int tensor": torch.tensor([[0, 1], [5, 2]]),
    "numpy int array": np.array([4, 3], dtype=np.int32),
    "bool tensor": torch.tensor(MASK),
    "uint8 tensor": torch.tensor(MASK, dtype=torch.uint8),
    "bool list": MASK,
    "bool numpy array": np.array(MASK),
    "uint8 numpy array": np.array(MASK, dtype=np.uint8),
    "uint8 tensor of 0/1 with slot numbers' look": torch.tensor([0, 1, 0, 0, 0, 0, 1, 0], dtype=torch.uint8),
}
REFUSED: dict[str, Any] = {
    "float": 1.5,
    "float tensor": torch.tensor([0.0, 1.0]),
    "float list": [0.0, 1.0],
    "0-dim bool tensor": torch.tensor(True),
    "python bool": True,
    "mask of the wrong length": torch.ones(CAP - 1, dtype=torch.bool),
    "uint8 mask of the wrong length": torch.ones(3, dtype=torch.uint8),
    "slot out of range": [0, CAP],
    "negative slot out of range": -CAP - 1,
}


def _quiet(fn: Callable[[], Any]) -> Any:
    """``fn()`` without torch's deprecation warning for uint8 masks (the store raises the same one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn()


def _torch_picks(index: Any) -> torch.Tensor:
    """What torch indexing selects from a dim of CAP positions (the reference meaning; a slice with a
    negative step, which torch lacks, as Python and numpy read it)."""
    if isinstance(index, slice):
        return torch.arange(CAP)[list(range(CAP))[index]]
    return _quiet(lambda: torch.arange(CAP)[index])


def _ring(backend: Any) -> LazyStackedTensorDictStore:
    """A full ring of CAP slots, slot s tagged s, every slot at generation 1."""
    store = LazyStackedTensorDictStore(count=CAP, **backend.kwargs())
    obs = torch.arange(CAP, dtype=torch.float32)[:, None].expand(CAP, 2).clone()
    store.extend(TensorDict(tag=torch.arange(CAP), obs=obs, batch_size=[CAP]))
    return store


def _tags(store: LazyStackedTensorDictStore) -> list[int]:
    return store.get("tag").tolist()


def _expected_after_write(index: Any) -> list[int]:
    local = torch.arange(CAP)
    local[_torch_picks(index)] = MARK
    return local.tolist()


def _read(store: LazyStackedTensorDictStore, index: Any) -> None:
    got = _quiet(lambda: store[index])
    want = _torch_picks(index)
    assert got["tag"].shape == want.shape and got["tag"].tolist() == want.tolist()


def _get_at(store: LazyStackedTensorDictStore, index: Any) -> None:
    got = _quiet(lambda: store.get_at("tag", index))
    assert torch.equal(got, _torch_picks(index))


def _write(store: LazyStackedTensorDictStore, index: Any) -> None:
    _quiet(lambda: store.__setitem__(index, MARK))
    assert _tags(store) == _expected_after_write(index)


def _set_at(store: LazyStackedTensorDictStore, index: Any) -> None:
    shape = _torch_picks(index).shape
    _quiet(lambda: store.set_at_("tag", torch.full(shape, MARK), index))
    assert _tags(store) == _expected_after_write(index)


def _update_priority(store: LazyStackedTensorDictStore, index: Any) -> None:
    """Slots the index selects get priority 5, the others keep 1: the probability of every drawn row
    tells which slots the call changed (4096 draws reach each of 8 slots but with probability < 1e-40)."""
    picked = set(_torch_picks(index).reshape(-1).tolist())
    applied = _quiet(lambda: store.update_priority(index, 5.0))
    assert applied.shape == (_torch_picks(index).numel(),) and bool(applied.all())
    s = store.sample(4096, generator=torch.Generator().manual_seed(0), prioritized=True)
    total = 5.0 * len(picked) + (CAP - len(picked))
    want = torch.tensor([(5.0 if slot in picked else 1.0) / total for slot in s.indices.tolist()], dtype=torch.float64)
    assert set(s.indices.tolist()) == set(range(CAP))
    assert torch.allclose(s.probabilities, want)


def _update_if(store: LazyStackedTensorDictStore, index: Any) -> None:
    picks = _torch_picks(index)
    n = picks.numel()
    if picks.ndim == 0:  # one slot: one element
        value: Any = TensorDict(tag=torch.tensor(MARK))
    else:
        value = TensorDict(tag=torch.full((n,), MARK), batch_size=[n])
    applied = _quiet(lambda: store.update_if(index, torch.ones(n, dtype=torch.int64), value))
    assert applied.tolist() == [True] * n
    assert _tags(store) == _expected_after_write(index)


CALLS: dict[str, Callable[[LazyStackedTensorDictStore, Any], None]] = {
    "store[i]": _read,
    "get_at": _get_at,
    "store[i] = x": _write,
    "set_at_": _set_at,
    "update_priority": _update_priority,
    "update_if": _update_if,
}

# a 2-d position tensor keeps its shape in a read and a write; update_if takes one element per slot
_SKIP = {("2-d int tensor", "update_if")}

#: The calls with values that fit any index: a refused index must raise before its value is looked at.
RAW_CALLS: dict[str, Callable[[LazyStackedTensorDictStore, Any], Any]] = {
    "store[i]": lambda store, index: store[index],
    "get_at": lambda store, index: store.get_at("tag", index),
    "store[i] = x": lambda store, index: store.__setitem__(index, MARK),
    "set_at_": lambda store, index: store.set_at_("tag", torch.full((2,), MARK), index),
    "update_priority": lambda store, index: store.update_priority(index, 5.0),
    "update_if": lambda store, index: store.update_if(index, 1, TensorDict(tag=torch.tensor(MARK))),
}
BOTH = pytest.mark.parametrize("backend", ["redis", "fakeredis"], indirect=True)


@pytest.mark.ring
@BOTH
@pytest.mark.parametrize("call", list(CALLS))
def test_every_call_reads_an_index_as_torch_does(backend, call):
    for kind, index in KINDS.items():
        if (kind, call) in _SKIP:
            continue
        store = _ring(backend)
        if call == "update_priority":
            store.enable_priorities(alpha=1.0)
        try:
            CALLS[call](store, index)
        except Exception as err:  # name the failing kind
            raise AssertionError(f"{call} with index kind {kind!r}: {type(err).__name__}: {err}") from err
        finally:
            store.clear_redis()


@pytest.mark.ring
@BOTH
@pytest.mark.parametrize("call", list(CALLS))
def test_every_call_refuses_the_same_index_kinds_before_writing(backend, call):
    store = _ring(backend)
    store.enable_priorities(alpha=1.0)
    try:
        before = _tags(store)
        for kind, index in REFUSED.items():
            with pytest.raises(IndexError):
                _quiet(lambda index=index: RAW_CALLS[call](store, index))
            assert _tags(store) == before, kind
            assert store.write_count == CAP, kind
        s = store.sample(256, generator=torch.Generator().manual_seed(1), prioritized=True)
        assert torch.allclose(s.probabilities, torch.full((256,), 1 / CAP, dtype=torch.float64))  # no priority moved
    finally:
        store.clear_redis()


@pytest.mark.ring
@BOTH
def test_a_uint8_mask_is_never_read_as_slots_0_and_1(backend):
    """The issue's case: update_priority(mask_u8, 9.0) boosted slots 0 and 1; now the masked slots."""
    store = _ring(backend)
    try:
        store.enable_priorities(alpha=1.0)
        mask = torch.zeros(CAP, dtype=torch.uint8)
        mask[[4, 6]] = 1
        with pytest.warns(UserWarning, match="uint8"):
            store.update_priority(mask, 9.0)
        s = store.sample(2048, generator=torch.Generator().manual_seed(2), prioritized=True)
        boosted = {slot for slot, p in zip(s.indices.tolist(), s.probabilities.tolist()) if p > 1 / CAP}
        assert boosted == {4, 6}
    finally:
        store.clear_redis()
