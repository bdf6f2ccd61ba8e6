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
``policy``: the ``sc`` JSON of ``_format.sampling_policy``; ``ho`` when rows are absent, below), ``priorities``
and ``sampled`` (file names or null), ``ttl_ms`` (the store's time to live left when exported, 0 for none;
optional), ``stats`` (the store's stats counters, ``{name: int}``, as ``_inspect.stats`` reads them;
optional: older checkpoints have none) and ``overwritten_during_export`` (optional, 0 when absent).

A checkpoint taken while writers ran holds the ring as of one fence (``lua/fence.lua``: the header,
the stats and the time to live read in one atomic step); the rows writers overwrote while the export
read the data are the fence's oldest ones, ring writes ``[rw - count, ho)``: ``overwritten_during_export``
counts them, ``ring.ho`` is the oldest ring write whose row the checkpoint holds, and their slots have
weight 0 and no sample count. Their bytes are whatever whole row the export read there (a newer
one); a restored ring never samples or pops them (``lua/_absent.lua``).

Nothing is ever unpickled: JSON and raw bytes only.  Every field and every file size is checked
(:func:`read_meta`) before anything is written to a server; a malformed checkpoint raises
:class:`CheckpointError` naming what is wrong.  A checkpoint is input from outside: its JSON is
parsed strictly (no ``NaN``/``Infinity``, a bounded size and nesting depth), every number is held
to the ranges a store is made with (``_format.header_info``), and every file is opened without
following a symlink, a regular file only (``_checkpoint.folder``).  This module does not import torch.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tdstore._checkpoint.folder import MAX_DEPTH, CheckpointError, bad, exists, file_size, inside, load_json
from tdstore._format.header_info import MAX_INT, RAGGED, check_new_layout, parse_classes
from tdstore._format.sampling_policy import UNBOUNDED, SamplingPolicy, tree_bytes

FORMAT = "tdstore-checkpoint"
FORMAT_VERSION = 1
META_FILE = "tdstore.json"
TORCHRL_FILE = "storage_metadata.json"
EXTRA_DIR = "_tdstore"
#: Where ``ReplayBuffer.dumps`` puts the storage's checkpoint, and its writer's state, in the folder it is given.
STORAGE_DIR = "storage"
WRITER_STATE = ("writer", "metadata.json")
#: Keys torchrl's writers store in each row (``TensorDictRoundRobinWriter``: ``"index"``), which a ring never
#: writes: a torchrl dump is restored without them (``tdstore.torchrl.METADATA_KEYS`` is this).
TORCHRL_ROW_KEYS = ("index", "index_generation")
LAYOUTS = ("dense", "ragged", "json")
#: Most dims of a key's element (torch's tensors have at most 64).
MAX_NDIM = 64
#: Header counters a checkpoint carries (``_format.sampling_policy``): ring writes, largest priority, limiter base, samples, queue
#: cursor, and the oldest ring write whose row it holds (``ho``: a checkpoint taken while writers ran, see the module docstring).
RING_FIELDS = ("rw", "pm", "lb", "sn", "rr", "ho")
#: Most fields of the stats hash a checkpoint carries (the scripts count a few dozen).
MAX_STATS = 256
#: Bytes per element of each dtype name a store accepts (``_format.codec.DTYPES``; kept here so that this module needs no torch).
ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}  # fmt: skip


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
    ttl_ms: int = 0
    """The store's time to live when it was exported (ms left; 0: none): what an import gives it unless told otherwise."""
    stats: dict[str, int] = field(default_factory=dict)
    """The store's stats counters at the fence (``StoreKeys.stats``), restored with the ring."""
    overwritten_during_export: int = 0
    """Rows of the fence that writers overwrote while the export read the data: absent (see the module docstring)."""
    classes: list[Any] = field(default_factory=list)
    """The tensorclass names of nested sub-trees, ``[[path, "module.QualName"], ...]`` (``Header.classes``): names only."""

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
            if any(ring.get(n) is not None for n in ("lb", "rr", "ho")):  # (counted in ring writes too)
                raise ValueError("the ring write count of a checkpoint with a rate limiter or a queue cursor is its own")
            ring["rw"] = rw
        if self.keys and not keys:
            ring.pop("rw", None)
            for name in ("lb", "rr", "ho"):
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
            "ttl_ms": self.ttl_ms,
            "stats": self.stats,
            "overwritten_during_export": self.overwritten_during_export,
            **({"classes": self.classes} if self.classes else {}),
        }


