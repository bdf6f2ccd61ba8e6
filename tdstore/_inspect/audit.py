"""``tdstore check``: every data and table key of a store against what its header implies.

The rules are the ones every write and read applies to the keys it touches (see
``tdstore._format.integrity``); this module applies them to all the keys of a store at once,
in two pipelines, without writing anything.  ``_format.integrity`` (and so numpy) is imported
when a check runs, so that ``tdstore ls`` does not pay for it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import redis

from tdstore._format.header_info import DELETING, HeaderDamagedError, HeaderInfo, LeafRecord, StoreFormatError
from tdstore._format.keys import StoreKeys
from tdstore._inspect.headers import read_header, store_layout
from tdstore._inspect.results import Audit, NoSuchStore, UnreadableStore

__all__ = ["audit"]


class _Wanted(NamedTuple):
    """One key to check: its name, the check ``_format.integrity.expected`` gives for it, the offsets
    key of a heterogeneous data key (whose last offset is the least the data must hold), and the
    store keys whose data it holds (one, or each key of the row block), as a user names them."""

    key: str
    check: tuple[int, int, int]
    offsets_key: str | None
    holds: tuple[str, ...] = ()


class _KeyState(NamedTuple):
    """What the server holds for one wanted key."""

    wanted: _Wanted
    exists: bool
    length: int
    last_offset: int | None


def audit(client: redis.Redis, prefix: str, td_id: str) -> Audit:
    """Check every data and table key of a store against what its header implies (two pipelines).

    The rules are the ones every write and read applies to the keys it touches (see
    ``tdstore._format.integrity``): a key holds exactly what its layout implies (a heterogeneous
    leaf's data at least its last offset); an absent key is fine only when the store's
    inventory is whole and does not list it (a segment never written). Read-only; a snapshot
    (not atomic with writes other processes make meanwhile).
    """
    keys = StoreKeys(prefix, td_id)
    raw = client.hgetall(keys.meta)
    if not raw:
        raise NoSuchStore(td_id)
    try:
        header, _ = read_header(raw)
    except HeaderDamagedError as err:  # a field out of range (edited by hand): the store is damaged
        return Audit(td_id, 0, 0, (f"{keys.meta}: {err}",))
    except StoreFormatError as err:
        raise UnreadableStore(str(err)) from None
    left = half_done(client, raw, header)
    if left:
        return Audit(td_id, 0, 0, (f"{keys.meta}: {left}; `tdstore rm {td_id}` deletes what is left of it",))
    keys = store_layout(client, keys, header)
    na_raw = raw.get(b"na") if b"na" in raw else raw.get("na")
    wanted = _wanted_keys(keys, header)
    replies = _query(client, keys, wanted, tracked=na_raw is not None)
    states, pos = _key_states(wanted, replies)
    problems: list[str] = []
    listed: list[bool] = [False] * len(wanted)
    whole = True
    if na_raw is not None:
        count = int(replies[pos])
        pos += 1
        listed = [bool(r) for r in replies[pos : pos + len(wanted)]]
        if count != int(na_raw):
            whole = False
            listed_n = f"{count} key" if count == 1 else f"{count} keys"
            problems.append(f"{keys.inventory}: the inventory lists {listed_n}, the header counts {int(na_raw)} (it lost entries)")
    damaged: list[str] = []
    never = _judge(states, listed, tracked=na_raw is not None, whole=whole, problems=problems, damaged=damaged)
    if header.sampling is not None and header.sampling.prioritized:
        problems += _tree_problems(client, keys.priorities, header.count)
    return Audit(td_id, len(wanted), never, tuple(problems), tuple(sorted(set(damaged))))


#: A priority tree up to this size is read whole and checked by ``tdstore check`` (a ring of 7 million slots).
TREE_CHECK_BYTES = 64 << 20


def _tree_problems(client: redis.Redis, key: str, count: int) -> list[str]:
    """What is wrong with a ring's priority tree (``lua/_tree.lua``): its size, then, for a tree of at most
    :data:`TREE_CHECK_BYTES`, values that are not finite weights >= 0 and sums that disagree with their
    children (the checks a draw makes along its path, here on every node)."""
    import numpy as np

    from tdstore._format.sampling_policy import TREE_FAN, tree_bytes

    size = tree_bytes(count)
    have = int(client.strlen(key))
    if have != size:
        return [f"{key}: the priority tree holds {have} bytes, not {size}"]
    if size > TREE_CHECK_BYTES or count < 1:
        return []
    blob = client.get(key)
    raw = np.frombuffer(blob if isinstance(blob, bytes) else b"", dtype="<f8")
    if not (np.isfinite(raw).all() and (raw >= 0).all()):
        return [f"{key}: the priority tree holds values that are not finite weights >= 0"]
    below, low, at, n = raw[:count], raw[:count], count, count
    while n > 1:
        n = -(-n // TREE_FAN)
        nodes = raw[at : at + 2 * n].reshape(n, 2)
        sums, mins = np.zeros(n * TREE_FAN), np.zeros(n * TREE_FAN)
        sums[: below.size], mins[: low.size] = below, low
        mins[mins <= 0] = np.inf
        least = mins.reshape(n, TREE_FAN).min(axis=1)
        least[np.isinf(least)] = 0
        if not np.allclose(nodes[:, 0], sums.reshape(n, TREE_FAN).sum(axis=1), rtol=1e-9, atol=0):
            return [f"{key}: sums of the priority tree disagree with their children"]
        if not np.array_equal(nodes[:, 1], least):
            return [f"{key}: the smallest weights the priority tree keeps disagree with its leaves"]
        below, low, at = nodes[:, 0], nodes[:, 1], at + 2 * n
    return []


def half_done(client: redis.Redis, raw: dict, header: HeaderInfo) -> str:
    """Why the store is what a whole-store call cut in batches left half-done (``lua/clear.lua``,
    ``lua/expire.lua``: every call answers it as gone), or '' when it is not."""
    if header.state == DELETING:
        return "the store is being deleted, or a delete stopped half-way (a tombstone header)"
    xd = raw.get(b"xd", raw.get("xd"))
    if xd is not None:
        sec, usec = client.time()
        if sec * 1000 + usec // 1000 >= int(xd):
            return "a change of its time to live stopped half-way and some keys expired: the store reads as gone"
    return ""


def _wanted_keys(keys: StoreKeys, header: HeaderInfo) -> list[_Wanted]:
    """Every key whose length the header implies: each leaf's (and the row block's) data and tables, per segment."""
    from tdstore._format.integrity import EXACT, HET_DATA, expected

    leaves = list(header.leaves)
    holds: dict[int, tuple[str, ...]] = {leaf.number: (".".join(leaf.path),) for leaf in leaves}
    if header.row is not None:
        leaves.append(LeafRecord(("\0row",), header.row[0], "uint8", 1, (header.row[1],)))
        holds[header.row[0]] = tuple(".".join(leaf.path) for leaf in header.leaves if leaf.col is not None)
    per = header.seg or max(header.count, 1)
    wanted: list[_Wanted] = []
    for seg in range(header.segments):
        m = min(per, header.count - seg * per)
        for leaf in leaves:
            for role, name in (("d", keys.data), ("o", keys.offsets), ("s", keys.shapes)):
                check = expected(role, leaf, m)
                if check[0] in (EXACT, HET_DATA):
                    okey = keys.offsets(leaf.number, seg) if check[0] == HET_DATA else None
                    wanted.append(_Wanted(name(leaf.number, seg), check, okey, holds[leaf.number]))
    return wanted


def _query(client: redis.Redis, keys: StoreKeys, wanted: list[_Wanted], *, tracked: bool) -> list[Any]:
    """One pipeline: each key's existence and length (and last offset), then the inventory's size and entries."""
    pipe = client.pipeline(transaction=False)
    for key, _, okey, _ in wanted:
        pipe.exists(key)
        pipe.strlen(key)
        if okey is not None:
            pipe.getrange(okey, -8, -1)
    if tracked:
        pipe.hlen(keys.inventory)
        for key, _, _, _ in wanted:
            pipe.hexists(keys.inventory, key)
    return list(pipe.execute())


def _key_states(wanted: list[_Wanted], replies: list[Any]) -> tuple[list[_KeyState], int]:
    """The replies of :func:`_query` per wanted key, and the position of the inventory's replies."""
    pos = 0
    states = []
    for item in wanted:
        exists, have = bool(replies[pos]), int(replies[pos + 1])
        pos += 2
        last = None
        if item.offsets_key is not None:
            tail = replies[pos]
            pos += 1
            last = int.from_bytes(tail, "little") if len(tail) == 8 else 0
        states.append(_KeyState(item, exists, have, last))
    return states, pos


def _bytes(n: int | None) -> str:
    return f"{n} byte" if n == 1 else f"{n} bytes"


def _judge(states: list[_KeyState], listed: list[bool], *, tracked: bool, whole: bool, problems: list[str], damaged: list[str]) -> int:
    """Append a line per damaged key to ``problems`` (and the store keys it holds to ``damaged``);
    return the keys absent because never written."""
    from tdstore._format.integrity import HET_DATA

    never = 0
    for state, in_inventory in zip(states, listed):
        key, (code, length, _), _, holds = state.wanted
        exists, have, last = state.exists, state.length, state.last_offset
        found = len(problems)
        if code == HET_DATA:
            if have < (last or 0):
                problems.append(f"{key}: holds {_bytes(have)}, its offset table says {last}" + ("" if exists else " (lost)"))
        elif have != length:
            if not exists and length and tracked and whole and not in_inventory:
                never += 1
            elif not exists:
                problems.append(f"{key}: lost (the header implies {_bytes(length)})")
            else:
                problems.append(f"{key}: holds {_bytes(have)}, the header implies {length}")
        if len(problems) > found:
            damaged.extend(holds)
    return never
