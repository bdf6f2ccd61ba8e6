"""The ring's public calls, written once for every kind of store that has a ring.

``RingCalls`` is a mixin that defines each call of ``tdstore.Ring`` once: its signature, the checks and
shaping of its arguments (done before anything is sent), and its docstring, which is ``tdstore.Ring``'s
(``tdstore.ring_interface`` gives each method here the protocol's docstring: one text per call, saying
where the kinds differ). What the call then does is the kind's: a class that mixes ``RingCalls`` in
defines ``_ring_work()``, which returns a :class:`RingWork`, the ring's work on checked arguments:

- a lazy store (``_ring.lazy_methods.LazyRing``) and a dense store (``_ring.dense_methods.DenseRing``)
  both answer with a ``_ring.one_node.OneNodeRing`` on the engine of the stack they are kept as; the
  dense one densifies the batches it reads. A new ring call is one method here (and, if it does new
  work, one in ``OneNodeRing``), and both kinds have it.
- a sharded ring (``_shards``) adopts the same front by defining ``_ring_work()`` as an object whose
  methods fan out over its shards (the ones ``_shards.shard_writes``/``sample``/``queue`` hold now).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from tdstore._format import ragged
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._format.schema import NestedPath
from tdstore._format.trajectories import Trajectories
from tdstore._plan.ring_plan import RingState, RingWrite, Sample, check_batch_size, check_request_id
from tdstore._plan.values import as_path
from tdstore._ring.leases import LeasedSample
from tdstore._ring.marks import Marks
from tdstore._ring.policy_calls import PrioritizedSample
from tdstore._ring.rollouts import RolloutSample
from tdstore._ring.slices import SliceSample


def pops_a_key(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``pop(*args, **kwargs)`` is TensorDict's ``pop(key[, default])`` (a key, str or tuple, first)
    rather than the queue's ``pop(batch_size, ...)``: one rule for every store's ``pop``."""
    return bool(args and isinstance(args[0], (str, tuple))) or "key" in kwargs or "default" in kwargs


def key_paths(keys: Sequence[Any] | None) -> list[NestedPath] | None:
    """``keys=`` of ``sample`` and ``pop`` as paths: one key (a ``str``, or a tuple: one nested key, as in
    ``TensorDict.select``) or a sequence of keys; None: every key."""
    if keys is None:
        return None
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    return [as_path(k) for k in keys]


class Rollout(NamedTuple):
    """A ring write's rollout arguments (``tdstore.Ring.extend``), checked against the ring's header by the work."""

    version: int | None
    max_ahead: int | None
    group: Any
    group_size: int | None


class RolloutPop(NamedTuple):
    """A pop's rollout arguments (``tdstore.Ring.pop_items``); ``length_key`` as a path."""

    max_staleness: int | None
    groups: int | None
    token_budget: int | None
    length_key: NestedPath | None


def rollout_of(version: int | None, max_ahead: int | None, group: Any, group_size: int | None) -> Rollout | None:
    """The rollout arguments of a ring write, or None when it gives none (a plain write)."""
    if version is None and max_ahead is None and group is None and group_size is None:
        return None
    return Rollout(version, max_ahead, group, group_size)


class RingWork(Protocol):
    """What a kind of ring does once the front has checked a call's arguments: one method per call (the
    arguments checked and shaped by :class:`RingCalls`), and what the front needs to shape them."""

    @property
    def capacity(self) -> int: ...
    @property
    def inner_batch_size(self) -> torch.Size: ...
    @property
    def stack_pos(self) -> int: ...

    def extend(self, td: Any, priority: Any, timeout: float | None, request: str | None, rollout: Rollout | None) -> RingWrite: ...
    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor: ...
    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None,
        paths: list[NestedPath] | None,
        as_tensor: dict[str, Any] | None,
        prioritized: bool | None,
        alpha: float | None,
        beta: float,
        min_size: int | None,
        timeout: float | None,
        max_staleness: int | None,
        groups: int | None,
    ) -> Sample | PrioritizedSample | RolloutSample: ...
    def pop(
        self,
        batch_size: int,
        timeout: float | None,
        paths: list[NestedPath] | None,
        lease: float | None,
        request: str | None,
        rollout: RolloutPop | None,
    ) -> Sample | LeasedSample | RolloutSample: ...
    def ack(self, receipt: Any, timeout: float | None) -> int: ...
    def set_version(self, version: int, allow_backwards: bool) -> int: ...
    def policy_version(self) -> int: ...
    def state(self) -> RingState: ...
    def written(self) -> Sequence[int]: ...
    def write_count(self) -> int: ...
    def sample_seen(self, batch_size: int, generator: torch.Generator | None) -> Sample: ...
    def filled(self, fresh: bool) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def policy(self) -> SamplingPolicy: ...
    def policies(self) -> list[SamplingPolicy]: ...
    def restore_policies(self, policies: Sequence[SamplingPolicy]) -> None: ...
    def enable_priorities(self, alpha: float, max_times_sampled: int | None) -> None: ...
    def update_priority(self, index: Any, priority: Any, generation: Any) -> torch.Tensor: ...
    def set_rate_limit(self, min_size: int, samples_per_insert: float | None, error_buffer: float | None) -> None: ...
    def clear_rate_limit(self) -> None: ...
    def set_queue(self, on: bool) -> None: ...
    def track_distinct(self, on: bool) -> None: ...
    def marks(self) -> Marks: ...
    def set_marks_base(self, generation_base: int, write_base: int) -> None: ...
    def counting_in_place(self) -> AbstractContextManager[None]: ...
    def wait_for(self, written: int | None, write_count: int | None, timeout: float | None) -> RingState: ...
    def set_trajectories(self, traj_key: Any, end_key: Any) -> None: ...
    def trajectories(self) -> Trajectories | None: ...
    def sample_slices(
        self,
        batch_size: int,
        num_slices: int | None,
        slice_len: int | None,
        strict_length: bool,
        span: Any,
        generator: torch.Generator | None,
        paths: list[NestedPath] | None,
        ranks: tuple[int, torch.Tensor] | None,
    ) -> SliceSample: ...