def _int(v: Any, what: str, where: Path, low: int = 0, high: int = MAX_INT) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise bad(where, f"{what} must be an int in {low}..{high}, got {v!r}"[:300])
    return v


def _size(root: Path, rel: str, want: int | None, what: str) -> int:
    try:
        have = file_size(root, rel, what)
    except FileNotFoundError:
        if want == 0:
            return 0
        raise bad(root, f"{what}: the file {rel!r} is missing") from None
    if want is not None and have != want:
        raise bad(root, f"{what}: the file {rel!r} holds {have} bytes, not {want}")
    return have


def _dims(root: Path, shape: Any, ndim: int, what: str) -> tuple[int, ...]:
    """An element shape: ``ndim`` dims (at most :data:`MAX_NDIM`), each and their product at most 2**53."""
    if not isinstance(shape, list) or len(shape) != ndim:
        raise bad(root, f"{what}: shape {shape!r} is not a list of {ndim} dims"[:300])
    dims = tuple(_int(s, f"{what}: a dim", root) for s in shape)
    if math.prod(dims) > MAX_INT:
        raise bad(root, f"{what}: shape {list(dims)} holds more than 2**53 items")
    return dims


def _key(root: Path, raw: Any, count: int, i: int) -> KeyEntry:
    if not isinstance(raw, dict):
        raise bad(root, f"keys[{i}] is not an object")
    path = raw.get("path")
    if not isinstance(path, list) or not path or len(path) > MAX_DEPTH or not all(isinstance(p, str) and p for p in path):
        raise bad(root, f"keys[{i}] has a bad path {path!r} (a list of at most {MAX_DEPTH} non-empty strings)"[:300])
    what = f"key {tuple(path)!r}"
    dtype, layout = raw.get("dtype"), raw.get("layout")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise bad(root, f"{what} has an unknown dtype {dtype!r}"[:300])
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise bad(root, f"{what} has an unknown layout {layout!r} (one of {', '.join(LAYOUTS)})"[:300])
    ndim = _int(raw.get("ndim"), f"{what}: ndim", root, 0, MAX_NDIM)
    file = raw.get("file")
    if layout == "dense":
        entry = KeyEntry(tuple(path), dtype, layout, ndim, str(file), _dims(root, raw.get("shape"), ndim, what))
        _size(root, entry.file, count * entry.element_nbytes, what)
        return entry
    if layout == "json" and (dtype != "uint8" or ndim != 1):
        raise bad(root, f"{what}: a non-tensor key is uint8 of one dim, got {dtype} of {ndim}")
    if ndim < 1:
        raise bad(root, f"{what}: a heterogeneous key has at least one dim")
    entry = KeyEntry(tuple(path), dtype, layout, ndim, str(file))
    _size(root, entry.file + ".offsets", 8 * (count + 1), what)
    _size(root, entry.file + ".shapes", 8 * count * ndim, what)
    _size(root, entry.file + ".data", None, what)
    return entry


def _ring(root: Path, raw: Any, count: int) -> dict[str, Any]:
    if not isinstance(raw, dict) or set(raw) - {*RING_FIELDS, "policy"}:
        raise bad(root, f"ring must be an object of {', '.join(RING_FIELDS)} and policy, got {raw!r}")
    out: dict[str, Any] = {}
    for name in ("rw", "lb", "sn", "rr", "ho"):
        if raw.get(name) is not None:
            out[name] = _int(raw[name], f"ring.{name}", root)
    pm = raw.get("pm")
    if pm is not None:  # the range restore.lua reads it with (tds_float_field)
        if isinstance(pm, bool) or not isinstance(pm, (int, float)) or not math.isfinite(pm) or not 0 <= pm <= UNBOUNDED:
            raise bad(root, f"ring.pm must be a finite number in 0..{UNBOUNDED:g}, got {pm!r}")
        out["pm"] = float(pm)
    rw = out.get("rw", 0)
    for name in ("lb", "rr", "ho"):
        if out.get(name, 0) > rw:
            raise bad(root, f"ring.{name}={out[name]} is beyond the ring write count rw={rw}")
    if out.get("ho", rw) < rw - count:
        raise bad(root, f"ring.ho={out['ho']} is below the oldest row a ring of {count} slots holds at rw={rw}")
    if raw.get("policy") is not None:
        try:
            SamplingPolicy.from_json(json.dumps(raw["policy"]))
        except (ValueError, TypeError) as err:
            raise bad(root, f"ring.policy: {err}") from None
        out["policy"] = raw["policy"]
    return out


