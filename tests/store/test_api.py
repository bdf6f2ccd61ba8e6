"""Constructor, attach, from_store, upload, dtypes, lifecycle, pickling and the seed's API quirks."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import warnings

import pytest
import torch
from helpers import assert_same, load_tool, make_stack
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._format.codec import DTYPES


def test_constructor_keywords_and_attach(backend):
    kw = backend.kwargs()
    store = LazyStackedTensorDictStore(backend="valkey", count=4, stack_dim=1, inner_batch_size=[2], td_id="my-buffer", **kw)
    assert store.batch_size == torch.Size([2, 4])
    assert store.td_id == store._td_id == "my-buffer"
    assert store._count == 4 and store._stack_dim == 1 and store._inner_batch_size == torch.Size([2]) and store._backend == "valkey"
    store.set("x", torch.arange(8.0).reshape(2, 4))
    # same layout: attaches, never overwrites
    again = LazyStackedTensorDictStore(count=4, stack_dim=1, inner_batch_size=[2], td_id="my-buffer", device="cpu", **backend.kwargs())
    assert torch.equal(again["x"], torch.arange(8.0).reshape(2, 4))
    # other layout: a clear error and the stored header is untouched
    with pytest.raises(ValueError, match="count 5 != stored 4"):
        LazyStackedTensorDictStore(count=5, stack_dim=1, inner_batch_size=[2], td_id="my-buffer", **backend.kwargs())
    with pytest.raises(ValueError, match="inner_batch_size"):
        LazyStackedTensorDictStore(count=4, stack_dim=1, inner_batch_size=[3], td_id="my-buffer", **backend.kwargs())
    reopened = LazyStackedTensorDictStore.from_store(td_id="my-buffer", **backend.kwargs())
    assert reopened.batch_size == torch.Size([2, 4]) and reopened.device is None
    store.clear_redis()


def test_url_forms(real, redis_server):
    store = LazyStackedTensorDictStore(url=redis_server.url, count=2, prefix=real.prefix)
    store.set("x", torch.zeros(2))
    other = LazyStackedTensorDictStore.from_store(unix_socket_path=redis_server.unix_socket_path, td_id=store.td_id, prefix=real.prefix)
    assert torch.equal(other["x"], torch.zeros(2))
    store.clear_redis()


def test_from_store_unknown_id_names_id_server_prefix(backend):
    with pytest.raises(KeyError) as err:
        LazyStackedTensorDictStore.from_store(td_id="no-such-store", **backend.kwargs())
    msg = str(err.value)
    assert "no-such-store" in msg and backend.prefix in msg


def test_from_tensordict_dispatch(backend):
    local = make_stack(3)
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    assert isinstance(store, LazyStackedTensorDictStore)
    again = TensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert_same(again.to_tensordict(), local)
    with pytest.raises(NotImplementedError, match="from_lazy_stack"):
        LazyStackedTensorDictStore.from_dict({"x": torch.zeros(3)})
    store.clear_redis()


def test_upload_checks_before_writing(backend):
    partial = lazy_stack([TensorDict(x=torch.zeros(2), y=torch.zeros(1)), TensorDict(x=torch.zeros(2))])
    assert "y" not in partial.keys()  # a lazy stack hides keys present in only some elements
    with pytest.raises(ValueError, match="only some elements"):
        LazyStackedTensorDictStore.from_lazy_stack(partial, **backend.kwargs())
    mixed = lazy_stack([TensorDict(x=torch.zeros(2)), TensorDict(x=torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(TypeError, match="dtype"):
        LazyStackedTensorDictStore.from_lazy_stack(mixed, **backend.kwargs())
    assert backend.keys() == []


def test_failed_upload_leaves_no_keys(backend, monkeypatch):
    import tdstore._front.upload as up

    calls = {"n": 0}
    real_chunks = up._chunks

    def failing(*args, **kwargs):
        for chunk in real_chunks(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated failure mid-upload")
            yield chunk

    monkeypatch.setattr(up, "_chunks", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        LazyStackedTensorDictStore.from_lazy_stack(make_stack(10), chunk_elements=2, **backend.kwargs())
    assert backend.keys() == []


def test_upload_in_chunks_with_progress_bar(backend, capsys):
    local = make_stack(25)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, chunk_elements=4, chunk_bytes=300, pbar=True, **backend.kwargs())
    assert_same(store.to_tensordict(), local)
    assert "upload" in capsys.readouterr().err
    store.clear_redis()


def test_reader_never_sees_a_half_uploaded_store(real):
    import tdstore._front.upload as up

    seen = []
    real_chunks = up._chunks

    def spying(*args, **kwargs):
        for chunk in real_chunks(*args, **kwargs):
            yield chunk
            try:
                LazyStackedTensorDictStore.from_store(td_id="half", **real.kwargs())
                seen.append("visible")
            except KeyError:
                seen.append("hidden")

    up._chunks = spying
    try:
        store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(6), chunk_elements=2, td_id="half", **real.kwargs())
    finally:
        up._chunks = real_chunks
    # three chunks of two elements (more when small segments cut them), none visible
    assert len(seen) >= 3 and set(seen) == {"hidden"}
    assert LazyStackedTensorDictStore.from_store(td_id="half", **real.kwargs()).batch_size == torch.Size([6])
    store.clear_redis()


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips_bit_exact(backend, name):
    dtype = DTYPES[name]
    high = 2 if dtype == torch.bool else 256  # a bool byte other than 0 or 1 is not a bool
    raw = torch.randint(0, high, (3, 5 * torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8)
    values = raw.view(dtype)  # arbitrary bit patterns, NaNs included
    local = lazy_stack([TensorDict(v=values[i].clone(), w=values[i, : 1 + i].clone()) for i in range(3)])
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    for i in range(3):
        el = store[i].to_tensordict()
        assert el["v"].dtype == dtype and torch.equal(el["v"].view(torch.uint8), values[i].view(torch.uint8))
        assert torch.equal(el["w"].view(torch.uint8), values[i, : 1 + i].view(torch.uint8))
    store[1] = TensorDict(v=values[2].clone(), w=values[0, :3].clone())
    assert torch.equal(store[1]["w"].view(torch.uint8), values[0, :3].view(torch.uint8))
    store.clear_redis()


def test_reads_land_on_device(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), device="cpu", **backend.kwargs())
    assert store.device == torch.device("cpu")
    assert store[0]["obs"].device == torch.device("cpu")
    assert store[0:2].device == torch.device("cpu")
    assert LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs()).device == torch.device("cpu")
    store.clear_redis()


def test_clear_redis_touches_only_this_store(backend):
    prefix = backend.prefix + ":*?[x]{}"
    a = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), **backend.kwargs(prefix=prefix, td_id="a*"))
    b = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), **backend.kwargs(prefix=prefix, td_id="a"))
    c = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), **backend.kwargs(prefix=prefix + "x", td_id="a*"))
    before = len(backend.client().keys("*"))
    n = a.clear_redis()
    assert n > 0 and len(backend.client().keys("*")) == before - n
    assert_same(b.to_tensordict(), make_stack(3))
    assert_same(c.to_tensordict(), make_stack(3))
    with pytest.raises(KeyError, match="a\\*"):
        a.to_tensordict()
    b.clear_redis()
    c.clear_redis()


def test_context_manager_and_close(backend):
    with LazyStackedTensorDictStore.from_lazy_stack(make_stack(2), **backend.kwargs()) as store:
        td_id = store.td_id
    # data outlives the handle
    again = LazyStackedTensorDictStore.from_store(td_id=td_id, **backend.kwargs())
    assert_same(again.to_tensordict(), make_stack(2))
    with again.unlock_():  # tensordict's own context-manager use keeps working
        pass
    assert again.to_tensordict().batch_size == torch.Size([2])
    again.clear_redis()


def test_repr_never_shows_password(real, redis_server):
    client = real.client()
    client.execute_command("ACL", "SETUSER", "reprtest", "on", ">s3cret-pw", "~*", "+@all")
    url = f"unix://reprtest:s3cret-pw@{redis_server.unix_socket_path}"
    store = LazyStackedTensorDictStore(url=url, count=2, prefix=real.prefix)
    store.set("x", torch.zeros(2))
    text = repr(store) + str(store) + repr(store[0]) + repr(pickle.dumps(store))
    assert "s3cret" not in text
    for field in ("keys", "batch_size", "count", "stack_dim", "device", "backend", "td_id"):
        assert field in repr(store)
    store.clear_redis()


def test_flatten_unflatten_to_local_from_dict(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), **backend.kwargs())
    flat = store.flatten_keys()
    assert "nested.b" in flat.keys()
    assert "nested.b" not in store.keys()
    with pytest.raises(ValueError):
        store.flatten_keys(inplace=True)
    with pytest.raises(ValueError):
        store.unflatten_keys(inplace=True)
    assert ("nested", "b") in flat.unflatten_keys().keys(True)
    with pytest.warns(DeprecationWarning):
        local = store.to_local()
    assert_same(local, store.to_tensordict())
    store.clear_redis()


def test_locking_follows_the_seed(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), **backend.kwargs())
    store.lock_()
    assert store.is_locked and not store[1].is_locked
    store[1]["obs"] = torch.zeros(4)  # existing key: allowed
    assert torch.equal(store[1]["obs"], torch.zeros(4))
    with pytest.raises(RuntimeError, match="locked"):
        store[1]["new"] = torch.zeros(4)
    with pytest.raises(RuntimeError, match="locked"):
        store.set("new", torch.zeros(3))
    with pytest.raises(RuntimeError, match="locked"):
        del store["obs"]
    store.unlock_()
    store.set("new", torch.zeros(3))
    assert "new" in store.keys()
    store.clear_redis()


def test_keys_with_any_characters_do_not_collide(backend):
    names = ["x", "x:idx", "x.y", "a b", "d:0", "m", "{tag}", "*"]
    td = TensorDict({n: torch.full((2,), float(k)) for k, n in enumerate(names)}, batch_size=[2])
    td.set(("x", "idx") if False else ("nest", "x:idx"), torch.ones(2, 3))
    local = lazy_stack(list(td.unbind(0)))
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    for k, n in enumerate(names):
        assert torch.equal(store[n], torch.full((2,), float(k))), n
    store[1]["x:idx"] = torch.tensor(99.0)
    assert store["x"].tolist() == [0.0, 0.0] and store["x:idx"].tolist() == [1.0, 99.0]
    assert "x.y" in store.keys() and ("x", "y") not in store.keys(True)
    store.clear_redis()


def _write_in_child(store, i):
    store[i] = TensorDict(
        obs=torch.full((4,), 42.0),
        done=torch.ones(1, dtype=torch.bool),
        nested=TensorDict(b=torch.full((3,), 42)),
        tokens=torch.full((7,), 42),
    )


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_store_crosses_process_boundaries(real, method):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4), **real.kwargs())
    ctx = mp.get_context(method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded pytest
        procs = [ctx.Process(target=_write_in_child, args=(store, i)) for i in (1, 3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)  # bounds a hang only: a spawned child imports torch, slow on a busy machine
        stuck = [p for p in procs if p.is_alive()]
        for p in stuck:
            p.kill()
    assert not stuck, f"{len(stuck)} child(ren) did not finish in 600 s"
    assert [p.exitcode for p in procs] == [0, 0]
    for i in (1, 3):
        assert store[i]["tokens"].tolist() == [42] * 7
    assert store[0]["obs"].tolist() == [0.0, 1.0, 2.0, 3.0]
    store.clear_redis()


def test_stale_cache_never_returns_wrong_data(backend):
    """Another handle changes a key's dtype to one of the same size: this handle refreshes, no garbage."""
    a = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), **backend.kwargs())
    b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **backend.kwargs())
    b.set("obs", torch.arange(12, dtype=torch.int32).reshape(3, 4))
    got = a[1]["obs"]
    assert got.dtype == torch.int32 and got.tolist() == [4, 5, 6, 7]
    # a write planned with the stale dtype is refused, not applied as garbage
    c = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **backend.kwargs())
    b.set("obs", torch.zeros(3, 4, dtype=torch.float32))
    with pytest.raises(TypeError, match="obs"):
        c[0]["obs"] = torch.ones(4, dtype=torch.int32)
    assert c[0]["obs"].tolist() == [0.0] * 4
    a.clear_redis()


