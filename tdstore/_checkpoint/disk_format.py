"""The on-disk format of a checkpoint (``tdstore export``, ``StoreStorage.dumps``), and its validation.

A checkpoint is a directory::

    tdstore.json            what the store is (below); written last, so a directory without it is no checkpoint
    meta.json, <key>.memmap, <nested>/...
                            every homogeneous tensor key as ``TensorDict.memmap`` lays it out: a
                            TensorDict of batch size ``[count]`` whose row ``s`` is element (ring slot) ``s``
    storage_metadata.json   torchrl's ``TensorStorageCheckpointer`` file (``{"len": written, ...}``), only
                            when every key is a homogeneous tensor of a store of stack dim 0 and no inner
                            batch size: then ``LazyTensorStorage(count).loads(dir)`` reads the checkpoint
    _tdstore/k<i>.data      a heterogeneous or non-tensor key ``i`` (its index in ``keys``): the elements'
    _tdstore/k<i>.offsets   bytes back to back, ``count + 1`` little-endian int64 offsets (from 0), and
    _tdstore/k<i>.shapes    ``count * ndim`` little-endian int64 dims; a non-tensor element is its UTF-8
                            JSON document (``["d", value]`` or ``["s", lists]``, see ``_format.nontensor``)
    _tdstore/priorities.f64 the priority tree exactly as the server keeps it (``lua/_tree.lua``): the
                            first ``8 * count`` bytes are the slots' weights ``priority ** alpha``
    _tdstore/sampled.u32    how often each slot was drawn (``max_times_sampled``), 4 bytes per slot

``tdstore.json``: ``format`` ("tdstore-checkpoint"), ``version`` (1), ``td_id``, ``kind`` ("lazy" or
"dense"), ``count``, ``stack_dim``, ``inner``, ``batchless``, ``device``, ``tensorclass`` (a name, never
imported), ``sub`` (``[[path, dims], ...]``), ``keys`` (``{"path", "dtype", "layout": "dense" | "ragged"
| "json", "shape" (dense), "ndim", "file"}``: ``file`` is the memmap file, or the ``_tdstore/k<i>``
stem), ``ring`` (``rw`` and the policy counters ``pm``, ``lb``, ``sn``, ``rr`` as the header holds them,
``policy``: the ``sc`` JSON of ``_format.sampling_policy``), ``priorities`` and ``sampled`` (file names or null).

Nothing is ever unpickled: JSON and raw bytes only.  Every field and every file size is checked
(:func:`read_meta`) before anything is written to a server; a malformed checkpoint raises
:class:`CheckpointError` naming what is wrong.  This module does not import torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tdstore._format.sampling_policy import SamplingPolicy, tree_bytes

FORMAT = "tdstore-checkpoint"
FORMAT_VERSION = 1
META_FILE = "tdstore.json"
TORCHRL_FILE = "storage_metadata.json"
EXTRA_DIR = "_tdstore"
LAYOUTS = ("dense", "ragged", "json")
#: Header counters a checkpoint carries (``_format.sampling_policy``): ring writes, largest priority, limiter base, samples, queue cursor.
RING_FIELDS = ("rw", "pm", "lb", "sn", "rr")
#: Bytes per element of each dtype name a store accepts (``_format.codec.DTYPES``; kept here so that this module needs no torch).
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that is not one, or is malformed: refused before anything is written to a server."""


@dataclass(frozen=True)
class KeyEntry:
    """One key of a checkpoint (see the module docstring)."""

    path: tuple[str, ...]
    dtype: str
    layout: str
    ndim: int
    file: str
    shape: tuple[int, ...] | None = None

    @property
    def element_nbytes(self) -> int:
        assert self.shape is not None
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": list(self.path), "dtype": self.dtype, "layout": self.layout, "ndim": self.ndim, "file": self.file}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return out


