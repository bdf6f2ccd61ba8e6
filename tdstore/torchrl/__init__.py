"""torchrl replay buffers whose storage, cursor, length and generations live on the server.

torchrl's own ``StoreStorage`` keeps the buffer's length in a ``multiprocessing.Value``
and the writer's cursor in the process, so two machines' buffers on one store overwrite
each other's rows and disagree on ``len``.  Here everything that must agree between
processes is the tdstore ring's (:mod:`tdstore._ring.extend`): one header counter ``rw`` on the
server, from which the cursor, the written length and each slot's generation follow.

* :class:`StoreStorage` (a torchrl ``Storage``) holds a dense :class:`~tdstore.TensorDictStore`
  of ``max_size`` rows (``ragged=True``: a :class:`~tdstore.LazyStackedTensorDictStore` of
  ``max_size`` elements, which may differ in shape); ``len()`` is the
  number of slots the ring has written, read from the server (the same in every process).
* :class:`StoreWriter` (a torchrl ``Writer``): ``add``/``extend`` are one ``store.extend``
  call each, which reserves the slots at the server's cursor and writes them atomically,
  so any number of writer processes on any number of machines share one cursor.
* :class:`StoreSampler` (a torchrl ``Sampler``): uniform sampling over the written slots
  in one round trip (``store.sample``, whose rows it hands to ``StoreStorage.get``);
  :class:`StoreSamplerWithoutReplacement` (``StoreSampler(replacement=False)``);
  :class:`StorePrioritizedSampler`: torchrl's ``PrioritizedSampler`` API with the sum tree
  on the server, so actors' data gets its priority as it is written and learners share it.
* :class:`StoreSliceSampler`: torchrl's ``SliceSampler`` given to :func:`replay_buffer` becomes one
  (the same object): the server keeps an episode index and draws slices in one round trip.
* :func:`replay_buffer` wires the three into a ``TensorDictReplayBuffer`` (or a
  ``ReplayBuffer``) in one line; a second process or machine attaches by ``td_id``.

The classes live in :mod:`tdstore.torchrl.storage`, :mod:`tdstore.torchrl.writer` and
:mod:`tdstore.torchrl.samplers`; this module gathers them and builds buffers from them.
torchrl is imported only by these modules: ``import tdstore`` never imports it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any, cast

import redis
from redis.cluster import RedisCluster
from torchrl.data.replay_buffers.replay_buffers import ReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import Sampler, SamplerWithoutReplacement

from tdstore import ShardedRing
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import SamplingPolicy
from tdstore.torchrl.ragged_buffers import RaggedReplayBuffer, RaggedTensorDictReplayBuffer
from tdstore.torchrl.samplers import StorePrioritizedSampler, StoreSampler, StoreSamplerWithoutReplacement
from tdstore.torchrl.slice_sampler import SERVED, StoreSliceSampler, StoreSliceSamplerWithoutReplacement
from tdstore.torchrl.staleness import StoreStalenessSampler, on_the_server
from tdstore.torchrl.storage import StoreStorage
from tdstore.torchrl.storage_base import METADATA_KEYS, TENSOR_KEY
from tdstore.torchrl.writer import StoreWriter

__all__ = [
    "StoreStorage",
    "StoreWriter",
    "StoreSampler",
    "StoreSamplerWithoutReplacement",
    "StorePrioritizedSampler",
    "StoreStalenessSampler",
    "StoreSliceSampler",
    "StoreSliceSamplerWithoutReplacement",
    "replay_buffer",
    "attach",
    "RaggedTensorDictReplayBuffer",
    "RaggedReplayBuffer",
    "TENSOR_KEY",
    "METADATA_KEYS",
]


#: The priority exponent of ``sampler="prioritized"`` for a buffer whose store has no priorities yet.
DEFAULT_ALPHA = 0.6

_SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "uniform": StoreSampler,
    "without_replacement": StoreSamplerWithoutReplacement,
}


def _policy(s: LazyStackedTensorDictStore) -> SamplingPolicy:
    """The sampling policy of the store just opened (a sharded ring's shards share priorities and queue:
    its first shard's)."""
    return s.sampling_policy


def _parameters(fn: Callable[..., Any]) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}


@cache
def _buffer_keywords(tensordict: bool) -> frozenset[str]:
    """torchrl's buffer keywords that :func:`replay_buffer` passes on (the storage, sampler and writer are its own)."""
    names = _parameters(ReplayBuffer.__init__) | (_parameters(TensorDictReplayBuffer.__init__) if tensordict else set())
    return frozenset(names - {"storage", "sampler", "writer", "batch_size", "kwargs"})


