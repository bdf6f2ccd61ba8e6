"""The versioned store header: what a client caches, and how it is checked.

The header hash holds the fixed facts of a store (type, count, stack dim, inner
batch size, device) and the *schema*: one record per leaf (path, leaf number,
dtype, layout, element shape).  Three kinds of version guard it, all bumped inside
the script that changes the schema:

* ``version``: every schema change.  A schema change itself (which rewrites the
  whole schema) is only applied on the exact version it was planned from.
* ``kv`` (key-set version): adds, deletes and renames.  Reads that select leaves
  by prefix ("all keys", ``store["nested"]``) check it, so they never miss a key.
* ``lv:<n>`` (leaf version): any change of leaf ``n`` (rename, dtype, shape,
  layout, delete).  Every data call checks the leaves it touches.

Every data script is given the versions the client planned with and refuses to
run on a mismatch (see ``lua/_lib.lua``).  So a cached :class:`Header` may be
stale, but it can never make a script read or write the wrong bytes, and a call
that touches only unchanged leaves is not disturbed by changes to other keys.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from tdstore._format import codec
from tdstore._format.header_info import RAGGED, StoreFormatError, parse_classes, parse_header
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._format.trajectories import Trajectories

__all__ = ["FORMAT", "FORMAT_ROWS", "FORMAT_SPREAD", "FORMATS", "Header", "Leaf", "NestedPath", "StoreFormatError", "check_paths"]
from tdstore._format.segments import Segments

FORMAT = "1"
"""Layout version written in the header of a store without a row block."""
FORMAT_ROWS = "2"
"""Layout version of a store that has (or had) a row block: tdstore versions that do not know
the block refuse it instead of reading grouped keys from blobs that do not exist."""
#: A spread store (Redis Cluster): each segment under its own hash tag with a guard hash
#: (``_format.keys``); releases that do not know it refuse the store instead of reading the wrong keys.
FORMAT_SPREAD = "3"
FORMATS = (FORMAT, FORMAT_ROWS, FORMAT_SPREAD)
"""The formats this tdstore reads; a header of another format is refused."""

NestedPath = tuple[str, ...]


class KeySpec(NamedTuple):
    """What a store's ``key_specs()`` says of one leaf key: its dtype, one element's shape (None when it
    varies per element) and whether it is held as JSON (non-tensor data)."""

    dtype: torch.dtype
    shape: tuple[int, ...] | None
    json: bool


def key_specs_of(h: Header) -> dict[NestedPath, KeySpec]:
    """Every leaf of header ``h`` as a :class:`KeySpec`, by path."""
    return {path: KeySpec(leaf.dtype, leaf.shape, leaf.json) for path, leaf in h.leaves.items()}


@dataclass(frozen=True)
class Leaf:
    """One leaf key of the store.

    ``shape`` is the shape of one element's tensor (inner batch dims first) for a
    homogeneous leaf, and ``None`` for a heterogeneous one, whose per-element shapes
    live in its shape table on the server.
    """

    path: NestedPath
    number: int
    dtype: torch.dtype
    ndim: int
    shape: tuple[int, ...] | None
    version: int = 0
    json: bool = False
    """A non-tensor key: element ``i`` holds the UTF-8 JSON of its value (see ``_format.nontensor``)."""
    col: int | None = None
    """Byte offset of this leaf's element inside the store's row block (see :attr:`Header.row`),
    or ``None`` when the leaf has a blob of its own."""

    @property
    def het(self) -> bool:
        return self.shape is None

    @property
    def element_nbytes(self) -> int:
        assert self.shape is not None
        return codec.nbytes(self.shape, self.dtype)

    def to_json(self) -> dict:
        rec: dict = {
            "path": list(self.path),
            "n": self.number,
            "dtype": codec.dtype_name(self.dtype),
            "ndim": self.ndim,
            "v": self.version,
        }
        if self.shape is not None:
            rec["shape"] = list(self.shape)
        if self.json:
            rec["nt"] = 1
        if self.col is not None:
            rec["col"] = self.col
        return rec

    def same_layout(self, other: Leaf) -> bool:
        """Same name, number, dtype and layout: a data call planned with one is right for the other."""
        return (self.path, self.number, self.dtype, self.ndim, self.shape, self.json, self.col) == (
            other.path,
            other.number,
            other.dtype,
            other.ndim,
            other.shape,
            other.json,
            other.col,
        )


@dataclass(frozen=True)
class Header:
    """A client's view of a store header (immutable; replaced on refresh)."""

    version: int
    count: int
    stack_dim: int
    inner: tuple[int, ...]
    device: str
    kind: str = "lazy"
    leaves: dict[NestedPath, Leaf] = field(default_factory=dict)
    next_leaf: int = 0
    state: str = "ready"
    keyset_version: int = 1
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))
    """Random token of this creation of the store: a store deleted and created again
    under the same id has another, so handles on the old one are refused."""
    batchless: bool = False
    """A dense store of batch size ``[]``, kept as a stack of one element whose stack dim
    its front class hides."""
    tensorclass: str = ""
    """``module.QualName`` of the tensorclass the store was uploaded from: a name only,
    matched against classes the program gives or registers, never imported."""
    seg: int = 0
    """Elements per segment (see ``_format.segments``); 0 keeps every element in one segment.
    Fixed once the store holds data: the element-to-key mapping depends on it."""
    row: tuple[int, int] | None = None
    """The row block, ``(leaf number, bytes per element)``: one blob per segment holding, per
    element, the bytes of every grouped leaf side by side (leaf ``col`` gives where), so an
    element or a random batch of them is one ``GETRANGE`` per element for all those leaves.
    Set when a store gets its first keys; a leaf leaves the block (its column stays as a
    dead gap) when it is deleted or changes layout, and the block goes with its last leaf."""

    spread: bool = False
    """Segments on several Redis Cluster nodes: each under its own hash tag, guarded by a copy
    of the epoch and version next to it (``_format.keys``); set when the store is created."""

    tracked: bool = False
    """The store keeps an inventory of its allocated keys (header field ``na``, see ``_format.integrity``),
    so its segments are allocated when first written; set when the store is created (not for a
    spread store, whose segments live on several nodes and are allocated up front)."""

    sampling: SamplingPolicy | None = None
    """The ring's sampling policy (priorities, rate limiter, queue; header field ``sc``, see
    ``_format.sampling_policy``), set by ``lua/sampling.lua`` only: a header built by the client never writes it."""

    absent_rows: bool = False
    """The ring was restored from a checkpoint taken while writers ran with rows absent (header field ``ho``,
    set by ``lua/restore.lua`` only): its samples are drawn by the server (``lua/_absent.lua``), never by the client."""
    trajectories: Trajectories | None = None
    """The key that tells the ring's trajectories apart (header field ``tj``, set by ``lua/trajectories.lua``
    only; see ``_format.trajectories``): every ring write then passes each row's id or end flag."""

    leased: bool = False
    """A leased pop ran on the ring (header field ``ls``, set by ``read.lua``'s 'L' op only): plain
    pops then take the lease table's items waiting for redelivery too (see ``_ring.leases``)."""

    distinct: bool = False
    """The ring tracks distinct rows sampled (header field ``sd``, set by ``lua/distinct.lua`` only; off by
    default): a full ring's transaction sample then marks its rows in the sampled-rows bitmap too."""

    rollouts: bool = False
    """The ring keeps a rollout index (header field ``ro``, set by ``lua/_rollouts.lua`` only): every ring
    write stamps its rows, and samples and pops go through ``read.lua``'s 'G' op (see ``_ring.rollouts``)."""

    sub: dict[NestedPath, tuple[int, ...]] = field(default_factory=dict)
    """Batch dims of nested sub-trees beyond the store's own: ``{("chat", "prompt"): (1,)}`` for a
    ``[5]`` store whose ``("chat", "prompt")`` sub-tree has batch size ``[5, 1]`` (chat-style data).
    Kept in the schema JSON (``"sub"``), so every schema change carries it; tdstore versions that
    do not know it read the sub-tree with the store's batch size (the bytes are the same).
    A dim of ``-1`` (:data:`RAGGED`) varies between elements (a chat ``History`` of 2, 3, 4 messages):
    each element's comes from its own leaves when it is read (``_plan.values``); tdstore versions
    that do not know it refuse the header (a negative dim) instead of building elements wrong."""

    classes: dict[NestedPath, str] = field(default_factory=dict)
    """``module.QualName`` of the tensorclass each nested sub-tree was written as (``("history",)``:
    ``torchrl.data.llm.history.History``): schema JSON ``"tc"``. A name only: reads rebuild the class
    when the program knows it already (``_format.tensorclass.known``), never importing a module."""

    # -- derived facts (computed once: headers are immutable) -----------------
    stack_pos: int = field(init=False, repr=False, compare=False)
    """Position of the stack dim in the batch size (as LazyStackedTensorDict puts it)."""
    batch_size: torch.Size = field(init=False, repr=False, compare=False)
    segments: Segments = field(init=False, repr=False, compare=False)
    sub_dims: SubTrees = field(init=False, repr=False, compare=False)
    """The entries of :attr:`sub` the current leaves agree with (what reads apply): a sub-tree whose
    tensor leaves do not all start with its batch dims, or nested in a sub-tree whose dims it does not
    extend, is read with its parent's batch size instead of being built inconsistent."""

    def __post_init__(self) -> None:
        pos = self.stack_dim if self.stack_dim >= 0 else len(self.inner) + 1 + self.stack_dim
        bs = list(self.inner)
        bs.insert(pos, self.count)
        object.__setattr__(self, "stack_pos", pos)
        object.__setattr__(self, "batch_size", torch.Size(bs))
        object.__setattr__(self, "segments", Segments(self.count, self.seg or max(self.count, 1)))
        object.__setattr__(self, "sub_dims", SubTrees(_agreed_sub_dims(self.sub, self.leaves, len(self.inner)), self.classes))

    def subtree_dims(self, path: NestedPath) -> tuple[int, ...]:
        """The extra batch dims of the sub-tree at ``path`` (of the deepest recorded sub-tree holding it): ``()`` for none."""
        for k in range(len(path), 0, -1):
            dims = self.sub_dims.get(path[:k])
            if dims is not None:
                return dims
        return ()

    def leaf_inner(self, path: NestedPath) -> tuple[int, ...]:
        """The batch size of one element of the sub-tree holding leaf ``path``: the inner batch size and its sub-tree's extra dims."""
        return self.inner + self.subtree_dims(path[:-1]) if self.sub_dims else self.inner

    @property
    def block(self) -> Leaf | None:
        """The row block as a homogeneous uint8 leaf of one row per element (``None`` without one).

        Reads and whole-row writes treat it as any homogeneous leaf; it never appears in
        :attr:`leaves`, and it is guarded by the versions of the leaves grouped in it.
        """
        if self.row is None:
            return None
        return Leaf(("\0row",), self.row[0], torch.uint8, 1, (self.row[1],))

    def grouped(self) -> list[Leaf]:
        """The leaves living in the row block, by column."""
        return sorted((leaf for leaf in self.leaves.values() if leaf.col is not None), key=lambda leaf: leaf.col or 0)

    @property
    def inner_numel(self) -> int:
        return math.prod(self.inner)

    def schema_json(self) -> str:
        leaves = sorted(self.leaves.values(), key=lambda leaf: leaf.number)
        schema: dict = {"next": self.next_leaf, "leaves": [leaf.to_json() for leaf in leaves]}
        if self.row is not None:
            schema["row"] = list(self.row)
        if self.sub:
            schema["sub"] = [[list(p), list(d)] for p, d in self.sub.items()]
        if self.classes:
            schema["tc"] = [[list(p), name] for p, name in self.classes.items()]
        return json.dumps(schema, separators=(",", ":"))

    def with_leaves(
        self,
        leaves: dict[NestedPath, Leaf],
        next_leaf: int | None = None,
        sub: dict[NestedPath, tuple[int, ...]] | None = None,
        classes: dict[NestedPath, str] | None = None,
    ) -> Header:
        """The header after a schema change (the server will hold ``version + 1``).

        Leaves whose name or layout changed get the new version as their leaf
        version; the key-set version moves when keys were added, deleted or renamed.
        Sub-tree batch dims (:attr:`sub`, plus ``sub``) follow renamed sub-trees and go
        with their last leaf; a tensor leaf whose shape contradicts its sub-tree's
        batch dims is refused (``ValueError``), as a TensorDict refuses it.
        """
        new_version = self.version + 1
        if classes is None:
            classes = getattr(sub, "classes", None)  # a write's SubTrees carries its sub-trees' classes
        # a sub-tree whose dims change (become RAGGED): its leaves move to the new version, so that a
        # reader planning with the old dims is refused and refreshes
        moved = [p for p, d in (sub or {}).items() if p in self.sub and self.sub[p] != d]
        old_by_number = {leaf.number: leaf for leaf in self.leaves.values()}
        stamped = {}
        for path, leaf in leaves.items():
            old = old_by_number.get(leaf.number)
            same = old is not None and old.same_layout(leaf) and not any(path[: len(p)] == p for p in moved)
            version = old.version if old is not None and same else new_version
            stamped[path] = replace(leaf, version=version)
        names = {(p, leaf.number) for p, leaf in self.leaves.items()}
        new_names = {(p, leaf.number) for p, leaf in stamped.items()}
        return replace(
            self,
            leaves=stamped,
            next_leaf=self.next_leaf if next_leaf is None else next_leaf,
            version=new_version,
            keyset_version=new_version if names != new_names else self.keyset_version,
            # the block goes with its last grouped leaf (run_write deletes its blobs)
            row=self.row if any(leaf.col is not None for leaf in stamped.values()) else None,
            sub=_moved_sub({**self.sub, **(sub or {})}, self.leaves, stamped, len(self.inner)),
            classes=_kept_classes({**self.classes, **(classes or {})}, stamped),
        )

    def version_fields(self, old: Header | None) -> str:
        """The guard fields a schema change sets, for ``write.lua``: ``name=value`` pairs, ``-`` deletes."""
        parts = [f"kv={self.keyset_version}"]
        for leaf in self.leaves.values():
            parts.append(f"lv:{leaf.number}={leaf.version}")
        if old is not None:
            gone = {leaf.number for leaf in old.leaves.values()} - {leaf.number for leaf in self.leaves.values()}
            parts.extend(f"lv:{n}=-" for n in sorted(gone))
        if self.seg and (old is None or old.seg != self.seg):
            parts.append(f"seg={self.seg}")
        if self.row is not None and (old is None or old.row is None) and not self.spread:
            parts.append(f"format={FORMAT_ROWS}")  # the first keys made a row block (a ring's first write)
        return " ".join(parts)

    def ready(self) -> Header:
        """The same header in state ``ready`` (after an upload commits)."""
        return replace(self, state="ready")

    def fields(self) -> dict[str, str]:
        """The header hash as stored on the server."""
        guards = {"kv": str(self.keyset_version), **{f"lv:{leaf.number}": str(leaf.version) for leaf in self.leaves.values()}}
        return {
            **guards,
            "format": FORMAT_SPREAD if self.spread else FORMAT_ROWS if self.row is not None else FORMAT,
            "epoch": self.epoch,
            "type": self.kind,
            "version": str(self.version),
            "count": str(self.count),
            "stack_dim": str(self.stack_dim),
            "inner": json.dumps(list(self.inner)),
            "device": self.device,
            "state": self.state,
            "schema": self.schema_json(),
            **({"tensorclass": self.tensorclass} if self.tensorclass else {}),
            **({"batchless": "1"} if self.batchless else {}),
            **({"seg": str(self.seg)} if self.seg else {}),
            **({"na": "0"} if self.tracked else {}),
        }

    @classmethod
    def from_fields(cls, raw: dict[bytes | str, bytes | str]) -> Header:
        """Parse and check a header hash read from the server.

        ``_format.header_info.parse_header`` (which the command line uses without torch) does every
        check; anything unexpected (a field edited by hand, a store written by another tdstore
        format or by the reference implementation) raises :class:`StoreFormatError` instead
        of being guessed at. Here the dtypes become torch dtypes.
        """
        info = parse_header(raw)
        try:
            # parse_header has checked that the field is there and holds a JSON object
            schema = json.loads(raw[b"schema"] if b"schema" in raw else raw["schema"])
            sub = _parse_sub(schema.get("sub", []))
            classes = parse_classes(schema.get("tc", []))
        except (KeyError, ValueError, TypeError) as err:
            raise StoreFormatError(f"store header is incomplete or corrupt: {err!r}") from None
        leaves = {
            rec.path: Leaf(rec.path, rec.number, codec.dtype_from_name(rec.dtype), rec.ndim, rec.shape, rec.version, rec.json, rec.col)
            for rec in info.leaves
        }
        return cls(
            version=info.version,
            count=info.count,
            stack_dim=info.stack_dim,
            inner=info.inner,
            device=info.device,
            kind=info.kind,
            leaves=leaves,
            next_leaf=info.next_leaf,
            state=info.state,
            keyset_version=info.keyset_version,
            epoch=info.epoch,
            batchless=info.batchless,
            tensorclass=info.tensorclass,
            seg=info.seg,
            spread=info.spread,
            tracked=info.tracked,
            sampling=info.sampling,
            trajectories=info.trajectories,
            leased=info.leased,
            distinct=info.distinct,
            absent_rows=info.absent_rows,
            rollouts=info.rollouts,
            row=info.row,
            sub=sub,
            classes=classes,
        )


