"""A sharded ring's samples (uniform and by priority, exactly the one-node distribution) and its priorities."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tdstore._ring.extend import Sample
from tdstore._ring.policy_calls import PrioritizedSample, weights_of
from tdstore._shards.fan_out import _POLL_S, ShardsBase, _with_kwargs


class ShardSampling(ShardsBase):
    """Sampling and priorities of a sharded ring."""

    _full: list[bool]

    def _sizes(self) -> list[int]:
        """Items each shard holds, read at once; a full shard (it stays full) is not read again."""
        todo = [k for k in range(len(self._shards)) if not self._full[k]]
        got = dict(zip(todo, self._fan_out([(k, self._shards[k]._engine.ring_writes, ()) for k in todo]))) if todo else {}
        out = []
        for k, c in enumerate(self._layout.counts):
            n = c if self._full[k] else min(got[k], c)
            self._full[k] = n >= c
            out.append(n)
        return out

    def _prioritized(self) -> bool:
        pol = self._shards[0]._engine.header.sampling
        return pol is not None and pol.prioritized

    def _masses(self) -> tuple[list[int], list[float], list[float]]:
        """Each shard's size, priority mass (root of its sum tree) and smallest positive weight, read at once."""

        def one(k: int) -> tuple[int, float, float]:
            shard = self._shards[k]
            engine = shard._engine
            c = self._layout.counts[k]
            pipe = engine.client.pipeline(transaction=False)  # one round trip: both keys are in the shard's slot
            pipe.hmget(engine.keys.meta, "rw", "na")
            pipe.getrange(engine.keys.priorities, *((0, 7) if c == 1 else (-16, -1)))
            head, root = pipe.execute()
            rw = engine.ring_writes_from(head[0], head[1])
            if not root:
                return min(rw, c), 0.0, 0.0
            vals = np.frombuffer(root, dtype="<f8")
            total = float(vals[0])
            low = float(vals[1]) if len(vals) > 1 else total
            if not (math.isfinite(total) and total >= 0 and math.isfinite(low) and low >= 0):
                raise KeyError(f"shard {k} of the sharded ring td_id={self.td_id!r} has a damaged priority tree")
            return min(rw, c), total, low

        got = self._fan_out([(k, one, (k,)) for k in range(len(self._shards))])
        return [g[0] for g in got], [g[1] for g in got], [g[2] for g in got]

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
    ) -> Sample | PrioritizedSample:
        """A batch of ``batch_size`` written slots drawn with replacement over every shard, exactly as one ring
        would draw them (uniformly, or by priority on a ring with priorities): see the module docstring.
        Arguments and result as ``LazyStackedTensorDictStore.sample`` (indices are global slots)."""
        from tdstore._ring.sample_pop import _check_sample_args

        _check_sample_args(batch_size, min_size, beta)
        if min_size is not None and min_size > self._layout.count:
            raise ValueError(f"min_size={min_size} can never be reached by a ring of {self._layout.count} slots")
        by_prio = self._prioritized() if prioritized is None else bool(prioritized)
        if by_prio and not self._prioritized():
            self._shards[0]._engine.set_header(self._shards[0]._engine.fetch_header())
            if not self._prioritized():
                raise ValueError(f"the sharded ring td_id={self.td_id!r} has no priorities: call enable_priorities(alpha=...) first")
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _POLL_S[0]
        while True:
            if by_prio:
                sizes, masses, lows = self._masses()
                weights = masses
            else:
                sizes = self._sizes()
                weights, lows = [float(s) for s in sizes], []
            total = sum(weights)
            if total > 0 and (min_size is None or sum(sizes) >= min_size):
                break
            if min_size is None and timeout is None:
                what = "no slot with a positive priority" if by_prio and sum(sizes) > 0 else "nothing written yet"
                raise ValueError(
                    f"cannot sample: the sharded ring td_id={self.td_id!r} holds {what} (pass min_size= or timeout= to wait for data)"
                )
            pause = self._pause(deadline, pause, f"sample: the sharded ring td_id={self.td_id!r} holds {sum(sizes)} items")
        which = torch.multinomial(torch.tensor(weights, dtype=torch.float64), batch_size, replacement=True, generator=generator)
        parts = torch.bincount(which, minlength=len(self._shards)).tolist()
        seeds = torch.randint(0, 1 << 62, (len(self._shards),), generator=generator).tolist()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        kw = {"keys": keys, "prioritized": prioritized, "alpha": alpha, "beta": beta, "timeout": left, **ragged}
        chosen = [k for k, b in enumerate(parts) if b]
        jobs = [(k, self._shards[k].sample, (parts[k], torch.Generator().manual_seed(seeds[k]))) for k in chosen]
        got = self._fan_out([(k, _with_kwargs(fn, kw), args) for k, fn, args in jobs])
        back = torch.argsort(torch.argsort(which, stable=True))  # row j of the pieces (in shard order) goes to position order[j]
        td = self._rows(torch.cat([g.td for g in got], dim=self._stack_pos), back) if len(got) > 1 else got[0].td
        indices = torch.cat([g.indices + self._offsets[k] for k, g in zip(chosen, got)]).index_select(0, back)
        gens = torch.cat([g.generations for g in got]).index_select(0, back)
        if not by_prio:
            return Sample(td, indices, gens)
        probs = torch.cat([g.probabilities * (masses[k] / total) for k, g in zip(chosen, got)]).index_select(0, back)
        low = min(lows[k] for k in range(len(self._shards)) if masses[k] > 0) / total
        return PrioritizedSample(td, indices, gens, weights_of(probs, low, beta), probs)

    @property
    def sampling_policy(self) -> Any:
        return self._shards[0].sampling_policy

    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        """Priorities on every shard (each its own sum tree), at once; see the one-node ring."""
        self._all("enable_priorities", alpha, max_times_sampled=max_times_sampled)

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        """``update_priority`` on each shard touched, at once: which slots were updated."""
        slots, _, groups = self._by_shard(index)
        n = int(slots.numel())
        pr = torch.as_tensor(priority, dtype=torch.float64).reshape(-1)
        pr = pr.expand(n) if pr.numel() == 1 else pr
        if pr.numel() != n:
            raise ValueError(f"got {pr.numel()} priority values for {n} rows")
        gens = None
        if generation is not None:
            from tdstore._ring.args import generations_arg

            gens = generations_arg(generation, n, "update_priority")
        out = torch.zeros(n, dtype=torch.bool)
        jobs = [
            (k, _with_kwargs(self._shards[k].update_priority, {"generation": None if gens is None else gens[rows]}), (local, pr[rows]))
            for k, rows, local in groups
        ]
        for (_, rows, _), ok in zip(groups, self._fan_out(jobs)):
            out[rows] = ok
        return out
