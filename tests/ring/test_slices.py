"""Trajectories on the server: the episode index every ring write keeps (``lua/_episodes.lua``) and
``sample_slices`` (``read.lua`` 'J'), checked against a model of the ring and torchrl's SliceSampler."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import round_trips, top_level_commands
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore


def rows(start: int, ids: list[int], done: list[bool] | None = None) -> TensorDict:
    """Rows whose ``step`` is their write number (so a slice's rows are consecutive writes)."""
    n = len(ids)
    td = TensorDict(
        step=torch.arange(start, start + n),
        obs=torch.randn(n, 3),
        episode=torch.tensor(ids, dtype=torch.int64),
        batch_size=[n],
    )
    if done is not None:
        td["done"] = torch.tensor(done).unsqueeze(-1)
    return td


def model_runs(history: list, count: int, by: str) -> list[tuple[int, int]]:
    """The trajectories the ring holds, as (first write number, length): runs of the window of write
    numbers max(0, rw - count) .. rw - 1, cut where the id changes (by id) or after an end flag."""
    rw = len(history)
    low = max(0, rw - count)
    out: list[tuple[int, int]] = []
    for w in range(low, rw):
        new = w == low or (history[w] != history[w - 1] if by == "id" else bool(history[w - 1]))
        if new:
            out.append((w, 1))
        else:
            out[-1] = (out[-1][0], out[-1][1] + 1)
    return out


def server_runs(store) -> list[tuple[int, int]]:
    engine = store._engine
    got = engine.client.zrange(engine.keys.episodes, 0, -1, withscores=True)
    return sorted((int(m), int(s)) for m, s in got)


def random_episodes(rng: random.Random, n: int, first_id: int, max_len: int = 9) -> tuple[list[int], list[bool], int]:
    ids, dones, ep = [], [], first_id
    left = rng.randint(1, max_len)
    for _ in range(n):
        ids.append(ep)
        left -= 1
        dones.append(left == 0)
        if left == 0:
            ep += 1
            left = rng.randint(1, max_len)
    return ids, dones, ep


@pytest.mark.parametrize("by", ["id", "end"])
def test_index_follows_overwrites_and_wrap(one_node, by):
    count = 37
    s = LazyStackedTensorDictStore(count=count, **one_node.kwargs())
    if by == "id":
        s.set_trajectories(traj_key="episode")
    else:
        s.set_trajectories(end_key="done")
    rng = random.Random(3)
    history: list = []
    ep = 0
    for _ in range(60):
        n = rng.choice([1, 2, 5, 11, count])
        ids, dones, _ = random_episodes(rng, n, ep)
        if rng.random() < 0.5:  # the last episode goes on in the next batch
            ids = [ep + i - ids[0] for i in ids]
        ep = ids[-1] + (1 if dones[-1] else 0)
        s.extend(rows(len(history), ids, dones))
        history += ids if by == "id" else dones
        assert server_runs(s) == model_runs(history, count, by), len(history)
    s.clear_redis()


def test_index_matches_torchrl_boundaries(one_node):
    """The trajectories the server keeps are those torchrl's SliceSampler finds in the same ring."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    count = 50
    s = LazyStackedTensorDictStore(count=count, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    sampler = SliceSampler(num_slices=2, traj_key="episode", strict_length=False)
    rb = ReplayBuffer(storage=LazyTensorStorage(count), sampler=sampler, batch_size=4)
    rng = random.Random(5)
    ep, w = 0, 0
    for _ in range(25):
        ids, _, ep = random_episodes(rng, rng.randint(1, 12), ep)
        td = rows(w, ids)
        w += len(ids)
        s.extend(td)
        rb.extend(td)
        start, _, lengths = sampler._get_stop_and_length(rb._storage)
        theirs = sorted((int(a), int(b)) for a, b in zip(start[:, 0], lengths))
        ours = sorted((m % count, n) for m, n in server_runs(s))
        assert ours == theirs
    s.clear_redis()


@pytest.mark.parametrize("by", ["id", "end"])
def test_slices_stay_inside_one_episode(one_node, by):
    count = 200
    s = LazyStackedTensorDictStore(count=count, **one_node.kwargs())
    s.set_trajectories(**({"traj_key": "episode"} if by == "id" else {"end_key": "done"}))
    rng = random.Random(7)
    ep, w = 0, 0
    for _ in range(30):  # the ring wraps: slices may cross its end
        ids, dones, ep = random_episodes(rng, 23, ep, max_len=15)
        s.extend(rows(w, ids, dones))
        w += 23
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        got = s.sample_slices(24, num_slices=6, generator=g)
        assert got.indices.numel() == 24
        step = got.td["step"].view(6, 4)
        episode = got.td["episode"].view(6, 4)
        assert (step.diff(dim=1) == 1).all()  # consecutive writes
        assert (episode == episode[:, :1]).all()  # one episode each
        assert (step % count == got.indices.view(6, 4)).all()
        assert got.info["truncated"].view(6, 4)[:, -1].all() and not got.info["truncated"].view(6, 4)[:, :-1].any()
        assert (got.info["traj_lengths"] >= 4).all()
        assert (got.generations > 0).all()
    by_len = s.sample_slices(20, slice_len=5)
    assert by_len.indices.numel() == 20 and (by_len.info["slice_lengths"] == 5).all()
    s.clear_redis()


def test_strict_length_and_short_episodes(one_node):
    s = LazyStackedTensorDictStore(count=40, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    ids = [0] * 3 + [1] * 5 + [2] * 2
    s.extend(rows(0, ids))
    with pytest.raises(ValueError, match="no trajectory of at least 6 rows"):
        s.sample_slices(12, num_slices=2)  # slices of 6: longer than every episode
    got = s.sample_slices(12, num_slices=2, strict_length=False)  # shorter slices of the episodes there are
    lens = got.info["slice_lengths"]
    assert got.indices.numel() == int(lens.sum()) and (lens <= 6).all()
    got = s.sample_slices(40, num_slices=10)  # slices of 4: only episode 1 is long enough
    assert (got.td["episode"] == 1).all()
    span = s.sample_slices(40, num_slices=10, span=True, generator=torch.Generator().manual_seed(1))
    assert (span.info["slice_lengths"] <= 4).all() and span.indices.numel() == int(span.info["slice_lengths"].sum())
    for k, n in enumerate(span.info["slice_lengths"].tolist()):
        part = span.td["episode"][int(span.info["slice_lengths"][:k].sum()) :][:n]
        assert (part == part[:1]).all()
    with pytest.raises(ValueError, match="divisible"):
        s.sample_slices(10, num_slices=3)
    with pytest.raises(TypeError, match="num_slices or slice_len"):
        s.sample_slices(12)
    s.clear_redis()


def test_missing_trajectory_key_is_refused_before_anything_is_written(one_node):
    s = LazyStackedTensorDictStore(count=20, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    s.extend(rows(0, [0, 0, 1]))
    rw = s.write_count
    with pytest.raises(KeyError, match="episode"):
        s.extend(TensorDict(step=torch.arange(2), obs=torch.zeros(2, 3), batch_size=[2]))
    with pytest.raises(TypeError, match="int64|integers"):
        s.extend(TensorDict(step=torch.arange(2), obs=torch.zeros(2, 3), episode=torch.zeros(2), batch_size=[2]))
    assert s.write_count == rw and server_runs(s) == [(0, 2), (2, 1)]
    with pytest.raises(KeyError, match="no key 'nope'"):
        s.set_trajectories(traj_key="nope")
    with pytest.raises(ValueError, match="not both"):
        s.set_trajectories(traj_key="episode", end_key="done")
    plain = LazyStackedTensorDictStore(count=20, **one_node.kwargs())
    plain.extend(rows(0, [0, 0, 1]))
    with pytest.raises(ValueError, match="set_trajectories"):
        plain.sample_slices(4, num_slices=2)
    s.clear_redis()
    plain.clear_redis()


def test_set_on_a_ring_with_rows_builds_the_index_and_other_handles_follow(one_node):
    count = 30
    s = LazyStackedTensorDictStore(count=count, **one_node.kwargs())
    rng = random.Random(11)
    history: list[int] = []
    ep = 0
    for _ in range(5):  # wraps once before the setting
        ids, _, ep = random_episodes(rng, 9, ep)
        s.extend(rows(len(history), ids))
        history += ids
    other = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    assert server_runs(s) == model_runs(history, count, "id")
    ids = [ep] * 4  # a handle that never heard of the setting: answered STALE, it writes the ids
    other.extend(rows(len(history), ids))
    history += ids
    assert server_runs(s) == model_runs(history, count, "id")
    assert other.trajectories is not None and other.trajectories.key == ("episode",)
    s.set_trajectories()  # forgotten
    assert server_runs(s) == [] and s.trajectories is None
    other.extend(rows(len(history), [1, 2]))  # writes go on without ids
    s.clear_redis()


def test_dense_store_samples_slices(one_node):
    s = TensorDictStore(batch_size=[64], **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    ids, _, _ = random_episodes(random.Random(2), 60, 0, max_len=12)
    s.extend(rows(0, ids))
    got = s.sample_slices(8, num_slices=4)
    assert isinstance(got.td, TensorDict) and got.td.batch_size == torch.Size([8])
    ep = got.td["episode"].view(4, 2)
    assert (ep == ep[:, :1]).all()
    s.clear_redis()


def test_one_round_trip_each(real):
    s = LazyStackedTensorDictStore(count=1000, **real.kwargs())
    s.set_trajectories(traj_key="episode")
    ids, _, _ = random_episodes(random.Random(4), 500, 0, max_len=40)
    s.extend(rows(0, ids))
    s.sample_slices(32, num_slices=4)  # the script loaded
    sample = round_trips(top_level_commands(real.client, lambda: s.sample_slices(64, num_slices=8)))
    assert sample == ["evalsha"]
    write = round_trips(top_level_commands(real.client, lambda: s.extend(rows(500, [7] * 50))))
    assert write == ["evalsha"]
    s.clear_redis()


def test_torchrl_slice_sampler_samples_on_the_server(real):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    from tdstore.torchrl import StoreSliceSampler, replay_buffer

    sampler = SliceSampler(num_slices=8, traj_key="episode")
    rb = replay_buffer(300, **real.kwargs(), sampler=sampler, batch_size=64)
    assert rb.sampler is sampler and isinstance(sampler, StoreSliceSampler)
    mem = TensorDictReplayBuffer(storage=LazyTensorStorage(300), sampler=SliceSampler(num_slices=8, traj_key="episode"), batch_size=64)
    rng = random.Random(9)
    ep, w = 0, 0
    for _ in range(40):  # wraps
        ids, dones, ep = random_episodes(rng, 17, ep, max_len=30)
        td = rows(w, ids, dones)
        td["next", "done"] = td["done"]
        td["next", "terminated"] = td["done"]
        del td["done"]
        rb.extend(td)
        mem.extend(td)
        w += 17
    rb.sample()  # the script loaded
    ours = []
    trips = round_trips(top_level_commands(real.client, lambda: ours.append(rb.sample())))
    assert trips == ["evalsha"]
    theirs = mem.sample()
    for got in (ours[0], theirs):
        assert got.batch_size == torch.Size([64])
        ep_ = got["episode"].view(8, 8)
        assert (ep_ == ep_[:, :1]).all() and (got["step"].view(8, 8).diff(dim=1) == 1).all()
        trunc = got["next", "truncated"].view(8, 8)
        assert trunc[:, -1].all() and not trunc[:, :-1].any()
        done = got["next", "done"].view(8, 8)
        assert done[:, -1].all()
        assert set(got.keys(True, True)) >= {("next", "truncated"), ("next", "done"), ("next", "terminated"), "index"}
    assert set(ours[0].keys(True, True)) == set(theirs.keys(True, True))
    strict = replay_buffer(300, **real.kwargs(), sampler=SliceSampler(slice_len=40, traj_key="episode"), batch_size=80)
    strict.extend(rows(0, [0] * 10 + [1] * 10))
    with pytest.raises(RuntimeError, match="no trajectory"):
        strict.sample()
    strict.storage.delete()
    rb.storage.delete()


def test_a_build_too_large_for_one_call_is_refused(one_node, monkeypatch):
    from tdstore._ring import slices

    monkeypatch.setattr(slices, "MAX_BUILD_RUNS", 3)
    s = LazyStackedTensorDictStore(count=20, **one_node.kwargs())
    s.extend(rows(0, [0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="5 trajectories"):
        s.set_trajectories(traj_key="episode")
    assert s.trajectories is None
    s.clear_redis()


@pytest.mark.parametrize("data_key", ["episode", "done-only"])
def test_torchrl_slice_sampler_picks_its_key_as_torchrl_does(real, data_key):
    from torchrl.data.replay_buffers.samplers import SliceSampler

    from tdstore.torchrl import replay_buffer

    rb = replay_buffer(100, **real.kwargs(), sampler=SliceSampler(num_slices=4), batch_size=16)
    ids = [0] * 7 + [1] * 9 + [2] * 6 + [3] * 8
    td = rows(0, ids)
    td["next", "done"] = torch.tensor([ids[i] != ids[i + 1] if i + 1 < len(ids) else True for i in range(len(ids))]).unsqueeze(-1)
    if data_key == "done-only":
        del td["episode"]
    rb.extend(td)
    got = rb.sample()
    step = got["step"].view(4, 4)
    episode = torch.tensor(ids)[step]
    assert (episode == episode[:, :1]).all() and (step.diff(dim=1) == 1).all()
    want = ("episode",) if data_key == "episode" else ("next", "done")
    assert rb.storage.with_store(lambda s: s.trajectories.key) == want
    rb.storage.delete()


def test_torchrl_slice_sampler_without_replacement_gives_each_trajectory_once_per_pass(one_node):
    from torchrl.data.replay_buffers.samplers import SliceSamplerWithoutReplacement

    from tdstore.torchrl import StoreSliceSamplerWithoutReplacement, replay_buffer

    sampler = SliceSamplerWithoutReplacement(num_slices=4, traj_key="episode")
    rb = replay_buffer(200, **one_node.kwargs(), sampler=sampler, batch_size=16)
    assert isinstance(sampler, StoreSliceSamplerWithoutReplacement)
    rb.extend(rows(0, [e for e in range(10) for _ in range(10)]))
    seen: list[int] = []
    for _ in range(3):  # 4 + 4 + 2 slices: every episode once, the last batch short
        got = rb.sample()
        ep = got["episode"].view(-1, 4)
        assert (ep == ep[:, :1]).all()
        seen += ep[:, 0].tolist()
    assert sorted(seen) == list(range(10))
    rb.extend(rows(100, [10] * 10))  # a new episode: the next pass is of 11
    seen = []
    for _ in range(3):
        seen += rb.sample()["episode"].view(-1, 4)[:, 0].tolist()
    assert sorted(seen) == list(range(11))
    rb.storage.delete()


@pytest.mark.parametrize("strict", [True, False])
def test_slice_starts_follow_torchrls_distribution(one_node, strict):
    """torchrl's draw: a trajectory uniformly among those long enough (all of them when not strict), then a
    start uniformly where the slice fits (a short trajectory whole). Chi-square over every (trajectory, start)."""
    from test_replay import chi2_critical, chi_square

    s = LazyStackedTensorDictStore(count=64, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    lengths = [3, 5, 10, 20]
    ids = [e for e, n in enumerate(lengths) for _ in range(n)]
    s.extend(rows(0, ids))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
    seq = 4
    eligible = [e for e, n in enumerate(lengths) if n >= seq or not strict]
    cells = [(e, o) for e in eligible for o in range(max(1, lengths[e] - seq + 1))]
    expected = torch.tensor([1 / len(eligible) / max(1, lengths[e] - seq + 1) for e, _ in cells])
    counts = torch.zeros(len(cells))
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        got = s.sample_slices(100 * seq, num_slices=100, strict_length=strict, generator=g)
        for t, o, n in zip(got.info["traj_starts"].tolist(), got.info["offsets"].tolist(), got.info["slice_lengths"].tolist()):
            e = int((starts == t).nonzero())
            assert n == min(seq, lengths[e])
            counts[cells.index((e, o))] += 1
    assert chi_square(counts, expected) < chi2_critical(len(cells) - 1)
    s.clear_redis()


def test_a_resent_extend_moves_the_index_once(one_node):
    s = LazyStackedTensorDictStore(count=30, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    s.extend(rows(0, [0, 0, 1]))
    rid = "ab" * 16
    first = s.extend(rows(3, [1, 1, 2]), request_id=rid)
    again = s.extend(rows(3, [1, 1, 2]), request_id=rid)  # a resend: answered from the record, nothing written
    assert torch.equal(first.indices, again.indices) and s.write_count == 6
    assert server_runs(s) == [(0, 2), (2, 3), (5, 1)]
    s.clear_redis()


@pytest.mark.parametrize("by", ["id", "end"])
def test_a_write_after_a_build_continues_the_newest_trajectory(one_node, by):
    s = LazyStackedTensorDictStore(count=20, **one_node.kwargs())
    s.extend(rows(0, [-5, -5, 7, 7, 7], [False, True, False, False, False]))
    s.set_trajectories(**({"traj_key": "episode"} if by == "id" else {"end_key": "done"}))
    assert server_runs(s) == [(0, 2), (2, 3)]
    s.extend(rows(5, [7, 7, 8], [False, True, False]))  # episode 7 goes on (id 7 again; no end flag yet)
    assert server_runs(s) == [(0, 2), (2, 5), (7, 1)]
    s.clear_redis()


def test_a_lost_index_is_noticed_refused_and_built_again(one_node):
    from tdstore import StoreDamagedError

    s = LazyStackedTensorDictStore(count=20, **one_node.kwargs())
    s.set_trajectories(traj_key="episode")
    s.extend(rows(0, [0] * 6 + [1] * 6))
    s._engine.client.delete(s._engine.keys.episodes)  # evicted, or deleted by hand
    s.extend(rows(12, [1, 1]))  # the write goes through; the index is marked broken
    with pytest.raises(StoreDamagedError, match="set_trajectories builds it again"):
        s.sample_slices(4, num_slices=2)
    s.set_trajectories(traj_key="episode")
    assert server_runs(s) == [(0, 6), (6, 8)]
    assert s.sample_slices(4, num_slices=2).indices.numel() == 4
    s.clear_redis()


def test_index_by_end_flags_matches_torchrl_boundaries(one_node):
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    count = 50
    s = LazyStackedTensorDictStore(count=count, **one_node.kwargs())
    s.set_trajectories(end_key="done")
    sampler = SliceSampler(num_slices=2, end_key="done", strict_length=False)
    rb = ReplayBuffer(storage=LazyTensorStorage(count), sampler=sampler, batch_size=4)
    rng = random.Random(6)
    ep, w = 0, 0
    for _ in range(25):
        ids, dones, ep = random_episodes(rng, rng.randint(1, 12), ep)
        td = rows(w, ids, dones)
        w += len(ids)
        s.extend(td)
        rb.extend(td)
        start, _, lengths = sampler._get_stop_and_length(rb._storage)
        theirs = sorted((int(a), int(b)) for a, b in zip(start[:, 0], lengths))
        ours = sorted((m % count, n) for m, n in server_runs(s))
        assert ours == theirs, w
    s.clear_redis()