def check_paths(paths: list[NestedPath]) -> None:
    """Raise if a leaf path is also the parent of another leaf (``"a"`` and ``("a", "b")``)."""
    known = set(paths)
    for path in paths:
        for k in range(1, len(path)):
            if path[:k] in known:
                raise KeyError(f"key {path[:k]} is both a leaf and the parent of {path}")


def _dim_ok(d: object) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d >= RAGGED


def _parse_sub(raw: object) -> dict[NestedPath, tuple[int, ...]]:
    """The ``"sub"`` entry of the schema JSON: ``[[path, dims], ...]`` (``ValueError`` when malformed)."""
    if not isinstance(raw, list):
        raise ValueError(f"bad sub-tree batch dims {raw!r}")
    out: dict[NestedPath, tuple[int, ...]] = {}
    for rec in raw:
        if not (
            isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], list) and rec[0] and all(isinstance(p, str) for p in rec[0])
        ):
            raise ValueError(f"bad sub-tree batch dims record {rec!r}")
        if not (
            isinstance(rec[1], list) and rec[1] and all(isinstance(d, int) and not isinstance(d, bool) and d >= RAGGED for d in rec[1])
        ):
            raise ValueError(f"bad sub-tree batch dims record {rec!r}")
        out[tuple(rec[0])] = tuple(rec[1])
    return out