def _stats(root: Path, raw: Any) -> dict[str, int]:
    """The stats counters of a checkpoint: at most :data:`MAX_STATS` names of letters, digits and ``_`` (as
    ``lua/restore.lua`` takes them), each an int in 0..2**53."""
    if not isinstance(raw, dict) or len(raw) > MAX_STATS:
        raise bad(root, f"stats must be an object of at most {MAX_STATS} counters, got {raw!r}"[:300])
    for name in raw:
        if not (0 < len(name) <= 64 and name.replace("_", "a").isalnum() and name.isascii()):
            raise bad(root, f"stats: {name[:80]!r} is not a counter's name (letters, digits and _)")
    return {name: _int(v, f"stats.{name}", root) for name, v in raw.items()}


def read_meta(root: Any) -> CheckpointMeta:
    """The checkpoint in directory ``root``, every field and file size checked; :class:`CheckpointError` otherwise."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a tdstore checkpoint: it is not a directory")
    if not exists(root, META_FILE):
        if exists(root, TORCHRL_FILE):
            return _torchrl_meta(root)
        raise CheckpointError(f"{root} is not a tdstore checkpoint: it has no {META_FILE} (nor torchrl's {TORCHRL_FILE})")
    raw = load_json(root, META_FILE, META_FILE)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise bad(root, f"{META_FILE} does not say format {FORMAT!r}")
    if raw.get("version") != FORMAT_VERSION:
        raise bad(root, f"format version {raw.get('version')!r}; this tdstore reads version {FORMAT_VERSION}"[:300])
    td_id = raw.get("td_id")
    if not isinstance(td_id, str) or not td_id:
        raise bad(root, f"td_id must be a non-empty string, got {td_id!r}"[:300])
    kind = raw.get("kind")
    if kind not in ("lazy", "dense"):
        raise bad(root, f"kind must be 'lazy' or 'dense', got {kind!r}"[:300])
    inner_raw = raw.get("inner")
    if not isinstance(inner_raw, list) or len(inner_raw) > MAX_NDIM:
        raise bad(root, f"inner must be a list of at most {MAX_NDIM} dims, got {inner_raw!r}"[:300])
    inner = tuple(_int(d, "an inner dim", root) for d in inner_raw)
    stack_dim = raw.get("stack_dim")
    try:  # what a store is made with (the constructors' check)
        count, _ = check_new_layout(raw.get("count"), stack_dim, inner)
    except (ValueError, TypeError) as err:
        raise bad(root, str(err)[:300]) from None
    assert isinstance(stack_dim, int)  # (checked just above)
    keys_raw = raw.get("keys")
    if not isinstance(keys_raw, list):
        raise bad(root, "keys must be a list")
    keys = [_key(root, k, count, i) for i, k in enumerate(keys_raw)]
    paths = [k.path for k in keys]
    if len(set(paths)) != len(paths):
        raise bad(root, "a key is listed twice")
    known = set(paths)
    for p in paths:
        for n in range(1, len(p)):
            if p[:n] in known:
                raise bad(root, f"key {p[:n]!r} is both a leaf and the parent of {p!r}")
    ring = _ring(root, raw.get("ring", {}), count)
    for name in ("batchless",):
        if not isinstance(raw.get(name, False), bool):
            raise bad(root, f"{name} must be true or false")
    for name in ("device", "tensorclass"):
        if not isinstance(raw.get(name, ""), str) or len(raw.get(name, "")) > 1000:
            raise bad(root, f"{name} must be a string")
    tensorclass = raw.get("tensorclass", "")
    if tensorclass and not all(part.isidentifier() for part in tensorclass.split(".")):
        raise bad(root, f"tensorclass {tensorclass[:100]!r} is not a dotted name 'module.ClassName'")
    sub = raw.get("sub", [])
    if not isinstance(sub, list) or not all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], list) and all(isinstance(p, str) for p in e[0])
        and isinstance(e[1], list) and all(isinstance(d, int) and not isinstance(d, bool) and RAGGED <= d <= MAX_INT for d in e[1])
        for e in sub
    ):  # fmt: skip
        raise bad(root, f"sub must be a list of [path, dims], got {sub!r}"[:300])
    try:
        classes = parse_classes(raw.get("classes", []))
    except ValueError as err:
        raise bad(root, str(err)) from None
    meta = CheckpointMeta(
        td_id, kind, count, stack_dim, inner, keys, ring, raw.get("batchless", False), raw.get("device", ""),
        raw.get("tensorclass", ""), sub, raw.get("priorities"), raw.get("sampled"), _int(raw.get("ttl_ms", 0), "ttl_ms", root),
        _stats(root, raw.get("stats", {})), _int(raw.get("overwritten_during_export", 0), "overwritten_during_export", root, 0, count),
        [[list(p), name] for p, name in classes.items()],
    )  # fmt: skip
    policy = meta.policy
    if (policy is not None and policy.prioritized) != (meta.priorities is not None):
        raise bad(root, "priorities must be given exactly when the policy has alpha")
    for name in ("priorities", "sampled"):
        if raw.get(name) is not None and not isinstance(raw.get(name), str):
            raise bad(root, f"{name} must be a file name or null")
    if meta.priorities is not None:
        _size(root, meta.priorities, tree_bytes(count), "the priority tree")
    if (policy is not None and policy.max_times is not None) != (meta.sampled is not None):
        raise bad(root, "the sample counts must be given exactly when the policy has max_times_sampled")
    if meta.sampled is not None:
        _size(root, meta.sampled, 4 * count, "the sample counts")
    return meta


#: Entries of a ``TensorDict.memmap`` ``meta.json`` that describe the tensordict, not a key.
_TD_FIELDS = {"shape", "device", "_type", "_format_version", "_class", "_is_locked", "names", "batch_size"}


def _memmap_keys(root: Path, folder: str, prefix: tuple[str, ...], count: int | None) -> tuple[int, list[KeyEntry]]:
    """The tensor keys of a ``TensorDict.memmap`` folder (plain TensorDicts of memmapped tensors only; ``folder``
    relative to ``root``, "" for ``root`` itself)."""
    if len(prefix) > MAX_DEPTH:
        raise bad(root, f"keys nest deeper than {MAX_DEPTH} ({prefix[:3]!r}...)")
    where = f"{folder}/meta.json" if folder else "meta.json"
    try:
        raw = load_json(root, where, where)
    except FileNotFoundError:
        raise bad(root, f"{where} is missing") from None
    if not isinstance(raw, dict) or raw.get("_class", "tensordict:TensorDict") != "tensordict:TensorDict":
        raise bad(root, f"{where} is not a plain TensorDict's (tdstore imports TensorDicts of tensors only)")
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) != 1:
        raise bad(root, f"{where}: a storage of one batch dim is expected, got shape {shape!r}"[:300])
    n = _int(shape[0], "the storage size", root, 1)
    if count is not None and n != count:
        raise bad(root, f"{where}: batch size {n}, the storage has {count}")
    try:
        n, _ = check_new_layout(n, 0, ())
    except ValueError as err:
        raise bad(root, str(err)) from None
    keys: list[KeyEntry] = []
    for name, entry in raw.items():
        if name in _TD_FIELDS:
            continue
        path = (*prefix, name)
        sub = f"{folder}/{name}" if folder else name
        inside(root, sub, f"key {path!r}")
        if isinstance(entry, dict) and entry.get("type") == "TensorDict":
            keys += _memmap_keys(root, sub, path, n)[1]
            continue
        if not isinstance(entry, dict) or "dtype" not in entry or entry.get("is_nested"):
            raise bad(root, f"key {path!r} is not a memory-mapped tensor (tdstore imports tensors only)"[:300])
        dtype = str(entry["dtype"]).removeprefix("torch.")
        dims = entry.get("shape")
        if dtype not in ITEMSIZE or not isinstance(dims, list) or not dims or dims[0] != n:
            raise bad(root, f"key {path!r}: dtype {entry['dtype']!r} and shape {dims!r} are not a tensor of {n} rows tdstore stores"[:300])
        e = KeyEntry(path, dtype, "dense", len(dims) - 1, f"{sub}.memmap", _dims(root, dims[1:], len(dims) - 1, f"key {path!r}"))
        _size(root, e.file, n * e.element_nbytes, f"key {path!r}")
        keys.append(e)
    return n, keys


def _torchrl_meta(root: Path) -> CheckpointMeta:
    """A checkpoint of torchrl's ``LazyTensorStorage`` (``storage.dumps(path)``): a dense store (one shape per key,
    as there) whose ring had ``len`` writes, under a new td_id.  With ``len`` 0 (an emptied buffer, whose memmaps
    still hold the old rows) nothing is written: no key is restored (a store holding rows would be a full ring)."""
    import uuid

    raw = load_json(root, TORCHRL_FILE, TORCHRL_FILE)
    if not isinstance(raw, dict) or raw.get("is_pytree") is not False:
        raise bad(root, f"{TORCHRL_FILE} is not a TensorDict storage's (pytree storages are not imported)")
    length = _int(raw.get("len"), "len", root)
    count, keys = _memmap_keys(root, "", (), None)
    if length > count:
        raise bad(root, f"len {length} is beyond the storage size {count}")
    return CheckpointMeta(str(uuid.uuid4()), "dense", count, 0, (), keys if length else [], {"rw": length} if length else {})


def is_torchrl_dump(root: Path) -> bool:
    """Whether the checkpoint folder ``root`` is torchrl's (``storage_metadata.json``, no ``tdstore.json``)."""
    return not exists(root, META_FILE) and exists(root, TORCHRL_FILE)


