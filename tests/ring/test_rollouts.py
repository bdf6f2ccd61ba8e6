"""Rollouts on a ring (``_ring.rollouts``, ``lua/_rollouts.lua``): policy versions with bounded staleness,
groups that appear whole (written from several processes), token budgets; one round trip each."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch
from helpers import round_trips, top_level_commands
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._shards import rollout_refusal as shard_rollouts

pytestmark = pytest.mark.ring


def rows(n: int, tag0: int = 0, lens: list[int] | None = None, group: int = -1) -> list[TensorDict]:
    """``n`` rollouts: ragged tokens (length ``lens[i]``), a tag, the group they belong to."""
    lens = lens or [3] * n
    return [
        TensorDict({"tokens": torch.arange(lens[i]) + 100 * (tag0 + i), "tag": torch.tensor(tag0 + i), "gid": torch.tensor(group)}, [])
        for i in range(n)
    ]


def store_of(one_node, count: int = 32) -> LazyStackedTensorDictStore:
    return LazyStackedTensorDictStore(count=count, **one_node.kwargs())


def test_versions_stamp_rows_and_set_version_refuses_going_back(one_node):
    s = store_of(one_node)
    s.extend(rows(2), version=0)
    assert s.policy_version == 0
    assert s.set_version(3) == 0 and s.policy_version == 3
    s.extend(rows(2, 2), version=3)
    s.extend(rows(1, 4))  # no version: the published one
    got = s.sample(64)
    by_tag = dict(zip(got.td["tag"].tolist(), got.versions.tolist()))
    assert {t: v for t, v in by_tag.items()} == {t: (0 if t < 2 else 3) for t in by_tag}
    with pytest.raises(ValueError, match="behind the published version 3"):
        s.set_version(2)
    assert s.policy_version == 3
    assert s.set_version(2, allow_backwards=True) == 3 and s.policy_version == 2
    with pytest.raises(ValueError, match="version"):
        s.set_version(-1)


def test_sample_with_max_staleness_draws_only_fresh_rows(one_node):
    s = store_of(one_node)
    s.set_version(0)
    for v in range(5):
        s.extend(rows(3, 10 * v), version=v)
    s.set_version(4)
    got = s.sample(200, max_staleness=1, generator=torch.Generator().manual_seed(0))
    assert set(got.versions.tolist()) == {3, 4}
    assert set(got.td["tag"].tolist()) == {30, 31, 32, 40, 41, 42}  # every fresh row drawn, uniformly
    assert set(s.sample(200, max_staleness=4).versions.tolist()) == {0, 1, 2, 3, 4}
    s.set_version(10)
    with pytest.raises(ValueError, match="version >= 9"):
        s.sample(4, max_staleness=1)
    with pytest.raises(TimeoutError):
        s.sample(4, max_staleness=1, timeout=0.3)
    s.extend(rows(1, 99), version=10)
    assert s.sample(5, max_staleness=1).td["tag"].tolist() == [99] * 5


def test_pop_with_max_staleness_skips_and_counts_old_rows(one_node):
    s = store_of(one_node)
    s.set_version(0)
    s.extend(rows(3, 0), version=0)
    s.extend(rows(2, 3), version=2)
    s.extend(rows(2, 5), version=1)
    s.set_version(2)
    got = s.pop(10, max_staleness=0)
    assert got.td["tag"].tolist() == [3, 4] and got.versions.tolist() == [2, 2]
    assert got.stale == 5 and got.lost == 0  # the three of version 0 and the two of version 1, dropped
    assert s.stats()["stale"] == 5
    s.extend(rows(1, 7), version=2)
    got = s.pop(10, max_staleness=0)
    assert got.td["tag"].tolist() == [7] and got.stale == 0
    with pytest.raises(TimeoutError):
        s.pop(1, max_staleness=0, timeout=0.2)


def test_a_group_stays_invisible_until_whole_then_pops_and_samples_whole(one_node):
    s = store_of(one_node)
    s.extend(rows(1, 0))  # an ungrouped row
    s.extend(rows(2, 10, group=1), group="g1", group_size=4, version=0)
    assert set(s.sample(64).td["tag"].tolist()) == {0}  # the group's rows are not drawn yet
    got = s.pop(8)
    assert got.td["tag"].tolist() == [0]
    with pytest.raises(TimeoutError):
        s.pop(8, timeout=0.2)
    s.extend(rows(1, 12, group=1), group="g1", group_size=4)
    s.extend(rows(1, 20, group=2), group="g2", group_size=2)
    s.extend(rows(1, 13, group=1), group="g1", group_size=4)  # g1 whole now: after g2's first row, before g2
    assert s.stats()["rollouts"] == {"version": 0, "queued_items": 1, "whole_groups": 1}  # g1 (g2 is half written)
    one = s.sample(1, groups=3)
    assert one.group_sizes.tolist() == [4] * 3 and sorted(one.td["tag"].tolist()) == sorted([10, 11, 12, 13] * 3)
    got = s.pop(groups=5)
    assert got.group_sizes.tolist() == [4] and got.td["tag"].tolist() == [10, 11, 12, 13]
    s.extend(rows(1, 21, group=2), group="g2", group_size=2)
    with pytest.raises(ValueError, match="the next group holds 2 rows"):
        s.pop(1)  # never part of a group
    got = s.pop(2)
    assert got.td["tag"].tolist() == [20, 21] and got.group_sizes.tolist() == [2]


def test_token_budget_pops_rows_and_groups_in_order(one_node):
    s = store_of(one_node)
    s.extend(rows(3, 0, [2, 3, 4]))
    s.extend(rows(2, 3, [1, 1], group=7), group=7, group_size=2)
    s.extend(rows(1, 5, [5]))
    got = s.pop(token_budget=5, length_key="tokens")
    assert got.td["tag"].tolist() == [0, 1]  # 2 + 3; the next row (4) would pass the budget
    with pytest.raises(ValueError, match="token budget of 3 is smaller than the next row"):
        s.pop(token_budget=3, length_key="tokens")
    got = s.pop(token_budget=6, length_key="tokens")  # 4, then the whole group (1 + 1)
    assert got.td["tag"].tolist() == [2, 3, 4] and got.group_sizes.tolist() == [1, 2]
    with pytest.raises(ValueError, match="length_key"):
        s.pop(token_budget=6)
    with pytest.raises(KeyError):
        s.pop(token_budget=6, length_key="nope")
    got = s.pop(token_budget=100, length_key="tokens")
    assert got.td["tag"].tolist() == [5]


def test_bad_input_raises_before_anything_is_written(one_node):
    s = store_of(one_node)
    s.extend(rows(2, 0, group=1), group="a", group_size=3)
    before = s.write_count
    with pytest.raises(ValueError, match="has 3 rows, this write says group_size=4"):
        s.extend(rows(1, 5), group="a", group_size=4)
    with pytest.raises(ValueError, match="would overflow"):
        s.extend(rows(2, 5), group="a", group_size=3)
    with pytest.raises(ValueError, match="more than its group_size"):
        s.extend(rows(3, 5), group="b", group_size=2)
    with pytest.raises(ValueError, match="no whitespace"):
        s.extend(rows(1, 5), group="a b", group_size=2)
    with pytest.raises(ValueError, match="both group="):
        s.extend(rows(1, 5), group="c")
    with pytest.raises(ValueError, match="version must be"):
        s.extend(rows(1, 5), version=-1)
    with pytest.raises(ValueError, match="give version="):
        s.extend(rows(1, 5), max_ahead=1)
    with pytest.raises(ValueError, match="cannot fit"):
        s.extend(rows(1, 5), group="d", group_size=1000)
    assert s.write_count == before
    s.extend(rows(1, 9, group=1), group="a", group_size=3)
    with pytest.raises(ValueError, match="whole already"):
        s.extend(rows(1, 5), group="a", group_size=3)
    assert s.pop(3).td["tag"].tolist() == [0, 1, 9]


def test_writers_too_far_ahead_wait_for_set_version(one_node):
    s = store_of(one_node)
    s.set_version(0)
    with pytest.raises(TimeoutError):
        s.extend(rows(1), version=3, max_ahead=1, timeout=0.3)
    assert s.write_count == 0
    done: list = []
    writer = threading.Thread(target=lambda: done.append(s.extend(rows(1, 1), version=3, max_ahead=1, timeout=60)))
    writer.start()
    held = s.stats()["held_writes"]
    while s.stats()["held_writes"] == held:  # the writer got its WAIT (the timed-out call above counted one)
        writer.join(0.01)
    s.set_version(2)
    writer.join(60)
    assert done and s.write_count == 1 and s.sample(2).versions.tolist() == [3, 3]


def test_overwritten_rows_break_their_group_and_are_counted_lost(one_node):
    s = store_of(one_node, count=4)
    s.extend(rows(2, 0, group=1), group="g", group_size=3)
    s.extend(rows(1, 2))
    s.extend(rows(2, 3))  # laps slot 0: g loses a row, it never completes
    got = s.pop(10)
    assert got.td["tag"].tolist() == [2, 3, 4]
    s.extend(rows(1, 5, group=1), group="g", group_size=3)  # a new group of that id: the old one is gone
    s.extend(rows(3, 6))
    got = s.pop(10)
    assert got.lost == 0 and got.td["tag"].tolist() == [6, 7, 8]
    s.extend(rows(4, 20))
    s.extend(rows(1, 30))  # row 20 overwritten before anyone popped it: its queue entry goes (lost)
    got = s.pop(10)
    assert got.td["tag"].tolist() == [21, 22, 23, 30] and s.stats()["lost"] == 1
    s.extend(rows(1, 40, group=2), group="h", group_size=2)
    s.extend(rows(3, 41))  # laps the group's first row before it is whole
    s.extend(rows(1, 44, group=2), group="h", group_size=2)  # a new group "h": one row of two
    got = s.pop(10)
    assert got.td["tag"].tolist() == [41, 42, 43]


def test_a_resent_pop_gets_the_same_items(one_node):
    s = store_of(one_node)
    s.extend(rows(4, 0), version=0)
    rid = "ab" * 16
    first = s.pop(2, request_id=rid)
    again = s.pop(2, request_id=rid)
    assert first.td["tag"].tolist() == again.td["tag"].tolist() == [0, 1]
    assert s.pop(5).td["tag"].tolist() == [2, 3]


def test_dense_ring_takes_the_same_arguments(one_node):
    s = TensorDictStore(batch_size=[8], **one_node.kwargs())
    td = TensorDict({"x": torch.arange(3.0), "tag": torch.arange(3)}, [3])
    s.extend(td[:2], group="g", group_size=3, version=1)
    s.set_version(1)
    with pytest.raises(ValueError, match="no visible row"):
        s.sample(2)
    s.extend(td[2:], group="g", group_size=3, version=1)
    got = s.pop(groups=1, max_staleness=0)
    assert isinstance(got.td, TensorDict) and got.td["tag"].tolist() == [0, 1, 2] and s.policy_version == 1


def test_sharded_rings_refuse_rollouts_naming_why():
    with pytest.raises(NotImplementedError, match="sharded ring"):
        shard_rollouts.refuse("extend", version=1, group=None)
    shard_rollouts.refuse("extend", version=None)  # nothing given: nothing refused
    with pytest.raises(NotImplementedError, match="sharded ring"):
        shard_rollouts.ShardRollouts().set_version(1)


def test_each_call_is_one_round_trip(one_node):
    if one_node.server is None:
        pytest.skip("MONITOR counts commands on a real server")
    s = store_of(one_node)
    s.set_version(0)  # the index on (and the header learned)
    s.extend(rows(3, 0), version=0)
    s.sample(1), s.pop(1)  # every script loaded on this server (a first call loads it: NOSCRIPT, SCRIPT LOAD)
    client = one_node.client
    for call in (
        lambda: s.extend(rows(2, 2, group=1), version=0, group="g", group_size=2),
        lambda: s.set_version(1),
        lambda: s.sample(4, max_staleness=1),
        lambda: s.sample(1, groups=1),
        lambda: s.pop(2, max_staleness=1),
        lambda: s.pop(groups=1),
    ):
        got = round_trips(top_level_commands(client, call))
        assert got == ["evalsha"], got
    s.extend(rows(2, 5, [2, 2]))
    assert round_trips(top_level_commands(client, lambda: s.pop(token_budget=4, length_key="tokens"))) == ["evalsha"]


# -- groups written from several processes --------------------------------------------------------

WRITERS, GROUPS, SIZE = 3, 12, 6


def _writer(url: str, prefix: str, td_id: str, w: int, start, out) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    start.wait(60)
    for g in range(GROUPS):  # each writer gives every group SIZE / WRITERS rows, one call per row
        for r in range(SIZE // WRITERS):
            tag = 1000 * g + 10 * w + r
            store.extend(rows(1, tag, [1 + tag % 5], group=g), group=f"q{g}", group_size=SIZE, version=g, timeout=60)
    out.put(w)


def test_groups_written_by_several_processes_pop_whole(redis_server):
    prefix = "rollouts-mp"
    s = LazyStackedTensorDictStore(count=512, url=redis_server.url, prefix=prefix)
    s.set_version(0)
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(redis_server.url, prefix, s.td_id, w, start, out)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    start.set()
    seen: dict[int, list[int]] = {}
    while len(seen) < GROUPS:
        got = s.pop(groups=2, timeout=60)
        assert int(got.group_sizes.sum()) == got.td.batch_size[0]
        k = 0
        for size in got.group_sizes.tolist():
            assert size == SIZE  # never part of a group
            gids = got.td["gid"][k : k + size].tolist()
            assert len(set(gids)) == 1 and gids[0] not in seen
            seen[gids[0]] = sorted(got.td["tag"][k : k + size].tolist())
            k += size
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(seen) == list(range(GROUPS))
    for g, tags in seen.items():
        assert tags == sorted(1000 * g + 10 * w + r for w in range(WRITERS) for r in range(SIZE // WRITERS))
    assert s.stats()["popped"] == GROUPS * SIZE


# -- torchrl's MCAdvantage on whole groups, written by several processes (no manager) -------------

PROMPTS, GRPO = 6, 4


def _trajectory(p: int, c: int) -> TensorDict:
    """Completion ``c`` of prompt ``p``: a one-step trajectory (batch ``[1]``), as MCAdvantage takes them."""
    reward = float((p * 7 + c * 3) % 5)
    return TensorDict(
        {
            "prompt_id": torch.tensor([p]),
            "c": torch.tensor([c]),
            ("next", "reward"): torch.tensor([[reward]]),
            ("next", "done"): torch.tensor([[True]]),
        },
        [1],
    )


def _rollout_writer(url: str, prefix: str, td_id: str, w: int, start, out) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    start.wait(60)
    for p in range(PROMPTS):  # writer w makes completions c = w, w + WRITERS, ... of every prompt
        for c in range(w, GRPO, WRITERS):
            store.extend([_trajectory(p, c)[0]], group=f"prompt-{p}", group_size=GRPO, version=1, timeout=60)
    out.put(w)


def _advantages(batches) -> dict[tuple[int, int], float]:
    """MCAdvantage in this process (local queues) fed the trajectories in ``batches``: advantage by (prompt, completion)."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm import MCAdvantage

    rb = ReplayBuffer(storage=LazyStackStorage(PROMPTS * GRPO), transform=MCAdvantage(grpo_size=GRPO, prompt_key="prompt_id"))
    for traj in batches:
        rb.extend(traj)
    got = rb[:]
    return {
        (int(p), int(c)): float(a)
        for p, c, a in zip(got["prompt_id"].flatten(), got["c"].flatten(), got["advantage"].flatten(), strict=True)
    }


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_mcadvantage_on_whole_groups_from_several_writers_matches_in_memory(redis_server):
    pytest.importorskip("torchrl.objectives.llm")
    prefix = "rollouts-mc"
    s = LazyStackedTensorDictStore(count=256, url=redis_server.url, prefix=prefix)
    s.set_version(1)
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rollout_writer, args=(redis_server.url, prefix, s.td_id, w, start, out)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    start.set()
    popped = []
    while sum(int(g.group_sizes.numel()) for g in popped) < PROMPTS:
        popped.append(s.pop(groups=2, max_staleness=0, timeout=60))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    # each whole group, row by row, into MCAdvantage in this one process: its local queue completes every group
    rows_in_order = [got.td[k].unsqueeze(0) for got in popped for k in range(got.td.batch_size[0])]
    on_store = _advantages(rows_in_order)
    in_memory = _advantages([_trajectory(p, c) for c in range(GRPO) for p in range(PROMPTS)])
    assert sorted(on_store) == sorted(in_memory) == [(p, c) for p in range(PROMPTS) for c in range(GRPO)]
    for key, adv in in_memory.items():
        assert on_store[key] == pytest.approx(adv, abs=1e-6)