class SubTrees(dict[NestedPath, tuple[int, ...]]):
    """:attr:`Header.sub_dims`, what reads build elements with: the sub-trees' extra batch dims, and the
    tensorclass names of sub-trees written as one (``classes``, :attr:`Header.classes`)."""

    classes: dict[NestedPath, str]

    def __init__(self, dims: dict[NestedPath, tuple[int, ...]], classes: dict[NestedPath, str]) -> None:
        super().__init__(dims)
        self.classes = classes

    def __bool__(self) -> bool:
        return bool(len(self) or self.classes)


def ragged(dims: tuple[int, ...]) -> bool:
    """Whether sub-tree batch dims ``dims`` vary between elements (hold a :data:`RAGGED` dim)."""
    return RAGGED in dims


def merge_sub(a: dict[NestedPath, tuple[int, ...]], b: dict[NestedPath, tuple[int, ...]]) -> dict[NestedPath, tuple[int, ...]]:
    """The sub-tree batch dims of elements with dims ``a`` and of elements with dims ``b``: a dim the two
    disagree on becomes :data:`RAGGED`; a sub-tree whose number of extra dims differs raises ``ValueError``
    (no element of a TensorDict can hold both)."""
    out = dict(a)
    for path, dims in b.items():
        have = out.get(path)
        if have is None:
            out[path] = dims
        elif len(have) != len(dims):
            shown = path[0] if len(path) == 1 else path
            raise ValueError(
                f"sub-tree {shown!r} has {len(have)} batch dims beyond the element's in some elements but {len(dims)} in others "
                f"({list(have)} and {list(dims)}); they may differ in size, not in number"
            )
        elif have != dims:
            out[path] = tuple(x if x == y else RAGGED for x, y in zip(have, dims, strict=True))
    return out


