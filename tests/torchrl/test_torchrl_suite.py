"""torchrl's kinds of replay-buffer test (composable buffers, storages, samplers, writers, trajectories,
state dicts, transforms, pytrees, tensorclasses, devices), each run on an in-memory ``LazyTensorStorage``
and on tdstore's ``StoreStorage`` (redis-server and fakeredis) through torchrl's public API only.

Written for tdstore in the manner of torchrl's ``test/test_rb.py`` (nothing copied): every case takes
``storage``, a factory ``storage(max_size, **kw)``, and asserts the same thing whatever the factory
makes.  Where a server cannot behave the same, the case says so with ``refused_on_store`` (README,
"What differs from LazyTensorStorage").
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import torch

pytest.importorskip("torchrl")

from tensordict import TensorDict, tensorclass  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)

from tdstore.torchrl import StoreStorage  # noqa: E402


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


@pytest.fixture(params=["memory", "redis", "fakeredis"])
def storage(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``storage(max_size, **kw)``: a LazyTensorStorage, or a StoreStorage on redis-server or fakeredis."""
    if request.param == "memory":
        yield LazyTensorStorage
        return
    if request.param == "redis":
        srv = request.getfixturevalue("redis_server")
        conn: dict[str, Any] = {"url": srv.url}
    else:
        server = fakeredis.FakeServer()
        conn = {"client_factory": lambda: fakeredis.FakeRedis(server=server)}
    prefix = f"suite-{request.node.name[-40:]}".replace("[", "-").replace("]", "")

    def make(max_size: int, **kw: Any) -> StoreStorage:
        extra = {"client": conn["client_factory"]()} if "client_factory" in conn else {"url": conn["url"]}
        return StoreStorage(max_size, prefix=prefix, **extra, **kw)

    make.on_store = True  # type: ignore[attr-defined]
    yield make


def on_store(storage: Any) -> bool:
    return getattr(storage, "on_store", False)


def transitions(n: int, start: int = 0) -> TensorDict:
    v = torch.arange(start, start + n)
    return TensorDict(
        obs=v[:, None].float().expand(n, 4).clone(),
        action=(v % 3)[:, None],
        reward=v.float()[:, None],
        next=TensorDict(obs=v[:, None].float().expand(n, 4) + 1, batch_size=[n]),
        batch_size=[n],
    )


def of_kind(kind: str, n: int, start: int = 0) -> Any:
    td = transitions(n, start)
    if kind == "tensor":
        return td["reward"][:, 0]
    if kind == "tensorclass":
        return Transition(obs=td["obs"], reward=td["reward"], batch_size=[n])
    if kind == "pytree":
        return {"obs": td["obs"], "extra": (td["reward"], [td["action"]])}
    return td


