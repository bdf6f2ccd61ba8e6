"""A sharded ring's writes: extend (a batch whole to one shard, shards in turn), append, update_if, item writes."""

from __future__ import annotations

import time
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from tdstore._errors import AmbiguousTimeoutError
from tdstore._format import codec as _codec
from tdstore._ring.extend import RingWrite
from tdstore._ring.policy_calls import priority_tensor
from tdstore._shards import rollout_refusal as _rollouts
from tdstore._shards.fan_out import _with_kwargs
from tdstore._shards.queue import ShardQueue


class ShardWrites(ShardQueue):
    """Writes of a sharded ring."""

    def _batch(self, td: Any) -> TensorDictBase:
        if isinstance(td, (list, tuple)):
            if not td:
                raise ValueError("extend got an empty list: nothing to write")
            elements = [
                e.to_tensordict() if is_tensorclass(e) else TensorDict(e, batch_size=self._layout.inner) if isinstance(e, dict) else e
                for e in td
            ]
            bad = [type(e).__name__ for e in elements if not isinstance(e, TensorDictBase)]
            if bad:
                raise TypeError(f"extend got a list holding {bad[0]}; it takes a list of TensorDicts (one per element)")
            return lazy_stack(elements, dim=self._stack_pos)
        if is_tensorclass(td):
            return td.to_tensordict()
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"extend takes a TensorDict (or a list of them), got {type(td).__name__}")
        return td

    def extend(self, td: Any, *, priority: Any = None, timeout: float | None = None, **rollout: Any) -> RingWrite:
        """Write the elements of ``td`` into one shard's next slots, in one atomic call on its node (a batch
        larger than the shard is cut, one piece per shard, sent at once). Shards are taken in turn by
        each handle, from a random start. Returns the global slots written and their generations.
        Rollout arguments (``version``, ``max_ahead``, ``group``, ``group_size``): ``NotImplementedError``."""
        _rollouts.refuse("extend", **rollout)
        td = self._batch(td)
        sp = self._stack_pos
        bs = td.batch_size
        if len(bs) != len(self._layout.inner) + 1:
            raise ValueError(
                f"a batch for this store must have batch size {list(self._layout.inner)} with the element dim "
                f"inserted at {sp}; got {list(bs)}"
            )
        n = int(bs[sp])
        if not 1 <= n <= self._layout.count:
            raise ValueError(f"extend got {n} elements for a ring of {self._layout.count} slots (1 to {self._layout.count} per call)")
        prios = None
        if priority is not None and not isinstance(priority, (int, float)):
            prios = priority_tensor(priority).reshape(-1)  # a complex or bool one refused before any shard is written
            if prios.numel() == 1:
                priority = float(prios[0])
                prios = None
            elif prios.numel() != n:
                raise ValueError(f"got {prios.numel()} priority values for {n} rows")
        with self._within(timeout, "extend"):
            return self._extend(td, n, priority, prios, timeout)

    def _extend(self, td: TensorDictBase, n: int, priority: Any, prios: torch.Tensor | None, timeout: float | None) -> RingWrite:
        k_total = len(self._shards)
        if n <= min(self._layout.counts) and self._guarded():
            deadline = None if timeout is None else time.monotonic() + timeout  # one for the whole call
            k = self._admitting(n, deadline)
            self._next = (k + 1) % k_total
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return _whole(self._fan_out([(k, self._extend_one, (k, td, priority, left))], write=True))
        jobs = []
        k, start = self._next, 0
        while start < n:
            take = min(n - start, self._layout.counts[k])
            piece = td if take == n else self._rows(td, slice(start, start + take))
            p = priority if prios is None else prios[start : start + take]
            jobs.append((k, self._extend_one, (k, piece, p, timeout)))
            start += take
            k = (k + 1) % k_total
        self._next = k
        return _whole(self._fan_out(jobs, write=True))

    def _extend_one(self, k: int, piece: TensorDictBase, priority: Any, timeout: float | None) -> RingWrite | AmbiguousTimeoutError:
        """Shard ``k``'s part of an extend, at global slots. A part that may have run is returned as its
        ``AmbiguousTimeoutError`` (retrying at global slots), not raised: the parts that ran are kept for
        the whole call's retry (:func:`_whole`)."""
        offset = self._offsets[k]
        try:
            return _shifted(self._shards[k].extend(piece, priority=priority, timeout=timeout), offset)
        except AmbiguousTimeoutError as err:
            return _shifted_error(err, offset)

    def append(self, td: Any, *, priority: Any = None, timeout: float | None = None, **rollout: Any) -> RingWrite:
        """``extend`` with one element (a tensordict of the inner batch size)."""
        _rollouts.refuse("append", **rollout)
        if isinstance(td, dict):
            td = TensorDict(td, batch_size=self._layout.inner)
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"append expects a TensorDict or a dict, got {type(td).__name__}")
        return self.extend(td.unsqueeze(self._stack_pos), priority=priority, timeout=timeout)

    def update_if(self, index: Any, generation: Any, td: Any) -> torch.Tensor:
        """``update_if`` of each shard touched, at once: which rows were applied (see the one-node ring)."""
        from tdstore._ring.args import generations_arg

        slots, scalar, groups = self._by_shard(index)
        gens = generations_arg(generation, int(slots.numel()), "update_if")
        if scalar:
            td = td.unsqueeze(self._stack_pos)
        out = torch.zeros(int(slots.numel()), dtype=torch.bool)
        jobs = [(k, self._shards[k].update_if, (local, gens[rows], self._rows(td, rows))) for k, rows, local in groups]
        for (_, rows, _), applied in zip(groups, self._fan_out(jobs, write=True)):
            out[rows] = applied
        return out

    def set_at_(self, key: Any, value: Any, index: Any, **kwargs: Any) -> Any:
        """``value`` into ``key`` at global slots ``index``: each shard touched writes its slots, all at once
        (torchrl's ``set_at_``, ``set_`` and ``rb[key] = value`` on its storage's rows write through this)."""
        slots, scalar, groups = self._by_shard(index)
        set_at = [_with_kwargs(self._shards[k].set_at_, kwargs) for k, _, _ in groups]
        self._fan_out(
            [
                (k, fn, (key, self._part(value, rows, scalar), int(local[0]) if scalar else local))
                for fn, (k, rows, local) in zip(set_at, groups)
            ],
            write=True,
        )
        return self

    def update_at_(self, input_dict_or_td: Any, index: Any, **kwargs: Any) -> Any:
        """``input_dict_or_td``'s keys at global slots ``index``, each shard touched its own, all at once (torchrl's ``update_``)."""
        slots, scalar, groups = self._by_shard(index)
        update_at = [_with_kwargs(self._shards[k].update_at_, kwargs) for k, _, _ in groups]
        self._fan_out(
            [
                (k, fn, (self._part(input_dict_or_td, rows, scalar), int(local[0]) if scalar else local))
                for fn, (k, rows, local) in zip(update_at, groups)
            ],
            write=True,
        )
        return self

    def _part(self, value: Any, rows: torch.Tensor, scalar: bool) -> Any:
        """The rows ``rows`` (along the stack dim) of a value written at several slots: a tensor's, a tensordict's,
        a dict's values'; anything else (a number, a value of one slot) goes to every shard as it is."""
        if scalar:
            return value
        if isinstance(value, TensorDictBase):
            return self._rows(value, rows) if value.batch_dims > self._stack_pos else value
        if isinstance(value, dict):
            return {k: self._part(v, rows, scalar) for k, v in value.items()}
        if isinstance(value, torch.Tensor) and value.dim() > self._stack_pos:
            return _codec.index_select(value, self._stack_pos, rows)
        return value

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, int) and not isinstance(index, bool):
            slots, _, groups = self._by_shard(index)
            k, _, local = groups[0]
            self._fan_out([(k, self._shards[k].__setitem__, (int(local[0]), value))], write=True)
            return
        slots, _, groups = self._by_shard(index)
        self._fan_out([(k, self._shards[k].__setitem__, (local, self._rows(value, rows))) for k, rows, local in groups], write=True)