def test_store_deleted_by_another_handle_raises_keyerror(backend):
    a = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), **backend.kwargs())
    b = LazyStackedTensorDictStore.from_store(td_id=a.td_id, **backend.kwargs())
    b.clear_redis()
    with pytest.raises(KeyError, match=a.td_id):
        a[0].to_tensordict()
    with pytest.raises(KeyError, match=a.td_id):
        a[0] = make_stack(3)[0]
    assert backend.keys() == []


def test_lazy_results_are_lazy_stacks(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4), **backend.kwargs())
    assert isinstance(store[0:3], LazyStackedTensorDict)
    assert isinstance(store[[0, 2]], LazyStackedTensorDict)
    store.set("tokens", torch.zeros(4, 2, dtype=torch.int64))  # now homogeneous everywhere: dense reads
    assert isinstance(store[0:3], TensorDict)
    store.clear_redis()


def test_handle_on_a_recreated_store_is_refused(backend):
    a = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(obs=torch.full((4,), 1.5))] * 3), td_id="replay", **backend.kwargs()
    )
    b = LazyStackedTensorDictStore.from_store(td_id="replay", **backend.kwargs())
    b.clear_redis()
    b2 = LazyStackedTensorDictStore.from_lazy_stack(
        lazy_stack([TensorDict(obs=torch.arange(4, dtype=torch.int32))] * 3), td_id="replay", **backend.kwargs()
    )
    with pytest.raises(KeyError, match="created again"):
        a[0]["obs"]
    with pytest.raises(KeyError, match="created again"):
        a[1] = TensorDict(obs=torch.zeros(4))
    assert b2[1]["obs"].tolist() == [0, 1, 2, 3]
    again = LazyStackedTensorDictStore.from_store(td_id="replay", **backend.kwargs())
    assert again[0]["obs"].dtype == torch.int32
    b2.clear_redis()


