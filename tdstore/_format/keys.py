"""Every server key name that tdstore uses is built here, and nowhere else.

Layout of one store (``P`` is the escaped prefix, ``I`` the escaped td_id)::

    P:{I}:m        hash    the store header: type, version, count, stack dim,
                           inner batch size, device, state, segment length, schema (JSON)
    T:d:<n>        string  data blob of leaf number n in one segment (its elements, element-major)
    T:o:<n>        string  offset table of a heterogeneous leaf in one segment: one int64 LE
                           byte offset per element of the segment, plus one (starts at 0)
    T:s:<n>        string  shape table of a heterogeneous leaf in one segment: one record of
                           ndim int64 LE per element
    P:{I}:a        hash    inventory: every data and table key of the store that holds data,
                           one field each (the key's name); the header's 'na' counts them.
                           A key that is absent and not listed was never allocated (reads
                           as zeros); one that is listed was lost (see ``_format.integrity``)
    T:g            hash    guard of segment k > 0 of a *spread* store (Redis Cluster, segments on
                           several nodes): copies of the header's epoch and version, checked
                           by every call on the segment (the header lives on another node)
    P:{I}:p        string  priority tree of a ring with priorities: a sum tree of the slots'
                           weights (see ``lua/_tree.lua``), from ``enable_priorities``
    P:{I}:t        string  times each slot was sampled (4-byte little-endian counts), for
                           ``max_times_sampled``
    P:{I}:pn, :tn  string  the tree and counts of ``enable_priorities`` while it builds them in
                           steps (``lua/tree_build.lua``), renamed to ``:p``/``:t`` when done
    P:{I}:pb       string  that build's state (step, pass, cursor); the three expire unless resumed
    P:{I}:r        hash    reply cache: what each recent state-changing ring call decided, under
                           the request id its client made (a resend gets the first reply back);
                           the last 4096 ids (see ``lua/_lib.lua`` ``tds_request``)
    P:{I}:e        channel Pub/Sub channel (not a key) that ring writes, samples and pops publish
                           on, so a waiting client wakes without polling (see ``_ring.waiting``)
    P:{I}:l        hash    lease table of a ring's leased pops: each outstanding item and
                           each receipt (see ``lua/_lease.lua``); with the zsets below:
    P:{I}:ld       zset    live leases by deadline
    P:{I}:lq       zset    items whose lease expired, waiting for redelivery, by write number
    P:{I}:lo       zset    outstanding (leased or waiting) items, by write number
    P:{I}:lk       zset    receipts settled or expired, by time (the oldest are forgotten)
    P:{I}:c        hash    stats: counters of the ring's work (rows inserted, sampled, popped, acked,
                           ...), added by the scripts that do it (``lua/_lib.lua`` ``tds_stat``), read
                           by ``stats()`` (``_inspect.stats``); deleted with the store
    P:{I}:vz       zset    a ring with rollouts (``lua/_rollouts.lua``): visible rows, slot -> policy version
    P:{I}:vr       zset    its whole groups, group id -> lowest version of its rows
    P:{I}:vg, :vs  hash    its groups' rows (id -> size, lowest version, rows) and each grouped slot's group
    P:{I}:vq       list    its queue of visible items for ``pop`` (a row, or a whole group), in order
    P:{I}:j        zset    a ring with trajectories: its episode index, first write number ->
                           length of each trajectory the ring holds (see ``lua/_episodes.lua``)
    P:{I}:cs       string  stats: one bit per slot, set when the row in the slot is sampled, cleared when a
                           ring write overwrites it (``lua/_seen.lua``): distinct rows sampled
    P:{I}:sh       string  layout of a *sharded* ring (``tdstore.ShardedRing``): JSON of its
                           count, layout and shards (each an ordinary store, see ``shard_id``)
    P:{I}:f        string  a shard's replication fence (``min_replicas``): an empty string written
                           after a write, then ``WAIT``; it expires in 2 s
    P:stores       set     registry of the prefix: the td_id of every store created under it
    <key>:stage:<token>  string  staging copy of a large new blob for <key>, moved into
                           place by write.lua (RENAME); expires on its own if not

``T`` is the segment's own hash-tagged base: ``P:{I}`` for segment 0 (so a store of
one segment has exactly the keys above, O(K) for K leaves) and ``P:{I%s<k>}`` for
segment k > 0.  Segments are ranges of elements of the stack (see ``_format.segments``);
each has its own hash tag (on Redis Cluster only in a *spread* store; the others keep
every segment under the header's: see ``StoreKeys.segment_tags``).  The
``%s`` cannot come out of :func:`escape` (which writes ``%`` followed by two upper-case
hex digits), so no id's segment 0 can be named like another id's segment k.

Leaf *numbers*, never leaf names, appear in key names, so a leaf called ``"x:idx"``
or ``"a.b"`` cannot collide with another leaf or with an internal key.  The td_id
sits inside the hash tag ``{...}``, so every key of one segment hashes to one Redis
Cluster slot and a script on one segment may touch all of them.  Escaping removes braces from
the prefix and the id (a brace would move the hash tag) and glob characters (so a
``SCAN MATCH`` on a prefix can never match another store by accident).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

# Characters that would change the meaning of a key name: braces move the hash tag,
# glob characters turn a name into a pattern, '%' is our escape character, and
# whitespace/control characters make keys unreadable in redis-cli.
_UNSAFE = set("{}%*?[]\\") | {chr(c) for c in range(33)} | {chr(127)}


def escape(part: str) -> str:
    """Percent-escape the characters of ``part`` that are unsafe in a key name.

    The mapping is injective (``%`` itself is escaped), so two different prefixes
    or ids never produce the same key.
    """
    if not isinstance(part, str):
        raise TypeError(f"expected a str, got {type(part).__name__}: {part!r}")
    return "".join(f"%{ord(ch):02X}" if ch in _UNSAFE else ch for ch in part)


def check_td_id(td_id: str) -> str:
    """``td_id`` as a caller gave it, if it can name a store: a non-empty ``str`` (``TypeError`` or
    ``ValueError`` naming it otherwise). An empty id would name keys like ``P:{}:m`` and read like
    "no id" to every ``td_id or ...`` default: it is refused, never replaced by a new one."""
    if not isinstance(td_id, str):
        raise TypeError(f"td_id must be a str (or None for a new store), got {type(td_id).__name__}: {td_id!r}")
    if not td_id:
        raise ValueError("td_id='' names no store: give a store's id, or leave td_id out (None) for a new one")
    return td_id


def registry_key(prefix: str) -> str:
    """The registry set of ``prefix``; it has no braces, so no store key can be named like it."""
    return f"{escape(prefix)}:stores"


def reference_key(prefix: str, td_id: str, suffix: str) -> str:
    """A key of a store written by the reference ``tensordict.store`` (read by ``_checkpoint.reference`` only):
    ``{prefix}:{td_id}:{suffix}``, unescaped, with the suffixes ``__keys__`` (a set of dotted key
    paths), ``__batch_size__``, ``__type__``, ..., ``d:<path>`` (data), ``d:<path>:idx`` (offsets)
    and ``m:<path>`` (a hash: shape, dtype, ...).  tdstore's own keys of the same id never take
    these names unless a reference key path is all digits (``d:<n>``)."""
    return f"{prefix}:{{{td_id}}}:{suffix}"


#: Keys every store of the reference holds: a dense one's batch size, a lazy stack's element count.
REFERENCE_MARKERS = ("__batch_size__", "__count__")


def reference_pattern(prefix: str) -> str:
    """A ``SCAN MATCH`` pattern of the reference's metadata keys under ``prefix`` (its glob characters escaped)."""
    escaped = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in prefix)
    return f"{escaped}:{{*}}:__*__"