@cache
def _store_keywords() -> frozenset[str]:
    """What a store constructor takes: its own keywords, and any ``redis.Redis`` / ``RedisCluster`` keyword."""
    own = _parameters(LazyStackedTensorDictStore.__init__) - {"count", "td_id", "_kind", "_batchless"}
    extra = {"password_provider", "cluster", "min_replicas", "sharded"}
    return frozenset(own | _parameters(redis.Redis.__init__) | _parameters(RedisCluster.__init__) | extra)


def _split_keywords(kwargs: dict[str, Any], buffer_kwargs: dict[str, Any] | None, tensordict: bool) -> tuple[dict, dict]:
    """``kwargs`` cut into (buffer keywords, store keywords); a keyword neither takes raises ``TypeError`` at once.

    Without this, a buffer keyword such as ``prefetch`` would reach ``redis.Redis`` at the
    first ``extend``, 13 frames deep.
    """
    buffer = dict(buffer_kwargs or {})
    store: dict[str, Any] = {}
    unknown = []
    for name, value in kwargs.items():
        if name in _buffer_keywords(tensordict):
            if name in buffer:
                raise TypeError(f"replay_buffer got {name!r} twice: as a keyword and in buffer_kwargs")
            buffer[name] = value
        elif name in _store_keywords():
            store[name] = value
        else:
            unknown.append(name)
    bad = [n for n in buffer if n not in _buffer_keywords(tensordict)]
    if unknown or bad:
        kind = "TensorDictReplayBuffer" if tensordict else "ReplayBuffer"
        raise TypeError(
            f"replay_buffer got unexpected keyword argument(s) {sorted(unknown + bad)}: neither torchrl's {kind} "
            f"({', '.join(sorted(_buffer_keywords(tensordict)))}) nor a store's connection keywords take them"
        )
    return buffer, store


