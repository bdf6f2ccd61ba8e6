"""The torchrl ``Sampler`` classes of :mod:`tdstore.torchrl`: uniform, without replacement, and prioritized on the server."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, Sampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.samplers.base import _REPLACEMENT_DISPATCH  # see the registration at the end
from torchrl.data.replay_buffers.storages import Storage

from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import PrioritizedSample, check_batch_size, index_positions, priority_tensor
from tdstore.torchrl.storage import StoreStorage
from tdstore.torchrl.storage_base import EMPTY_ERROR, Drawn, has_keys


def _slots_only(storage: Storage, sampler: object) -> None:
    """tdstore's samplers draw ring slots: an ndim>1 storage's batches are of cells (torchrl's samplers draw those)."""
    if getattr(storage, "ndim", 1) > 1:
        raise ValueError(
            f"{type(sampler).__name__} draws the ring's slots (dim 0), but this StoreStorage has ndim={storage.ndim}, whose "
            "samples are cells: use torchrl's RandomSampler, SamplerWithoutReplacement or SliceSampler"
        )


class StoreSampler(Sampler):
    """Uniform sampling (with replacement) over the slots the ring has written, in one round trip.

    The sampler reads the rows itself and hands them to ``StoreStorage.get`` for the
    indices it returns (so ``rb.sample()`` is one round trip, generations included).
    The random numbers come from the buffer's generator (``rb.set_rng``) when one is set.

    How: the ring's ``sample_seen`` (``tdstore.Ring``): the slots are drawn on the client,
    below the written length the store handle last saw, and read in one transaction of
    plain ``GETRANGE``s together with the ring's write counter (which gives the generations
    and the bound for the next call).  Written slots stay written (the ring only grows until
    ``empty``), so every drawn slot holds a written row; the counter read with the rows
    proves it, and a batch that drew a slot beyond it (the buffer was emptied meanwhile) is
    drawn again by the server.  Rows written since the previous sample are drawn from the
    next one on.  The first sample of a handle reads the length first (two round trips).
    Heterogeneous data, servers that refuse transactions and sharded rings use
    ``store.sample`` (the server draws; one script call, slower on the server).
    ``StoreSampler(replacement=False)`` is :class:`StoreSamplerWithoutReplacement`.
    """

    requires_shared_state = False

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if not isinstance(storage, StoreStorage):
            raise TypeError(
                f"StoreSampler samples a tdstore.torchrl.StoreStorage, got {type(storage).__name__}; use RandomSampler for other storages"
            )
        _slots_only(storage, self)
        check_batch_size(int(batch_size), "sample")
        got = storage.with_store(lambda s: self._draw(s, int(batch_size)))
        storage.stash(got)
        return got.indices, {}

    def _draw(self, s: LazyStackedTensorDictStore, batch_size: int) -> Drawn:
        if not has_keys(s):
            raise RuntimeError(EMPTY_ERROR)
        try:
            return s.sample_seen(batch_size, generator=self._rng)
        except ValueError as err:
            if "nothing" in str(err).lower() or "written" in str(err).lower():
                raise RuntimeError(EMPTY_ERROR) from err
            raise

    def _empty(self) -> None:
        """Nothing to forget: the bound is the store handle's, and an emptied buffer is another handle."""

    def dumps(self, path: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: Any) -> None:
        """Nothing to load: the one thing the sampler knows, the written length, is the server's."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`loads`)."""


class StoreSamplerWithoutReplacement(SamplerWithoutReplacement):
    """torchrl's ``SamplerWithoutReplacement`` for a buffer that others keep extending.

    torchrl's reshuffles everything whenever the storage length changes, which, with
    actors extending all the time, makes every batch a fresh draw.  This one keeps the
    slots not drawn yet and adds the newly written ones, so within one pass every written
    slot is drawn once.  Two round trips per batch (the server's length, then the rows).
    The permutation is this process's: two learners each draw every slot once.
    """

    _sample_list: torch.Tensor | None  # torchrl's: the slots this pass has not drawn yet
    len_storage: int  # torchrl's: the storage length that list was made for
    _written: torch.Tensor | None = None  # a sharded ring not full: its written slots (the list holds positions in these)

    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        _slots_only(storage, self)
        slots = storage.written_slots() if isinstance(storage, StoreStorage) else None
        n = len(storage) if slots is None else slots.numel()
        if n == 0:
            raise RuntimeError(EMPTY_ERROR)
        before = self._written
        self._written = slots
        if self._sample_list is not None and 0 < self.len_storage < n:
            if before is not None:  # the slots written since: those not in the list's set (written slots stay written)
                grown = slots[~torch.isin(slots, before)] if slots is not None else _not_in(torch.arange(n), before)
                self._sample_list = before[self._sample_list]
            else:
                grown = torch.arange(self.len_storage, n)
            rest = torch.cat([self._sample_list, grown])
            self._sample_list = rest[torch.randperm(rest.numel(), generator=self._rng)] if self.shuffle else rest
            self.len_storage = n
            if slots is not None:  # back to positions in the written slots
                self._sample_list = torch.searchsorted(slots, self._sample_list)
        index, info = super().sample(_KnownLength(storage, n), batch_size)
        return (index if slots is None else slots[index]), info

    def _empty(self) -> None:
        super()._empty()
        self._written = None


def _not_in(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a[~torch.isin(a, b)]


class _KnownLength:
    """The storage as ``SamplerWithoutReplacement`` sees it, with the length already read (no second round trip)."""

    ndim = 1

    def __init__(self, storage: Storage, n: int) -> None:
        self._inner = storage
        self._n = n
        self.device = None

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self) -> torch.Size:
        return self._inner.shape


class StorePrioritizedSampler(PrioritizedSampler):
    """torchrl's ``PrioritizedSampler`` API with the sum tree on the server, shared by every process.

    torchrl's ``PrioritizedSampler`` keeps its tree in the learner's process: actors cannot
    give new data a priority, and two learners cannot share one. Here the tree is the
    store's (``store.enable_priorities``): a slot written by any actor gets the largest
    priority so far in the same atomic call, ``update_priority`` sets
    ``(|priority| + eps) ** alpha`` on the server (only where the slot still holds the
    generation the last sample read), and ``sample`` draws on the server in one round
    trip, returning torchrl's ``{"priority_weight": ...}`` (``(P(i) / min P) ** -beta``).
    ``max_times_sampled`` retires a slot after that many draws (Reverb's).

    It subclasses torchrl's ``PrioritizedSampler`` so that torchrl's buffers treat it as one
    (``update_tensordict_priority`` checks the type), without its in-process trees: every
    method torchrl calls is this class's own.
    """

    requires_shared_state = False

    def __init__(
        self, alpha: float, beta: float, eps: float = 1e-8, *, max_times_sampled: int | None = None, timeout: float | None = None
    ) -> None:  # noqa: D107 (no trees here)
        if alpha < 0 or beta < 0 or eps < 0:
            raise ValueError(f"alpha, beta and eps must be >= 0, got alpha={alpha}, beta={beta}, eps={eps}")
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self._max_times = max_times_sampled
        self.reduction = "max"  # how torchrl's buffers reduce a multi-dim priority to one per row
        self.timeout = timeout
        """How long a sample waits for the store's rate limiter (``None``: as long as it takes), then ``TimeoutError``."""
        self._last: tuple[StoreStorage, PrioritizedSample] | None = None

    @property
    def alpha(self) -> float:
        return self._alpha

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = float(value)  # annealing beta is the learner's: only sampling uses it

    def prepare(self, storage: StoreStorage) -> None:
        """Turn the store's priorities on (idempotent; a store keeps the alpha it got first)."""
        storage.with_store(lambda s: s.enable_priorities(self._alpha, max_times_sampled=self._max_times))

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if not isinstance(storage, StoreStorage):
            raise TypeError(f"StorePrioritizedSampler samples a tdstore.torchrl.StoreStorage, got {type(storage).__name__}")
        _slots_only(storage, self)

        def draw(s: LazyStackedTensorDictStore) -> PrioritizedSample:
            if not has_keys(s):
                raise RuntimeError(EMPTY_ERROR)
            s.enable_priorities(self._alpha, max_times_sampled=self._max_times)
            try:
                got = s.sample(int(batch_size), generator=self._rng, prioritized=True, beta=self._beta, timeout=self.timeout)
                return cast(PrioritizedSample, got)  # prioritized=True always answers a PrioritizedSample
            except ValueError as err:
                if "no written slot" in str(err) or "nothing" in str(err).lower():
                    raise RuntimeError(EMPTY_ERROR) from err
                raise

        got: PrioritizedSample = storage.with_store(draw)
        storage.stash(got)
        self._last = (storage, got)
        return got.indices, {"priority_weight": got.weights}

    def update_priority(self, index: Any, priority: Any, *, storage: Storage | None = None) -> None:
        """Set ``(|priority| + eps) ** alpha`` for ``index``: where it is the last batch drawn, only
        for slots that still hold the rows it read (an actor may have overwritten some since)."""
        if isinstance(index, tuple):
            index = index[0]
        p = priority_tensor(priority).reshape(-1)  # a complex or bool td_error is refused, never cast
        if p.numel() and bool(p.isnan().all()):
            return  # torchrl seeding a new buffer's existing rows with default_priority: the server's stand
        last = self._last
        target = storage if isinstance(storage, StoreStorage) else (last[0] if last is not None else None)
        if target is None:
            raise RuntimeError("update_priority needs the storage: sample first, or pass storage=")
        idx, _ = index_positions(index, target.max_size)  # a mask means what it means to indexing
        p = p.abs() + self._eps
        if p.numel() == 1 and idx.numel() > 1:
            p = p.expand(idx.numel())
        gens = None
        if last is not None and last[0] is target and last[1].indices.shape == idx.shape and torch.equal(last[1].indices, idx):
            gens = last[1].generations
        target.with_store(lambda s: s.update_priority(idx, p, generation=gens))

    def mark_update(self, index: Any, *, storage: Storage | None = None) -> None:
        """Nothing to do: the server gives a written slot its priority in the call that writes it."""

    def add(self, index: Any) -> None:
        """Nothing to do (torchrl's sampler tracks its max priority here; the server does)."""

    def extend(self, index: Any) -> None:
        """Nothing to do (see :meth:`add`)."""

    @property
    def default_priority(self) -> float:
        """NaN: "the server's default". A torchrl buffer built over rows already written seeds them
        with this value through ``update_priority``, which leaves the server's priorities as they are
        (a slot written without a priority gets the largest so far, on the server)."""
        return float("nan")

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_last"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._last = None

    def _empty(self) -> None:
        self._last = None

    def dumps(self, path: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: Any) -> None:
        """Nothing to load: the priorities are the server's."""

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps, "max_times_sampled": self._max_times}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._beta = float(state_dict.get("beta", self._beta))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, max_times_sampled={self._max_times})"


# ``StoreSampler(replacement=False)`` builds a StoreSamplerWithoutReplacement: torchrl's sampler metaclass looks the
# counterpart up in this table, and registering in it is the only way torchrl offers (it has no public registration call).
_REPLACEMENT_DISPATCH[StoreSampler] = StoreSamplerWithoutReplacement