def first_leaf(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        return x["obs"]
    return x.get("obs") if hasattr(x, "get") else x.obs


KINDS = ["tensordict", "tensor", "tensorclass", "pytree"]


# -- composable buffers: writers x samplers x data kinds -----------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sampler", [RandomSampler, SamplerWithoutReplacement])
def test_composable_add_extend_sample(storage, kind, sampler):
    rb = ReplayBuffer(storage=storage(10), sampler=sampler(), writer=RoundRobinWriter(), batch_size=4)
    rb.add(
        of_kind(kind, 1)[0] if kind != "pytree" else {"obs": torch.zeros(4), "extra": (torch.zeros(1), [torch.zeros(1, dtype=torch.int64)])}
    )
    idx = rb.extend(of_kind(kind, 6, 1))
    assert idx.tolist() == list(range(1, 7)) and len(rb) == 7
    out = rb.sample()
    assert first_leaf(out).shape == (4, 4) or kind == "tensor"
    assert rb.write_count == 7
    rb.extend(of_kind(kind, 6, 7))  # wraps around
    assert len(rb) == 10 and rb.write_count == 13
    assert first_leaf(rb[0]).flatten()[0] == (10 if kind != "tensor" else 10)


@pytest.mark.parametrize("kind", KINDS)
def test_index_and_len(storage, kind):
    rb = ReplayBuffer(storage=storage(8), batch_size=2)
    rb.extend(of_kind(kind, 5))
    assert len(rb) == 5 and len(rb.storage) == 5
    got = rb[torch.tensor([4, 0])]
    assert first_leaf(got).reshape(2, -1)[:, 0].tolist() == [4.0, 0.0]
    assert first_leaf(rb[1:3]).reshape(2, -1)[:, 0].tolist() == [1.0, 2.0]


def test_empty_and_reuse(storage):
    rb = TensorDictReplayBuffer(storage=storage(6), batch_size=3)
    rb.extend(transitions(6))
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 0
    rb.extend(transitions(2, 50))
    assert len(rb) == 2 and rb[:]["reward"].flatten().tolist() == [50.0, 51.0]


def test_empty_keeps_the_write_count(storage):
    rb = ReplayBuffer(storage=storage(6))
    rb.extend(transitions(4))
    rb.empty(empty_write_count=False)
    assert len(rb) == 0 and rb.write_count == 4
    rb.extend(transitions(1))
    assert rb.write_count == 5


def test_generations_after_empty(storage):
    rb = ReplayBuffer(storage=storage(4), writer=RoundRobinWriter(track_generations=True))
    idx = rb.extend(transitions(4))
    gen = rb.writer.generations_of(idx)
    rb.empty()
    rb.extend(transitions(4, 10))
    assert (rb.writer.generations_of(idx) != gen).all()
    res = rb.update_if_present(index=idx, generation=gen, patch={"reward": torch.zeros(4, 1)})
    assert not res.updated.any()


def test_inplace_writing(storage):
    rb = TensorDictReplayBuffer(storage=storage(10), batch_size=2)
    rb.extend(transitions(6))
    rb[3] = transitions(1, 100)[0]
    rb[4:6] = transitions(2, 200)
    assert rb[:]["reward"].flatten().tolist() == [0.0, 1.0, 2.0, 100.0, 200.0, 201.0]
    assert len(rb) == 6


def test_set_at_and_update(storage):
    rb = ReplayBuffer(storage=storage(5))
    rb.extend(transitions(5))
    rb.set_at_("reward", torch.full((2, 1), -1.0), torch.tensor([0, 4]))
    rb.update_(TensorDict(action=torch.full((5, 1), 7), batch_size=[5]))
    assert rb["reward"].flatten().tolist() == [-1.0, 1.0, 2.0, 3.0, -1.0]
    assert rb["action"].flatten().tolist() == [7] * 5


# -- storages: state dicts, pickles, checkpoints ---------------------------------------------------------
@pytest.mark.parametrize("init_out", [True, False])
def test_storage_state_dict(storage, init_out):
    rb = TensorDictReplayBuffer(storage=storage(20), batch_size=3)
    rb.extend(transitions(5))
    state = rb.state_dict()
    out = TensorDictReplayBuffer(storage=storage(20), batch_size=3)
    if init_out:
        out.extend(transitions(2, 90))
    out.load_state_dict(state)
    assert len(out) == 5 and out[:]["reward"].flatten().tolist() == list(range(5))
    assert out.sample()["obs"].shape == (3, 4)


@pytest.mark.parametrize("direction", ["into memory", "from memory"])
def test_state_dict_across_storage_kinds(storage, direction):
    if direction == "into memory":
        src, dst = TensorDictReplayBuffer(storage=storage(8)), TensorDictReplayBuffer(storage=LazyTensorStorage(8))
    else:
        src, dst = TensorDictReplayBuffer(storage=LazyTensorStorage(8)), TensorDictReplayBuffer(storage=storage(8))
    src.extend(transitions(3))
    dst.storage.load_state_dict(src.storage.state_dict())
    assert len(dst) == 3 and dst[:]["reward"].flatten().tolist() == [0.0, 1.0, 2.0]


def test_state_dict_of_an_emptied_buffer_restores_its_rows(storage):
    rb = TensorDictReplayBuffer(storage=storage(8))
    rb.extend(transitions(3))
    state = rb.state_dict()
    if on_store(storage):
        rb.storage._store.clear_redis()  # the buffer is gone (emptied elsewhere, a server restarted)
    out = TensorDictReplayBuffer(storage=storage(8))
    out.load_state_dict(state)
    assert len(out) == 3 and out[:]["reward"].flatten().tolist() == [0.0, 1.0, 2.0]


def test_dumps_loads(storage, tmp_path):
    rb = TensorDictReplayBuffer(storage=storage(10), batch_size=2)
    rb.extend(transitions(7))
    rb.dumps(tmp_path)
    rb.empty()
    rb.loads(tmp_path)
    assert len(rb) == 7 and rb[:]["reward"].flatten().tolist() == list(range(7))


def test_pickle(storage):
    rb = TensorDictReplayBuffer(storage=storage(6), batch_size=2)
    rb.extend(transitions(4))
    if on_store(storage) and not isinstance(rb.storage._conn.get("url"), str):
        pytest.skip("a handle on a fakeredis client holds no URL a copy could reconnect with")
    back = pickle.loads(pickle.dumps(rb))
    assert len(back) == 4 and back.sample()["obs"].shape == (2, 4)


# -- samplers -------------------------------------------------------------------------------------------
def test_sampler_without_replacement_epochs(storage):
    rb = ReplayBuffer(storage=storage(10), sampler=SamplerWithoutReplacement(drop_last=True), batch_size=3)
    rb.extend(transitions(9))
    seen = torch.cat([rb.sample()["reward"].flatten() for _ in range(3)])
    assert sorted(seen.tolist()) == list(range(9))


def episodes(ids: list[int]) -> TensorDict:
    n = len(ids)
    ep = torch.tensor(ids)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[:-1, 0] = ep[1:] != ep[:-1]
    done[-1, 0] = True
    return TensorDict(obs=torch.arange(n, dtype=torch.float32), episode=ep, next=TensorDict(done=done, batch_size=[n]), batch_size=[n])


@pytest.mark.parametrize("key", ["traj_key", "end_key"])
def test_slice_sampler(storage, key):
    kw = {"traj_key": "episode"} if key == "traj_key" else {"end_key": ("next", "done")}
    rb = TensorDictReplayBuffer(storage=storage(20), sampler=SliceSampler(num_slices=3, **kw), batch_size=9)
    rb.extend(episodes([0] * 5 + [1] * 6 + [2] * 4))
    for _ in range(5):
        ep = rb.sample()["episode"].reshape(3, 3)
        assert (ep == ep[:, :1]).all()


def test_slice_sampler_without_replacement(storage):
    rb = TensorDictReplayBuffer(storage=storage(20), sampler=SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode"), batch_size=8)
    rb.extend(episodes([0] * 4 + [1] * 4 + [2] * 4 + [3] * 4))
    for _ in range(2):
        ep = rb.sample()["episode"].reshape(2, 4)
        assert (ep == ep[:, :1]).all()


def test_slice_sampler_cache_follows_in_place_writes(storage):
    rb = TensorDictReplayBuffer(storage=storage(8), sampler=SliceSampler(num_slices=2, traj_key="episode", cache_values=True), batch_size=4)
    rb.extend(episodes([0] * 4 + [1] * 4))
    rb.sample()
    rb.set_("episode", torch.tensor([2, 2, 3, 3, 4, 4, 5, 5]))
    for _ in range(10):
        ep = rb.sample()["episode"].reshape(2, 2)
        assert (ep[:, 0] == ep[:, 1]).all()


def test_rb_trajectories_with_a_wrapping_cursor(storage):
    rb = TensorDictReplayBuffer(storage=storage(10), sampler=SliceSampler(num_slices=2, end_key=("next", "done")), batch_size=6)
    rb.extend(episodes([0] * 6 + [1] * 6))  # wraps: slots 0..1 hold the end of episode 1
    for _ in range(5):
        ep = rb.sample()["episode"].reshape(2, 3)
        assert (ep == ep[:, :1]).all()


def against_memory(storage: Any, run: Any) -> Any:
    """``run(storage)``; on a StoreStorage, also ``run(LazyTensorStorage)``, which must give the same."""
    got = run(storage)
    if on_store(storage):
        assert got == run(LazyTensorStorage)
    return got


def test_consuming_sampler(storage):
    from torchrl.data.replay_buffers.samplers import ConsumingSampler

    def run(make: Any) -> Any:
        rb = TensorDictReplayBuffer(storage=make(6), sampler=ConsumingSampler(), batch_size=3)
        rb.set_rng(torch.Generator().manual_seed(0))
        rb.extend(transitions(6))
        drawn = torch.cat([rb.sample()["reward"].flatten() for _ in range(2)])
        assert sorted(drawn.tolist()) == list(range(6))
        rb.extend(transitions(2, 40))  # the consumed slots take the new rows
        return drawn.tolist(), len(rb), sorted(rb[:]["reward"].flatten().tolist())

    against_memory(storage, run)


def test_sequence_sample_unit(storage):
    from torchrl.data.replay_buffers.sample_units import Sequence

    rb = TensorDictReplayBuffer(storage=storage(12), sample_unit=Sequence(3, done_key=("next", "done")), batch_size=2)
    rb.extend(episodes([0] * 5 + [1] * 5))
    out = rb.sample()
    assert out.batch_size == (6,)


# -- writers --------------------------------------------------------------------------------------------
def test_max_value_writer(storage):
    rb = TensorDictReplayBuffer(storage=storage(4), writer=TensorDictMaxValueWriter(rank_key="key"), batch_size=2)
    for v in [5.0, 1.0, 9.0, 3.0, 7.0, 0.5, 8.0]:
        rb.add(TensorDict(key=torch.tensor(v), obs=torch.ones(2)))
    assert sorted(rb[:]["key"].tolist()) == [5.0, 7.0, 8.0, 9.0]
    rb.extend(TensorDict(key=torch.tensor([10.0, 0.1]), obs=torch.ones(2, 2), batch_size=[2]))
    assert sorted(rb[:]["key"].tolist()) == [7.0, 8.0, 9.0, 10.0]


def test_round_robin_writer_generations(storage):
    rb = ReplayBuffer(storage=storage(3), writer=RoundRobinWriter(track_generations=True), batch_size=2)
    idx = rb.extend(transitions(5))
    assert rb.writer.generations_of(torch.arange(3)).tolist() == [1, 1, 0]
    _, info = rb.sample(return_info=True)
    assert "index_generation" in info
    assert idx.tolist() == [0, 1, 2, 0, 1]


# -- transforms, compile, devices, tensorclasses ---------------------------------------------------------
def test_insert_transform(storage):
    from torchrl.envs.transforms import Compose, RenameTransform

    rb = TensorDictReplayBuffer(storage=storage(6), batch_size=3, transform=Compose(RenameTransform(["obs"], ["o"], create_copy=True)))
    rb.extend(transitions(4))
    assert "o" in rb.sample().keys()
    rb.insert_transform(0, RenameTransform(["reward"], ["r"], create_copy=True))
    out = rb.sample()
    assert (out["r"] == out["reward"]).all() and "r" not in rb.storage[:].keys()


def test_compilable_buffer(storage):
    rb = ReplayBuffer(storage=storage(8, compilable=True), batch_size=3, compilable=True)
    rb.extend(transitions(5))
    assert rb.sample()["obs"].shape == (3, 4)


@pytest.mark.parametrize("compilable", [False, True])
def test_torch_compile_through_the_storage(storage, compilable):
    """torch.compile of a function that extends and samples (the storage's server calls run eagerly)."""
    rb = ReplayBuffer(storage=storage(8, compilable=compilable), sampler=RandomSampler(), batch_size=3, compilable=compilable)
    td = TensorDict(a=torch.ones(2, 3), batch_size=[2])

    @torch.compile(backend="eager")
    def extend_and_sample(td: TensorDict) -> torch.Tensor:
        rb.extend(td)
        return rb.sample()["a"].sum()

    for _ in range(5):
        assert extend_and_sample(td).item() == 9.0
    assert len(rb) == 8 and rb.write_count == 10


def test_device_auto(storage):
    rb = ReplayBuffer(storage=storage(6, device="auto"), batch_size=2)
    rb.extend(transitions(3))
    assert rb.sample()["obs"].device == torch.device("cpu")


def test_device_argument(storage):
    rb = ReplayBuffer(storage=storage(6, device="cpu"), batch_size=2)
    rb.extend(transitions(3))
    assert rb.sample().device == torch.device("cpu") and rb.storage.device == torch.device("cpu")


def test_tensorclass_round_trip(storage):
    rb = ReplayBuffer(storage=storage(6), batch_size=2)
    rb.extend(of_kind("tensorclass", 4))
    out = rb.sample()
    assert isinstance(out, Transition) and out.obs.shape == (2, 4)


def test_pytree_round_trip(storage):
    rb = ReplayBuffer(storage=storage(6), batch_size=2)
    rb.extend(of_kind("pytree", 4))
    out = rb[:]
    assert isinstance(out["extra"], tuple) and isinstance(out["extra"][1], list)
    assert out["extra"][0].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_elements_with_their_own_batch_dims(storage):
    rb = ReplayBuffer(storage=storage(5), batch_size=3)
    rb.extend(TensorDict(a=torch.randn(2, 4, 3), batch_size=[2, 4]))
    assert rb[:].batch_size == (2, 4) and rb.sample().batch_size == (3, 4)


# -- ndim > 1 ---------------------------------------------------------------------------------------------
def cells(kind: str, shape: tuple[int, ...]) -> Any:
    obs = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    if kind == "tensor":
        return obs
    if kind == "tensorclass":
        return Transition(obs=obs, reward=-obs, batch_size=shape)
    if kind == "pytree":
        return {"obs": obs, "more": (-obs,)}
    return TensorDict(obs=obs, batch_size=shape)


def obs_of(x: Any) -> list:
    return (x if isinstance(x, torch.Tensor) else x["obs"] if isinstance(x, (dict, TensorDict)) else x.obs).tolist()


@pytest.mark.parametrize("kind", ["tensordict", "tensor", "tensorclass"])  # (an ndim>1 LazyTensorStorage indexes no pytree)
@pytest.mark.parametrize("sampler", [RandomSampler, lambda: SamplerWithoutReplacement(drop_last=False)])
@pytest.mark.parametrize("ndim", [2, 3])
def test_multidim_storage(storage, ndim, kind, sampler):
    """As torchrl's ndim>1 storages: dim 0 is time, the others lanes; sampling draws cells."""

    def run(make: Any) -> Any:
        shape = (3, 4) if ndim == 2 else (3, 4, 2)  # [lanes, time, ...] as collectors give it (dim_extend = 1)
        rb = ReplayBuffer(storage=make(24, ndim=ndim), sampler=sampler(), batch_size=5)
        rb.set_rng(torch.Generator().manual_seed(0))
        idx = rb.extend(cells(kind, shape))
        got = [len(rb), tuple(rb.storage.shape), tuple(idx.shape), obs_of(rb.sample()), obs_of(rb[:])]
        got.append(obs_of(rb.storage[tuple(idx[:3].unbind(-1))]))  # the cells extend returned
        rb.extend(cells(kind, shape))
        got.append([len(rb), rb.write_count, obs_of(rb.sample())])
        if isinstance(rb.sampler, SamplerWithoutReplacement):
            got.append(sorted(v for batch in rb for v in torch.as_tensor(obs_of(batch)).flatten().tolist()))
        rb.empty()
        got.append(len(rb))
        return got

    against_memory(storage, run)


@pytest.mark.parametrize("key", ["traj_key", "end_key"])
def test_multidim_slice_sampler(storage, key):
    def run(make: Any) -> Any:
        kw = {"traj_key": "episode"} if key == "traj_key" else {"end_key": ("next", "done")}
        rb = TensorDictReplayBuffer(storage=make(16, ndim=2), sampler=SliceSampler(num_slices=2, **kw), batch_size=6)
        ep = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 3, 3, 3, 3, 3]])
        done = torch.zeros(2, 8, 1, dtype=torch.bool)
        done[0, 3] = done[0, 7] = done[1, 2] = done[1, 7] = True
        rb.extend(TensorDict(episode=ep, obs=ep.float(), next=TensorDict(done=done, batch_size=[2, 8]), batch_size=[2, 8]))
        for _ in range(5):
            e = rb.sample()["episode"].reshape(2, 3)
            assert (e == e[:, :1]).all()
        return len(rb)

    against_memory(storage, run)


