"""The demo's encoding of who wrote an element, and the checks that find a torn one.

Every leaf of an element is a function of ``(actor, seq)`` (see :mod:`tdstore.demo` for the
table), so each sampled element can be checked on its own, and the final content against the
last write of each actor.  The writers and the checkers use the same functions, so the two can
never disagree about what a consistent element is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack

__all__ = [
    "INITIAL_ACTOR",
    "MAX_EXAMPLES",
    "MAX_TOKENS",
    "OBS_SIZE",
    "check_batch",
    "check_value",
    "element_problems",
    "initial_stack",
    "lost_writes",
    "make_element",
    "obs_value",
    "slot_of",
    "token_length",
    "token_rows",
]

#: The ``actor`` of the initial content uploaded before the actors start.
INITIAL_ACTOR = -1
OBS_SIZE = 8
#: Token lengths cycle through 1..MAX_TOKENS, so sampled batches are nearly always heterogeneous.
MAX_TOKENS = 13
#: At most this many torn-element descriptions are kept in the figures (the count is exact).
MAX_EXAMPLES = 5
_U64 = np.uint64


# -- the encoding: every leaf is a function of (actor, seq) ------------------------------------
# All functions take numpy arrays (or ints) and are used by both the writers and the
# checkers, so the two can never disagree about what a consistent element is.


def token_length(actor: Any, seq: Any) -> np.ndarray:
    """Length of the ``tokens`` leaf written as ``(actor, seq)``: varies with both, in 1..MAX_TOKENS.

    For the initial content (actor -1) this is ``1 + index % MAX_TOKENS``.
    """
    a = np.asarray(actor, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    return 1 + (s + 3 * (a + 1)) % MAX_TOKENS


def obs_value(actor: Any, seq: Any) -> np.ndarray:
    """The value that fills ``obs``: ``actor * 1e6 + seq`` as float32.

    Exact while it is below 2**24; beyond that two writes may share a value, which
    can only hide a torn element, never report a false one (the other leaves still
    disagree).
    """
    a = np.asarray(actor, dtype=np.float64)
    s = np.asarray(seq, dtype=np.float64)
    return (a * 1e6 + s).astype(np.float32)


def check_value(actor: Any, seq: Any) -> np.ndarray:
    """The ``("meta", "check")`` value: a second, different mix of actor and seq (exact in float32)."""
    a = np.asarray(actor, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    return (((a + 1) * 7919 + (s % 1_000_003) * 104_729) % 65_521).astype(np.float32)


def slot_of(actor: Any, seq: Any, count: int) -> np.ndarray:
    """The element that write ``(actor, seq)`` goes to: a splitmix64 hash, so slots look random.

    Deriving the slot from the write (instead of drawing it) lets a reader check
    that an element sits where its writer put it.  The initial content of element
    ``i`` is ``(-1, i)`` and maps to ``i``.  Unsigned numpy arithmetic wraps
    modulo 2**64 by definition, so the hash is the same in every process.
    """
    a = np.asarray(actor, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    with np.errstate(over="ignore"):
        z = (np.clip(a + 1, 0, None).astype(_U64) << _U64(32)) ^ s.astype(_U64)
        z = z + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z = z ^ (z >> _U64(31))
        hashed = (z % _U64(count)).astype(np.int64)
    return np.where(a < 0, s % count, hashed)


def make_element(actor: int, seq: int) -> TensorDict:
    """The element that actor ``actor`` writes as its ``seq``-th write (or the initial one, actor -1)."""
    length = int(token_length(actor, seq))
    return TensorDict(
        {
            "obs": torch.full((OBS_SIZE,), float(obs_value(actor, seq)), dtype=torch.float32),
            "tokens": torch.arange(length, dtype=torch.int64) + seq,
            "actor": torch.tensor([actor], dtype=torch.int64),
            "seq": torch.tensor([seq], dtype=torch.int64),
            "meta": {"check": torch.tensor([float(check_value(actor, seq))], dtype=torch.float32)},
        },
        batch_size=(),
    )


def initial_stack(count: int) -> LazyStackedTensorDict:
    """The content uploaded first, so every key exists (and is heterogeneous) before anyone writes."""
    return lazy_stack([make_element(INITIAL_ACTOR, i) for i in range(count)])


# -- checking ------------------------------------------------------------------------------------


def element_problems(td: TensorDictBase, index: int, *, count: int, actors: int, placed: bool = True) -> list[str]:
    """Everything wrong with one element read at ``index`` (empty when it is consistent).

    The slow, explicit path: :func:`check_batch` uses it only to describe the
    elements its vectorized pass flagged, so messages stay precise.
    """
    problems: list[str] = []
    try:
        actor_t, seq_t = td.get("actor"), td.get("seq")
    except KeyError as err:
        return [f"missing key: {err}"]
    if actor_t.shape != (1,) or seq_t.shape != (1,):
        return [f"actor/seq shapes {tuple(actor_t.shape)}/{tuple(seq_t.shape)} instead of (1,)"]
    a, s = int(actor_t[0]), int(seq_t[0])
    who = f"element {index} says (actor {a}, seq {s})"
    if not INITIAL_ACTOR <= a < actors or s < 0:
        return [f"{who}: no such writer"]
    expected = make_element(a, s)
    for key in (("obs",), ("tokens",), ("meta", "check")):
        name = key[0] if len(key) == 1 else key
        got = td.get(key, None)
        want = expected.get(key)
        if got is None:
            problems.append(f"{who}: {name!r} is missing")
        elif got.shape != want.shape:
            problems.append(f"{who}: {name!r} has shape {tuple(got.shape)}, that write had {tuple(want.shape)}")
        elif not torch.equal(got, want):
            problems.append(f"{who}: {name!r} holds {got.tolist()}, that write had {want.tolist()}")
    slot = int(slot_of(a, s, count))
    if placed and slot != index:
        problems.append(f"{who}: that write went to element {slot}")
    return problems


def token_rows(td: TensorDictBase) -> list[torch.Tensor]:
    """The ``tokens`` of each element of a batch (a lazy stack when lengths differ, else dense)."""
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        return [member.get("tokens") for member in td.tensordicts]
    return list(td.get("tokens").unbind(0))


def _consistent_mask(td: TensorDictBase, idx: np.ndarray, *, count: int, actors: int, placed: bool = True) -> np.ndarray:
    """Vectorized check of a batch read at ``idx``: True where an element is consistent.

    Per-element Python checks would cost as much as the read itself and halve the
    measured read rate; this pass touches each leaf once for the whole batch.
    """
    n = idx.size
    a = td.get("actor").reshape(n).numpy()
    s = td.get("seq").reshape(n).numpy()
    obs = td.get("obs").reshape(n, OBS_SIZE).numpy()
    chk = td.get(("meta", "check")).reshape(n).numpy()
    ok = (a >= INITIAL_ACTOR) & (a < actors) & (s >= 0)
    a = np.where(ok, a, 0)
    s = np.where(ok, s, 0)
    ok &= (obs == obs_value(a, s)[:, None]).all(axis=1)
    ok &= chk == check_value(a, s)
    if placed:  # else a ring placed the element (torchrl mode): where it sits is checked at the end
        ok &= slot_of(a, s, count) == idx
    toks = token_rows(td)
    lengths = np.array([t.shape[0] if t.ndim == 1 else -1 for t in toks], dtype=np.int64)
    ok &= lengths == token_length(a, s)
    sel = np.flatnonzero(ok)
    if sel.size:
        flat = torch.cat([toks[k] for k in sel]).numpy()
        lens = lengths[sel]
        starts = np.cumsum(lens) - lens
        want = np.repeat(s[sel], lens) + (np.arange(flat.size) - np.repeat(starts, lens))
        wrong = np.bincount(np.repeat(np.arange(sel.size), lens), weights=flat != want, minlength=sel.size)
        ok[sel[wrong > 0]] = False
    return ok


def check_batch(td: TensorDictBase, indices: Any, *, count: int, actors: int, placed: bool = True) -> dict[int, list[str]]:
    """Check a batch read at ``indices``; return ``{position in batch: problems}`` for torn elements.

    A fast vectorized pass flags elements, and only flagged ones are described
    element by element.  If the batch is so broken that the fast pass cannot even
    stack a leaf, every element is checked the slow way.
    """
    idx = np.asarray(indices.numpy() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64).reshape(-1)
    try:
        suspects = np.flatnonzero(~_consistent_mask(td, idx, count=count, actors=actors, placed=placed))
    except (RuntimeError, ValueError, KeyError, TypeError):
        suspects = np.arange(idx.size)
    out: dict[int, list[str]] = {}
    for k in suspects.tolist():
        problems = element_problems(td[k], int(idx[k]), count=count, actors=actors, placed=placed)
        if problems:
            out[k] = problems
    return out


def lost_writes(td: TensorDictBase, indices: np.ndarray, last_seq: np.ndarray) -> dict[int, str]:
    """Elements (``td[k]`` is element ``indices[k]``) that are not the last write an actor made to them.

    ``last_seq[a, i]`` is the seq of actor ``a``'s last write to element ``i`` (-1 if
    none).  Each actor writes sequentially, so if element ``i`` finally holds
    ``(a, s)``, no later write of ``a`` went to ``i``: ``s`` must be ``last_seq[a, i]``.
    If it still holds the initial content, no actor may have written it at all.
    Call this only on elements that passed :func:`check_batch`.
    """
    n = len(indices)
    a = td.get("actor").reshape(n).numpy()
    s = td.get("seq").reshape(n).numpy()
    out: dict[int, str] = {}
    for k, i in enumerate(indices.tolist()):
        if a[k] == INITIAL_ACTOR:
            writers = np.flatnonzero(last_seq[:, i] >= 0)
            if writers.size:
                writer = int(writers[0])
                out[i] = f"element {i} still holds its initial content, but actor {writer} wrote it (seq {int(last_seq[writer, i])})"
        elif last_seq[a[k], i] != s[k]:
            last = int(last_seq[a[k], i])
            out[i] = f"element {i} holds (actor {int(a[k])}, seq {int(s[k])}), but that actor's last write there was seq {last}"
    return out
