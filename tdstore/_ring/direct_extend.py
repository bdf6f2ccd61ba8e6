"""Ring writes whose rows travel as plain ``SETRANGE`` commands (``lua/direct.lua``).

A row argument of a script costs the server about 1.2 us per KiB to become a Lua string
(``write.lua`` spends 0.3 ms of a 500-row extend of 150 KB on it), against a few
microseconds for ``SETRANGE``. An ``extend`` whose rows go to homogeneous keys (the row
block, or blobs of their own) of a single-segment store without a sampling policy is sent
instead as one transaction, in one round trip::

    MULTI, EVALSHA direct 'open', SETRANGE K:w ..., EVALSHA direct 'close', EXEC

'open' checks what ``write.lua`` checks (the request id, the schema versions, the key sizes)
and that the ring cursor is where this handle expects it (the slots of the rows follow from
it), advances the cursor, records the request and moves each data key K to K:w; the rows go
there, and 'close' moves the keys back. Everything runs in one ``EXEC``: a reader never sees a
row without its cursor, nor a key away. The first extend of a ring this handle made (cursor 0,
no keys yet) goes the same way: 'open' also swaps in the schema its rows create and allocates
the keys. When 'open' refuses, the rows hit a hash and write nothing, and the write goes
through ``write.lua`` (the cursor moved: another writer got in first; a stale schema; a lost
key...). A handle that keeps finding the cursor moved (several writers) sends through
``write.lua`` directly for a while, then tries again.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import redis

from tdstore._engine import deadline, scripts
from tdstore._format import wire
from tdstore._format.op_kinds import Write
from tdstore._format.schema import Header, Leaf
from tdstore._plan.call import leaf_checks

#: A handle whose direct write found the cursor moved skips the direct path for this many
#: writes (doubling, up to ``_MAX_SKIP``, while it keeps being refused).
_FIRST_SKIP, _MAX_SKIP = 2, 64


class _State:
    """What a handle knows for its direct writes: the cursor it expects, and how long to skip."""

    __slots__ = ("rw", "skip", "backoff", "off", "loaded")

    def __init__(self) -> None:
        self.loaded = False  # lua/direct.lua sent (SCRIPT LOAD first inside its first transaction) by this handle
        self.rw: int | None = None  # the ring write counter after this handle's last write
        self.skip = 0
        self.backoff = _FIRST_SKIP
        self.off = False  # no MULTI on this server (an ACL, a proxy): never again


_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()

#: Servers (``ConnectionSpec.describe()``) this process has sent ``lua/direct.lua`` to: a new handle on
#: one of them sends ``EVALSHA`` without the script's text first. A server that lost it since (restarted,
#: ``SCRIPT FLUSH``) answers NOSCRIPT: nothing is written, the server leaves this set and the write goes
#: through ``write.lua`` (see ``extend``).
_LOADED_ON: set[str] = set()

#: How this process's direct ring writes went (``tools/stress.py`` reports it): "direct" (the rows
#: went in), "moved" (another writer had moved the cursor), "refused" (anything else write.lua
#: must do), "skipped" (sent through write.lua while backing off after "moved").
outcomes: Counter[str] = Counter()


def _state(engine: Any) -> _State:
    st = _STATES.get(engine)
    if st is None:
        st = _STATES[engine] = _State()
        st.loaded = _server(engine) in _LOADED_ON
    return st


def _server(engine: Any) -> str | None:
    """The server a handle's direct writes go to, as :data:`_LOADED_ON` names it (None: a cluster, whose
    nodes each load the script, or fakeredis, whose servers share one address)."""
    if engine.spec.cluster or type(engine.client).__module__.startswith("fakeredis"):
        return None
    return str(engine.spec.describe())


def learn(engine: Any, rw: int) -> None:
    """The ring write counter after a write this handle made through ``write.lua``."""
    _state(engine).rw = rw


def usable(engine: Any, h: Header) -> bool:
    """Whether an extend of this handle may go direct now (otherwise it goes through ``write.lua``)."""
    st = _state(engine)
    if st.rw is None or st.off or engine.readonly:
        return False
    if st.skip > 0:
        st.skip -= 1
        outcomes["skipped"] += 1
        return False
    # a store without keys yet: its first write creates them (direct when the store keeps an inventory)
    return not h.spread and h.segments.n == 1 and h.sampling is None and h.trajectories is None and (bool(h.leaves) or h.tracked)


def _aside_writes(
    engine: Any, kt: Any, ops: list[list[Any]], count: int, s0: int, n: int
) -> tuple[list[str], list[int], list[tuple[str, int, memoryview]]]:
    """The keys of a direct ring write (the header, the inventory, the reply cache, then each leaf's blob
    and its aside key, then the stats hash and the sampled-rows bitmap), each blob's full size, and the
    SETRANGEs of the ``n`` rows from slot ``s0`` into the aside keys (two per leaf when the rows wrap around the ring)."""
    first = min(n, count - s0)
    keys: list[str] = [engine.keys.meta, engine.keys.inventory, engine.keys.replies]
    sizes: list[int] = []
    writes: list[tuple[str, int, memoryview]] = []
    for op in ops:
        key, nb = kt.keys[op[1] - 1], int(op[2])
        if nb == 0:
            continue
        aside = engine.keys.write_aside(key)
        keys += [key, aside]
        sizes.append(count * nb)
        data = memoryview(op[3]).cast("B")
        writes.append((aside, s0 * nb, data[: first * nb]))
        if first < n:
            writes.append((aside, 0, data[first * nb :]))
    keys += [engine.keys.stats, engine.keys.sampled_rows]  # after the pairs: 'open' counts the rows there (lua/direct.lua)
    return keys, sizes, writes


def extend(
    engine: Any, h: Header, kt: Any, ops: list[list[Any]], touched: list[Leaf], n: int, request: str, new_header: Header | None = None
) -> int | None:
    """Send the planned ring write ``ops`` (a 'W' op, then 'X' ops) direct; the slot of its first
    row (the cursor before it), or None when it must go through ``write.lua``. ``new_header``: the
    schema the write gives a store without keys (its first keys, allocated by 'open')."""
    st = _state(engine)
    assert st.rw is not None
    if not ops or ops[0][0] != Write.W.marker or any(op[0] != Write.X.marker for op in ops[1:]):
        return None
    rw = st.rw
    after = new_header or h
    count = after.count
    s0 = rw % count
    keys, sizes, writes = _aside_writes(engine, kt, ops[1:], count, s0, n)
    if not writes:
        return None
    if new_header is None:
        check, schema = [f"{h.epoch}:K{h.keyset_version}", leaf_checks(touched)], ["", ""]
    else:  # a schema change is planned from the exact version it replaces, as write.lua's are
        check, schema = [f"{h.epoch}:V{h.version}", ""], [new_header.schema_json(), new_header.version_fields(h)]
    sha = scripts.script_source("direct")[1]
    nk = len(keys)
    head = ["EVALSHA", sha, nk, *keys, "open", request, rw, n, *check, *schema, engine.keys.events, *sizes]
    tail = ["EVALSHA", sha, nk, *keys, "close", request, len(sizes)]
    deadline.arm()  # sent next: from now on the rows may be written
    try:
        replies = _send(engine, head, writes, tail, load=not st.loaded)
        if replies is None:  # a cluster slot that moved, a node away: write.lua follows redirects
            return None
        st.loaded = True
        server = _server(engine)
        if server is not None:
            _LOADED_ON.add(server)
    except redis.exceptions.ResponseError as err:
        text = str(err).lower()
        if isinstance(err, redis.exceptions.NoScriptError):
            # neither end ran: the rows went to the aside keys only, which nothing reads
            # (a server restarted, or its scripts flushed, since this handle loaded it)
            engine.execute(engine.client, "DEL", *keys[4 : 3 + 2 * len(sizes) : 2])
            st.loaded = False
            _LOADED_ON.discard(_server(engine) or "")
            return None
        if "noperm" in text or "unknown command" in text or "no permissions" in text:
            st.off = True
            return None
        if "oom" in text or "execabort" in text:  # refused while queueing: nothing ran; write.lua names the error
            return None
        raise scripts.translate(err, keys) from None
    opened, closed = replies[0], replies[-1]
    if isinstance(opened, Exception):
        raise scripts.translate(opened, keys) if isinstance(opened, redis.exceptions.ResponseError) else opened
    status = opened[0]
    if status == b"GO":
        if not (isinstance(closed, list) and closed and closed[0] == b"OK"):
            raise scripts.ServerScriptError(f"unexpected reply {closed!r} from direct.lua close")
        _adopt(engine, new_header, opened[1])
        st.rw = rw + n
        st.backoff = _FIRST_SKIP
        outcomes["direct"] += 1
        return rw
    if status == b"DONE":  # a resend of a write that went in: its first reply
        _adopt(engine, new_header, opened[1])
        start = int(opened[2][1:]) if opened[2][:1] == b"W" else int(opened[2])
        st.rw = start + n
        return start
    if status == b"MOVED":  # another writer got in first: write.lua this time, and for a while
        st.rw = int(opened[1])
        outcomes["moved"] += 1
        st.skip = st.backoff
        st.backoff = min(2 * st.backoff, _MAX_SKIP)
        return None
    outcomes["refused"] += 1
    if status == b"STALE":
        engine.adopt_stale(opened)
        return None
    if status == b"GONE":
        raise engine.gone()
    return None  # 'SCRIPT': write.lua allocates, names a lost key, or applies the policy


def _adopt(engine: Any, new_header: Header | None, version: bytes) -> None:
    """After a write that gave the store its first keys: the schema it made, when the server's version
    is still the one it set (else a later change came first: the header is read again)."""
    if new_header is None:
        return
    if version == str(new_header.version).encode():
        engine.set_header(new_header)
    else:
        engine.set_header(engine.fetch_header())


#: The packed ``EVALSHA sha numkeys keys...`` of recent direct writes: the same for every write of a handle.
_PREFIXES: dict[tuple[Any, ...], bytes] = {}


def _pack_call(call: list[Any], enc: tuple[str, str]) -> bytes:
    """``call`` (``EVALSHA``, sha, number of keys, keys, args) in RESP, its ``EVALSHA`` through the keys packed once."""
    fixed = 3 + int(call[2])
    cache_key = (*call[:fixed], *enc)
    prefix = _PREFIXES.get(cache_key)
    if prefix is None:
        if len(_PREFIXES) >= 256:
            _PREFIXES.clear()
        prefix = _PREFIXES[cache_key] = wire.pack_args(*call[:fixed], encoding=enc)
    return b"*%d\r\n%b%b" % (len(call), prefix, wire.pack_args(*call[fixed:], encoding=enc))


#: A row run at least this long is sent as it is, not copied into one buffer with the commands around it.
_BIG = 32 * 1024


def _chunks(parts: list[Any]) -> list[Any]:
    """``parts`` as few buffers to send: small ones joined, large row runs kept (a 138 KB copy costs more than a send)."""
    out: list[Any] = []
    small: list[Any] = []
    for p in parts:
        if len(p) >= _BIG:
            if small:
                out.append(b"".join(small))
                small = []
            out.append(p)
        else:
            small.append(p)
    if small:
        out.append(b"".join(small))
    return out


def _send(engine: Any, head: list[Any], writes: list[tuple[str, int, memoryview]], tail: list[Any], load: bool = False) -> list[Any] | None:
    """MULTI, ``head``, the SETRANGEs, ``tail``, EXEC: the EXEC reply (one item per command, errors as
    exceptions). On the handle's held connection, else through a redis-py transaction pipeline.
    ``load``: the script's text goes first inside the transaction (SCRIPT LOAD), so the EVALSHAs after it find it."""
    text = scripts.script_source("direct")[0]
    enc = engine._key_encoding
    parts: list[Any] = [wire.MULTI, *([wire.pack("SCRIPT", "LOAD", text)] if load else []), _pack_call(head, enc)]
    for key, offset, data in writes:
        k = key.encode(*enc)
        parts.append(b"*4\r\n$8\r\nSETRANGE\r\n$%d\r\n%b\r\n$%d\r\n%d\r\n$%d\r\n" % (len(k), k, len(str(offset)), offset, len(data)))
        parts.append(data)
        parts.append(b"\r\n")
    parts += [_pack_call(tail, enc), wire.EXEC]
    n_commands = len(writes) + 2 + load

    def send(conn: Any) -> Any:
        conn.send_packed_command(_chunks(parts), check_health=False)
        replies: list[Any] = []
        for _ in range(n_commands + 2):
            try:
                replies.append(conn.read_response(disable_decoding=True))
            except redis.exceptions.ResponseError as err:
                replies.append(err)
        for r in replies[:-1]:
            if isinstance(r, redis.exceptions.ResponseError):
                raise r  # refused while queueing (NOSCRIPT is not: it comes in the EXEC reply)
        out = replies[-1]
        if isinstance(out, Exception):
            raise out
        if not isinstance(out, list) or len(out) != n_commands:
            conn.disconnect()
            raise redis.exceptions.InvalidResponse(f"expected EXEC to answer {n_commands} replies, got {out!r}")
        out = out[load:]  # the SCRIPT LOAD's reply
        for r in (out[0], out[-1]):
            if isinstance(r, redis.exceptions.NoScriptError):
                raise r
        return out

    def pipeline(client: Any) -> Any:
        pipe = client.pipeline(transaction=True)
        if load:
            pipe.execute_command("SCRIPT", "LOAD", text)
        pipe.execute_command(*head)
        for key, offset, data in writes:
            pipe.setrange(key, offset, bytes(data))
        pipe.execute_command(*tail)
        out = pipe.execute(raise_on_error=False)[load:]
        for r in (out[0], out[-1]):
            if isinstance(r, redis.exceptions.NoScriptError):
                raise r
        return out

    if not engine.spec.cluster:
        return engine._held._on_held(engine.client, send, lambda: pipeline(engine.client))
    # on a cluster, on the primary that serves the store's slot (every key of a store that is not spread
    # shares the header's hash tag); a redirect while queueing aborts the transaction: None
    return engine._on_store_node(engine.client, lambda node: engine._held._on_held(node, send, lambda: pipeline(node)), lambda: None)


__all__ = ["extend", "learn", "usable"]
