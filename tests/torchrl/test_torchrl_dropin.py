"""StoreStorage as a drop-in for torchrl's LazyTensorStorage, through torchrl's public replay-buffer API.

Each test builds the same buffer twice, on an in-memory ``LazyTensorStorage`` and on a
``StoreStorage`` (real server), makes the same calls and compares what is deterministic;
what cannot be the same on a server is checked to raise a clear error.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrl")

from helpers import mp_context, round_trips, top_level_commands  # noqa: E402
from tensordict import TensorDict, tensorclass  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)
from torchrl.envs.transforms import RenameTransform  # noqa: E402

from tdstore.torchrl import StoreStorage, replay_buffer  # noqa: E402


@tensorclass
class Step:
    obs: torch.Tensor
    reward: torch.Tensor


def both(real, n: int, *, cls=ReplayBuffer, make=None, **kw):
    """The same buffer on a LazyTensorStorage and on a StoreStorage (torchrl's default writer and sampler,
    or ``make()``'s keywords, made once per buffer)."""
    out = []
    for storage in (LazyTensorStorage(n), StoreStorage(n, **real.kwargs())):
        out.append(cls(storage=storage, **kw, **(make() if make else {})))
    return out


def data(n: int, start: int = 0) -> TensorDict:
    v = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(a=v.clone(), b=v[:, None].expand(n, 3).clone(), batch_size=[n])


def same(x, y) -> None:
    assert (x == y).all(), (x, y)


# -- 1. writes through storage[:] reach the server -------------------------------------------------------
def test_set_at_set_update_write_through(real):
    """The issue's example: set_at_ / set_ / update_ on the buffer change the server's rows, as in memory."""
    for rb in both(real, 10):
        rb.extend(TensorDict(a=torch.zeros(10), b=torch.ones(10), batch_size=[10]))
        rb.set_at_("a", torch.tensor([99.0, 99.0]), torch.tensor([2, 5]))
        assert rb["a"][2] == 99.0 and rb["a"][5] == 99.0 and rb["a"][3] == 0.0
        rb.set_("b", torch.full((10,), 7.0))
        rb.update_(TensorDict(a=torch.arange(10.0), batch_size=[10]))
        assert rb["a"].tolist() == list(range(10)) and rb["b"].tolist() == [7.0] * 10
        rb["b"] = torch.full((10,), 3.0)
        assert rb[:]["b"].tolist() == [3.0] * 10
    store = StoreStorage(td_id=rb.storage.td_id, **real.kwargs())  # another handle sees the writes
    assert store[:]["a"].tolist() == list(range(10)) and store[:]["b"].tolist() == [3.0] * 10


def test_set_at_on_a_partly_written_buffer_writes_the_written_slots(real):
    mem, srv = both(real, 10)
    for rb in (mem, srv):
        rb.extend(data(4))
        rb.set_at_("a", torch.tensor([-1.0]), torch.tensor([3]))
    same(mem[:]["a"], srv[:]["a"])
    assert len(srv) == 4


def test_in_place_writes_are_one_round_trip_and_bad_input_changes_nothing(real):
    """One atomic write that moves the server's revision (which other processes' cached samplers read) too."""
    rb = replay_buffer(10, **real.kwargs())
    rb.extend(data(10))
    rows = rb.storage[:]
    revision = rb.storage._mutation_revision
    cmds = top_level_commands(real.client, lambda: rows.set_at_("a", torch.tensor([5.0]), torch.tensor([1])))
    assert round_trips(cmds) == ["evalsha"], cmds
    assert rb.storage._mutation_revision != revision
    for write, trips in (
        (lambda: rows.set_("b", torch.full((10, 3), 2.0)), ["evalsha"]),
        (lambda: rows.update_(TensorDict(a=torch.arange(10.0), batch_size=[10])), ["evalsha"]),
        (lambda: rb.storage.set(3, data(1, 30)[0], set_cursor=False), ["evalsha"]),  # rb[3] = td
        # torchrl's own writers: the ring state (which slots continue the cursor), then the write
        (lambda: rb.storage.set(torch.tensor([4, 5]), data(2, 40)), ["hmget", "evalsha"]),
    ):
        revision = rb.storage._mutation_revision
        cmds = top_level_commands(real.client, write)
        assert round_trips(cmds) == trips, cmds
        assert rb.storage._mutation_revision != revision
    assert rb["a"].tolist() == [0.0, 1.0, 2.0, 30.0, 40.0, 41.0, *range(6, 10)]
    with pytest.raises(Exception, match="a"):
        rb.set_at_("a", torch.ones(2, 7), torch.tensor([1, 2]))  # wrong shape: refused by the server's write plan
    assert rb["a"].tolist() == [0.0, 1.0, 2.0, 30.0, 40.0, 41.0, *range(6, 10)]


def test_a_copy_of_the_rows_and_new_keys_stay_local(real):
    rb = replay_buffer(4, **real.kwargs())
    rb.extend(data(4))
    local = rb.storage[:].clone()
    local.set_("a", torch.full((4,), 9.0))
    assert rb["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    rows = rb.storage[:]
    rows["new"] = torch.ones(4)  # as a transform adding a key to rows it read: not added to the buffer
    assert "new" in rows.keys() and "new" not in rb.storage[:].keys()


# -- 2. in-place writes move the mutation revision ---------------------------------------------------------
def test_in_place_writes_move_the_revision_and_refresh_slice_sampler(real):
    def episodes(ids):
        return TensorDict(
            obs=torch.arange(len(ids), dtype=torch.float32),
            episode=torch.tensor(ids),
            batch_size=[len(ids)],
        )

    mem, srv = both(real, 8, cls=TensorDictReplayBuffer, batch_size=4)
    for rb in (mem, srv):
        rb.set_sampler(SliceSampler(num_slices=2, traj_key="episode", cache_values=True))
        rb.extend(episodes([0, 0, 0, 0, 1, 1, 1, 1]))
        rb.sample()  # caches two episodes of 4
        before = int(rb.storage._mutation_revision)
        rb.set_("episode", torch.tensor([2, 2, 3, 3, 4, 4, 5, 5]))  # now four episodes of 2
        assert int(rb.storage._mutation_revision) != before
        for _ in range(30):  # a stale cache would cut slices of 2 across the new episodes' boundaries
            ep = rb.sample()["episode"].reshape(2, 2)
            assert (ep[:, 0] == ep[:, 1]).all(), ep
        before = int(rb.storage._mutation_revision)
        rb[4] = episodes([9])[0]
        assert int(rb.storage._mutation_revision) != before
    same(mem["episode"], srv["episode"])


# -- 4. torchrl's own writers ------------------------------------------------------------------------------
@pytest.mark.parametrize("writer", [RoundRobinWriter, lambda: RoundRobinWriter(track_generations=True)])
def test_round_robin_writer_registered_directly(real, writer):
    mem, srv = both(real, 5, make=lambda: {"writer": writer()})
    for rb in (mem, srv):
        rb.extend(data(3))
        rb.add(data(1, 3)[0])
        rb.extend(data(4, 10))  # wraps
    assert len(srv) == len(mem) == 5 and srv.writer._cursor == mem.writer._cursor
    same(mem[:]["a"], srv[:]["a"])
    assert srv.storage._store.write_count == 8


def test_round_robin_writer_off_the_servers_cursor(real):
    """Slots already written are written in place, new ones must continue the server's cursor, or nothing is written."""
    rb = ReplayBuffer(storage=StoreStorage(6, **real.kwargs()), writer=RoundRobinWriter())
    rb.extend(data(2))
    other = replay_buffer(td_id=rb.storage.td_id, **real.kwargs())  # a StoreWriter elsewhere takes the next slot
    other.extend(data(1, 50))
    rb.writer._cursor = 4  # this writer's own cursor is ahead of the server's (3)
    rb.storage.wait_for_writers = 0  # (no other process will write slot 3)
    with pytest.raises(RuntimeError, match="not written yet, off its cursor"):
        rb.extend(data(3, 20))
    assert rb[:]["a"].tolist() == [0.0, 1.0, 50.0]
    rb.writer._cursor = 1  # behind: slots 1, 2 in place (as in memory, over the other process's row), 3 by the ring
    rb.extend(data(3, 20))
    assert rb[:]["a"].tolist() == [0.0, 20.0, 21.0, 22.0] and rb.storage._store.write_count == 4


def test_max_value_writer(real):
    def scored(vals):
        v = torch.tensor(vals, dtype=torch.float32)
        return TensorDict(obs=v.clone(), reward=v, batch_size=[len(vals)])

    mem, srv = both(real, 3, cls=TensorDictReplayBuffer, make=lambda: {"writer": TensorDictMaxValueWriter(rank_key="reward")})
    for rb in (mem, srv):
        rb.extend(scored([1.0, 5.0, 3.0]))
        rb.extend(scored([4.0, 0.5]))
        rb.add(scored([9.0])[0])
    assert sorted(srv["reward"].tolist()) == sorted(mem["reward"].tolist()) == [4.0, 5.0, 9.0]


def test_tensorclass_and_plain_tensors_through_default_writer(real):
    mem, srv = both(real, 4)
    for rb in (mem, srv):
        rb.extend(Step(obs=torch.arange(3.0), reward=torch.ones(3), batch_size=[3]))
    assert type(srv[:]) is Step
    same(mem[:].obs, srv[:].obs)
    mem, srv = both(real, 4)
    for rb in (mem, srv):
        rb.extend(torch.arange(6.0).reshape(3, 2))
    same(mem[:], srv[:])


# -- 3. empty() ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [True, False])
def test_empty_keeps_generations_and_optionally_the_write_count(one_node, keep):
    """Handles taken before empty() stay stale; empty(empty_write_count=False) keeps the count (as in memory)."""
    from tdstore.torchrl import StoreWriter

    got = []
    for i, storage in enumerate((LazyTensorStorage(6), StoreStorage(6, **one_node.kwargs()))):
        writer = RoundRobinWriter(track_generations=True) if i == 0 else StoreWriter(track_generations=True)
        rb = ReplayBuffer(storage=storage, writer=writer)
        idx = rb.extend(data(8))
        gen = rb.writer.generations_of(idx)
        rb.empty(empty_write_count=not keep)
        assert len(rb) == 0
        rb.extend(data(8, 10))
        res = rb.update_if_present(index=idx, generation=gen, patch={"a": torch.full((8,), -1.0)})
        assert not res.updated.any() and -1.0 not in rb[:]["a"].tolist()
        got.append((rb.write_count, rb[:]["a"].tolist()))
    other = StoreStorage(td_id=storage.td_id, **one_node.kwargs())  # another process sees the same count
    assert ReplayBuffer(storage=other, writer=StoreWriter()).write_count == got[1][0]
    assert got[0] == got[1] and got[0][0] == (16 if keep else 8)


def test_empty_keeps_the_buffers_priorities_rate_limiter_and_queue(one_node):
    """torchrl's samplers keep their priority settings across empty(): so does the buffer's store, whose
    policy other processes share. Before, the store came back bare: the next extend with td_error failed
    to set its priorities, and a limiter or queue set on the store was gone for every process."""
    rb = replay_buffer(6, sampler="prioritized", alpha=0.7, beta=0.4, batch_size=4, **one_node.kwargs())
    store = rb.storage._store
    store.set_rate_limit(min_size=2, samples_per_insert=2.0, error_buffer=8.0)
    store.set_queue(True)
    before = store.sampling_policy
    rb.extend(TensorDict({"a": torch.arange(3.0), "td_error": torch.tensor([1.0, 2.0, 3.0])}, [3]))
    rb.empty()
    assert len(rb) == 0 and rb.storage._store.sampling_policy == before
    idx = rb.extend(TensorDict({"a": torch.arange(10.0, 13.0), "td_error": torch.tensor([0.0, 0.0, 5.0])}, [3]))
    assert sorted(idx.tolist()) == [0, 1, 2]
    assert rb.sample(4)["a"].tolist() == [12.0] * 4  # the rows' td_error became their priorities: only slot 2 is drawn
    other = StoreStorage(td_id=rb.storage.td_id, **one_node.kwargs())
    assert other._store.sampling_policy == before


def test_load_state_dict_keeps_the_policy_and_the_limiter_counts_from_after_the_rows(one_node):
    """load_state_dict empties the store and writes the rows; the buffer keeps its policy, and the
    limiter counts inserts from after the loaded rows (the buffer's content, not inserts a learner
    must catch up with)."""
    mem = ReplayBuffer(storage=LazyTensorStorage(6))
    mem.extend(data(5))
    rb = ReplayBuffer(storage=StoreStorage(6, **one_node.kwargs()))
    store = rb.storage._store
    store.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=1.0)
    before = store.sampling_policy
    rb.storage.load_state_dict(mem.storage.state_dict())
    assert len(rb) == 5 and rb.storage._store.sampling_policy == before
    engine = rb.storage._store._engine
    assert engine.command("HMGET", engine.keys.meta, "lb", "sn") == [b"5", b"0"]
    same(rb[:], mem[:])


def test_reads_index_the_written_rows_as_a_lazy_tensor_storage_does(one_node):
    """Below the capacity but past the written rows, a read raises IndexError as torchrl's does (it never
    returns a slot never written); a position tensor of two dims gives rows of its shape; ``contains``
    counts negative positions from the end. Then, the buffer full, every slot reads."""
    mem, srv = both(one_node, 6)
    for rb in (mem, srv):
        rb.extend(data(4))
    for index in (5, 4, torch.tensor([3, 4]), [0, 5], -5):
        for rb in (mem, srv):
            with pytest.raises(IndexError):
                rb[index]
    for index in (3, -1, torch.tensor([[0, 1], [2, 3]]), [[3, 0], [-1, 1]], slice(1, None)):
        got, want = srv[index], mem[index]
        assert got.batch_size == want.batch_size, index
        same(got["b"], want["b"])
    probe = torch.tensor([0, -1, -4, -5, 3, 4])
    assert srv.storage.contains(probe).tolist() == mem.storage.contains(probe).tolist() == [True, True, True, False, True, False]
    for rb in (mem, srv):
        rb.extend(data(3, 10))  # full and wrapped
    same(srv[5]["a"], mem[5]["a"])
    same(srv[torch.tensor([[5, 0], [1, 4]])]["a"], mem[torch.tensor([[5, 0], [1, 4]])]["a"])


# -- 5. elements with their own batch dims; ndim > 1 storages --------------------------------------------
def test_elements_with_their_own_batch_dims(real):
    x = torch.randn(3, 2, 4)
    mem, srv = both(real, 5)
    for rb in (mem, srv):
        assert len(rb) == 0  # the store is made before the first write: it is made again for [2]-elements
        rb.extend(TensorDict({"a": x[:1]}, [1, 2]))
        rb.extend(TensorDict({"a": x[1:]}, [2, 2]))
    assert srv[:].batch_size == mem[:].batch_size == (3, 2)
    same(srv[:]["a"], mem[:]["a"])
    assert srv[1].batch_size == (2,) and torch.equal(srv[1]["a"], x[1])
    assert srv.sample(4).batch_size == (4, 2)
    with pytest.raises(ValueError, match=r"batch size \[2\].*\[3\]"):
        srv.extend(TensorDict({"a": torch.randn(1, 3, 4)}, [1, 3]))
    assert len(srv) == 3


def test_ndim_storage_refuses_data_of_fewer_dims_before_writing(one_node):
    rb = ReplayBuffer(storage=StoreStorage(8, ndim=2, **one_node.kwargs()), dim_extend=0)
    with pytest.raises(ValueError, match=r"ndim=2\) stores data of at least 2 batch dims, got batch size \[3\]"):
        rb.extend(data(3))
    assert len(rb) == 0
    rb = ReplayBuffer(storage=rb.storage, dim_extend=0)  # (torchrl's writer moved its in-process cursor before the refusal)
    rb.extend(TensorDict(a=torch.ones(3, 2), batch_size=[3, 2]))
    assert len(rb) == 6 and rb.storage.shape == (3, 2) and rb.storage.max_size == 8


# -- 6. pytrees ------------------------------------------------------------------------------------------
def test_dicts_of_tensors(real):
    mem, srv = both(real, 6)
    for rb in (mem, srv):
        rb.extend({"obs": torch.arange(6.0).reshape(3, 2), "nested": {"r": torch.arange(3)}})
        rb.add({"obs": torch.tensor([9.0, 9.0]), "nested": {"r": torch.tensor(9)}})
    got, want = srv[:], mem[:]
    assert isinstance(got, dict) and isinstance(want, dict)
    same(got["obs"], want["obs"])
    same(got["nested"]["r"], want["nested"]["r"])
    assert isinstance(srv.sample(2), dict)
    rb = replay_buffer(6, tensordict=False, **real.kwargs())  # tdstore's StoreWriter: the same
    rb.add({"obs": torch.tensor([1.0, 2.0])})
    rb.extend({"obs": torch.ones(2, 2)})
    assert rb[:]["obs"].tolist() == [[1.0, 2.0], [1.0, 1.0], [1.0, 1.0]] and isinstance(rb.sample(2), dict)


def test_other_pytrees_as_in_memory(one_node):
    mem, srv = both(one_node, 6)
    for rb in (mem, srv):
        rb.extend((torch.arange(4.0), {"x": [torch.ones(4, 2), torch.zeros(4, dtype=torch.int64)]}))
        rb.add((torch.tensor(9.0), {"x": [torch.full((2,), 9.0), torch.tensor(9)]}))
    got, want = srv[:], mem[:]
    assert type(got) is type(want) is tuple and isinstance(got[1]["x"], list)
    same(got[0], want[0])
    same(got[1]["x"][0], want[1]["x"][0])
    assert got[1]["x"][1].dtype == torch.int64
    with pytest.raises(TypeError, match="not a tuple holding str"):
        srv.add((torch.ones(1), "text"))
    assert len(srv) == 5


# -- 7. state dicts --------------------------------------------------------------------------------------
def test_a_lazy_tensor_storage_state_dict_loads_its_rows(real):
    mem, srv = both(real, 6)
    mem.extend(data(4))
    srv.extend(data(2, 100))
    srv.storage.load_state_dict(mem.storage.state_dict())
    assert len(srv) == 4
    same(srv[:]["b"], mem[:]["b"])
    tensors = ReplayBuffer(storage=LazyTensorStorage(6))
    tensors.extend(torch.arange(8.0).reshape(4, 2))
    srv = ReplayBuffer(storage=StoreStorage(6, **real.kwargs()))
    srv.storage.load_state_dict(tensors.storage.state_dict())
    same(srv[:], tensors[:])


def test_a_state_dict_of_another_kind_is_refused_clearly(real):
    srv = ReplayBuffer(storage=StoreStorage(6, **real.kwargs()))
    srv.extend(data(2))
    with pytest.raises(ValueError, match="neither a StoreStorage's.*dumps/loads"):
        srv.storage.load_state_dict({"_storage_list": []})
    with pytest.raises(ValueError, match="max_size 6"):
        srv.storage.load_state_dict(LazyTensorStorage(3).state_dict() | {"_storage": data(3).state_dict(), "_len": 3})
    assert srv[:]["a"].tolist() == [0.0, 1.0]


# -- samplers, transforms, compile, reads: the same draws from the same generator ------------------------
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: {"sampler": RandomSampler()}, id="RandomSampler"),
        pytest.param(lambda: {"sampler": SamplerWithoutReplacement()}, id="SamplerWithoutReplacement"),
        pytest.param(lambda: {"compilable": True}, id="compilable"),
        pytest.param(lambda: {"transform": RenameTransform(["a"], ["c"], create_copy=True)}, id="transform"),
    ],
)
def test_the_same_samples_as_in_memory(real, make):
    drawn = []
    for rb in both(real, 10, make=make, batch_size=4):
        rb.set_rng(torch.Generator().manual_seed(3))
        rb.extend(data(8))
        drawn.append([rb.sample().get("c" if "transform" in make() else "a").tolist() for _ in range(2)])
    assert drawn[0] == drawn[1]


