"""Index tensors, numpy arrays and lists of every integer dtype and bool mean what they mean to torch.

torch 2.13 takes int64 and int32 index tensors as positions, bool and uint8 ones
as masks (uint8 with a deprecation warning), and refuses every other dtype with
``IndexError``. Lists and numpy arrays become bool or uint8 masks when they hold
those, and int64 positions for any other integer type. Each case here runs the
same read (``store[idx]``) and write (``store[idx] = td``) on a store and on local
data and compares the outcome: the same rows, or the same exception type (and for
a refused write, not one byte changed on the server); a uint8 mask warns with
torch's own message.

The reference is torch itself (which rows ``torch.arange(n)[idx]`` picks) and a
local ``TensorDict``, which agrees with torch on every case here but two (noted at
``TD_READ_DIVERGES``). A local ``LazyStackedTensorDict`` is not a reference for
the dtype rules: in tensordict 0.15 its reads take int8/int16/uint16/32/64 index
tensors as positions and a numpy uint8 array as positions, which torch and
``TensorDict`` do not; it is used for the rows of a heterogeneous stack, indexed
by the int64 positions torch chose.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import assert_same
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._plan import index as _index

UINT8_WARNING = "indexing with dtype torch.uint8 is now deprecated"

TORCH_INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]
NUMPY_INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def component(case: str, n: int):
    """The index for one dim of size ``n``: positions ``[n-1, 0, 2]`` (``[-1, 0, 2]`` when signed) or a mask."""
    kind, _, name = case.partition(":")
    mask = [1, 0, 2, 0, 255][:n] + [0] * (n - 5)  # nonzero is True: 2 and 255 too
    mask[-1] = 1
    if kind in ("tensor", "numpy"):
        dtype = getattr(torch if kind == "tensor" else np, name)
        if name == "bool":
            return (torch.tensor if kind == "tensor" else np.array)([bool(v) for v in mask], dtype=dtype)
        if name == "uint8":
            return (torch.tensor if kind == "tensor" else np.array)(mask, dtype=dtype)
        signed = name.startswith("int")
        return (torch.tensor if kind == "tensor" else np.array)([-1 if signed else n - 1, 0, 2], dtype=dtype)
    if case == "tensor-short:uint8":  # three uint8 values are a mask of the wrong length, not positions
        return torch.tensor([n - 1, 0, 2], dtype=torch.uint8)
    if case == "tensor-empty:int8":
        return torch.zeros(0, dtype=torch.int8)
    if case == "tensor-empty:int64":
        return torch.zeros(0, dtype=torch.int64)
    if case == "tensor-0dim:int8":  # a 0-dim tensor of any integer dtype but uint8 is one position
        return torch.tensor(2, dtype=torch.int8)
    if case == "tensor-0dim:uint64":
        return torch.tensor(2, dtype=torch.uint64)
    if case == "list:int":
        return [n - 1, 0, 2]
    if case == "list:bool":
        return [bool(v) for v in mask]
    if case == "list:np.uint8":  # numpy uint8 scalars make a uint8 array: a mask
        return [np.uint8(v) for v in mask]
    if case == "list:np.int8":
        return [np.int8(-1), np.int8(0), np.int8(2)]
    if case == "list:mixed":  # bools among ints are ints
        return [True, 0, 2]
    raise AssertionError(case)


CASES = (
    [f"tensor:{str(d).removeprefix('torch.')}" for d in TORCH_INT_DTYPES]
    + ["tensor:bool"]
    + [f"numpy:{d.__name__}" for d in NUMPY_INT_DTYPES]
    + ["numpy:bool"]
    + ["tensor-short:uint8", "tensor-empty:int8", "tensor-empty:int64", "tensor-0dim:int8", "tensor-0dim:uint64"]
    + ["list:int", "list:bool", "list:np.uint8", "list:np.int8", "list:mixed"]
)

# Where tensordict 0.15.3 does not do what torch does, so the store follows torch alone: a uint8
# numpy array (or a list of numpy uint8 scalars) is a mask for the leaves but positions for the
# batch size in ``td[idx]`` (a TensorDict of batch size [10] whose leaves have 4 rows), and
# ``td[idx] = value`` with one raises a RuntimeError about the destination's batch size
TD_READ_DIVERGES = {"numpy:uint8", "list:np.uint8"}
TD_WRITE_DIVERGES = {"numpy:uint8", "list:np.uint8"}

# (kind, batch size, dim indexed)
KINDS = {
    "lazy": ([10], 0),
    "lazy-het": ([10], 0),
    "dense": ([10], 0),
    "dense2d": ([5, 4], 0),
    "dense2d-dim1": ([5, 4], 1),
}


def local_data(kind: str) -> TensorDictBase:
    """Local data for a kind of store; leaf ``pos`` holds each batch position's flat number."""
    bs, _ = KINDS[kind]
    numel = math.prod(bs)
    pos = torch.arange(numel).reshape(bs)
    obs = torch.arange(numel * 2, dtype=torch.float32).reshape(*bs, 2)
    flag = (torch.arange(numel) % 3 == 0).reshape(*bs, 1)
    if kind.startswith("lazy"):
        tds = [TensorDict(pos=pos[i], obs=obs[i], flag=flag[i]) for i in range(bs[0])]
        if kind == "lazy-het":
            for i, td in enumerate(tds):
                td["tokens"] = torch.arange(1 + i % 3) + 100 * i
        return lazy_stack(tds)
    return TensorDict(pos=pos, obs=obs, flag=flag, batch_size=bs)


