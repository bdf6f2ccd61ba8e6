"""Stores written by the reference ``tensordict.store``, copied into tdstore (``tdstore import-reference``).

The reference keeps a store as one key per leaf (``d:<dotted path>``, the whole tensor's raw
bytes; a heterogeneous leaf of a lazy stack adds ``d:<path>:idx``, its elements' byte offsets)
beside a metadata hash per leaf (``m:<path>``: shape, dtype, per-element shapes, non-tensor
encoding) and a few ``__name__`` keys (batch size, count, stack dim, inner batch size, device,
tensorclass name, the set of key paths): see ``_format.keys.reference_key``.  tdstore cannot read that
layout in place (its calls are scripts over its own header), so the store is copied: each key is
streamed into a checkpoint directory (``_checkpoint.disk_format``, a piece of 1 MiB per command:
memory bounded by a piece, not by a key), which is then imported as usual, so everything the
import checks applies.  Nothing of the reference is imported and nothing is unpickled: a
non-tensor leaf the reference pickled is refused, naming the key.  The copy is a snapshot only
when nobody writes the reference store meanwhile.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tdstore._checkpoint.disk_format import EXTRA_DIR, ITEMSIZE, META_FILE, CheckpointMeta, KeyEntry
from tdstore._checkpoint.export_import import import_checkpoint
from tdstore._engine.connection import open_client
from tdstore._format.keys import reference_key
from tdstore.dense import _connection_kwargs

__all__ = ["ReferenceStoreError", "import_reference", "is_reference_store", "reference_to_checkpoint"]

_PIECE = 1 << 20


class ReferenceStoreError(ValueError):
    """A reference store tdstore cannot copy (absent, pickled values, a layout it does not know)."""


def _text(client: Any, key: str) -> str | None:
    v = client.get(key)
    return v.decode() if isinstance(v, bytes) else v


def is_reference_store(client: Any, prefix: str, td_id: str) -> bool:
    """Whether ``td_id`` names a store of the reference ``tensordict.store`` under ``prefix`` (one round trip)."""
    names = ("__keys__", "__batch_size__", "__type__", "__count__")
    return bool(client.exists(*(reference_key(prefix, td_id, n) for n in names)))


def _stream(client: Any, key: str, dest: Path, want: int | None, what: str) -> int:
    """Copy a server string into ``dest`` in pieces; returns its length (``want``: the length it must have)."""
    size = int(client.strlen(key))
    if want is not None and size != want:
        raise ReferenceStoreError(f"{what}: the key {key!r} holds {size} bytes, its metadata says {want}")
    with open(dest, "wb") as f:
        for lo in range(0, size, _PIECE):
            f.write(client.getrange(key, lo, min(size, lo + _PIECE) - 1))
    return size


def _dtype(raw: Any, what: str) -> str:
    name = (raw.decode() if isinstance(raw, bytes) else str(raw)).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ReferenceStoreError(f"{what} has dtype {name!r}, which tdstore does not store")
    return name


def _json_docs(values: list[Any], dest: Path, n_inner: int) -> None:
    """Non-tensor elements as tdstore's JSON documents (``_format.nontensor``): data, offsets, shapes files."""
    docs = [json.dumps(["s" if n_inner else "d", v], ensure_ascii=False, separators=(",", ":")).encode() for v in values]
    ends = np.cumsum([0, *(len(d) for d in docs)], dtype=np.int64)
    Path(f"{dest}.data").write_bytes(b"".join(docs))
    ends.astype("<i8").tofile(f"{dest}.offsets")
    np.array([len(d) for d in docs], dtype="<i8").tofile(f"{dest}.shapes")


def _meta_fields(client: Any, key: str) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in client.hgetall(key).items()
    }