def test_reads_and_shape_as_in_memory(real):
    mem, srv = both(real, 10)
    for rb in (mem, srv):
        rb.extend(data(8))
        rb[0] = data(1, 70)[0]
        rb[1:3] = data(2, 80)
    assert srv.storage.shape == mem.storage.shape == (8,)
    for index in (slice(2, 5), torch.tensor([7, 0, 7]), 3, slice(None, None, 2)):
        same(srv[index]["b"], mem[index]["b"])
    assert srv["b"].shape == mem["b"].shape


def test_device(real):
    mem = ReplayBuffer(storage=LazyTensorStorage(4, device="cpu"), batch_size=2)
    srv = ReplayBuffer(storage=StoreStorage(4, device="cpu", **real.kwargs()), batch_size=2)
    for rb in (mem, srv):
        rb.extend(data(3))
        out, info = rb.sample(return_info=True)
        assert out.device == torch.device("cpu") and rb[:].device == torch.device("cpu") and rb.storage.device == torch.device("cpu")
        assert info["index"].device == torch.device("cpu")


# -- 8. update_if_present -------------------------------------------------------------------------------
@pytest.mark.parametrize("writer", ["RoundRobinWriter", "StoreWriter"])
def test_update_if_present_as_in_memory(real, writer):
    from tdstore.torchrl import StoreWriter

    results = []
    for i, rb in enumerate(both(real, 4, make=lambda: {"writer": RoundRobinWriter(track_generations=True)})):
        if i and writer == "StoreWriter":
            rb = ReplayBuffer(storage=StoreStorage(4, **real.kwargs()), writer=StoreWriter(track_generations=True))
        idx = rb.extend(data(4))
        gen = rb.writer.generations_of(idx)
        rb.extend(data(2, 10))  # slots 0 and 1 are written again: their handles are stale
        res = rb.update_if_present(index=idx, generation=gen, patch={"a": torch.full((4,), -5.0)})
        with pytest.raises(ValueError, match="dtype mismatch"):
            rb.update_if_present(index=idx, generation=gen, patch={"a": torch.zeros(4, dtype=torch.int64)})
        results.append((res.updated.tolist(), rb[:]["a"].tolist()))
    assert results[0] == results[1] == ([False, False, True, True], [10.0, 11.0, -5.0, -5.0])


