"""LLM-RL rollouts on a ring: policy versions with bounded staleness, groups that appear whole, token budgets.

The server keeps a rollout index beside the ring (``lua/_rollouts.lua``; keys ``StoreKeys.rollout_keys``),
turned on by the first ``set_version`` or the first ``extend`` given ``version=`` or ``group=``:

* ``extend(td, version=v)`` stamps the rows with the policy version that made them (``write.lua`` 'V',
  after 'W': the same call). ``max_ahead=k`` makes a writer more than ``k`` versions ahead of the
  published one wait (the ring's usual ``WAIT``: ``timeout=`` bounds it, ``set_version`` wakes it).
* ``extend(td, group=g, group_size=n)``: the rows join group ``g``, invisible to samples and pops until
  it holds ``n`` rows (written by any processes, in any calls); the call that completes it makes the
  whole group visible at once. A group of another size, or one that would overflow, is refused
  before anything is written.
* ``set_version(v)`` publishes the learner's version (``lua/rollouts.lua``; going backwards is refused
  unless ``allow_backwards=True``).
* ``sample(n, max_staleness=k)`` draws uniformly among visible rows of version >= published - k
  (``groups=g``: ``g`` whole groups); ``pop(n, max_staleness=k)`` takes the next visible items in the
  order they became visible, dropping (and counting) older ones; ``pop(groups=g)`` takes whole groups;
  ``pop(token_budget=t, length_key=key)`` the next items whose lengths (``key``'s first dim) fit ``t``.
  One ``read.lua`` call each ('G', with 'H' naming the length key).

Once the index is on, every ring call on the store goes this way (plain ``extend`` stamps the published
version, plain ``sample``/``pop`` skip incomplete groups). Not supported together with it, each with a
clear error: leased pops, queue mode, prioritized or rate-limited samples, sharded rings.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._engine import deadline, scripts
from tdstore._engine.engine import Engine, request_id
from tdstore._errors import MustWait
from tdstore._format import codec, row_block
from tdstore._format.header_info import MAX_INT
from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Read, Write
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan.call import Call, leaf_checks
from tdstore._plan.read_plan import leaf_read_ops
from tdstore._plan.values import display
from tdstore._ring import waiting
from tdstore._ring.args import check_batch_size, refuse_spread
from tdstore._ring.extend import DRAW_HIGH
from tdstore._ring.row_reads import RolloutsOn, RowRead, counted_op, decode_sample, selected_leaves

__all__ = ["RolloutSample", "RolloutsOn", "pop", "published_version", "sample", "set_version", "write_args"]


class RolloutSample(NamedTuple):
    """A batch of a ring with rollouts: the data, each row's slot, generation and policy version, the rows of
    each item (a group, or one row) in order, and how many stale and lost rows a pop dropped on the way."""

    td: TensorDictBase
    indices: torch.Tensor
    generations: torch.Tensor
    versions: torch.Tensor
    group_sizes: torch.Tensor
    stale: int
    lost: int


def _int_arg(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= int(value) <= MAX_INT:
        raise ValueError(f"{name} must be an int in {low}..2**53, got {value!r}")
    return int(value)


def write_args(h: Header, n: int, version: Any, max_ahead: Any, group: Any, group_size: Any) -> tuple[str, str, str, str] | None:
    """The 'V' op's arguments of a ring write of ``n`` rows (checked: a clear error before anything is
    written), or None when the write gives none of them."""
    if version is None and max_ahead is None and group is None and group_size is None:
        return None
    refuse_unsupported(h, "extend with version=/group=")
    v = "" if version is None else str(_int_arg(version, "version"))
    ahead = "" if max_ahead is None else str(_int_arg(max_ahead, "max_ahead"))
    if max_ahead is not None and version is None:
        raise ValueError("max_ahead= bounds the version the rows carry: give version= too")
    if (group is None) != (group_size is None):
        raise ValueError("a grouped write takes both group= (the group's id) and group_size= (its rows when whole)")
    if group is None:
        return v, ahead, "", ""
    if isinstance(group, bool) or not isinstance(group, (str, int, np.integer)):
        raise TypeError(f"group= is a group id (str or int), got {type(group).__name__}")
    gid = str(group)
    if not gid or len(gid.encode()) > 512 or any(c.isspace() for c in gid):
        raise ValueError(f"group id {gid[:40]!r}: 1 to 512 bytes, no whitespace")
    size = _int_arg(group_size, "group_size", 1)
    if size > h.count:
        raise ValueError(f"group {gid!r} of {size} rows cannot fit a ring of {h.count} slots")
    if n > size:
        raise ValueError(f"group {gid!r}: the write gives {n} rows, more than its group_size={size}")
    return v, ahead, gid, str(size)


def write_op(engine: Engine, kt: KeyTable, args: tuple[str, str, str, str] | None) -> list[Any]:
    """The 'V' op after a ring write's 'W' (``args``: :func:`write_args`; None: the published version, no group)."""
    return Write.V(*(kt.ref(k) for k in engine.keys.rollout_keys), *(args or ("", "", "", "")))


