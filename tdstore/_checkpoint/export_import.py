"""Checkpoints: a store's rows, ring, priorities and policy written to a directory, and restored into a new store.

:func:`export_store` reads the store in chunks with its ordinary reads (a slice of elements
per call: each chunk atomic, no element torn) and writes them into preallocated memmaps (the
homogeneous keys, in ``TensorDict.memmap``'s layout) and append-only files (heterogeneous and
non-tensor keys), then the priority tree and sample counts byte for byte, then the metadata
(format: :mod:`tdstore._checkpoint.disk_format`).  Memory is bounded by a chunk
(:data:`CHUNK_ELEMENTS` elements, about :data:`CHUNK_BYTES`), not by the store.

Writers may run meanwhile, and are never held by it (no lock; each read is one short call).  The
export holds the ring as of one fence (``lua/fence.lua``: the header, the stats counters and the
time to live in one atomic step): its cursor, write count (hence generations), policy counters and
policy.  It then reads the rows, the priority tree and the sample counts, and the ring write count
once more.  A ring write goes to the slot of the oldest row and moves the write count in the same
call, so the rows writers overwrote meanwhile are exactly the fence's oldest ones, one per write
past the fence: they are kept absent (``ring.ho``, weight 0, no sample count; counted in
``overwritten_during_export``), and every other row read is the fence's, whole (each chunk is one
atomic read).  A kept row's priority and sample count are the ones read after the fence (a
sampler's ``update_priority`` meanwhile is kept: they are the row's own).  A schema or policy change
during the export makes it fail (export again); so does a store deleted or made again.  In-place
writes ``store[i] = td`` (not ring writes) are not detected: a store written by index is exported
as it is read, chunk by chunk.

:func:`import_checkpoint` checks the whole checkpoint first (:func:`prepare`: sizes, offsets,
shapes, JSON documents, the priority tree, and the header the store will have read back as any
reader reads it, its ring fields included: nothing is unpickled, nothing is written), then (only
then) deletes the store it replaces, uploads the rows through the upload path (``_front.upload``:
the store appears only when every chunk is written), each chunk read from the files, and finally
gives the store its ring write count, policy counters, policy, priority tree and sample counts in
one script call (``lua/restore.lua``).  A failure after the store was created deletes every key
the import made, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from tdstore._checkpoint.disk_format import (
    EXTRA_DIR,
    META_FILE,
    RING_FIELDS,
    TORCHRL_FILE,
    CheckpointError,
    CheckpointMeta,
    KeyEntry,
    read_meta,
    read_restorable,
)
from tdstore._checkpoint.fence import Moved, Stamps, append_part, clear_counts, held_slots, open_ragged, read_fence, rebuild_tree
from tdstore._checkpoint.file_rows import check_tree, leaf_scans
from tdstore._checkpoint.folder import opened, prepare_dir, publish_dir, read_at
from tdstore._engine import scripts, whole_store
from tdstore._engine.connection import open_client
from tdstore._engine.engine import Engine
from tdstore._format import codec, row_block, tensorclass
from tdstore._format.header_info import StoreFormatError
from tdstore._format.integrity import damaged
from tdstore._format.keys import StoreKeys
from tdstore._format.nontensor import NonTensor, element_docs
from tdstore._format.sampling_policy import tree_bytes
from tdstore._format.schema import Header, Leaf
from tdstore._format.segments import segment_length
from tdstore._front import upload
from tdstore._front.common import ttl_to_ms
from tdstore._front.progress import progress
from tdstore._front.upload_scan import LeafScan
from tdstore._inspect.audit import audit
from tdstore.dense import TensorDictStore, _connection_kwargs
from tdstore.lazy import LazyStackedTensorDictStore, attach

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_ELEMENTS",
    "CheckpointError",
    "export_checkpoint",
    "export_store",
    "import_checkpoint",
    "import_narrowed",
    "prepare",
    "read_meta",
    "restore_into",
]

#: Most elements one chunk reads or writes.
CHUNK_ELEMENTS = 10_000
#: About the most bytes one chunk reads or writes (a chunk holds at least one element).
CHUNK_BYTES = 64 << 20
#: Bytes per command when the priority tree and the sample counts are copied.
_RAW_PIECE = 1 << 20
_STAGE_TTL_MS = 120_000


# -- export ---------------------------------------------------------------------------------------


def _intact(engine: Engine) -> None:
    """Raise ``StoreDamagedError`` unless every data and table key holds what the header implies (``tdstore
    check``'s audit, two pipelines): the reads of an export would take a lost segment, or a count another
    client edited, for rows never written, and a checkpoint must hold only rows that were."""
    for _ in range(3):  # (not atomic with writers: a write between its two pipelines may look like damage, damage stays)
        found = audit(engine.client, engine.keys.prefix, engine.keys.td_id)
        if not found.problems:
            return
    detail = "; ".join(found.problems[:3]) + (f" (and {len(found.problems) - 3} more)" if len(found.problems) > 3 else "")
    raise damaged(engine.where(), f"its keys disagree with its header (count {engine.header.count}): {detail}", engine.keys.td_id)


def _key_entries(h: Header) -> list[KeyEntry]:
    out = []
    for i, (path, leaf) in enumerate(sorted(h.leaves.items(), key=lambda kv: kv[1].number)):
        name = codec.dtype_name(leaf.dtype)
        if leaf.shape is not None:
            out.append(KeyEntry(path, name, "dense", leaf.ndim, "", tuple(leaf.shape)))
        else:
            out.append(KeyEntry(path, name, "json" if leaf.json else "ragged", leaf.ndim, f"{EXTRA_DIR}/k{i}"))
    return out


def _memmaps(root: Path, entries: list[KeyEntry], count: int) -> tuple[list[KeyEntry], dict[tuple[str, ...], torch.Tensor]]:
    """Preallocate the homogeneous keys as ``TensorDict.memmap`` does (sparse files, nothing in memory);
    returns the entries with their file names and each key's memory-mapped tensor."""
    dense = [e for e in entries if e.layout == "dense"]
    if not dense:
        return entries, {}
    template = TensorDict(batch_size=[count])
    for e in dense:
        assert e.shape is not None
        template.set(e.path, torch.zeros((), dtype=codec.DTYPES[e.dtype]).expand(count, *e.shape))
    mm = template.memmap_like(prefix=root)
    tensors = {e.path: mm.get(e.path) for e in dense}
    files = {e.path: os.path.relpath(str(tensors[e.path].filename), root) for e in dense}
    for rel in files.values():  # a key of empty elements gets no file from tensordict: an empty one
        (root / rel).touch(exist_ok=True)
    return [replace(e, file=files[e.path]) if e.layout == "dense" else e for e in entries], tensors


def _chunk_rows(h: Header) -> int:
    """Elements per chunk: at most :data:`CHUNK_ELEMENTS`, and about :data:`CHUNK_BYTES` of homogeneous rows."""
    per = sum(leaf.element_nbytes for leaf in h.leaves.values() if leaf.shape is not None)
    return max(1, min(CHUNK_ELEMENTS, CHUNK_BYTES // max(1, per)))


def _read_chunk(store: Any, h: Header, lo: int, hi: int) -> TensorDictBase:
    """Elements ``lo .. hi - 1``: one ordinary read (one atomic call)."""
    return store._read_index((slice(None),) * h.stack_pos + (slice(lo, hi),))


def _elements(td: TensorDictBase, sp: int) -> list[TensorDictBase]:
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == sp:
        return list(td.tensordicts)
    return list(td.unbind(sp))


def _write_chunk(td: TensorDictBase, h: Header, entries: list[KeyEntry], mms: dict, files: dict, lo: int, hi: int) -> int:
    """Write one chunk into the memmaps and ragged files; returns its bytes."""
    sp, n, total = h.stack_pos, hi - lo, 0
    elements: list[TensorDictBase] | None = None
    for e in entries:
        if e.layout == "dense":
            t = td.get(e.path)
            t = t.movedim(sp, 0) if sp else t
            mms[e.path][lo:hi] = t
            total += t.numel() * t.element_size()
            continue
        if e.layout == "json":
            pieces = element_docs(e.path, NonTensor(td.get(e.path)), n, sp)
        else:
            if elements is None:
                elements = _elements(td, sp)
            pieces = [el.get(e.path) for el in elements]
        data, offsets, shapes = files[e.path][:3]
        flat = torch.cat([t if t.ndim == 1 else t.reshape(-1) for t in pieces]) if pieces else torch.zeros(0)
        ends = files[e.path][3] + np.cumsum([t.numel() for t in pieces], dtype=np.int64) * flat.element_size()
        data.write(codec.to_bytes(flat))
        offsets.write(ends.astype("<i8").tobytes())
        shapes.write(np.array([d for t in pieces for d in t.shape], dtype="<i8").tobytes())
        total += int(ends[-1]) - files[e.path][3]
        files[e.path][3] = int(ends[-1])
    return total


def export_store(store: Any, path: Any, *, pbar: bool = False, extra: dict[str, Any] | None = None) -> CheckpointMeta:
    """Write ``store`` (its rows, ring state, priorities, policy and stats) into the directory ``path``.

    ``path`` may be absent, an empty directory or an earlier checkpoint (replaced only once the
    new one is whole).  ``extra`` maps file names to JSON documents written beside the metadata.
    Writers may run meanwhile (see the module docstring): the result's ``overwritten_during_export``
    counts the rows they overwrote, which the checkpoint holds absent.  Raises ``RuntimeError``
    when the schema or the policy changed during the export.
    """
    lazy = LazyStackedTensorDictStore.stack_of(store)
    engine: Engine = lazy._engine
    path = Path(path).resolve()  # "." or "ckpt/" name a directory with a name (renamed into place at the end)
    for _ in range(3):  # the header the export plans from, then (its files ready) the fence: one version of the store
        engine.set_header(engine.fetch_header())
        h = engine.header
        _intact(engine)
        tmp = prepare_dir(path, META_FILE)
        try:
            meta = _export(lazy, engine, h, tmp, pbar)
            for name, doc in (extra or {}).items():
                (tmp / name).write_text(json.dumps(doc))
            (tmp / META_FILE).write_text(json.dumps(meta.to_json(), indent=1))
            publish_dir(tmp, path)
            return meta
        except Moved:
            shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    raise RuntimeError(f"the schema or policy of the store with {engine.where()} keeps changing: export it again later")


def _export(lazy: Any, engine: Engine, h: Header, root: Path, pbar: bool) -> CheckpointMeta:
    """The checkpoint of the store ``h`` describes into ``root``: its files made, the fence taken (``Moved`` when
    the store is another version than ``h`` by then), the rows read, oldest first, and the ring state set."""
    count, plan = h.count, h.sampling
    entries = _key_entries(h)
    # a nested key named like a file of the checkpoint puts the memmap in a folder of its own (no longer torchrl's layout)
    clash = any(len(e.path) > 1 and e.path[0] in (EXTRA_DIR, META_FILE, TORCHRL_FILE) for e in entries if e.layout == "dense")
    entries, mms = _memmaps(root / "rows" if clash else root, entries, count)
    if clash:
        entries = [replace(e, file=f"rows/{e.file}") if e.layout == "dense" else e for e in entries]
    ragged = [e for e in entries if e.layout != "dense"]
    priorities = f"{EXTRA_DIR}/priorities.f64" if plan is not None and plan.prioritized else None
    sampled = f"{EXTRA_DIR}/sampled.u32" if plan is not None and plan.max_times is not None else None
    if ragged or priorities or sampled:
        (root / EXTRA_DIR).mkdir(exist_ok=True)
    for rel, size in ((priorities, tree_bytes(count)), (sampled, 4 * count)):
        if rel is not None:
            with open(root / rel, "wb") as blank:
                blank.truncate(size)
    tree = np.memmap(root / priorities, dtype="<f8", mode="r+", shape=(count,)) if priorities else None
    times = np.memmap(root / sampled, dtype="<u4", mode="r+", shape=(count,)) if sampled else None
    files: dict[tuple[str, ...], list[Any]] = {}
    first_part: dict[tuple[str, ...], list[Any]] = {}  # the slots read first ([c, count)), appended at the end
    try:
        for i, e in enumerate(ragged):
            files[e.path] = open_ragged(root / e.file, True)
            first_part[e.path] = open_ragged(root / EXTRA_DIR / f"part{i}", False)
        fence = read_fence(engine)  # as late as can be: the writes from here on race the reads
        if (fence.fields.get("epoch"), fence.fields.get("version")) != (h.epoch, str(h.version)):
            raise Moved
        stamps = Stamps(engine, h, fence)
        order = stamps.order()
        rows = _chunk_rows(h)
        with progress(pbar, count, "export") as bar:
            for n, (lo, end) in enumerate(order):
                target = first_part if n == 0 and len(order) > 1 else files
                while lo < end:
                    hi = min(end, lo + rows)
                    got = _write_chunk(_read_chunk(lazy, h, lo, hi), h, entries, mms, target, lo, hi) if entries else 0
                    stamps.read(lo, hi, tree, times)
                    if bar is not None:
                        bar.update(hi - lo)
                    if ragged:  # heterogeneous elements: the next chunk is sized on this one's bytes per element
                        rows = max(1, min(CHUNK_ELEMENTS, CHUNK_BYTES // max(1, got // (hi - lo))))
                    lo = hi
        for i, e in enumerate(ragged):
            if len(order) > 1:
                append_part(
                    files[e.path], first_part[e.path], {x: root / EXTRA_DIR / f"part{i}.{x}" for x in ("data", "offsets", "shapes")}
                )
    finally:
        for f in [*files.values(), *first_part.values()]:
            for handle in f[:3]:
                handle.close()
        for i in range(len(ragged)):
            for x in ("data", "offsets", "shapes"):
                (root / EXTRA_DIR / f"part{i}.{x}").unlink(missing_ok=True)
        mms.clear()  # unmapped: the files hold every row
        for m in (tree, times):
            if m is not None:
                m.flush()
        del tree, times
    fields = fence.fields
    policy_raw = fields.get("sc")
    policy = json.loads(policy_raw) if policy_raw else None
    ring: dict[str, Any] = {n: int(fields[n]) for n in ("rw", "lb", "sn", "rr") if fields.get(n) is not None}
    if fields.get("pm") is not None:
        ring["pm"] = float(fields["pm"])
    if policy is not None:
        ring["policy"] = policy
    meta = CheckpointMeta(
        td_id=engine.keys.td_id, kind=h.kind, count=count, stack_dim=h.stack_dim, inner=h.inner, keys=entries, ring=ring,
        batchless=h.batchless, device=h.device, tensorclass=h.tensorclass, sub=[[list(p), list(d)] for p, d in h.sub.items()],
        ttl_ms=max(fence.pttl, 0), stats=fence.stats, priorities=priorities, sampled=sampled,
        classes=[[list(p), name] for p, name in h.classes.items()],
    )  # fmt: skip
    # the fence's rows writers overwrote before the export read them are its oldest: absent, with every older one
    first, fence_rw = stamps.first, stamps.fence_rw
    meta.overwritten_during_export = first - stamps.oldest
    held = held_slots(count, first, fence_rw)
    if first > stamps.oldest:
        ring["rw"], ring["ho"] = fence_rw, first
        if ring.get("rr") is not None:  # a queue's next item is the oldest one held
            ring["rr"] = max(ring["rr"], first)
    if meta.priorities is not None:
        rebuild_tree(root / meta.priorities, count, held)
    if meta.sampled is not None:
        clear_counts(root / meta.sampled, count, held)
    if all(e.layout == "dense" for e in entries) and entries and not clash and h.stack_pos == 0 and not h.inner and not h.sub:
        # torchrl's TensorStorageCheckpointer reads this beside the memmap: LazyTensorStorage(count).loads(root)
        (root / TORCHRL_FILE).write_text(json.dumps({"metadata": {}, "is_pytree": False, "len": meta.written}))
    return meta


# -- import ---------------------------------------------------------------------------------------


def _header(engine: Engine, meta: CheckpointMeta, scans: list[LeafScan], token: str) -> Header:
    """The header of the upload, as ``_front.upload`` builds it from a scan (a header without keys: what an empty store is made with)."""
    if not scans:
        return Header(version=1, count=meta.count, stack_dim=meta.stack_dim, inner=meta.inner, device=meta.device,
                      kind=meta.kind, tensorclass=meta.tensorclass, batchless=meta.batchless)  # fmt: skip
    leaves = {}
    for n, (e, s) in enumerate(zip(meta.keys, scans, strict=True)):
        leaves[e.path] = Leaf(e.path, n, s.dtype, e.ndim, e.shape, json=s.json)
    header = Header(
        version=1, count=meta.count, stack_dim=meta.stack_dim, inner=meta.inner, device=meta.device, leaves=leaves,
        next_leaf=len(leaves), state=f"uploading:{token}", kind=meta.kind, tensorclass=meta.tensorclass,
        batchless=meta.batchless, sub={tuple(p): tuple(d) for p, d in meta.sub},
        classes={tuple(p): name for p, name in meta.classes},
    )  # fmt: skip
    header = row_block.grouped_header(header, len(leaves))
    width = header.row[1] if header.row is not None else 0
    largest = max((int(s.element_bytes().max()) for s in scans), default=1)
    return replace(header, seg=segment_length(meta.count, max(largest, width), engine.segment_size), spread=engine.spread)


def _ring_words(meta: CheckpointMeta) -> list[str]:
    """``restore.lua``'s header fields (``name=value``), as the header will hold them."""
    ring = meta.ring
    return [f"{n}={ring[n]:.17g}" if n == "pm" else f"{n}={ring[n]}" for n in RING_FIELDS if ring.get(n) is not None]


def _check_header(root: Path, header: Header, meta: CheckpointMeta) -> None:
    """The header the store will hold once restored (the upload's, ready, with the ring fields and policy
    ``restore.lua`` sets) read back as every reader reads it (``Header.from_fields``: leaves that start
    with the inner batch size, counters and policy in the scripts' ranges, sub-tree dims, ...):
    whatever a reader would call damaged is refused before anything is written."""
    fields: dict[bytes | str, bytes | str] = dict(replace(header, state="ready", tracked=not header.spread).fields().items())
    for word in _ring_words(meta):
        name, _, value = word.partition("=")
        fields[name] = value
    policy = meta.policy
    if policy is not None:
        fields["sc"] = policy.to_json()
    try:
        Header.from_fields(fields)
        if meta.device:
            torch.device(meta.device)
    except (StoreFormatError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"{root} is not a valid tdstore checkpoint: the store it describes is not one tdstore makes: {err}") from None


@dataclass
class Prepared:
    """A checkpoint checked against a server (:func:`prepare`): what :func:`restore_into` writes."""

    root: Path
    meta: CheckpointMeta
    scans: list[LeafScan]
    header: Header
    token: str
    chunk_bytes: int


def prepare(path: Any, meta: CheckpointMeta, engine: Engine) -> Prepared:
    """Every check of the checkpoint in ``path`` (``meta``: what :func:`read_meta` read there, maybe narrowed)
    that can be made before anything is written: the priority tree, every ragged key's offsets, shapes and
    documents, the header the store will have, and the room on ``engine``'s server.  Reads only."""
    root = Path(path)
    if meta.priorities is not None:
        check_tree(root, meta.priorities, meta.count, meta.written)
    scans = leaf_scans(root, meta)
    token = uuid.uuid4().hex
    header = _header(engine, meta, scans, token)
    _check_header(root, header, meta)
    chunk_bytes = CHUNK_BYTES
    if scans:
        sizes = {s.path: s.element_bytes() for s in scans}
        chunk_bytes = upload._check_fits(engine, header, scans, sizes, CHUNK_BYTES)
    return Prepared(root, meta, scans, header, token, chunk_bytes)


def _upload_rows(engine: Engine, plan: Prepared, pbar: bool, ttl_ms: int) -> None:
    """Upload the checkpoint's elements (``_front.upload``'s steps: create uploading, chunks, commit), or create an empty store."""
    header, scans = plan.header, plan.scans
    if not scans:
        if engine.create(header, ttl_ms=ttl_ms) is not None:
            raise FileExistsError(f"a store with {engine.where()} already exists; pick another td_id or delete it first")
        return
    sizes = {s.path: s.element_bytes() for s in scans}
    spread = engine.spread and header.segments.n > 1
    if engine.create(header, ttl_ms=upload.UPLOAD_TTL_MS) is not None:
        raise FileExistsError(f"a store with {engine.where()} already exists; pick another td_id or delete it first")
    header = engine.header
    try:
        upload._send(engine, header, scans, sizes, pbar=pbar, chunk_elements=CHUNK_ELEMENTS, chunk_bytes=plan.chunk_bytes, spread=spread)
        upload._commit(engine, header, plan.token, ttl_ms, spread)
    except BaseException:
        try:
            whole_store.abort_upload(engine, header.next_leaf, header.segments.n)
        finally:
            engine.set_header(None)
        raise
    engine.set_header(header.ready())


def _stage(engine: Engine, root: Path, rel: str | None, target: str, token: str) -> tuple[str, int]:
    """Copy a raw file into a staging key of ``target`` (a short time to live), a piece per command."""
    stage = engine.keys.staging(target, token)
    if rel is None:
        return stage, 0
    with opened(root, rel, "a policy file") as fd:
        size = os.fstat(fd).st_size
        lo = 0
        while lo < size:
            pipe = engine.client.pipeline(transaction=False)
            for _ in range(16):
                n = min(_RAW_PIECE, size - lo)
                if n > 0:
                    pipe.setrange(stage, lo, bytes(read_at(fd, lo, n)))
                    lo += n
            pipe.pexpire(stage, _STAGE_TTL_MS)
            pipe.execute()
    return stage, size


def _restore_ring(engine: Engine, root: Path, meta: CheckpointMeta) -> None:
    """Ring counters, policy, priority tree, sample counts and stats counters: staged, then set in one script call."""
    keys = engine.keys
    token = uuid.uuid4().hex
    tree_stage, times_stage = keys.staging(keys.priorities, token), keys.staging(keys.times_sampled, token)
    policy = meta.policy
    h = engine.header
    try:
        tree_stage, tree_len = _stage(engine, root, meta.priorities, keys.priorities, token)
        times_stage, times_len = _stage(engine, root, meta.sampled, keys.times_sampled, token)
        reply = scripts.call(
            engine.client,
            "restore",
            [keys.meta, keys.priorities, keys.times_sampled, tree_stage, times_stage, keys.stats],
            [
                f"{h.epoch}:V{h.version}",
                " ".join(_ring_words(meta)),
                policy.to_json() if policy else "",
                tree_len,
                times_len,
                keys.events,
                " ".join(f"{k}={v}" for k, v in sorted(meta.stats.items())),
            ],  # fmt: skip
        )
    finally:
        engine.command("DEL", tree_stage, times_stage)
    if reply[0] != b"OK":
        raise RuntimeError(f"the store with {engine.where()} was changed or deleted by someone else while it was restored")
    engine.adopt_stale(reply)


def _remove_made(engine: Engine, header: Header) -> None:
    """Delete the store this import made (every key of it), whatever state it was left in: by its header
    when that reads back, else (a header another client damaged reads as gone to ``clear``) by the keys the
    upload's header names, while the header there is still this import's (its epoch)."""
    try:
        whole_store.clear(engine)
    except Exception:  # (deleted by name below)
        pass
    if engine.command("HGET", engine.keys.meta, "epoch") == header.epoch.encode():
        whole_store.abort_upload(engine, header.next_leaf, header.segments.n)


def restore_into(
    path: Any, *, engine: Engine, pbar: bool = False, ttl_ms: int = 0, meta: CheckpointMeta | None = None, plan: Prepared | None = None
) -> CheckpointMeta:
    """Restore the checkpoint in ``path`` as the new store ``engine`` names (which must not exist).

    Everything is checked before anything is written (:func:`prepare`, or ``plan``, what it returned;
    :class:`CheckpointError`); the store appears with its rows, then gets its ring and policy state in
    one call; a failure after the store was created deletes it.  ``meta``: what :func:`read_meta` read
    of ``path``, narrowed by the caller (``CheckpointMeta.narrowed``).
    """
    if plan is None:
        plan = prepare(path, read_meta(path) if meta is None else meta, engine)
    meta = plan.meta
    _upload_rows(engine, plan, pbar, ttl_ms)
    # nothing to give (a spread store has no ring: its guards would not follow a version bump)
    if not meta.ring and (not meta.stats or engine.spread):
        return meta
    try:
        _restore_ring(engine, plan.root, meta)
    except BaseException:
        _remove_made(engine, plan.header)  # no half-restored store is left behind
        raise
    return meta


# -- the public calls -----------------------------------------------------------------------------


def export_checkpoint(store: Any, path: Any, *, pbar: bool = False, extra: dict[str, Any] | None = None) -> CheckpointMeta:
    """Write ``store`` (any tdstore store: rows, ring, priorities, policy) into the directory ``path``; returns
    what was written (``count``, ``keys``, ``ring``). ``extra`` maps file names to JSON documents written
    beside the metadata (an adapter's own state: torchrl's ``store.json``).

    See :func:`export_store` and :mod:`tdstore._checkpoint.disk_format` for the format.
    """
    return export_store(store, path, pbar=pbar, extra=extra)


def import_checkpoint(
    path: Any,
    *,
    td_id: str | None = None,
    replace: bool = False,
    pbar: bool = False,
    ttl: float | None = None,
    tensorclass_cls: Any = None,
    **store_kwargs: Any,
) -> Any:
    """A new store on the server ``store_kwargs`` name (``url=...``, ``prefix=...``, ...) holding the checkpoint in ``path``.

    The store gets the checkpoint's td_id unless ``td_id`` is given; a store of that id that
    exists already is refused (``FileExistsError``) unless ``replace=True``, which deletes it
    first (once the checkpoint passed every check). It gets the time to live the exported store had
    left unless ``ttl`` is given. ``path`` may also be the folder ``rb.dumps`` wrote (its ``storage``
    checkpoint is read) or a torchrl dump (restored without torchrl's ``"index"`` key, at its writer's
    cursor). Returns the store (a ``TensorDictStore`` for a dense checkpoint), with the checkpoint's
    rows, ring state, priorities and sampling policy.
    """
    root, meta = read_restorable(path)
    return import_narrowed(root, meta, td_id=td_id, replace=replace, pbar=pbar, ttl=ttl, tensorclass_cls=tensorclass_cls, **store_kwargs)


def import_narrowed(
    path: Any,
    meta: CheckpointMeta,
    *,
    td_id: str | None = None,
    replace: bool = False,
    pbar: bool = False,
    ttl: float | None = None,
    tensorclass_cls: Any = None,
    **store_kwargs: Any,
) -> Any:
    """:func:`import_checkpoint` of ``path`` as ``meta`` describes it: what :func:`read_meta` read there, narrowed by
    the caller (``CheckpointMeta.narrowed``: keys left out, another ring write count), restored in the same calls."""
    tid = meta.td_id if td_id is None else td_id
    client, spec, owned = open_client(**_connection_kwargs(store_kwargs))
    keys = StoreKeys(store_kwargs.get("prefix", "tensordict"), tid)
    options = {"segment_bytes": store_kwargs.get("segment_bytes"), "spread": store_kwargs.get("spread", False)}
    engine = Engine(spec, keys, client, owns_client=owned, **options)
    try:
        plan = prepare(path, meta, engine)  # every check first: a refused checkpoint leaves the store it would replace as it was
        if replace:
            old = Engine(spec, keys, client, owns_client=False, **options)  # the store there now, deleted
            try:
                old.set_header(old.fetch_header())
            except KeyError:
                pass
            else:
                whole_store.clear(old)
        restore_into(path, engine=engine, pbar=pbar, ttl_ms=meta.ttl_ms if ttl is None else ttl_to_ms(ttl), plan=plan)
    except BaseException:
        engine.close()
        raise
    store = attach(engine, backend=store_kwargs.get("backend", "redis"), cache_metadata=store_kwargs.get("cache_metadata", True))
    if engine.header.kind == "dense":
        store = TensorDictStore._open_view(store)
    return tensorclass.wrap(store, engine.header.tensorclass, tensorclass_cls)
