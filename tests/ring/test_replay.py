"""Server-side priorities, rate limiters and queues, on every engine.

Sampled frequencies are checked against the priorities with a chi-square statistic on a
seeded generator (the same draws every run, so nothing here is flaky): the bound is the
0.1 % critical value, and each test also checks that a wrong tree (uniform, or the
priorities without alpha) would fail it. Waiting is tested by order of events, never by
a timer racing a call: a call that must wait is tried with ``timeout=0`` (it raises at
once), and a blocked call is released by the write it waits for. Tests taking ``ring`` run on a
lazy store and on a dense ``TensorDictStore`` (whose ring is the lazy store's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import chi2_critical, chi_square, top_level_commands
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, QueueOverrunError, StoreDamagedError, TensorDictStore

pytestmark = [pytest.mark.ring, pytest.mark.usefixtures("replies_are_never_cut_short")]


def rows(lo: int, n: int, het: bool = False) -> TensorDict:
    """n elements tagged lo .. lo + n - 1 (obs = tag), optionally with varying-length tokens."""
    tags = torch.arange(lo, lo + n)
    td = TensorDict({"obs": tags.to(torch.float32).unsqueeze(-1).expand(n, 3).clone(), "tag": tags.clone()}, [n])
    if not het:
        return td
    from tensordict import lazy_stack

    return lazy_stack(
        [TensorDict({"obs": td["obs"][k], "tag": td["tag"][k], "tokens": torch.arange(1 + int(t) % 4)}, []) for k, t in enumerate(tags)]
    )


@pytest.fixture(params=["lazy", "dense"])
def ring(request: pytest.FixtureRequest, backend) -> Callable[[int], Any]:
    """Makes a ring of ``count`` slots on ``backend``: a lazy store, or a dense one (whose ring is the lazy store's)."""

    def make(count: int) -> Any:
        if request.param == "dense":
            return TensorDictStore(batch_size=[count], **backend.kwargs())
        return LazyStackedTensorDictStore(count=count, **backend.kwargs())

    return make


def draw_counts(store: Any, cap: int, total: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(cap, dtype=torch.float64)
    for _ in range(total // 1000):
        s = store.sample(1000, gen)
        assert torch.equal(s.td["tag"], s.indices)  # every row is the slot it says
        counts += torch.bincount(s.indices, minlength=cap).double()
    return counts


@pytest.mark.parametrize("cap", [1, 7, 300])
def test_sampled_frequencies_follow_the_priorities(ring, cap):
    store = ring(cap)
    store.enable_priorities(alpha=0.7)
    prios = (torch.arange(cap, dtype=torch.float64) % 13) * 0.5  # zeros among them: never drawn
    prios[0] = 2.0
    store.extend(rows(0, cap), priority=prios)
    weights = torch.where(prios > 0, prios**0.7, torch.zeros_like(prios))
    p = weights / weights.sum()
    counts = draw_counts(store, cap, 30_000)
    if cap == 1:
        assert counts.tolist() == [30_000.0]
        return
    df = int((p > 0).sum()) - 1
    assert chi_square(counts, p) < chi2_critical(df)
    # the same counts are far from what a wrong tree would give
    uniform = (prios > 0).double() / (prios > 0).sum()
    assert chi_square(counts, uniform) > 10 * chi2_critical(df)
    no_alpha = prios / prios.sum()
    assert chi_square(counts, no_alpha) > chi2_critical(df)


def test_probabilities_and_importance_weights(ring):
    store = ring(40)
    store.extend(rows(0, 20))
    store.enable_priorities(alpha=0.5)  # the 20 slots written so far get priority 1
    store.extend(rows(20, 5), priority=[4.0, 9.0, 16.0, 0.25, 1.0])
    w = torch.cat([torch.ones(20), torch.tensor([2.0, 3.0, 4.0, 0.5, 1.0])]).double()
    s = store.sample(64, torch.Generator().manual_seed(3), beta=0.6)
    assert type(s).__name__ == "PrioritizedSample"
    expect = w[s.indices] / w.sum()
    assert torch.allclose(s.probabilities, expect, rtol=1e-12, atol=0)
    assert torch.allclose(s.weights.double(), (expect / (w.min() / w.sum())) ** -0.6, rtol=1e-6)
    assert s.weights.dtype == torch.float32 and float(s.weights.max()) <= 1.0
    assert s.generations.tolist() == [1] * 64
    # alpha belongs to the store; uniform draws stay available
    with pytest.raises(ValueError, match="alpha=0.5"):
        store.sample(4, alpha=0.9)
    u = store.sample(8, prioritized=False)
    assert type(u).__name__ == "Sample" and int(u.indices.max()) < 25


def test_default_priority_is_the_largest_so_far_and_updates_respect_generations(ring):
    store = ring(4)
    store.enable_priorities(alpha=1.0)
    store.extend(rows(0, 2), priority=[3.0, 1.0])
    store.extend(rows(2, 1))  # no priority given: the largest so far, 3
    s = store.sample(2000, torch.Generator().manual_seed(1))
    freq = torch.bincount(s.indices, minlength=4).double() / 2000
    assert abs(freq[2] - 3 / 7) < 0.05 and freq[3] == 0  # slot 3 was never written
    # slot 0 is overwritten (generation 2): a late update for generation 1 is refused there
    store.extend(rows(3, 2), priority=[1.0, 1.0])  # slots 3 and 0
    applied = store.update_priority([0, 1], [50.0, 50.0], generation=[1, 1])
    assert applied.tolist() == [False, True]
    assert store.update_priority([3], 0.0).tolist() == [True]  # priority 0: never drawn
    s = store.sample(500, torch.Generator().manual_seed(2))
    assert 3 not in s.indices.tolist()
    assert store.update_priority([], []).tolist() == []


def test_alpha_zero_is_uniform_over_positive_priorities(ring):
    store = ring(20)
    store.enable_priorities(alpha=0.0)
    store.extend(rows(0, 20), priority=[0.0 if k % 4 == 0 else float(k) for k in range(20)])
    counts = draw_counts(store, 20, 20_000, seed=5)
    live = torch.tensor([k % 4 != 0 for k in range(20)]).double()
    assert chi_square(counts, live / live.sum()) < chi2_critical(14)


def test_enable_priorities_is_idempotent_and_refuses_other_values(backend):
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    store.extend(rows(0, 3))
    store.enable_priorities(alpha=0.6, max_times_sampled=3)
    store.enable_priorities(alpha=0.6, max_times_sampled=3)
    with pytest.raises(ValueError, match=r"alpha=0.6 and max_times_sampled=3"):
        store.enable_priorities(alpha=0.5)
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    assert other.sampling_policy.alpha == 0.6 and other.sampling_policy.max_times == 3


def test_bad_priorities_are_refused_before_anything_is_written(backend):
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    with pytest.raises(ValueError, match="enable_priorities"):
        store.extend(rows(0, 2), priority=1.0)
    with pytest.raises(ValueError, match="enable_priorities"):
        store.update_priority([0], 1.0)
    with pytest.raises(ValueError, match="no priorities"):
        store.sample(2, prioritized=True)
    assert store.write_count == 0
    store.enable_priorities()
    for bad, match in (
        (-1.0, "row 0"),
        (float("nan"), "row 0"),
        ([1.0, float("inf")], "row 1"),
        ([1.0, 2.0, 3.0], "3 priority values for 2 rows"),
    ):
        with pytest.raises(ValueError, match=match):
            store.extend(rows(0, 2), priority=bad)
    assert store.write_count == 0
    for kwargs in ({"alpha": -1.0}, {"alpha": float("nan")}, {"alpha": "x"}, {"max_times_sampled": 0}):
        with pytest.raises(ValueError):
            LazyStackedTensorDictStore(count=2, **backend.kwargs()).enable_priorities(**kwargs)
    store.extend(rows(0, 2), priority=[1.0, 2.0])
    with pytest.raises(IndexError, match="out of range"):
        store.update_priority([8], 1.0)
    with pytest.raises(ValueError, match="beta"):
        store.sample(2, beta=-1)
    assert store.write_count == 2 and store[1]["tag"].item() == 1


def test_max_times_sampled_retires_a_slot_until_it_is_written_again(ring):
    store = ring(6)
    store.enable_priorities(alpha=1.0, max_times_sampled=2)
    store.extend(rows(0, 6))
    seen = torch.zeros(6, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        s = store.sample(4, gen)
        seen += torch.bincount(s.indices, minlength=6)
    assert seen.tolist() == [2] * 6  # 12 draws, each slot exactly twice, then retired
    with pytest.raises(ValueError, match="positive priority"):
        store.sample(1)
    with pytest.raises(TimeoutError):
        store.sample(1, timeout=0)
    with pytest.raises(ValueError, match="max_times_sampled=2"):
        store.sample(1, prioritized=False)
    assert store.update_priority([0], 5.0).tolist() == [False]  # retired slots stay retired
    store.extend(rows(6, 1))  # slot 0 again: a new item
    s = store.sample(2, gen)
    assert s.indices.tolist() == [0, 0] and s.td["tag"].tolist() == [6, 6]


def test_rate_limiter_min_size(ring):
    store = ring(10)
    store.set_rate_limit(min_size=3)
    store.extend(rows(0, 2))
    with pytest.raises(TimeoutError, match="fewer than the 3"):
        store.sample(1, timeout=0)
    got: list = []
    learner = threading.Thread(target=lambda: got.append(store.sample(2, timeout=60)))
    learner.start()
    store.extend(rows(2, 1))  # the third item lets the waiting sample through
    learner.join()
    assert len(got) == 1 and got[0].td["tag"].max() <= 2
    store.clear_rate_limit()
    assert store.sampling_policy.limit is None


def test_sample_to_insert_ratio_holds_both_sides(ring):
    store = ring(20)
    store.set_rate_limit(min_size=2, samples_per_insert=2.0, error_buffer=4.0)  # diff within [0, 8]
    store.extend(rows(0, 2))  # diff 4
    store.sample(4)  # diff 0
    with pytest.raises(TimeoutError, match="rate limiter"):
        store.sample(1, timeout=0)
    store.extend(rows(2, 2))  # diff 4
    store.extend(rows(4, 2))  # diff 8
    with pytest.raises(TimeoutError, match="rate limiter"):
        store.extend(rows(6, 1), timeout=0)
    assert store.write_count == 6
    # a blocked writer goes on when a learner samples
    done = threading.Event()
    writer = threading.Thread(target=lambda: (store.extend(rows(6, 1), timeout=60), done.set()))
    writer.start()
    store.sample(2)
    writer.join()
    assert done.is_set() and store.write_count == 7
    # a batch goes when its first row may (it may overshoot by itself): batches wider than the
    # buffer never hold both sides back for good
    store.sample(9, timeout=0)  # diff 8 -> -1
    store.extend(rows(7, 5), timeout=0)  # diff -1 -> 9
    assert store.write_count == 12
    with pytest.raises(ValueError, match="error_buffer"):
        store.set_rate_limit(min_size=1, samples_per_insert=4.0, error_buffer=1.0)
    with pytest.raises(ValueError, match="never be reached"):
        store.set_rate_limit(min_size=21)


def test_pop_hands_each_item_to_one_reader_in_write_order(backend):
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    store.extend(rows(0, 5, het=True))
    a = store.pop(2)
    assert a.td["tag"].tolist() == [0, 1] and a.indices.tolist() == [0, 1] and a.generations.tolist() == [1, 1]
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    b = other.pop(10)
    assert b.td["tag"].tolist() == [2, 3, 4]
    assert [t["tokens"].tolist() for t in b.td.unbind(0)] == [list(range(1 + k % 4)) for k in (2, 3, 4)]
    with pytest.raises(TimeoutError, match="no unread item"):
        store.pop(1, timeout=0)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.pop(4, timeout=60)))
    reader.start()
    store.extend(rows(5, 1, het=True))
    reader.join()
    assert got[0].td["tag"].tolist() == [5]


def test_overrun_is_reported_never_silent(ring):
    store = ring(4)
    store.extend(rows(0, 3))
    assert store.pop(1).td["tag"].tolist() == [0]
    store.extend(rows(3, 4))  # 7 written, 1 popped: items 1 and 2 were overwritten
    with pytest.raises(QueueOverrunError, match="overwrote 2 items") as err:
        store.pop(1)
    assert err.value.lost == 2
    assert store.pop(10).td["tag"].tolist() == [3, 4, 5, 6]


def test_queue_mode_makes_writers_wait_instead_of_overwriting(ring):
    store = ring(4)
    store.set_queue(True)
    store.extend(rows(0, 4))
    with pytest.raises(TimeoutError, match="queue is full"):
        store.extend(rows(4, 1), timeout=0)
    writer = threading.Thread(target=lambda: store.extend(rows(4, 2), timeout=60))
    writer.start()
    assert store.pop(3).td["tag"].tolist() == [0, 1, 2]
    writer.join()
    assert store.pop(10).td["tag"].tolist() == [3, 4, 5]
    store.set_queue(False)
    store.extend(rows(6, 4))
    store.extend(rows(10, 1))  # overwrites item 6 unread: allowed again, and reported
    with pytest.raises(QueueOverrunError):
        store.pop(1)


def test_wait_for_written_items(ring):
    store = ring(10)
    with pytest.raises(TimeoutError, match="0 of the 2 items"):
        store.wait_for(written=2, timeout=0)
    out: list = []
    waiter = threading.Thread(target=lambda: out.append(store.wait_for(written=3, timeout=60)))
    waiter.start()
    store.extend(rows(0, 2))
    store.extend(rows(2, 2))
    waiter.join()
    assert out[0].written >= 3
    assert store.wait_for(write_count=4, timeout=0).write_count == 4
    with pytest.raises(TypeError):
        store.wait_for()
    with pytest.raises(ValueError, match="never holds"):
        store.wait_for(written=11)


def test_a_lost_priority_tree_is_reported_not_sampled_as_zeros(real):
    store = LazyStackedTensorDictStore(count=8, **real.kwargs())
    store.enable_priorities()
    store.extend(rows(0, 4))
    real.client().delete(store._engine.keys.priorities)
    for call in (lambda: store.sample(2), lambda: store.extend(rows(4, 1)), lambda: store.update_priority([0], 2.0)):
        with pytest.raises(StoreDamagedError, match="priority tree"):
            call()
    assert store.write_count == 4  # nothing was written


def test_policy_calls_are_one_round_trip(real):
    store = LazyStackedTensorDictStore(count=16, **real.kwargs())
    store.extend(rows(0, 8))
    store.enable_priorities(alpha=0.6)
    store.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=100.0)
    gen = torch.Generator().manual_seed(0)
    for fn in (
        lambda: store.extend(rows(8, 4), priority=torch.rand(4)),
        lambda: store.sample(8, gen),
        lambda: store.update_priority([0, 1], [2.0, 3.0], generation=[1, 1]),
        lambda: store.pop(2),
    ):
        assert top_level_commands(real.client, fn) == ["evalsha"]


def test_policy_changes_are_one_round_trip_and_known_at_once(real):
    """A policy change's script sends the header back: the handle knows the new policy without another call."""
    store = LazyStackedTensorDictStore(count=16, **real.kwargs())
    store.extend(rows(0, 8))
    for change, check in (
        (lambda: store.enable_priorities(alpha=0.5), lambda p: p.alpha == 0.5 and p.limit is None),
        (lambda: store.set_rate_limit(min_size=2, samples_per_insert=2.0, error_buffer=50.0), lambda p: p.limit is not None),
        (lambda: store.clear_rate_limit(), lambda p: p.limit is None and p.alpha == 0.5),
        (lambda: store.set_queue(True), lambda p: p.queue),
    ):
        assert top_level_commands(real.client, change) == ["evalsha"]
        assert check(store._engine.header.sampling)  # the cached header, as the script left it
        assert store._engine.header.sampling == store.sampling_policy  # and as the server holds it


def test_priorities_on_a_store_of_several_segments(backend):
    store = LazyStackedTensorDictStore(count=40, segment_bytes=64, **backend.kwargs())
    store.enable_priorities(alpha=1.0)
    store.extend(rows(0, 40, het=True), priority=[float(k % 5) for k in range(40)])
    assert store._engine.header.segments.n > 1
    s = store.sample(200, torch.Generator().manual_seed(0))
    assert torch.equal(s.td["tag"], s.indices) and all(int(i) % 5 for i in s.indices)
    p = store.pop(3)
    assert p.td["tag"].tolist() == [0, 1, 2]


def test_spread_and_readonly_stores_refuse(backend):
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    ro = LazyStackedTensorDictStore.from_store(td_id=store.td_id, readonly=True, **backend.kwargs())
    with pytest.raises(PermissionError):
        ro.enable_priorities()
    with pytest.raises(PermissionError):
        ro.pop(1, timeout=0)


def test_policy_keys_expire_and_go_with_the_store(real):
    store = LazyStackedTensorDictStore(count=8, ttl=100, **real.kwargs())
    store.enable_priorities(max_times_sampled=2)
    c = real.client()
    assert 0 < c.pttl(store._engine.keys.priorities) <= 100_000 and c.pttl(store._engine.keys.times_sampled) > 0
    store.clear_redis()
    assert not c.exists(store._engine.keys.priorities, store._engine.keys.times_sampled)


def test_plain_lua_float64_codec_matches_ieee_754():
    """fakeredis has no struct library: the tree's plain-Lua pack and unpack must give IEEE 754 bytes."""
    import struct
    from pathlib import Path

    import fakeredis

    lua = Path(__file__).resolve().parents[2] / "lua"
    lib = (lua / "_lib.lua").read_text() + "\n" + (lua / "_tree.lua").read_text() + "\n"
    values = [0.0, 5e-324, 1e-310, 2.2250738585072014e-308, 0.1, 1 / 3, 1.0, 2.0**52 + 1, 1e300, 1.7976931348623157e308]
    script = (
        lib
        + "local out = {} for i, v in ipairs(ARGV) do local b = tds_f64_pack_plain(tonumber(v)) "
        + "out[#out + 1] = b out[#out + 1] = string.format('%.17g', tds_f64_plain(b, 1)) end return out"
    )
    got = fakeredis.FakeRedis().eval(script, 0, *[repr(v) for v in values])
    for k, v in enumerate(values):
        assert got[2 * k] == struct.pack("<d", v), v
        assert float(got[2 * k + 1]) == v


def test_info_shows_the_policy_and_pop_of_a_key_is_still_tensordicts(real):
    import subprocess
    import sys

    store = LazyStackedTensorDictStore(count=10, **real.kwargs())
    store.extend(rows(0, 3))
    store.enable_priorities(0.6, max_times_sampled=2)
    store.set_rate_limit(min_size=2, samples_per_insert=2.0, error_buffer=4)
    out = subprocess.run(
        [sys.executable, "-m", "tdstore", "info", store.td_id, "--url", real.kwargs()["url"], "--prefix", store.prefix],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        "sampling:         priorities (alpha=0.6, max_times_sampled=2), rate limit (samples_per_insert=2, min_size=2, error_buffer=4)"
        in out.stdout
    ), out.stdout + out.stderr
    assert store.pop("obs").shape == (10, 3) and "obs" not in store.keys()  # TensorDict's pop(key)
    assert store.pop("missing", None) is None


def test_a_handle_that_cached_the_header_before_a_policy_samples_under_it(backend):
    """A full homogeneous ring samples through a client-side transaction; a policy another handle set
    since must still apply (the transaction reads the policy field, and the sample goes through read.lua)."""
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    store.extend(rows(0, 8))
    store.sample(4)  # the ring is full: later samples may take the transaction path
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **backend.kwargs())
    other.enable_priorities(alpha=1.0)
    other.update_priority(list(range(8)), [0.0] * 7 + [1.0])  # only slot 7 can be drawn
    s = store.sample(16, torch.Generator().manual_seed(0))
    assert s.indices.tolist() == [7] * 16 and type(s).__name__ == "PrioritizedSample"
    other.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=1.0)  # no sample before an insert
    with pytest.raises(TimeoutError, match="rate limiter"):
        store.sample(4, timeout=0, prioritized=False)


