"""Bad calls raise a clear exception before anything is written; the store stays intact and usable.

Each case names what it does wrong; the server content under the test prefix is
snapshotted before the call and compared byte for byte after it.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_stack
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, StoreFormatError


def el(**over):
    base = {
        "obs": torch.zeros(4),
        "done": torch.zeros(1, dtype=torch.bool),
        ("nested", "b"): torch.zeros(3, dtype=torch.int64),
        "tokens": torch.zeros(2, dtype=torch.int64),
    }
    base.update(over)
    td = TensorDict()
    for k, v in base.items():
        if v is not None:
            td.set(k, v)
    return td


def rows(n, **over):
    return lazy_stack([el(**over) for _ in range(n)])


# (id, callable(store), exception type, text the message must contain)
CASES = [
    ("index past the end", lambda s: s[6], IndexError, "6"),
    ("negative index past the start", lambda s: s[-7], IndexError, "-7"),
    ("index tensor out of range", lambda s: s[torch.tensor([0, 9])], IndexError, "9"),
    ("list out of range", lambda s: s[[1, -8]], IndexError, "-8"),
    ("float index tensor", lambda s: s[torch.tensor([0.5])], IndexError, "float"),
    ("mask too short", lambda s: s[torch.tensor([True, False])], IndexError, "mask"),
    ("mask too long", lambda s: s[torch.ones(7, dtype=torch.bool)], IndexError, "mask"),
    ("too many indices", lambda s: s[0, 0], IndexError, "too many"),
    ("None index", lambda s: s[None], IndexError, "None"),
    ("bool index", lambda s: s[True], IndexError, "bool"),
    ("two ellipses", lambda s: s[..., ...], IndexError, "ellipsis"),
    ("string slice", lambda s: s["a":"b"], IndexError, "slice"),
    ("zero step", lambda s: s[::0], ValueError, "step"),
    ("missing key read", lambda s: s["nope"], KeyError, "nope"),
    ("missing nested key read", lambda s: s["nested", "zz"], KeyError, "zz"),
    ("missing key in element", lambda s: s[0]["nope"], KeyError, "nope"),
    ("write past the end", lambda s: s.__setitem__(6, el()), IndexError, "6"),
    ("write negative past start", lambda s: s.__setitem__(-7, el()), IndexError, "-7"),
    ("element write wrong dtype", lambda s: s.__setitem__(1, el(obs=torch.zeros(4, dtype=torch.float64))), TypeError, "obs"),
    ("element write wrong ndim", lambda s: s.__setitem__(1, el(obs=torch.zeros(2, 2))), ValueError, "obs"),
    ("element write heterogeneous ndim", lambda s: s.__setitem__(1, el(tokens=torch.zeros(2, 2, dtype=torch.int64))), ValueError, "tokens"),
    (
        "element write new key beside a bad one",
        lambda s: s.__setitem__(1, el(obs=torch.zeros(2, 2), extra=torch.zeros(1))),
        ValueError,
        "obs",
    ),
    ("element key write wrong dtype", lambda s: s[1].__setitem__("obs", torch.zeros(4, dtype=torch.int32)), TypeError, "obs"),
    ("element key write new key of junk", lambda s: s[1].__setitem__("fresh", object()), TypeError, "fresh"),
    ("element update with junk", lambda s: s[1].update({"obs": "text"}), TypeError, "obs"),
    ("element write non-tensor leaf", lambda s: s.__setitem__(1, {"obs": [1.0, 2.0, 3.0, 4.0]}), TypeError, "obs"),
    ("element write string value", lambda s: s.__setitem__(1, "junk"), TypeError, "str"),
    ("element write bare tensor", lambda s: s.__setitem__(1, torch.zeros(4)), TypeError, "ambiguous"),
    ("slice write too few elements", lambda s: s.__setitem__(slice(0, 3), rows(2)), ValueError, "elements"),
    ("slice write too many elements", lambda s: s.__setitem__(slice(0, 2), rows(3)), ValueError, "elements"),
    ("index write wrong count", lambda s: s.__setitem__(torch.tensor([0, 1]), rows(3)), ValueError, "elements"),
    ("mask write wrong mask length", lambda s: s.__setitem__(torch.tensor([True, False, True]), rows(2)), IndexError, "mask"),
    (
        "mask write wrong count",
        lambda s: s.__setitem__(torch.tensor([True, False, True, False, False, False]), rows(3)),
        ValueError,
        "elements",
    ),
    ("slice write wrong dtype", lambda s: s.__setitem__(slice(0, 2), rows(2, done=torch.zeros(1))), TypeError, "done"),
    (
        "slice write dtype in one element only",
        lambda s: s.__setitem__(slice(0, 2), lazy_stack([el(), el(obs=torch.zeros(4, dtype=torch.float16))])),
        TypeError,
        "obs",
    ),
    (
        "slice write new key beside a wrong dtype",
        lambda s: s.__setitem__(slice(0, 2), rows(2, other=torch.zeros(1), done=torch.zeros(1))),
        TypeError,
        "done",
    ),
    ("set wrong batch size", lambda s: s.set("obs", torch.zeros(5, 4)), ValueError, "obs"),
    ("set new key wrong batch size", lambda s: s.set("new", torch.zeros(3)), ValueError, "new"),
    ("set_ missing key", lambda s: s.set_("nope", torch.zeros(6)), KeyError, "nope"),
    ("set_ wrong dtype", lambda s: s.set_("obs", torch.zeros(6, 4, dtype=torch.float64)), TypeError, "obs"),
    ("set_at_ missing key", lambda s: s.set_at_("nope", torch.zeros(4), 0), KeyError, "nope"),
    ("set_at_ wrong dtype", lambda s: s.set_at_("obs", torch.zeros(4, dtype=torch.int64), 0), TypeError, "obs"),
    ("set_at_ wrong shape", lambda s: s.set_at_(("nested", "b"), torch.zeros(2, 3, dtype=torch.int64), slice(0, 3)), ValueError, "nested"),
    ("set non-tensor", lambda s: s.set("s", object()), TypeError, "s"),
    ("set leaf under a leaf", lambda s: s.set(("obs", "x"), torch.zeros(6)), KeyError, "obs"),
    ("set parent of a leaf", lambda s: s.set("nested", torch.zeros(6)), KeyError, "nested"),
    ("update with wrong batch", lambda s: s.update(TensorDict(obs=torch.zeros(3, 4), batch_size=[3])), ValueError, "obs"),
    ("update_ missing key", lambda s: s.update_(TensorDict(nope=torch.zeros(6), batch_size=[6])), KeyError, "nope"),
    ("update_at_ missing key", lambda s: s.update_at_({"nope": torch.zeros(4)}, 0), KeyError, "nope"),
    ("del missing key", lambda s: s.__delitem__("nope"), KeyError, "nope"),
    ("rename missing key", lambda s: s.rename_key_("nope", "other"), KeyError, "nope"),
    ("rename onto existing key", lambda s: s.rename_key_("obs", "done"), KeyError, "done"),
    ("rename under a leaf", lambda s: s.rename_key_("obs", ("done", "x")), KeyError, "done"),
    ("delete from one element", lambda s: s[0].__delitem__("obs"), RuntimeError, "del store"),
    ("rename in one element", lambda s: s[0].rename_key_("obs", "o"), RuntimeError, "rename_key_"),
    ("fill heterogeneous key with number", lambda s: s.__setitem__(slice(0, 2), 0), NotImplementedError, "tokens"),
    ("batch size change", lambda s: setattr(s, "batch_size", [3]), RuntimeError, "fixed"),
    ("view", lambda s: s.view(-1), RuntimeError, "view"),
    ("permute", lambda s: s.permute(0), RuntimeError, "permute"),
    ("share_memory_", lambda s: s.share_memory_(), NotImplementedError, "share_memory_"),
    ("memmap_ in place", lambda s: s.memmap_(), RuntimeError, "memmap"),
    ("flatten_keys in place", lambda s: s.flatten_keys(inplace=True), ValueError, "in place"),
    ("from_dict", lambda s: type(s).from_dict({"a": torch.zeros(2)}), NotImplementedError, "from_lazy_stack"),
    ("unsupported dtype", lambda s: s.set("q", torch.quantize_per_tensor(torch.zeros(6), 0.1, 0, torch.qint8)), TypeError, "qint8"),
    ("nested tensor value", lambda s: s.set("nt", torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])), TypeError, "nt"),
]


def snapshot(client, prefix):
    out = {}
    for key in sorted(client.keys(prefix + ":*")):
        kind = client.type(key)
        out[key] = client.hgetall(key) if kind == b"hash" else client.smembers(key) if kind == b"set" else client.get(key)
    return out


@pytest.fixture
def store(backend):
    s = LazyStackedTensorDictStore.from_lazy_stack(make_stack(6, het=True), **backend.kwargs())
    yield s
    s.clear_redis()


@pytest.mark.parametrize(("name", "call", "exc", "text"), CASES, ids=[c[0] for c in CASES])
def test_bad_call_raises_before_writing(backend, store, name, call, exc, text):
    before = snapshot(backend.client(), backend.prefix)
    local_before = store.to_tensordict()
    with pytest.raises(exc) as err:
        call(store)
    assert text.lower() in str(err.value).lower(), f"{name}: {err.value!r}"
    assert snapshot(backend.client(), backend.prefix) == before, name
    # still usable
    store[0] = store[1].to_tensordict()
    assert store[0]["tokens"].tolist() == local_before[1]["tokens"].tolist()


def test_number_of_bad_calls():
    assert len(CASES) >= 50


CONSTRUCTOR_CASES = [
    ("count 0", {"count": 0}, ValueError, "count"),
    ("negative count", {"count": -3}, ValueError, "count"),
    ("float count", {"count": 2.5}, ValueError, "count"),
    ("huge count", {"count": 2**41}, ValueError, "too large"),
    ("stack_dim out of range", {"count": 3, "stack_dim": 2, "inner_batch_size": [4]}, ValueError, "stack_dim"),
    ("negative inner size", {"count": 3, "inner_batch_size": [-1]}, ValueError, "inner_batch_size"),
    ("inner size not a sequence", {"count": 3, "inner_batch_size": 4}, TypeError, "inner_batch_size"),
    ("credential_provider", {"count": 3, "credential_provider": object()}, TypeError, "credential_provider"),
]


@pytest.mark.parametrize(("name", "kwargs", "exc", "text"), CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_bad_constructor_arguments_write_nothing(backend, name, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        LazyStackedTensorDictStore(**backend.kwargs(**kwargs))
    assert backend.keys() == []


def test_glob_and_brace_ids_are_private(backend):
    for td_id in ("*", "a{b}c", "[x]?", "}{", "%7B"):
        s = LazyStackedTensorDictStore(count=2, td_id=td_id, **backend.kwargs())
        s.set("x", torch.full((2,), float(len(td_id))))
    for td_id in ("*", "a{b}c", "[x]?", "}{", "%7B"):
        s = LazyStackedTensorDictStore.from_store(td_id=td_id, **backend.kwargs())
        assert s["x"].tolist() == [float(len(td_id))] * 2
        s.clear_redis()
    assert backend.keys() == []


def test_empty_stack_upload_raises(backend):
    from tensordict import LazyStackedTensorDict

    with pytest.raises((ValueError, RuntimeError)):
        LazyStackedTensorDictStore.from_lazy_stack(LazyStackedTensorDict(stack_dim=0), **backend.kwargs())
    assert backend.keys() == []


@pytest.mark.parametrize(
    ("field", "value", "text"),
    [
        ("schema", "{not json", "corrupt"),
        ("format", "999", "format"),
        ("count", "-1", "count"),
        ("inner", '["a"]', "inner"),
        ("schema", '{"next": 1, "leaves": [{"path": ["x"], "n": 0, "dtype": "os.system", "ndim": 1, "shape": [2]}]}', "dtype"),
        ("schema", '{"next": 1, "leaves": [{"path": [], "n": 0, "dtype": "float32", "ndim": 1, "shape": [2]}]}', "path"),
    ],
)
def test_corrupted_or_foreign_header_is_refused(backend, store, field, value, text):
    client = backend.client()
    meta = store._engine.keys.meta
    client.hset(meta, field, value)
    with pytest.raises(Exception, match=text) as err:
        LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert isinstance(err.value, (StoreFormatError, ValueError))  # a value out of range: HeaderDamagedError, a StoreFormatError too


def test_store_of_the_reference_layout_is_not_read(backend):
    client = backend.client()
    # keys as tensordict.store writes them: not ours, never parsed
    client.set(f"{backend.prefix}:ref-id:__type__", "lazy_stack")
    client.set(f"{backend.prefix}:ref-id:__count__", "3")
    with pytest.raises(KeyError, match="ref-id"):
        LazyStackedTensorDictStore.from_store(td_id="ref-id", **backend.kwargs())


def test_server_without_scripting_gives_a_clear_error(real):
    client = real.client()
    client.execute_command("ACL", "SETUSER", "noscript", "on", ">pw", "~*", "+@all", "-evalsha", "-eval", "-script")
    with pytest.raises(PermissionError, match="ACL"):
        LazyStackedTensorDictStore(count=2, url=real.server.url.replace("unix://", "unix://noscript:pw@"), prefix=real.prefix)
    assert real.keys() == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fill_with_a_value_the_dtype_cannot_hold_raises_as_torch_and_writes_nothing(backend, dtype):
    """``fill_`` casts as ``Tensor.fill_`` does, overflow check included: 1e40 into float16 raises (it wrote inf)."""
    from tdstore import TensorDictStore

    local = TensorDict(x=torch.ones(3, 2, dtype=dtype), y=torch.zeros(3), batch_size=[3])
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    with pytest.raises(RuntimeError, match=r"key 'x'.*overflow"):
        store.fill_("x", 1e40)
    with pytest.raises(RuntimeError):
        local.clone().fill_("x", 1e40)  # as a TensorDict does
    assert torch.equal(store["x"], local["x"])
    store.fill_("x", 2.5)
    assert torch.equal(store["x"], torch.full((3, 2), 2.5, dtype=dtype))
    store.clear_redis()


def test_an_ellipsis_into_a_keys_own_dims_is_refused_by_get_at_and_set_at(backend):
    """TensorDict's ``get_at``/``set_at_`` index the key's tensor, so ``...`` spans its feature dims too; a
    store's index takes the batch dims. ``get_at('f', (..., 0))`` read other cells than TensorDict's and
    ``set_at_`` wrote other cells: both now raise, naming the key, and nothing is written. A key with no
    dims of its own reads and writes as TensorDict's."""
    from tdstore import TensorDictStore

    local = TensorDict(f=torch.arange(18.0).reshape(2, 3, 3), g=torch.arange(6.0).reshape(2, 3), batch_size=[2, 3])
    dense = TensorDictStore.from_tensordict(local, **backend.kwargs())
    lazy = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(list(local.unbind(0))), **backend.kwargs())
    for store in (dense, lazy):
        with pytest.raises(IndexError, match=r"get_at\('f'.*\.\.\."):
            store.get_at("f", (..., 0))
        with pytest.raises(IndexError, match=r"set_at_\('f'"):
            store.set_at_("f", torch.full((2, 3), -1.0), (..., 0))
        assert torch.equal(store.get("f"), local["f"])
        assert torch.equal(store.get_at("g", (..., 1)), local.get_at("g", (..., 1)))
        assert torch.equal(store.get_at("f", (1, 2)), local.get_at("f", (1, 2)))
    want = local.clone().set_at_("g", torch.tensor([-1.0, -2.0]), (..., 0))
    dense.set_at_("g", torch.tensor([-1.0, -2.0]), (..., 0))
    assert torch.equal(dense.get("g"), want["g"])
    dense.clear_redis()
    lazy.clear_redis()