class RingCalls:
    """The ring buffer's calls (``tdstore.Ring``), each defined once; the docstrings are ``tdstore.Ring``'s.
    A kind defines :meth:`_ring_work` (see the module docstring)."""

    def _ring_work(self, *, write: bool = False) -> RingWork:
        """The ring's work for this handle, once the handle is known to have a ring (``write``: and to
        take a ring write: a locked store refuses the first one, which creates keys)."""
        raise NotImplementedError

    # -- writes ----------------------------------------------------------------------------------
    def extend(
        self,
        td: Any,
        *,
        priority: Any = None,
        timeout: float | None = None,
        request_id: str | None = None,
        version: int | None = None,
        max_ahead: int | None = None,
        group: Any = None,
        group_size: int | None = None,
    ) -> RingWrite:
        work = self._ring_work(write=True)
        inner, stack_pos = work.inner_batch_size, work.stack_pos
        if isinstance(td, (list, tuple)):
            if not td:
                raise ValueError("extend got an empty list: nothing to write")
            elements = [
                e.to_tensordict() if is_tensorclass(e) else TensorDict(e, batch_size=inner) if isinstance(e, dict) else e for e in td
            ]
            bad = [type(e).__name__ for e in elements if not isinstance(e, TensorDictBase)]
            if bad:
                raise TypeError(f"extend got a list holding {bad[0]}; it takes a list of TensorDicts (one per element)")
            td = lazy_stack(elements, dim=stack_pos)
        elif is_tensorclass(td):
            td = td.to_tensordict()
        if isinstance(td, TensorDictBase) and tuple(td.batch_size) == tuple(inner):
            raise ValueError(
                f"extend got one element (batch size {list(td.batch_size)}); use append for one element, or give extend a batch "
                f"with the element dim at {stack_pos}"
            )
        rollout = rollout_of(version, max_ahead, group, group_size)
        return work.extend(td, priority, timeout, check_request_id(request_id), rollout)

    def append(
        self,
        td: Any,
        *,
        priority: Any = None,
        timeout: float | None = None,
        request_id: str | None = None,
        version: int | None = None,
        max_ahead: int | None = None,
        group: Any = None,
        group_size: int | None = None,
    ) -> RingWrite:
        work = self._ring_work(write=True)
        inner = work.inner_batch_size
        if isinstance(td, dict):
            td = TensorDict(td, batch_size=inner)
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"append expects a TensorDict or a dict, got {type(td).__name__}")
        if tuple(td.batch_size) != tuple(inner):
            raise ValueError(f"append expects one element of batch size {list(inner)}, got {list(td.batch_size)}; use extend for batches")
        return self.extend(
            td.unsqueeze(work.stack_pos),
            priority=priority,
            timeout=timeout,
            request_id=request_id,
            version=version,
            max_ahead=max_ahead,
            group=group,
            group_size=group_size,
        )

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        return self._ring_work(write=True).update_if(index, generation, td)

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
        **as_tensor: Any,
    ) -> Sample | PrioritizedSample | RolloutSample:
        if as_tensor and not ragged.wanted(as_tensor):
            raise TypeError(
                f"sample takes as_padded_tensor=True or as_nested_tensor=True (with {sorted(ragged.KEYWORDS)}), got {sorted(as_tensor)}"
            )
        work = self._ring_work()
        paths = key_paths(keys)
        return work.sample(
            batch_size, generator, paths, as_tensor or None, prioritized, alpha, beta, min_size, timeout, max_staleness, groups
        )

    def pop(self, *args: Any, **kwargs: Any) -> Any:
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
        _request: str | None = None,
        max_staleness: int | None = None,
        groups: int | None = None,
        token_budget: int | None = None,
        length_key: Any = None,
    ) -> Sample | LeasedSample | RolloutSample:
        # ``_request``: a sharded ring's pop of one shard, sent again under its id (``_shards.queue``)
        request = check_request_id(request_id) or _request
        rollout = None
        if max_staleness is not None or groups is not None or token_budget is not None or length_key is not None:
            rollout = RolloutPop(max_staleness, groups, token_budget, None if length_key is None else as_path(length_key))
        return self._ring_work().pop(batch_size, timeout, key_paths(keys), lease, request, rollout)

    def ack(self, receipt: Any, *, timeout: float | None = None) -> int:
        return self._ring_work().ack(receipt, timeout)

    # -- rollouts: policy versions ---------------------------------------------------------------
    def set_version(self, version: int, *, allow_backwards: bool = False) -> int:
        return self._ring_work().set_version(version, allow_backwards)

    @property
    def policy_version(self) -> int:
        return self._ring_work().policy_version()

    # -- priorities, rate limiter, queue ---------------------------------------------------------
    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        self._ring_work().enable_priorities(alpha, max_times_sampled)

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        return self._ring_work().update_priority(index, priority, generation)

    def set_rate_limit(self, *, min_size: int = 1, samples_per_insert: float | None = None, error_buffer: float | None = None) -> None:
        self._ring_work().set_rate_limit(min_size, samples_per_insert, error_buffer)

    def clear_rate_limit(self) -> None:
        self._ring_work().clear_rate_limit()

    def set_queue(self, on: bool = True) -> None:
        self._ring_work().set_queue(on)

    def track_distinct(self, on: bool = True) -> None:
        self._ring_work().track_distinct(on)

    @property
    def sampling_policy(self) -> SamplingPolicy:
        return self._ring_work().policy()

    def sampling_policies(self) -> list[SamplingPolicy]:
        return self._ring_work().policies()

    def restore_sampling_policies(self, policies: Sequence[SamplingPolicy]) -> None:
        self._ring_work().restore_policies(policies)

    # -- trajectories ----------------------------------------------------------------------------
    def set_trajectories(self, *, traj_key: Any = None, end_key: Any = None) -> None:
        self._ring_work().set_trajectories(traj_key, end_key)

    @property
    def trajectories(self) -> Trajectories | None:
        return self._ring_work().trajectories()

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
        work = self._ring_work()
        return work.sample_slices(batch_size, num_slices, slice_len, strict_length, span, generator, key_paths(keys), ranks)

    # -- the ring's state ------------------------------------------------------------------------
    def marks(self) -> Marks:
        return self._ring_work().marks()

    def set_marks_base(self, generation_base: int, write_base: int) -> None:
        self._ring_work().set_marks_base(generation_base, write_base)

    def counting_in_place(self) -> AbstractContextManager[None]:
        return self._ring_work().counting_in_place()

    def wait_for(self, *, written: int | None = None, write_count: int | None = None, timeout: float | None = None) -> RingState:
        if (written is None) == (write_count is None):
            raise TypeError("wait_for takes exactly one of written= or write_count=")
        want = written if written is not None else write_count
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise ValueError(f"wait_for needs an int >= 0, got {want!r}")
        work = self._ring_work()
        if written is not None and written > work.capacity:
            raise ValueError(f"a ring of {work.capacity} slots never holds {written} items")
        return work.wait_for(written, write_count, timeout)

    def ring_state(self) -> RingState:
        return self._ring_work().state()

    def stats(self) -> dict[str, Any]:
        return self._ring_work().stats()

    @property
    def written(self) -> Sequence[int]:
        return self._ring_work().written()

    @property
    def write_count(self) -> int:
        return self._ring_work().write_count()

    def sample_seen(self, batch_size: int, generator: torch.Generator | None = None) -> Sample:
        check_batch_size(batch_size, "sample")
        return self._ring_work().sample_seen(batch_size, generator)

    def filled(self, *, fresh: bool = False) -> int:
        return self._ring_work().filled(fresh)

    @property
    def cursor(self) -> int:
        return self._ring_work().state().cursor

    @property
    def capacity(self) -> int:
        return self._ring_work().capacity


#: The calls :class:`RingCalls` defines, each stated (signature, docstring) by ``tdstore.Ring``.
CALLS = tuple(name for name in vars(RingCalls) if not name.startswith("_"))