@dataclass
class CheckpointMeta:
    """What ``tdstore.json`` holds (see the module docstring)."""

    td_id: str
    kind: str
    count: int
    stack_dim: int
    inner: tuple[int, ...]
    keys: list[KeyEntry]
    ring: dict[str, Any] = field(default_factory=dict)
    batchless: bool = False
    device: str = ""
    tensorclass: str = ""
    sub: list[Any] = field(default_factory=list)
    priorities: str | None = None
    sampled: str | None = None

    @property
    def policy(self) -> SamplingPolicy | None:
        raw = self.ring.get("policy")
        return SamplingPolicy.from_json(json.dumps(raw)) if raw is not None else None

    @property
    def written(self) -> int:
        """The slots a sampler draws from (``tds_written`` in ``lua/_lib.lua``)."""
        rw = int(self.ring.get("rw") or 0)
        return self.count if rw == 0 and self.keys else min(rw, self.count)

    def narrowed(self, *, drop: Collection[tuple[str, ...]] = (), rw: int | None = None) -> CheckpointMeta:
        """This checkpoint restored without the keys ``drop`` (paths; absent ones ignored) and, with ``rw``, with that
        ring write count in place of its own (its written slots must stay what they are: ``min(rw, count)``).

        What a torchrl buffer's ``loads`` restores (``tdstore.torchrl.dumps_loads``): a torchrl checkpoint's
        rows carry the metadata keys its writer stores (``"index"``), which a buffer on a ring never writes,
        and its cursor is its writer's, not a ring's.  A checkpoint left with no key keeps no written slot.
        """
        left_out = set(drop)
        keys = [k for k in self.keys if k.path not in left_out]
        ring = dict(self.ring)
        if rw is not None:
            if isinstance(rw, bool) or not isinstance(rw, int) or rw < 0:
                raise ValueError(f"a ring write count is an int >= 0, got {rw!r}")
            if min(rw, self.count) != self.written:
                raise ValueError(f"a ring write count of {rw} would make {min(rw, self.count)} slots written, not {self.written}")
            if ring.get("lb") is not None or ring.get("rr") is not None:  # (counted in ring writes too)
                raise ValueError("the ring write count of a checkpoint with a rate limiter or a queue cursor is its own")
            ring["rw"] = rw
        if self.keys and not keys:
            ring.pop("rw", None)
            for name in ("lb", "rr"):
                ring.pop(name, None)
        return replace(self, keys=keys, ring=ring)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "td_id": self.td_id,
            "kind": self.kind,
            "count": self.count,
            "stack_dim": self.stack_dim,
            "inner": list(self.inner),
            "batchless": self.batchless,
            "device": self.device,
            "tensorclass": self.tensorclass,
            "sub": self.sub,
            "keys": [k.to_json() for k in self.keys],
            "ring": self.ring,
            "priorities": self.priorities,
            "sampled": self.sampled,
        }


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a valid tdstore checkpoint: {what}")


