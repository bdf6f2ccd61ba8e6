"""Many commands in one write and their replies read in one go: the wire side of a read transaction.

A random batch read is one ``MULTI``/``EXEC`` of hundreds of plain ``GETRANGE``s (see
``_engine.Call``). Through redis-py's pipeline, packing each command and reading each
``QUEUED`` reply costs several microseconds of Python, more than the server spends on
the whole transaction; here the commands are packed straight into RESP bytes and the
replies taken from the connection's hiredis reader in a tight loop (measured on one
server, 256 ranges of 300 bytes: 0.38 ms per transaction against 0.47 ms through
``read_response`` per reply and 0.72 ms as one ``EVALSHA`` doing the same ``GETRANGE``s,
whose ``redis.call`` costs about 2 us each on Redis 7.0 against 0.13 us for the command).

Connections with redis-py's hiredis parser (RESP2 or RESP3) take the tight loop; any other
connection reads reply by reply through ``read_response``, which gives the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

try:  # redis-py's hiredis parser and the sentinel its reader returns when a reply is incomplete
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
    from redis._parsers.hiredis import _HiredisParser
except ImportError:  # pragma: no cover - another redis-py layout: read reply by reply
    _HiredisParser = None  # type: ignore[assignment,misc]
    _NOT_ENOUGH_DATA = object()
try:
    from hiredis import PushNotification as _PUSH
except ImportError:  # pragma: no cover - hiredis < 3.2 has no push type
    _PUSH = None


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def pack(*args: bytes | str | int) -> bytes:
    """One command in RESP (bytes, str as UTF-8, int in decimal)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        parts.append(_bulk(a))
    return b"".join(parts)


def exchange(conn: Any, packed: Sequence[bytes], n_replies: int) -> list[Any]:
    """Send ``packed`` on ``conn`` (one write) and read exactly ``n_replies`` replies (bytes, never decoded).

    Every reply is read before an error reply is raised (the first one), so the
    connection stays in step with the server. A connection error propagates; the
    caller must then drop the connection.
    """
    conn.send_packed_command([b"".join(packed)], check_health=False)
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    replies: list[Any] = []
    if _HiredisParser is not None and isinstance(parser, _HiredisParser) and reader is not None:
        gets, more, push = reader.gets, parser.read_from_socket, _PUSH
        left = n_replies
        while left:
            r = gets(False)
            if r is _NOT_ENOUGH_DATA:
                more()
            elif push is None or r.__class__ is not push:  # RESP3 out-of-band pushes are not replies
                replies.append(r)
                left -= 1
    else:
        for _ in range(n_replies):
            try:
                replies.append(conn.read_response(disable_decoding=True))
            except redis.ResponseError as err:
                replies.append(err)
    _raise_first_error(replies)
    return replies


def _raise_first_error(replies: list[Any]) -> None:
    """Raise the first error reply, looking into arrays (EXEC's) one level down."""
    kinds = set(map(type, replies))
    if list in kinds:
        for r in replies:
            if r.__class__ is list:
                kinds.update(map(type, r))
    if any(issubclass(k, Exception) for k in kinds):
        for r in replies:
            for item in r if r.__class__ is list else (r,):
                if isinstance(item, Exception):
                    raise item


#: One byte range run: a key and the starts and lengths of its ranges (int64 arrays), read in order.
Piece = tuple[str, np.ndarray, np.ndarray]


def pack_chunked_getranges(buffers: Sequence[Sequence[Piece]], chunk: int) -> tuple[bytes, list[int]]:
    """``GETRANGE``s reading every range of every piece of every buffer, in order, in pieces of at
    most ``chunk`` bytes, and how many commands each buffer takes (an empty range takes none)."""
    out: list[bytes] = []
    counts: list[int] = []
    for pieces in buffers:
        n = 0
        for key, starts, lengths in pieces:
            if not starts.size:
                continue
            if int(lengths.min()) > 0 and int(lengths.max()) <= chunk:  # the common case: no loop in Python
                out.append(_getranges(key.encode(), starts, starts + lengths - 1))
                n += int(starts.size)
                continue
            firsts, lasts = [], []
            for start, length in zip(starts.tolist(), lengths.tolist()):
                for a in range(start, start + length, chunk):
                    firsts.append(a)
                    lasts.append(min(a + chunk, start + length) - 1)
            if firsts:
                out.append(_getranges(key.encode(), firsts, lasts))
                n += len(firsts)
        counts.append(n)
    return b"".join(out), counts


def _getranges(key: bytes, starts: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray) -> bytes:
    """``GETRANGE key start end`` for each pair, formatted in one ``%`` (three times faster than one by one)."""
    head = (b"*4\r\n$8\r\nGETRANGE\r\n" + _bulk(key)).replace(b"%", b"%%")
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    cols = np.stack([_digits(s), s, _digits(e), e], axis=1).ravel().tolist()
    return ((head + b"$%d\r\n%d\r\n$%d\r\n%d\r\n") * len(starts)) % tuple(cols)


def _digits(x: np.ndarray) -> np.ndarray:
    """Decimal digits of each non-negative int (exact: compared with powers of ten, no float log)."""
    return np.searchsorted(_POWERS, x, side="right").astype(np.int64) + (x == 0)


_POWERS = np.array([10**k for k in range(19)], dtype=np.int64)
