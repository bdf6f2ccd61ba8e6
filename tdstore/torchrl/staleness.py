"""torchrl's ``StalenessAwareSampler`` on a tdstore buffer: the staleness bound held by the server.

torchrl's sampler keeps the learner's ``consumer_version`` in one process and filters the rows whose
``policy_version`` key lags it by more than ``max_staleness``. On a tdstore ring the versions live on
the server (``_ring/rollouts.py``): rows carry the version they were written with (``extend(version=)``
from any process, or the published one), ``set_version`` publishes the learner's, and
``sample(n, max_staleness=k)`` draws only rows of version >= published - k, in one round trip.
:func:`tdstore.torchrl.replay_buffer` turns a ``StalenessAwareSampler`` given as ``sampler=`` into
:class:`StoreStalenessSampler` (the same object, so the caller keeps setting ``consumer_version`` on it):
a sample first publishes ``consumer_version`` when it changed (``set_version``, backwards allowed as
torchrl allows), then lets the server draw.

Differences from torchrl's in-memory sampler, by design: the version is each row's server stamp, not
its ``version_key`` (write rows with ``extend(..., version=v)`` on the store, or let the server stamp
the published version); within the bound rows are drawn uniformly (the hard gate is exact; torchrl's
freshness weighting ``staleness_weight_fn`` is not applied: a custom one is refused).
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers.samplers import StalenessAwareSampler
from torchrl.data.replay_buffers.samplers.random import _default_staleness_weight
from torchrl.data.replay_buffers.storages import Storage

from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import RolloutSample
from tdstore.torchrl.storage import StoreStorage
from tdstore.torchrl.storage_base import EMPTY_ERROR, has_keys

__all__ = ["StoreStalenessSampler", "on_the_server"]


class StoreStalenessSampler(StalenessAwareSampler):
    """``StalenessAwareSampler`` whose bound the server holds (see the module docstring); one round trip a
    sample, two when ``consumer_version`` changed since the last one."""

    _published: tuple[Any, int] | None = None  # (store, version) this sampler published last

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        if not isinstance(storage, StoreStorage):
            raise TypeError(f"StoreStalenessSampler samples a tdstore.torchrl.StoreStorage, got {type(storage).__name__}")
        if self._weight_fn is not _default_staleness_weight:
            raise NotImplementedError(
                "a tdstore buffer draws uniformly within max_staleness: a custom staleness_weight_fn is not supported"
            )
        version = int(self.consumer_version)

        def draw(s: LazyStackedTensorDictStore) -> RolloutSample:
            if not has_keys(s):
                raise RuntimeError(EMPTY_ERROR)
            if self._published != (storage.store_identity, version):
                s.set_version(version, allow_backwards=True)
                self._published = (storage.store_identity, version)
            bound = None if self.max_staleness < 0 else int(self.max_staleness)
            try:
                got = s.sample(int(batch_size), max_staleness=bound)
            except ValueError as err:
                raise RuntimeError(
                    f"no row of the buffer is within max_staleness={self.max_staleness} (consumer_version={version}): {err}"
                ) from None
            assert isinstance(got, RolloutSample)  # the ring's rollout index is on (set_version)
            return got

        got = storage.with_store(draw)
        storage.stash(got)
        return got.indices, {"staleness": version - got.versions}


def on_the_server(sampler: Any) -> Any:
    """``sampler`` turned into :class:`StoreStalenessSampler` when it is torchrl's ``StalenessAwareSampler``
    (the same object: its ``consumer_version`` stays the caller's to set); any other sampler as it is."""
    if type(sampler) is StalenessAwareSampler:
        sampler.__class__ = StoreStalenessSampler
    return sampler
