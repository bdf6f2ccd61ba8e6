"""``tdstore.Ring``: what a ring buffer of tdstore is, stated once for every kind of store that has one.

Three kinds of handle have the ring's calls, and each is a ``Ring`` (``isinstance(x, tdstore.Ring)``):

- **lazy**: a ``LazyStackedTensorDictStore`` of ``count`` elements on one server (or one hash slot of a
  cluster). Its ring is ``_ring.lazy_methods``: the calls of ``_ring.ring_calls`` (each written once for
  the lazy and dense kinds, with this protocol's docstring) on ``_ring.one_node`` (the work: ``_ring.extend``,
  ``_ring.sample_pop``, ``_ring.policy_calls``, ``_ring.leases``, ``_ring.waiting``).
- **dense**: a ``TensorDictStore(batch_size=[count, *rest])``: the lazy ring of the stack it is kept as
  (``_ring.dense_methods``: the same calls and work), so every call behaves as the lazy one's, with three
  differences: ``sample`` takes no ``as_padded_tensor``/``as_nested_tensor`` (nothing is ragged), batches come
  back as one dense ``TensorDict`` of batch size ``[n, *rest]``, and a row of another shape than its key's
  raises ``DenseShapeError`` before anything is written (a lazy ring makes the key heterogeneous).
- **sharded**: a ``tdstore.ShardedRing`` (``ShardedRing(count=N, url="redis+cluster://...")``, opened by id
  with ``ShardedRing.from_store(td_id=...)``; not to be confused with a lazy store's *spread* store, below):
  ``K`` lazy rings (*shards*) on distinct primaries of a Redis Cluster, one global slot
  numbering (``_shards``). A call on one shard is that shard's one-node call; a call over several shards
  is sent to them at once and is atomic per shard, not as a whole. Where its contract differs, the method
  says so under "Sharded".

Every call below is, on one node, one atomic round trip (a Lua script, or MULTI/EXEC for reads), checks
its arguments before anything is sent (a clear ``TypeError``/``ValueError`` naming what is wrong; the
store is left as it was), and is safe to resend: a call carries a request id, and the server answers a
resend with the first call's reply (the last 4,096 ids per store are remembered), so nothing is
written, counted or popped twice. Every ``timeout=`` is a deadline for the whole call (``None``: wait as
long as it takes): a call held back (rate limiter, queue mode, nothing to pop) waits without polling on
one node (the store's event channel), polls its shards on a sharded ring, and raises ``TimeoutError``
when the deadline passes, having done nothing. A deadline that passes after the call may have reached
the server raises ``tdstore.AmbiguousTimeoutError`` (a ``TimeoutError``) instead: the call may have run;
its ``retry()`` resends it under its ``request_id`` and gets its one effect.

``isinstance(x, Ring)`` looks the ring's calls up on ``x``'s class, statically (as Python 3.12 does for
every runtime-checkable protocol): it sends nothing and never runs a property. It says that ``x`` has
the calls, not that its store can serve them: every ``LazyStackedTensorDictStore`` is a ring (``count``
is required; an uploaded store, or one written by index and never extended, is a full ring), but a
*spread* store (segments over a cluster's nodes: ``spread="segments"``, or the older ``spread=True, shards=0``) raises
``NotImplementedError`` on ring calls, and a dense store of batch size ``[]`` (no rows) or a handle on
a sub-tree raises ``TypeError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, _ProtocolMeta, runtime_checkable

# What the ring's calls answer and take, public here so that adapters (``tdstore.torchrl``) name them
# without importing private modules (and the classes' ``__module__`` is this module's: pickles name them
# here, so moving the code that defines them breaks no pickle); and the two rules an adapter must apply as the ring does: which
# slots an index names (``index_positions``: a bool/uint8 mask means what it means to ``store[mask]``)
# and which generation a slot holds after ``write_count`` ring writes (``slot_generations``).
from tdstore._format.sampling_policy import RateLimit, SamplingPolicy
from tdstore._format.trajectories import Trajectories
from tdstore._plan.index import MASK_DTYPES
from tdstore._plan.index import positions as index_positions
from tdstore._plan.ring_plan import RingState, RingWrite, Sample, check_batch_size
from tdstore._plan.ring_plan import generations as slot_generations
from tdstore._ring.leases import LeasedSample, Receipt
from tdstore._ring.marks import Marks
from tdstore._ring.policy_calls import PrioritizedSample, priority_tensor
from tdstore._ring.ring_calls import CALLS, RingCalls
from tdstore._ring.rollouts import RolloutSample
from tdstore._ring.slices import RanksMoved, SliceSample

if TYPE_CHECKING:
    import torch

__all__ = [
    "Ring",
    "RingState",
    "RingWrite",
    "Sample",
    "PrioritizedSample",
    "LeasedSample",
    "Receipt",
    "RolloutSample",
    "Marks",
    "SamplingPolicy",
    "RateLimit",
    "SliceSample",
    "RanksMoved",
    "Trajectories",
    "MASK_DTYPES",
    "index_positions",
    "slot_generations",
    "check_batch_size",
    "priority_tensor",
]

_MISSING = object()


class _StaticProtocolMeta(_ProtocolMeta):
    """``isinstance`` against a protocol by a static look-up of its members on the instance's class.

    Python 3.11's check runs ``hasattr`` on the instance, which evaluates properties: ``written`` and
    ``cursor`` are round trips to the server (a fan-out on a sharded ring), and a dense store of batch
    size ``[]`` raises ``TypeError`` from them. Python 3.12 looks members up with
    ``inspect.getattr_static``; this does the same on 3.11, so the answer is the same on both.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        if not cls.__dict__.get("_is_protocol", False):
            return super().__instancecheck__(instance)  # a class that subclasses the protocol explicitly
        names = {
            name
            for base in cls.__mro__
            if base.__dict__.get("_is_protocol", False) and base.__name__ not in ("Protocol", "Generic")
            for name in vars(base)
            if not name.startswith("_")
        }
        return all(inspect.getattr_static(instance, name, _MISSING) is not _MISSING for name in names)


