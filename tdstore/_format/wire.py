"""Many commands in one write and their replies read in one go: the wire side of a read transaction.

A random batch read is one ``MULTI``/``EXEC`` of hundreds of plain ``GETRANGE``s (see
``_plan.call.Call``). Through redis-py's pipeline, packing each command and reading each
``QUEUED`` reply costs several microseconds of Python, more than the server spends on
the whole transaction; here the commands are packed straight into RESP bytes, the
``+OK``/``+QUEUED`` replies are compared as bytes and only the ``EXEC`` array is parsed
(measured on one server, 256 ranges of 300 bytes: 0.38 ms per transaction with the
connection's hiredis reader in a loop, against 0.47 ms through ``read_response`` per reply
and 0.72 ms as one ``EVALSHA`` doing the same ``GETRANGE``s, whose ``redis.call`` costs
about 2 us each on Redis 7.0 against 0.13 us for the command).

Connections with redis-py's hiredis parser take these fast paths; any other connection
reads reply by reply through ``read_response``, which gives the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import redis

try:  # redis-py's hiredis parser and the sentinel its reader returns when a reply is incomplete
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
    from redis._parsers.hiredis import _HiredisParser

    _HAS_HIREDIS_PARSER = True
except ImportError:  # pragma: no cover - another redis-py layout: read reply by reply
    _HAS_HIREDIS_PARSER = False
    _NOT_ENOUGH_DATA = object()
try:
    import hiredis

    _HAS_HIREDIS = True
except ImportError:  # pragma: no cover - redis[hiredis] is a dependency; without it, read reply by reply
    _HAS_HIREDIS = False
_PUSH = getattr(hiredis, "PushNotification", None) if _HAS_HIREDIS else None  # hiredis < 3.2 has no push type

MULTI = b"*1\r\n$5\r\nMULTI\r\n"
EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_OK = b"+OK\r\n"
_QUEUED = b"+QUEUED\r\n"
_RECV_BYTES = 1 << 17
_INCOMPLETE = object()


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


def pack(*args: bytes | str | int, encoding: tuple[str, str] = ("utf-8", "strict")) -> bytes:
    """One command in RESP (bytes, str in ``encoding`` (name, errors) as the client encodes it, int in decimal)."""
    return b"*%d\r\n%b" % (len(args), pack_args(*args, encoding=encoding))


def pack_args(*args: bytes | str | int, encoding: tuple[str, str] = ("utf-8", "strict")) -> bytes:
    """``args`` as RESP bulk strings, without the array header: part of a command (see :func:`pack`)."""
    parts = []
    for a in args:
        if isinstance(a, str):
            a = a.encode(*encoding)
        elif isinstance(a, int):
            a = b"%d" % a
        parts.append(_bulk(a))
    return b"".join(parts)


def _fast_path_ok(conn: Any, parser: Any) -> bool:
    """Whether replies can be taken from a hiredis reader directly: redis-py's hiredis parser,
    and pushes told apart from replies (hiredis 3.2 or newer, or a RESP2 connection)."""
    return (
        _HAS_HIREDIS_PARSER
        and isinstance(parser, _HiredisParser)
        and getattr(parser, "_reader", None) is not None
        and (_PUSH is not None or str(getattr(conn, "protocol", 2) or 2) == "2")
    )


def _is_push(r: Any, parser: Any) -> bool:
    """A RESP3 out-of-band push (client tracking, maintenance notices): handed to redis-py's handler, not a reply."""
    if _PUSH is None or r.__class__ is not _PUSH:
        return False
    handle = getattr(parser, "handle_push_response", None)
    if handle is not None:
        handle(r)
    return True


def exchange(conn: Any, packed: Sequence[bytes], n_replies: int) -> list[Any]:
    """Send ``packed`` on ``conn`` (one write) and read exactly ``n_replies`` replies (bytes, never decoded).

    Every reply is read before an error reply is raised (the first one), so the
    connection stays in step with the server. A connection error propagates; the
    caller must then drop the connection.
    """
    conn.send_packed_command([b"".join(packed)], check_health=False)
    parser: Any = getattr(conn, "_parser", None)  # redis-py's parser of the connection, private to it
    replies: list[Any] = []
    if _fast_path_ok(conn, parser):
        gets, more = parser._reader.gets, parser.read_from_socket
        left = n_replies
        while left:
            r = gets(False)
            if r is _NOT_ENOUGH_DATA:
                more()
            elif not _is_push(r, parser):
                replies.append(r)
                left -= 1
    else:  # read_response handles pushes itself
        for _ in range(n_replies):
            try:
                replies.append(conn.read_response(disable_decoding=True))
            except redis.ResponseError as err:
                replies.append(err)
    _raise_first_error(replies)
    return replies