def locate(path: Any) -> Path:
    """The checkpoint folder of ``path``: ``path`` itself, or its ``storage`` folder when ``path`` is what
    ``ReplayBuffer.dumps`` wrote (a folder of ``storage/``, ``writer/``, ``sampler/``; never through a symlink)."""
    root = Path(path)
    if exists(root, META_FILE) or exists(root, TORCHRL_FILE):
        return root
    try:
        inside_dir = stat.S_ISDIR(os.lstat(root / STORAGE_DIR).st_mode)
    except OSError:
        return root
    return root / STORAGE_DIR if inside_dir else root


def writer_state(path: Path) -> tuple[int | None, int | None]:
    """The cursor and write count a torchrl writer saved beside the storage checkpoint ``path`` (``rb.dumps``:
    ``<dir>/storage`` and ``<dir>/writer/metadata.json``, as torchrl's ``RoundRobinWriter.dumps`` writes it);
    ``(None, None)`` when there is none, or it holds no such numbers."""
    if path.name != STORAGE_DIR:
        return None, None
    try:
        saved = load_json(path.parent, "/".join(WRITER_STATE), "the writer's state")
    except (OSError, CheckpointError):
        return None, None
    if not isinstance(saved, dict):
        return None, None

    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT else None

    return count(saved.get("cursor")), count(saved.get("write_count"))


