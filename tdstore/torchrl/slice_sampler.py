"""torchrl's ``SliceSampler`` served by the server: the episode index and ``sample_slices`` (``_ring.slices``).

``replay_buffer(N, url=..., sampler=SliceSampler(num_slices=32, traj_key="episode"))`` gives the
buffer a :class:`StoreSliceSampler`: the same object (the caller's reference, its ``state_dict`` and
its arguments stay), whose ``sample`` asks the store for the slices in one round trip instead of
reading the whole trajectory key every time. What torchrl's sampler returns comes back the same way:
the slots (flat), and ``truncated`` (the last row of each slice), ``done`` (the stored done flag or
truncated) and ``terminated`` (stored, or zeros) under the sampler's ``truncated_key``, and its
``init_key`` marking each slice's first row where the rows have it. Configurations the server does
not serve (``fragmented``, ``output_layout="batch_time"``, ``pad_output``, several ``end_keys``, static
``ends``/``trajectories``, a storage of ``ndim > 1`` or a sharded ring) sample as torchrl's class does.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrl._utils import _replace_last
from torchrl.data.replay_buffers.samplers import SliceSampler, SliceSamplerWithoutReplacement
from torchrl.data.replay_buffers.storages import Storage

from tdstore import ShardedRing
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import RanksMoved, Sample, SliceSample
from tdstore.torchrl.storage import StoreStorage
from tdstore.torchrl.storage_base import EMPTY_ERROR, has_keys


def _auto_key(s: LazyStackedTensorDictStore) -> tuple[str, Any] | None:
    """torchrl's choice when neither ``traj_key`` nor ``end_key`` was given: ``("collector", "traj_ids")``,
    then ``"episode"``, among the store's keys (None: no keys yet)."""
    paths = {(k,) if isinstance(k, str) else tuple(k) for k in s.keys(include_nested=True, leaves_only=True)}
    if not paths:
        return None
    if ("collector", "traj_ids") in paths:
        return "traj_key", ("collector", "traj_ids")
    if ("episode",) in paths:
        return "traj_key", "episode"
    return "end_key", ("next", "done")


class _ServerSlices:
    """What both served slice samplers share: the store's trajectory key, the draw, torchrl's flags."""

    __slots__ = ()  # no layout of its own: torchrl's sampler objects become the subclasses (``__class__`` assignment)

    fragmented: bool
    output_layout: str
    pad_output: bool
    end_keys: Any
    _cache: dict
    _fetch_traj: bool
    traj_key: Any
    end_key: Any
    num_slices: int | None
    slice_len: int | None
    strict_length: bool
    span: Any
    _rng: torch.Generator | None
    _batch_size_multiplier: int | None
    truncated_key: Any
    init_key: Any

    def served(self, storage: Storage) -> bool:
        """Whether the server samples for this configuration and storage (else torchrl's ``sample`` does)."""
        return (
            isinstance(storage, StoreStorage)
            and getattr(storage, "ndim", 1) == 1
            and not self.fragmented
            and self.output_layout == "flat"
            and not self.pad_output
            and self.end_keys is None
            and "static-stop-and-length" not in self._cache
        )

    def _wanted(self, s: LazyStackedTensorDictStore) -> tuple[str, Any] | None:
        if getattr(self, "_traj_key_auto", False):
            return _auto_key(s)
        if self._fetch_traj and self.traj_key is not None:
            return "traj_key", self.traj_key
        return "end_key", self.end_key

    def prepare(self, storage: StoreStorage) -> None:
        """Give the store the episode index this sampler reads (once; a no-op when it has it already)."""

        def setup(s: LazyStackedTensorDictStore) -> None:
            wanted = self._wanted(s)
            if wanted is None or isinstance(s, ShardedRing):
                return
            have = s.trajectories
            by = "id" if wanted[0] == "traj_key" else "end"
            path = (wanted[1],) if isinstance(wanted[1], str) else tuple(wanted[1])
            if have is None or have.by != by or have.key != path:
                s.set_trajectories(**{wanted[0]: wanted[1]})

        storage.with_store(setup)

    def _draw(self, storage: StoreStorage, batch_size: int, ranks: tuple[int, torch.Tensor] | None = None) -> SliceSample | None:
        """The store's slices (None: a sharded ring, which torchrl's own sampling serves)."""

        def draw(s: LazyStackedTensorDictStore) -> SliceSample | None:
            if isinstance(s, ShardedRing):
                return None
            if not has_keys(s):
                raise RuntimeError(EMPTY_ERROR)
            if s.trajectories is None:
                self.prepare(storage)
            try:
                return s.sample_slices(
                    int(batch_size),
                    num_slices=self.num_slices if ranks is None else ranks[1].numel(),  # (a pass's last slices may be fewer)
                    slice_len=self.slice_len if ranks is None else None,
                    strict_length=self.strict_length,
                    span=self.span,
                    generator=self._rng,
                    ranks=ranks,
                )
            except ValueError as err:  # torchrl raises RuntimeError for these
                if "no trajectory" in str(err) or "divisible" in str(err):
                    raise RuntimeError(str(err)) from err
                raise

        got = storage.with_store(draw)
        if got is not None:
            storage.stash(Sample(got.td, got.indices, got.generations))
        return got

    def _info(self, got: SliceSample) -> dict[Any, torch.Tensor]:
        """The flags torchrl's ``SliceSampler`` returns with its index, from the rows already read."""
        td, truncated = got.td, got.info["truncated"]
        info: dict[Any, torch.Tensor] = {}
        if self.truncated_key is not None:
            done_key = _replace_last(self.truncated_key, "done")
            terminated_key = _replace_last(self.truncated_key, "terminated")
            done = td.get(done_key, default=None)
            done = truncated.clone() if done is None else done.reshape(truncated.shape) | truncated
            terminated = td.get(terminated_key, default=None)
            info[self.truncated_key] = truncated
            info[done_key] = done
            info[terminated_key] = torch.zeros_like(truncated) if terminated is None else terminated
        if self.init_key is not None:
            existing = td.get(self.init_key, default=None)
            if existing is not None:
                marker = torch.zeros_like(existing)
                lengths = got.info["slice_lengths"]
                starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])[lengths > 0]
                marker[starts] = True
                info[self.init_key] = marker | existing
        return info


