"""torchrl checkpoints loaded into a ``StoreStorage`` (``rb.loads``, ``storage.loads``: ``tdstore.torchrl.dumps_loads``),
each compared with the same checkpoint loaded into torchrl's in-memory ``LazyTensorStorage``, on redis-server and fakeredis.

* a ``TensorDictReplayBuffer``'s rows hold the ``"index"`` its writer stores: the store leaves it out, as its
  writes do, so that the buffer can be extended after the load;
* the cursor of a torchrl buffer is its writer's (``writer/metadata.json``): the ring continues there;
* a ``StoreStorage(ndim=2)`` loads the checkpoint it dumped (the ring's slots hold ``max_size`` cells).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Backend

pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    RoundRobinWriter,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
)

from tdstore.torchrl import StoreStorage, StoreWriter, replay_buffer  # noqa: E402


@pytest.fixture
def be(one_node: Backend) -> Backend:
    """redis-server and fakeredis (a ring runs on one node)."""
    return one_node


def rows(start: int, n: int) -> TensorDict:
    v = torch.arange(start, start + n)
    return TensorDict(a=v, b=v[:, None].float().expand(n, 3).clone(), batch_size=[n])


def keys_of_the_store(rb: Any) -> set[tuple[str, ...]]:
    return set(rb.storage._store.stack_ops.engine.fetch_header().leaves)


def state(rb: Any) -> dict[str, Any]:
    """What a later write and read depend on: the rows (their ``a``), the length, the cursor and the write count."""
    return {"a": rb.storage[:]["a"].tolist(), "len": len(rb), "cursor": int(rb._writer._cursor), "write_count": rb.write_count}


# -- the "index" key torchrl's TensorDictRoundRobinWriter stores in every row ---------------------------
@pytest.mark.parametrize("how", ["rb.loads", "storage.loads"])
def test_a_tensordict_replay_buffer_checkpoint_loads_without_its_index_key_and_extends(be: Backend, tmp_path: Path, how: str) -> None:
    src = TensorDictReplayBuffer(storage=LazyTensorStorage(6), batch_size=4)  # torchrl's default writer: "index" in each row
    src.extend(rows(0, 4))
    assert "index" in src.storage[:].keys()
    src.dumps(tmp_path / "ck")
    mem = TensorDictReplayBuffer(storage=LazyTensorStorage(6), batch_size=4)
    mem.loads(tmp_path / "ck")
    srv = replay_buffer(6, batch_size=4, **be.kwargs())
    if how == "rb.loads":
        srv.loads(tmp_path / "ck")
    else:
        srv.storage.loads(tmp_path / "ck" / "storage")
    assert keys_of_the_store(srv) == {("a",), ("b",)}  # the writer's metadata key is not the buffer's data
    assert state(srv) == state(mem)
    for rb in (mem, srv):
        rb.extend(rows(100, 3))  # wraps: slots 4, 5, 0
        rb.add(rows(200, 1)[0])
    assert state(srv) == state(mem) == {"a": [102, 200, 2, 3, 100, 101], "len": 6, "cursor": 2, "write_count": 8}
    assert torch.equal(srv.storage[:]["b"], mem.storage[:]["b"])
    drawn = srv.sample()
    assert torch.equal(drawn["a"], srv.storage[drawn["index"]]["a"])  # a sample still carries its index, as torchrl's


def test_a_store_checkpoint_with_an_index_key_loads_without_it(be: Backend, tmp_path: Path) -> None:
    """A tdstore checkpoint whose store holds ``"index"`` (written other than through a StoreStorage): left out too."""
    from tdstore import TensorDictStore, export_checkpoint

    store = TensorDictStore.from_tensordict(rows(0, 6).set("index", torch.arange(6)), td_id="with-index", **be.kwargs())
    export_checkpoint(store, tmp_path / "ck")
    rb = replay_buffer(6, **be.kwargs())
    rb.storage.loads(tmp_path / "ck")
    assert keys_of_the_store(rb) == {("a",), ("b",)}
    rb.extend(rows(100, 2))
    assert rb.storage[:]["a"].tolist() == [100, 101, 2, 3, 4, 5]


# -- the writer's cursor ------------------------------------------------------------------------------------
def _history(rb: Any, name: str) -> None:
    if name == "wrapped":
        rb.extend(rows(0, 8))
    elif name == "many_laps":
        for start in (0, 5, 10):
            rb.extend(rows(start, 5))
        rb.add(rows(15, 1)[0])
    elif name == "not_full":
        rb.extend(rows(0, 4))
    elif name == "full_at_slot_0":
        rb.extend(rows(0, 12))
    elif name == "emptied_keeping_the_count":
        rb.extend(rows(0, 8))
        rb.empty(empty_write_count=False)
        rb.extend(rows(10, 7))
    else:
        raise AssertionError(name)


HISTORIES = ["wrapped", "many_laps", "not_full", "full_at_slot_0", "emptied_keeping_the_count"]


@pytest.mark.parametrize("writer", [RoundRobinWriter, TensorDictRoundRobinWriter])
@pytest.mark.parametrize("history", HISTORIES)
def test_a_torchrl_buffer_continues_at_its_writers_cursor(be: Backend, tmp_path: Path, writer: type, history: str) -> None:
    src = TensorDictReplayBuffer(storage=LazyTensorStorage(6), writer=writer(track_generations=True))
    _history(src, history)
    src.dumps(tmp_path / "ck")
    mem = TensorDictReplayBuffer(storage=LazyTensorStorage(6), writer=writer(track_generations=True))
    mem.loads(tmp_path / "ck")
    srv = TensorDictReplayBuffer(storage=StoreStorage(6, **be.kwargs()), writer=StoreWriter())
    srv.loads(tmp_path / "ck")
    assert state(srv) == state(mem) == state(src)
    slots = torch.arange(len(mem))
    if history != "emptied_keeping_the_count":  # (torchrl's generations go on per slot across empty(); a ring's per buffer)
        assert srv._writer.generations_of(slots).tolist() == mem._writer.generations_of(slots).tolist()
    for rb in (mem, srv):
        rb.extend(rows(100, 3))  # the oldest rows are overwritten, never the newest
        rb.add(rows(200, 1)[0])
    assert state(srv) == state(mem)
    attached = TensorDictReplayBuffer(storage=StoreStorage(td_id=srv.storage.td_id, **be.kwargs()), writer=StoreWriter())
    assert state(attached) == state(mem)  # the cursor is the server's: every process continues there


def test_an_emptied_torchrl_buffer_loads_empty(be: Backend, tmp_path: Path) -> None:
    """torchrl's ``empty()`` keeps the old rows in its memmaps and saves ``len`` 0: none of them is restored."""
    src = TensorDictReplayBuffer(storage=LazyTensorStorage(6), batch_size=2)
    src.extend(rows(0, 4))
    src.empty()
    src.dumps(tmp_path / "ck")
    mem = TensorDictReplayBuffer(storage=LazyTensorStorage(6), batch_size=2)
    mem.loads(tmp_path / "ck")
    srv = replay_buffer(6, batch_size=2, **be.kwargs())
    srv.loads(tmp_path / "ck")
    assert len(srv) == len(mem) == 0 and srv.write_count == mem.write_count == 0
    for rb in (mem, srv):
        rb.extend(rows(100, 2))
    assert state(srv) == state(mem) == {"a": [100, 101], "len": 2, "cursor": 2, "write_count": 2}


