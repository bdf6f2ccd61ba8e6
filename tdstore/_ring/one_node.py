"""The ring's work on one node: each call of ``tdstore.Ring`` as the one script call (or read transaction)
that does it, on the engine of one store (``_ring.ring_calls.RingWork``).

A lazy store's ring and a dense store's are both this, on the engine of the stack the store is kept as.
They differ in what a read hands back: a dense store's batches are one dense ``TensorDict`` of batch size
``[n, *rest]`` (``rows=``, see ``_ring.dense_methods.densify``), where a lazy store's may be a lazy stack.
The other difference, a dense store's ``DenseShapeError``, is the server header's (``type: dense``), which
the write planner reads: no code here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tensordict import TensorDictBase

from tdstore._engine.engine import Engine
from tdstore._errors import AmbiguousTimeoutError, MustWait
from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._format.schema import NestedPath
from tdstore._format.trajectories import Trajectories
from tdstore._inspect import stats
from tdstore._plan.ring_plan import RingState, RingWrite, Sample
from tdstore._ring import extend, leases, marks, policy_calls, rollouts, sample_pop, slices, waiting
from tdstore._ring.args import refuse_spread
from tdstore._ring.leases import LeasedSample
from tdstore._ring.marks import Marks
from tdstore._ring.policy_calls import PrioritizedSample
from tdstore._ring.ring_calls import Rollout, RolloutPop
from tdstore._ring.rollouts import RolloutSample
from tdstore._ring.row_reads import RolloutsOn
from tdstore._ring.slices import SliceSample

T = TypeVar("T")


@dataclass(slots=True)
class OneNodeRing:
    """The ring of the store ``engine`` serves (see the module docstring)."""

    engine: Engine
    capacity: int
    inner_batch_size: torch.Size
    device: torch.device | None
    host: Any  # the handle a ``LeasedSample`` acknowledges through
    rows: Callable[[Any], Any] | None = None  # what a read's ``Sample`` goes through before it is handed back

    @property
    def stack_pos(self) -> int:
        return self.engine.header.stack_pos

    def _read(self, call: Callable[[], T]) -> T:
        """``call()``'s sample or pop through :attr:`rows`, and so is its resend's, if it may have run."""
        if self.rows is None:
            return call()
        try:
            got = call()
        except AmbiguousTimeoutError as err:
            raise err.then(self.rows) from err.__cause__
        return self.rows(got)

    # -- writes ----------------------------------------------------------------------------------
    def extend(self, td: Any, priority: Any, timeout: float | None, request: str | None, rollout: Rollout | None) -> RingWrite:
        engine = self.engine
        args = None
        if rollout is not None:  # checked against the header: the 'V' op's arguments (``_ring.rollouts``)
            h, sp = engine.header, self.stack_pos
            n = int(td.batch_size[sp]) if isinstance(td, TensorDictBase) and td.batch_dims > sp else 0
            args = rollouts.write_args(h, n, *rollout)
        return extend.extend(engine, td, priority, timeout, request, args)

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        return extend.update_if(self.engine, index, generation, td)

    # -- reads -----------------------------------------------------------------------------------
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
    ) -> Sample | PrioritizedSample | RolloutSample:
        if as_tensor and self.rows is not None:
            raise TypeError(
                "a dense store's rows have one shape per key, so its sample is one TensorDict already: "
                f"{sorted(as_tensor)} are a LazyStackedTensorDictStore's (heterogeneous keys)"
            )
        engine = self.engine
        if max_staleness is None and groups is None and not engine.header.rollouts:
            try:
                got = self._read(
                    lambda: sample_pop.sample(
                        engine,
                        batch_size,
                        generator,
                        self.device,
                        as_tensor,
                        paths,
                        prioritized=prioritized,
                        alpha=alpha,
                        beta=beta,
                        min_size=min_size,
                        timeout=timeout,
                    )
                )
                if not engine.header.rollouts:  # (a read that met the index turned on re-read its rows: drawn again)
                    return got
            except RolloutsOn:
                pass  # the store's rollout index is on: its sample hides incomplete groups
        if prioritized or min_size is not None:  # (a ring with rollouts, or rollout arguments)
            raise NotImplementedError(
                "a sample of a ring with rollouts draws uniformly: prioritized= and min_size= are not supported with it yet"
            )
        return self._read(
            lambda: rollouts.sample(
                engine,
                batch_size,
                generator,
                self.device,
                paths,
                max_staleness=max_staleness,
                groups=groups,
                timeout=timeout,
                ragged=as_tensor,
            )
        )

    def sample_seen(self, batch_size: int, generator: torch.Generator | None) -> Sample:
        """The client-side draw below the written length this handle saw (``sample_pop.sample_seen``), else
        the server's uniform sample."""
        engine = self.engine
        got = sample_pop.sample_seen(engine, batch_size, generator, self.device)  # (a read: nothing to resend)
        if got is not None:
            return got if self.rows is None else self.rows(got)
        return self._read(lambda: sample_pop.sample(engine, batch_size, generator, self.device, prioritized=False))  # type: ignore[return-value]

    def filled(self, fresh: bool) -> int:
        """Items held: the capacity once this handle saw the ring full (rw only grows), else read (one round trip)."""
        engine = self.engine
        if engine.ring_full and not fresh:
            return self.capacity
        n = self.state().written
        engine.ring_full = engine.ring_full or n >= self.capacity
        return n

    def pop(
        self,
        batch_size: int,
        timeout: float | None,
        paths: list[NestedPath] | None,
        lease: float | None,
        request: str | None,
        rollout: RolloutPop | None,
    ) -> Sample | LeasedSample | RolloutSample:
        engine, device = self.engine, self.device
        refused = "pop(lease=) on a ring with rollouts (versions, groups, budgets) is not supported yet"
        if lease is not None and (rollout is not None or engine.header.rollouts):
            raise NotImplementedError(refused)
        if rollout is None and not engine.header.rollouts:
            try:
                if lease is not None:
                    return self._read(lambda: leases.pop(engine, self.host, batch_size, device, timeout, paths, lease, request))
                return self._read(lambda: sample_pop.pop(engine, batch_size, device, timeout, paths, request))
            except RolloutsOn:  # the store's rollout index turned on: its pop takes whole groups
                if lease is not None:
                    raise NotImplementedError(refused) from None
        given = rollout or RolloutPop(None, None, None, None)
        return self._read(
            lambda: rollouts.pop(
                engine,
                batch_size,
                device,
                paths,
                max_staleness=given.max_staleness,
                groups=given.groups,
                token_budget=given.token_budget,
                length_key=given.length_key,
                timeout=timeout,
                request=request,
            )
        )

    def ack(self, receipt: Any, timeout: float | None) -> int:
        return leases.ack(self.engine, receipt, timeout)

    # -- rollouts: policy versions ---------------------------------------------------------------
    def set_version(self, version: int, allow_backwards: bool) -> int:
        return rollouts.set_version(self.engine, version, allow_backwards)

    def policy_version(self) -> int:
        return rollouts.published_version(self.engine)

    # -- the ring's state ------------------------------------------------------------------------
    def state(self) -> RingState:
        return extend.state(self.engine.ring_writes(), self.capacity)

    def written(self) -> range:
        return range(self.state().written)

    def write_count(self) -> int:
        return self.engine.ring_writes()

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        refuse_spread(engine)
        try:
            return stats.read(engine.client, engine.keys, cluster=engine.spec.cluster)
        except KeyError:
            raise engine.gone() from None

    def marks(self) -> Marks:
        return marks.read(self.engine)

    def set_marks_base(self, generation_base: int, write_base: int) -> None:
        marks.set_base(self.engine, generation_base, write_base)

    def counting_in_place(self) -> AbstractContextManager[None]:
        return self.engine.counting_in_place()

    def wait_for(self, written: int | None, write_count: int | None, timeout: float | None) -> RingState:
        engine, count = self.engine, self.capacity
        want = written if written is not None else write_count
        assert want is not None

        def attempt() -> RingState:
            st = extend.state(engine.ring_writes(), count)
            have = st.written if written is not None else st.write_count
            if have < want:
                raise MustWait("size", f"the ring has {have} of the {want} {'items' if written is not None else 'ring writes'} asked for")
            return st

        return waiting.until_ready(engine, attempt, timeout, "wait_for")

    # -- trajectories ----------------------------------------------------------------------------
    def set_trajectories(self, traj_key: Any, end_key: Any) -> None:
        slices.set_trajectories(self.engine, traj_key, end_key)

    def trajectories(self) -> Trajectories | None:
        return self.engine.header.trajectories

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
    ) -> SliceSample:
        engine, device = self.engine, self.device
        return self._read(
            lambda: slices.sample_slices(
                engine,
                batch_size,
                num_slices=num_slices,
                slice_len=slice_len,
                strict_length=strict_length,
                span=span,
                generator=generator,
                keys=paths,
                device=device,
                ranks=ranks,
            )
        )

    # -- priorities, rate limiter, queue ---------------------------------------------------------
    def policy(self) -> SamplingPolicy:
        return policy_calls.policy_of(self.engine, fresh=True)

    def policies(self) -> list[SamplingPolicy]:
        return [self.policy()]

    def restore_policies(self, policies: Sequence[SamplingPolicy]) -> None:
        if len(policies) != 1:
            raise ValueError(f"a one-node ring holds one sampling policy, got {len(policies)}")
        policy_calls.restore_policy(self.engine, policies[0])

    def enable_priorities(self, alpha: float, max_times_sampled: int | None) -> None:
        policy_calls.enable_priorities(self.engine, alpha, max_times_sampled)

    def update_priority(self, index: Any, priority: Any, generation: Any) -> torch.Tensor:
        return policy_calls.update_priority(self.engine, index, priority, generation)

    def set_rate_limit(self, min_size: int, samples_per_insert: float | None, error_buffer: float | None) -> None:
        policy_calls.set_rate_limit(self.engine, min_size, samples_per_insert, error_buffer)

    def clear_rate_limit(self) -> None:
        policy_calls.clear_rate_limit(self.engine)

    def set_queue(self, on: bool) -> None:
        policy_calls.set_queue(self.engine, on)

    def track_distinct(self, on: bool) -> None:
        policy_calls.track_distinct(self.engine, on)