def make_store(kind: str, backend):
    local = local_data(kind)
    if kind.startswith("lazy"):
        return LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs()), local
    return TensorDictStore.from_tensordict(local, **backend.kwargs()), local


def full_index(kind: str, comp):
    return (slice(None), comp) if KINDS[kind][1] == 1 else comp


def outcome(fn):
    """``("ok", value, warned)`` or ``("raise", exception type, warned)``; ``warned``: torch's uint8 warning was given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = ("ok", fn())
        except Exception as err:  # the type is compared with the reference's
            result = ("raise", type(err))
    warned = any(UINT8_WARNING in str(w.message) and w.category is UserWarning for w in caught)
    return (*result, warned)


def torch_positions(kind: str, idx):
    """What torch makes of ``idx``: the flat positions it selects, or the exception it raises."""
    bs, _ = KINDS[kind]
    grid = torch.arange(math.prod(bs)).reshape(bs)
    return outcome(lambda: grid[idx])


def torch_read(local: TensorDict, idx) -> TensorDict:
    """``local[idx]`` done leaf by leaf with torch's own indexing."""
    grid = torch.arange(local.batch_size.numel()).reshape(local.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's uint8 warning: compared in outcome()
        return TensorDict({k: local.get(k)[idx] for k in ("pos", "obs", "flag")}, batch_size=grid[idx].shape)


def as_local(got):
    """A store's result as local data (an element view or a dense store view is read out)."""
    return got.to_tensordict() if type(got).__module__.startswith("tdstore") else got


def snapshot(client, prefix):
    out = {}
    for key in sorted(client.keys(prefix + ":*")):
        kind = client.type(key)
        out[key] = client.hgetall(key) if kind == b"hash" else client.smembers(key) if kind == b"set" else client.get(key)
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_read_follows_torch(backend, kind, case):
    store, local = make_store(kind, backend)
    bs, dim = KINDS[kind]
    idx = full_index(kind, component(case, bs[dim]))
    want = torch_positions(kind, idx)
    got = outcome(lambda: as_local(store[idx]))
    assert got[0] == want[0] and got[2] == want[2], (got, want)
    if want[0] == "raise":
        assert got[1] is want[1], (got, want)
        return
    if isinstance(local, LazyStackedTensorDict):
        ref = local[want[1]]  # the rows torch picked, by int64 positions
        if want[1].ndim == 0:
            ref = ref.to_tensordict()
    else:
        ref = torch_read(local, idx)
        assert torch.equal(ref["pos"], want[1])
        if case not in TD_READ_DIVERGES:
            td = outcome(lambda: local[idx])
            assert td[0] == "ok" and td[2] == want[2], td
            assert_same(td[1], ref)  # TensorDict reads what torch reads
    assert_same(got[1], ref)


def new_value(ref: TensorDictBase, het: bool) -> TensorDictBase:
    """Values to write where ``ref`` was read: every number changed (a heterogeneous key gets new lengths)."""
    if het:
        tds = [
            TensorDict(pos=t["pos"] + 1000, obs=t["obs"] - 7, flag=~t["flag"], tokens=torch.arange(4 - int(t["pos"]) % 3) - 5)
            for t in ref.unbind(0)
        ]
        return lazy_stack(tds) if tds else ref.apply(lambda t: t)
    return TensorDict(pos=ref["pos"] + 1000, obs=ref["obs"] - 7, flag=~ref["flag"], batch_size=ref.batch_size)


def torch_write(local: TensorDictBase, idx, value: TensorDictBase) -> TensorDictBase:
    """``local[idx] = value`` done leaf by leaf with torch's own indexing."""
    out = local.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's uint8 warning: compared in outcome()
        for key in ("pos", "obs", "flag"):
            leaf = out.get(key)
            leaf[idx] = value.get(key)
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_write_follows_torch(backend, kind, case):
    store, local = make_store(kind, backend)
    bs, dim = KINDS[kind]
    idx = full_index(kind, component(case, bs[dim]))
    want = torch_positions(kind, idx)
    het = kind == "lazy-het"
    if want[0] == "ok":
        picked = want[1]
        ref_read = local[picked] if isinstance(local, LazyStackedTensorDict) else torch_read(local, idx)
        value = new_value(ref_read if picked.ndim or not het else lazy_stack([ref_read]), het)
        if het and picked.ndim == 0:
            value = value[0]
    else:
        value = new_value(local[:3] if not het else lazy_stack([local[i] for i in range(3)]), het)
    before = snapshot(backend.client(), backend.prefix)

    def write():
        store[idx] = value

    got = outcome(write)
    assert got[0] == want[0] and got[2] == want[2], (got, want)
    if want[0] == "raise":
        assert got[1] is want[1], (got, want)
        assert snapshot(backend.client(), backend.prefix) == before, "a refused index wrote to the server"
        return
    if het:
        expected = list(local.unbind(0))
        for k, p in enumerate(want[1].reshape(-1).tolist()):
            expected[p] = value if want[1].ndim == 0 else value[k]
        assert_same(store.to_tensordict(), lazy_stack(expected))
        return
    dense = local.to_tensordict() if isinstance(local, LazyStackedTensorDict) else local
    expected = torch_write(dense, idx, value)
    assert_same(store.to_tensordict(), expected)
    if case not in TD_WRITE_DIVERGES:
        td = dense.clone()
        td_got = outcome(lambda: td.__setitem__(idx, value))
        assert td_got[0] == "ok" and td_got[2] == want[2], td_got
        assert_same(td, expected)  # TensorDict writes what torch writes


def test_uint8_warning_is_torchs_own(backend):
    """The store's warning for a uint8 mask is the text torch gives for the same index."""
    store, local = make_store("lazy", backend)
    mask = torch.tensor([1, 0, 1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    with warnings.catch_warnings(record=True) as torch_caught:
        warnings.simplefilter("always")
        assert torch.arange(10)[mask].tolist() == [0, 2, 9]
    with warnings.catch_warnings(record=True) as store_caught:
        warnings.simplefilter("always")
        assert store[mask]["pos"].tolist() == [0, 2, 9]
    assert {str(w.message) for w in store_caught} == {str(w.message) for w in torch_caught}
    assert {w.category for w in store_caught} == {UserWarning}


def test_uint8_2d_mask_covers_two_dims(backend):
    """A 2-d uint8 mask on a 2-d batch picks cells, as a 2-d bool mask does, on reads and writes."""
    store, local = make_store("dense2d", backend)
    mask = torch.zeros(5, 4, dtype=torch.uint8)
    mask[0, 1] = mask[2, 3] = mask[4, 0] = 7
    with pytest.warns(UserWarning, match=UINT8_WARNING):
        got = store[mask].to_tensordict()
    assert got["pos"].tolist() == [1, 11, 16]
    assert_same(got, local[mask.bool()])
    value = new_value(got, False)
    with pytest.warns(UserWarning, match=UINT8_WARNING):
        store[mask] = value
    local[mask.bool()] = value
    assert_same(store.to_tensordict(), local)


# Where a store deliberately does not do what torch does: each is refused with IndexError
# before any I/O, instead of a result torch gets by a silent cast or a new axis.
REFUSED = {
    # torch truncates floats in a list or numpy array to int64 positions (x[[0.7]] reads row 0)
    "float list": ([0.0, 2.0], "float64"),
    "float array": (np.array([0.7, 2.0], dtype=np.float32), "float32"),
    # torch wraps uint64 values past the int64 range to negative positions (2**64 - 1 reads the last row)
    "uint64 past int64": (np.array([2**64 - 1], dtype=np.uint64), "18446744073709551615"),
    # 0-dim masks add a new axis in torch; a store has no new axes (None is refused too)
    "0-dim uint8 tensor": (torch.tensor(1, dtype=torch.uint8), "0-dim mask"),
    "0-dim bool tensor": (torch.tensor(True), "0-dim mask"),
    "0-dim uint8 array": (np.array(1, dtype=np.uint8), "0-dim mask"),
    "0-dim bool array": (np.array(True), "0-dim mask"),
}


@pytest.mark.parametrize("name", list(REFUSED))
@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_refused_where_torch_casts(backend, kind, name):
    idx, text = REFUSED[name]
    store, local = make_store(kind, backend)
    before = snapshot(backend.client(), backend.prefix)
    with pytest.raises(IndexError, match=text):
        store[idx]
    with pytest.raises(IndexError, match=text):
        store[idx] = local[:1]
    assert snapshot(backend.client(), backend.prefix) == before


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float32, torch.complex64])
@pytest.mark.parametrize("where", [0, 1])
def test_refused_dtype_is_named_with_its_dim(dtype, where):
    """The IndexError names the dtype and the batch dim the index tensor stands on."""
    idx = torch.tensor([1, 0], dtype=dtype)
    index = (slice(None), idx) if where else idx
    with pytest.raises(IndexError, match=rf"{dtype}.* dim {where} .*batch size \[3, 4\]"):
        _index.normalize(index, torch.Size([3, 4]))


@pytest.mark.parametrize("dtype", TORCH_INT_DTYPES + [torch.bool])
@pytest.mark.parametrize("raw", [[1, 0, 1], [2, 0], [0, 0, 1]])
def test_normalize_matches_torch_for_every_dtype(dtype, raw):
    """Unit level: normalize picks torch's rows for every dtype torch takes, and refuses the others."""
    grid = torch.arange(12).reshape(3, 4)
    idx = torch.tensor(raw, dtype=dtype)
    want = outcome(lambda: grid[idx])
    got = outcome(lambda: _index.storage_rows(_index.plan(_index.normalize(idx, grid.shape), grid.shape, 0), (4,)))
    assert got[0] == want[0] and got[2] == want[2], (got, want)
    if want[0] == "raise":
        assert got[1] is want[1] is IndexError
    else:
        assert torch.equal(got[1], want[1])
