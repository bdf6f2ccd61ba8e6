"""One write surface, one rule: the same writes through every handle (a lazy store, an element
view, a dense store, a sub-tree view of each) against the same writes on a local TensorDict.

The rule (``_front.write_surface``): ``set``/``update``/``[key] =``/``[index] =`` create a missing key;
``set_``/``update_``/``set_at_``/``update_at_`` raise ``KeyError`` on one, before anything is
written; a locked handle (an element view: its store) refuses new keys and writes existing
ones in place.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore

HANDLES = ["lazy", "element", "element-subtree", "dense", "dense-subtree"]


def _local() -> TensorDict:
    return TensorDict(
        obs=torch.arange(12, dtype=torch.float32).reshape(4, 3),
        nested=TensorDict(b=torch.arange(4) * 10, c=torch.ones(4, 2), batch_size=[4]),
        batch_size=[4],
    )


class Case:
    """A handle, the store it writes, the local TensorDict it mirrors, and how to lock it."""

    def __init__(self, kind: str, backend) -> None:
        full = _local()
        if kind in ("lazy", "element", "element-subtree"):
            self.store = LazyStackedTensorDictStore.from_lazy_stack(full, **backend.kwargs())
        else:
            self.store = TensorDictStore.from_tensordict(full, **backend.kwargs())
        self.kind = kind
        mirrors = {"lazy": full, "dense": full, "element": full[1], "element-subtree": full[1]["nested"], "dense-subtree": full["nested"]}
        self.local = mirrors[kind].clone()
        self.handle = self.open()

    def open(self):
        s = self.store
        if self.kind in ("lazy", "dense"):
            return s
        if self.kind == "element":
            return s[1]
        return s[1]["nested"] if self.kind == "element-subtree" else s["nested"]

    def lock(self):
        """Lock what governs the handle's writes (an element view's store) and return a handle under it."""
        if self.kind.startswith("element"):
            self.store.lock_()
            return self.handle
        self.store.lock_()
        return self.open()  # a sub-tree view opened from a locked store is locked

    def check(self) -> None:
        assert_same(self.handle.to_tensordict(), self.local)


@pytest.fixture(params=HANDLES)
def case(request, one_node):
    c = Case(request.param, one_node)
    yield c
    c.store.clear_redis()


def _value(case: Case, feat=(), dtype=torch.float32, fill=7.0) -> torch.Tensor:
    return torch.full((*case.local.batch_size, *feat), fill, dtype=dtype)


def test_in_place_writes_of_a_missing_key_raise_before_writing(case):
    h = case.handle
    keys = sorted(h.keys(include_nested=True, leaves_only=True), key=str)
    rows = case.local.batch_size[0] if case.local.batch_size else None
    calls = {
        "set_": lambda: h.set_("absent", _value(case)),
        "update_": lambda: h.update_({"absent": _value(case), "b" if "subtree" in case.kind else "obs": _value(case)}),
        "update(inplace=True)": lambda: h.update({"absent": _value(case)}, inplace=True),
        "set_at_": lambda: h.set_at_("absent", torch.zeros(()), 0) if rows else h.set_at_("absent", torch.zeros(()), ()),
        "update_at_": lambda: h.update_at_({"absent": torch.zeros(())}, 0 if rows else ()),
    }
    for name, call in calls.items():
        with pytest.raises(KeyError, match=f"absent.*{name.split('(')[0].rstrip('_')}_ writes existing keys only"):
            call()
    assert sorted(h.keys(include_nested=True, leaves_only=True), key=str) == keys
    case.check()


def test_new_keys_are_created_by_set_update_and_index_writes(case):
    h, local = case.handle, case.local
    h.set("new", _value(case, (2,)))
    local.set("new", _value(case, (2,)))
    h.update({"other": _value(case, dtype=torch.int16, fill=3)})
    local.update({"other": _value(case, dtype=torch.int16, fill=3)})
    case.check()
    assert h.entry_class("new") is torch.Tensor and "new" in h.keys()


def test_existing_keys_written_every_way(case):
    h, local = case.handle, case.local
    key = "c" if "subtree" in case.kind else "obs"
    feat = tuple(local[key].shape[local.batch_dims :])
    h.set_(key, _value(case, feat, fill=1.0))
    local.set_(key, _value(case, feat, fill=1.0))
    h.update_({key: _value(case, feat, fill=2.0)})
    local.update_({key: _value(case, feat, fill=2.0)})
    idx = 2 if local.batch_size else ()
    h.set_at_(key, torch.full(feat, 3.0), idx)
    local.set_at_(key, torch.full(feat, 3.0), idx)
    h.update_at_({key: torch.full(feat, 4.0)}, idx)
    local.update_at_({key: torch.full(feat, 4.0)}, idx)
    case.check()
    if local.batch_size:
        h[1] = local[0]
        local[1] = local[0]
        h[0] = 5  # a number fills every leaf of the handle (of a sub-tree view: its leaves only)
        local[0] = 5
        case.check()
    h.fill_(key, 9)
    local.fill_(key, 9)
    case.check()
    h.zero_()
    local.zero_()
    case.check()
    h.apply_(lambda t: t + 1)
    local.apply_(lambda t: t + 1)
    case.check()
    with pytest.raises(TypeError, match="ambiguous"):
        h[idx] = torch.zeros(3)


def test_a_number_written_at_an_index_stays_in_the_handles_scope(case):
    if not case.local.batch_size:
        pytest.skip("an element of an element view has no rows to index")
    outside = case.store.to_tensordict().exclude(*[("nested", k) for k in ("b", "c")]) if "subtree" in case.kind else None
    case.handle[0] = 5
    case.local[0] = 5
    case.check()
    if outside is not None:  # a sub-tree view's number reaches no leaf outside its sub-tree
        assert_same(case.store.to_tensordict().exclude(*[("nested", k) for k in ("b", "c")]), outside)


def test_replacing_a_key_with_another_dtype_needs_the_whole_stack(case):
    h = case.handle
    key = "c" if "subtree" in case.kind else "obs"
    feat = tuple(case.local[key].shape[case.local.batch_dims :])
    if case.kind.startswith("element"):  # one element: a key keeps its dtype
        with pytest.raises(TypeError, match=key):
            h.set(key, _value(case, feat, dtype=torch.float64))
        case.check()
        return
    h.set(key, _value(case, feat, dtype=torch.float64))
    case.local.set(key, _value(case, feat, dtype=torch.float64))
    case.check()


def test_a_locked_handle_refuses_new_keys_and_writes_existing_ones_in_place(case):
    h = case.lock()
    key = "c" if "subtree" in case.kind else "obs"
    feat = tuple(case.local[key].shape[case.local.batch_dims :])
    for write in (
        lambda: h.set("new", _value(case)),
        lambda: h.update({"new": _value(case)}),
        lambda: h.__setitem__("new", _value(case)),
        lambda: h.__setitem__(0 if case.local.batch_size else (), {"new": torch.zeros(())}),
    ):
        with pytest.raises(RuntimeError, match="locked"):
            write()
    assert "new" not in h.keys()
    with pytest.raises(TypeError, match=key):  # in place: the key keeps its dtype
        h.set(key, _value(case, feat, dtype=torch.float64))
    h.set(key, _value(case, feat, fill=6.0))
    case.local.set(key, _value(case, feat, fill=6.0))
    case.check()
    h.update({"new": _value(case)}, ignore_lock=True)
    case.local.update({"new": _value(case)})
    case.check()
