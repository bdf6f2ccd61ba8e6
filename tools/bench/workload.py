"""The benchmark's settings, its data, and the raw floor (plain commands moving the bytes tdstore moves)."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
import torch
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning, module="tensordict")

try:  # the reference is optional: without it its column reads "unavailable"
    from tensordict.store import LazyStackedTensorDictStore as RefLazy
    from tensordict.store import TensorDictStore as RefDense
except ImportError:  # pragma: no cover - tensordict 0.15.3 ships it
    RefLazy = RefDense = None

CONTENDERS = ("tdstore", "reference", "raw")
SYSTEM_REDIS = "/usr/bin/redis-server"
MiB = 1 << 20
GiB = 1 << 30

#: Operations per case, in the order they run (the shape-changing write last: it
#: changes element sizes that the other heterogeneous operations rely on).
OPERATIONS: dict[str, tuple[str, ...]] = {
    "homogeneous": (
        "upload",
        "upload_vs_plain_upload",
        "dense_upload",
        "element_read",
        "element_write",
        "batch_read",
        "slice_read",
        "full_read",
        "extend",
        "fill",
    ),
    "heterogeneous": (
        "upload",
        "upload_vs_plain_upload",
        "element_read",
        "element_write",
        "batch_read",
        "slice_read",
        "full_read",
        "padded_batch",
        "nested_batch",
        "padded_slice",
        "nested_slice",
        "padded_full",
        "nested_full",
        "shape_change_write",
    ),
    "large": ("large_read", "large_write"),
}

TOKENS_PERIOD = 17  # element i of the heterogeneous case holds tokens i64[1 + i % 17]
EXTEND_ROWS = 500  # rows per extend (torchrl's benchmark workload: fill 5,000 rows in chunks of 500)
FILL_ROWS = 5_000
LEARNER_BATCH = 256  # the learner's sample under writers; they extend WRITER_ROWS rows at a time
WRITER_ROWS = 100


# --------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    """What to run and how often; ``--quick`` shrinks everything."""

    count: int = 10_000
    batch: int = 256
    reps: dict[str, int] = field(default_factory=dict)
    warmup: int = 2
    min_reps: int = 3
    op_budget_s: float = 30.0
    large_leaf_bytes: tuple[int, ...] = (64 * MiB,)
    large_count: int = 16
    mp_seconds: float = 10.0
    mp_writers: int = 4
    seed: int = 0
    quick: bool = False

    def reps_for(self, op: str) -> int:
        """Timed repetitions of ``op`` (each runs every contender once)."""
        return self.reps.get(op, 10)


FULL_REPS = {
    "upload": 5,
    "upload_vs_plain_upload": 5,
    "dense_upload": 10,
    "element_read": 300,
    "element_write": 300,
    "shape_change_write": 300,
    "batch_read": 60,
    "slice_read": 100,
    "full_read": 10,
    "padded_batch": 60,
    "nested_batch": 60,
    "padded_slice": 100,
    "nested_slice": 100,
    "padded_full": 10,
    "nested_full": 10,
    "large_read": 7,
    "large_write": 7,
    "extend": 60,
    "fill": 7,
}
QUICK_REPS = {
    "upload": 2,
    "upload_vs_plain_upload": 2,
    "dense_upload": 2,
    "element_read": 30,
    "element_write": 30,
    "shape_change_write": 30,
    "batch_read": 10,
    "slice_read": 10,
    "full_read": 3,
    "padded_batch": 10,
    "nested_batch": 10,
    "padded_slice": 10,
    "nested_slice": 10,
    "padded_full": 3,
    "nested_full": 3,
    "large_read": 3,
    "large_write": 3,
    "extend": 5,
    "fill": 2,
}


def make_settings(args: argparse.Namespace) -> Settings:
    """Settings from the command line (``--quick`` first, explicit flags override it)."""
    quick = bool(args.quick)
    count = args.count if args.count is not None else (1_000 if quick else 10_000)
    large = (8 * MiB,) if quick else (64 * MiB,)
    if args.large and not quick:
        large = (*large, 1 * GiB)
    mp_seconds = args.mp_seconds if args.mp_seconds is not None else (1.0 if quick else 10.0)
    reps = dict(QUICK_REPS if quick else FULL_REPS)
    if args.reps_scale != 1.0:
        reps = {k: max(1, round(v * args.reps_scale)) for k, v in reps.items()}
    return Settings(
        count=count,
        batch=min(256, count),
        reps=reps,
        warmup=1 if quick else 2,
        min_reps=1 if quick else 3,
        op_budget_s=1.5 if quick else 30.0,
        large_leaf_bytes=large,
        mp_seconds=mp_seconds,
        mp_writers=args.mp_writers,
        seed=args.seed,
        quick=quick,
    )


# --------------------------------------------------------------------------- data
def make_element(i: int, het: bool, gen: torch.Generator, tokens_len: int | None = None) -> TensorDict:
    """Element ``i`` of the workload: obs f32[64], action f32[4], reward f32[1], nested.b i64[3] (+ tokens)."""
    d: dict[str, Any] = {
        "obs": torch.randn(64, generator=gen),
        "action": torch.randn(4, generator=gen),
        "reward": torch.randn(1, generator=gen),
        "nested": {"b": torch.randint(0, 1 << 30, (3,), generator=gen)},
    }
    if het:
        n = tokens_len if tokens_len is not None else 1 + i % TOKENS_PERIOD
        d["tokens"] = torch.randint(0, 50_000, (n,), generator=gen)
    return TensorDict(d, batch_size=[])


def make_batch(n: int, gen: torch.Generator) -> TensorDict:
    """``n`` rows of the homogeneous workload as one dense tensordict (what an actor extends a ring with)."""
    return TensorDict(
        {
            "obs": torch.randn(n, 64, generator=gen),
            "action": torch.randn(n, 4, generator=gen),
            "reward": torch.randn(n, 1, generator=gen),
            "nested": {"b": torch.randint(0, 1 << 30, (n, 3), generator=gen)},
        },
        batch_size=[n],
    )


def make_stack(count: int, het: bool, seed: int) -> LazyStackedTensorDict:
    """The lazy stack every contender uploads (the same object for all of them)."""
    gen = torch.Generator().manual_seed(seed)
    return lazy_stack([make_element(i, het, gen) for i in range(count)])


def make_large_stack(count: int, leaf_bytes: int, seed: int) -> LazyStackedTensorDict:
    """``count`` elements of one f32 leaf ``big``, ``leaf_bytes`` in all."""
    per = leaf_bytes // count // 4
    gen = torch.Generator().manual_seed(seed)
    return lazy_stack([TensorDict(big=torch.randn(per, generator=gen), batch_size=[]) for _ in range(count)])


def _path_key(path: tuple[str, ...]) -> str | tuple[str, ...]:
    return path[0] if len(path) == 1 else path


@dataclass
class RawLeaf:
    """One leaf of the raw floor, in tdstore's layout: an element-major blob (+ tables if heterogeneous)."""

    path: tuple[str, ...]
    number: int
    dtype: torch.dtype
    ndim: int
    het: bool
    offsets: np.ndarray  # count + 1 byte offsets of the elements in the blob
    blob: bytes
    offsets_bytes: bytes = b""
    shapes_bytes: bytes = b""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy when it is contiguous."""
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def raw_layout(stack: LazyStackedTensorDict) -> list[RawLeaf]:
    """The bytes the raw floor stores, computed once, outside any timing."""
    elements = stack.tensordicts
    out = []
    paths = [k if isinstance(k, tuple) else (k,) for k in elements[0].keys(include_nested=True, leaves_only=True)]
    for number, path in enumerate(paths):
        key = _path_key(path)
        tensors = [el.get(key) for el in elements]
        shapes = {tuple(t.shape) for t in tensors}
        sizes = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
        offsets = np.zeros(len(tensors) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        blob = b"".join(bytes(tensor_bytes(t)) for t in tensors)
        het = len(shapes) > 1
        leaf = RawLeaf(path, number, tensors[0].dtype, tensors[0].ndim, het, offsets, blob)
        if het:
            leaf.offsets_bytes = offsets.astype("<i8").tobytes()
            leaf.shapes_bytes = np.asarray([s for t in tensors for s in t.shape], dtype="<i8").tobytes()
        out.append(leaf)
    return out


def runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Inclusive ``(lo, hi)`` runs of consecutive ids (as tdstore groups a batch read)."""
    if sorted_ids.size == 0:
        return []
    breaks = np.nonzero(np.diff(sorted_ids) != 1)[0]
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [sorted_ids.size - 1]))
    return [(int(sorted_ids[a]), int(sorted_ids[b])) for a, b in zip(starts, ends, strict=True)]


