"""What a stress writer writes, and how a reader checks it: every leaf says which write produced it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

WRITE_KINDS = ("element", "update", "slice", "step", "index")
READ_KINDS = ("element", "slice", "step", "batch", "rows", "column")
READ_WEIGHTS = (4, 2, 2, 3, 2, 1)
SCHEMA_KINDS = ("add", "delete", "rename", "dtype")
RING_READ_KINDS = ("sample", "slice", "batch")
#: Slots of the ring store of ``--ring-writers``.
RING_SLOTS = 64

#: Sequence numbers stay below this so that they are exact in float32 obs leaves (24-bit mantissa).
SEQ_LIMIT = 2**22
#: Leaves every writer writes and every reader checks exactly.
CHECKED: tuple[tuple[str, ...], ...] = (
    ("stamp",),
    ("obs",),
    ("tokens",),
    ("small",),
    ("nested", "a"),
    ("nested", "deeper", "b"),
    ("nested", "ragged"),
)
EXTRA_VALUE = 7.0
AUX_VALUE = (42, 43)
#: The widths ``spare`` takes as the schema racer retypes it: each change of dtype changes its shape too.
SPARE_WIDTHS = (2, 3)
#: The values ``spare`` holds in each dtype the schema racer gives it (cycled in this order).
SPARE_VALUES: tuple[tuple[torch.dtype, float], ...] = ((torch.float32, 1.5), (torch.float64, 2.5), (torch.int64, 3))
MAX_EXAMPLES = 5
LIMITS = {
    "writers": (1, 64),
    "readers": (0, 64),
    "seconds": (0.1, 3600.0),
    "rows_per_writer": (1, 1024),
    "max_ops": (1, 10_000_000),
    "segment_bytes": (1, 1 << 40),
}


# ---------------------------------------------------------------------------------------------
# what a writer writes, and how a reader checks it
# ---------------------------------------------------------------------------------------------
def tokens_len(w: int, seq: int, row: int) -> int:
    """Length of ``tokens`` written by writer ``w`` at ``seq`` in ``row`` (3..11).

    Even sequence numbers give one length for every row of a batch (dense batch
    writes), odd ones a length per row (lazy-stack batch writes).
    """
    spread = row * 5 if seq % 2 else 0
    return 3 + (w * 7 + seq * 13 + spread) % 9


def ragged_len(w: int, seq: int, row: int) -> int:
    """First dim of ``("nested", "ragged")`` (1..4): a second, 2-D heterogeneous leaf."""
    spread = row if seq % 3 == 0 else 0
    return 1 + (w + 3 * seq + spread) % 4


def make_element(w: int, seq: int, row: int) -> TensorDict:
    """The element writer ``w`` writes at sequence number ``seq`` into ``row`` (checked keys only)."""
    n_tok = tokens_len(w, seq, row)
    tokens = torch.empty(n_tok, dtype=torch.int64)
    tokens[0], tokens[1], tokens[2] = w, seq, row
    tokens[3:] = seq * 100 + torch.arange(n_tok - 3)
    obs = torch.empty(16, dtype=torch.float32)
    obs[0], obs[1] = w, seq
    obs[2:] = (seq + torch.arange(14, dtype=torch.float64) * 0.25).to(torch.float32)
    n_rag = ragged_len(w, seq, row)
    ragged = torch.tensor([[w + k, seq % 1024 + k] for k in range(n_rag)], dtype=torch.float16)
    return TensorDict(
        {
            "stamp": torch.tensor([w, seq], dtype=torch.int64),
            "obs": obs,
            "tokens": tokens,
            "small": torch.tensor([w % 256, seq % 256, row % 256, 255 - seq % 256], dtype=torch.uint8),
            "nested": {
                "a": torch.tensor([w, seq, w * 1e6 + seq, -seq / 4], dtype=torch.float64),
                "deeper": {"b": torch.tensor([w, seq, (w * 31 + seq) % 2**31], dtype=torch.int32)},
                "ragged": ragged,
            },
        },
        batch_size=[],
    )


def make_ring_rows(w: int, seq: int, n: int) -> TensorDict:
    """The ``n`` rows ring writer ``w`` extends with at ``seq``: row j stamped ``(w, seq, j)``, every other
    leaf a function of the stamp (homogeneous keys only, so the ring can take its rows as SETRANGEs)."""
    j = torch.arange(n, dtype=torch.int64)
    stamp = torch.stack([torch.full((n,), w), torch.full((n,), seq), j], 1)
    base = (seq * 64 + j).to(torch.float64)
    return TensorDict(
        {
            "stamp": stamp,
            "obs": (base.unsqueeze(1) + torch.arange(16, dtype=torch.float64) * 0.25 + w).to(torch.float32),
            "small": torch.stack([torch.full((n,), w % 256), torch.full((n,), seq % 256), j % 256], 1).to(torch.uint8),
            "nested": {"a": torch.stack([base, -base / 4, base + w * 1e6], 1)},
        },
        batch_size=[n],
    )


def check_ring_row(td: TensorDictBase, where: str, writers: int) -> str | None:
    """None when ring row ``td`` holds what its stamp's writer extended; else the problem."""
    stamp = td.get("stamp", None)
    if not isinstance(stamp, torch.Tensor) or stamp.shape != (3,) or stamp.dtype != torch.int64:
        return f"{where}: bad stamp {_describe(stamp)}"
    w, seq, j = (int(v) for v in stamp)
    if not (0 <= w < writers and 0 <= seq < SEQ_LIMIT and 0 <= j < 64):
        return f"{where}: stamp {(w, seq, j)} was never written"
    want = make_ring_rows(w, seq, j + 1)[j]
    for path in (("obs",), ("small",), ("nested", "a")):
        got, exp = td.get(_key(path), None), want.get(_key(path))
        if not isinstance(got, torch.Tensor) or got.dtype != exp.dtype or got.shape != exp.shape or not torch.equal(got, exp):
            return f"{where}: stamp {(w, seq, j)} but {_key(path)!r} holds {_describe(got)}, expected {_describe(exp)}"
    return None


