"""A sharded ring's samples (uniform and by priority, exactly the one-node distribution) and its priorities."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch

from tdstore._format.sampling_policy import SamplingPolicy
from tdstore._plan.padded_batch import check_padding, pad_rows
from tdstore._ring import marks
from tdstore._ring.extend import Sample
from tdstore._ring.marks import Marks
from tdstore._ring.policy_calls import PrioritizedSample, priority_tensor, weights_of
from tdstore._shards import rollout_refusal
from tdstore._shards.fan_out import _POLL_S, ShardsBase, _with_kwargs
from tdstore._shards.queue import _policies


class ShardSampling(ShardsBase):
    """Sampling and priorities of a sharded ring."""

    _full: list[bool]
    _cached: tuple[list[int], list[float], list[float]] | None  # each shard's size, mass and smallest weight, as last seen
    _ratio: float  # the last split's largest (current / cached share): how many candidates the next one adds

    def _sizes(self) -> list[int]:
        """Items each shard holds, read at once; a full shard (it stays full) is not read again. Each read carries
        its shard's header version: a header another handle changed (enabled priorities, say) is adopted."""
        todo = [k for k in range(len(self._shards)) if not self._full[k]]
        jobs = [(k, _with_kwargs(self._shards[k]._engine.ring_writes, {"fresh": True}), ()) for k in todo]
        got = dict(zip(todo, self._fan_out(jobs))) if todo else {}
        out = []
        for k, c in enumerate(self._layout.counts):
            n = c if self._full[k] else min(got[k], c)
            self._full[k] = n >= c
            out.append(n)
        return out

    def sample_seen(self, batch_size: int, generator: torch.Generator | None = None) -> Sample:
        """A uniform sample of the whole ring (``sample(prioritized=False)``): shards are read by script, so the
        client-side draw of a one-node ring (``tdstore.Ring.sample_seen``) has nothing to save here."""
        got = self.sample(batch_size, generator, prioritized=False)
        assert not isinstance(got, PrioritizedSample)
        return got

    def filled(self, *, fresh: bool = False) -> int:
        """Items the ring holds: no round trip once every shard was seen full; else the shards not seen full are read
        at once (``fresh``: every shard)."""
        if fresh:
            self._full = [False] * len(self._shards)
        return sum(self._sizes())

    def _prioritized(self) -> bool:
        """Whether the ring has priorities, as this handle last saw any shard's header (priorities, once enabled,
        stay: any shard seen with them tells, whichever of the shards' reads and calls refreshed it)."""
        return any(pol is not None and pol.prioritized for pol in _policies(self._shards))

    def _mass_of(self, k: int) -> tuple[int, float, float]:
        """Shard ``k``'s size, priority mass (root of its sum tree) and smallest positive weight: one pipeline, which
        also reads the header version (a header another handle changed is adopted)."""
        engine = self._shards[k]._engine
        c = self._layout.counts[k]
        # one round trip (both keys are in the shard's slot), on the shard's node, within the call's deadline
        head, root = engine.commands(
            [("HMGET", engine.keys.meta, "rw", "na", "version"), ("GETRANGE", engine.keys.priorities, *((0, 7) if c == 1 else (-16, -1)))]
        )
        engine.adopt_version(head[2])
        rw = engine.ring_writes_from(head[0], head[1])
        if not root:
            return min(rw, c), 0.0, 0.0
        vals = np.frombuffer(root, dtype="<f8")
        total = float(vals[0])
        low = float(vals[1]) if len(vals) > 1 else total
        if not (math.isfinite(total) and total >= 0 and math.isfinite(low) and low >= 0):
            raise KeyError(f"shard {k} of the sharded ring td_id={self.td_id!r} has a damaged priority tree")
        return min(rw, c), total, low

    def _masses(self) -> tuple[list[int], list[float], list[float]]:
        """Each shard's size, priority mass and smallest positive weight, read at once."""
        got = self._fan_out([(k, self._mass_of, (k,)) for k in range(len(self._shards))])
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
        max_staleness: int | None = None,
        groups: int | None = None,
        **ragged: Any,
    ) -> Sample | PrioritizedSample:
        """A batch of ``batch_size`` written slots drawn with replacement over every shard, exactly as one ring
        would draw them (uniformly, or by priority on a ring with priorities): see the module docstring.
        Arguments and result as ``LazyStackedTensorDictStore.sample`` (indices are global slots);
        ``max_staleness``/``groups`` (rollouts): ``NotImplementedError``."""
        rollout_refusal.refuse("sample", max_staleness=max_staleness, groups=groups)
        from tdstore._plan.ring_plan import check_sample_args

        check_sample_args(batch_size, min_size, beta)
        with self._within(timeout, "sample"):
            if ragged and len(self._shards) > 1:
                # shards pad to their own longest rows: the rows are read as they are and padded once joined
                check_padding(ragged)
                got = self._sample(batch_size, generator, keys, prioritized, alpha, beta, min_size, timeout, {})
                return got._replace(td=pad_rows(got.td, ragged))
            return self._sample(batch_size, generator, keys, prioritized, alpha, beta, min_size, timeout, ragged)

    def _sample(
        self,
        batch_size: int,
        generator: torch.Generator | None,
        keys: Sequence[Any] | None,
        prioritized: bool | None,
        alpha: float | None,
        beta: float,
        min_size: int | None,
        timeout: float | None,
        ragged: dict[str, Any],
    ) -> Sample | PrioritizedSample:
        if min_size is not None and min_size > self._layout.count:
            raise ValueError(f"min_size={min_size} can never be reached by a ring of {self._layout.count} slots")
        by_prio = self._prioritized() if prioritized is None else bool(prioritized)
        if by_prio and not self._prioritized():
            self._shards[0]._engine.set_header(self._shards[0]._engine.fetch_header())
            if not self._prioritized():
                raise ValueError(f"the sharded ring td_id={self.td_id!r} has no priorities: call enable_priorities(alpha=...) first")
        kw = {"keys": keys, "prioritized": prioritized, "alpha": alpha, "beta": beta, **ragged}
        if by_prio and min_size is None and timeout is None and self._guessable():
            guessed = self._sample_on_cached(batch_size, generator, kw, beta)
            if guessed is not None:
                return guessed
        deadline = None if timeout is None else time.monotonic() + timeout
        sizes, weights, lows = self._weights(by_prio, min_size, timeout, deadline)
        if prioritized is None and not by_prio and self._prioritized():
            by_prio = True  # the sizes' read adopted priorities another handle enabled: the split goes by the masses
            sizes, weights, lows = self._weights(by_prio, min_size, timeout, deadline)
        if by_prio:
            self._cached = (sizes, weights, lows)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        which, chosen, got = self._draw(batch_size, generator, weights, {**kw, "timeout": left})
        if prioritized is None and not by_prio and any(isinstance(g, PrioritizedSample) for g in got):
            # the shards' samples adopted priorities that no read saw (full shards are not asked their size):
            # these rows were split by size, so draw again, by the masses (this handle now knows the policy)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._sample(batch_size, generator, keys, prioritized, alpha, beta, min_size, left, ragged)
        return self._assemble(chosen, got, _back(which, len(chosen)), weights, lows, beta, by_prio)

    def _weights(
        self, by_prio: bool, min_size: int | None, timeout: float | None, deadline: float | None
    ) -> tuple[list[int], list[float], list[float]]:
        """Each shard's size, weight (size, or priority mass) and smallest weight, read at once; waiting (polling)
        for ``min_size`` items or a positive mass when given a ``min_size`` or ``timeout``."""
        pause = _POLL_S[0]
        while True:
            if by_prio:
                sizes, weights, lows = self._masses()
            else:
                sizes = self._sizes()
                weights, lows = [float(s) for s in sizes], []
            if sum(weights) > 0 and (min_size is None or sum(sizes) >= min_size):
                return sizes, weights, lows
            if min_size is None and timeout is None:
                what = "no slot with a positive priority" if by_prio and sum(sizes) > 0 else "nothing written yet"
                raise ValueError(
                    f"cannot sample: the sharded ring td_id={self.td_id!r} holds {what} (pass min_size= or timeout= to wait for data)"
                )
            pause = self._pause(deadline, pause, f"sample: the sharded ring td_id={self.td_id!r} holds {sum(sizes)} items")

    def _draw(
        self, batch_size: int, generator: torch.Generator | None, weights: list[float], kw: dict[str, Any]
    ) -> tuple[torch.Tensor, list[int], list[Any]]:
        """Each of ``batch_size`` rows given a shard by one multinomial draw over ``weights``, each shard's rows
        sampled on its node, all at once: (the shard of each row, the shards sampled, their samples)."""
        which = torch.multinomial(torch.tensor(weights, dtype=torch.float64), batch_size, replacement=True, generator=generator)
        parts = torch.bincount(which, minlength=len(self._shards)).tolist()
        seeds = torch.randint(0, 1 << 62, (len(self._shards),), generator=generator).tolist()
        chosen = [k for k, b in enumerate(parts) if b]
        jobs = [(k, _with_kwargs(self._shards[k].sample, kw), (parts[k], torch.Generator().manual_seed(seeds[k]))) for k in chosen]
        return which, chosen, self._fan_out(jobs)

    def _assemble(
        self,
        chosen: list[int],
        got: list[Any],
        rows: torch.Tensor | None,
        masses: list[float],
        lows: list[float],
        beta: float,
        by_prio: bool,
    ) -> Sample | PrioritizedSample:
        """Rows ``rows`` (None: all) of the shards' samples ``got`` (concatenated in shard order), with global slots; by priority,
        their probabilities ``mass_k / mass`` times their shard's and weights by the smallest probability of all shards."""
        td: Any = torch.cat([g.td for g in got], dim=self._stack_pos) if len(got) > 1 else got[0].td
        indices = torch.cat([g.indices + self._offsets[k] for k, g in zip(chosen, got)])
        gens = torch.cat([g.generations for g in got])
        if rows is not None:
            td, indices, gens = self._rows(td, rows), indices.index_select(0, rows), gens.index_select(0, rows)
        if not by_prio:
            return Sample(td, indices, gens)
        total = sum(masses)
        probs = torch.cat([g.probabilities * (masses[k] / total) for k, g in zip(chosen, got)])
        probs = probs if rows is None else probs.index_select(0, rows)
        low = min(lows[k] for k in range(len(self._shards)) if masses[k] > 0) / total
        return PrioritizedSample(td, indices, gens, weights_of(probs, low, beta), probs)

    # -- one round trip on the masses the last sample saw (see lua/README.md, Sharded rings) --
    def _guessable(self) -> bool:
        """Whether a prioritized sample may split on cached masses: there are some, and no shard's sample counts
        (a rate limiter or ``max_times_sampled`` would count the rows drawn and then dropped), as this handle last saw
        every shard's header (the shards' calls refresh them; no read is added to know it)."""
        pols = _policies(self._shards)
        return self._cached is not None and all(pol is None or (pol.limit is None and pol.max_times is None) for pol in pols)

    def _sample_on_cached(
        self, batch_size: int, generator: torch.Generator | None, kw: dict[str, Any], beta: float
    ) -> PrioritizedSample | None:
        """Candidates split over the shards by the cached masses ``q``, each shard sampling its part and answering its
        current mass ``p`` in the same call (shards with no part read it): one round trip. A candidate of shard ``k``
        is kept with probability ``(p_k / q_k) / max_j (p_j / q_j)`` (rejection sampling: the kept rows are i.i.d.
        by the current masses); the first ``batch_size`` kept are the sample, a shortfall is drawn by the current
        masses in a second round trip. None (nothing sampled) when a shard's mass could not be read."""
        assert self._cached is not None
        k_total = len(self._shards)
        q = torch.tensor(self._cached[1], dtype=torch.float64)
        q = q / q.sum()
        over = self._ratio - 1.0  # the last call's excess: a few more candidates than rows, as many as it would reject
        n = batch_size + (math.ceil(batch_size * over + 3 * math.sqrt(batch_size * over) + 1) if over > 0 else 0)
        which = torch.multinomial(q, n, replacement=True, generator=generator)
        parts = torch.bincount(which, minlength=k_total).tolist()
        seeds = torch.randint(0, 1 << 62, (k_total,), generator=generator).tolist()
        coins = torch.rand(n, generator=generator, dtype=torch.float64)
        got = self._fan_out([(k, self._sample_with_mass, (k, parts[k], seeds[k], kw)) for k in range(k_total)])
        sizes, masses, lows = [g[1] for g in got], [g[2] for g in got], [g[3] for g in got]
        if any(not math.isfinite(m) for m in masses) or sum(masses) <= 0:
            self._cached = None
            return None
        self._cached = (sizes, masses, lows)
        p = torch.tensor(masses, dtype=torch.float64) / sum(masses)
        ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.zeros_like(p))
        top = float(ratio.max())
        if bool(((q == 0) & (p > 0)).any()):
            kept = torch.zeros(0, dtype=torch.int64)  # a shard the split could not reach: no candidate stands
            self._ratio = 2.0
        else:
            kept = (coins < (ratio / top)[which]).nonzero().reshape(-1)[:batch_size]
            self._ratio = top
        chosen = [k for k in range(k_total) if got[k][0] is not None]  # a shard found without mass drew nothing
        out = None
        if kept.numel():
            placed = torch.where(torch.tensor([g[0] is not None for g in got])[which], which, k_total)  # those last
            out = self._assemble(chosen, [got[k][0] for k in chosen], _positions(placed).index_select(0, kept), masses, lows, beta, True)
        if kept.numel() < batch_size:
            which2, chosen2, got2 = self._draw(batch_size - kept.numel(), generator, masses, {**kw, "timeout": None})
            more = self._assemble(chosen2, got2, _back(which2, len(chosen2)), masses, lows, beta, True)
            out = more if out is None else self._cat(out, more)
        assert isinstance(out, PrioritizedSample)
        return out

    def _sample_with_mass(self, k: int, n: int, seed: int, kw: dict[str, Any]) -> tuple[Any, int, float, float]:
        """Shard ``k``'s prioritized sample of ``n`` rows and its size, mass and smallest weight as it drew them
        (with ``n`` 0, only those, read); mass 0 when the shard has no slot of positive priority."""
        from tdstore._format.ragged import KEYWORDS, wanted
        from tdstore._plan.values import as_path
        from tdstore._ring import sample_pop

        if n == 0:
            return (None, *self._mass_of(k))
        shard = self._shards[k]
        keys = kw.get("keys")
        keys = [keys] if isinstance(keys, (str, tuple)) else keys
        ragged = {f: v for f, v in kw.items() if f not in ("keys", "prioritized", "alpha", "beta", "timeout")}
        if ragged and not wanted(ragged):
            raise TypeError(f"sample takes as_padded_tensor=True or as_nested_tensor=True (with {sorted(KEYWORDS)}), got {sorted(ragged)}")
        heads: list[tuple[float, float, int]] = []
        try:
            got = sample_pop.sample(
                shard._engine, n, torch.Generator().manual_seed(seed), shard._device, ragged or None,
                None if keys is None else [as_path(x) for x in keys], prioritized=True, alpha=kw.get("alpha"), beta=kw["beta"], heads=heads,
            )  # fmt: skip
        except ValueError:
            size, mass, low = self._mass_of(k)
            if mass > 0:
                raise
            return None, size, 0.0, 0.0
        mass, low_prob, rw = heads[-1] if heads else (math.nan, 0.0, 0)
        return got, min(rw, self._layout.counts[k]), mass, low_prob * mass

    def _cat(self, a: Any, b: Any) -> PrioritizedSample:
        td: Any = torch.cat([a.td, b.td], dim=self._stack_pos)
        return PrioritizedSample(td, *(torch.cat([x, y]) for x, y in zip(a[1:], b[1:])))

    @property
    def sampling_policy(self) -> Any:
        return self._shards[0].sampling_policy

    def marks(self) -> Marks:
        """Every shard's marks, read at once: counts summed, bases the largest (``_ring.marks.add_up``)."""
        return marks.add_up(self._all("marks"))

    def set_marks_base(self, generation_base: int, write_base: int) -> None:
        """The same bases on every shard, at once."""
        self._all("set_marks_base", generation_base, write_base)

    @contextmanager
    def counting_in_place(self) -> Iterator[None]:
        """Within: this thread's writes count as in-place writes on whichever shard they land."""
        with ExitStack() as stack:
            for s in self._shards:
                stack.enter_context(s.counting_in_place())
            yield

    def sampling_policies(self) -> list[SamplingPolicy]:
        """Each shard's policy (a limiter's sizes are split over the shards), read at once."""
        return [p for each in self._all("sampling_policies") for p in each]

    def restore_sampling_policies(self, policies: Sequence[SamplingPolicy]) -> None:
        """Each shard gets its policy of ``policies`` (``sampling_policies()`` of a ring of as many shards)."""
        if len(policies) != len(self._shards):
            raise ValueError(f"this sharded ring has {len(self._shards)} shards, got {len(policies)} sampling policies")
        self._fan_out([(k, s.restore_sampling_policies, ([p],)) for k, (s, p) in enumerate(zip(self._shards, policies))])

    def enable_priorities(self, alpha: float = 1.0, *, max_times_sampled: int | None = None) -> None:
        """Priorities on every shard (each its own sum tree), at once; see the one-node ring."""
        self._all("enable_priorities", alpha, max_times_sampled=max_times_sampled)

    def update_priority(self, index: Any, priority: Any, *, generation: Any = None) -> torch.Tensor:
        """``update_priority`` on each shard touched, at once: which slots were updated."""
        slots, _, groups = self._by_shard(index)
        n = int(slots.numel())
        pr = priority_tensor(priority).reshape(-1)
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
        for (_, rows, _), ok in zip(groups, self._fan_out(jobs, write=True)):
            out[rows] = ok
        return out


def _back(which: torch.Tensor, pieces: int) -> torch.Tensor | None:
    """Where each row of a draw (its shard: ``which``) is among the shards' pieces concatenated in shard order
    (None: in order already, one piece)."""
    return None if pieces == 1 else _positions(which)


def _positions(which: torch.Tensor) -> torch.Tensor:
    return torch.argsort(torch.argsort(which, stable=True))