# -- more of torchrl's storage and buffer cases ---------------------------------------------------------
def test_writer_cursor_position(storage):
    rb = ReplayBuffer(storage=storage(5), batch_size=2)
    rb.add(transitions(1)[0])
    assert rb.writer._cursor == 1
    rb.extend(transitions(6))
    assert rb.writer._cursor == 2 and len(rb) == 5


def test_storage_not_initialized(storage):
    s = storage(10)
    with pytest.raises(RuntimeError):
        s[0]


@pytest.mark.parametrize("index", [[0, 2], -1, slice(-2, None), "mask"])
def test_rb_indexing(storage, index):
    def run(make: Any) -> Any:
        rb = ReplayBuffer(storage=make(6))
        rb.extend(transitions(4))
        i = torch.tensor([True, False, True, True]) if index == "mask" else index
        return rb[i]["reward"].flatten().tolist()

    against_memory(storage, run)


@pytest.mark.parametrize("drop_last", [True, False])
def test_iterate_a_buffer(storage, drop_last):
    def run(make: Any) -> Any:
        rb = ReplayBuffer(storage=make(10), sampler=SamplerWithoutReplacement(drop_last=drop_last, shuffle=False), batch_size=3)
        rb.extend(transitions(7))
        return [b["reward"].flatten().tolist() for b in rb]

    against_memory(storage, run)


