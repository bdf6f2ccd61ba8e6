"""The ring-buffer, replay-buffer and queue methods of a lazy store.

The ring (``extend``, ``append``, ``sample``, ``update_if`` and the ring's state), server-side
priorities, the rate limiter, the queue and waiting: a mixin of ``LazyStackedTensorDictStore``
whose work is done in ``_ring.extend`` (writes), ``_ring.sample_pop`` (samples, pops), ``_ring.policy_calls`` and ``_ring.waiting``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from tdstore._engine.engine import Engine
from tdstore._errors import MustWait
from tdstore._format import ragged as _ragged
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._front.common import LOCK_ERROR
from tdstore._front.state import LazyState
from tdstore._inspect import stats as _stats
from tdstore._plan.values import as_path
from tdstore._ring import extend as _ring
from tdstore._ring import leases as _leases
from tdstore._ring import marks as _marks
from tdstore._ring import policy_calls as _sampling
from tdstore._ring import sample_pop as _ring_reads
from tdstore._ring import waiting as _waiting
from tdstore._ring.args import check_request_id, refuse_spread
from tdstore._ring.policy_calls import PrioritizedSample


def pops_a_key(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``pop(*args, **kwargs)`` is TensorDict's ``pop(key[, default])`` (a key, str or tuple, first)
    rather than the queue's ``pop(batch_size, ...)``: one rule for every store's ``pop``."""
    return bool(args and isinstance(args[0], (str, tuple))) or "key" in kwargs or "default" in kwargs