@runtime_checkable
class Ring(Protocol, metaclass=_StaticProtocolMeta):
    """A shared ring buffer of ``capacity`` slots whose cursor, counts, generations, priorities, rate
    limiter and read cursor live on the server: actors and learners in any number of processes and
    machines share one buffer (Reverb's tables, without TensorFlow).

    The store's ``count`` (a dense store's first dim) is the capacity. ``extend`` writes at the cursor,
    wrapping around: a buffer of ``count`` holds ``count`` items before the oldest is overwritten. Each
    slot has a *generation*: how many times the ring has written it (0: never), returned by ``extend``,
    ``sample`` and ``pop``, and checked by ``update_if`` and ``update_priority(generation=...)`` so that a
    learner's late write never lands on data an actor wrote since. Slots are indexed as ``store[index]``
    (ints, slices, lists, int tensors, bool/uint8 masks). See the module docstring for the three kinds
    (lazy, dense, sharded), the round trips, request ids, deadlines and what ``isinstance`` checks.
    """

    # -- writes ----------------------------------------------------------------------------------
    def extend(
        self,
        td: Any,
        *,
        priority: Any = None,
        timeout: float | None = None,
        version: int | None = None,
        max_ahead: int | None = None,
        group: Any = None,
        group_size: int | None = None,
    ) -> RingWrite:
        """Write the elements of ``td`` into the next slots of the ring, at the cursor, wrapping around.

        Arguments: ``td`` has the store's batch size with the element dim (1 to ``capacity`` elements)
        at the stack dim, and every key of the store; a lazy or sharded ring also takes a list or tuple of
        element tensordicts (stacked lazily, so shapes may differ) or a tensorclass batch. A key the
        store lacks is created for every slot (zeros elsewhere), as ``store[i] = td`` does. ``priority``
        (one number, or one per element): on a ring with priorities, each new slot's priority, set in
        the same call (default: the largest given so far). ``timeout``: how long the call may wait while
        the rate limiter or queue mode holds inserts back.

        Returns ``RingWrite(indices, generations)``: the slots written and their new generations.

        Errors: ``ValueError``/``TypeError`` for a batch of the wrong size, type or dtype (one element:
        use ``append``); ``DenseShapeError`` on a dense ring for a row of another shape than its key's;
        ``TimeoutError`` when held back past the deadline (nothing written); ``MemoryError`` when the
        rows would take a ``noeviction`` server past its ``maxmemory`` (nothing written);
        ``AmbiguousTimeoutError`` when the deadline passed after the call may have run.

        Round trips: one on one node (the server reserves the slots, writes every key of every element
        and moves the cursor in one script: no slot is written twice in one lap, any number of writers
        at once). ``request_id``: each call is sent under a request id of its own, with every attempt, so a
        resend after a lost reply writes once and gets the first reply; ``AmbiguousTimeoutError.retry()``
        resends under the same id (a ``request_id=`` keyword, where a store takes one, names the id).

        Sharded: the ring holds ``capacity`` rows before one is overwritten, whatever the extend sizes: the
        shards fill in laps (none starts its next lap, overwriting its oldest row, before every shard has
        ended the current one). The batch goes whole to one shard whose lap has room for it (the shards
        taken in turn by each handle, from a random start; under a rate limiter or queue mode, the least
        filled shard that admits it); else it is cut, each shard taking what its lap has room for (then
        the next lap), one part per shard, the parts sent at once, each atomic on its shard: a reader may
        see some parts before the others (a sample or pop between them finds the first parts' rows and not
        yet the rest), never half a row; ``indices`` come back in the batch's order. A handle places rows
        by the shards' write counts it read (at its first extend, then from each reply; once it sees
        another handle's rows, before each extend: one more round trip), so concurrent writers may take
        a shard past its lap by the rows in flight. A timed-out extend cut over shards raises
        ``AmbiguousTimeoutError`` whose ``retry()`` resends only the parts that may not have run, each under
        its own request id, and answers for the whole call.

        Rollouts (LLM-RL; ``_ring.rollouts``, ``lua/_rollouts.lua``): ``version=v`` stamps the rows with the
        policy version that made them (default: the published one, see ``set_version``); ``max_ahead=k``
        holds the write (a wait, as the rate limiter's) while ``v`` runs more than ``k`` versions ahead of
        the published one. ``group=g, group_size=n``: the rows join group ``g`` (a str or int id, unique
        among the ring's live groups), invisible to ``sample`` and ``pop`` until it holds ``n`` rows,
        written by any processes in any calls; the call that completes it makes all ``n`` visible at
        once. ``ValueError`` before anything is written for a group of another size, one that would
        overflow, or a bad id. The first such write (or ``set_version``) turns the ring's rollout index
        on: from then on every write stamps its rows and samples and pops go through it. Not with queue
        mode, a rate limiter or priorities (``NotImplementedError``). Sharded: ``NotImplementedError``.
        """
        ...

    def append(
        self,
        td: Any,
        *,
        priority: Any = None,
        timeout: float | None = None,
        version: int | None = None,
        max_ahead: int | None = None,
        group: Any = None,
        group_size: int | None = None,
    ) -> RingWrite:
        """``extend`` with one element (a tensordict, or a dict, of the inner batch size): the same
        result, errors, round trip, ``request_id``, resend and rollout arguments as ``extend``."""
        ...

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        """Write ``td`` (any subset of the store's keys) at slots ``index`` only where a slot still holds
        ``generation`` (from ``sample`` or ``pop``): rows whose slot a later ``extend`` rewrote are
        skipped. Every row is checked (keys, dtypes, shapes) before anything is written.

        Returns a bool tensor: which rows were applied. One atomic round trip on one node, safe to
        resend. Sharded: one call per shard touched, sent at once, each atomic on its shard.
        """
        ...

    # -- reads -----------------------------------------------------------------------------------
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
        max_staleness: int | None = None,
        groups: int | None = None,
    ) -> Sample | PrioritizedSample | RolloutSample:
        """A random batch of ``batch_size`` written slots, drawn with replacement.

        Arguments: ``generator`` (a ``torch.Generator``; the global one by default) makes the draw
        reproducible on the same ring. ``keys`` reads only those keys (a nested key takes every leaf
        below it). ``prioritized=False`` draws uniformly on a ring with priorities; ``alpha``, if given,
        must be the store's; ``beta`` is the importance weights' exponent. ``min_size`` waits until the
        ring holds that many items. The lazy and sharded rings also take ``as_padded_tensor=True``
        (``padding_side``, ``padding_value``, ``return_mask``) or ``as_nested_tensor=True``: each
        heterogeneous key as one tensor of the batch.

        Returns ``Sample(td, indices, generations)`` (a lazy stack when keys are heterogeneous; a dense
        ring's is one ``TensorDict`` of batch size ``[batch_size, *rest]``); on a ring with priorities
        ``PrioritizedSample(td, indices, generations, weights, probabilities)``: row ``i`` is drawn with
        probability ``P(i) = p_i ** alpha / sum_j p_j ** alpha`` (on the server, O(log capacity) per
        row), with weight ``(P(i) / min_j P(j)) ** -beta``.

        Errors: ``ValueError`` when nothing is written yet (or no slot has a positive priority), unless
        given ``timeout=`` or ``min_size=``: then it waits for data, and ``TimeoutError`` after the
        deadline. The rate limiter holds a sample that would run ahead of the inserts (``TimeoutError``
        at the deadline). One round trip on one node.

        Sharded: exactly the one-node distribution over the whole ring (the batch split over the shards
        by one multinomial draw on their sizes or priority masses, each shard sampling its part at
        once); two round trips at most; ``indices`` are global slots.

        Rollouts: on a ring whose rollout index is on (see ``extend``), rows of incomplete groups are never
        drawn; ``max_staleness=k`` draws uniformly among visible rows of version >= published - ``k``
        (exact: O(log capacity) a row, by rank in a sorted set on the server); ``groups=g`` draws ``g``
        whole groups (``batch_size`` ignored). Returns ``RolloutSample(td, indices, generations, versions,
        group_sizes, stale, lost)``. None qualifies: ``ValueError``, or with ``timeout=`` a wait for a
        write or ``set_version``. Uniform only (``prioritized``/``min_size``: ``NotImplementedError``).
        """
        ...

    def sample_seen(self, batch_size: int, generator: torch.Generator | None = None) -> Sample:
        """A uniform batch of ``batch_size`` slots (with replacement) among those this handle has seen written:
        what a learner sampling all the time wants (torchrl's ``StoreSampler``), at less server time than ``sample``.

        On one node the slots are drawn on the client below the written length this handle last saw, and read
        with the ring's write count in one transaction of plain reads (no script); rows written since it last
        looked are drawn from the next call on (the first call reads the length first: two round trips).
        Written slots stay written, so every row drawn is a written one; the write count read with the rows
        proves it. Where that cannot serve (heterogeneous keys, a sampling policy, a server refusing
        transactions, a draw beyond the count: the store was made again), and on a sharded ring, this is
        ``sample(batch_size, generator, prioritized=False)``. Returns ``Sample(td, indices, generations)``
        (a dense ring's ``td`` is one ``TensorDict``); errors as ``sample``'s."""
        ...

    def filled(self, *, fresh: bool = False) -> int:
        """How many items the ring holds (``len(ring.written)``): once this handle has seen the ring full, its
        capacity with no round trip (a ring's write count only grows; a store made again is another ring,
        whose calls find it); else, or with ``fresh=True``, read from the server (one round trip; sharded: the
        shards not seen full, at once)."""
        ...

    def pop(
        self, batch_size: int = 1, *, timeout: float | None = None, keys: Sequence[Any] | None = None, lease: float | None = None
    ) -> Any:
        """The next unread items, in write order, each handed to exactly one caller (a queue); see
        ``pop_items``, which this is. ``pop(key[, default])`` with a key (a ``str`` or tuple) first is
        TensorDict's ``pop`` instead (removes a key; not on a sharded ring). ``request_id``: a resent pop
        gets the items the first one took, and ``AmbiguousTimeoutError.retry()`` resends it."""
        ...

    def pop_items(
        self,
        batch_size: int = 1,
        *,
        timeout: float | None = None,
        keys: Sequence[Any] | None = None,
        lease: float | None = None,
        max_staleness: int | None = None,
        groups: int | None = None,
        token_budget: int | None = None,
        length_key: Any = None,
    ) -> Sample | LeasedSample | RolloutSample:
        """Up to ``batch_size`` unread items, in write order, each handed to exactly one caller.

        Any number of readers pop the same ring (the server moves one read cursor). With none unread,
        waits (``timeout``: then ``TimeoutError``, nothing taken; ``timeout=0`` tries once). Returns
        ``Sample(td, indices, generations)`` (a dense ring's ``td``: one ``TensorDict`` of batch size
        ``[n, *rest]``, as for ``sample``): popped items are gone from the queue, so a reader that
        dies before using them loses them (at most once). ``keys`` reads only those keys.

        ``lease=S`` (seconds): the items are leased to this caller until ``ack``, returned as
        ``LeasedSample(td, indices, generations, write_numbers, deliveries, receipt)``; items not
        acknowledged within ``S`` seconds of the server's clock go to the next pop again, before newer
        items, in write order, ``redelivered`` with their delivery count (at least once; exactly once
        for a reader that acknowledges). ``with ring.pop(n, lease=S) as got:`` acks on a clean exit.

        Errors: ``QueueOverrunError`` (``.lost``) when writers overwrote unread items (a ring not in
        queue mode); the next pop goes on with the oldest item left. ``TimeoutError`` at the deadline;
        ``AmbiguousTimeoutError`` when the deadline passed after the pop may have taken items (its
        ``retry()`` gets them). One round trip on one node; a resend under the same request id gets
        the same items.

        Sharded: a pop takes items of one shard (the shards tried in turn), in write order within a
        shard, not across shards (as Kafka's partitions); a waiting pop polls the shards (1 to 50 ms
        apart). Each item still goes to exactly one reader.

        Rollouts: on a ring whose rollout index is on, a pop takes *items* (a row, or a whole group) in the
        order they became visible, never part of a group (a group larger than ``batch_size``: ``ValueError``,
        use ``groups=``). ``max_staleness=k`` drops (and counts: ``RolloutSample.stale``, ``stats()['stale']``)
        items whose lowest version is below published - ``k``; items a writer overwrote are dropped and
        counted in ``lost`` (no ``QueueOverrunError``). ``groups=g``: the next ``g`` whole groups.
        ``token_budget=t, length_key=key``: the next items whose lengths (each row's first dim of ``key``)
        add up to at most ``t``, in order (a budget smaller than the next item: ``ValueError``, nothing
        taken). One round trip; a pop looks at 2,048 queue entries at most. Not with ``lease=``.
        """
        ...

    def set_version(self, version: int, *, allow_backwards: bool = False) -> int:
        """Publish the learner's policy version (an int >= 0), which ``max_staleness`` and ``max_ahead`` measure
        against; returns the one published before. Going backwards raises ``ValueError`` unless
        ``allow_backwards=True``. Turns the ring's rollout index on (see ``extend``). Wakes writers waiting on
        ``max_ahead``. One round trip. Sharded: ``NotImplementedError``."""
        ...

    @property
    def policy_version(self) -> int:
        """The version ``set_version`` published last (0 before any), read from the server."""
        ...

    def ack(self, receipt: Any, *, timeout: float | None = None) -> int:
        """Settle the items of a leased pop (its ``receipt`` or the ``LeasedSample``); returns how many.

        Twice is harmless (the same answer). An ack after the lease ran out settles the items no other
        pop took and raises ``LeaseLostError`` (``.not_held``: the write numbers of those another pop
        took). A receipt the store does not hold (never handed out, or settled more than 4,096 receipts
        ago) raises ``ValueError``. One round trip. Sharded: the receipt (a ``ShardReceipt``) names its
        shard; only receipts of the ring's own pops are taken.
        """
        ...

    # -- priorities, rate limiter, queue ---------------------------------------------------------
    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        """Keep a priority per slot on the server (a sum tree of ``priority ** alpha``, about
        ``9 * capacity`` bytes) and sample by it. Slots written so far get priority 1; new slots get the
        ``priority`` given to ``extend`` (default: the largest so far). ``max_times_sampled`` retires a
        slot after that many draws, until it is written again. The tree is built in steps of bounded
        server work (one call each: other clients are never held up); the call returns when priorities
        are on. Again with the same values: nothing; with others: ``ValueError``. Sharded: on every
        shard (each its own tree), at once."""
        ...

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        """Set the priority of slots ``index`` (one number or one per slot; finite, >= 0; 0 is never
        drawn), in one atomic call; with ``generation``, only where a slot still holds it. Slots never
        written or retired keep theirs. Returns a bool tensor: which slots were updated. ``ValueError``
        on a ring without priorities or for bad values, before anything is written. Sharded: one call
        per shard touched, at once, each atomic on its shard."""
        ...

    def set_rate_limit(self, *, min_size: int = 1, samples_per_insert: float | None = None, error_buffer: float | None = None) -> None:
        """Limit sampling and inserting on the server, for every process at once (Reverb's limiters).

        ``min_size`` alone (``MinSize``): ``sample`` waits until the ring holds that many items. With
        ``samples_per_insert`` and ``error_buffer`` (``SampleToInsertRatio``): sampled rows and inserted
        rows (counted from now) keep ``samples - samples_per_insert * inserts`` within the buffer; a
        ``sample`` that would run ahead waits for inserts and an ``extend`` that would run ahead waits
        for samples (``timeout=``: ``TimeoutError``, nothing done). A batch goes when its first row may,
        so it may overshoot by itself, and the two sides never block each other. ``error_buffer`` must
        be at least ``max(1, samples_per_insert)`` (``ValueError``).

        Sharded: each shard limits its own calls, with ``min_size`` and ``error_buffer`` split in
        proportion to its count (each at least ``max(1, samples_per_insert)``): a shard's ``min_size``
        is its share, and the whole ring's difference stays within the sum of the shards' buffers plus
        one batch per shard.
        """
        ...

    def clear_rate_limit(self) -> None:
        """Remove the rate limiter; waiting calls go on at their next try. Sharded: on every shard."""
        ...

    def set_queue(self, on: bool = True) -> None:
        """Queue mode (Reverb's ``Queue``): an ``extend`` that would overwrite items no one has popped
        (leased ones included, until acknowledged) waits instead (``timeout=``: ``TimeoutError``), so
        ``pop`` loses nothing. Sharded: on every shard (an extend goes to a shard with room)."""
        ...

    def track_distinct(self, on: bool = True) -> None:
        """Count the distinct rows sampled (``stats()``: ``distinct_sampled``, ``overwritten_unsampled``,
        ``sampled_resident``; None while off). Off by default, because of its cost: a bitmap of one bit per
        slot, one ``BITFIELD`` per counted sample and clearing work in every ring write that overwrites rows
        (a sample of a full ring costs ~+25% to x2 server time, see ``tools/README.md`` "Stats cost").
        Turning it on starts from an empty bitmap: rows are counted from then on; turning it off deletes
        the bitmap. A setting of the store, seen by every handle. Sharded: on every shard."""
        ...

    @property
    def sampling_policy(self) -> SamplingPolicy:
        """The ring's sampling policy (priorities' ``alpha`` and ``max_times``, the rate limiter,
        queue mode), read from the server. Sharded: the first shard's (every shard has the same)."""
        ...

    # -- trajectories ----------------------------------------------------------------------------
    def set_trajectories(self, *, traj_key: Any = None, end_key: Any = None) -> None:
        """Keep an episode index on the server, so that ``sample_slices`` draws slices of trajectories.

        ``traj_key``: a key of one integer id per row, consecutive rows of one id being one trajectory;
        ``end_key``: a key of one flag per row, a set flag ending its trajectory (torchrl's
        ``SliceSampler`` arguments). The index is built over the rows held (one read of the key), then
        each ``extend`` keeps it in the same atomic call (a batch without the key: ``KeyError``, nothing
        written), overwrites and wrap-around included. Neither key: the index is dropped. Sharded:
        ``NotImplementedError`` (an episode would have to stay on one shard)."""
        ...

    @property
    def trajectories(self) -> Trajectories | None:
        """The ring's trajectory setting (``set_trajectories``; None: none), as this handle knows it."""
        ...

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
        """``batch_size`` rows as slices of trajectories, drawn and read on the server in one round trip,
        as torchrl's ``SliceSampler`` draws them: ``num_slices`` slices (or slices of ``slice_len`` rows),
        each inside one trajectory drawn uniformly among those long enough (``strict_length=False``: among
        all, a shorter one giving a shorter slice; none long enough: ``ValueError``), its start uniform;
        ``span`` lets slices hang over a trajectory's ends and be cut there. The server's work grows with
        the rows returned, not with the ring. Returns ``SliceSample(td, indices, generations, info)`` with
        ``info["truncated"]`` (the last row of each slice) and the slices' bounds. Needs ``set_trajectories``.
        ``ranks=(eligible, ranks)``: a sampler without replacement names each slice's trajectory by its rank
        among the ``eligible`` long enough (longest first); another count raises ``RanksMoved`` (nothing drawn).
        Sharded: ``NotImplementedError``."""
        ...

    # -- the ring's state ------------------------------------------------------------------------
    def marks(self) -> Marks:
        """``Marks(rw, tr, gb, wb)`` in one round trip: the ring write count (``write_count``) and three
        counters an adapter keeps in the ring's header (torchrl's ``StoreStorage`` does): ``tr``, the
        store's writes made within :meth:`counting_in_place` (by any process), and ``gb``/``wb``, the bases
        :meth:`set_marks_base` set (0 until then). ``KeyError`` when the store was deleted or made again
        since this handle opened it. Sharded: every shard's at once, ``rw``/``tr`` summed, ``gb``/``wb``
        the largest (set alike on every shard)."""
        ...

    def set_marks_base(self, generation_base: int, write_base: int) -> None:
        """Set ``marks().gb`` and ``marks().wb`` in one atomic call (what an adapter carries over into a
        store made again, e.g. torchrl's generations and ``write_count`` across ``empty()``). Sharded: on
        every shard, at once."""
        ...

    def counting_in_place(self) -> AbstractContextManager[None]:
        """A context manager: within it, every write of the store this thread makes also adds 1 to
        ``marks().tr`` in the same atomic call (no extra round trip), so every process sees that the
        rows changed (torchrl's ``_mutation_revision``). Sharded: on whichever shard a write lands."""
        ...

    def sampling_policies(self) -> list[SamplingPolicy]:
        """The sampling policy of each ring that holds one, read again from the server: one for a one-node
        ring (``[sampling_policy]``), one per shard for a sharded ring (a limiter's sizes are split over
        the shards, so the shards' policies differ). With :meth:`restore_sampling_policies`, what a store
        made again in another's place (torchrl's ``empty()``) needs to keep priorities, limiter and queue."""
        ...

    def restore_sampling_policies(self, policies: Sequence[SamplingPolicy]) -> None:
        """Give the ring exactly the policies ``sampling_policies()`` of another ring of its kind and shape
        returned: priorities as ``enable_priorities`` builds them (written slots get priority 1), then the
        limiter (its counts start now) and the queue in one call per ring. ``ValueError`` (nothing done)
        when the number of policies is not the ring's. Sharded: each shard its own, at once."""
        ...

    def wait_for(self, *, written: int | None = None, write_count: int | None = None, timeout: float | None = None) -> RingState:
        """Block until the ring holds ``written`` items (``len(ring.written)``) or has had ``write_count``
        ring writes (exactly one of the two), without polling on one node (writers publish on the
        store's channel; a sharded ring polls its shards). Returns the ring's state; ``TimeoutError``
        after ``timeout`` seconds; on one node, ``ValueError`` for a ``written`` above the capacity."""
        ...

    def ring_state(self) -> RingState:
        """``RingState(write_count, cursor, written)``, read from the server in one round trip.
        Sharded: summed over the shards (read at once), and ``cursor`` is -1 (``shard_states()`` has
        each shard's)."""
        ...

    def stats(self) -> dict[str, Any]:
        """The ring's counters and state, as a plain dict (JSON-able), read in one round trip per node.

        Counted on the server by the scripts that do the work, in the same call (no round trip of their
        own), since the store was made (deleted with it; not carried by checkpoints): ``inserted``,
        ``sampled``, ``popped``, ``acknowledged``, ``redelivered`` (popped again after a lease lapsed),
        ``expired`` (items whose lease lapsed), ``lost`` (unread items overwritten), ``held_writes`` and
        ``held_samples`` (WAIT replies of the rate limiter or a full queue), ``held_writes_ms``,
        ``held_samples_ms``, ``held_pops_ms`` (how long calls that went through had been held), the age in ring writes of the
        rows sampled (``age_rows``, ``age_sum``, ``age_mean``, ``age_max``), with rollouts the age in policy versions
        of the rows sampled or popped (``age_versions_rows``, ``age_versions_sum``, ``age_policy_versions`` (the
        mean), ``age_policy_versions_max``; None while none was taken); and the ring as it is now:
        ``capacity``, ``written``, ``write_count``, ``unread``, ``leased``, ``awaiting_redelivery``,
        ``queue``, ``limiter`` (settings, inserts and samples counted, ``room``), ``priority`` (``alpha``,
        ``total`` mass, ``min_weight``, ``max_priority``) and ``waiting`` (clients waiting on the store's
        channel; None on a cluster). Rows sampled at least once (``distinct_sampled``, ``overwritten_sampled``,
        ``overwritten_unsampled``, ``sampled_resident``): only once :meth:`track_distinct` turned them on,
        None before. ``tdstore._inspect.stats`` says what each key counts. A read-only handle's calls are not
        counted.

        Sharded: the totals over the shards (read at once), and ``shards``: each shard's own dict.
        """
        ...

    @property
    def written(self) -> Sequence[int]:
        """The slots written so far (``len(ring.written)`` is how many items the ring holds, at most
        ``capacity``), read from the server: ``range(n)`` on one node; sharded, each shard's written
        slots in global numbering (``WrittenSlots``)."""
        ...

    @property
    def write_count(self) -> int:
        """How many elements ``extend``/``append`` wrote in total (all laps), read from the server
        (sharded: summed over the shards). A slot's generation is how many of them landed on it."""
        ...

    @property
    def cursor(self) -> int:
        """The slot the next ``extend`` writes first (``write_count % capacity``), read from the server.
        Sharded: -1, a sharded ring has no one cursor."""
        ...

    @property
    def capacity(self) -> int:
        """The ring's number of slots: the store's ``count`` (a dense store's first dim). No round trip."""
        ...


def _docstrings_from_the_protocol(front: type) -> None:
    """Give each call of ``front`` (``_ring.ring_calls.RingCalls``, the calls of the lazy and dense kinds,
    written once) the docstring stated here, so that every call's text exists once: this protocol's."""
    for name in CALLS:
        stated = inspect.getattr_static(Ring, name)
        doc = (stated.fget if isinstance(stated, property) else stated).__doc__
        vars(front)[name].__doc__ = doc


_docstrings_from_the_protocol(RingCalls)