def _kept_classes(classes: dict[NestedPath, str], leaves: dict[NestedPath, Leaf]) -> dict[NestedPath, str]:
    """The sub-tree tensorclasses that still hold a leaf (a class goes with its sub-tree's last key)."""
    return {p: name for p, name in classes.items() if any(len(q) > len(p) and q[: len(p)] == p for q in leaves)}


def _agreed_sub_dims(
    sub: dict[NestedPath, tuple[int, ...]], leaves: dict[NestedPath, Leaf], n_inner: int
) -> dict[NestedPath, tuple[int, ...]]:
    """The entries of ``sub`` that hold leaves which all agree with them (see :attr:`Header.sub_dims`)."""
    if not sub:
        return {}
    out: dict[NestedPath, tuple[int, ...]] = {}
    for path in sorted(sub, key=len):  # parents first: a child must extend its parent's dims
        dims = sub[path]
        parent = next((out[path[:k]] for k in range(len(path) - 1, 0, -1) if path[:k] in out), ())
        below = [leaf for p, leaf in leaves.items() if len(p) > len(path) and p[: len(path)] == path]
        if not below or dims[: len(parent)] != parent:
            continue
        if all(leaf.json or _fits(leaf.shape, n_inner, dims) for leaf in below):
            out[path] = dims
    return out


