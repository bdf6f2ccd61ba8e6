"""Lost keys are detected, never recreated as zeros; memory is allocated as it is used.

A key of a store can vanish while the header stays (evicted under an evicting
``maxmemory-policy``, deleted by hand). Every read and every write must then raise
``StoreDamagedError`` (a ``KeyError``) naming the store and the key, and write nothing;
a key never allocated (a ring or ``from_schema`` store allocates a segment when it is
first written) reads as zeros. Eviction is made deterministic here with ``DEL`` of chosen
keys; ``python -m tools.faults --case eviction`` runs a real ``maxmemory`` + ``allkeys-lru`` server.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from helpers import assert_same, top_level_commands
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, StoreDamagedError, TensorDictStore
from tdstore.server import EmbeddedServer


def _element(i: int) -> TensorDict:
    return TensorDict(
        {
            "obs": torch.full((3,), float(i)),  # small: joins the row block with "step"
            "step": torch.tensor(i),
            "big": torch.full((2048,), float(i)),  # 8 KiB: a blob of its own
            "tokens": torch.arange(i % 4 + 1, dtype=torch.int32),  # heterogeneous: data, offsets, shapes
            "note": NonTensorData(f"n{i}"),  # non-tensor: JSON documents in a heterogeneous leaf
        },
        batch_size=[],
    )


def _stack(n: int = 10) -> LazyStackedTensorDict:
    return lazy_stack([_element(i) for i in range(n)])


def _raw(backend) -> dict:
    """Every key of the test's prefix with its content: strings as bytes, hashes as dicts."""
    client = backend.client()
    out = {}
    for key in backend.keys():
        kind = client.type(key)
        kind = kind.decode() if isinstance(kind, bytes) else kind
        out[key] = client.hgetall(key) if kind == "hash" else client.smembers(key) if kind == "set" else client.get(key)
    return out


def _key_of(store: LazyStackedTensorDictStore, kind: str) -> str:
    """The server key of one kind of leaf data in segment 0."""
    keys, h = store._engine.keys, store._engine.header
    if kind == "row block":
        assert h.row is not None
        return keys.data(h.row[0])
    leaf = {"blob": ("big",), "het data": ("tokens",), "het offsets": ("tokens",), "het shapes": ("tokens",), "json": ("note",)}[kind]
    number = h.leaves[leaf].number
    return {"het offsets": keys.offsets, "het shapes": keys.shapes}.get(kind, keys.data)(number)


KINDS = ["row block", "blob", "het data", "het offsets", "het shapes", "json"]


@pytest.mark.parametrize("kind", KINDS)
def test_lost_key_raises_and_writes_nothing(backend, kind):
    """The issue's reproduction: upload, DEL a data key, write st[7], read st[0:8]."""
    st = LazyStackedTensorDictStore.from_lazy_stack(_stack(), **backend.kwargs())
    backend.client().delete(_key_of(st, kind))
    before = _raw(backend)
    with pytest.raises(StoreDamagedError) as info:
        st[7] = _element(70)
    msg = str(info.value)
    assert st.td_id in msg and _key_of(st, kind) in msg and "tdstore check" in msg and "noeviction" in msg
    assert "script" not in msg and "user_script" not in msg  # no script hash or line
    assert _raw(backend) == before  # nothing written, nothing recreated
    for read in (
        lambda: st[0:8].to_tensordict(),
        lambda: st.to_tensordict(),
        lambda: st[7].to_tensordict(),
        lambda: st[torch.tensor([7, 2, 7])].to_tensordict(),
    ):
        with pytest.raises(StoreDamagedError):
            read()
    assert isinstance(info.value, KeyError)
    assert _raw(backend) == before
    # a read of keys that were not lost still works
    if kind != "row block":
        assert torch.equal(st["obs"], torch.stack([torch.full((3,), float(i)) for i in range(10)]))


def test_lost_key_of_a_dense_store(backend):
    td = TensorDict(obs=torch.arange(24.0).reshape(8, 3), act=torch.arange(8), batch_size=[8])
    st = TensorDictStore.from_tensordict(td, **backend.kwargs())
    client = backend.client()
    for key in backend.keys():
        if b":d:" in key:
            client.delete(key)
    before = _raw(backend)
    with pytest.raises(StoreDamagedError):
        st[3] = TensorDict(obs=torch.ones(3), act=torch.tensor(1), batch_size=[])
    with pytest.raises(StoreDamagedError):
        st[torch.tensor([1, 5])]  # a random batch: a read transaction, then read.lua says which key
    with pytest.raises(StoreDamagedError):
        st["obs"]
    assert _raw(backend) == before