def test_a_resent_grouped_write_joins_its_group_once(one_node):
    s = store_of(one_node)
    rid = "cd" * 16
    first = s.extend(rows(1, 0, group=1), group="g", group_size=2, request_id=rid)
    again = s.extend(rows(1, 0, group=1), group="g", group_size=2, request_id=rid)  # a resend: the first reply
    assert first.indices.tolist() == again.indices.tolist() and s.write_count == 1
    with pytest.raises(TimeoutError):
        s.pop(groups=1, timeout=0.2)  # one row of two: still invisible
    s.extend(rows(1, 1, group=1), group="g", group_size=2)
    assert s.pop(groups=1).td["tag"].tolist() == [0, 1]


def test_handles_opened_before_the_index_turned_on_follow_it(one_node):
    s = store_of(one_node)
    old = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **one_node.kwargs())
    old.extend(rows(1, 0))  # before: plain
    s.extend(rows(1, 1, group=1), group="g", group_size=2, version=0)  # turns the index on
    old.extend(rows(1, 2))  # its cached header predates the index: STALE, then stamped like any write
    assert set(old.sample(64).td["tag"].tolist()) == {0, 2}  # the half group stays hidden from it too
    assert old.pop(5).td["tag"].tolist() == [0, 2]
    s.extend(rows(1, 3, group=1), group="g", group_size=2)
    assert old.pop(5).td["tag"].tolist() == [1, 3]