def test_tensordict_map_updates_and_inserts_in_one_batch(real):
    from torchrl.data.map import TensorDictMap

    def keys(*k):
        return TensorDict(k=torch.tensor(k, dtype=torch.float32)[:, None], batch_size=[len(k)])

    def values(*v):
        return TensorDict(v=torch.tensor(v, dtype=torch.float32), batch_size=[len(v)])

    got = []
    for storage in (LazyTensorStorage(10), StoreStorage(10, **real.kwargs())):
        m = TensorDictMap.from_tensordict_pair(
            keys(0.0),
            keys(0.0).set("v", torch.zeros(1)),
            in_keys=["k"],
            out_keys=["v"],
            max_size=10,
            storage_constructor=lambda s=storage: s,
        )
        m[keys(1, 2, 3)] = values(10, 20, 30)
        m[keys(2, 4)] = values(21, 40)  # an update and an insert: two atomic calls on the server
        got.append(m[keys(1, 2, 3, 4)]["v"].tolist())
    assert got[0] == got[1] == [10.0, 21.0, 30.0, 40.0]


def test_features_torchrl_keeps_for_tensor_storages(one_node):
    """ConsumingSampler and sequence sample units, which torchrl offers to TensorStorage subclasses only."""
    from torchrl.data.replay_buffers.sample_units import Sequence
    from torchrl.data.replay_buffers.samplers import ConsumingSampler

    got = []
    for storage in (LazyTensorStorage(8), StoreStorage(8, **one_node.kwargs())):
        rb = TensorDictReplayBuffer(storage=storage, sampler=ConsumingSampler(), batch_size=3)
        rb.set_rng(torch.Generator().manual_seed(0))
        rb.extend(data(6))
        drawn = sorted(rb.sample()["a"].tolist() + rb.sample()["a"].tolist())
        rb.extend(data(3, 100))  # consumed slots are written first
        got.append((drawn, sorted(rb[:]["a"].tolist())))
        seq = TensorDictReplayBuffer(
            storage=type(storage)(8, **({} if isinstance(storage, LazyTensorStorage) else one_node.kwargs())),
            sample_unit=Sequence(3, done_key="done"),
            batch_size=2,
        )
        seq.set_rng(torch.Generator().manual_seed(1))
        seq.extend(TensorDict(a=torch.arange(6.0), done=torch.tensor([0, 0, 1, 0, 0, 1], dtype=torch.bool)[:, None], batch_size=[6]))
        got.append(seq.sample()["a"].tolist())
    assert got[:2] == got[2:]


