"""What every fault case shares: results, data whose every leaf says which write produced it, checks on the server."""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore._engine.write_call import BULK_WRITE_BYTES
from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import EmbeddedServer

#: Every case, in the order they run.
CASE_NAMES = (
    "restart",
    "script-flush",
    "connection-drop",
    "sigkill-writer",
    "maxmemory",
    "proto-max-bulk-len",
    "client-query-buffer-limit",
    "store-deleted",
    "store-recreated",
    "eviction",
    "ambiguous-timeout",
    "hostile-checkpoint",
    "readonly-acl",
    "sharded-failover",
)
MAXMEMORY = 20 << 20
MAXMEMORY_ARGS = ("--maxmemory", "20mb", "--maxmemory-policy", "noeviction")
BULK_LIMIT = 1 << 20
BULK_ARGS = ("--proto-max-bulk-len", "1mb")
#: Adding this to a seq keeps every leaf shape of :func:`element` (lcm of its two periods).
SAME_SHAPE_STEP = 145
#: Upper bound of the element writes of one writer process (it is killed long before).
MAX_WRITER_OPS = 1_000_000
#: Seq numbers of kill round ``r`` start at ``r * ROUND_SEQ`` (exact in float32 up to 2**24).
ROUND_SEQ = 100_000
SAW_WIDTH = 110
#: Whole-leaf writes of at least this many bytes take tdstore's bulk path (plain SETRANGEs into a
#: staging key moved by the script); dense reads of any size are a MULTI/EXEC of plain GETRANGEs.
BULK_BYTES = BULK_WRITE_BYTES
BULK_TEXT = f"{BULK_BYTES / 2**20:g} MiB"
BULK_COUNT = 16
BULK_WIDTH = -(-BULK_BYTES // (4 * BULK_COUNT))  # float32 per element, so that one leaf is BULK_BYTES


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class Check:
    """One thing a case verified: what the user saw, and the evidence that nothing was lost."""

    name: str
    ok: bool
    saw: str = ""
    proof: str = ""


@dataclass
class CaseResult:
    """The outcome of one case: PASS, FAIL or SKIP, and its checks."""

    name: str
    status: str
    seconds: float
    checks: list[Check] = field(default_factory=list)
    note: str = ""
    server: str = ""

    @property
    def saw(self) -> str:
        """What the user saw, check by check (shortened)."""
        groups: dict[str, list[str]] = {}
        for c in self.checks:
            if c.saw:
                groups.setdefault(c.saw, []).append(c.name)
        return "; ".join(f"{'/'.join(names)}: {saw}" for saw, names in groups.items()) or self.note

    @property
    def proof(self) -> str:
        """The evidence that nothing was lost or half-written, check by check."""
        return "; ".join(c.proof for c in self.checks if c.proof)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, with the one-line summaries."""
        out = asdict(self)
        out["saw"] = self.saw
        out["proof"] = self.proof
        return out


@dataclass
class Options:
    """How to run the cases."""

    url: str | None = None
    binary: str | None = None
    quick: bool = False
    seed: int = 0
    start_method: str = "fork"
    kill_rounds: int | None = None


@dataclass
class Env:
    """What a case works with: the server, an inspection client, a private key prefix."""

    url: str
    client: redis.Redis
    server: EmbeddedServer | None
    prefix: str
    opts: Options
    rng: random.Random
    cluster: EmbeddedCluster | None = None
    """The private cluster of a case that needs one (``CaseSpec.cluster``): ``url`` is its ``redis+cluster://``."""

    @property
    def private(self) -> bool:
        """True on a server this tool started (so it may kill every normal client)."""
        return self.server is not None

    def td_id(self, label: str) -> str:
        """A readable store id, unique for this run."""
        return f"{label}-{uuid.uuid4().hex[:8]}"


def short(text: str, width: int = SAW_WIDTH) -> str:
    """One line of at most ``width`` characters, server addresses replaced by ``<server>``."""
    text = re.sub(r"unix://\S+?\?db=\d+", "<server>", text)
    text = re.sub(r"rediss?://[^\s/]+/\d+", "<server>", text)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def describe_exc(exc: BaseException | None, width: int = SAW_WIDTH) -> str:
    """``Type: message`` of an exception, shortened (``no exception`` for None)."""
    if exc is None:
        return "no exception"
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    name = type(exc).__name__
    if type(exc).__module__.startswith("redis"):
        name = f"redis.{name}"
    return short(f"{name}: {msg}", width)


def attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, float]:
    """Call ``fn``; return (result, exception or None, seconds)."""
    t0 = time.perf_counter()
    try:
        return fn(), None, time.perf_counter() - t0
    except Exception as exc:  # the point is to see what the user sees
        return None, exc, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# data whose every leaf says which write produced it