def reference_to_checkpoint(client: Any, prefix: str, td_id: str, root: Path) -> CheckpointMeta:
    """Write the reference store ``td_id`` into the (empty) directory ``root`` as a tdstore checkpoint."""

    def rk(suffix: str) -> str:
        return reference_key(prefix, td_id, suffix)

    if not is_reference_store(client, prefix, td_id):
        raise ReferenceStoreError(f"no store of tensordict.store with td_id={td_id!r} under prefix {prefix!r}")
    lazy = _text(client, rk("__type__")) == "lazy_stack"
    if lazy:
        count = int(_text(client, rk("__count__")) or 0)
        inner = tuple(json.loads(_text(client, rk("__inner_batch_size__")) or "[]"))
        stack_dim = int(_text(client, rk("__stack_dim__")) or 0)
        batchless = False
    else:
        batch = tuple(json.loads(_text(client, rk("__batch_size__")) or "[]"))
        batchless = not batch
        count, inner, stack_dim = (batch[0], batch[1:], 0) if batch else (1, (), 0)
    if count < 1:
        raise ReferenceStoreError(f"the reference store {td_id!r} holds no elements (count {count}); nothing to copy")
    (root / EXTRA_DIR).mkdir(parents=True, exist_ok=True)
    keys: list[KeyEntry] = []
    paths = sorted(m.decode() if isinstance(m, bytes) else m for m in client.smembers(rk("__keys__")))
    for i, dotted in enumerate(paths):
        path = tuple(dotted.split("."))
        what = f"key {dotted!r} of the reference store {td_id!r}"
        meta = _meta_fields(client, rk(f"m:{dotted}"))
        stem = f"{EXTRA_DIR}/k{i}"
        if meta.get("is_non_tensor") == "1":
            encoding = meta.get("encoding", "json")
            if encoding not in ("json", "json_array"):
                raise ReferenceStoreError(
                    f"{what} holds a {encoding}-encoded value; tdstore never unpickles: store it as JSON data, or drop the key"
                )
            value = json.loads(client.get(rk(f"d:{dotted}")) or b"null")
            if encoding == "json_array" and not batchless:
                if not isinstance(value, list) or len(value) != count:
                    raise ReferenceStoreError(f"{what}: a json_array of {count} entries is expected")
                values = value
            else:
                values = [value] * count
            _json_docs(values, root / stem, len(inner) if encoding == "json_array" else 0)
            keys.append(KeyEntry(path, "uint8", "json", 1, stem))
            continue
        dtype = _dtype(meta.get("dtype", ""), what)
        shape = json.loads(meta.get("shape", "[]"))
        if lazy and meta.get("homogeneous") == "0":
            shapes = json.loads(meta.get("shapes", "[]"))
            if len(shapes) != count:
                raise ReferenceStoreError(f"{what}: {len(shapes)} element shapes for {count} elements")
            ndim = len(shapes[0]) if shapes else 0
            _stream(client, rk(f"d:{dotted}"), root / f"{stem}.data", None, what)
            _stream(client, rk(f"d:{dotted}:idx"), root / f"{stem}.offsets", 8 * (count + 1), what)
            np.asarray(shapes, dtype="<i8").reshape(-1).tofile(root / f"{stem}.shapes")
            keys.append(KeyEntry(path, dtype, "ragged", ndim, stem))
            continue
        element = tuple(shape[1:]) if not batchless else tuple(shape)
        if not batchless and (not shape or shape[0] != count):
            raise ReferenceStoreError(f"{what} has shape {shape}, not {count} elements first")
        entry = KeyEntry(path, dtype, "dense", len(element), f"{stem}.bin", element)
        _stream(client, rk(f"d:{dotted}"), root / entry.file, count * math.prod(element) * ITEMSIZE[dtype], what)
        keys.append(entry)
    tensorclass = _text(client, rk("__tensorclass__")) or ""
    meta_out = CheckpointMeta(
        td_id=td_id, kind="lazy" if lazy else "dense", count=count, stack_dim=stack_dim, inner=inner, keys=keys,
        batchless=batchless, device="", tensorclass=tensorclass,
    )  # fmt: skip
    (root / META_FILE).write_text(json.dumps(meta_out.to_json()))
    return meta_out


def import_reference(
    td_id: str, *, new_td_id: str | None = None, prefix: str = "tensordict", pbar: bool = False, **store_kwargs: Any
) -> Any:
    """Copy the reference store ``td_id`` into a new tdstore store (``new_td_id``, by default the same id) on the same server.

    The reference's keys stay as they are (tdstore never writes them); a reference key
    path made of digits only would share a name with tdstore's keys of the same id, so
    such a store needs another ``new_td_id``.  Returns the new store.
    """
    client, _, owned = open_client(**_connection_kwargs(store_kwargs))
    try:
        target = td_id if new_td_id is None else new_td_id
        if target == td_id:
            members = client.smembers(reference_key(prefix, td_id, "__keys__"))
            digits = [m.decode() if isinstance(m, bytes) else str(m) for m in members if m.isdigit()]
            if digits:
                raise ReferenceStoreError(
                    f"the reference store {td_id!r} has keys named {sorted(digits)}, whose server keys "
                    "tdstore uses under the same id; copy it under another id (new_td_id=..., --td-id)"
                )
        tmp = Path(tempfile.mkdtemp(prefix="tdstore-reference-"))
        try:
            reference_to_checkpoint(client, prefix, td_id, tmp)
            return import_checkpoint(tmp, td_id=target, pbar=pbar, prefix=prefix, **store_kwargs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if owned:
            client.close()