def replay_buffer(
    max_size: int | None = None,
    *,
    td_id: str | None = None,
    batch_size: int | None = None,
    sampler: str | Sampler | None = None,
    tensordict: bool = True,
    track_generations: bool = False,
    tensorclass_cls: type | None = None,
    buffer_kwargs: dict[str, Any] | None = None,
    alpha: float | None = None,
    beta: float = 0.4,
    eps: float = 1e-8,
    max_times_sampled: int | None = None,
    ragged: bool = False,
    **kwargs: Any,
) -> ReplayBuffer:
    """A torchrl replay buffer on a tdstore server, in one line.

    ``replay_buffer(10_000, url="redis://host:6379", batch_size=256)`` makes a new
    buffer; ``replay_buffer(url=..., td_id=rb.storage.td_id)`` (in another process or on
    another machine) attaches to it, with its size read from the server.

    Args:
        max_size: the capacity; ``None`` when attaching by ``td_id``.
        td_id: the id of the buffer to attach to (``rb.storage.td_id``).
        batch_size: the default sample size.
        sampler: ``None`` (default): the buffer's own policy, read from the server when
            attaching by ``td_id`` (a buffer with priorities is sampled by them, with the
            store's ``alpha`` and ``max_times_sampled``; any other by :class:`StoreSampler`),
            ``"uniform"`` for a new buffer. ``"uniform"`` (:class:`StoreSampler`, one round trip),
            ``"without_replacement"`` (:class:`StoreSamplerWithoutReplacement`),
            ``"prioritized"`` (:class:`StorePrioritizedSampler` with ``alpha`` (default: the
            store's, else 0.6), ``beta``, ``eps`` and ``max_times_sampled`` (default: the store's):
            priorities on the server; ``beta`` and ``eps`` are the learner's, not kept on the
            server: an attaching learner passes its own), or any torchrl ``Sampler`` (``RandomSampler()``, ``SliceSampler(...)``...).
            torchrl's ``SliceSampler`` becomes :class:`StoreSliceSampler` (slices drawn on the server).
            A sampler given explicitly wins over the buffer's policy: ``"uniform"`` draws a
            prioritized buffer uniformly, and a torchrl sampler draws on the client, outside the
            store's rate limiter. tdstore's samplers keep a rate limiter or queue the store has
            (the server counts and holds their calls). On a sharded ring
            (``sharded=True``, or ``spread=True`` on a cluster) torchrl's ``SamplerWithoutReplacement`` becomes its subclass
            :class:`StoreSamplerWithoutReplacement`, which draws the written slots.
        tensordict: a ``TensorDictReplayBuffer`` (default) or a plain ``ReplayBuffer``
            (for tensorclass or plain-tensor data).
        track_generations: samples carry ``"index_generation"`` (free with ``"uniform"``).
        tensorclass_cls: the tensorclass the data is read back as, in a process that did
            not write it.
        sharded: (on a Redis Cluster) the buffer is a ``tdstore.ShardedRing``: one ring per primary
            (``shards=K``: K of them); ``spread=True`` on a cluster says the same. Attaching by ``td_id``
            opens a sharded ring as one whatever this says.
        ragged: keep rows whose keys vary in shape (a lazy store; samples are lazy stacks).
            By default the buffer is a dense store whose first write fixes each key's shape,
            as torchrl's ``LazyTensorStorage``; a later row of another shape raises
            ``DenseShapeError``. Attaching by ``td_id`` opens the buffer as it was made.
        buffer_kwargs: more keyword arguments for the buffer, as a dict (the same as
            passing them directly).
        **kwargs: torchrl's ``ReplayBuffer`` keywords (``transform``, ``prefetch``,
            ``collate_fn``, ``pin_memory``, ``dim_extend``, ``compilable``, ``priority_key``...),
            passed to the buffer, and tdstore's connection keywords (``url``, ``host``,
            ``port``, ``unix_socket_path``, ``prefix``, ``password_provider``, any
            ``redis.Redis`` keyword...), passed to the store. Any other keyword raises
            ``TypeError`` here, before anything is created.
    """
    buffer_kwargs, store_kwargs = _split_keywords(kwargs, buffer_kwargs, tensordict)
    storage = StoreStorage(max_size, td_id=td_id, tensorclass_cls=tensorclass_cls, ragged=ragged, **store_kwargs)
    if sampler is None or (isinstance(sampler, str) and sampler == "prioritized"):
        # the buffer's policy is the server's: a default attach samples as the buffer that made it does
        policy = storage.with_store(_policy) if td_id is not None else SamplingPolicy()
        if sampler is None:
            sampler = "prioritized" if policy.prioritized else "uniform"
        if policy.prioritized:
            alpha = policy.alpha if alpha is None else alpha
            max_times_sampled = policy.max_times if max_times_sampled is None else max_times_sampled
    if isinstance(sampler, str):
        if sampler == "prioritized":
            sampler = StorePrioritizedSampler(DEFAULT_ALPHA if alpha is None else alpha, beta, eps, max_times_sampled=max_times_sampled)
        elif sampler not in _SAMPLERS:
            raise ValueError(f"sampler must be one of {sorted([*_SAMPLERS, 'prioritized'])} or a torchrl Sampler, got {sampler!r}")
        else:
            sampler = _SAMPLERS[sampler]()
    if type(sampler) is SamplerWithoutReplacement and ShardedRing.wanted(store_kwargs):
        # torchrl's draws range(len), which a sharded ring not full has not all written: its subclass draws the
        # written slots (the same object, so the caller's reference and its state_dict stay the buffer's)
        sampler.__class__ = StoreSamplerWithoutReplacement
    if isinstance(sampler, StorePrioritizedSampler):
        sampler.prepare(storage)
    sampler = on_the_server(sampler)  # torchrl's StalenessAwareSampler: the server holds its max_staleness
    if type(sampler) in SERVED and not ShardedRing.wanted(store_kwargs):  # torchrl's slice samplers: the server draws slices
        sampler.__class__ = SERVED[type(sampler)]  # the same object: the caller's reference and its state stay the buffer's
        cast(StoreSliceSampler, sampler).prepare(storage)
    if ragged or (td_id is not None and not storage.with_store(_kept_as_dense)):
        # rows of varying shapes: lists in extend, padding keywords in sample (tdstore.torchrl.ragged_buffers)
        cls: type[ReplayBuffer] = RaggedTensorDictReplayBuffer if tensordict else RaggedReplayBuffer
    else:
        cls = TensorDictReplayBuffer if tensordict else ReplayBuffer
    return cls(
        storage=storage,
        writer=StoreWriter(track_generations=track_generations),
        sampler=sampler,
        batch_size=batch_size,
        **buffer_kwargs,
    )


def _kept_as_dense(store: Any) -> bool:
    return bool(store.kept_as_dense)


def attach(td_id: str, **kwargs: Any) -> ReplayBuffer:
    """``replay_buffer(td_id=td_id, **kwargs)``: the buffer another process made, by its id.

    It samples as the buffer's policy on the server says (by priority, with the store's alpha, when
    it has priorities), unless ``sampler=`` is given: the caller's sampler wins."""
    return replay_buffer(td_id=td_id, **kwargs)
