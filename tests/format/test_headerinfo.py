"""The torch-free header reader (``_format.header_info``, used by ``tdstore ls/info/rm``) and the store's own
(``_format.schema.Header.from_fields``) give the same verdict and the same facts.

Real headers come from stores of every kind written on fakeredis; each is also
corrupted in many ways, and both readers must accept or refuse each variant alike.
"""

from __future__ import annotations

import json
from typing import Any

import fakeredis
import pytest
import torch
from tensordict import NonTensorData, TensorDict, lazy_stack, tensorclass

from tdstore import LazyStackedTensorDictStore, StoreFormatError, TensorDictStore
from tdstore._format import codec as _codec
from tdstore._format import schema as _schema
from tdstore._format.header_info import FORMATS, ITEMSIZE, parse_header
from tdstore._format.keys import StoreKeys


@tensorclass
class _Pair:
    a: torch.Tensor
    b: torch.Tensor


def _real_headers() -> dict[str, dict[str, str]]:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    kw: dict[str, Any] = {"client": client, "prefix": "hi"}
    het = lazy_stack([TensorDict(obs=torch.full((3,), float(i)), tok=torch.arange(i + 1), meta={"s": torch.tensor(i)}) for i in range(4)])
    LazyStackedTensorDictStore.from_lazy_stack(het, td_id="het", **kw)
    inner = lazy_stack(
        [
            TensorDict(img=torch.zeros(2, 3, dtype=torch.uint8), v=torch.ones(2, i + 1, dtype=torch.bfloat16), batch_size=[2])
            for i in range(3)
        ]
    )
    LazyStackedTensorDictStore.from_lazy_stack(inner, td_id="inner", **kw)
    ring = LazyStackedTensorDictStore(count=5, td_id="ring", **kw)
    ring.extend(TensorDict(x=torch.ones(3, 2), done=torch.zeros(3, dtype=torch.bool), batch_size=[3]))
    LazyStackedTensorDictStore.from_lazy_stack(het, td_id="seg", segment_bytes=16, **kw)
    TensorDictStore.from_tensordict(TensorDict(y=torch.ones(5, 2, dtype=torch.float64), batch_size=[5]), td_id="dense", **kw)
    TensorDictStore.from_tensordict(TensorDict(z=torch.ones(3)), td_id="batchless", **kw)
    nt = lazy_stack([TensorDict(o=torch.zeros(1), text=NonTensorData(f"s{i}")) for i in range(3)])
    LazyStackedTensorDictStore.from_lazy_stack(nt, td_id="nontensor", **kw)
    TensorDictStore.from_tensordict(_Pair(a=torch.zeros(2), b=torch.ones(2, 2), batch_size=[2]), td_id="tc", **kw)
    LazyStackedTensorDictStore(count=2, td_id="empty", **kw)
    out = {}
    for td_id in ("het", "inner", "ring", "seg", "dense", "batchless", "nontensor", "tc", "empty"):
        raw = client.hgetall(StoreKeys("hi", td_id).meta)
        out[td_id] = {k.decode(): v.decode() for k, v in raw.items()}
    return out


REAL = _real_headers()


def _schema_edit(fields: dict[str, str], edit: Any) -> dict[str, str]:
    schema = json.loads(fields["schema"])
    edit(schema)
    return {**fields, "schema": json.dumps(schema)}


def _leaf_edit(key: str, value: Any, i: int = 0) -> Any:
    def edit(schema: dict) -> None:
        if schema["leaves"]:
            leaf = schema["leaves"][i % len(schema["leaves"])]
            if value is _DROP:
                leaf.pop(key, None)
            else:
                leaf[key] = value

    return edit


_DROP = object()