def test_write_that_would_outgrow_the_server_limit_writes_nothing():
    from tdstore.server import EmbeddedServer

    with EmbeddedServer(extra_args=["--proto-max-bulk-len", "1mb"]) as srv:
        local = lazy_stack([TensorDict(a=torch.zeros(2), tok=torch.zeros(60_000 + i, dtype=torch.int32)) for i in range(3)])
        s = LazyStackedTensorDictStore.from_lazy_stack(local, url=srv.url, prefix="limit", segment_bytes=1 << 30)  # one segment
        before = s.to_tensordict()
        client = srv.client()
        raw = {k: client.get(k) for k in client.keys("limit:*") if client.type(k) == b"string"}
        with pytest.raises(ValueError, match="too large"):
            s[0] = TensorDict(a=torch.ones(2), tok=torch.ones(200_000, dtype=torch.int32))
        assert {k: client.get(k) for k in raw} == raw
        assert_same(s.to_tensordict(), before)
        s[0] = TensorDict(a=torch.ones(2), tok=torch.ones(10, dtype=torch.int32))  # still usable
        assert s[0]["tok"].tolist() == [1] * 10


def test_urls_never_carry_secrets(real, redis_server):
    from tdstore._engine.connection import open_client

    client = real.client()
    client.execute_command("ACL", "SETUSER", "pct", "on", ">p@ss/w:rd", "~*", "+@all")
    path = redis_server.unix_socket_path
    for url in (f"unix://pct:p%40ss%2Fw%3Ard@{path}", f"unix://{path}?username=pct&password=p%40ss%2Fw%3Ard"):
        store = LazyStackedTensorDictStore(url=url, count=2, prefix=real.prefix)
        store.set("x", torch.zeros(2))
        blob = pickle.dumps(store) + repr(store).encode() + store._engine.spec.describe().encode()
        assert b"p@ss" not in blob and b"p%40ss" not in blob
        with pytest.raises(KeyError) as err:
            LazyStackedTensorDictStore.from_store(url=url, td_id="missing", prefix=real.prefix)
        assert "p@ss" not in str(err.value) and "p%40ss" not in str(err.value)
        store.clear_redis()
    _, spec, _ = open_client(
        url="redis://u:secret@[::1]:6390/3", host="h", port=1, db=0, unix_socket_path=None, client=None, redis_kwargs={"ssl_password": "k"}
    )
    assert spec.describe() == "redis://[::1]:6390/3" and "secret" not in repr(spec) and "k" not in repr(spec.kwargs)


