"""The torchrl ``Writer`` of :mod:`tdstore.torchrl`: slots reserved on the server, in the call that writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torchrl.data.replay_buffers.writers import Writer

from tdstore.ring_interface import MASK_DTYPES, index_positions, slot_generations
from tdstore.torchrl.storage import StoreStorage


def _torchrl_generations(ring: torch.Tensor, base: int) -> torch.Tensor:
    """torchrl's generations from the ring's (0: never written, else writes received): -1 for a slot
    never written, else ``base`` + writes - 1 (``base`` grows at each ``empty()``)."""
    return torch.where(ring > 0, ring - 1 + base, torch.full_like(ring, -1))


class StoreWriter(Writer):
    """A torchrl ``Writer`` whose slots are reserved on the server, in the call that writes them.

    ``add`` and ``extend`` are one ``store.extend`` each (see :class:`StoreStorage`), so
    writers in any number of processes and machines share one cursor and never write the
    same slot in one lap.  The cursor and write count are read from the server.
    Generations come from the server's write counter too, in torchrl's convention (the
    first write of a slot is generation 0, a never-written slot -1), whatever
    ``track_generations`` says; that flag only makes samples carry ``"index_generation"``.
    """

    def __init__(self, *, track_generations: bool = False) -> None:
        super().__init__()
        self._track_generations = track_generations

    @property
    def tracks_generations(self) -> bool:
        return self._track_generations

    def _ring_storage(self) -> StoreStorage:
        if not isinstance(self._storage, StoreStorage):
            raise TypeError(f"StoreWriter writes a tdstore.torchrl.StoreStorage, got {type(self._storage).__name__}")
        return self._storage

    def add(self, data: Any) -> int:
        storage = self._ring_storage()
        one = data.unsqueeze(0) if hasattr(data, "unsqueeze") else [data]
        index = int(storage.extend_ring(one)[0])
        self._mark_update_entities(index)
        return index if storage.ndim == 1 else self._replicate_index(index)

    def extend(self, data: Any) -> torch.Tensor:
        index = self._replicate_index(self._ring_storage().extend_ring(data))  # (ndim>1: every cell's coordinates)
        self._mark_update_entities(index)
        return index

    def _mark_update_entities(self, index: Any) -> None:
        for ent in self._storage._attached_entities_iter():
            ent.mark_update(index)

    def generations_of(self, index: Any) -> torch.Tensor:
        """Each slot's generation: from the batch a ``StoreSampler`` just drew, else one round trip."""
        storage = self._ring_storage()
        p = storage.stashed(index)
        if p is not None:
            return _torchrl_generations(p.generations, storage.generation_base())
        if isinstance(index, tuple):
            index = index[0]
        if isinstance(index, torch.Tensor) and storage.ndim > 1 and index.ndim > 1 and index.shape[-1] == storage.ndim:
            index = index[..., 0]  # coordinates: the slot is the first
        slots, one = index_positions(index, storage._dim0)  # a mask means what it means to indexing
        m = storage.marks()
        gen = _torchrl_generations(slot_generations(slots, m.rw, storage._dim0), m.gb)
        if one:
            return gen[0]
        if isinstance(index, torch.Tensor) and index.dtype not in MASK_DTYPES:
            return gen.reshape(index.shape)  # positions keep their shape
        return gen

    @property
    def _cursor(self) -> int:
        return self._ring_storage().with_store(lambda s: s.cursor)

    @property
    def _write_count(self) -> int:
        """Rows written since the buffer was made (or emptied with ``empty_write_count=True``), by every process."""
        m = self._ring_storage().marks()
        return m.wb + m.rw

    def _empty(self, empty_write_count: bool = True) -> None:
        """``StoreStorage._empty`` (which torchrl calls next) empties the store, the cursor with it; the
        write count goes on from where it was when ``empty_write_count`` is False."""
        self._ring_storage()._keep_write_count = not empty_write_count

    def dumps(self, path: Any) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: Any) -> None:
        """Nothing to load here: the cursor and write count are the server's.

        ``ReplayBuffer.loads`` loads the storage first, and ``StoreStorage.loads`` has already given the ring
        the cursor and write count a torchrl writer saved in ``path`` (``metadata.json``, beside ``storage/``),
        in the call that restored the ring (:mod:`tdstore.torchrl.dumps_loads`); a tdstore checkpoint's ring
        state is in the storage's checkpoint itself."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the cursor and write count are the server's."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(track_generations={self._track_generations})"
