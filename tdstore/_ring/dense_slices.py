"""``set_trajectories``, ``trajectories`` and ``sample_slices`` of a dense ``TensorDictStore`` (see ``_ring.slices``):
the hidden lazy store's calls, the rows handed back as one dense TensorDict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tdstore._format.trajectories import Trajectories
from tdstore._ring.dense_methods import dense_rows
from tdstore._ring.slices import SliceSample


class DenseTrajectoryMethods:
    """The same calls on a dense ``TensorDictStore``: its hidden lazy store's, the rows handed back dense."""

    def _ring(self) -> Any:  # DenseRing's: the hidden lazy store
        raise NotImplementedError

    def _writable_ring(self) -> Any:  # DenseRing's
        raise NotImplementedError

    def set_trajectories(self, *, traj_key: Any = None, end_key: Any = None) -> None:
        """As :meth:`LazyStackedTensorDictStore.set_trajectories`."""
        self._writable_ring().set_trajectories(traj_key=traj_key, end_key=end_key)

    @property
    def trajectories(self) -> Trajectories | None:
        """As :attr:`LazyStackedTensorDictStore.trajectories`."""
        return self._ring().trajectories

    def sample_slices(
        self,
        batch_size: int,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        strict_length: bool = True,
        span: Any = False,
        generator: torch.Generator | None = None,
        keys: Sequence[Any] | None = None,
        ranks: tuple[int, torch.Tensor] | None = None,
    ) -> SliceSample:
        """As :meth:`LazyStackedTensorDictStore.sample_slices`, the rows one dense TensorDict of batch size ``[rows, *rest]``."""
        got = self._ring().sample_slices(
            batch_size,
            num_slices=num_slices,
            slice_len=slice_len,
            strict_length=strict_length,
            span=span,
            generator=generator,
            keys=keys,
            ranks=ranks,
        )
        return got._replace(td=dense_rows(got.td))
