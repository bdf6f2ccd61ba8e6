"""The ring of a dense ``TensorDictStore``: the lazy store's ring, reached through the stack it is kept as.

A dense store of batch size ``[N, *rest]`` is a stack of ``N`` elements of batch size
``rest`` (``dense``), so its first dim is the ring's ``N`` slots.  Every ring call here
is the hidden lazy store's own (``_ring.lazy_methods.ReplayMethods``: one script call, the same
request ids, waits, priorities, limiter, queue and leases); this mixin only checks that
the handle is a whole store with rows, and hands the batches back dense (a sample of
``B`` rows is a ``TensorDict`` of batch size ``[B, *rest]``, never a lazy stack).  The
store's header says ``type: dense``, which the ring's writes read: a row of another
shape than its key's raises ``DenseShapeError`` before anything is written, where a
lazy store would make the key heterogeneous.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from tensordict import LazyStackedTensorDict

from tdstore._errors import AmbiguousTimeoutError
from tdstore._format import nontensor as _nontensor
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._front.common import LOCK_ERROR
from tdstore._ring.extend import RingState, RingWrite, Sample
from tdstore._ring.lazy_methods import ReplayMethods, pops_a_key
from tdstore._ring.leases import LeasedSample
from tdstore._ring.marks import Marks
from tdstore._ring.policy_calls import PrioritizedSample

if TYPE_CHECKING:
    from tdstore.lazy import LazyStackedTensorDictStore


def dense_rows(td: Any) -> Any:
    """Rows of a dense store read through its stack as one dense TensorDict: a lazy stack (of
    non-tensor rows) is stacked, and non-tensor keys are held as a dense TensorDict holds them."""
    if isinstance(td, LazyStackedTensorDict):
        return _nontensor.collapse(torch.stack(list(td.tensordicts), td.stack_dim))
    return td


def densify(got: Any) -> Any:
    """``got`` (a ``Sample``, ``PrioritizedSample`` or ``LeasedSample``) with its rows as one dense TensorDict."""
    td = dense_rows(got.td)
    if isinstance(got, LeasedSample):
        return dataclasses.replace(got, td=td)
    return got._replace(td=td)


def _doc(name: str) -> str:
    """The lazy store's docstring of ring method ``name``: the dense store's behaves alike."""
    return getattr(ReplayMethods, name).__doc__ or ""


class DenseRing:
    """The shared ring of a dense store (see ``ReplayMethods``, whose methods these call)."""

    _store: Any  # the hidden LazyStackedTensorDictStore (the StackView's StackStore)
    _under: tuple
    _batchless: bool
    is_locked: bool

    #: ``TensorDictStore.dense_rows(td)``: rows read through the stack a dense store is kept as
    #: (``LazyStackedTensorDictStore.kept_as_dense``), as the dense store gives them: one dense TensorDict.
    dense_rows = staticmethod(dense_rows)

    def _ring(self) -> LazyStackedTensorDictStore:
        """The stack the ring is kept in, once this handle is known to be a whole store with rows."""
        if self._batchless:
            raise TypeError(
                "a dense store of batch size [] has no rows, so no ring: make it with batch_size=[capacity, ...] "
                "(its first dim is the ring's slots)"
            )
        if self._under:
            raise TypeError(f"the ring is the whole store's: call it on the store, not on its sub-tree {'.'.join(self._under)!r}")
        assert isinstance(self._store, ReplayMethods)  # the hidden lazy store: the ring's methods are its own
        return self._store

    def _writable_ring(self) -> LazyStackedTensorDictStore:
        ring = self._ring()
        if self.is_locked and not ring.stack_ops.engine.header.leaves:
            raise RuntimeError(LOCK_ERROR)  # a locked store refuses the first ring write only (it creates keys)
        return ring

    def extend(self, td: Any, *, priority: Any = None, timeout: float | None = None, request_id: str | None = None) -> RingWrite:
        """Write the rows of ``td`` (batch size ``[n, *rest]``, 1 <= n <= capacity) into the next rows of the ring, in one call.

        As :meth:`LazyStackedTensorDictStore.extend`: the server reserves the rows at its
        cursor (wrapping around), writes every key and advances the cursor atomically, so any
        number of processes may extend one store; a resent call writes once. ``td`` holds
        every key of the store (a new key is created for every row); each key keeps its
        dtype and row shape: a row of another shape raises ``DenseShapeError`` naming the key
        and both shapes, before anything is written (ragged rows need a lazy store).
        ``priority``, ``timeout``, ``request_id``: as for the lazy store. Returns ``RingWrite(indices, generations)``.
        """
        return self._writable_ring().extend(td, priority=priority, timeout=timeout, request_id=request_id)

    def append(self, td: Any, *, priority: Any = None, timeout: float | None = None, request_id: str | None = None) -> RingWrite:
        return self._writable_ring().append(td, priority=priority, timeout=timeout, request_id=request_id)

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        keys: Sequence[Any] | None = None,
        prioritized: bool | None = None,
        alpha: float | None = None,
        beta: float = 1.0,
        min_size: int | None = None,
        timeout: float | None = None,
    ) -> Sample | PrioritizedSample:
        """A random batch of written rows in one round trip: ``Sample(td, indices, generations)`` whose ``td``
        is a dense TensorDict of batch size ``[batch_size, *rest]`` (``PrioritizedSample`` with weights and
        probabilities on a store with priorities). Arguments as :meth:`LazyStackedTensorDictStore.sample`."""
        try:
            got = self._ring().sample(
                batch_size, generator, keys=keys, prioritized=prioritized, alpha=alpha, beta=beta, min_size=min_size, timeout=timeout
            )
        except AmbiguousTimeoutError as err:  # a counted sample: its resend's rows dense too
            raise err.then(densify) from err.__cause__
        return densify(got)

    def pop(self, *args: Any, **kwargs: Any) -> Any:
        """``pop(batch_size=1, *, timeout=None, keys=None, lease=None)``: the queue's next items (see :meth:`pop_items`);
        ``pop(key[, default])``, a key (str or tuple) first: TensorDict's, which removes a key and returns it."""
        if pops_a_key(args, kwargs):
            return super().pop(*args, **kwargs)  # type: ignore[misc]  # TensorDictBase.pop, further along the MRO
        return self.pop_items(*args, **kwargs)

    def pop_items(
        self,
        batch_size: int = 1,
        *,
        timeout: float | None = None,
        keys: Sequence[Any] | None = None,
        lease: float | None = None,
        request_id: str | None = None,
    ) -> Sample | LeasedSample:
        try:
            got = self._ring().pop_items(batch_size, timeout=timeout, keys=keys, lease=lease, request_id=request_id)
        except AmbiguousTimeoutError as err:  # its resend's rows dense too
            raise err.then(densify) from err.__cause__
        return densify(got)

    def ack(self, receipt: Any, *, timeout: float | None = None) -> int:
        return self._ring().ack(receipt, timeout=timeout)

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        return self._ring().update_if(index, generation, td)

    def ring_state(self) -> RingState:
        return self._ring().ring_state()

    def stats(self) -> dict[str, Any]:
        return self._ring().stats()

    @property
    def capacity(self) -> int:
        """The ring's capacity: the store's first dim (``len(store.written)`` is how many rows it holds)."""
        return self._ring().capacity

    @property
    def written(self) -> range:
        """The rows the ring has written so far (``range(n)``), read from the server."""
        return self._ring().written

    @property
    def cursor(self) -> int:
        """The row the next ``extend`` writes first, read from the server."""
        return self._ring().cursor

    @property
    def write_count(self) -> int:
        """How many rows ``extend``/``append`` have written in total (all laps), read from the server."""
        return self._ring().write_count

    @property
    def sampling_policy(self) -> SamplingPolicy:
        """The ring's sampling policy as the server holds it (read again from the server)."""
        return self._ring().sampling_policy

    def marks(self) -> Marks:
        return self._ring().marks()

    def set_marks_base(self, generation_base: int, write_base: int) -> None:
        self._ring().set_marks_base(generation_base, write_base)

    def counting_in_place(self) -> AbstractContextManager[None]:
        return self._ring().counting_in_place()

    def sampling_policies(self) -> list[SamplingPolicy]:
        return self._ring().sampling_policies()

    def restore_sampling_policies(self, policies: Sequence[SamplingPolicy]) -> None:
        self._ring().restore_sampling_policies(policies)

    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        self._ring().enable_priorities(alpha, max_times_sampled=max_times_sampled)

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        return self._ring().update_priority(index, priority, generation=generation)

    def set_rate_limit(self, *, min_size: int = 1, samples_per_insert: float | None = None, error_buffer: float | None = None) -> None:
        self._ring().set_rate_limit(min_size=min_size, samples_per_insert=samples_per_insert, error_buffer=error_buffer)

    def clear_rate_limit(self) -> None:
        self._ring().clear_rate_limit()

    def set_queue(self, on: bool = True) -> None:
        self._ring().set_queue(on)

    def track_distinct(self, on: bool = True) -> None:
        self._ring().track_distinct(on)

    def wait_for(self, *, written: int | None = None, write_count: int | None = None, timeout: float | None = None) -> RingState:
        return self._ring().wait_for(written=written, write_count=write_count, timeout=timeout)


for _name in (
    "append", "pop_items", "ack", "update_if", "ring_state", "stats", "enable_priorities",
    "update_priority", "set_rate_limit", "clear_rate_limit", "set_queue", "track_distinct", "wait_for", "sampling_policies",
    "restore_sampling_policies", "marks", "set_marks_base", "counting_in_place",
):  # fmt: skip
    getattr(DenseRing, _name).__doc__ = _doc(_name)