@pytest.mark.ring
def test_lost_key_of_a_ring(backend):
    st = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    st.extend(_stack(6))
    client = backend.client()
    client.delete(_key_of(st, "het offsets"))
    before = _raw(backend)
    with pytest.raises(StoreDamagedError):
        st.extend(_stack(3))
    with pytest.raises(StoreDamagedError):
        st.sample(4)
    assert _raw(backend) == before


def test_segments_never_written_read_as_zeros_and_allocate_when_written(backend):
    schema = {"obs": ([4], torch.float32), ("n", "r"): ([], torch.int64)}
    st = TensorDictStore.from_schema(schema, batch_size=[12], segment_bytes=16, **backend.kwargs())
    h = st._store._engine.header
    assert h.segments.n == 12  # one element per segment
    assert not any(b":d:" in k for k in backend.keys())  # nothing allocated
    assert not st["obs"].any() and st["n", "r"].shape == (12,)
    st[5] = TensorDict({"obs": torch.ones(4), "n": {"r": torch.tensor(7)}}, batch_size=[])
    data = [k for k in backend.keys() if b":d:" in k]
    assert len(data) == 2 and all(b"%s5" in k for k in data)  # segment 5 of each key only
    want = torch.zeros(12, 4)
    want[5] = 1
    assert torch.equal(st["obs"], want) and st["n", "r"].tolist() == [0] * 5 + [7] + [0] * 6
    st[torch.tensor([2, 9])] = TensorDict({"obs": torch.full((2, 4), 2.0), "n": {"r": torch.tensor([2, 9])}}, batch_size=[2])
    assert sorted({int(k.split(b"%s")[1].split(b":")[0].rstrip(b"}")) for k in backend.keys() if b":d:" in k}) == [2, 5, 9]
    assert st["n", "r"].tolist() == [0, 0, 2, 0, 0, 7, 0, 0, 0, 9, 0, 0]


def test_a_lost_segment_is_not_taken_for_one_never_written(backend):
    st = TensorDictStore.from_schema({"obs": ([4], torch.float32)}, batch_size=[6], segment_bytes=16, **backend.kwargs())
    st[4] = TensorDict(obs=torch.ones(4), batch_size=[])
    [data] = [k for k in backend.keys() if b":d:" in k]
    backend.client().delete(data)  # the inventory lists it: lost, not "never written"
    with pytest.raises(StoreDamagedError):
        st["obs"]
    with pytest.raises(StoreDamagedError):
        st[4] = TensorDict(obs=torch.ones(4), batch_size=[])
    assert not any(b":d:" in k for k in backend.keys())


def test_a_lost_inventory_vouches_for_nothing(backend):
    st = TensorDictStore.from_schema({"obs": ([4], torch.float32)}, batch_size=[6], segment_bytes=16, **backend.kwargs())
    st[4] = TensorDict(obs=torch.ones(4), batch_size=[])
    client = backend.client()
    client.delete(st._store._engine.keys.inventory)
    assert torch.equal(st[4]["obs"], torch.ones(4))  # a key that is there still reads
    with pytest.raises(StoreDamagedError):  # segment 0 is absent: never written, or lost with the inventory?
        st[0]["obs"]
    with pytest.raises(StoreDamagedError):
        st[0] = TensorDict(obs=torch.ones(4), batch_size=[])


@pytest.mark.ring
def test_a_huge_ring_allocates_what_it_writes(real):
    client = real.client()
    st = LazyStackedTensorDictStore(count=20_000_000, **real.kwargs())
    before = client.info("memory")["used_memory"]
    st.extend(lazy_stack([TensorDict(obs=torch.ones(4), act=torch.ones(2)) for _ in range(3)]))
    h = st._engine.header
    assert h.segments.n > 100
    grown = client.info("memory")["used_memory"] - before
    assert grown < 2 * h.seg * 24 + (1 << 20), grown  # one segment of the row block, not 480 MB
    assert st[19_999_999]["obs"].tolist() == [0.0] * 4 and st[2]["obs"].tolist() == [1.0] * 4
    assert st.sample(4).td["obs"].sum().item() == 16


