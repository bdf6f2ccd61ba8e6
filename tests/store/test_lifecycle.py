"""Store lifecycle: the registry of each prefix, readable ids, and whole-store expiry (ttl, expire, persist)."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import make_stack, pttls, same_deadline

from tdstore import LazyStackedTensorDictStore
from tdstore._format.keys import registry_key


def registered(backend) -> set[str]:
    return {m.decode() for m in backend.client().smembers(registry_key(backend.prefix))}


@pytest.mark.ring
def test_registry_tracks_created_and_deleted_stores(backend):
    a = LazyStackedTensorDictStore(count=3, td_id="replay-buffer", **backend.kwargs())
    b = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4), **backend.kwargs())
    assert registered(backend) == {"replay-buffer", b.td_id}
    # a readable id is a real id: another handle finds the store by it
    a.extend(make_stack(2))
    again = LazyStackedTensorDictStore.from_store(td_id="replay-buffer", **backend.kwargs())
    assert again.write_count == 2
    assert b.clear_redis() > 0
    assert registered(backend) == {"replay-buffer"}
    a.clear_redis()
    assert registered(backend) == set() and backend.keys() == []


def test_failed_upload_leaves_no_registry_entry(backend):
    bad = make_stack(4)
    bad[2]["obs"] = torch.zeros(4, dtype=torch.float64)  # a dtype that differs across elements
    with pytest.raises(TypeError):
        LazyStackedTensorDictStore.from_lazy_stack(bad, **backend.kwargs())
    assert registered(backend) == set()


@pytest.mark.ring
def test_ttl_on_creation_covers_keys_added_later(backend):
    store = LazyStackedTensorDictStore(count=4, ttl=600, **backend.kwargs())
    store.extend(make_stack(3))  # creates every leaf: they take the header's deadline
    store.set("extra", torch.zeros(4, 2))
    store[1] = make_stack(9)[8].set("extra", torch.ones(2))  # tokens grows: the key gains offset and shape tables
    ttls = pttls(backend, store)
    assert len(ttls) >= 6
    assert same_deadline(backend, ttls), ttls
    # a long time to live, read within a tenth of it: a busy machine never runs out the window
    assert 540_000 < next(iter(ttls.values())) <= 600_000
    assert 540 < store.ttl() <= 600


def test_expire_and_persist_act_on_every_key_at_once(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(5), **backend.kwargs())
    assert store.ttl() is None
    store.expire(600.5)
    ttls = pttls(backend, store)
    assert same_deadline(backend, ttls) and 540_000 < next(iter(ttls.values())) <= 600_500
    store.persist()
    assert set(pttls(backend, store).values()) == {-1}
    assert store.ttl() is None


def test_upload_with_ttl(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(5), ttl=600, **backend.kwargs())
    ttls = pttls(backend, store)
    assert same_deadline(backend, ttls) and 540_000 < next(iter(ttls.values())) <= 600_000


def test_a_store_expires_as_a_whole(backend):
    # a long time to live while the store is checked, then a short one on purpose: a busy machine
    # never sees the store go before its checks (every key taking the one deadline is test_upload_with_ttl)
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(5), ttl=600, **backend.kwargs())
    assert store[1]["obs"].tolist() == [10.0, 11.0, 12.0, 13.0]

    def store_keys() -> list[bytes]:  # the registry entry stays (stale): `tdstore ls` skips it
        return [k for k in backend.keys() if b"{" in k]

    assert len(store_keys()) >= 4
    store.expire(0.05)
    deadline = time.monotonic() + 60  # a limit on a hang only: the keys go within ~0.1 s
    while store_keys() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store_keys() == []
    with pytest.raises(KeyError, match="expired"):
        store[1].to_tensordict()
    with pytest.raises(KeyError, match=store.td_id):
        LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "10", True])
def test_bad_ttl_values(backend, bad):
    with pytest.raises(ValueError, match="ttl"):
        LazyStackedTensorDictStore(count=2, ttl=bad, **backend.kwargs())
    store = LazyStackedTensorDictStore(count=2, **backend.kwargs())
    with pytest.raises(ValueError):
        store.expire(bad)
    assert store.ttl() is None
    assert registered(backend) == {store.td_id}  # the refused constructor created nothing


def test_readonly_handles_cannot_change_expiry(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), **backend.kwargs())
    ro = LazyStackedTensorDictStore.from_store(td_id=store.td_id, readonly=True, **backend.kwargs())
    with pytest.raises(PermissionError):
        ro.expire(10)
    with pytest.raises(PermissionError):
        ro.persist()
    assert ro.ttl() is None


@pytest.mark.parametrize("het", [True, False], ids=["het", "homog"])
@pytest.mark.parametrize(("stack_dim", "inner"), [(0, ()), (1, (2,))], ids=["dim0", "dim1"])
def test_downloads_and_clones_with_a_progress_bar(backend, capsys, het, stack_dim, inner):
    pytest.importorskip("tqdm")
    from helpers import assert_same

    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(11, het=het, inner=inner, stack_dim=stack_dim), **backend.kwargs())
    whole = store.to_tensordict()
    capsys.readouterr()
    assert_same(store.to_tensordict(pbar=True, chunk_elements=3), whole)
    err = capsys.readouterr().err
    assert "download" in err and "11/11" in err
    assert_same(store.clone(pbar=True), whole)
    assert_same(store.to_tensordict(chunk_elements=4), whole)
    with pytest.raises(ValueError, match="chunk_elements"):
        store.to_tensordict(chunk_elements=0)


def test_chunked_download_is_one_call_per_chunk(real):
    from helpers import top_level_commands

    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(10), **real.kwargs())
    store.to_tensordict()  # warm
    assert top_level_commands(real.client, lambda: store.to_tensordict(chunk_elements=3)) == ["evalsha"] * 4
    assert top_level_commands(real.client, lambda: store.to_tensordict()) == ["evalsha"]


def test_dropped_handles_give_their_connection_back(real):
    """Each handle sends its script calls on a connection it holds; dropping the handle returns it to a shared pool."""
    import gc

    client = real.client()
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), client=client, prefix=real.prefix)
    for _ in range(30):
        handle = LazyStackedTensorDictStore.from_store(td_id=store.td_id, client=client, prefix=real.prefix)
        handle[0].to_tensordict()
        del handle
    gc.collect()
    assert len(client.connection_pool._in_use_connections) == 0
    assert len(client.connection_pool._available_connections) <= 2
