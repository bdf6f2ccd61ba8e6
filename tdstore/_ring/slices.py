"""Trajectories on the server: ``set_trajectories`` and ``sample_slices``, one call each.

A ring given a trajectory key (``set_trajectories(traj_key=...)``: an integer id per row, runs of
one id being one trajectory; or ``end_key=...``: a flag per row ending its trajectory) keeps an
episode index on the server, which every ring write updates in the same atomic call
(``lua/_episodes.lua``; the write passes the rows' ids, ``_ring.episodes``). ``sample_slices`` then
draws slices of trajectories as torchrl's ``SliceSampler`` does (a trajectory uniformly among those
long enough, then a start in it; ``strict_length``, ``span``) and reads their rows in the same call
(``read.lua``'s 'J' op): one round trip, whose server time grows with the rows returned, not with the
ring (``O(log trajectories)`` per slice).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._engine import deadline
from tdstore._engine.engine import Engine
from tdstore._errors import MustWait
from tdstore._format import codec
from tdstore._format.op_kinds import Read
from tdstore._format.schema import Header, NestedPath
from tdstore._format.trajectories import Trajectories
from tdstore._plan.call import Call
from tdstore._plan.read_results import DenseResult
from tdstore._plan.values import as_path
from tdstore._ring.args import check_batch_size, refuse_spread
from tdstore._ring.extend import DRAW_HIGH
from tdstore._ring.row_reads import decode_sample, row_read_call


class SliceSample(NamedTuple):
    """A batch drawn by ``sample_slices``: the rows of every slice, one slice after the other.

    ``indices`` and ``generations`` as ``sample``'s (slot and generation of each row). ``info``:
    ``truncated`` (bool ``[rows, 1]``: True on the last row of each slice, as torchrl's
    ``SliceSampler`` sets it), ``slice_lengths`` (rows per slice; all equal to the slice length
    unless ``strict_length=False`` or ``span`` cut some), ``traj_starts`` (the slot of each slice's
    trajectory's first row), ``traj_lengths`` and ``offsets`` (where the slice starts in it)."""

    td: TensorDictBase
    indices: torch.Tensor
    generations: torch.Tensor
    info: dict[str, torch.Tensor]


SliceSample.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


def trajectory_setting(traj_key: Any, end_key: Any) -> Trajectories | None:
    """The setting ``set_trajectories`` asks for (None: forget it), its arguments checked."""
    if traj_key is not None and end_key is not None:
        raise ValueError("set_trajectories takes traj_key or end_key, not both")
    if traj_key is None and end_key is None:
        return None
    key = traj_key if traj_key is not None else end_key
    if not isinstance(key, (str, tuple)) or not key:
        raise TypeError(f"a trajectory key is a str or a tuple of str, got {key!r}")
    return Trajectories("id" if traj_key is not None else "end", as_path(key))


def _runs(t: Trajectories, values: np.ndarray, first: int) -> tuple[np.ndarray, str]:
    """The trajectories of rows ``values`` (the key of each row held, oldest first, at write numbers
    ``first, first + 1, ...``): ``(start, length)`` pairs, and the newest row's ``jv`` (``lua/_episodes.lua``)."""
    n = len(values)
    if n == 0:
        return np.zeros((0, 2), dtype=np.int64), ""
    if t.by == "id":
        new = np.concatenate([[True], values[1:] != values[:-1]])
        last = np.int64(values[-1]).astype("<i8").tobytes().hex()
    else:
        ends = values.astype(bool)
        new = np.concatenate([[True], ends[:-1]])
        last = "1" if ends[-1] else "0"
    starts = np.flatnonzero(new)
    lengths = np.diff(np.append(starts, n))
    return np.stack([starts + first, lengths], 1).astype(np.int64), last


#: The most trajectories ``set_trajectories`` indexes in one call over rows the ring holds already: the build is
#: one script, one ZADD per trajectory (about 3 us each on Redis 7: 10^4 in ~25 ms, 10^5 in ~340 ms, past the
#: ~50 ms a call may hold the server). A ring given its setting before it holds more keeps it by its writes.
MAX_BUILD_RUNS = 20_000


def set_trajectories(engine: Engine, traj_key: Any = None, end_key: Any = None) -> None:
    """Set (or, with neither key, forget) the ring's trajectory key and build its episode index over the
    rows it holds (see ``LazyStackedTensorDictStore.set_trajectories``)."""
    engine.refuse_if_readonly()
    refuse_spread(engine)
    t = trajectory_setting(traj_key, end_key)
    for _ in range(64):
        rw = engine.ring_writes(fresh=True)
        h = engine.header
        if h.rollouts:  # a group's rows stay hidden until whole: the episode index would not know it
            raise NotImplementedError("set_trajectories on a ring with rollouts (versions, groups, budgets) is not supported yet")
        count = h.count
        low = max(0, rw - count)
        values = np.zeros(0, dtype=np.int64)
        if t is not None and rw > low:
            leaf = h.leaves.get(t.key)
            if leaf is None:
                raise KeyError(f"the ring has no key {t.key[0] if len(t.key) == 1 else t.key!r} to tell its trajectories apart")
            if leaf.het or leaf.json or leaf.dtype.is_floating_point or leaf.dtype.is_complex:
                raise TypeError(
                    f"a trajectory key holds one integer (traj_key) or flag (end_key) per row; {t.describe()} has "
                    f"dtype {leaf.dtype}{' and rows of several shapes' if leaf.het else ''}"
                )
            slots = torch.arange(low, rw, dtype=torch.int64) % count
            _, res = engine.read(slots, [t.key])
            if not isinstance(res, DenseResult):
                raise TypeError(f"the trajectory key {t.describe()} must hold one value per row")
            col = res.leaves[t.key].reshape(rw - low, -1)
            if t.by == "id" and col.shape[1] != 1:
                raise ValueError(f"the trajectory key {t.describe()} must hold one id per row, got {col.shape[1]}")
            values = (col.any(-1) if t.by == "end" else col[:, 0]).to(torch.int64).numpy()
        runs, last = _runs(t, values, low) if t is not None else (np.zeros((0, 2), dtype=np.int64), "")
        if len(runs) > MAX_BUILD_RUNS:
            raise ValueError(
                f"the ring holds {len(runs):,} trajectories by {t.describe() if t else ''}: indexing more than "
                f"{MAX_BUILD_RUNS:,} at once would hold the server too long; call set_trajectories while the ring holds "
                "fewer (an empty ring: its writes keep the index from then on)"
            )

        def plan(h: Header, runs: np.ndarray = runs, last: str = last, rw: int = rw) -> Call:
            deadline.arm()
            return Call(
                "trajectories",
                [engine.keys.meta, engine.keys.episodes],
                [f"{h.epoch}:V{h.version}", t.to_json() if t is not None else "", rw, codec.pack_i64(runs.reshape(-1)), last],
                engine.adopt_stale,
            )

        try:
            engine.run(plan)
            return
        except MustWait:  # the ring was written since its key was read: read it again
            continue
    raise TimeoutError("set_trajectories: writers kept writing the ring while its trajectory key was read (64 tries)")


def _span(span: Any, seq: int) -> tuple[int, int]:
    """torchrl's ``span`` as ``read.lua``'s 'J' op takes it: per side 0 (none), -1 (True) or k > 0."""
    pair = span if isinstance(span, (tuple, list)) else (span, span)
    if len(pair) != 2:
        raise ValueError(f"span is a bool, an int or a pair of them, got {span!r}")
    out = []
    for side in pair:
        if isinstance(side, bool):
            out.append(-1 if side else 0)
        elif isinstance(side, int) and side >= 0:
            if side >= seq:
                raise ValueError("The right and left span must be strictly lower than the sequence length")
            out.append(side)
        else:
            raise ValueError(f"span is a bool, an int >= 0 or a pair of them, got {span!r}")
    return out[0], out[1]


def slice_shape(batch_size: int, num_slices: int | None, slice_len: int | None) -> tuple[int, int]:
    """``(slice length, slices)`` of a batch, as torchrl's ``SliceSampler`` computes them."""
    check_batch_size(batch_size, "sample_slices")
    if (num_slices is None) == (slice_len is None):
        raise TypeError("sample_slices takes num_slices or slice_len (one of them)")
    given = num_slices if num_slices is not None else slice_len
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ValueError(f"num_slices and slice_len are ints >= 1, got {given!r}")
    if batch_size % given:
        what = "number of slices" if num_slices is not None else "slice length"
        raise ValueError(f"The batch-size must be divisible by the {what}, got batch_size={batch_size} and {given}")
    return (batch_size // given, given) if num_slices is not None else (given, batch_size // given)


def sample_slices(
    engine: Engine,
    batch_size: int,
    *,
    num_slices: int | None = None,
    slice_len: int | None = None,
    strict_length: bool = True,
    span: Any = False,
    generator: torch.Generator | None = None,
    keys: list[NestedPath] | None = None,
    device: torch.device | None = None,
    ranks: tuple[int, torch.Tensor] | None = None,
) -> SliceSample:
    """Slices of trajectories and their rows, in one call (see ``LazyStackedTensorDictStore.sample_slices``).

    ``ranks``: ``(eligible, ranks)``, a sampler without replacement's picks: each slice's trajectory by its
    rank among the ``eligible`` trajectories long enough (longest first); when the ring holds another number,
    ``RanksMoved`` carries it (nothing drawn) and the caller draws its ranks again."""
    refuse_spread(engine)
    seq, m = slice_shape(batch_size, num_slices, slice_len)
    s0, s1 = _span(span, seq)
    if engine.header.trajectories is None:
        engine.set_header(engine.fetch_header())  # another handle may have set it
        if engine.header.trajectories is None:
            raise ValueError(
                f"the ring of the store with {engine.where()} keeps no trajectories: call "
                "set_trajectories(traj_key=...) or set_trajectories(end_key=...) first"
            )
    drawn = torch.randint(0, DRAW_HIGH, (2 * m,), generator=generator, dtype=torch.int64)
    if ranks is not None:
        if ranks[1].numel() != m:
            raise ValueError(f"{ranks[1].numel()} trajectory ranks for {m} slices")
        drawn[0::2] = ranks[1].to(torch.int64)
    draws = codec.pack_i64(drawn.numpy())
    ranked = 0 if ranks is None else int(ranks[0])

    def plan(h: Header) -> Call:
        if h.trajectories is None:
            raise ValueError(f"the ring of the store with {engine.where()} keeps no trajectories any more (set_trajectories)")

        def head(kt: Any) -> list[Any]:
            return Read.J(m, seq, "1" if strict_length else "0", s0, s1, draws, kt.ref(engine.keys.episodes), ranked)

        def parse(reply: list, rows: Any) -> SliceSample:
            got = decode_sample(h, rows.leaves, reply, 5, device, rows.block, rows.grouped, None, rows.wanted)
            info = torch.from_numpy(codec.unpack_i64(reply[4]).astype(np.int64)).reshape(m, 4)
            lengths = info[:, 3]
            truncated = torch.zeros((got.indices.numel(), 1), dtype=torch.bool)
            ends = lengths.cumsum(0) - 1
            truncated[ends[lengths > 0], 0] = True
            return SliceSample(
                got.td,
                got.indices,
                got.generations,
                {
                    "truncated": truncated,
                    "slice_lengths": lengths,
                    "traj_starts": info[:, 0] % h.count,
                    "traj_lengths": info[:, 1],
                    "offsets": info[:, 2],
                },
            )

        return row_read_call(engine, h, keys, m * seq, head, parse)

    try:
        return engine.run(plan)
    except MustWait as err:  # read.lua 'J': the eligible trajectories are not the count the ranks were drawn for
        if ranks is None or err.reason != "moved":
            raise
        raise RanksMoved(int(err.message)) from None


class RanksMoved(Exception):
    """A sample without replacement drew ranks among another number of trajectories than the ring holds (``eligible``)."""

    def __init__(self, eligible: int) -> None:
        super().__init__(f"the ring holds {eligible} trajectories long enough")
        self.eligible = eligible


RanksMoved.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


#: Why a sharded ring has no slices yet (``ShardedTrajectoryMethods``).
SHARDED_SLICES = (
    "a sharded ring keeps no episode index yet: a trajectory's rows would have to stay on one shard, and an extend "
    "goes to one shard per batch whatever its trajectories are. Use a ring on one node (or one hash slot) for slices"
)


class ShardedTrajectoryMethods:
    """The trajectory calls of a ``ShardedRing``: not served yet (``NotImplementedError`` saying why)."""

    def set_trajectories(self, *, traj_key: Any = None, end_key: Any = None) -> None:
        """Not on a sharded ring (see :data:`SHARDED_SLICES`)."""
        raise NotImplementedError(SHARDED_SLICES)

    @property
    def trajectories(self) -> Trajectories | None:
        """None: a sharded ring keeps no trajectories."""
        return None

    def sample_slices(self, batch_size: int, **kwargs: Any) -> SliceSample:
        """Not on a sharded ring (see :data:`SHARDED_SLICES`)."""
        raise NotImplementedError(SHARDED_SLICES)