def test_prefetch(storage):
    rb = TensorDictReplayBuffer(storage=storage(10), batch_size=3, prefetch=2)
    rb.extend(transitions(8))
    for _ in range(4):
        assert rb.sample()["obs"].shape == (3, 4)


def test_sampler_state_dict_round_trip(storage):
    def run(make: Any) -> Any:
        rb = ReplayBuffer(storage=make(10), sampler=SamplerWithoutReplacement(), batch_size=2)
        rb.set_rng(torch.Generator().manual_seed(4))
        rb.extend(transitions(6))
        first = rb.sample()["reward"].flatten().tolist()
        state = rb.sampler.state_dict()
        sampler = SamplerWithoutReplacement()
        sampler.load_state_dict(state)
        rest = [rb.sample()["reward"].flatten().tolist() for _ in range(2)]
        return sorted(first + sum(rest, []))

    against_memory(storage, run)


@pytest.mark.parametrize("source", ["memory", "store"])
def test_storage_dumps_loads_across_kinds(storage, tmp_path, source):
    if not on_store(storage):
        pytest.skip("the same as test_dumps_loads on memory")
    src = LazyTensorStorage(8) if source == "memory" else storage(8)
    dst = storage(8) if source == "memory" else LazyTensorStorage(8)
    rb = TensorDictReplayBuffer(storage=src)
    rb.extend(transitions(5))
    src.dumps(tmp_path / "s")
    dst.loads(tmp_path / "s")
    assert len(dst) == 5 and dst[:]["reward"].flatten().tolist() == list(range(5))