def reference_id(prefix: str, key: str) -> str | None:
    """The td_id of a reference store whose marker key (:data:`REFERENCE_MARKERS`) is ``key``, else None."""
    head = f"{prefix}:{{"
    for marker in REFERENCE_MARKERS:
        tail = f"}}:{marker}"
        if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
            return key[len(head) : -len(tail)]
    return None


def shard_id(td_id: str, shard: int, attempt: int) -> str:
    """The td_id of shard ``shard`` of the sharded ring ``td_id``: an ordinary store, whose hash tag
    ``attempt`` moves until it falls in a slot of the primary the shard is placed on (``_shards.ring``)."""
    return f"{td_id}~s{shard}.{attempt}"


def shard_of_id(td_id: str) -> tuple[str, int] | None:
    """``(sharded ring id, shard)`` when ``td_id`` names a shard (:func:`shard_id`), else None."""
    head, sep, tail = td_id.rpartition("~s")
    k, dot, j = tail.partition(".")
    if sep and dot and k.isdigit() and j.isdigit():
        return head, int(k)
    return None


@dataclass(frozen=True)
class StoreKeys:
    """Key names of one store, computed once per handle.

    ``segment_tags`` gives each segment k > 0 a hash tag of its own (a store spread over a Redis
    Cluster's nodes, or a store off Cluster, where tags change nothing); ``segment_tags=False`` (a
    store on Redis Cluster that is not spread) keeps every segment under the header's hash tag,
    as ``P:{I}%s<k>:d:<n>``, so that a call may still touch the header and several segments in
    one slot.
    """

    prefix: str
    td_id: str
    segment_tags: bool = True
    base: str = field(init=False, repr=False, compare=False)
    meta: str = field(init=False, repr=False, compare=False)
    _escaped: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # escaped once: a call over many segments names thousands of keys
        escaped = (escape(self.prefix), escape(self.td_id))
        base = f"{escaped[0]}:{{{escaped[1]}}}"
        object.__setattr__(self, "_escaped", escaped)
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "meta", f"{base}:m")

    @property
    def registry(self) -> str:
        """The set of td_ids created under this prefix (no hash tag: it belongs to no one store)."""
        return registry_key(self.prefix)

    def segment_base(self, seg: int) -> str:
        """The hash-tagged base of segment ``seg`` (segment 0 shares the header's tag)."""
        if seg == 0:
            return self.base
        if not self.segment_tags:
            return f"{self.base}%s{seg}"
        return f"{self._escaped[0]}:{{{self._escaped[1]}%s{seg}}}"

    def guard(self, seg: int) -> str:
        """The hash a call on segment ``seg`` of a spread store checks: the header itself for segment 0."""
        return self.meta if seg == 0 else f"{self.segment_base(seg)}:g"

    @property
    def shards(self) -> str:
        """The layout of a sharded ring whose id this is (``_shards.ring``): its shards' ids and counts."""
        return f"{self.base}:sh"

    @property
    def fence(self) -> str:
        """A shard's replication fence: written after a write, before ``WAIT`` (``_shards.fan_out._replicated``)."""
        return f"{self.base}:f"

    @property
    def inventory(self) -> str:
        """The hash listing every data and table key that holds data (see ``_format.integrity``)."""
        return f"{self.base}:a"

    @property
    def priorities(self) -> str:
        """The priority tree of a ring with priorities (see ``lua/_tree.lua``)."""
        return f"{self.base}:p"

    @property
    def times_sampled(self) -> str:
        """How often each slot was sampled since it was written (``max_times_sampled``)."""
        return f"{self.base}:t"

    @property
    def build_keys(self) -> list[str]:
        """The tree and counts ``enable_priorities`` is building, and the build's state (``lua/tree_build.lua``)."""
        return [f"{self.base}:pn", f"{self.base}:tn", f"{self.base}:pb"]

    @property
    def replies(self) -> str:
        """The reply cache: what recent ring calls and policy changes decided, by request id, so that a
        resend of one (redis-py retrying after a lost reply) gets its first reply instead of running again."""
        return f"{self.base}:r"

    @property
    def events(self) -> str:
        """The Pub/Sub channel ring writes, samples and pops publish on (a channel, not a key)."""
        return f"{self.base}:e"

    @property
    def lease_keys(self) -> list[str]:
        """The keys of a ring's leased pops (``lua/_lease.lua``: table, deadlines, redelivery queue,
        outstanding items, settled receipts), in the order scripts take them. Not strings, so
        not in :meth:`all_keys` (whose keys past the header and inventory are measured with
        STRLEN); calls on the whole store (delete, copy, time to live) add them."""
        return [f"{self.base}:l", f"{self.base}:ld", f"{self.base}:lq", f"{self.base}:lo", f"{self.base}:lk"]

    @property
    def stats(self) -> str:
        """The ring's counters (a hash: rows inserted, sampled, popped, ...; see ``_inspect.stats``), added to
        by the scripts that do the work, in the same call."""
        return f"{self.base}:c"

    @property
    def rollout_keys(self) -> list[str]:
        """The rollout index of a ring (``lua/_rollouts.lua``: visible rows by version, whole groups by version,
        group records, each grouped slot's group, the pop queue), in the order scripts take them."""
        return [f"{self.base}:vz", f"{self.base}:vr", f"{self.base}:vg", f"{self.base}:vs", f"{self.base}:vq"]

    @property
    def episodes(self) -> str:
        """A ring with trajectories: its episode index (a zset: member a trajectory's first write number,
        score its length in rows; ``lua/_episodes.lua``), kept by every ring write."""
        return f"{self.base}:j"

    @property
    def sampled_rows(self) -> str:
        """One bit per slot: whether the row in the slot was sampled since it was written (``lua/_seen.lua``),
        set by the sampling call, cleared by the ring write that overwrites the slot; ``stats()`` counts them."""
        return f"{self.base}:cs"

    @property
    def side_keys(self) -> list[str]:
        """The keys of the store beside its data (:attr:`lease_keys`, then :attr:`stats`, :attr:`episodes`,
        :attr:`sampled_rows` and :attr:`rollout_keys`), not measured as the data's strings: calls on the whole store
        (delete, copy, time to live) add them to :meth:`all_keys`."""
        return [*self.lease_keys, self.stats, self.episodes, self.sampled_rows, *self.rollout_keys]

    @property
    def sampling_keys(self) -> list[str]:
        """The keys a ring's sampling policy keeps (see ``_format.sampling_policy``), in the order scripts take them."""
        return [self.priorities, self.times_sampled]

    def value_type(self, key: str) -> str | None:
        """The Redis type tdstore keeps under ``key``, a key of this store or its prefix's registry (the
        layout above): ``hash``, ``zset``, ``set`` or ``string``; None for a direct write's aside key (a
        string or a hash, see :meth:`write_aside`). A key of another type was written by another client
        (``_format.integrity.WrongTypeError``)."""
        if key in (self.meta, self.inventory, self.replies, self.lease_keys[0]) or key.endswith("}:g"):
            return "hash"
        if key in self.lease_keys or key == self.episodes or key in self.rollout_keys[:2]:
            return "zset"
        if key in self.rollout_keys[2:4]:
            return "hash"
        if key == self.rollout_keys[4]:
            return "list"
        if key == self.registry:
            return "set"
        return None if key.endswith(":w") else "string"

    def describe(self, key: str) -> tuple[str, int, int] | None:
        """``(role, leaf number, segment)`` of a data (``d``), offset (``o``) or shape (``s``) key of
        this store; None for any other key (header, inventory, guard, staging key)."""
        return _describe(self, key)

    def segment_of(self, key: str) -> int:
        """The segment that a key of this store (data, table, guard or staging key) belongs to."""
        head = f"{self._escaped[0]}:{{{self._escaped[1]}"
        if not key.startswith(head):
            raise ValueError(f"{key!r} is not a key of this store")
        rest = key[len(head) :]
        if rest.startswith("}%s"):  # a store that is not spread keeps every segment under the header's tag
            return int(rest[3 : rest.index(":")])
        if not rest.startswith("%s"):
            return 0
        return int(rest[2 : rest.index("}")])

    def data(self, leaf: int, seg: int = 0) -> str:
        return f"{self.segment_base(seg) if seg else self.base}:d:{leaf}"

    def offsets(self, leaf: int, seg: int = 0) -> str:
        return f"{self.segment_base(seg) if seg else self.base}:o:{leaf}"

    def shapes(self, leaf: int, seg: int = 0) -> str:
        return f"{self.segment_base(seg) if seg else self.base}:s:{leaf}"

    def write_aside(self, key: str) -> str:
        """Where data key ``key`` stands while a direct ring write's rows go in (``lua/direct.lua``):
        it exists only inside that write's transaction (or, after a refused one, as a hash that
        the same transaction deletes)."""
        return f"{key}:w"

    def staging(self, target: str, token: str) -> str:
        """A temporary key that a bulk write fills with plain SETRANGEs before a script moves it onto ``target``.

        It carries a short TTL, so one left behind by a refused or interrupted write expires.
        """
        assert target.startswith(f"{self._escaped[0]}:{{{self._escaped[1]}")
        return f"{target}:stage:{token}"

    def leaf_keys(self, leaf: int, seg: int = 0) -> tuple[str, str, str]:
        """All keys that leaf number ``leaf`` may own in segment ``seg`` (data, offsets, shapes)."""
        return (self.data(leaf, seg), self.offsets(leaf, seg), self.shapes(leaf, seg))

    def all_keys(self, next_leaf: int, segments: int = 1) -> list[str]:
        """Every key the store can own, given the next unused leaf number and its segment count:
        the header, the inventory, then each segment's data and table keys, then the
        sampling policy's keys (absent unless the store has one), then the reply cache (a hash).

        Deleted leaves keep their numbers, so listing every number below
        ``next_leaf`` also covers keys a failed or interrupted write may have left.
        """
        keys = [self.meta, self.inventory]
        for seg in range(segments):
            for n in range(next_leaf):
                keys.extend(self.leaf_keys(n, seg))
        return keys + self.sampling_keys + self.build_keys + [self.replies]

    def segment_keys(self, next_leaf: int, seg: int) -> list[str]:
        """The data and table keys of segment ``seg`` (no header)."""
        keys: list[str] = []
        for n in range(next_leaf):
            keys.extend(self.leaf_keys(n, seg))
        return keys


@lru_cache(maxsize=65536)
def _describe(keys: StoreKeys, key: str) -> tuple[str, int, int] | None:
    parts = key.rsplit(":", 2)
    if len(parts) != 3 or parts[1] not in ("d", "o", "s") or not parts[2].isdigit():
        return None
    try:
        return parts[1], int(parts[2]), keys.segment_of(key)
    except ValueError:
        return None


class KeyTable:
    """KEYS of one script call: the header first (and, for a store that keeps one, its inventory,
    see ``_format.integrity``), then each key once, referenced by 1-based index."""

    def __init__(self, *head: str) -> None:
        self.keys = list(head)
        self.head = len(head)
        self._pos: dict[str, int] = {}

    def fresh(self) -> KeyTable:
        """An empty table with the same head keys."""
        return KeyTable(*self.keys[: self.head])

    def ref(self, key: str) -> int:
        pos = self._pos.get(key)
        if pos is None:
            self.keys.append(key)
            pos = self._pos[key] = len(self.keys)
        return pos

    def block(self, keys: list[str]) -> int:
        """Append ``keys`` as consecutive KEYS (a script adds a segment number to the first index)."""
        first = len(self.keys) + 1
        self.keys.extend(keys)
        return first
