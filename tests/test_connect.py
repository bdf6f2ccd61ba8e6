"""A new connection's handshake: what redis-py would ask a server that lacks it is not asked (``_engine.connection._lean_handshake``)."""

from __future__ import annotations

import torch

from tdstore import TensorDictStore
from tdstore._engine.connection import _server_version
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
