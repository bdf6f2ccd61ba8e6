"""A proxy that cuts or holds a connection at an exact byte of one command (:class:`CuttingProxy`)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit


# ---------------------------------------------------------------------------------------------
# a proxy that cuts or holds a connection at an exact byte of one command
# ---------------------------------------------------------------------------------------------
class RespScanner:
    """Finds the top-level messages of a RESP2 byte stream fed in pieces, without copying payloads.

    On the request side a message is a command (an array of bulk strings; its first
    one is the command name); on the reply side it is one reply, so the reply to
    the k-th command of a connection is its k-th reply.  Knowing where each one
    starts is what lets the proxy cut a connection at a point chosen in advance
    (so many bytes into a given command or into its reply) instead of at a moment.
    """

    def __init__(self) -> None:
        self.offset = 0  # bytes fed so far
        self.starts: list[int] = []  # stream offset of the first byte of each message
        self.names: list[str] = []  # each message's command name, upper case ("" for a reply)
        self.done = 0  # messages complete
        self._line = bytearray()  # a header line cut by the end of a piece
        self._skip = 0  # bytes of a bulk payload (and its CRLF) still to pass
        self._stack: list[int] = []  # elements still expected by each open array
        self._name: bytearray | None = None  # the command name being read
        self._name_next = False  # the next bulk string is a command name

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        """Scan ``data``; return ``(stream offset, message index)`` for each command name learned in it,
        the offset being the byte just after the name (the command cannot run before it)."""
        named: list[tuple[int, int]] = []
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                if self._name is not None:
                    self._name += data[i : i + take]
                i += take
                self._skip -= take
                if not self._skip:
                    if self._name is not None:
                        self.names[-1] = bytes(self._name[:-2]).decode("latin-1").upper()
                        named.append((self.offset + i, len(self.starts) - 1))
                        self._name = None
                    self._element_done()
                continue
            if not self._line and not self._stack:
                self.starts.append(self.offset + i)
                self.names.append("")
            j = data.find(b"\n", i)
            if j < 0:
                self._line += data[i:]
                break
            line = bytes(self._line) + data[i : j + 1]
            self._line.clear()
            i = j + 1
            self._header(line)
        self.offset += n
        return named

    def _header(self, line: bytes) -> None:
        kind, body = line[:1], line[1:].strip()
        if kind in (b"*", b">", b"~", b"%"):
            count = int(body) * (2 if kind == b"%" else 1)
            if count <= 0:
                self._element_done()
            else:
                self._name_next = not self._stack
                self._stack.append(count)
            return
        if kind in (b"$", b"=", b"!"):
            size = int(body)
            if size < 0:
                self._element_done()
            else:
                self._skip = size + 2
                self._name = bytearray() if self._name_next and size <= 64 else None
            self._name_next = False
            return
        self._name_next = False
        self._element_done()  # a simple string, error, integer... (an inline command: one line)

    def _element_done(self) -> None:
        while self._stack:
            self._stack[-1] -= 1
            if self._stack[-1]:
                return
            self._stack.pop()
        self.done += 1


@dataclass
class Cut:
    """Where the proxy stops a connection: ``keep`` bytes into the ``nth`` command named one of
    ``names`` (counted from its first byte, over the rest of the request stream), or ``keep`` bytes
    into the server's reply to that command.  ``hold``: stop forwarding there (the caller then
    kills the client) instead of closing both sockets."""

    direction: str  # "request" or "reply"
    names: tuple[str, ...]
    keep: int = 0
    nth: int = 0
    hold: bool = False
    # filled in by the proxy
    found: int = -1  # matching commands seen so far, minus one
    link: Any = None
    index: int = -1  # message index of the chosen command on its connection
    at: int = -1  # stream offset of the cut on that connection (request or reply stream)
    landed: threading.Event = field(default_factory=threading.Event)
    where: str = ""  # what was cut, for the report


class _Link:
    """One client connection through the proxy and its connection to the server."""

    def __init__(self, number: int, client: Any, upstream: Any) -> None:
        self.number = number
        self.client = client
        self.upstream = upstream
        self.request = RespScanner()
        self.reply = RespScanner()
        self.frozen = {"request": False, "reply": False}
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of the server, for faults that must land mid-call.

    It forwards bytes both ways and follows the commands and replies of every
    connection (:class:`RespScanner`).  :meth:`arm` picks a point in the stream, say
    "half-way through the SETRANGEs" or "before the first byte of the reply to the
    EVALSHA", and the proxy cuts (or holds) the connection exactly there: the fault
    lands inside the call on any machine, fast or slow, because it is placed by
    bytes, not by a timer.  ``on_command(name)`` runs before each command can reach
    the server (the script-flush case flushes the script cache there).
    """

    def __init__(self, target: str, on_command: Callable[[str], None] | None = None) -> None:
        parts = urlsplit(target)
        self._unix = parts.path if parts.scheme == "unix" else None
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        port = self._listener.getsockname()[1]
        auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        query = parse_qs(parts.query)
        db = query.pop("db", ["0"])[0] if parts.scheme == "unix" else (parts.path.strip("/") or "0")
        rest = urlencode({k: v[0] for k, v in query.items()})
        scheme = "rediss" if parts.scheme == "rediss" else "redis"
        self.url = f"{scheme}://{auth}127.0.0.1:{port}/{db}" + (f"?{rest}" if rest else "")
        self.on_command = on_command
        self.accepted = 0
        self.links: list[_Link] = []
        self._cut: Cut | None = None
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept_loop, daemon=True, name="faults-proxy").start()

    def _connect_upstream(self) -> socket.socket:
        if self._unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self._unix)
            return sock
        return socket.create_connection(self._target)

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.accepted += 1
                link = _Link(self.accepted, client, upstream)
                self.links.append(link)
            threading.Thread(target=self._pump, args=(link, "request"), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, "reply"), daemon=True).start()

    def arm(self, cut: Cut) -> Cut:
        """Cut (or hold) at ``cut``, once; the caller makes the call after this returns."""
        with self._lock:
            self._cut = cut
        return cut

    def disarm(self) -> Cut | None:
        """Forget the armed cut (landed or not) and return it."""
        with self._lock:
            cut, self._cut = self._cut, None
        return cut

    def _pump(self, link: _Link, direction: str) -> None:
        src, dst = (link.client, link.upstream) if direction == "request" else (link.upstream, link.client)
        scanner = link.request if direction == "request" else link.reply
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                base = scanner.offset
                named = scanner.feed(data)
                if direction == "request":
                    self._match(link, named)  # before any of these bytes can reach the server
                pos = 0  # bytes of data forwarded so far
                if direction == "request" and self.on_command is not None:
                    for offset, index in named:  # before the command's last byte reaches the server
                        dst.sendall(data[pos : offset - base])
                        pos = offset - base
                        self.on_command(link.request.names[index])
                landing = self._cut_point(link, direction, base, len(data))
                if landing is not None:
                    cut, stop = landing
                    stop = max(stop, pos)  # never before what is already forwarded
                    if not link.frozen[direction]:
                        dst.sendall(data[pos:stop])
                    self._land(link, direction, cut, base + stop)
                    if link.closed:
                        return
                    continue
                if not link.frozen[direction]:
                    dst.sendall(data[pos:])
        except OSError:
            pass
        link.close()

    def _match(self, link: _Link, named: list[tuple[int, int]]) -> None:
        """Count the commands the armed cut names; on the ``nth``, tie the cut to this connection."""
        with self._lock:
            cut = self._cut
            if cut is None or cut.link is not None:
                return
            for _, index in named:
                if link.request.names[index] in cut.names:
                    cut.found += 1
                    if cut.found == cut.nth:
                        cut.link, cut.index = link, index
                        if cut.direction == "request":
                            cut.at = link.request.starts[index] + cut.keep
                        return

    def _cut_point(self, link: _Link, direction: str, base: int, size: int) -> tuple[Cut, int] | None:
        """The armed cut and where in this piece (0..size) it lands on ``link``, or None."""
        with self._lock:
            cut = self._cut
            if cut is None or cut.landed.is_set() or cut.link is not link or cut.direction != direction:
                return None
            if direction == "reply" and cut.at < 0:
                if len(link.reply.starts) <= cut.index:
                    return None  # the reply to the command has not started
                cut.at = link.reply.starts[cut.index] + cut.keep
            if cut.at >= base + size:
                return None
            return cut, cut.at - base

    def _land(self, link: _Link, direction: str, cut: Cut, at: int) -> None:
        """Record where the cut landed (``at``: bytes of the stream forwarded), then hold or close the connection."""
        name = link.request.names[cut.index]
        start = (link.request if direction == "request" else link.reply).starts[cut.index]
        part = "request" if direction == "request" else "reply to"
        cut.at = at
        cut.where = (
            f"{'held' if cut.hold else 'cut'} {at - start:,} B into the {part} {name} #{cut.nth + 1} "
            f"(connection {link.number}, byte {at:,} of what it {'sent' if direction == 'request' else 'received'})"
        )
        if cut.hold:
            link.frozen[direction] = True
        cut.landed.set()  # before the close: the call that sees it fail then sees the cut landed
        if not cut.hold:
            link.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links = list(self.links)
        for link in links:
            link.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