def transaction(conn: Any, body: bytes, n_commands: int) -> list[Any]:
    """``MULTI``, the ``n_commands`` commands packed in ``body``, ``EXEC``: the ``EXEC`` reply (one per command).

    The ``+OK`` and ``+QUEUED`` replies that come first are known in advance: they are
    compared byte for byte as they arrive, and only the ``EXEC`` array goes through a hiredis
    reader (one call instead of one per reply). At the first byte that differs (an error while
    queueing, a server or ACL user without ``MULTI``, a RESP3 push) every reply is parsed one
    by one instead. Needs the connection's socket and redis-py's hiredis parser with nothing
    buffered; otherwise ``exchange`` does the same more slowly.
    """
    sock = getattr(conn, "_sock", None)
    parser: Any = getattr(conn, "_parser", None)  # redis-py's parser of the connection, private to it
    if sock is None or not _HAS_HIREDIS or not _fast_path_ok(conn, parser) or parser._reader.has_data():
        replies = exchange(conn, [MULTI, body, EXEC], n_commands + 2)
        return _exec_reply(conn, replies[-1], n_commands)
    conn.send_packed_command([MULTI + body + EXEC], check_health=False)
    reader = hiredis.Reader(protocolError=redis.exceptions.InvalidResponse, replyError=parser.parse_error, notEnoughData=_INCOMPLETE)
    prefix = _OK + _QUEUED * n_commands
    got = b""  # bytes, as Reader.feed takes them (the first recv is kept without a copy)
    try:
        while len(got) < len(prefix) and prefix.startswith(got):
            got += _recv(sock)
        if got.startswith(prefix):
            reader.feed(got, len(prefix))
            r = _read_one(reader, sock)
            while _is_push(r, parser):
                r = _read_one(reader, sock)
            replies = [r]
        else:  # not the replies of a queued transaction: every reply, one by one
            reader.feed(got)
            replies = []
            while len(replies) < n_commands + 2:
                r = _read_one(reader, sock)
                if not _is_push(r, parser):
                    replies.append(r)
    except TimeoutError as err:  # socket.timeout
        raise redis.TimeoutError("Timeout reading from socket") from err
    except OSError as err:
        raise redis.ConnectionError(f"Error while reading from socket: {err}") from err
    if reader.has_data():  # bytes after the EXEC reply: this connection can no longer be trusted
        conn.disconnect()
    _raise_first_error(replies)
    return _exec_reply(conn, replies[-1], n_commands)


def _exec_reply(conn: Any, reply: Any, n_commands: int) -> list[Any]:
    """``reply`` when it is what EXEC answers for ``n_commands`` commands; otherwise the connection is out of step."""
    if isinstance(reply, list) and len(reply) == n_commands:
        return reply
    conn.disconnect()
    raise redis.exceptions.InvalidResponse(f"expected EXEC to answer {n_commands} replies, got {type(reply).__name__}")


def _recv(sock: Any) -> bytes:
    chunk = sock.recv(_RECV_BYTES)
    if not chunk:
        raise redis.ConnectionError("Connection closed by server.")
    return chunk


def _read_one(reader: Any, sock: Any) -> Any:
    r = reader.gets(False)
    while r is _INCOMPLETE:
        reader.feed(_recv(sock))
        r = reader.gets(False)
    return r


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
#: In a read transaction, a value of at most this many bytes per range the read needs from it (a
#: homogeneous leaf's blob, a heterogeneous leaf's offset table) is read whole, in one GETRANGE,
#: and cut on the client instead of one GETRANGE per range.
TX_WHOLE_BYTES_PER_RANGE = 2048


def pack_chunked_getranges(
    buffers: Sequence[Sequence[Piece]], chunk: int, encoding: tuple[str, str] = ("utf-8", "strict")
) -> tuple[bytes, list[int]]:
    """``GETRANGE``s reading every range of every piece of every buffer, in order, in pieces of at
    most ``chunk`` bytes, and how many commands each buffer takes (an empty range takes none).
    Key names are encoded as ``encoding`` (name, errors), as the client encodes them."""
    out: list[bytes] = []
    counts: list[int] = []
    for pieces in buffers:
        n = 0
        for key, starts, lengths in pieces:
            if not starts.size:
                continue
            if int(lengths.min()) > 0 and int(lengths.max()) <= chunk:  # the common case: no loop in Python
                out.append(_getranges(key.encode(*encoding), starts, starts + lengths - 1))
                n += int(starts.size)
                continue
            firsts, lasts = chunked(starts, lengths, chunk)
            if firsts:
                out.append(_getranges(key.encode(*encoding), firsts, lasts))
                n += len(firsts)
        counts.append(n)
    return b"".join(out), counts


def chunked(starts: np.ndarray, lengths: np.ndarray, chunk: int) -> tuple[list[int], list[int]]:
    """First and last byte (inclusive) of each piece of at most ``chunk`` bytes of the ranges
    ``(start, length)``; an empty range has none."""
    firsts: list[int] = []
    lasts: list[int] = []
    for start, length in zip(starts.tolist(), lengths.tolist()):
        for a in range(start, start + length, chunk):
            firsts.append(a)
            lasts.append(min(a + chunk, start + length) - 1)
    return firsts, lasts


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
