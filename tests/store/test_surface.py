"""The TensorDictBase surface, one shared suite for both store classes.

Every row of the README's surface table is exercised on a lazy store with
homogeneous keys, a lazy store with a heterogeneous key, and a dense store, on
redis-server and on fakeredis.  Each call is made on the store and on a local
copy of the same data: results must agree, out-of-place calls must leave the
server unchanged, and in-place calls must leave the server holding what the local
copy holds afterwards.
"""

from __future__ import annotations

import tempfile
from numbers import Number

import pytest
import torch
from helpers import assert_same, round_trips, top_level_commands
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._front.tensordict_api import LOCAL_METHODS, OPERATORS, REFUSED, THROUGH_COPY, SurfaceMixin


def _elements(het: bool) -> list[TensorDict]:
    return [
        TensorDict(
            obs=torch.arange(4.0) + i,
            nested=TensorDict(b=torch.arange(3.0) * (i + 1), batch_size=[]),
            **({"tokens": torch.arange(1.0 + i % 3)} if het else {}),
            batch_size=[],
        )
        for i in range(5)
    ]


@pytest.fixture(params=["lazy-homog", "lazy-het", "dense"])
def kind(request):
    return request.param


@pytest.fixture
def pair(kind, backend):
    """(store, local copy of the same data)."""
    els = _elements(kind == "lazy-het")
    if kind == "dense":
        local = torch.stack(els)
        return TensorDictStore.from_tensordict(local, **backend.kwargs()), local.clone()
    local = lazy_stack(els)
    return LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs()), lazy_stack([e.clone() for e in els])


def same(a, b) -> None:
    """Results agree: tensordicts by value (store results are local copies), tensors, numbers, sequences."""
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        a = a.to_tensordict() if getattr(a, "_tdstore_reads_remote", False) else a
        b = b.to_tensordict() if getattr(b, "_tdstore_reads_remote", False) else b
        if isinstance(a, LazyStackedTensorDict) != isinstance(b, LazyStackedTensorDict):
            a, b = (x if isinstance(x, LazyStackedTensorDict) else lazy_stack(list(x.unbind(0))) for x in (a, b))
        assert_same(a, b)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a.double(), b.double(), equal_nan=True) if a.is_floating_point() else torch.equal(a, b)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, Number) or a is None or isinstance(a, (str, torch.Size)):
        assert a == b, (a, b)
    else:
        raise AssertionError(f"no comparison for {type(a).__name__}")


def snapshot(store):
    return store.to_tensordict()


