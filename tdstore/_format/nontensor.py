"""Non-tensor leaves (``NonTensorData``, ``NonTensorStack``) as one JSON document per element.

A non-tensor key is stored like a heterogeneous ``uint8`` key whose element ``i``
is the UTF-8 JSON of element ``i``'s value, so reading or writing element ``i``
moves only that element's bytes (the offset table is rewritten on the server when
its size changes), never the whole column.  A document is ``["d", value]`` for
one value covering the element (``NonTensorData``) or ``["s", nested lists]`` for
one value per inner batch entry (``NonTensorStack``).

Only what JSON holds exactly is accepted: str, int, float (finite), bool, None,
lists and dicts with str keys.  Anything else (tuples, sets, objects, NaN) raises
``TypeError`` naming the key, because it would not read back as written; nothing
is ever pickled, and reading never imports or evaluates anything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack
from tensordict.base import _is_leaf_nontensor

from tdstore._format.schema import RAGGED, NestedPath


@dataclass(frozen=True)
class NonTensor:
    """A non-tensor value to write (``NonTensorData`` or ``NonTensorStack``), as ``leaves_of`` found it."""

    value: Any


def _display(path: NestedPath) -> Any:
    return path[0] if len(path) == 1 else path


def _check(path: NestedPath, v: Any, where: str = "") -> None:
    if v is None or isinstance(v, (str, bool, int)):
        return
    if isinstance(v, float):
        if not math.isfinite(v):
            raise TypeError(f"key {_display(path)!r}{where}: {v} cannot be stored as JSON (only finite floats)")
        return
    if isinstance(v, list):
        for k, x in enumerate(v):
            _check(path, x, f"{where}[{k}]")
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(f"key {_display(path)!r}{where}: dict key {k!r} is not a str; JSON keys are strings")
            _check(path, x, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"key {_display(path)!r}{where}: a {type(v).__name__} cannot be stored as JSON and read back as written "
        "(str, int, float, bool, None, list and dict are; nothing is pickled)"
    )


def _doc(path: NestedPath, piece: Any) -> torch.Tensor:
    """The JSON document of one element as a uint8 tensor."""
    if isinstance(piece, NonTensorStack):
        body: list = ["s", piece.tolist()]
    elif isinstance(piece, NonTensorData):
        body = ["d", piece.data]
    else:
        body = ["d", piece]
    _check(path, body[1])
    raw = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def element_docs(path: NestedPath, value: NonTensor, n: int | None, stack_pos: int) -> list[torch.Tensor]:
    """One document per element: of the element itself (``n`` None), or of each of the ``n`` elements along ``stack_pos``."""
    v = value.value
    if n is None:
        return [_doc(path, v)]
    if isinstance(v, NonTensorData) or not isinstance(v, NonTensorStack):
        data = v.data if isinstance(v, NonTensorData) else v
        doc = _doc(path, data)
        return [doc] * n
    bs = v.batch_size
    if len(bs) <= stack_pos or bs[stack_pos] != n:
        raise ValueError(
            f"key {_display(path)!r}: a non-tensor stack of batch size {list(bs)} does not hold {n} elements along dim {stack_pos}"
        )
    return [_doc(path, piece) for piece in v.unbind(stack_pos)]


def _build(values: Any, inner: tuple[int, ...]) -> Any:
    if not inner:
        return NonTensorData(values, batch_size=[])
    if not isinstance(values, list) or (inner[0] != RAGGED and len(values) != inner[0]):
        raise ValueError(f"a stored non-tensor stack does not match the inner batch size {list(inner)}")
    if not values:  # a chat of no messages: nothing below to stack
        return NonTensorData(None, batch_size=[0, *(max(d, 0) for d in inner[1:])])
    if len(inner) == 1 and _FLAT_STACK is not None and all(type(x) in _FLAT for x in values):
        # a list of plain values (a chat's roles, contents): tensordict's builder of such a stack, a tenth of
        # the time of one NonTensorData per value stacked (the same NonTensorStack)
        return _FLAT_STACK(values, device=None, ndim=1)
    return torch.stack([_build(x, inner[1:]) for x in values])


_FLAT = (str, int, float, bool)
#: tensordict's fast builder of a one-dim stack of plain values (0.15; absent: the general path)
_FLAT_STACK = getattr(NonTensorStack, "_from_list", None)


def decode(raw: bytes | bytearray | memoryview | torch.Tensor, inner: tuple[int, ...]) -> Any:
    """The ``NonTensorData``/``NonTensorStack`` of one element from its stored document (never unpickles).

    A :data:`RAGGED` dim of ``inner`` (a sub-tree whose dims vary between elements) takes the length
    the stored lists have."""
    if isinstance(raw, torch.Tensor):
        raw = raw.numpy().tobytes()
    if not len(raw):  # an element never written (a slot of a segment allocated when first written)
        return NonTensorData(None, batch_size=list(inner))
    try:
        kind, value = json.loads(bytes(raw))
    except (ValueError, TypeError) as err:
        raise ValueError(f"a stored non-tensor element is not a tdstore JSON document: {err}") from None
    if kind == "d":
        # in a sub-tree whose dims vary between elements (RAGGED), the dims known so far: the element's
        # maker (``_plan.values``) gives the value its sub-tree's batch size, which its siblings tell
        known = inner[: inner.index(RAGGED)] if RAGGED in inner else inner
        return NonTensorData(value, batch_size=list(known))
    if kind == "s":
        return _build(value, inner)
    raise ValueError(f"a stored non-tensor element has an unknown kind {kind!r}")


def content(value: Any) -> Any:
    """What ``td[key]`` gives for a value: the data of a ``NonTensorData``, a list for a ``NonTensorStack``, else the value."""
    if isinstance(value, NonTensorStack):
        return value.tolist(as_linked_list=True)
    if isinstance(value, NonTensorData):
        return value.data
    return value


def _values(v: Any) -> list[Any]:
    """Every entry of a non-tensor stack (one per batch position)."""
    if isinstance(v, NonTensorStack):
        return [x for member in v.tensordicts for x in _values(member)]
    return [v.data] * max(1, v.numel())


def collapse(td: Any) -> Any:
    """Stacks of one repeated value become one ``NonTensorData``, as ``TensorDict.set(key, value)`` holds it (in place).

    A stack of elements that each held a stack (a list per element, as chat data
    has) stays a stack, as a TensorDict keeps it.
    """
    for key in list(td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor)):
        v = td.get(key)
        if isinstance(v, NonTensorStack) and not any(isinstance(m, NonTensorStack) for m in v.tensordicts):
            values = _values(v)
            if values and len({json.dumps(x, sort_keys=True) for x in values}) == 1:
                td.set(key, NonTensorData(values[0], batch_size=v.batch_size))
    return td
