"""Whole-store calls cut in bounded batches: delete (``clear.lua``) and deadlines (``expire.lua``).

One script holds the whole server while it runs, and a call naming every key of a store of
thousands of segments would hold it for seconds (``lua/README.md``, Worst cases). So a store
with more keys than :data:`BATCH_KEYS` is deleted, or given its time to live, in several calls
of at most that many keys each; a smaller store still takes exactly one call. How a reader never
sees a half-deleted or half-expired store, and what a client dying half-way leaves, is the
scripts' part (``clear.lua``: a tombstone header, deleted last; ``expire.lua``: a header that
outlives every key and reads as gone once a key may have expired). No torch: ``tdstore rm``
uses this too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tdstore._engine import scripts
from tdstore._format.header_info import parse_header
from tdstore._format.keys import StoreKeys

#: Keys one call of a whole-store script may name. A key costs the server ~2-15 us in these
#: scripts (DEL, PEXPIREAT, STRLEN and an inventory entry), so a call stays near 10 ms, well
#: under the 50 ms standard, on a busy 2-core machine. A multiple of 3: a leaf's data, offset
#: and shape keys of one segment stay in one batch (commit.lua checks data against offsets).
BATCH_KEYS = 1023

#: Bytes one ``clear.lua`` call frees at most (plus the value that crosses the bound): freeing a
#: value takes the server ~0.5-0.9 ms per 4 MiB (one call deleting 64 values of 4 MiB: 29 ms,
#: 128: 116 ms), so a batch of large segments is cut by bytes before keys.
CLEAR_BYTES = 64 << 20


def batches(keys: list[str]) -> list[list[str]]:
    """``keys`` in order, cut into lists of at most :data:`BATCH_KEYS`."""
    size = max(3, BATCH_KEYS - BATCH_KEYS % 3)
    return [keys[i : i + size] for i in range(0, len(keys), size)] or [[]]


def status(reply: Any) -> str:
    """A script reply's marker as text (``OK``, ``STALE``, ``GONE``, ...)."""
    head = reply[0]
    return head.decode() if isinstance(head, bytes) else str(head)


def clear(client: Any, meta: str, registry: str | None, keys: list[str], spec: str, td_id: str, execute: Any = None) -> list:
    """Delete the store whose header is ``meta`` and whose other keys are ``keys`` (``clear.lua``).

    ``registry`` is the prefix's registry set, None on Redis Cluster (the caller updates it).
    One call when ``keys`` fit in a batch of :data:`BATCH_KEYS` keys and :data:`CLEAR_BYTES`
    bytes; otherwise the first call turns the header into a tombstone (after ``spec``'s check),
    the next ones delete keys under it, and the one that reaches the end the header. Returns the
    first call's reply when it is not ``OK`` (``STALE``: plan again; ``GONE``), else
    ``[b"OK", keys deleted]``. A later call that finds the tombstone gone (another client
    finished the delete, or its time to live ran out) stops: nothing is left.
    """
    head = [meta] if registry is None else [meta, registry]
    noreg = "noreg" if registry is None else ""
    size = len(batches(keys)[0])
    later = f"{spec.split(':', 1)[0]}:X" if spec != "*" else "*"
    total, pending, first = 0, keys, True
    while True:
        part = pending[:size]
        ends = len(pending) <= size
        args = [spec if first else later, td_id, noreg, "" if ends else "keep", CLEAR_BYTES]
        reply = scripts.call(client, "clear", [*head, *part], args, execute)
        if status(reply) != "OK":
            return reply if first else [b"OK", total]
        total += int(reply[1])
        went = int(reply[2])
        pending, first = pending[went:], False
        if ends and went == len(part):  # the header went with the last keys
            return [b"OK", total]


def expire(client: Any, meta: str, keys: list[str], spec: str, ttl_ms: int, execute: Any = None) -> list:
    """Give the store whose header is ``meta`` and whose other keys are ``keys`` one deadline
    ``ttl_ms`` from now, or none when 0 (``expire.lua``): one call when they fit in a batch,
    else batches under the deadline the first one read. Returns the first reply that is not
    ``OK`` (``STALE``: the caller plans again and starts over; ``GONE``), else the last one.
    """
    parts = batches(keys)
    if len(parts) == 1:
        return scripts.call(client, "expire", [meta, *parts[0]], [spec, ttl_ms], execute)
    at = ""
    reply: list = []
    for i, part in enumerate(parts):
        phase = "first" if i == 0 else "last" if i == len(parts) - 1 else "next"
        reply = scripts.call(client, "expire", [meta, *part], [spec, ttl_ms, at, phase], execute)
        if status(reply) != "OK":
            return reply
        at = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
    return reply


def clear_lapsed(client: Any, keys: StoreKeys, fields: dict, cluster: bool, execute: Any = None) -> int:
    """Delete what a whole-store call cut in batches left of a store (``create.lua``'s ``LAPSED``
    reply, ``tdstore rm``): ``fields`` is its header, a tombstone or a lapsed one."""
    info = parse_header(fields)
    keys = replace(keys, segment_tags=info.spread or not cluster)  # its layout, as its header says (_inspect_read.store_layout)
    every = keys.all_keys(info.next_leaf, info.segments) + keys.side_keys
    reply = clear(client, every[0], None if cluster else keys.registry, every[1:], f"{info.epoch}:X", keys.td_id, execute)
    if cluster:
        client.srem(keys.registry, keys.td_id)
    return int(reply[1]) if status(reply) == "OK" else 0
