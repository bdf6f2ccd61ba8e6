"""The replay-buffer and queue methods of a lazy store: priorities, rate limiter, queue, waiting.

A mixin of ``LazyStackedTensorDictStore`` (it uses the store's ``_engine``, ``_count``
and ``_device``); the work is done in ``_sampling``, ``_ring`` and ``_waiting``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _ring, _sampling, _waiting
from ._engine import Engine
from ._errors import MustWait
from ._policy import SamplingPolicy
from ._values import as_path


class ReplayMethods:
    """Server-side priorities, rate limiting and queues, shared by every handle on the store."""

    _engine: Engine
    _count: int
    _device: torch.device | None

    @property
    def sampling_policy(self) -> SamplingPolicy:
        """The ring's sampling policy as the server holds it (read again from the server)."""
        return _sampling.policy_of(self._engine, fresh=True)

    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        """Keep a priority per slot on the server and sample by it (``sample(prioritized=True)``).

        A slot is drawn with probability ``p_i ** alpha / sum_j p_j ** alpha`` (``alpha=0``:
        uniformly among the slots with a positive priority). Slots written so far get priority
        1; ``extend(td, priority=...)`` gives new slots theirs in the same atomic call (without
        it, the largest priority given so far, as torchrl's ``PrioritizedSampler`` does), and
        ``update_priority`` changes them. ``max_times_sampled`` retires a slot (weight 0) once
        it has been drawn that many times, until it is written again (Reverb's
        ``max_times_sampled``). The tree takes about ``9 * capacity`` bytes on the server.
        Calling it again with the same values does nothing; other values raise ``ValueError``.
        """
        _sampling.enable_priorities(self._engine, alpha, max_times_sampled)

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        """Set the priority of slots ``index`` (an int, list or tensor), in one atomic call.

        ``priority`` is one number or one per slot (finite, >= 0; 0 is never drawn). With
        ``generation`` (from ``sample``), a slot is updated only if it still holds that
        generation: a learner's late update never lands on data an actor wrote since. Slots
        never written or retired keep theirs. Returns a bool tensor: which slots were updated.
        """
        return _sampling.update_priority(self._engine, index, priority, generation)

    def set_rate_limit(self, *, min_size: int = 1, samples_per_insert: float | None = None, error_buffer: float | None = None) -> None:
        """Limit sampling and inserting on the server, for every process at once (Reverb's rate limiters).

        ``min_size`` alone: ``sample`` waits until the ring holds that many items (``MinSize``).
        With ``samples_per_insert`` and ``error_buffer`` (``SampleToInsertRatio``): samples (each
        row counts) and inserts (``extend`` rows, counted from now) keep the ratio within the
        buffer: a sample that would run ahead waits for inserts, an ``extend`` that would run
        ahead waits for samples. A batch goes when its first row may (Reverb counts row by row),
        so it may overshoot the buffer by itself, and the two sides never block each other. Waiting calls block without polling; their ``timeout=`` raises
        ``TimeoutError``. ``error_buffer`` must be at least ``max(1, samples_per_insert)``.
        """
        _sampling.set_rate_limit(self._engine, min_size, samples_per_insert, error_buffer)

    def clear_rate_limit(self) -> None:
        """Remove the rate limiter (waiting calls go on at their next try)."""
        _sampling.clear_rate_limit(self._engine)

    def set_queue(self, on: bool = True) -> None:
        """Queue mode: an ``extend`` that would overwrite items no one has popped waits instead
        (``timeout=`` raises ``TimeoutError``), so ``pop`` loses nothing (Reverb's ``Queue``)."""
        _sampling.set_queue(self._engine, on)

    def pop(self, *args: Any, **kwargs: Any) -> Any:
        """``pop(batch_size=1, *, timeout=None, keys=None)``: the queue's next items (see :meth:`pop_items`);
        ``pop(key[, default])``, a key (str or tuple) first: TensorDict's, which removes a key and returns it."""
        if (args and isinstance(args[0], (str, tuple))) or "key" in kwargs or "default" in kwargs:
            return super().pop(*args, **kwargs)  # type: ignore[misc]  # TensorDictBase.pop, further along the MRO
        return self.pop_items(*args, **kwargs)

    def pop_items(self, batch_size: int = 1, *, timeout: float | None = None, keys: Sequence[Any] | None = None) -> _ring.Sample:
        """The next unread items in write order (up to ``batch_size``), each handed to exactly one caller.

        Any number of readers may ``pop`` the same ring: the server moves one read cursor.
        Waits for an item when none is unread (``timeout=None``: as long as it takes; after
        ``timeout`` seconds, ``TimeoutError``). When writers overwrote unread items (a ring
        not in queue mode), raises ``QueueOverrunError`` with ``.lost``, and the next ``pop``
        goes on with the oldest item left. Returns ``Sample(td, indices, generations)``.
        """
        if isinstance(keys, (str, tuple)):
            keys = [keys]
        return _ring.pop(self._engine, batch_size, self._device, timeout, None if keys is None else [as_path(k) for k in keys])

    def wait_for(self, *, written: int | None = None, write_count: int | None = None, timeout: float | None = None) -> _ring.RingState:
        """Block until the ring holds ``written`` items (``len(store.written)``) or has had ``write_count``
        ring writes, without polling (the writers' scripts publish on the store's channel).

        Returns the ring's state; ``TimeoutError`` after ``timeout`` seconds (``None``: no limit).
        """
        if (written is None) == (write_count is None):
            raise TypeError("wait_for takes exactly one of written= or write_count=")
        want = written if written is not None else write_count
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise ValueError(f"wait_for needs an int >= 0, got {want!r}")
        if written is not None and written > self._count:
            raise ValueError(f"a ring of {self._count} slots never holds {written} items")
        engine = self._engine

        def attempt() -> _ring.RingState:
            st = _ring.state(engine.ring_writes(), self._count)
            have = st.written if written is not None else st.write_count
            if have < want:
                raise MustWait("size", f"the ring has {have} of the {want} {'items' if written is not None else 'ring writes'} asked for")
            return st

        return _waiting.until_ready(engine, attempt, timeout, "wait_for")
