"""A sharded ring's writes: extend (whole to a shard with room in its lap, else cut over the shards: :func:`place`),
append, update_if, item writes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, lazy_stack

from tdstore._errors import AmbiguousTimeoutError
from tdstore._format import codec
from tdstore._ring.extend import RingWrite
from tdstore._ring.policy_calls import priority_tensor
from tdstore._shards import rollout_refusal
from tdstore._shards.fan_out import _with_kwargs
from tdstore._shards.queue import ShardQueue


class ShardWrites(ShardQueue):
    """Writes of a sharded ring."""

    _rw: list[int | None] | None  # each shard's ring writes as this handle last saw them (None: read them at the next extend)
    _shared: bool  # another handle's writes were seen: the counts are read before each extend

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
        """Write the elements of ``td`` into the shards' next slots: whole to one shard (one atomic call on its
        node) when its current lap has room for them, else cut over the shards with room, one part per shard,
        each atomic on its shard, sent at once (:func:`place`). A ring of ``count`` slots so holds ``count``
        rows before any is overwritten, whatever the extend sizes. Shards are taken in turn by each handle,
        from a random start. Returns the global slots written and their generations, in the rows' order.
        Rollout arguments (``version``, ``max_ahead``, ``group``, ``group_size``): ``NotImplementedError``."""
        rollout_refusal.refuse("extend", **rollout)
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
        deadline = None if timeout is None else time.monotonic() + timeout  # one for the whole call
        start = self._next
        if not self._guarded() and (self._rw is None or self._shared):
            # this handle's first extend (or the first since a failed one), or other handles write too (their rows
            # moved the counts): the counts read first, one round trip, every shard at once (adopting a policy set elsewhere)
            self._rw = [None if h is None else h.get("rw") for h in self._heads()]
        if self._guarded():
            if n <= min(self._layout.counts):
                start, self._rw = self._admitting(n, deadline)  # the least written shard that admits it: fresh counts
            else:
                self._rw = [None if h is None else h.get("rw") for h in self._heads()]
        counts_seen: list[int | None] = self._rw if self._rw is not None else [None] * len(self._shards)
        plan = place(n, counts_seen, self._layout.counts, start, self._part_rows(td, n))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        jobs, order = [], []
        for k, spans in plan:
            rows = torch.cat([torch.arange(lo, hi) for lo, hi in spans]) if len(spans) > 1 else None
            piece = td if spans == [(0, n)] else self._rows(td, rows if rows is not None else slice(*spans[0]))
            idx = rows if rows is not None else torch.arange(*spans[0])
            p = priority if prios is None else prios[idx]
            jobs.append((k, self._extend_one, (k, piece, p, left if timeout is not None else None)))
            order.append(idx)
        self._next = (plan[-1][0] + 1) % len(self._shards)
        try:
            parts = self._fan_out(jobs, write=True)
        except BaseException:
            self._rw = None  # a part may have run: read the counts again next time
            raise
        known = self._rw
        for (k, _), part in zip(plan, parts):
            if isinstance(part, RingWrite) and known is not None and known[k] is not None:
                after = _writes_after(part, self._offsets[k], self._layout.counts[k])  # the shard's count at this write
                if after > int(known[k] or 0) + part.indices.numel():
                    self._shared = True  # another handle wrote this shard since this one read it: read before each extend
                known[k] = after
            elif known is not None:
                known[k] = None
        if known is not None and any(v is None for v in known):
            self._rw = None  # a shard did not answer (or may not have run its part): read the counts again next time
        return _whole(parts, order, n)

    def _part_rows(self, td: TensorDictBase, n: int) -> int:
        """The most rows of ``td`` one shard's part should carry: a segment's worth of bytes (``segment_bytes``,
        4 MiB by default), at least ``n / K`` (so ``K`` parts hold the batch). The server holds a call's
        arguments twice while it runs (a large argument, and a query buffer of its size made ready for the
        next one, kept until the connection idles), so a node near ``maxmemory`` refuses a call of more than
        half its free bytes: a batch cut over the shards in parts of at most a segment fits where it would not
        whole (issue 39: extends of 100 rows of 64 KiB on 64 MB nodes)."""
        try:
            row_bytes = max(1, int(td.bytes()) // n)
        except Exception:  # noqa: BLE001 - a batch whose size tensordict cannot tell (non-tensor data): no cap
            return n
        segment = self._shards[0]._engine.segment_size
        return max(1, segment // row_bytes, -(-n // len(self._shards)))

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
        rollout_refusal.refuse("append", **rollout)
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
            return codec.index_select(value, self._stack_pos, rows)
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


def _whole(parts: list[RingWrite | AmbiguousTimeoutError], order: list[torch.Tensor], n: int) -> RingWrite:
    """The ``RingWrite`` of an extend from its shards' parts (part ``i`` wrote the call's rows ``order[i]``),
    in the rows' order; ``AmbiguousTimeoutError`` if a part may have run without its reply: its ``retry()``
    resends only those parts (each under its own request id) and answers for the whole call, the parts that
    ran included."""
    pending = [p for p in parts if isinstance(p, AmbiguousTimeoutError)]
    if not pending:
        indices = torch.empty(n, dtype=torch.int64)
        gens = torch.empty(n, dtype=torch.int64)
        for p, rows in zip(parts, order):
            assert isinstance(p, RingWrite)
            indices[rows] = p.indices.to(torch.int64)
            gens[rows] = p.generations.to(torch.int64)
        return RingWrite(indices, gens)

    def resend(timeout: float | None) -> RingWrite:
        again: list[RingWrite | AmbiguousTimeoutError] = []
        for p in parts:
            if isinstance(p, AmbiguousTimeoutError):
                try:
                    p = p.retry(timeout)
                except AmbiguousTimeoutError as still:
                    p = still
            again.append(p)
        return _whole(again, order, n)

    first = pending[0]
    raise AmbiguousTimeoutError(str(first), request_id=first.request_id, resend=resend)


def _writes_after(w: RingWrite, offset: int, count: int) -> int:
    """A shard's ring write count right after its part ``w`` (global slots; ``count``: the shard's): the
    position of its last row plus one (slot ``s`` of generation ``g`` is ring write ``(g - 1) * count + s``)."""
    last = int(w.indices[-1]) - offset
    return (int(w.generations[-1]) - 1) * count + last + 1


def place(
    n: int, writes: Sequence[int | None], counts: Sequence[int], start: int, part_rows: int | None = None
) -> list[tuple[int, list[tuple[int, int]]]]:
    """Which shard takes which rows of an extend of ``n`` rows: ``[(shard, [(lo, hi), ...]), ...]``, each
    shard once, its rows in order, by the shards' ring write counts ``writes`` (None: unknown, its node did
    not answer: given rows only if no other shard can take them) and slot ``counts``.

    The shards fill in *laps*: lap ``L`` ends when shard ``k`` has had ``L * counts[k]`` ring writes, and
    no shard starts lap ``L + 1`` (overwrites its oldest row) before every shard has ended lap ``L``. So
    a ring of ``count`` slots holds ``count`` rows before one is overwritten, and then overwrites about
    its oldest rows (each shard's oldest, the shards a lap apart at most). The rows go whole to the first
    shard, in turn from ``start``, whose lap has room for them; else they are cut: each shard in turn takes
    what its lap has room for, and once every lap is full the next lap is started the same way (a shard
    takes at most ``counts[k]`` rows of one call). ``part_rows``: a shard's part holds at most that many rows
    while the shards' laps have room for the batch in such parts (a call's bytes in flight per node; see
    ``ShardWrites._part_rows``); None: no such bound."""
    k_total = len(counts)
    order = [(start + i) % k_total for i in range(k_total)]
    known = [k for k in range(k_total) if writes[k] is not None]
    if not known:  # no shard answered: in turn, as the call will tell (ShardUnavailableError, TimeoutError)
        return [(start, [(0, n)])] if n <= counts[start] else _cut_in_turn(n, counts, order)
    rw = {k: int(writes[k] or 0) for k in known}
    lap = min(rw[k] // counts[k] for k in known) + 1
    room = {k: max(0, lap * counts[k] - rw[k]) for k in known}
    cap = n if part_rows is None else max(1, part_rows)
    for k in order:
        if k in room and room[k] >= n and n <= cap:
            return [(k, [(0, n)])]
    parts: dict[int, list[tuple[int, int]]] = {}
    taken = dict.fromkeys(range(k_total), 0)
    at = 0
    while at < n:
        moved = False
        for k in order:
            if k not in room:
                continue
            take = min(room[k], n - at, counts[k] - taken[k], cap - taken[k])
            if take > 0:
                spans = parts.setdefault(k, [])
                if spans and spans[-1][1] == at:
                    spans[-1] = (spans[-1][0], at + take)
                else:
                    spans.append((at, at + take))
                at, rw[k], room[k], taken[k], moved = at + take, rw[k] + take, room[k] - take, taken[k] + take, True
                if at == n:
                    break
        if not moved and cap < n and all(taken[k] >= min(cap, counts[k]) or room[k] == 0 for k in known) and any(room.values()):
            cap = n  # the parts are as large as they may be and rows are left: larger parts
            continue
        if not moved:  # every lap full (or its shards took all they may in one call): the next lap
            lap += 1
            room = {k: max(0, lap * counts[k] - rw[k]) for k in known}
            if all(counts[k] == taken[k] for k in known):
                return _cut_in_turn(n, counts, order)  # (cannot be: n <= sum(counts); kept for safety)
    return list(parts.items())


def _cut_in_turn(n: int, counts: Sequence[int], order: list[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """``n`` rows cut in turn over the shards, each taking up to its count (no counts known)."""
    out, at = [], 0
    for k in order:
        if at == n:
            break
        take = min(counts[k], n - at)
        out.append((k, [(at, at + take)]))
        at += take
    return out
