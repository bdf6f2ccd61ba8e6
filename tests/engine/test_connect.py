"""A new connection: its handshake (what redis-py would ask a server that lacks it is not asked,
``_engine.connection._lean_handshake``), and one clear tdstore error, never holding the password, for
a URL that names what the server lacks or that tdstore does not take."""

from __future__ import annotations

import pytest
import torch

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._engine.connection import _server_version
from tdstore._engine.urls import redact_url
from tdstore.cli import main
from tdstore.server import EmbeddedServer


def test_a_new_store_asks_the_server_nothing_it_refuses() -> None:
    # a server of its own: the session's server also serves what other tests left running (their
    # error replies would count here), and errorstats cannot tell one client's errors from another's
    with EmbeddedServer() as srv:
        _check_handshake(srv)


def _check_handshake(srv: EmbeddedServer) -> None:
    raw = srv.client()
    raw.execute_command("CONFIG", "RESETSTAT")
    store = TensorDictStore(batch_size=[4], url=srv.url)
    store["x"] = torch.zeros(4, 2)
    conn = store._store.stack_ops.engine.client.connection_pool.get_connection()
    version = _server_version(conn)
    assert version is not None and version[0] >= 6  # known from HELLO
    if version < (7, 2):  # no CLIENT SETINFO, no CLIENT MAINT_NOTIFICATIONS: each was an error reply
        assert "errorstat_ERR" not in raw.info("errorstats")  # (NOSCRIPT: scripts are loaded when first needed)
    assert conn.driver_info is not None  # the connection's settings are back after the handshake
    store.clear_redis()
    store.close()


def test_stores_of_one_process_share_a_client_and_reuse_its_connections() -> None:
    """Stores opened with the same settings share one client: a new store takes a connection another one
    gave back instead of connecting again; other settings (a database, a password) get a client of their
    own, and the client goes with the last store using it."""
    import gc
    import weakref

    with EmbeddedServer() as srv:
        raw = srv.client()

        def connections() -> int:
            return int(raw.info("stats")["total_connections_received"])

        first = TensorDictStore(batch_size=[4], url=srv.url)
        first["x"] = torch.zeros(4, 2)
        client = first._store.stack_ops.engine.client
        second = TensorDictStore(batch_size=[4], url=srv.url)
        assert second._store.stack_ops.engine.client is client
        other_db = TensorDictStore(batch_size=[4], url=srv.url + ("?db=1" if srv.url.startswith("unix") else "/1"))
        assert other_db._store.stack_ops.engine.client is not client
        second["x"] = torch.ones(4, 2)
        first.close()  # its connection goes back to the shared pool: the next store takes it
        before = connections()
        third = TensorDictStore(batch_size=[4], url=srv.url)
        third["x"] = torch.full((4, 2), 3.0)
        assert connections() == before
        assert first["x"].sum() == 0 and second["x"].sum() == 8 and third["x"].sum() == 24  # the closed one reconnects
        second.clear_redis()  # a deleted store gives its connection back too (torchrl's fresh buffer per fill)
        before = connections()
        fourth = TensorDictStore(batch_size=[4], url=srv.url)
        fourth["x"] = torch.full((4, 2), 4.0)
        assert connections() == before and fourth["x"].sum() == 32
        fourth.clear_redis()
        ref = weakref.ref(client)
        for store in (first, second, third):
            store.clear_redis()
        del first, second, third, fourth, store, client
        gc.collect()
        assert ref() is None


PASSWORD = "pw-h3e-s3cret"


def _cli_ls(capsys: pytest.CaptureFixture[str], url: str) -> str:
    """``tdstore ls --url url`` as a person runs it: one line on stderr, exit code 2, no traceback."""
    code = main(["ls", "--url", url])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (code, out, err)
    assert PASSWORD not in err
    return err


def test_a_database_past_the_servers_is_named_with_the_servers_count(capsys) -> None:
    """Before: redis-py's ``DB index is out of range`` (a ResponseError), from the store and the CLI alike."""
    with EmbeddedServer(unix_socket=False, password=PASSWORD) as srv:
        hostport = srv.url.split("://", 1)[1].split("/", 1)[0]
        url = f"redis://:{PASSWORD}@{hostport}/99"
        with pytest.raises(
            ValueError, match=r"database 99 .*out of range: the server at redis://127\.0\.0\.1:\d+/99 has 16 databases"
        ) as got:
            LazyStackedTensorDictStore(count=2, url=url, prefix="p")
        assert PASSWORD not in str(got.value)
        assert "database 99" in _cli_ls(capsys, url) and "has 16 databases" in _cli_ls(capsys, url)
        assert srv.client().keys("*") == []
    with EmbeddedServer() as srv:  # a unix socket: the database comes in ?db=
        with pytest.raises(ValueError, match=r"database 16 .*has 16 databases \(0 to 15"):
            TensorDictStore(batch_size=[2], url=f"{srv.url}?db=16", prefix="p")


def test_a_plain_server_named_as_a_cluster_says_so(capsys) -> None:
    """Before: redis-py's ``RedisClusterException`` (a traceback from ``tdstore ls``)."""
    with EmbeddedServer(unix_socket=False, password=PASSWORD) as srv:
        hostport = srv.url.split("://", 1)[1].split("/", 1)[0]
        url = f"redis+cluster://:{PASSWORD}@{hostport}"
        with pytest.raises(ValueError, match=rf"redis\+cluster://{hostport} is not a Redis Cluster.*redis://{hostport}/0") as got:
            LazyStackedTensorDictStore(count=2, url=url, prefix="p")
        assert PASSWORD not in str(got.value)
        assert f"is not a Redis Cluster (cluster mode is not enabled on it): reach it with redis://{hostport}/0" in _cli_ls(capsys, url)


def test_a_url_without_a_scheme_lists_the_schemes_tdstore_takes(capsys) -> None:
    """Before: redis-py's list of its own schemes (redis://, rediss://, unix://), without redis+cluster://."""
    schemes = "redis://, rediss://, unix://, redis+cluster://, rediss+cluster://"
    for url in ("localhost:6379/0", f"user:{PASSWORD}@localhost:6379/0", "http://localhost:6379"):
        with pytest.raises(ValueError, match="does not start with a scheme tdstore accepts") as got:
            TensorDictStore(batch_size=[2], url=url)
        assert schemes in str(got.value) and PASSWORD not in str(got.value)
        assert schemes in _cli_ls(capsys, url)


def test_redact_url_drops_every_password() -> None:
    assert redact_url(f"redis://user:{PASSWORD}@host:7000/0") == "redis://user:***@host:7000/0"
    assert redact_url(f"unix:///tmp/x.sock?db=2&password={PASSWORD}") == "unix:///tmp/x.sock?db=2"
    assert redact_url(f":{PASSWORD}@host:1/0") == "***@host:1/0"
    assert redact_url("unix:///tmp/x.sock") == "unix:///tmp/x.sock"