def test_declared_size_past_maxmemory_is_refused_up_front():
    with EmbeddedServer(extra_args=["--maxmemory", "50mb"]) as srv:
        st = LazyStackedTensorDictStore(count=10**12, url=srv.url, prefix="p")
        with pytest.raises(MemoryError, match=r"16000000000000 bytes.*maxmemory \(52428800 bytes\)"):
            st.extend(lazy_stack([TensorDict(obs=torch.ones(4)) for _ in range(2)]))
        with pytest.raises(MemoryError, match=r"320000000 bytes.*52428800"):
            TensorDictStore.from_schema({"x": ([4], torch.float32)}, batch_size=[20_000_000], url=srv.url, prefix="p")
        big = lazy_stack([TensorDict(x=torch.zeros(1 << 20)) for _ in range(16)])  # 64 MiB
        with pytest.raises(MemoryError, match=r"67108864 bytes.*52428800"):
            LazyStackedTensorDictStore.from_lazy_stack(big, url=srv.url, prefix="p")
        used = srv.client().info("memory")["used_memory"]
        assert used < 8 << 20 and not srv.client().keys("p:*:d:*")
        assert len(st) == 10**12 and st._engine.header.leaves == {}  # the store is intact and usable


def test_a_ring_of_too_many_segments_is_refused(real):
    st = LazyStackedTensorDictStore(count=10**12, **real.kwargs())
    with pytest.raises(ValueError, match="segments"):
        st.extend(lazy_stack([TensorDict(obs=torch.ones(4)) for _ in range(2)]))
    assert not [k for k in real.keys() if b":d:" in k]


def test_a_write_past_maxmemory_is_refused_before_writing():
    """Redis checks maxmemory only when a script starts: the script itself refuses what would overshoot."""
    with EmbeddedServer(extra_args=["--maxmemory", "24mb"]) as srv:
        client = srv.client()
        client.setrange("someone-else", (12 << 20) - 1, b"\0")  # the server holds 12 MiB of other data
        # 16 MiB declared: fits maxmemory, but not beside the other data
        st = TensorDictStore.from_schema({"x": ([1 << 20], torch.uint8)}, batch_size=[16], segment_bytes=1 << 20, url=srv.url, prefix="p")
        written = 0
        with pytest.raises(MemoryError, match="maxmemory"):
            for i in range(16):  # each write allocates one 1 MiB segment
                st[i] = TensorDict(x=torch.full((1 << 20,), i % 251, dtype=torch.uint8), batch_size=[])
                written += 1
        info = client.info("memory")
        assert info["used_memory"] <= info["maxmemory"]
        assert 2 < written < 12
        # what was written is intact; once the other data is gone, the store takes the refused write
        assert [int(st[i]["x"][0]) for i in range(written)] == [i % 251 for i in range(written)]
        client.delete("someone-else")
        st[written] = TensorDict(x=torch.full((1 << 20,), 200, dtype=torch.uint8), batch_size=[])
        assert int(st[written]["x"][-1]) == 200 and int(st[written + 1]["x"].sum()) == 0