def test_store_samplers_refuse_ndim_storages_naming_torchrls(one_node):
    from tdstore.torchrl import StoreSampler, StoreWriter

    rb = ReplayBuffer(storage=StoreStorage(8, ndim=2, **one_node.kwargs()), writer=StoreWriter(), sampler=StoreSampler(), batch_size=2)
    idx = rb.extend(TensorDict(a=torch.ones(2, 3), batch_size=[2, 3]))  # [lanes, time]: dim_extend=1
    assert idx.shape == (6, 2) and len(rb) == 6
    with pytest.raises(ValueError, match="ndim=2.*use torchrl's RandomSampler"):
        rb.sample()


def test_in_place_writes_of_another_process_move_the_revision(one_node):
    rb = replay_buffer(6, **one_node.kwargs())
    rb.extend(data(6))
    other = ReplayBuffer(storage=StoreStorage(td_id=rb.storage.td_id, **one_node.kwargs()))
    before = rb.storage._mutation_revision
    other[2] = data(1, 50)[0]
    assert rb.storage._mutation_revision != before and rb["a"][2] == 50.0
    before = rb.storage._mutation_revision
    other.set_at_("a", torch.tensor([7.0]), torch.tensor([0]))
    assert rb.storage._mutation_revision != before


def test_a_full_buffer_reads_its_rows_in_one_round_trip_and_sees_another_handle_empty_it(one_node):
    """Once a handle has seen the ring full, ``storage[:]`` (``rb[:]``, ``rb["a"]``, torchrl's in-place writes) reads
    the rows without asking the length first (the ring's write count only grows); a buffer another handle emptied
    and wrote again is another creation of the store, which that read finds."""
    rb = replay_buffer(4, **one_node.kwargs())
    rb.extend(data(4))
    assert len(rb) == 4  # learns the ring is full
    if one_node.server is not None:
        for read in (lambda: rb.storage[:], lambda: rb["a"]):
            cmds = top_level_commands(one_node.client, read)
            assert round_trips(cmds) == ["transaction"], cmds
    other = ReplayBuffer(storage=StoreStorage(td_id=rb.storage.td_id, **one_node.kwargs()))
    other.empty()
    other.extend(data(2, 10))
    assert rb.storage[:]["a"].tolist() == [10.0, 11.0] and rb["a"].tolist() == [10.0, 11.0] and len(rb) == 2
    other.extend(data(2, 12))
    rb.storage[:].set_at_("a", torch.tensor([-1.0]), torch.tensor([3]))
    assert other["a"].tolist() == [10.0, 11.0, 12.0, -1.0]