def test_the_index_goes_with_the_store(one_node):
    s = store_of(one_node)
    s.extend(rows(2, 0, group=1), group="g", group_size=3, version=0)
    s.extend(rows(1, 2, group=2), group="h", group_size=1)  # whole
    client = one_node.client()
    assert all(client.exists(k) for k in s._engine.keys.rollout_keys)
    s.expire(60)
    assert all(0 < client.pttl(k) <= 60_000 for k in s._engine.keys.rollout_keys)
    s.clear_redis()
    assert not any(client.exists(k) for k in s._engine.keys.rollout_keys)
    assert not list(client.scan_iter(f"{one_node.prefix}:*"))


def test_an_index_edited_by_hand_is_reported_damaged_not_misread(one_node):
    from tdstore import StoreDamagedError

    s = store_of(one_node)
    s.extend(rows(2), version=0)
    client = one_node.client()
    z, _, _, _, q = s._engine.keys.rollout_keys
    client.zadd(z, {"abc": 0})
    with pytest.raises(StoreDamagedError, match="not a written slot"):
        s.sample(64)
    client.zrem(z, "abc")
    client.rpush(q, "0 99,0")  # a ring write not made yet
    client.lpush(q, "garbage")
    with pytest.raises(StoreDamagedError):
        s.pop(1)


def test_rollouts_and_trajectories_refuse_each_other(one_node):
    s = store_of(one_node)
    s.extend([TensorDict({"obs": torch.tensor(float(k)), "traj": torch.tensor(0)}, []) for k in range(4)])
    s.set_trajectories(traj_key="traj")
    with pytest.raises(NotImplementedError, match="trajectories"):
        s.set_version(1)
    t = store_of(one_node)
    t.extend(rows(2), version=0)
    with pytest.raises(NotImplementedError, match="rollouts"):
        t.set_trajectories(traj_key="tag")