def test_slice_sampler_strict_length_false_and_span(storage):
    def run(make: Any) -> Any:
        rb = TensorDictReplayBuffer(
            storage=make(20), sampler=SliceSampler(slice_len=4, traj_key="episode", strict_length=False, span=True), batch_size=8
        )
        rb.set_rng(torch.Generator().manual_seed(0))
        rb.extend(episodes([0] * 3 + [1] * 6 + [2] * 2))
        out = rb.sample()
        return tuple(out.batch_size)

    against_memory(storage, run)


def test_rb_add_tensorclass_element(storage):
    rb = ReplayBuffer(storage=storage(4), batch_size=2)
    rb.add(Transition(obs=torch.ones(3), reward=torch.zeros(1), batch_size=[]))
    rb.extend(Transition(obs=torch.zeros(2, 3), reward=torch.ones(2, 1), batch_size=[2]))
    assert isinstance(rb[0], Transition) and rb[:].obs.shape == (3, 3)


def test_stack_of_two_buffers(storage):
    rb = ReplayBuffer(storage=storage(4), batch_size=2)
    rb.extend(transitions(4))
    other = ReplayBuffer(storage=storage(4), batch_size=2)
    other.extend(transitions(4, 10))
    assert torch.stack([rb[:], other[:]]).batch_size == (2, 4)