def test_wide_batches_never_hold_each_other_back_for_good(backend):
    """Batches wider than the limiter's buffer: each goes when its first row may (Reverb's per-row count)."""
    store = LazyStackedTensorDictStore(count=64, **backend.kwargs())
    store.set_rate_limit(min_size=2, samples_per_insert=1.0, error_buffer=4.0)  # diff within [-2, 6]
    store.extend(rows(0, 16), timeout=0)  # diff 0 -> 16: the first row fitted
    with pytest.raises(TimeoutError):
        store.extend(rows(16, 1), timeout=0)  # 17 > 6
    store.sample(20, timeout=0)  # diff 16 -> -4: the first sample fitted
    with pytest.raises(TimeoutError):
        store.sample(1, timeout=0)  # -5 < -2
    store.extend(rows(16, 1), timeout=0)


def test_a_failed_pop_or_sample_changes_nothing(real):
    store = LazyStackedTensorDictStore(count=8, **real.kwargs())
    store.extend(rows(0, 4))
    store.enable_priorities(max_times_sampled=1)
    store.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=100.0)
    c = real.client()
    data = [k for k in c.keys(f"{store.prefix}:*") if b":d:" in k]
    assert data
    saved = c.dump(data[0])
    c.delete(data[0])  # the rows' key is lost: every read of it raises
    before = c.hgetall(store._engine.keys.meta)
    with pytest.raises(StoreDamagedError):
        store.pop(2)
    with pytest.raises(StoreDamagedError):
        store.sample(2)
    after = c.hgetall(store._engine.keys.meta)
    assert {k: before.get(k) for k in (b"rr", b"sn")} == {k: after.get(k) for k in (b"rr", b"sn")}
    c.restore(data[0], 0, saved)
    assert sorted(store.sample(4, torch.Generator().manual_seed(0)).indices.tolist()) == [0, 1, 2, 3]  # none was retired
    assert store.pop(2).td["tag"].tolist() == [0, 1]