def test_pickled_store_reconnects_with_password_from_env_or_provider(real, redis_server, monkeypatch):
    client = real.client()
    client.execute_command("ACL", "SETUSER", "envuser", "on", ">envpw", "~*", "+@all")
    store = LazyStackedTensorDictStore(url=f"unix://envuser:envpw@{redis_server.unix_socket_path}", count=2, prefix=real.prefix)
    store.set("x", torch.ones(2))
    blob = pickle.dumps(store)
    assert b"envpw" not in blob
    monkeypatch.setenv("TDSTORE_PASSWORD", "envpw")
    assert pickle.loads(blob)["x"].tolist() == [1.0, 1.0]
    monkeypatch.delenv("TDSTORE_PASSWORD")
    with pytest.raises(Exception, match="(?i)auth|password|WRONGPASS"):
        pickle.loads(blob)["x"]
    store.clear_redis()


def test_review_edge_cases(backend):
    import numpy as np

    local = make_stack(3, het=False, inner=(2,), stack_dim=1)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    # an equivalent negative stack_dim attaches
    again = LazyStackedTensorDictStore(count=3, stack_dim=-1, inner_batch_size=[2], td_id=store.td_id, **backend.kwargs())
    assert again.batch_size == store.batch_size
    flat = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3, het=False), **backend.kwargs())
    # numpy and 0-d tensor ints give the element view
    assert type(flat[np.int64(1)]).__name__ == "ElementView" and type(flat[torch.tensor(2)]).__name__ == "ElementView"
    # a locked store keeps its schema: no dtype change through set
    flat.lock_()
    with pytest.raises(TypeError, match="obs"):
        flat.set("obs", torch.zeros(3, 4, dtype=torch.float64))
    flat.unlock_()
    # conjugate views are written as their values
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    flat.set("z", torch.stack([z, z, z]).conj())
    assert torch.equal(flat[1]["z"], z.conj().resolve_conj())
    store.clear_redis()
    flat.clear_redis()