def test_update_priority_with_store_free_sampler_is_a_no_op(storage):
    rb = TensorDictReplayBuffer(storage=storage(6), batch_size=2)
    rb.extend(transitions(4))
    rb.update_priority(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))  # RandomSampler ignores priorities
    assert len(rb) == 4


def test_extend_a_batch_longer_than_the_buffer(storage):
    def run(make: Any) -> Any:
        rb = ReplayBuffer(storage=make(4))
        idx = rb.extend(transitions(10))
        return idx.tolist(), rb[:]["reward"].flatten().tolist(), rb.write_count

    against_memory(storage, run)


def test_write_at_and_extend_returns_indices(storage):
    def run(make: Any) -> Any:
        rb = ReplayBuffer(storage=make(6), writer=RoundRobinWriter(track_generations=True))
        rb.extend(transitions(6))
        rb.writer.write_at(torch.tensor([1, 3]), transitions(2, 50))
        return rb[:]["reward"].flatten().tolist(), rb.writer.generations_of(torch.arange(6)).tolist(), len(rb)

    against_memory(storage, run)


@tensorclass
class WithText:
    tensor: torch.Tensor
    td: TensorDict
    text: str


def dump_data(kind: str) -> Any:
    if kind == "tensor":
        return torch.arange(3)
    if kind == "pytree":
        return {"a": torch.arange(3), "b": {"c": [torch.ones(3), (-torch.ones(3, 2),)]}, 30: -torch.ones(3, 1)}
    if kind == "tc":
        return WithText(tensor=torch.arange(3), td=TensorDict(x=torch.ones(3, 2), batch_size=[3]), text="some text", batch_size=[3])
    return TensorDict(a=torch.arange(3), b=TensorDict(c=torch.ones(3, 2), batch_size=[3]), batch_size=[3])