class StoreSliceSampler(SliceSampler, _ServerSlices):
    """torchrl's ``SliceSampler``, sampled on the server (see the module docstring)."""

    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        if not self.served(storage):
            return super().sample(storage, batch_size)
        assert isinstance(storage, StoreStorage)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        got = self._draw(storage, batch_size)
        if got is None:
            return super().sample(storage, batch_size)
        return got.indices, self._info(got)


class StoreSliceSamplerWithoutReplacement(SliceSamplerWithoutReplacement, _ServerSlices):
    """torchrl's ``SliceSamplerWithoutReplacement``, sampled on the server: within a pass every trajectory long
    enough gives one slice. The pass is a permutation of the ranks of those trajectories (longest first) kept in
    this process; the server draws each slice's start and reads the rows in one round trip, and answers with
    the count it holds when it differs from the pass's (a trajectory finished or overwritten): a new pass starts
    (torchrl's sampler starts one when the storage's trajectory count changes), and the call is sent again.
    The last slices of a pass: fewer than ``num_slices`` give a short batch (``drop_last=False``) or start the next pass."""

    _tds_pass: torch.Tensor | None = None
    _tds_at = 0
    _tds_eligible = 1  # until the server says (a pass of one trajectory: it answers with its count)

    def _new_pass(self, eligible: int) -> None:
        self._tds_eligible = max(1, eligible)
        if self.shuffle:
            self._tds_pass = torch.randperm(self._tds_eligible, generator=self._rng)
        else:
            self._tds_pass = torch.arange(self._tds_eligible)
        self._tds_at = 0

    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        if not self.served(storage):
            return super().sample(storage, batch_size)
        assert isinstance(storage, StoreStorage)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        seq, m = self._adjusted_batch_size(batch_size)
        for _ in range(16):
            if self._tds_pass is None:
                self._new_pass(self._tds_eligible)
            assert self._tds_pass is not None
            left = self._tds_pass.numel() - self._tds_at
            if left == 0 or (left < m and self.drop_last):
                self._new_pass(self._tds_eligible)
                left = self._tds_pass.numel()
            k = min(m, left)
            ranks = self._tds_pass[self._tds_at : self._tds_at + k]
            try:
                got = self._draw(storage, k * seq, (self._tds_eligible, ranks))
            except RanksMoved as moved:
                self._new_pass(moved.eligible)
                continue
            if got is None:
                return super().sample(storage, batch_size)
            self._tds_at += k
            return got.indices, self._info(got)
        raise RuntimeError("SliceSamplerWithoutReplacement: the trajectory count changed at each of 16 tries")

    def _empty(self) -> None:
        super()._empty()
        self._tds_pass = None


#: The torchrl classes the server samples for, and what each becomes (exactly these classes: a subclass,
#: such as ``PrioritizedSliceSampler``, keeps its own sampling).
SERVED: dict[type, type] = {SliceSampler: StoreSliceSampler, SliceSamplerWithoutReplacement: StoreSliceSamplerWithoutReplacement}