def test_a_storage_checkpoint_alone_keeps_the_rings_cursor(be: Backend, tmp_path: Path) -> None:
    """``storage.dumps`` of a LazyTensorStorage has no writer beside it: the ring restarts after its written rows."""
    src = LazyTensorStorage(6)
    src.set(torch.arange(6), rows(0, 6))
    src.dumps(tmp_path / "storage")
    srv = replay_buffer(6, **be.kwargs())
    srv.storage.loads(tmp_path / "storage")
    assert state(srv) == {"a": [0, 1, 2, 3, 4, 5], "len": 6, "cursor": 0, "write_count": 6}
    srv.extend(rows(100, 1))
    assert srv.storage[:]["a"].tolist() == [100, 1, 2, 3, 4, 5]


def test_a_store_checkpoint_keeps_its_own_ring_state(be: Backend, tmp_path: Path) -> None:
    """A tdstore checkpoint carries its ring write count: a writer's file beside it changes nothing."""
    rb = replay_buffer(6, **be.kwargs())
    rb.extend(rows(0, 8))
    rb.dumps(tmp_path / "ck")
    (tmp_path / "ck" / "writer" / "metadata.json").write_text('{"cursor": 5, "write_count": 99}')
    back = replay_buffer(6, **be.kwargs())
    back.loads(tmp_path / "ck")
    assert state(back) == {"a": [6, 7, 2, 3, 4, 5], "len": 6, "cursor": 2, "write_count": 8}


# -- ndim > 1 -------------------------------------------------------------------------------------------
def test_an_ndim_2_storage_loads_its_own_checkpoint_as_in_memory(be: Backend, tmp_path: Path) -> None:
    def steps(start: int, t: int) -> TensorDict:  # 2 envs x t steps (the buffer extends along dim 1)
        return TensorDict(a=torch.arange(start, start + 2 * t).reshape(2, t), batch_size=[2, t])

    def make(kind: str) -> TensorDictReplayBuffer:
        if kind == "memory":
            return TensorDictReplayBuffer(storage=LazyTensorStorage(12, ndim=2))
        return TensorDictReplayBuffer(storage=StoreStorage(12, ndim=2, **be.kwargs()), writer=StoreWriter())

    got = {}
    for kind in ("memory", "store"):
        rb = make(kind)
        rb.extend(steps(0, 4))
        rb.extend(steps(100, 3))  # wraps: 6 slots of 2 lanes
        rb.dumps(tmp_path / kind)
        back = make(kind)
        back.loads(tmp_path / kind)
        seen = [len(back), back.storage.max_size, list(back.storage.shape), back.storage[:]["a"].tolist(), back.write_count]
        back.extend(steps(200, 2))
        got[kind] = [*seen, back.storage[:]["a"].tolist(), len(back), back.write_count]
    assert got["store"] == got["memory"]
    assert got["store"][:3] == [12, 12, [6, 2]]
    smaller = StoreStorage(10, ndim=2, **be.kwargs())  # 5 slots of 2 lanes
    with pytest.raises(ValueError, match="max_size 12, this storage has max_size 10"):
        smaller.loads(tmp_path / "store" / "storage")