def flat(x: Any) -> list:
    from torch.utils._pytree import tree_flatten

    if is_tc(x):
        x = x.to_tensordict() if hasattr(x, "to_tensordict") else x
    if isinstance(x, TensorDict) or hasattr(x, "flatten_keys"):
        return sorted((str(k), v.tolist()) for k, v in x.flatten_keys(".").items() if isinstance(v, torch.Tensor))
    return [v.tolist() for v in tree_flatten(x)[0]]


def is_tc(x: Any) -> bool:
    from tensordict import is_tensorclass

    return is_tensorclass(x)


@pytest.mark.parametrize("kind", ["tensor", "td", "tc", "pytree"])
@pytest.mark.parametrize("isinit", [True, False])
def test_storage_set_range_and_dumps_loads(storage, kind, isinit, tmp_path):
    from torch.utils._pytree import tree_map

    data = dump_data(kind)
    s = storage(10)
    s.set(range(3), data)
    s.dumps(tmp_path / "save")
    s.dumps(tmp_path / "save")  # twice into one directory
    back = storage(10)
    if isinit:
        back.set(range(3), tree_map(lambda x: torch.zeros_like(x), data) if kind == "pytree" else data.clone().zero_())
    if kind in ("tensor", "pytree") and not isinit and not on_store(storage):
        with pytest.raises(RuntimeError, match="non-initialized"):
            back.loads(tmp_path / "save")
        return
    back.loads(tmp_path / "save")
    assert flat(back[:]) == flat(s[:])


def test_pytree_with_int_keys(storage):
    def run(make: Any) -> Any:
        rb = ReplayBuffer(storage=make(10), batch_size=2)
        rb.add({"a": torch.zeros(3), "b": {"c": (torch.zeros(2), [torch.ones(1)])}, 30: -torch.ones(())})
        rb.extend({"a": torch.ones(4, 3), "b": {"c": (torch.ones(4, 2), [torch.ones(4, 1)])}, 30: torch.arange(4.0)})
        out = rb[:]
        return len(rb), sorted(map(str, out)), out[30].tolist(), out["b"]["c"][1][0].flatten().tolist()

    against_memory(storage, run)


def test_non_tensor_data(storage):
    def run(make: Any) -> Any:
        rb = TensorDictReplayBuffer(storage=make(6), batch_size=3)
        rb.extend(TensorDict(obs=torch.arange(4.0), text=["a", "b", "c", "d"], batch_size=[4]))
        rb.set_rng(torch.Generator().manual_seed(0))
        out = rb.sample()
        return [o for o in out["text"]], out["obs"].tolist(), rb[:]["text"]

    against_memory(storage, run)


def test_storage_ensemble(storage):
    from torchrl.data.replay_buffers import ReplayBufferEnsemble

    def run(make: Any) -> Any:
        r1 = TensorDictReplayBuffer(storage=make(6), batch_size=4)
        r2 = TensorDictReplayBuffer(storage=make(6), batch_size=4)
        r1.extend(transitions(3))
        r2.extend(transitions(3, 10))
        ens = ReplayBufferEnsemble(r1, r2, batch_size=4, sample_from_all=True)
        out = ens.sample()
        return sorted(out["reward"].flatten().tolist()) and len(out["reward"])

    against_memory(storage, run)


def test_extend_lazy_stack_along_dim_1(storage):
    from tensordict import LazyStackedTensorDict

    rb = ReplayBuffer(storage=storage(6), batch_size=2)
    td1 = TensorDict(a=torch.rand(5, 4, 8), batch_size=5)
    td2 = TensorDict(a=torch.rand(5, 4, 8), batch_size=5)
    rb.extend(LazyStackedTensorDict(td1, td2, stack_dim=1))
    assert len(rb) == 5 and rb.sample(3).batch_size == (3, 2)