def _fits(shape: tuple[int, ...] | None, n_inner: int, dims: tuple[int, ...]) -> bool:
    """Whether a leaf of element shape ``shape`` (None: it varies) can sit in a sub-tree of batch dims ``dims``."""
    if shape is None:
        return ragged(dims)
    got = shape[n_inner : n_inner + len(dims)]
    return len(got) == len(dims) and all(d == RAGGED or d == g for d, g in zip(dims, got))


def _moved_sub(
    sub: dict[NestedPath, tuple[int, ...]], old: dict[NestedPath, Leaf], new: dict[NestedPath, Leaf], n_inner: int
) -> dict[NestedPath, tuple[int, ...]]:
    """``sub`` after a schema change: a renamed sub-tree keeps its dims, an emptied one loses them; a
    tensor leaf that contradicts its sub-tree's dims raises ``ValueError`` (nothing is written)."""
    if not sub:
        return {}
    by_number = {leaf.number: p for p, leaf in new.items()}
    out: dict[NestedPath, tuple[int, ...]] = {}
    for path, dims in sub.items():
        if any(len(p) > len(path) and p[: len(path)] == path for p in new):
            out[path] = dims
            continue
        # every leaf that was below it now lies below one other path: the sub-tree was renamed
        moved = {
            by_number[leaf.number][: len(by_number[leaf.number]) - len(p) + len(path)]
            for p, leaf in old.items()
            if len(p) > len(path) and p[: len(path)] == path and leaf.number in by_number
        }
        if len(moved) == 1:
            out[moved.pop()] = dims
    for path, leaf in new.items():
        if leaf.json or leaf.shape is None:
            continue
        for k in range(len(path) - 1, 0, -1):
            sub_dims = out.get(path[:k])
            if sub_dims is not None:
                if not _fits(leaf.shape, n_inner, sub_dims):
                    raise ValueError(
                        f"key {path if len(path) > 1 else path[0]!r} of element shape {list(leaf.shape)} "
                        f"does not start with the batch dims {list(sub_dims)} of its sub-tree {path[:k]!r} "
                        f"(after the store's {n_inner} inner dims); nothing was written"
                    )
                break
    return out