def test_an_evicting_policy_warns_once():
    with EmbeddedServer(extra_args=["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]) as srv:
        with pytest.warns(RuntimeWarning, match="allkeys-lru.*noeviction"):
            a = LazyStackedTensorDictStore(count=4, url=srv.url, prefix="p")
            a.extend(_stack(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, url=srv.url, prefix="p")
            b.extend(_stack(2))


def test_lazily_allocating_write_is_one_round_trip(real):
    st = TensorDictStore.from_schema({"obs": ([4], torch.float32)}, batch_size=[6], segment_bytes=16, **real.kwargs())
    st[0] = TensorDict(obs=torch.ones(4), batch_size=[])  # the handle's first write reads the server's limits
    assert top_level_commands(real.client, lambda: st.__setitem__(3, TensorDict(obs=torch.ones(4), batch_size=[]))) == ["evalsha"]


@pytest.mark.parametrize(
    "value, match",
    [(torch.zeros(4, 2).to_sparse(), "sparse"), (torch.zeros(4, 2, device="meta"), "meta")],
    ids=["sparse", "meta"],
)
def test_tensors_without_dense_storage_are_refused(backend, value, match):
    st = LazyStackedTensorDictStore.from_lazy_stack(_stack(4), **backend.kwargs())
    before = _raw(backend)
    with pytest.raises(TypeError, match=f"key 'x'.*{match}"):
        st.set("x", value)
    assert _raw(backend) == before


@pytest.mark.parametrize("device", ["meta", "cuda:7"])
def test_devices_that_cannot_hold_reads_are_refused(real, device):
    with pytest.raises(ValueError, match="device"):
        LazyStackedTensorDictStore(count=2, device=device, **real.kwargs())
    st = LazyStackedTensorDictStore.from_lazy_stack(_stack(2), **real.kwargs())
    with pytest.raises(ValueError, match="device"):
        st.device = device
    assert_same(st.to_tensordict(), _stack(2))


def test_a_write_to_a_replica_names_the_replica(redis_server):
    with EmbeddedServer(unix_socket=False) as primary, EmbeddedServer(unix_socket=False) as replica:
        st = LazyStackedTensorDictStore.from_lazy_stack(_stack(3), url=primary.url, prefix="p")
        rc, pc = replica.client(), primary.client()
        rc.replicaof("127.0.0.1", primary.port)
        deadline = time.monotonic() + 120  # bounds a failure only: the first sync takes milliseconds

        def synced() -> bool:
            return bool(rc.exists(st._engine.keys.meta)) and rc.info("replication").get("master_link_status") == "up"

        while not synced():
            assert time.monotonic() < deadline, f"the replica did not sync with its primary in 120 s: {rc.info('replication')}"
            pc.wait(1, 50)
        other = LazyStackedTensorDictStore.from_store(td_id=st.td_id, url=replica.url, prefix="p")
        assert_same(other.to_tensordict(), _stack(3))  # reads work on a replica
        with pytest.raises(PermissionError, match=rf"replica.*{replica.port}|{replica.port}.*replica"):
            other[0] = _element(9)
        assert_same(st.to_tensordict(), _stack(3))


def test_tdstore_check_and_info_report_a_damaged_store(real, capsys):
    from tdstore.cli import main

    st = LazyStackedTensorDictStore.from_lazy_stack(_stack(6), **real.kwargs())
    sparse = TensorDictStore.from_schema({"x": ([4], torch.float32)}, batch_size=[8], segment_bytes=16, **real.kwargs())
    sparse[3] = TensorDict(x=torch.ones(4), batch_size=[])
    args = ["--url", real.server.url, "--prefix", real.prefix]
    assert main(["check", st.td_id, *args]) == 0
    assert "intact" in capsys.readouterr().out
    assert main(["check", sparse.td_id, *args]) == 0
    assert "intact (8 keys checked; 7 of them absent, in segments never written)" in capsys.readouterr().out
    lost = [_key_of(st, "het offsets"), _key_of(st, "blob")]
    real.client().delete(*lost)
    assert main(["check", st.td_id, *args]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: 2 keys" in out and all(k in out for k in lost)
    assert main(["info", st.td_id, *args]) == 0
    assert "integrity: DAMAGED: 2 keys lost or cut short" in capsys.readouterr().out
    assert main(["check", st.td_id, *args, "--json"]) == 1
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["intact"] is False and len(doc["problems"]) == 2


@pytest.mark.ring
def test_a_key_turning_heterogeneous_keeps_segments_never_written_readable(backend):
    # obs is too large for the row block: seq keeps a blob of its own
    st = LazyStackedTensorDictStore(count=8, segment_bytes=9000, **backend.kwargs())
    st.extend(lazy_stack([TensorDict(obs=torch.ones(1100), seq=torch.arange(2)) for _ in range(2)]))
    h = st._engine.header
    assert h.segments.n == 4 and h.row is None and not h.leaves[("seq",)].het
    st[1] = TensorDict(obs=torch.ones(1100), seq=torch.arange(5))  # seq turns heterogeneous in every segment
    assert st._engine.header.leaves[("seq",)].het
    assert [st[i]["seq"].tolist() for i in range(8)] == [[0, 1], [0, 1, 2, 3, 4]] + [[0, 0]] * 6
    st.extend(lazy_stack([TensorDict(obs=torch.ones(1100), seq=torch.arange(k)) for k in (1, 3)]))
    assert st[2]["seq"].tolist() == [0] and st[3]["seq"].tolist() == [0, 1, 2]