def test_staleness_aware_sampler(storage):
    from torchrl.data.replay_buffers.samplers import StalenessAwareSampler

    def run(make: Any) -> Any:
        sampler = StalenessAwareSampler(max_staleness=1)
        rb = TensorDictReplayBuffer(storage=make(10), sampler=sampler, batch_size=16)
        rb.extend(transitions(6).set("policy_version", torch.tensor([0, 0, 1, 1, 2, 2])))
        sampler.consumer_version = 2
        return sorted(set(rb.sample()["policy_version"].tolist()))

    against_memory(storage, run)


def test_child_process_extends_the_same_buffer(storage):
    import multiprocessing as mp

    if on_store(storage) and not isinstance(storage(1)._conn.get("url"), str):
        pytest.skip("fakeredis lives in this process")
    rb = TensorDictReplayBuffer(storage=storage(10), batch_size=3)
    rb.extend(transitions(2))
    proc = mp.get_context("fork").Process(target=rb.extend, args=(transitions(3, 10),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    if on_store(storage):  # the server's buffer: the child's rows are here
        assert len(rb) == 5 and rb[:]["reward"].flatten().tolist() == [0.0, 1.0, 10.0, 11.0, 12.0]


def test_forked_writers_share_torchrls_cursor(storage):
    """Forked processes extending one buffer with torchrl's shared cursor (taken under a lock): every row lands once."""
    import multiprocessing as mp

    if on_store(storage) and not isinstance(storage(1)._conn.get("url"), str):
        pytest.skip("fakeredis lives in this process")
    rb = ReplayBuffer(storage=storage(40))
    rb.extend(TensorDict(a=torch.zeros(1), batch_size=[1]))
    rb.writer._cursor, rb.writer._write_count  # noqa: B018  # (made before the fork: shared)
    if not on_store(storage):
        rb.storage._storage.share_memory_()
    else:
        rb.storage.wait_for_writers = 600  # (however slow the machine: a child waits for the others' slots)

    def work(k: int) -> None:
        for j in range(3):
            rb.extend(TensorDict(a=torch.full((4,), float(k * 10 + j)), batch_size=[4]))

    # torchrl's writer reads its shared cursor, then moves it, without a lock: two forks may take the same
    # slots (in memory too; it shows when extends take long enough to overlap). The forks serialize that
    # step here, as a user must; the rows are written outside the lock, so a fork may write slots ahead of
    # another's still in flight, which the storage orders on the server.
    lock = mp.get_context("fork").Lock()
    take_slots = rb.writer._storage._max_size_along_dim0
    original_set = rb.writer._storage.set

    def locked_extend(data: Any) -> Any:
        with lock:
            cursor = rb.writer._cursor
            rb.writer._cursor = (cursor + len(data)) % take_slots(batched_data=data)
            rb.writer._write_count += len(data)
        index = (torch.arange(cursor, cursor + len(data)) % take_slots(batched_data=data)).long()
        original_set(index, data)
        return index

    rb.writer.extend = locked_extend  # type: ignore[method-assign]
    procs = [mp.get_context("fork").Process(target=work, args=(k,)) for k in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    got = sorted(rb[:]["a"].tolist())
    assert got == [0.0] + sorted(float(k * 10 + j) for k in (1, 2, 3) for j in range(3) for _ in range(4))


@pytest.mark.parametrize("checkpointer", ["TensorStorageCheckpointer", "FlatStorageCheckpointer", "NestedStorageCheckpointer"])
def test_torchrls_checkpointers_round_trip_to_the_same_storage_and_to_memory(storage, checkpointer, tmp_path):
    """``rb.dumps``/``rb.loads`` with one of torchrl's checkpointers: the rows come back in a new buffer of the
    same kind and in a ``LazyTensorStorage`` (a store's dump is in torchrl's memmap layout)."""
    from torchrl.data.replay_buffers import checkpointers

    def buffer(s: Any) -> ReplayBuffer:
        s.checkpointer = getattr(checkpointers, checkpointer)()
        return ReplayBuffer(storage=s, batch_size=4)

    rb = buffer(storage(30))
    rb.extend(transitions(12))
    rb.dumps(tmp_path)
    for again in (buffer(storage(30)), buffer(LazyTensorStorage(30))):
        again.loads(tmp_path)
        assert len(again) == 12
        for key in ("obs", "reward", ("next", "obs")):
            assert torch.equal(again[:][key], rb[:][key])