def initial_element(owner: int, row: int) -> TensorDict:
    """Row ``row`` as uploaded: its owner's element at seq 0 plus the keys the schema racer plays with."""
    td = make_element(owner, 0, row)
    td["aux"] = torch.tensor(AUX_VALUE, dtype=torch.int64)
    dtype, value = SPARE_VALUES[0]
    td["spare"] = torch.full((2,), value, dtype=dtype)
    return td


def stack_batch(tds: list[TensorDict]) -> TensorDictBase:
    """A dense TensorDict when the elements agree in every leaf shape, else a lazy stack."""
    first = {k: v.shape for k, v in tds[0].items(include_nested=True, leaves_only=True)}
    same = all({k: v.shape for k, v in td.items(include_nested=True, leaves_only=True)} == first for td in tds[1:])
    return torch.stack(tds, 0) if same else lazy_stack(tds, 0)


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    vals = t.reshape(-1)[:6].tolist()
    return f"{t.dtype} {list(t.shape)} {vals}{'...' if t.numel() > 6 else ''}"


def _key(path: tuple[str, ...]) -> str | tuple[str, ...]:
    return path[0] if len(path) == 1 else path


def check_element(td: TensorDictBase, row: int, owner: Sequence[int]) -> tuple[int | None, str | None]:
    """Check one element read from ``row``; return (its seq or None, a problem or None).

    The element is consistent when every checked leaf equals what the ``(writer,
    seq)`` in its ``stamp`` wrote into this row, the writer is the row's owner, and
    the keys of the schema racer hold their values.
    """
    stamp = td.get("stamp", None)
    if not isinstance(stamp, torch.Tensor) or stamp.shape != (2,) or stamp.dtype != torch.int64:
        return None, f"row {row}: bad stamp {_describe(stamp)}"
    w, seq = int(stamp[0]), int(stamp[1])
    if w != owner[row]:
        return None, f"row {row}: stamp (w{w}, seq {seq}) but the row belongs to writer {owner[row]}"
    if not 0 <= seq < SEQ_LIMIT:
        return None, f"row {row}: stamp (w{w}, seq {seq}) has an impossible seq"
    want = make_element(w, seq, row)
    for path in CHECKED[1:]:
        got = td.get(_key(path), None)
        exp = want.get(_key(path))
        if not isinstance(got, torch.Tensor) or got.dtype != exp.dtype or got.shape != exp.shape or not torch.equal(got, exp):
            return seq, f"row {row}: stamp (w{w}, seq {seq}) but {_key(path)!r} holds {_describe(got)}, expected {_describe(exp)}"
    problem = _check_racer_keys(td, row)
    return seq, problem


def _check_racer_keys(td: TensorDictBase, row: int) -> str | None:
    """Loose checks of ``extra_k``, ``aux``/``aux_renamed`` and ``spare`` (written only by the schema racer)."""
    extra = td.get("extra_k", None)
    if extra is not None and not (extra.dtype == torch.float32 and extra.shape == (3,) and bool((extra == EXTRA_VALUE).all())):
        return f"row {row}: extra_k holds {_describe(extra)}"
    auxes = [td.get(name, None) for name in ("aux", "aux_renamed")]
    present = [a for a in auxes if a is not None]
    if len(present) != 1:
        return f"row {row}: {len(present)} of aux/aux_renamed are present (keys {sorted(map(str, td.keys()))})"
    if present[0].dtype != torch.int64 or present[0].tolist() != list(AUX_VALUE):
        return f"row {row}: aux holds {_describe(present[0])}"
    spare = td.get("spare", None)
    ok = (
        spare is not None
        and tuple(spare.shape) in {(w,) for w in SPARE_WIDTHS}
        and any(spare.dtype == d and bool((spare == v).all()) for d, v in SPARE_VALUES)
    )
    if not ok:
        return f"row {row}: spare holds {_describe(spare)}"
    return None
