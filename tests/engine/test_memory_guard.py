"""The memory guard (``tds_room`` in ``lua/_lib.lua``): ``MemoryError`` only when the data would not fit.

A server that does not evict lets a running script allocate past its maxmemory, so a write that
allocates (a ring's next segment, a key never allocated) reads ``INFO memory`` and refuses,
before writing, what would take the server past it. ``used_memory`` counts the call's own
arguments while it runs (for a ring extend, every row it carries) and the server frees them when
the call returns: counting them as well as the segment the rows fill refused, near the limit,
writes whose data fits (a 3 x 64 MB cluster refused a 150 MiB ring at 2,100 of 2,400 rows while
every node had 13 MB free). These tests fill a ring close to the limit with writes that fit and
then try one that does not, on one node and on a sharded ring. Real servers only: fakeredis has
no maxmemory.

The limits are chosen from how Redis 7.0 holds a call: while a write of ``A`` bytes of arguments
runs, ``used_memory`` holds the data, the arguments and a query buffer of ``A`` kept for the next
request; after it, the data and that buffer. Rows of 64 KiB in segments of 4 MiB (64 rows), extends
of 128 rows (A = 8 MiB, allocating two segments): the second extend of 256 rows leaves a node at
``16 + 8 + base`` MiB (30 MiB fit), which the old guard took for ``8 + 8 + 8 + 8 + base``.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, ShardedRing, TensorDictStore
from tdstore._ring import direct_extend as _direct
from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import EmbeddedServer

ROW_FLOATS = (64 * 1024 - 8) // 4  # with the int64 tag: rows of 64 KiB
PER = 128  # rows per extend: 8 MiB of arguments, two 4 MiB segments allocated


def rows(first: int, n: int) -> TensorDict:
    tags = torch.arange(first, first + n)
    return TensorDict(tag=tags, obs=tags.float().unsqueeze(-1) + torch.zeros(ROW_FLOATS), batch_size=[n])


def used(client) -> tuple[int, int]:
    info = client.info("memory")
    return int(info["used_memory"]), int(info["maxmemory"])


def fill(store, count: int) -> None:
    """Fill ``store`` with ``count`` rows (tags 0..count-1) in extends of PER rows: none may be refused."""
    for first in range(0, count, PER):
        store.extend(rows(first, PER))


def intact(store, count: int) -> bool:
    got = store[torch.arange(count)]
    return sorted(got["tag"].tolist()) == list(range(count)) and torch.equal(got["obs"][:, -1], got["tag"].float())


def data_keys(client, prefix: str) -> list[bytes]:
    return sorted(k for k in client.keys(f"{prefix}:*") if b":d:" in k)


@pytest.mark.parametrize("kind", ["lazy", "dense"])
def test_a_ring_filled_close_to_maxmemory_by_writes_that_fit_is_not_refused(kind):
    """One node of 30 MiB: 256 rows (16 MiB in four segments) in two extends of 8 MiB. The second
    extend's arguments and the segments it allocates are both 8 MiB: the old guard counted the rows
    twice (in flight and in their segments) and refused it with room to spare (the dense ring's
    first extend already, with 1 MB used)."""
    with EmbeddedServer(extra_args=["--maxmemory", "30mb", "--maxmemory-policy", "noeviction"]) as srv:
        client = srv.client()
        if kind == "lazy":
            s = LazyStackedTensorDictStore(count=256, url=srv.url, prefix="p")
        else:
            s = TensorDictStore(batch_size=[256], url=srv.url, prefix="p")
        fill(s, 256)
        now, limit = used(client)
        assert s.write_count == 256 and intact(s, 256)
        assert now <= limit
        # a write that does not fit: a ring whose first extend allocates a 24 MiB key (one segment)
        # beside the 16 MiB of data: refused before anything is written
        big = LazyStackedTensorDictStore(count=384, segment_bytes=64 << 20, url=srv.url, prefix="q")
        with pytest.raises(MemoryError, match="would allocate 25165824 bytes.*maxmemory"):
            big.extend(rows(0, 2))
        assert data_keys(client, "q") == [] and big.write_count == 0
        assert s.write_count == 256 and intact(s, 256)  # the first ring is as it was
        assert used(client)[0] <= limit


def test_a_direct_first_extend_that_fits_is_not_refused():
    """A ring of one 20 MiB segment on a node of 32 MiB: its first extend (128 rows, 8 MiB, as plain
    SETRANGEs queued behind direct.lua's 'open') allocates the whole key. The old guard counted the
    queued rows as well as the key they go into and refused it."""
    with EmbeddedServer(extra_args=["--maxmemory", "32mb", "--maxmemory-policy", "noeviction"]) as srv:
        client = srv.client()
        s = LazyStackedTensorDictStore(count=320, segment_bytes=64 << 20, url=srv.url, prefix="p")
        before = _direct.outcomes["direct"]
        s.extend(rows(0, PER))
        assert _direct.outcomes["direct"] == before + 1  # through direct.lua
        assert s.write_count == PER and intact(s, PER)
        now, limit = used(client)
        assert now <= limit


def test_the_guard_refuses_what_would_not_fit_before_writing():
    """A ring's next extend allocates a new segment the server has no room for: MemoryError from the
    guard (not the server's own check, which the call's few arguments pass), nothing written."""
    with EmbeddedServer(extra_args=["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]) as srv:
        client = srv.client()
        s = LazyStackedTensorDictStore(count=256, url=srv.url, prefix="p")
        s.extend(rows(0, 64))  # one segment of 4 MiB, full
        keys = data_keys(client, "p")
        client.config_set("maxmemory", used(client)[0] + (1 << 20))  # 1 MiB of room: not a 4 MiB segment
        with pytest.raises(MemoryError, match="would allocate 4194304 bytes"):
            s.extend(rows(64, 2))  # 128 KiB of rows, into the next segment
        assert s.write_count == 64 and data_keys(client, "p") == keys and intact(s, 64)
        client.config_set("maxmemory", 64 << 20)
        s.extend(rows(64, 2))  # once there is room, the same write goes in
        assert s.write_count == 66 and intact(s, 66)


def test_a_sharded_ring_filled_close_to_maxmemory_is_not_refused():
    """Three primaries of 30 MiB, a sharded ring of 3 x 256 rows of 64 KiB (16 MiB per node) filled
    in extends of 128 rows (each whole on one shard): every one fits, the old guard refused the
    second extend of a shard. Then a second ring whose first extend needs a 16 MiB key on a node
    that holds 16 MiB already: refused before anything is written, the first ring intact."""
    args = ("--maxmemory", "30mb", "--maxmemory-policy", "noeviction")
    with EmbeddedCluster(extra_args=args) as cluster:
        nodes = [cluster.node_client(i) for i in range(3)]
        s = ShardedRing(count=768, url=cluster.url, prefix="p")
        assert isinstance(s, ShardedRing) and s.shard_counts == (256, 256, 256)
        fill(s, 768)
        assert len(s.written) == 768 and s.write_count == 768 and intact(s, 768)
        assert all(now <= limit for now, limit in map(used, nodes))
        big = ShardedRing(count=768, segment_bytes=64 << 20, url=cluster.url, prefix="q")
        with pytest.raises(MemoryError, match="would allocate 16777216 bytes"):
            big.extend(rows(0, 2))
        assert big.write_count == 0 and all(data_keys(n, "q") == [] for n in nodes)
        assert s.write_count == 768 and intact(s, 768)
        for n in nodes:
            n.close()


def test_loading_a_script_after_a_large_call_keeps_no_large_buffer():
    """A first extend of 8 MiB meets NOSCRIPT, the script is loaded and the call sent again. Loaded on
    the call's connection, Redis 7.0 kept write.lua's 78 KB text in the 8 MiB query buffer that
    connection held (10 MiB of used_memory for as long as the script stays cached); on a connection
    of its own, the text costs its own size."""
    with EmbeddedServer() as srv:
        client = srv.client()
        before = scripts_memory(client)
        s = LazyStackedTensorDictStore(count=256, url=srv.url, prefix="p")
        s.extend(rows(0, PER))
        s.extend(rows(PER, PER))
        assert s.write_count == 2 * PER and intact(s, 2 * PER)
        assert scripts_memory(client) - before < 1 << 20


def scripts_memory(client) -> int:
    """The bytes the server's script cache holds: ``used_memory_scripts_eval`` on Redis 7,
    ``used_memory_scripts`` on 6.2 (which has no EVAL/FUNCTION split)."""
    info = client.info("memory")
    return int(info.get("used_memory_scripts_eval", info.get("used_memory_scripts", 0)))