# --------------------------------------------------------------------------- raw floor
class RawFloor:
    """One pipeline of plain commands per operation, moving the bytes tdstore moves.

    The floor keeps its own copy of the data under its own keys, knows every
    offset client-side (so a heterogeneous element costs one pipeline, not a
    lookup first), never decodes what it reads and never builds a TensorDict.
    """

    def __init__(self, client: redis.Redis, base: str, leaves: list[RawLeaf]) -> None:
        self.client = client
        self.base = base
        self.leaves = leaves

    def key(self, kind: str, leaf: RawLeaf, base: str | None = None) -> str:
        """Server key of a leaf's data ('d'), offsets ('o') or shapes ('s')."""
        return f"{base or self.base}:{kind}:{leaf.number}"

    def _pipe(self) -> Any:
        return self.client.pipeline(transaction=False)

    def upload(self, base: str | None = None) -> list:
        """SET every blob and table (the bytes ``from_lazy_stack`` sends)."""
        pipe = self._pipe()
        for leaf in self.leaves:
            pipe.set(self.key("d", leaf, base), leaf.blob)
            if leaf.het:
                pipe.set(self.key("o", leaf, base), leaf.offsets_bytes)
                pipe.set(self.key("s", leaf, base), leaf.shapes_bytes)
        return pipe.execute()

    def upload_from(self, stack: LazyStackedTensorDict, base: str) -> list:
        """SET the same blobs and tables, gathered from the lazy stack itself: what a plain redis-py
        upload of the stack costs (each element's tensor through tensordict's public ``get``, then one
        ``torch.stack``, or ``torch.cat`` and its tables when the elements differ in shape, per key; no
        checks), where :meth:`upload` sends blobs made beforehand."""
        elements = stack.tensordicts
        pipe = self._pipe()
        for leaf in self.leaves:
            key = _path_key(leaf.path)
            tensors = [el.get(key) for el in elements]
            if leaf.het:
                pipe.set(self.key("d", leaf, base), tensor_bytes(torch.cat([t.reshape(-1) for t in tensors])))
                sizes = np.array([t.nbytes for t in tensors], dtype=np.int64)
                offsets = np.zeros(len(tensors) + 1, dtype="<i8")
                np.cumsum(sizes, out=offsets[1:])
                pipe.set(self.key("o", leaf, base), offsets.tobytes())
                shapes = np.fromiter((s for t in tensors for s in t.shape), dtype="<i8")
                pipe.set(self.key("s", leaf, base), shapes.tobytes())
            else:
                pipe.set(self.key("d", leaf, base), tensor_bytes(torch.stack(tensors)))
        return pipe.execute()

    def drop(self, base: str) -> None:
        """Delete the keys of an upload made under ``base`` (untimed clean-up)."""
        keys = [self.key(k, leaf, base) for leaf in self.leaves for k in ("d", "o", "s")]
        self.client.delete(*keys)

    def _read_runs(self, pipe: Any, lohi: Sequence[tuple[int, int]]) -> None:
        for leaf in self.leaves:
            d = self.key("d", leaf)
            for lo, hi in lohi:
                a, b = int(leaf.offsets[lo]), int(leaf.offsets[hi + 1])
                if leaf.het:
                    pipe.getrange(self.key("o", leaf), 8 * lo, 8 * (hi + 2) - 1)
                    pipe.getrange(self.key("s", leaf), 8 * leaf.ndim * lo, 8 * leaf.ndim * (hi + 1) - 1)
                pipe.getrange(d, a, b - 1)

    def read_runs(self, lohi: Sequence[tuple[int, int]]) -> list:
        """GETRANGE each run of every leaf (plus its offset and shape records when heterogeneous)."""
        pipe = self._pipe()
        self._read_runs(pipe, lohi)
        return pipe.execute()

    def read_element(self, i: int) -> list:
        """Element ``i`` of every leaf."""
        return self.read_runs([(i, i)])

    def read_batch(self, idx: np.ndarray) -> list:
        """The distinct elements of ``idx``, grouped in runs of consecutive ids as tdstore does."""
        return self.read_runs(runs(np.unique(idx)))

    def read_all(self) -> list:
        """GET every blob and table."""
        pipe = self._pipe()
        for leaf in self.leaves:
            pipe.get(self.key("d", leaf))
            if leaf.het:
                pipe.get(self.key("o", leaf))
                pipe.get(self.key("s", leaf))
        return pipe.execute()

    def write_ops(self, i: int, td: TensorDict) -> list[tuple[str, int, bytes | memoryview]]:
        """The SETRANGEs that write element ``i`` = ``td`` (computed outside the timing)."""
        ops: list[tuple[str, int, bytes | memoryview]] = []
        for leaf in self.leaves:
            t = td.get(_path_key(leaf.path))
            ops.append((self.key("d", leaf), int(leaf.offsets[i]), tensor_bytes(t)))
            if leaf.het and leaf.ndim:
                ops.append((self.key("s", leaf), 8 * leaf.ndim * i, np.asarray(t.shape, dtype="<i8").tobytes()))
        return ops

    def write(self, ops: list[tuple[str, int, bytes | memoryview]]) -> list:
        """One pipeline of SETRANGEs."""
        pipe = self._pipe()
        for key, offset, data in ops:
            pipe.setrange(key, offset, data)
        return pipe.execute()


def materialize(x: Any) -> Any:
    """A slice read's result as local tensors (tdstore and the reference already return them)."""
    if type(x) in (TensorDict, LazyStackedTensorDict):
        return x
    return x.to_tensordict()


def same_data(a: Any, b: Any) -> bool:
    """Whether two tensordicts hold the same keys with equal tensors."""
    keys_a = {k if isinstance(k, tuple) else (k,) for k in a.keys(True, True)}
    keys_b = {k if isinstance(k, tuple) else (k,) for k in b.keys(True, True)}
    return keys_a == keys_b and all(torch.equal(a.get(_path_key(k)), b.get(_path_key(k))) for k in keys_a)