# ---------------------------------------------------------------------------------------------
def element(seq: int, i: int, scale: int = 1, obs_dtype: torch.dtype = torch.float32) -> TensorDict:
    """Element ``i`` as written at sequence number ``seq``: every leaf encodes ``(seq, i)``.

    ``tokens`` (int64) and ``("nested", "ragged")`` (float16, 2-D) change shape with
    ``(seq, i)``, so writes keep moving bytes and rewriting offset tables; ``obs`` and
    ``("nested", "flag")`` are homogeneous.  ``scale`` multiplies the token count.
    """
    n_tok = (1 + (seq * 7 + i * 3) % 29) * scale
    n_rag = 1 + (seq + 2 * i) % 5
    ragged = torch.tensor([[seq % 2048, i % 2048, k] for k in range(n_rag)], dtype=torch.float16)
    return TensorDict(
        {
            "stamp": torch.tensor([seq, i], dtype=torch.int64),
            "obs": torch.tensor([seq, i, -seq, -i], dtype=obs_dtype),
            "tokens": torch.full((n_tok,), seq * 100_000 + i, dtype=torch.int64),
            "small": torch.tensor([seq % 256, i % 256], dtype=torch.uint8),
            "nested": {"flag": torch.tensor([seq, i], dtype=torch.int32), "ragged": ragged},
        },
        batch_size=[],
    )


def big_element(seq: int, i: int, width: int) -> TensorDict:
    """An element with a large homogeneous leaf (``width`` float32) and a small ragged one."""
    code = seq * 1000 + i
    return TensorDict(
        {
            "stamp": torch.tensor([seq, i], dtype=torch.int64),
            "big": torch.full((width,), float(code), dtype=torch.float32),
            "tokens": torch.full((1 + (seq + i) % 7,), code, dtype=torch.int64),
        },
        batch_size=[],
    )


def wide_element(seq: int, i: int, n_tok: int) -> TensorDict:
    """An element whose ``tokens`` leaf holds ``n_tok`` int64 (8 bytes each)."""
    return TensorDict(
        {"stamp": torch.tensor([seq, i], dtype=torch.int64), "tokens": torch.full((n_tok,), seq * 100_000 + i, dtype=torch.int64)},
        batch_size=[],
    )


def bulk_store(env: Env, td_id: str, value: float = 0.0) -> LazyStackedTensorDictStore:
    """A store of one float32 leaf ``big`` of ``BULK_BYTES`` (element ``i`` all ``value + i``): reads and
    whole-leaf writes of it take tdstore's bulk paths."""
    return upload(env, [TensorDict(big=torch.full((BULK_WIDTH,), value + i)) for i in range(BULK_COUNT)], td_id)


def bulk_value(value: float) -> torch.Tensor:
    """The ``big`` leaf of a bulk store whose element ``i`` is all ``value + i``."""
    return (value + torch.arange(BULK_COUNT, dtype=torch.float32)).unsqueeze(1).expand(BULK_COUNT, BULK_WIDTH).contiguous()


def td_difference(got: TensorDictBase, want: TensorDictBase) -> str | None:
    """None when both hold the same keys, dtypes, shapes and values; else what differs."""
    kg = sorted(map(str, got.keys(True, True)))
    kw = sorted(map(str, want.keys(True, True)))
    if kg != kw:
        return f"keys {kg} != {kw}"
    for key in want.keys(True, True):
        a, b = got.get(key), want.get(key)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{key}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if not torch.equal(a, b):
            return f"{key}: values differ"
    return None