def read_only_acl(user: str, password: str, prefix: str) -> list[str]:
    """README.md's read-only ACL (tests/engine/test_acl.py checks it) without ``+multi +exec`` (the read transactions)."""
    acl = load_tool("faults.acl").readme_acl(prefix, user, password)
    return [rule for rule in acl if rule not in ("+multi", "+exec")]


def test_readonly_handle_refuses_every_write(backend):
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(3), **backend.kwargs())
    ro = LazyStackedTensorDictStore.from_store(td_id=store.td_id, readonly=True, **backend.kwargs())
    assert ro.readonly and not store.readonly
    before = ro.to_tensordict()
    writes = [
        lambda: ro.__setitem__(0, before[1]),
        lambda: ro[0].__setitem__("obs", torch.zeros(4)),
        lambda: ro[0].update(before[1]),
        lambda: ro.set("new", torch.zeros(3)),
        lambda: ro.__setitem__(slice(0, 2), before[1:3]),
        lambda: ro.__delitem__("obs"),
        lambda: ro.rename_key_("obs", "o"),
        lambda: ro.zero_(),
        lambda: ro.fill_("obs", 1.0),
        lambda: ro.apply_(lambda t: t),
        lambda: ro.clear_redis(),
    ]
    for write in writes:
        with pytest.raises(PermissionError, match="read-only"):
            write()
    assert_same(store.to_tensordict(), before)
    assert pickle.loads(pickle.dumps(ro)).readonly
    with pytest.raises(ValueError, match="td_id"):
        LazyStackedTensorDictStore(count=3, readonly=True, **backend.kwargs())
    attached = LazyStackedTensorDictStore(count=3, td_id=store.td_id, readonly=True, **backend.kwargs())
    assert_same(attached[1].to_tensordict(), before[1])
    store.clear_redis()