def _int(v: Any, what: str, where: Path, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(where, f"{what} must be an int >= {low}, got {v!r}")
    return v


def inside(root: Path, rel: Any, what: str) -> Path:
    """``root / rel`` for a relative path that stays inside ``root`` (no absolute path, no ``..``)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise _bad(root, f"{what} names the file {rel!r}, which is not a relative path inside the checkpoint")
    return root / rel


def _size(root: Path, rel: str, want: int | None, what: str) -> int:
    p = inside(root, rel, what)
    if want == 0 and not p.exists():
        return 0
    if not p.is_file():
        raise _bad(root, f"{what}: the file {rel!r} is missing")
    have = p.stat().st_size
    if want is not None and have != want:
        raise _bad(root, f"{what}: the file {rel!r} holds {have} bytes, not {want}")
    return have


def _key(root: Path, raw: Any, count: int, i: int) -> KeyEntry:
    if not isinstance(raw, dict):
        raise _bad(root, f"keys[{i}] is not an object")
    path = raw.get("path")
    if not isinstance(path, list) or not path or not all(isinstance(p, str) and p for p in path):
        raise _bad(root, f"keys[{i}] has a bad path {path!r} (a list of non-empty strings)")
    what = f"key {tuple(path)!r}"
    dtype, layout = raw.get("dtype"), raw.get("layout")
    if dtype not in ITEMSIZE:
        raise _bad(root, f"{what} has an unknown dtype {dtype!r}")
    if layout not in LAYOUTS:
        raise _bad(root, f"{what} has an unknown layout {layout!r} (one of {', '.join(LAYOUTS)})")
    ndim = _int(raw.get("ndim"), f"{what}: ndim", root)
    file = raw.get("file")
    if layout == "dense":
        shape = raw.get("shape")
        if not isinstance(shape, list) or len(shape) != ndim:
            raise _bad(root, f"{what}: shape {shape!r} is not a list of {ndim} dims")
        entry = KeyEntry(tuple(path), dtype, layout, ndim, str(file), tuple(_int(s, f"{what}: a dim", root) for s in shape))
        _size(root, entry.file, count * entry.element_nbytes, what)
        return entry
    if layout == "json" and (dtype != "uint8" or ndim != 1):
        raise _bad(root, f"{what}: a non-tensor key is uint8 of one dim, got {dtype} of {ndim}")
    if ndim < 1:
        raise _bad(root, f"{what}: a heterogeneous key has at least one dim")
    entry = KeyEntry(tuple(path), dtype, layout, ndim, str(file))
    _size(root, entry.file + ".offsets", 8 * (count + 1), what)
    _size(root, entry.file + ".shapes", 8 * count * ndim, what)
    _size(root, entry.file + ".data", None, what)
    return entry


def _ring(root: Path, raw: Any, count: int) -> dict[str, Any]:
    if not isinstance(raw, dict) or set(raw) - {*RING_FIELDS, "policy"}:
        raise _bad(root, f"ring must be an object of {', '.join(RING_FIELDS)} and policy, got {raw!r}")
    out: dict[str, Any] = {}
    for name in ("rw", "lb", "sn", "rr"):
        if raw.get(name) is not None:
            out[name] = _int(raw[name], f"ring.{name}", root)
    pm = raw.get("pm")
    if pm is not None:
        if isinstance(pm, bool) or not isinstance(pm, (int, float)) or not math.isfinite(pm) or pm < 0:
            raise _bad(root, f"ring.pm must be a finite number >= 0, got {pm!r}")
        out["pm"] = float(pm)
    rw = out.get("rw", 0)
    for name in ("lb", "rr"):
        if out.get(name, 0) > rw:
            raise _bad(root, f"ring.{name}={out[name]} is beyond the ring write count rw={rw}")
    if raw.get("policy") is not None:
        try:
            SamplingPolicy.from_json(json.dumps(raw["policy"]))
        except (ValueError, TypeError) as err:
            raise _bad(root, f"ring.policy: {err}") from None
        out["policy"] = raw["policy"]
    return out


def read_meta(root: Any) -> CheckpointMeta:
    """The checkpoint in directory ``root``, every field and file size checked; :class:`CheckpointError` otherwise."""
    root = Path(root)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        if (root / TORCHRL_FILE).is_file():
            return _torchrl_meta(root)
        raise CheckpointError(f"{root} is not a tdstore checkpoint: it has no {META_FILE} (nor torchrl's {TORCHRL_FILE})")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise _bad(root, f"{META_FILE} is not JSON ({err})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _bad(root, f"{META_FILE} does not say format {FORMAT!r}")
    if raw.get("version") != FORMAT_VERSION:
        raise _bad(root, f"format version {raw.get('version')!r}; this tdstore reads version {FORMAT_VERSION}")
    td_id = raw.get("td_id")
    if not isinstance(td_id, str) or not td_id:
        raise _bad(root, f"td_id must be a non-empty string, got {td_id!r}")
    kind = raw.get("kind")
    if kind not in ("lazy", "dense"):
        raise _bad(root, f"kind must be 'lazy' or 'dense', got {kind!r}")
    count = _int(raw.get("count"), "count", root, 1)
    inner_raw = raw.get("inner")
    if not isinstance(inner_raw, list):
        raise _bad(root, f"inner must be a list of dims, got {inner_raw!r}")
    inner = tuple(_int(d, "an inner dim", root) for d in inner_raw)
    stack_dim = raw.get("stack_dim")
    if isinstance(stack_dim, bool) or not isinstance(stack_dim, int) or not -len(inner) - 1 <= stack_dim <= len(inner):
        raise _bad(root, f"stack_dim {stack_dim!r} does not fit an inner batch size of {len(inner)} dims")
    keys_raw = raw.get("keys")
    if not isinstance(keys_raw, list):
        raise _bad(root, "keys must be a list")
    keys = [_key(root, k, count, i) for i, k in enumerate(keys_raw)]
    paths = [k.path for k in keys]
    if len(set(paths)) != len(paths):
        raise _bad(root, "a key is listed twice")
    known = set(paths)
    for p in paths:
        for n in range(1, len(p)):
            if p[:n] in known:
                raise _bad(root, f"key {p[:n]!r} is both a leaf and the parent of {p!r}")
    ring = _ring(root, raw.get("ring", {}), count)
    for name in ("batchless",):
        if not isinstance(raw.get(name, False), bool):
            raise _bad(root, f"{name} must be true or false")
    for name in ("device", "tensorclass"):
        if not isinstance(raw.get(name, ""), str):
            raise _bad(root, f"{name} must be a string")
    sub = raw.get("sub", [])
    if not isinstance(sub, list) or not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], list) and all(isinstance(p, str) for p in e[0])
        and isinstance(e[1], list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e[1])
        for e in sub
    ):  # fmt: skip
        raise _bad(root, f"sub must be a list of [path, dims], got {sub!r}")
    meta = CheckpointMeta(
        td_id, kind, count, stack_dim, inner, keys, ring, raw.get("batchless", False), raw.get("device", ""),
        raw.get("tensorclass", ""), sub, raw.get("priorities"), raw.get("sampled"),
    )  # fmt: skip
    policy = meta.policy
    if (policy is not None and policy.prioritized) != (meta.priorities is not None):
        raise _bad(root, "priorities must be given exactly when the policy has alpha")
    if meta.priorities is not None:
        _size(root, meta.priorities, tree_bytes(count), "the priority tree")
    if (policy is not None and policy.max_times is not None) != (meta.sampled is not None):
        raise _bad(root, "the sample counts must be given exactly when the policy has max_times_sampled")
    if meta.sampled is not None:
        _size(root, meta.sampled, 4 * count, "the sample counts")
    return meta


#: Entries of a ``TensorDict.memmap`` ``meta.json`` that describe the tensordict, not a key.
_TD_FIELDS = {"shape", "device", "_type", "_format_version", "_class", "_is_locked", "names", "batch_size"}


def _memmap_keys(root: Path, folder: Path, prefix: tuple[str, ...], count: int | None) -> tuple[int, list[KeyEntry]]:
    """The tensor keys of a ``TensorDict.memmap`` folder (plain TensorDicts of memmapped tensors only)."""
    try:
        raw = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise _bad(root, f"{folder / 'meta.json'} cannot be read as JSON ({err})") from None
    if not isinstance(raw, dict) or raw.get("_class", "tensordict:TensorDict") != "tensordict:TensorDict":
        raise _bad(root, f"{folder / 'meta.json'} is not a plain TensorDict's (tdstore imports TensorDicts of tensors only)")
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) != 1:
        raise _bad(root, f"{folder / 'meta.json'}: a storage of one batch dim is expected, got shape {shape!r}")
    n = _int(shape[0], "the storage size", root, 1)
    if count is not None and n != count:
        raise _bad(root, f"{folder / 'meta.json'}: batch size {n}, the storage has {count}")
    keys: list[KeyEntry] = []
    for name, entry in raw.items():
        if name in _TD_FIELDS:
            continue
        path = (*prefix, name)
        if isinstance(entry, dict) and entry.get("type") == "TensorDict":
            keys += _memmap_keys(root, inside(root, str((folder / name).relative_to(root)), f"key {path!r}"), path, n)[1]
            continue
        if not isinstance(entry, dict) or "dtype" not in entry or entry.get("is_nested"):
            raise _bad(root, f"key {path!r} is not a memory-mapped tensor (tdstore imports tensors only)")
        dtype = str(entry["dtype"]).removeprefix("torch.")
        dims = entry.get("shape")
        if dtype not in ITEMSIZE or not isinstance(dims, list) or not dims or dims[0] != n:
            raise _bad(root, f"key {path!r}: dtype {entry['dtype']!r} and shape {dims!r} are not a tensor of {n} rows tdstore stores")
        rel = str((folder / f"{name}.memmap").relative_to(root))
        e = KeyEntry(path, dtype, "dense", len(dims) - 1, rel, tuple(_int(d, f"key {path!r}: a dim", root) for d in dims[1:]))
        _size(root, rel, n * e.element_nbytes, f"key {path!r}")
        keys.append(e)
    return n, keys


def _torchrl_meta(root: Path) -> CheckpointMeta:
    """A checkpoint of torchrl's ``LazyTensorStorage`` (``storage.dumps(path)``): a dense store (one shape per key,
    as there) whose ring had ``len`` writes, under a new td_id.  With ``len`` 0 (an emptied buffer, whose memmaps
    still hold the old rows) nothing is written: no key is restored (a store holding rows would be a full ring)."""
    import uuid

    try:
        raw = json.loads((root / TORCHRL_FILE).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise _bad(root, f"{TORCHRL_FILE} is not JSON ({err})") from None
    if not isinstance(raw, dict) or raw.get("is_pytree") is not False:
        raise _bad(root, f"{TORCHRL_FILE} is not a TensorDict storage's (pytree storages are not imported)")
    length = _int(raw.get("len"), "len", root)
    count, keys = _memmap_keys(root, root, (), None)
    if length > count:
        raise _bad(root, f"len {length} is beyond the storage size {count}")
    return CheckpointMeta(str(uuid.uuid4()), "dense", count, 0, (), keys if length else [], {"rw": length} if length else {})
