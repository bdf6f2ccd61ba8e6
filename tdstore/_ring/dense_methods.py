"""The ring of a dense ``TensorDictStore``: the ring of the stack it is kept as, its batches dense.

A dense store of batch size ``[N, *rest]`` is a stack of ``N`` elements of batch size ``rest``
(``dense``), so its first dim is the ring's ``N`` slots. Its ring calls are ``_ring.ring_calls.RingCalls``'s,
written once for every kind, on the engine of the hidden lazy store (``_ring.one_node.OneNodeRing``: one
script call, the same request ids, waits, priorities, limiter, queue and leases). What differs is here:
the handle must be a whole store with rows, and the batches come back dense (a sample of ``B`` rows is a
``TensorDict`` of batch size ``[B, *rest]``, never a lazy stack). The store's header says ``type: dense``,
which the ring's writes read: a row of another shape than its key's raises ``DenseShapeError`` before
anything is written, where a lazy store would make the key heterogeneous.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from tensordict import LazyStackedTensorDict

from tdstore._format import nontensor
from tdstore._front.common import LOCK_ERROR
from tdstore._ring.lazy_methods import LazyRing
from tdstore._ring.leases import LeasedSample
from tdstore._ring.one_node import OneNodeRing
from tdstore._ring.ring_calls import RingCalls


def dense_rows(td: Any) -> Any:
    """Rows of a dense store read through its stack as one dense TensorDict: a lazy stack (of
    non-tensor rows) is stacked, and non-tensor keys are held as a dense TensorDict holds them."""
    if isinstance(td, LazyStackedTensorDict):
        return nontensor.collapse(torch.stack(list(td.tensordicts), td.stack_dim))
    return td


def densify(got: Any) -> Any:
    """``got`` (a ``Sample``, ``PrioritizedSample``, ``RolloutSample`` or ``LeasedSample``) with its rows as one dense TensorDict."""
    td = dense_rows(got.td)
    if isinstance(got, LeasedSample):
        return dataclasses.replace(got, td=td)
    return got._replace(td=td)


class DenseRing(RingCalls):
    """The shared ring of a dense store (``tdstore.Ring``; see the module docstring)."""

    _store: Any  # the hidden LazyStackedTensorDictStore (the StackView's StackStore)
    _under: tuple
    _batchless: bool
    is_locked: bool

    #: ``TensorDictStore.dense_rows(td)``: rows read through the stack a dense store is kept as
    #: (``LazyStackedTensorDictStore.kept_as_dense``), as the dense store gives them: one dense TensorDict.
    dense_rows = staticmethod(dense_rows)

    def _ring_work(self, *, write: bool = False) -> OneNodeRing:
        if self._batchless:
            raise TypeError(
                "a dense store of batch size [] has no rows, so no ring: make it with batch_size=[capacity, ...] "
                "(its first dim is the ring's slots)"
            )
        if self._under:
            raise TypeError(f"the ring is the whole store's: call it on the store, not on its sub-tree {'.'.join(self._under)!r}")
        stack = self._store
        assert isinstance(stack, LazyRing)  # the hidden lazy store
        engine = stack._engine
        if write and (self.is_locked or stack.is_locked) and not engine.header.leaves:
            raise RuntimeError(LOCK_ERROR)  # a locked store refuses the first ring write only (it creates keys)
        return OneNodeRing(engine, stack._count, stack._inner_batch_size, stack._device, self, densify)