def _set_at_in_child(url: str, prefix: str, td_id: str) -> None:
    rb = ReplayBuffer(storage=StoreStorage(td_id=td_id, url=url, prefix=prefix))
    rb.storage[:].set_at_("a", torch.tensor([-3.0]), torch.tensor([4]))  # one in-place write


def test_one_in_place_write_of_another_os_process_moves_the_revision_once(real):
    """The rows and the revision move in the same call: a cached SliceSampler in this process sees a write made
    by another process, and the revision counts that write once."""
    rb = replay_buffer(6, **real.kwargs())
    rb.extend(data(6))
    before = rb.storage._mutation_revision
    p = mp_context().Process(target=_set_at_in_child, args=(real.server.url, real.prefix, rb.storage.td_id))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    assert rb.storage._mutation_revision - before == 1 << 48  # 'tr' + 1 (rw, the ring's writes, unchanged)
    assert rb["a"].tolist() == [0.0, 1.0, 2.0, 3.0, -3.0, 5.0]


def test_a_write_ahead_of_the_cursor_waits_for_the_writes_before_it(one_node):
    """torchrl's writers share their cursor across forked processes, whose writes may reach the server out of order."""
    import threading

    storage = StoreStorage(10, **one_node.kwargs())
    first = ReplayBuffer(storage=storage, writer=RoundRobinWriter())
    ahead = ReplayBuffer(storage=StoreStorage(td_id=storage.td_id, **one_node.kwargs()), writer=RoundRobinWriter())
    ahead.writer._cursor = 3  # its process took slots 3..4 of the shared cursor; slots 0..2 are another's
    ahead.storage.wait_for_writers = 600  # (however slow the machine)
    errors: list[BaseException] = []

    def write_ahead() -> None:
        try:
            ahead.extend(data(2, 30))
        except BaseException as err:  # noqa: BLE001  # (reported by the assertion below)
            errors.append(err)

    thread = threading.Thread(target=write_ahead)
    thread.start()
    first.extend(data(3))
    thread.join(60)
    assert not errors and not thread.is_alive()
    assert first[:]["a"].tolist() == [0.0, 1.0, 2.0, 30.0, 31.0] and len(first) == 5