# -- rows answered on a local copy: (row, call) -------------------------------------------------
#: A heterogeneous store gives a lazy stack here, where a local lazy stack cannot stack its key and raises.
BETTER = {"contiguous", "to_tensordict"}
OTHER = 1.5
LOCAL_ROWS = {
    "abs": lambda t: t.abs(),
    "exp": lambda t: t.exp(),
    "sqrt": lambda t: t.sqrt(),
    "neg": lambda t: t.neg(),
    "add": lambda t: t.add(OTHER),
    "mul": lambda t: t.mul(2),
    "clamp": lambda t: t.clamp(1, 3),
    "maximum": lambda t: t.maximum(t.to_tensordict() if hasattr(t, "_tdstore_reads_remote") else t),
    "isnan": lambda t: t.isnan(),
    "sum": lambda t: t.sum(),
    "sum dim": lambda t: t.sum(dim=1) if "tokens" not in t.keys() else t.exclude("tokens").sum(dim=1),
    "mean": lambda t: t.mean(),
    "max": lambda t: t.max(),
    "all": lambda t: t.all(),
    "any": lambda t: t.any(),
    "double": lambda t: t.double(),
    "to dtype": lambda t: t.to(torch.float64),
    "to cpu": lambda t: t.to("cpu"),
    "cpu": lambda t: t.cpu(),
    "detach": lambda t: t.detach(),
    "apply": lambda t: t.apply(lambda x: x * 2),
    "named_apply": lambda t: t.named_apply(lambda name, x: x + len(name)),
    "split": lambda t: t.split(2),
    "chunk": lambda t: t.chunk(2),
    "unbind other": lambda t: t.unbind(0) if not hasattr(t, "_count") else tuple(v.to_tensordict() for v in t.unbind(0)),
    "flip": lambda t: t.flip(0),
    "roll": lambda t: t.roll(1, 0),
    "reshape": lambda t: t.reshape(5, 1),
    "empty shape": lambda t: t.empty().batch_size,
    "select": lambda t: t.select("obs"),
    "exclude": lambda t: t.exclude("obs"),
    "masked_fill": lambda t: t.masked_fill(torch.tensor([True, False, True, False, True]), 0.0),
    "where": lambda t: t.where(torch.tensor([True, False, True, False, True]), 0.0),
    "replace": lambda t: (
        t.replace(obs=torch.zeros(5, 4)) if "tokens" not in t.keys() else t.exclude("tokens").replace(obs=torch.zeros(5, 4))
    ),
    "tolist": lambda t: t.tolist() if "tokens" not in t.keys() else t.exclude("tokens").tolist(),
    "contiguous": lambda t: t.contiguous(),
    "clone": lambda t: t.clone(),
    "to_tensordict": lambda t: t.to_tensordict(),
    "densify": lambda t: t.densify() if "tokens" not in t.keys() else t.exclude("tokens").densify(),
    "numel": lambda t: t.numel(),
    "is_empty": lambda t: t.is_empty(),
    "batch_size": lambda t: t.batch_size,
    "len": lambda t: len(t),
    "keys": lambda t: sorted(map(str, t.keys())),
    "keys nested": lambda t: sorted(map(str, t.keys(include_nested=True))),
    "keys leaves": lambda t: sorted(map(str, t.keys(include_nested=True, leaves_only=True))),
    "items leaves": lambda t: sorted(
        (str(k), v.to_tensordict() if hasattr(v, "_tdstore_reads_remote") else v)
        for k, v in t.items(include_nested=True, leaves_only=True)
        if k != "tokens"
    )[0][1],
    "values": lambda t: [v for k, v in zip(t.keys(), t.values()) if k == "obs"],
    "get": lambda t: t.get("obs"),
    "get nested": lambda t: t.get(("nested", "b")),
    "get default": lambda t: t.get("missing", None),
    "get_at": lambda t: t.get_at("obs", 2),
    "eq": lambda t: (t == (t.to_tensordict() if hasattr(t, "_tdstore_reads_remote") else t).clone()).all(),
    "ne scalar": lambda t: t != 1.0,
    "lt": lambda t: t < 2.0,
    "add op": lambda t: t + 1,
    "radd op": lambda t: 1 + t,
    "mul op": lambda t: t * 2,
    "truediv op": lambda t: t / 2,
    "neg op": lambda t: -t,
    "torch.stack of elements": lambda t: (
        torch.stack([t[0], t[1]])
        if "tokens" not in t.keys()
        else lazy_stack(
            [
                t[0].to_tensordict() if hasattr(t, "_tdstore_reads_remote") else t[0],
                t[1].to_tensordict() if hasattr(t, "_tdstore_reads_remote") else t[1],
            ]
        )
    ),
    "torch.cat with local": lambda t: torch.cat([t, t.to_tensordict() if hasattr(t, "_tdstore_reads_remote") else t.clone()], 0),
    "torch.stack with local": lambda t: torch.stack([t, t.to_tensordict() if hasattr(t, "_tdstore_reads_remote") else t.clone()], 0),
    "state_dict keys": lambda t: sorted(t.to_tensordict().state_dict() if hasattr(t, "_tdstore_reads_remote") else t.state_dict()),
    "entry_class obs": lambda t: t.entry_class("obs"),
    "names": lambda t: t.names,
}


@pytest.mark.parametrize("row", list(LOCAL_ROWS))
def test_reads_and_local_copies_agree_and_leave_the_server_alone(pair, row, kind):
    store, local = pair
    call = LOCAL_ROWS[row]
    before = snapshot(store)
    try:
        want = call(local)
    except Exception as err:  # the local object refuses: the store must refuse the same way...
        if row in BETTER and kind == "lazy-het":
            assert isinstance(call(store), LazyStackedTensorDict)  # ...except where the store does better (README)
            return
        with pytest.raises(type(err)):
            call(store)
        return
    got = call(store)
    if row == "entry_class obs":
        assert got is want
    elif row == "empty shape":
        assert got == want
    else:
        same(got, want)
    same(snapshot(store), before)


INPLACE_ROWS = {
    "add_": lambda t: t.add_(1.0),
    "mul_": lambda t: t.mul_(2.0),
    "apply_": lambda t: t.apply_(lambda x: x + 3),
    "apply inplace": lambda t: t.apply(lambda x: x - 1, inplace=True),
    "zero_": lambda t: t.zero_(),
    "fill_": lambda t: t.fill_("obs", 7.0),
    "clamp_": lambda t: t.clamp_(1.0, 2.0),
    "masked_fill_": lambda t: t.masked_fill_(torch.tensor([True, False, True, False, True]), -1.0),
    "set_at_": lambda t: t.set_at_("obs", torch.full((4,), 9.0), 1),
    "update_at_": lambda t: t.update_at_({"obs": torch.full((4,), 8.0)}, 3),
    "setitem row": lambda t: t.__setitem__(2, t[2].to_tensordict() * 0 if hasattr(t, "_tdstore_reads_remote") else t[2] * 0),
    "set key": lambda t: t.set("extra", torch.ones(5, 2)),
    "del key": lambda t: t.del_("obs"),
    "pop": lambda t: t.pop("obs"),
    "rename_key_": lambda t: t.rename_key_("obs", "observation"),
    "exclude inplace": lambda t: t.exclude("obs", inplace=True),
    "select inplace": lambda t: t.select("obs", inplace=True),
    "set_non_tensor": lambda t: t.set_non_tensor("label", "x"),
}