def _variants(fields: dict[str, str]) -> list[dict[str, str]]:
    out = [dict(fields)]
    for name in list(fields):
        out.append({k: v for k, v in fields.items() if k != name})
    for name, bad in (
        ("format", "9"),
        ("format", "1"),
        ("format", "3"),
        ("count", "-1"),
        ("count", "x"),
        ("stack_dim", "7"),
        ("stack_dim", "-9"),
        ("inner", "[-1]"),
        ("inner", "[2]"),
        ("inner", "{}"),
        ("version", "v"),
        ("epoch", "XYZ"),
        ("epoch", ""),
        ("seg", "-2"),
        ("seg", "1"),
        ("kv", "?"),
        ("schema", "{}"),
        ("schema", "not json"),
        ("tensorclass", "os.system; x"),
        ("batchless", "1"),
        ("state", "uploading:ab"),
    ):
        out.append({**fields, name: bad})
    for edit in (
        _leaf_edit("dtype", "qint8"),
        _leaf_edit("dtype", 3),
        _leaf_edit("dtype", "float8_e5m2"),
        _leaf_edit("shape", [1, 2, 3, 4]),
        _leaf_edit("shape", [-1]),
        _leaf_edit("n", 10_000),
        _leaf_edit("n", -1),
        _leaf_edit("path", []),
        _leaf_edit("path", ["a", 1]),
        _leaf_edit("col", 10_000),
        _leaf_edit("col", True),
        _leaf_edit("col", 0, 1),
        _leaf_edit("nt", 1),
        _leaf_edit("v", "x"),
        _leaf_edit("ndim", _DROP),
        lambda s: s.update(row=[0, 1]),
        lambda s: s.update(row=[99, 8]),
        lambda s: s.update(row=None),
        lambda s: s.update(next=0),
        lambda s: s["leaves"].append(dict(s["leaves"][0])) if s["leaves"] else None,
    ):
        out.append(_schema_edit(fields, edit))
    return out


def _facts_of_schema(h: _schema.Header) -> dict[str, Any]:
    leaves = sorted(
        (leaf.path, leaf.number, _codec.dtype_name(leaf.dtype), leaf.ndim, leaf.shape, leaf.json, leaf.col) for leaf in h.leaves.values()
    )
    return {
        "version": h.version, "count": h.count, "stack_dim": h.stack_dim, "inner": h.inner, "device": h.device, "kind": h.kind,
        "leaves": leaves, "next": h.next_leaf, "state": h.state, "epoch": h.epoch, "tensorclass": h.tensorclass, "seg": h.seg,
        "spread": h.spread, "row": h.row, "batchless": h.batchless, "segments": h.segments.n,
        "nbytes": sorted(leaf.element_nbytes for leaf in h.leaves.values() if leaf.shape is not None),
    }  # fmt: skip


def _facts_of_info(h: Any) -> dict[str, Any]:
    leaves = sorted((leaf.path, leaf.number, leaf.dtype, leaf.ndim, leaf.shape, leaf.json, leaf.col) for leaf in h.leaves)
    return {
        "version": h.version, "count": h.count, "stack_dim": h.stack_dim, "inner": h.inner, "device": h.device, "kind": h.kind,
        "leaves": leaves, "next": h.next_leaf, "state": h.state, "epoch": h.epoch, "tensorclass": h.tensorclass, "seg": h.seg,
        "spread": h.spread, "row": h.row, "batchless": h.batchless, "segments": h.segments,
        "nbytes": sorted(leaf.element_nbytes for leaf in h.leaves if leaf.shape is not None),
    }  # fmt: skip


def _verdict(reader: Any, fields: dict[str, str]) -> Any:
    try:
        return reader(fields)
    except StoreFormatError as err:
        return ("refused", type(err))


@pytest.mark.parametrize("td_id", sorted(REAL))
def test_both_readers_agree_on_real_and_corrupted_headers(td_id: str) -> None:
    refused = 0
    for fields in _variants(REAL[td_id]):
        ours = _verdict(parse_header, fields)
        theirs = _verdict(_schema.Header.from_fields, fields)
        if isinstance(theirs, tuple):
            assert isinstance(ours, tuple), (fields, "the store refuses this header, the inspector accepted it")
            refused += 1
        else:
            assert not isinstance(ours, tuple), (fields, ours)
            assert _facts_of_info(ours) == _facts_of_schema(theirs), fields
    assert refused > 10  # the corruptions are really exercised


def test_real_headers_cover_the_features() -> None:
    infos = {td_id: parse_header(fields) for td_id, fields in REAL.items()}
    assert infos["ring"].row is not None and any(leaf.col is not None for leaf in infos["ring"].leaves)
    assert infos["seg"].segments > 1 and infos["batchless"].batchless and infos["dense"].kind == "dense"
    assert any(leaf.json for leaf in infos["nontensor"].leaves) and infos["tc"].tensorclass.endswith("_Pair")
    assert any(leaf.shape is None for leaf in infos["het"].leaves) and infos["inner"].inner == (2,)


def test_dtype_sizes_and_formats_match_the_store() -> None:
    assert set(_codec.DTYPES) <= set(ITEMSIZE)
    for name, dtype in _codec.DTYPES.items():
        assert ITEMSIZE[name] == dtype.itemsize, name
    assert FORMATS == _schema.FORMATS
    assert _schema.StoreFormatError is StoreFormatError