def refuse_unsupported(h: Header, what: str) -> None:
    """Rollouts do not combine with a queue mode, a rate limiter, priorities or trajectories yet: a clear error naming why."""
    if h.trajectories is not None:
        raise NotImplementedError(f"{what}: the ring keeps trajectories (set_trajectories), which rollouts do not support yet")
    policy = h.sampling
    if policy is not None and (policy.queue or policy.limit is not None or policy.prioritized):
        which = "queue mode" if policy.queue else "a rate limiter" if policy.limit is not None else "priorities"
        raise NotImplementedError(f"{what}: the store has {which}, which rollouts (versions, groups, budgets) do not support yet")


def set_version(engine: Engine, version: Any, allow_backwards: bool = False) -> int:
    """Publish ``version`` (``lua/rollouts.lua``); returns the version published before. One round trip."""
    v = _int_arg(version, "version")
    engine.refuse_if_readonly()
    refuse_spread(engine)
    h = engine.header
    refuse_unsupported(h, "set_version")
    args = [h.epoch, str(v), "1" if allow_backwards else "0", engine.keys.events, "2", "3", "4", "5", "6"]
    with engine.naming_errors():
        reply = scripts.call(engine.client, "rollouts", [engine.keys.meta, *engine.keys.rollout_keys], args, engine.execute)
    if reply[0] in (b"GONE", "GONE"):
        raise engine.gone()
    kv = int(reply[2])
    if not h.rollouts or h.keyset_version != kv:
        h = engine.fetch_header()  # the index was turned on (kv moved): the next calls plan with it
        engine.set_header(h)
    return int(reply[1])


def published_version(engine: Engine) -> int:
    """The version the learner published last (0 before any), read from the server."""
    raw = engine.command("HGET", engine.keys.meta, "cv")
    return int(raw) if raw is not None else 0


def _length_leaf(h: Header, length_key: NestedPath | None, budget: int | None) -> Leaf | int | None:
    """What a token budget measures: a heterogeneous tensor leaf (each element's first dim, read on the
    server), or a fixed length (a homogeneous leaf's first dim); None without a budget."""
    if budget is None:
        if length_key is not None:
            raise ValueError("length_key= names what a token_budget= counts: give token_budget= too")
        return None
    if length_key is None:
        raise ValueError("token_budget= needs length_key= (the key whose first dim is a row's length)")
    leaf = h.leaves.get(length_key)
    if leaf is None:
        raise KeyError(f"length_key {display(length_key)!r} is not a key of the store")
    if leaf.json or h.inner or h.stack_pos:
        raise ValueError(f"length_key {display(length_key)!r}: a tensor key of a store without inner batch dims is needed")
    if not leaf.het:
        assert leaf.shape is not None
        if not leaf.shape:
            raise ValueError(f"length_key {display(length_key)!r} holds scalars: no length to count")
        return int(leaf.shape[0])
    if leaf.ndim < 1:
        raise ValueError(f"length_key {display(length_key)!r} holds scalars: no length to count")
    return leaf


def _call(
    engine: Engine,
    h: Header,
    keys: list[NestedPath] | None,
    rows: int,
    j_args: list[Any],
    parse: Any,
    request: str | None,
    length: Leaf | int | None,
) -> Call:
    """The ``read.lua`` call of a rollout sample or pop: ['N'], ['A'], ['H'], 'G', then every selected leaf at its rows."""
    selected = selected_leaves(h, keys)
    wanted = None if keys is None else {leaf.path for leaf in selected}
    kt = engine.key_table(h)
    checked = selected + [length] if isinstance(length, Leaf) and length not in selected else selected
    leaves, block, grouped = row_block.units(h, selected)
    named = Read.N(kt.ref(engine.keys.replies), request) if request is not None else []
    counted = counted_op(engine, kt)
    fixed = str(length) if isinstance(length, int) else ""
    pre: list[Any] = []
    if isinstance(length, Leaf):
        _, lo, ls = engine.keys.leaf_keys(length.number)
        pre = Read.H(kt.ref(lo), kt.ref(ls), 8 * length.ndim, length.dtype.itemsize)
    j_args = [*j_args[:5], fixed, *j_args[5:]]
    head = Read.G(*j_args, *(kt.ref(k) for k in engine.keys.rollout_keys))
    ops = 1 + len(leaves) + bool(named) + bool(counted) + bool(pre)
    args: list[Any] = [f"{h.epoch}:K{h.keyset_version}", leaf_checks(checked), ops, *named, *counted, *pre, *head]
    args += leaf_read_ops(engine.keys, h, kt, leaves, rows)
    unit = RowRead(leaves, block, grouped, wanted)
    return Call("read", kt.keys, args, lambda reply: parse(reply, unit))