def test_weights_that_overflow_are_refused_before_anything_is_written(backend):
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    store.enable_priorities(alpha=2.0)
    store.extend(rows(0, 2), priority=[1.0, 2.0])
    with pytest.raises(ValueError, match="largest allowed priority is 1.118"):
        store.update_priority([0], 1e200)
    with pytest.raises(ValueError, match="largest allowed priority is 1.118"):
        store.extend(rows(2, 2), priority=[1.0, 1e200])
    assert store.write_count == 2
    s = store.sample(400, torch.Generator().manual_seed(0))
    assert abs(float((s.indices == 1).double().mean()) - 0.8) < 0.06  # weights 1 and 4, unchanged


def test_an_uploaded_store_keeps_every_slot_sampleable_and_updatable(backend):
    from tensordict import lazy_stack

    local = lazy_stack([rows(k, 1)[0] for k in range(6)])
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **backend.kwargs())
    store.enable_priorities(alpha=1.0)  # every element of an upload weighs 1
    store.extend(rows(10, 1))  # the ring's first write: slot 0
    assert store.update_priority([3, 5], [5.0, 5.0]).tolist() == [True, True]
    s = store.sample(600, torch.Generator().manual_seed(1))
    assert set(s.indices.tolist()) == set(range(6)) and abs(float((s.indices == 5).double().mean()) - 5 / 14) < 0.06


def test_readonly_handles_and_unreachable_sizes(backend):
    store = LazyStackedTensorDictStore(count=8, **backend.kwargs())
    store.extend(rows(0, 4))
    with pytest.raises(ValueError, match="never be reached"):
        store.sample(2, min_size=9)
    store.set_rate_limit(min_size=1)
    ro = LazyStackedTensorDictStore.from_store(td_id=store.td_id, readonly=True, **backend.kwargs())
    with pytest.raises(PermissionError, match="counts samples"):
        ro.sample(2)
