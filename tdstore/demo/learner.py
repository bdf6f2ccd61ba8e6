"""The demo's learner: it samples the store while the actors write, checks every sampled element,
and at the end checks the whole store against what the actors report they wrote.

The learner samples either uniformly at random (the store placed by a hash of each write) or
through a replay buffer (:class:`RingLearner` on the store's own calls, or a torchrl buffer):
then the server picks the rows by priority and the learner writes priorities back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore.demo.actors import ActorPool, ActorReport
from tdstore.demo.report import Progress
from tdstore.demo.torn_check import MAX_EXAMPLES, check_batch, lost_writes, token_rows
from tdstore.lazy import LazyStackedTensorDictStore

__all__ = ["RingLearner", "Tally", "figures", "sample_until", "verify_final"]

#: Seconds between two progress updates (and checks that no actor died).
TICK = 0.2
#: Seconds the learner's first draw may take. Only a stalled server makes it slow (the rate limiter
#: never holds a learner that has sampled nothing), so this bounds a failure, not the run.
FIRST_DRAW_TIMEOUT = 60.0


class RingLearner:
    """The learner's side of ``tdstore demo --replay``: the calls the demo's loop makes on a torchrl
    buffer, made on the store itself (``sample`` by priority, ``update_priority`` where not overwritten)."""

    def __init__(self, store: LazyStackedTensorDictStore, batch: int) -> None:
        self.store, self.batch = store, batch
        self.sampler = self  # the loop sets ``rb.sampler.timeout``
        self.timeout: float | None = None
        self._gen: torch.Generator | None = None
        self._last: Any = None

    def set_rng(self, gen: torch.Generator) -> None:
        """The generator the draws use (the learner's seed)."""
        self._gen = gen

    def sample(self) -> TensorDictBase:
        """One batch drawn by priority, with its slots as ``index`` (as a torchrl buffer returns it)."""
        s = self.store.sample(self.batch, self._gen, beta=0.4, timeout=self.timeout)
        self._last = s
        return s.td.set("index", s.indices)

    def update_tensordict_priority(self, td: TensorDictBase) -> None:
        """Write ``td_error`` back as the priorities of the last batch's rows, where not overwritten since."""
        self.store.update_priority(self._last.indices, td.get("td_error"), generation=self._last.generations)


@dataclass
class Tally:
    """What the learner saw while sampling."""

    reads: int = 0
    """Batches read."""
    torn: int = 0
    """Torn elements seen."""
    examples: list[str] = field(default_factory=list)
    """The first :data:`MAX_EXAMPLES` torn elements, described."""
    seconds: float = 0.0
    """How long the learner sampled."""

    def record(self, bad: dict[int, list[str]]) -> None:
        """Count the torn elements of the batch just read (``check_batch``'s result)."""
        self.torn += len(bad)
        for k, problems in bad.items():
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"batch {self.reads}, position {k}: " + "; ".join(problems))


def sample_until(
    store: LazyStackedTensorDictStore,
    rb: Any,
    pool: ActorPool,
    bar: Progress,
    gen: torch.Generator,
    *,
    seconds: float,
    count: int,
    actors: int,
    batch: int,
) -> Tally:
    """Release the actors, then sample and check batches for ``seconds`` (or until the rate limiter
    holds the learner past the end); every :data:`TICK`, update the progress and check the actors.

    The learner reads at least once, however late it gets to its first draw, and that draw may
    take :data:`FIRST_DRAW_TIMEOUT`: a run's figures always show what the learner read.
    """
    placed = rb is None
    tally = Tally()
    pool.go()
    t0 = time.monotonic()
    end = t0 + seconds
    next_tick = t0 + TICK
    now = t0
    while tally.reads == 0 or (now := time.monotonic()) < end:
        left = max(end - now, FIRST_DRAW_TIMEOUT) if tally.reads == 0 else max(0.0, end - now)
        drawn = _draw(store, rb, gen, count=count, batch=batch, left=left)
        if drawn is None:
            break
        sampled, idx = drawn
        tally.reads += 1
        tally.record(check_batch(sampled, idx, count=count, actors=actors, placed=placed))
        if now >= next_tick:
            next_tick = now + TICK
            pool.raise_if_failed()
            bar.update(now - t0, pool.writes(), tally.reads, tally.torn)
    tally.seconds = time.monotonic() - t0
    return tally


def _draw(
    store: LazyStackedTensorDictStore, rb: Any, gen: torch.Generator, *, count: int, batch: int, left: float
) -> tuple[TensorDictBase, Any] | None:
    """One batch and the slots it was read at; ``None`` when the rate limiter held the learner ``left`` seconds."""
    if rb is None:
        idx = torch.randint(count, (batch,), generator=gen)
        return store[idx], idx
    rb.sampler.timeout = left  # the rate limiter may hold the learner: not past the run's end
    try:
        sampled = rb.sample()  # one round trip: the server draws by priority and reads the rows
    except TimeoutError:
        return None
    idx = sampled["index"]
    # the learner's "TD error" (here: the token count) becomes the rows' priority, on the
    # server, only where an actor has not overwritten the slot since
    rb.update_tensordict_priority(sampled.set("td_error", torch.tensor([float(t.numel()) for t in token_rows(sampled)])))
    return sampled, idx


def verify_final(
    store: LazyStackedTensorDictStore, done: dict[int, ActorReport], *, count: int, actors: int, placed: bool = True
) -> dict[str, Any]:
    """Read the whole store in one call and check every element, and that no write was lost.

    ``lost_writes`` also checks where each element sits: it must be the slot its
    writer recorded for that write (the hash's, or the one the ring gave it).
    """
    final = store.to_tensordict()
    bad = check_batch(final, np.arange(count), count=count, actors=actors, placed=placed)
    good = np.array([i for i in range(count) if i not in bad], dtype=np.int64)
    lost: dict[int, str] = {}
    if good.size:
        last_seq = np.stack([done[a][2] for a in range(actors)])
        lost = lost_writes(final[torch.from_numpy(good)], good, last_seq)
    examples = ["; ".join(p) for p in list(bad.values())[:MAX_EXAMPLES]] + list(lost.values())[:MAX_EXAMPLES]
    return {"verified": count - len(bad) - len(lost), "inconsistent": len(bad), "lost_writes": len(lost), "final_examples": examples}


def figures(
    tally: Tally, done: dict[int, ActorReport], final: dict[str, Any], *, where: str, count: int, batch: int, ring: bool
) -> dict[str, Any]:
    """The figures :func:`tdstore.demo.run_demo` returns (``ring``: the run went through a replay buffer)."""
    actors = len(done)
    writes = [done[a][0] for a in range(actors)]
    rates = [done[a][0] / done[a][1] if done[a][1] > 0 else 0.0 for a in range(actors)]
    reads, read_time = tally.reads, tally.seconds
    return {
        "server": where,
        "actors": actors,
        "count": count,
        "batch": batch,
        "seconds": round(read_time, 3),
        "writes": sum(writes),
        "writes_per_actor": writes,
        "writes_per_s": round(sum(rates), 1),
        "reads": reads,
        "reads_per_s": round(reads / read_time, 1),
        "elements_read": reads * batch,
        "elements_read_per_s": round(reads * batch / read_time, 1),
        "torn": tally.torn,
        "torn_examples": tally.examples,
        **final,
        **({"samples_per_insert": round(reads * batch / max(1, sum(writes)), 2)} if ring else {}),
        "ok": tally.torn == 0 and final["verified"] == count,
    }