def decode(td: TensorDictBase, i: int, make: Callable[[int, int], TensorDict]) -> tuple[int | None, str | None]:
    """The seq that wrote element ``i`` (from its stamp) and whether every leaf agrees with it."""
    stamp = td.get("stamp", None)
    if not isinstance(stamp, torch.Tensor) or stamp.shape != (2,):
        return None, f"element {i}: no valid stamp"
    seq, idx = int(stamp[0]), int(stamp[1])
    if idx != i:
        return seq, f"element {i}: stamp names element {idx}"
    diff = td_difference(td, make(seq, i))
    return seq, None if diff is None else f"element {i} (stamp seq {seq}) is torn: {diff}"


def elements_of(td: TensorDictBase) -> list[TensorDictBase]:
    """The elements of a stack read from the store (lazy or dense)."""
    return list(td.tensordicts) if isinstance(td, LazyStackedTensorDict) else list(td.unbind(0))


def read_seqs(store: LazyStackedTensorDictStore, make: Callable[[int, int], TensorDict]) -> tuple[list[int | None], list[str]]:
    """Read the whole store in one call; each element's seq and any inconsistency."""
    seqs: list[int | None] = []
    problems: list[str] = []
    for i, el in enumerate(elements_of(store.to_tensordict())):
        seq, problem = decode(el, i, make)
        seqs.append(seq)
        if problem:
            problems.append(problem)
    return seqs, problems


def upload(env: Env, elements: list[TensorDict], td_id: str, prefix: str | None = None, **kwargs: Any) -> LazyStackedTensorDictStore:
    """Upload ``elements`` as a lazy stack under the case prefix."""
    return LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack(elements, 0), url=env.url, prefix=prefix or env.prefix, td_id=td_id, **kwargs
    )


# ---------------------------------------------------------------------------------------------
# server inspection
# ---------------------------------------------------------------------------------------------
def snapshot_size(snap: dict[bytes, Any]) -> int:
    """Bytes held by the string keys of a snapshot."""
    return sum(len(v) for v in snap.values() if isinstance(v, bytes))


def compare_snapshots(before: dict[bytes, Any], after: dict[bytes, Any]) -> tuple[bool, str]:
    """(identical, a description) of two raw snapshots."""
    if before == after:
        return True, f"raw keys identical ({len(after)} keys, {snapshot_size(after):,} B)"
    changed = sorted({k for k in before.keys() | after.keys() if before.get(k) != after.get(k)})
    names = ", ".join(
        k.decode(errors="replace").rsplit(":", 2)[-2] + ":" + k.decode(errors="replace").rsplit(":", 1)[-1] for k in changed[:4]
    )
    return False, f"raw keys CHANGED: {len(changed)} keys differ ({names})"


def is_oom(exc: BaseException | None) -> bool:
    """tdstore's MemoryError, or redis' own out-of-memory error."""
    return isinstance(exc, (MemoryError, redis.exceptions.OutOfMemoryError)) or (exc is not None and "maxmemory" in str(exc))


def is_clear_size_error(exc: BaseException | None) -> bool:
    """An error that tells the user the value is too large for the server."""
    if exc is None or isinstance(exc, redis.ConnectionError):
        return False
    text = str(exc).lower()
    return isinstance(exc, ValueError) or any(w in text for w in ("proto-max-bulk-len", "too large", "larger than", "maximum allowed size"))


def keyerror_check(name: str, fn: Callable[[], Any], td_id: str, must_say: str = "") -> Check:
    """``fn`` must raise a KeyError whose message names ``td_id`` (and holds ``must_say``)."""
    _, exc, _ = attempt(fn)
    ok = isinstance(exc, KeyError) and td_id in str(exc) and must_say in str(exc)
    return Check(name, ok, describe_exc(exc, 140))
