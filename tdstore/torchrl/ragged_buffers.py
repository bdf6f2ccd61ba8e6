"""The buffers :func:`tdstore.torchrl.replay_buffer` makes for rows that differ in shape (``ragged=True``).

torchrl's ``ReplayBuffer(storage=LazyStackStorage(n))`` takes a list of tensordicts in ``extend`` and
samples lazy stacks; an LLM learner then pads each key itself. These subclasses of torchrl's buffers
keep every torchrl behaviour and add what a ragged buffer needs:

* ``extend([td, td, ...])``: a list of tensordicts is written as their lazy stack (one call), as
  ``LazyStackStorage`` takes it (``TensorDictReplayBuffer`` refuses lists);
* ``sample(..., as_padded_tensor=True | as_nested_tensor=True, padding_side=, padding_value=,
  return_mask=)``: the lazy stack the sample gives, laid out by ``_plan.padded_batch.pad_rows``
  (tensor keys padded or jagged, non-tensor keys as ``NonTensorStack``, sub-trees of varying dims,
  such as a chat ``History``, as lazy stacks in their class).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDictBase, lazy_stack
from torchrl.data.replay_buffers.replay_buffers import ReplayBuffer, TensorDictReplayBuffer

from tdstore import check_padding, pad_rows


def _stacked(data: Any) -> Any:
    """A list (or tuple) of tensordicts as their lazy stack; anything else as it is."""
    if isinstance(data, (list, tuple)) and data and all(isinstance(x, TensorDictBase) for x in data):
        return lazy_stack(list(data))
    return data


def _padded(out: Any, padding: dict[str, Any]) -> Any:
    if not padding:
        return out
    if isinstance(out, tuple):  # (data, info)
        return (pad_rows(out[0], padding), *out[1:])
    return pad_rows(out, padding)


class RaggedTensorDictReplayBuffer(TensorDictReplayBuffer):
    """torchrl's ``TensorDictReplayBuffer`` taking lists in ``extend`` and padding keywords in ``sample`` (module docstring)."""

    def extend(self, tensordicts: Any, *args: Any, **kwargs: Any) -> Any:
        return super().extend(_stacked(tensordicts), *args, **kwargs)

    def sample(self, batch_size: int | None = None, return_info: bool = False, *args: Any, **kwargs: Any) -> Any:
        padding = check_padding({k: kwargs.pop(k) for k in list(kwargs) if k not in _TORCHRL_SAMPLE})
        return _padded(super().sample(batch_size, return_info, *args, **kwargs), padding)


class RaggedReplayBuffer(ReplayBuffer):
    """torchrl's ``ReplayBuffer`` taking lists of tensordicts in ``extend`` and padding keywords in ``sample`` (module docstring)."""

    def extend(self, data: Sequence, *args: Any, **kwargs: Any) -> Any:
        return super().extend(_stacked(data), *args, **kwargs)

    def sample(self, batch_size: int | None = None, return_info: bool = False, *args: Any, **kwargs: Any) -> Any:
        padding = check_padding({k: kwargs.pop(k) for k in list(kwargs) if k not in _TORCHRL_SAMPLE})
        return _padded(super().sample(batch_size, return_info, *args, **kwargs), padding)


#: The keywords torchrl's ``sample`` takes (any other is a padding keyword, or refused by name).
_TORCHRL_SAMPLE = frozenset({"include_info", "wait", "timeout", "cancel_event"})