def _shifted(w: RingWrite, offset: int) -> RingWrite:
    """A shard's ``RingWrite`` at the ring's global slots."""
    return RingWrite(w.indices + offset, w.generations)


def _shifted_error(err: AmbiguousTimeoutError, offset: int) -> AmbiguousTimeoutError:
    """A shard's ambiguous extend whose ``retry()`` answers at the ring's global slots (the shard's own
    retry resends under the shard call's request id: its rows are written once)."""

    def resend(timeout: float | None) -> RingWrite:
        try:
            return _shifted(err.retry(timeout), offset)
        except AmbiguousTimeoutError as again:
            raise _shifted_error(again, offset) from again

    return AmbiguousTimeoutError(str(err), request_id=err.request_id, resend=resend)


def _whole(parts: list[RingWrite | AmbiguousTimeoutError]) -> RingWrite:
    """The ``RingWrite`` of an extend from its shards' parts, in order; ``AmbiguousTimeoutError`` if a part may
    have run without its reply: its ``retry()`` resends only those parts (each under its own request id)
    and answers for the whole call, the parts that ran included."""
    pending = [p for p in parts if isinstance(p, AmbiguousTimeoutError)]
    if not pending:
        done = [p for p in parts if isinstance(p, RingWrite)]
        return RingWrite(torch.cat([w.indices for w in done]), torch.cat([w.generations for w in done]))

    def resend(timeout: float | None) -> RingWrite:
        again: list[RingWrite | AmbiguousTimeoutError] = []
        for p in parts:
            if isinstance(p, AmbiguousTimeoutError):
                try:
                    p = p.retry(timeout)
                except AmbiguousTimeoutError as still:
                    p = still
            again.append(p)
        return _whole(again)

    first = pending[0]
    raise AmbiguousTimeoutError(str(first), request_id=first.request_id, resend=resend)