def torchrl_ring_writes(meta: CheckpointMeta, cursor: int | None, write_count: int | None) -> tuple[int | None, int]:
    """The ring write count that continues a torchrl writer at ``cursor`` (None: the checkpoint's own) and the
    write base (``wb``) that makes ``rb.write_count`` the writer's ``write_count``.

    A ring's next slot is its write count modulo its slots, and its written slots are the first ``min(rw,
    slots)``: a full ring gets the largest count up to ``write_count`` that leaves its cursor at ``cursor``
    (``write_count`` itself for a writer never emptied with ``empty_write_count=False``, whose slots then have
    torchrl's generations), and at least one lap; a ring not full keeps its length (its cursor)."""
    n, written = meta.count, meta.written
    rw = None
    if written == n and cursor is not None and cursor < n:
        rw = n + cursor
        if write_count is not None and write_count > rw:
            rw += (write_count - rw) // n * n
    base = written if rw is None else rw
    return rw, (write_count - base if write_count is not None and write_count > base else 0)


def read_restorable(path: Any) -> tuple[Path, CheckpointMeta]:
    """What ``import_checkpoint(path)`` restores: the checkpoint folder (:func:`locate`) and its metadata, a
    torchrl dump's narrowed as ``rb.loads`` narrows it (without :data:`TORCHRL_ROW_KEYS`, its writer's cursor)."""
    root = locate(path)
    meta = read_meta(root)
    if is_torchrl_dump(root):
        meta = meta.narrowed(drop=[(k,) for k in TORCHRL_ROW_KEYS], rw=torchrl_ring_writes(meta, *writer_state(root))[0])
    return root, meta