class ReplayMethods(LazyState):
    """The shared ring buffer, and server-side priorities, rate limiting and queues, shared by every handle on the store."""

    def extend(self, td: Any, *, priority: Any = None, timeout: float | None = None, request_id: str | None = None) -> _ring.RingWrite:
        """Write the elements of ``td`` into the next slots of the ring, atomically, in one call.

        The store's ``count`` is the ring's capacity.  The server reserves the slots
        at its cursor (wrapping around), writes every key of every element, and
        advances the cursor, in one script call: processes on any number of
        machines may ``extend`` the same store at once, and no slot is written
        twice in one lap.  ``td`` has the store's batch size with the element dim
        (of 1 to ``count`` elements) at the stack dim, and every key of the store;
        a key the store does not have yet is created for every element (the other slots
        hold zeros), as ``store[i] = td`` does, and on a store without keys the first
        ``extend`` creates them all.  Elements may differ in shape (heterogeneous keys).

        ``td`` may also be a list or tuple of element tensordicts (stacked lazily, so
        their shapes may differ) or a tensorclass batch. Returns the slots written and
        their new generations (:class:`RingWrite`).

        On a store with priorities (:meth:`enable_priorities`), ``priority`` (one number, or
        one per element) is each new slot's priority, set in the same atomic call; by
        default, the largest priority given so far. When the store's rate limiter or queue
        mode holds inserts back, ``extend`` waits (``timeout`` seconds at most, then
        ``TimeoutError``; ``None``: as long as it takes) and nothing is written meanwhile.

        A ``timeout`` that passes after the write was sent raises ``tdstore.AmbiguousTimeoutError``
        (the rows may be written): its ``retry()``, or ``extend`` of the same rows with
        ``request_id=err.request_id``, writes them once and returns where they went.
        """
        if isinstance(td, (list, tuple)):
            if not td:
                raise ValueError("extend got an empty list: nothing to write")
            elements = [
                e.to_tensordict() if is_tensorclass(e) else TensorDict(e, batch_size=self._inner_batch_size) if isinstance(e, dict) else e
                for e in td
            ]
            bad = [type(e).__name__ for e in elements if not isinstance(e, TensorDictBase)]
            if bad:
                raise TypeError(f"extend got a list holding {bad[0]}; it takes a list of TensorDicts (one per element)")
            td = lazy_stack(elements, dim=self._engine.header.stack_pos)
        elif is_tensorclass(td):
            td = td.to_tensordict()
        if isinstance(td, TensorDictBase) and tuple(td.batch_size) == tuple(self._inner_batch_size):
            raise ValueError(
                f"extend got one element (batch size {list(td.batch_size)}); use append for one element, or give extend a batch "
                f"with the element dim at {self._engine.header.stack_pos}"
            )
        return _ring.extend(self._writable_engine(), td, priority, timeout, check_request_id(request_id))

    def append(self, td: Any, *, priority: Any = None, timeout: float | None = None, request_id: str | None = None) -> _ring.RingWrite:
        """``extend`` with one element (a tensordict of the inner batch size)."""
        if isinstance(td, dict):
            td = TensorDict(td, batch_size=self._inner_batch_size)
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"append expects a TensorDict or a dict, got {type(td).__name__}")
        if tuple(td.batch_size) != tuple(self._inner_batch_size):
            raise ValueError(
                f"append expects one element of batch size {list(self._inner_batch_size)}, got {list(td.batch_size)}; "
                "use extend for batches"
            )
        return self.extend(td.unsqueeze(self._engine.header.stack_pos), priority=priority, timeout=timeout, request_id=request_id)

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
        **ragged: Any,
    ) -> _ring.Sample | PrioritizedSample:
        """A uniform random batch of written slots (with replacement), in one round trip.

        Only slots the ring has written are drawn (``store.written``).  The random
        numbers come from ``generator`` (``torch.Generator``; the global one by
        default), so a seeded generator draws the same batch from the same ring.
        Returns ``Sample(td, indices, generations)``: ``td`` is a TensorDict, or a
        lazy stack when keys are heterogeneous; keep the generations to write back
        with :meth:`update_if`.  Raises ``ValueError`` when nothing was written yet, unless given
        ``timeout=`` or ``min_size=``: then it waits for a first item (``TimeoutError`` when none comes).

        ``keys`` reads only those keys (nested keys take every leaf below them).
        ``as_padded_tensor=True`` (with ``padding_side``, ``padding_value``) or
        ``as_nested_tensor=True`` make each heterogeneous key one padded or jagged tensor of
        the batch, as ``get`` does, so ``td`` is a TensorDict (token sequences padded for a
        learner, built without a tensor per row).

        On a store with priorities (:meth:`enable_priorities`) the draw follows them
        (``prioritized=False`` draws uniformly): each row is drawn on the server, in
        O(log capacity), and the result is ``PrioritizedSample(td, indices, generations,
        weights, probabilities)`` with importance weights ``(P(i) / min_j P(j)) ** -beta``
        (``alpha``, if given, must be the store's). ``min_size`` waits until the ring holds that
        many items, as the store's rate limiter (:meth:`set_rate_limit`) does; a waiting
        sample blocks without polling, ``timeout`` seconds at most (``TimeoutError``;
        ``None``: as long as it takes).
        """
        if ragged and not _ragged.wanted(ragged):
            raise TypeError(
                f"sample takes as_padded_tensor=True or as_nested_tensor=True (with {sorted(_ragged.KEYWORDS)}), got {sorted(ragged)}"
            )
        if isinstance(keys, (str, tuple)):
            keys = [keys]  # one key (a tuple is one nested key, as in TensorDict.select)
        return _ring_reads.sample(
            self._engine,
            batch_size,
            generator,
            self._device,
            ragged or None,
            None if keys is None else [as_path(k) for k in keys],
            prioritized=prioritized,
            alpha=alpha,
            beta=beta,
            min_size=min_size,
            timeout=timeout,
        )

    @property
    def capacity(self) -> int:
        """The ring's capacity: the store's element count (``len(store.written)`` is how many it holds)."""
        return self._count

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        """Write ``td`` at slots ``index`` only where the slot's generation still equals ``generation``.

        A learner that sampled a batch writes back (new priorities, say) without
        clobbering slots an actor has overwritten since: rows whose slot was
        rewritten by a later ``extend`` are skipped.  One atomic call; every row is
        checked (keys, dtypes, shapes) before anything is written.  ``td`` may hold
        a subset of the store's keys.  Returns a bool tensor: which rows were applied.
        ``index`` means what it means to ``store[index]`` (a bool or uint8 mask included).
        """
        return _ring.update_if(self._writable_engine(), index, generation, td)

    def ring_state(self) -> _ring.RingState:
        """``(write_count, cursor, written)`` of the ring, read from the server in one round trip."""
        return _ring.state(self._engine.ring_writes(), self._count)

    def stats(self) -> dict[str, Any]:
        """The ring's counters and state, read in one round trip (see ``tdstore.Ring.stats``; the keys are
        documented in ``tdstore._inspect.stats``)."""
        engine = self._engine
        refuse_spread(engine)
        try:
            return _stats.read(engine.client, engine.keys, cluster=engine.spec.cluster)
        except KeyError:
            raise engine.gone() from None

    @property
    def written(self) -> range:
        """The slots the ring has written so far (``range(n)``; ``len(store.written)`` is n), read from the server."""
        return range(self.ring_state().written)

    @property
    def cursor(self) -> int:
        """The slot the next ``extend`` writes first, read from the server."""
        return self.ring_state().cursor

    @property
    def write_count(self) -> int:
        """How many elements ``extend``/``append`` have written in total (all laps), read from the server."""
        return self._engine.ring_writes()

    def _writable_engine(self) -> Engine:
        """The engine, for a ring write; a locked store refuses only the first one, which creates keys."""
        if self.is_locked and not self._engine.header.leaves:
            raise RuntimeError(LOCK_ERROR)
        return self._engine

    @property
    def sampling_policy(self) -> SamplingPolicy:
        """The ring's sampling policy as the server holds it (read again from the server)."""
        return _sampling.policy_of(self._engine, fresh=True)

    def marks(self) -> _marks.Marks:
        """The ring write count and an adapter's counters, in one round trip (see ``tdstore.Ring.marks``)."""
        return _marks.read(self._engine)

    def set_marks_base(self, generation_base: int, write_base: int) -> None:
        """Set the ``gb``/``wb`` bases of :meth:`marks`, in one atomic call (see ``tdstore.Ring``)."""
        _marks.set_base(self._engine, generation_base, write_base)

    @contextmanager
    def counting_in_place(self) -> Iterator[None]:
        """Within: this thread's writes of the store also add 1 to ``marks().tr``, in the same atomic call."""
        with self._engine.counting_in_place():
            yield

    def sampling_policies(self) -> list[SamplingPolicy]:
        """The policy of each ring that holds one (here one), read again from the server (see ``tdstore.Ring``)."""
        return [self.sampling_policy]

    def restore_sampling_policies(self, policies: Sequence[SamplingPolicy]) -> None:
        """Give the ring the policies ``sampling_policies()`` of another store of its kind and size returned."""
        if len(policies) != 1:
            raise ValueError(f"a one-node ring holds one sampling policy, got {len(policies)}")
        _sampling.restore_policy(self._engine, policies[0])

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
        """Set the priority of slots ``index``, in one atomic call. ``index`` means what it means
        to ``store[index]`` (``_plan.index.positions``): ints, lists, ranges, slices, int tensors and
        arrays are slots; bool and uint8 tensors, lists and arrays are masks over the slots.

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
        so it may overshoot the buffer by itself, and the two sides never block each other. Waiting
        calls block without polling; their ``timeout=`` raises ``TimeoutError``. ``error_buffer``
        must be at least ``max(1, samples_per_insert)``.
        """
        _sampling.set_rate_limit(self._engine, min_size, samples_per_insert, error_buffer)

    def clear_rate_limit(self) -> None:
        """Remove the rate limiter (waiting calls go on at their next try)."""
        _sampling.clear_rate_limit(self._engine)

    def set_queue(self, on: bool = True) -> None:
        """Queue mode: an ``extend`` that would overwrite items no one has popped waits instead
        (``timeout=`` raises ``TimeoutError``), so ``pop`` loses nothing (Reverb's ``Queue``)."""
        _sampling.set_queue(self._engine, on)

    def track_distinct(self, on: bool = True) -> None:
        """Count distinct rows sampled (``stats()``' ``distinct_sampled``), off by default: see ``tdstore.Ring``."""
        _sampling.track_distinct(self._engine, on)

    def pop(self, *args: Any, **kwargs: Any) -> Any:
        """``pop(batch_size=1, *, timeout=None, keys=None, lease=None)``: the queue's next items (see :meth:`pop_items`);
        ``pop(key[, default])``, a key (str or tuple) first: TensorDict's, which removes a key and returns it."""
        if pops_a_key(args, kwargs):
            return super().pop(*args, **kwargs)  # TensorDictBase.pop, further along the MRO
        return self.pop_items(*args, **kwargs)

    def pop_items(
        self,
        batch_size: int = 1,
        *,
        timeout: float | None = None,
        keys: Sequence[Any] | None = None,
        lease: float | None = None,
        request_id: str | None = None,
        _request: str | None = None,
    ) -> _ring.Sample | _leases.LeasedSample:
        """The next unread items in write order (up to ``batch_size``), each handed to exactly one caller.

        Any number of readers may ``pop`` the same ring: the server moves one read cursor.
        Waits for an item when none is unread (``timeout=None``: as long as it takes; after
        ``timeout`` seconds, ``TimeoutError``). When writers overwrote unread items (a ring
        not in queue mode), raises ``QueueOverrunError`` with ``.lost``, and the next ``pop``
        goes on with the oldest item left. Returns ``Sample(td, indices, generations)``.
        Without a lease the items are gone from the queue once popped: a reader that dies
        before using them loses them (at most once).

        ``lease=S`` (seconds): the items are leased to this caller until ``ack`` (or
        ``with store.pop(n, lease=S) as got:``), returned as a ``LeasedSample`` (write numbers,
        delivery counts, ``redelivered``, ``receipt``). Items not acknowledged within ``S``
        seconds of the server's clock go to the next pop again (leased or not), before newer
        items, in write order. In queue mode, leased items count as unread until acknowledged.

        A ``timeout`` that passes after the pop was sent raises ``tdstore.AmbiguousTimeoutError`` (the
        items may be taken): its ``retry()``, or ``pop`` with ``request_id=err.request_id``, returns the
        items that pop took (or takes them now if it never ran), never other items: items overwritten
        since raise ``QueueOverrunError``. ``_request`` (a sharded ring's, see ``_shards.queue``): the same.
        """
        if isinstance(keys, (str, tuple)):
            keys = [keys]
        paths = None if keys is None else [as_path(k) for k in keys]
        request = check_request_id(request_id) or _request
        if lease is not None:
            return _leases.pop(self._engine, self, batch_size, self._device, timeout, paths, lease, request)
        return _ring_reads.pop(self._engine, batch_size, self._device, timeout, paths, request)

    def ack(self, receipt: Any, *, timeout: float | None = None) -> int:
        """Settle the items of a leased pop (its ``receipt``, or the ``LeasedSample``), in one call.

        Returns how many items it settled. Acknowledging twice is harmless (the same answer).
        An ack after the lease ran out still settles the items no other pop has taken; when
        another pop took some, raises ``tdstore.LeaseLostError`` naming them (``.not_held``,
        their write numbers), after settling the rest. A receipt the store does not hold (never
        handed out, or settled more than 4,096 receipts ago) raises ``ValueError``. ``timeout`` is a
        deadline as for every ring call (``TimeoutError``); ``with store.pop(n, lease=S, timeout=T)``
        acks within ``T``.
        """
        return _leases.ack(self._engine, receipt, timeout)

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