def _parser(h: Header, device: torch.device | None, ragged: dict[str, Any] | None) -> Any:
    def parse(reply: list, rows: RowRead) -> RolloutSample:
        got = decode_sample(h, rows.leaves, reply, 7, device, rows.block, rows.grouped, ragged, rows.wanted)
        versions = torch.from_numpy(codec.unpack_i64(reply[4]).astype(np.int64))
        sizes = torch.from_numpy(codec.unpack_i64(reply[5]).astype(np.int64))
        stale, lost = (int(x) for x in reply[6].split())
        return RolloutSample(got.td, got.indices, got.generations, versions, sizes, stale, lost)

    return parse


def _ensure_on(engine: Engine, what: str) -> Header:
    """The header, once the store's rollout index is known to be on (read again if the cached one says off)."""
    h = engine.header
    if not h.rollouts:
        h = engine.fetch_header()
        engine.set_header(h)
    if not h.rollouts:
        raise ValueError(
            f"{what}: the store with {engine.where()} keeps no rollout index yet (call set_version, or extend with version=/group=)"
        )
    refuse_unsupported(h, what)
    return h


@deadline.honours_timeout("sample")
def sample(
    engine: Engine,
    batch_size: int,
    generator: torch.Generator | None,
    device: torch.device | None,
    keys: list[NestedPath] | None,
    *,
    max_staleness: Any = None,
    groups: Any = None,
    timeout: float | None = None,
    ragged: dict[str, Any] | None = None,
) -> RolloutSample:
    """``batch_size`` visible rows (or ``groups`` whole groups) drawn uniformly with replacement among those
    of version >= published - ``max_staleness``, in one round trip. When none qualifies: ``ValueError``
    at once, or, given ``timeout=``, a wait for writes or ``set_version`` (then ``TimeoutError``)."""
    refuse_spread(engine)
    stale = "" if max_staleness is None else str(_int_arg(max_staleness, "max_staleness"))
    n = batch_size if groups is None else groups
    check_batch_size(n, "sample" if groups is None else "sample(groups=)")
    draws = codec.pack_i64(torch.randint(0, DRAW_HIGH, (n,), generator=generator, dtype=torch.int64).numpy())
    _ensure_on(engine, "sample with rollouts")

    def plan(h: Header) -> Call:
        refuse_unsupported(h, "sample with rollouts")
        j = ["s", n, "1" if groups is not None else "0", stale, "", draws, engine.keys.events]
        return _call(engine, h, keys, n, j, _parser(h, device, ragged), None, None)

    def attempt() -> RolloutSample:
        return engine.run(plan)

    if timeout is None:
        try:
            return attempt()
        except MustWait as err:
            raise ValueError(f"cannot sample: {err.message} (pass timeout= to wait for one)") from None
    return waiting.until_ready(engine, attempt, timeout, "sample")


@deadline.honours_timeout("pop")
def pop(
    engine: Engine,
    batch_size: int | None,
    device: torch.device | None,
    keys: list[NestedPath] | None,
    *,
    max_staleness: Any = None,
    groups: Any = None,
    token_budget: Any = None,
    length_key: NestedPath | None = None,
    timeout: float | None = None,
    request: str | None = None,
) -> RolloutSample:
    """The next visible items in the order they became visible (see the module docstring), in one round trip;
    waits for one as ``pop`` does. A resend under the same request id gets the same items."""
    engine.refuse_if_readonly()
    refuse_spread(engine)
    stale = "" if max_staleness is None else str(_int_arg(max_staleness, "max_staleness"))
    budget = None if token_budget is None else _int_arg(token_budget, "token_budget", 1)
    if groups is not None:
        check_batch_size(groups, "pop(groups=)")
        if budget is not None:
            raise ValueError("pop takes groups= or token_budget=, not both (a budget takes whole groups already)")
    h0 = _ensure_on(engine, "pop with rollouts")
    if h0.leased:
        raise NotImplementedError("pop with rollouts: the store has had leased pops, which rollouts do not support yet")
    n = groups if groups is not None else h0.count if budget is not None else (batch_size or 1)
    check_batch_size(n, "pop")
    rid = request or request_id()

    def plan(h: Header) -> Call:
        refuse_unsupported(h, "pop with rollouts")
        if h.leased:
            raise NotImplementedError("pop with rollouts: the store has had leased pops, which rollouts do not support yet")
        deadline.arm()  # sent next: from now on the pop may have taken its items
        length = _length_leaf(h, length_key, budget)
        j = ["p", n, "1" if groups is not None else "0", stale, "" if budget is None else str(budget), "", engine.keys.events]
        return _call(engine, h, keys, min(n, h.count), j, _parser(h, device, None), rid, length)

    def resend(again: float | None) -> RolloutSample:
        return pop(
            engine,
            batch_size,
            device,
            keys,
            max_staleness=max_staleness,
            groups=groups,
            token_budget=token_budget,
            length_key=length_key,
            timeout=again,
            request=rid,
        )

    with deadline.resolvable(rid, resend, keyword=True):
        return waiting.until_ready(engine, lambda: engine.run(plan), timeout, "pop")