@pytest.mark.parametrize("row", list(INPLACE_ROWS))
def test_in_place_calls_leave_the_server_as_the_local_copy(pair, row, kind):
    store, local = pair
    call = INPLACE_ROWS[row]
    if kind == "lazy-het" and row in {"masked_fill_"}:
        pytest.skip("a local lazy stack with a heterogeneous key cannot masked_fill_ either")
    try:
        want = call(local)
    except Exception as err:
        with pytest.raises(type(err)):
            call(store)
        return
    got = call(store)
    if isinstance(want, torch.Tensor):
        same(got, want)
    after = store.to_tensordict()
    same(after, local)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_methods_raise_naming_the_alternative(pair, name):
    store, _ = pair
    with pytest.raises(RuntimeError, match="not supported"):
        getattr(store, name)()
    with pytest.raises(RuntimeError, match="no gradients"):
        store.grad  # noqa: B018


@pytest.mark.parametrize(
    ("name", "call", "hint"),
    [
        ("view", lambda t: t.view(5, 1), "reshape"),
        ("permute", lambda t: t.permute(0), "to_tensordict"),
        ("unsqueeze", lambda t: t.unsqueeze(0), "to_tensordict"),
        ("share_memory_", lambda t: t.share_memory_(), "shared"),
        ("memmap_ in place", lambda t: t.memmap_(tempfile.mkdtemp()), "memmap"),
        ("names set", lambda t: setattr(t, "names", ["time"]), "local copy"),
        ("rename dims", lambda t: t.rename("time"), "local copy"),
        ("vmap", lambda t: torch.vmap(lambda x: x)(t), "vmap"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_views_and_shared_memory_raise_clearly(pair, name, call, hint):
    store, _ = pair
    before = snapshot(store)
    with pytest.raises((RuntimeError, ValueError, NotImplementedError), match=hint):
        call(store)
    same(snapshot(store), before)


def test_memmap_and_state_dict_are_local(pair):
    store, local = pair
    path = tempfile.mkdtemp()
    mm = store.memmap(path)
    assert mm.is_memmap() and not getattr(mm, "_tdstore_reads_remote", False)
    same(mm, local)


def test_unbind_along_the_stack_dim_gives_write_through_views(pair, kind):
    store, local = pair
    parts = store.unbind(0)
    assert len(parts) == 5
    parts[1]["obs"] = torch.full((4,), -5.0)
    if kind == "dense":
        assert not (store["obs"][1] == -5).any()  # dense: local copies, as documented
    else:
        assert (store[1]["obs"] == -5).all()  # lazy: element views, as a lazy stack gives its members


def test_locking_rules(pair, kind):
    store, _ = pair
    store.lock_()
    assert store.is_locked
    with pytest.raises(RuntimeError, match="locked"):
        store.set("new", torch.zeros(5))
    if kind != "dense":
        view = store[0]
        assert not view.is_locked  # the seed's rule: an element view is not locked itself...
        with pytest.raises(RuntimeError, match="locked"):
            view["new"] = torch.zeros(1)  # ...but it refuses new keys of a locked store
        view["obs"] = torch.zeros(4)  # and writes existing ones
    store.unlock_()
    store.set("new", torch.zeros(5))
    assert "new" in store.keys()


@pytest.mark.parametrize("cls", [LazyStackedTensorDictStore, TensorDictStore], ids=["lazy", "dense"])
def test_every_generated_answer_reaches_both_classes(cls):
    """No class in between shadows an answer of the surface module, and each says how it is answered."""
    for name in (*LOCAL_METHODS, *THROUGH_COPY, *OPERATORS, *REFUSED):
        method = getattr(cls, name)
        assert getattr(SurfaceMixin, name) is method, f"{cls.__name__}.{name} is shadowed"
        assert any(w in (method.__doc__ or "") for w in ("local copy", "Through a copy", "Not supported")), name


@pytest.mark.parametrize(
    ("call", "reads"),
    [
        (lambda s: s + 1, 1),
        (lambda s: s.sum(), 1),
        (lambda s: s.apply(lambda x: x * 2), 1),
        (lambda s: s.select("obs"), 1),
        (lambda s: torch.stack([s[0], s[1]]), 2),  # one read per element given
        (lambda s: s == s.to_tensordict(), 2),  # the lambda's own to_tensordict(), then eq's copy
    ],
    ids=["add", "sum", "apply", "select", "torch.stack of two elements", "eq"],
)
def test_local_copies_read_the_store_once(real, call, reads):
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(_elements(False)), **real.kwargs())
    store[0].to_tensordict()  # warm
    assert len(round_trips(top_level_commands(real.client, lambda: call(store)))) == reads
