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