def test_read_only_acl_user(real, redis_server):
    admin = real.client()
    admin.execute_command(*read_only_acl("learner", "readpw", real.prefix))
    store = LazyStackedTensorDictStore.from_lazy_stack(make_stack(4), **real.kwargs())
    admin.script_flush()  # the read-only user must be able to load the read script itself
    url = f"unix://learner:readpw@{redis_server.unix_socket_path}"
    ro = LazyStackedTensorDictStore.from_store(url=url, td_id=store.td_id, prefix=real.prefix, readonly=True)
    assert_same(ro.to_tensordict(), make_stack(4))
    assert_same(ro[torch.tensor([3, 1])], make_stack(4)[torch.tensor([3, 1])])
    # without readonly=True, the server's ACL refuses the write script: a clear PermissionError, nothing written
    rw = LazyStackedTensorDictStore.from_store(url=url, td_id=store.td_id, prefix=real.prefix)
    with pytest.raises(PermissionError, match="ACL"):
        rw[0] = make_stack(4)[2]
    assert_same(store.to_tensordict(), make_stack(4))
    store.clear_redis()


def test_read_only_acl_user_without_transactions_reads_dense_keys(real, redis_server):
    """The read-only ACL user above has no MULTI/EXEC (``@transaction``): dense reads, which are
    transactions, come back through read.lua, and the handle stops trying after the first NOPERM.
    One-byte rows at 256 scattered places are the case where the server's replies to the
    unqueued commands are shorter than the +OK/+QUEUED replies the reader waits for."""
    admin = real.client()
    admin.execute_command(*read_only_acl("learner2", "readpw2", real.prefix))
    n = 600_000
    done = torch.rand(n, generator=torch.Generator().manual_seed(0)) < 0.5
    store = TensorDictStore.from_tensordict(TensorDict(done=done, batch_size=[n]), **real.kwargs())
    url = f"unix://learner2:readpw2@{redis_server.unix_socket_path}?socket_timeout=30"
    ro = TensorDictStore.from_store(url=url, td_id=store.td_id, prefix=real.prefix, readonly=True)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:256]
    assert torch.equal(ro[idx]["done"], done[idx])
    assert ro._store._engine.transactions is False  # no transaction is tried again
    assert torch.equal(ro[1000:1300]["done"], done[1000:1300])
    store.clear_redis()


def provide_password() -> str:
    """A picklable password provider (module level), as a user would write one."""
    return "providedpw"


def test_password_provider_reconnects_pickled_stores(real, redis_server, monkeypatch):
    monkeypatch.delenv("TDSTORE_PASSWORD", raising=False)
    real.client().execute_command("ACL", "SETUSER", "provided", "on", ">providedpw", "~*", "+@all")
    store = LazyStackedTensorDictStore(
        unix_socket_path=redis_server.unix_socket_path, username="provided", password_provider=provide_password, count=2, prefix=real.prefix
    )
    store.set("x", torch.full((2,), 3.0))
    blob = pickle.dumps(store)
    assert b"providedpw" not in blob
    assert pickle.loads(blob)["x"].tolist() == [3.0, 3.0]
    store.clear_redis()
