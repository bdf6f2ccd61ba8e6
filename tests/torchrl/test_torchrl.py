"""tdstore.torchrl: torchrl's replay-buffer API on the server's ring, from one and from many processes.

Skipped when torchrl is not installed (it needs ``pip install --no-deps torchrl-nightly``);
CI installs it, so none of these is skipped there.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import queue
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrl")

from helpers import children_from_forkserver, mp_context, round_trips, top_level_commands  # noqa: E402
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, lazy_stack, tensorclass  # noqa: E402
from torchrl.data import RandomSampler, ReplayBuffer, RoundRobinWriter, SamplerWithoutReplacement, SliceSampler, TensorDictReplayBuffer  # noqa: E402

from tdstore import DenseShapeError  # noqa: E402
from tdstore.server import EmbeddedServer  # noqa: E402
from tdstore.torchrl import (  # noqa: E402
    StorePrioritizedSampler,
    StoreSampler,
    StoreSamplerWithoutReplacement,
    StoreStorage,
    StoreWriter,
    attach,
    replay_buffer,
)


@tensorclass
class Obs:
    x: torch.Tensor
    step: torch.Tensor


def rows(start: int, n: int) -> TensorDict:
    """``n`` rows stamped ``start, start+1, ...`` in every entry, so a row read whole is recognisable."""
    v = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(obs=v[:, None].expand(n, 8).clone(), step=torch.arange(start, start + n), batch_size=[n])


def whole(td: TensorDict) -> bool:
    return bool((td["obs"] == td["step"].to(torch.float32)[:, None]).all())


# -- the ReplayBuffer API on the new classes ---------------------------------------------------------
def test_importing_tdstore_does_not_import_torchrl():
    code = "import sys, tdstore, tdstore.store, tdstore.lazy; assert 'torchrl' not in sys.modules, 'torchrl imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_extend_add_sample_len(real):
    rb = replay_buffer(10, batch_size=4, **real.kwargs())
    assert len(rb) == 0 and rb.write_count == 0
    assert rb.extend(rows(0, 6)).tolist() == list(range(6))
    assert rb.add(rows(6, 1)[0]) == 6
    assert len(rb) == 7 and rb.write_count == 7 and rb.writer._cursor == 7
    s = rb.sample()
    assert s.batch_size == torch.Size([4]) and whole(s)
    assert set(s["step"].tolist()) <= set(range(7)) and s["index"].tolist() == s["step"].tolist()
    assert rb.storage[:]["step"].tolist() == list(range(7))  # a slice covers the written slots only
    assert rb.storage[2]["step"].item() == 2 and rb[torch.tensor([1, 3])]["step"].tolist() == [1, 3]
    assert rb.storage.contains(6) and not rb.storage.contains(7)


def test_torchrls_buffer_keywords_are_taken_directly(real):
    """``prefetch``, ``transform``... go to torchrl's buffer; tdstore's own keywords to the store."""
    rb = replay_buffer(10, batch_size=4, prefetch=2, pin_memory=False, dim_extend=0, **real.kwargs(socket_timeout=30))
    try:
        assert rb._prefetch_cap == 2
        rb.extend(rows(0, 6))
        assert rb.sample().batch_size == torch.Size([4])
    finally:
        rb.empty()


def test_unknown_keywords_are_refused_before_anything_is_made(real):
    before = real.keys()
    with pytest.raises(TypeError, match=r"unexpected keyword.*\['prefetchh'\]"):
        replay_buffer(10, prefetchh=4, **real.kwargs())
    with pytest.raises(TypeError, match="twice"):
        replay_buffer(10, prefetch=4, buffer_kwargs={"prefetch": 2}, **real.kwargs())
    with pytest.raises(TypeError, match=r"\['not_a_buffer_keyword'\]"):
        replay_buffer(10, buffer_kwargs={"not_a_buffer_keyword": 1}, **real.kwargs())
    with pytest.raises(TypeError, match="priority_key"):  # a TensorDictReplayBuffer keyword, not a plain buffer's
        replay_buffer(10, tensordict=False, priority_key="td_error", **real.kwargs())
    assert real.keys() == before


def test_writes_at_explicit_slots(real):
    rb = replay_buffer(10, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 5))
    rb[2] = rows(42, 1)[0]
    rb[torch.tensor([0, 1])] = rows(7, 2)
    got = rb.storage[:]
    assert got["step"].tolist() == [7, 8, 42, 3, 4] and whole(got)
    assert len(rb) == 5 and rb.write_count == 5  # an explicit write moves neither the length nor the cursor


def test_wraps_around_and_splits_batches_longer_than_the_ring(real):
    rb = replay_buffer(10, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 4))
    index = rb.extend(rows(100, 14))  # 14 rows into 10 slots: written in two calls, the later wins
    assert index.tolist() == [(4 + i) % 10 for i in range(14)]
    assert len(rb) == 10 and rb.write_count == 18 and rb.writer._cursor == 8
    got = rb.storage[:]
    assert whole(got) and sorted(got["step"].tolist()) == list(range(104, 114))


def test_index_key_of_a_tensordict_buffer_is_not_stored(real):
    rb = replay_buffer(10, batch_size=3, **real.kwargs())
    rb.extend(rows(0, 3))
    again = rb.sample()
    assert "index" in again.keys()
    rb.extend(again)  # a sample extended again: its "index" is buffer metadata, not a key of the store
    assert sorted(rb.storage._storage.keys()) == ["obs", "step"] and len(rb) == 6
    assert whole(rb.storage[:])


def test_generations_in_torchrls_convention(real):
    rb = replay_buffer(4, batch_size=6, track_generations=True, **real.kwargs())
    rb.extend(rows(0, 3))
    assert rb.writer.generations_of(torch.arange(4)).tolist() == [0, 0, 0, -1]
    rb.extend(rows(3, 3))  # slots 3, 0, 1
    assert rb.writer.generations_of(torch.arange(4)).tolist() == [1, 1, 0, 0]
    s = rb.sample()
    assert torch.equal(s["index_generation"], rb.writer.generations_of(s["index"]))


def test_state_dict_round_trip(real):
    rb = replay_buffer(10, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 5))
    state = rb.state_dict()
    other = replay_buffer(10, batch_size=4, **real.kwargs())
    other.load_state_dict(state)
    assert len(other) == 5 and other.storage.td_id == rb.storage.td_id
    assert other.storage[:]["step"].tolist() == list(range(5))
    other.extend(rows(5, 2))  # one buffer: the cursor is the server's
    assert len(rb) == 7 and rb.storage[:]["step"].tolist() == list(range(7))


def test_dumps_loads_reattach_by_td_id(real, tmp_path):
    rb = replay_buffer(10, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 5))
    rb.dumps(tmp_path / "ckpt")
    other = replay_buffer(10, batch_size=4, **real.kwargs())
    other.loads(tmp_path / "ckpt")
    assert len(other) == 5 and other.sample()["step"].max() < 5


def test_state_and_pickles_hold_no_password(monkeypatch):
    storage = StoreStorage(10, url="redis://:s3cret-pw@127.0.0.1:1/0?password=s3cret-pw", password="s3cret-pw2", prefix="p")
    monkeypatch.setattr(StoreStorage, "_len_along_dim0", property(lambda self: 0))  # (no server here: no rows)
    assert "s3cret" not in repr(storage.state_dict()) and "s3cret" not in repr(storage)
    assert b"s3cret" not in pickle.dumps(storage)
    assert storage.state_dict()["conn"] == {"url": "redis://127.0.0.1:1/0", "prefix": "p"}


def test_attach_by_td_id_reads_the_size_from_the_server(real):
    rb = replay_buffer(12, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 3))
    other = attach(rb.storage.td_id, batch_size=2, **real.kwargs())
    assert other.storage.max_size == 12 and len(other) == 3
    with pytest.raises(ValueError, match="max_size"):
        StoreStorage(**real.kwargs())


def test_empty(real):
    rb = replay_buffer(10, batch_size=4, **real.kwargs())
    other = attach(rb.storage.td_id, batch_size=8, **real.kwargs())
    rb.extend(rows(0, 5))
    assert len(other) == 5 and other.sample()["step"].max() < 5
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 0
    assert len(other) == 0  # the other handle reopens the store emptied under it
    with pytest.raises(RuntimeError, match="empty"):
        rb.sample()
    rb.extend(rows(50, 3))
    assert len(rb) == 3 and len(other) == 3 and other.storage[:]["step"].tolist() == [50, 51, 52]
    assert set(other.sample()["step"].tolist()) <= {50, 51, 52}  # never a slot of the buffer before it was emptied


def test_tensorclass_data(real):
    rb = replay_buffer(8, batch_size=3, tensordict=False, **real.kwargs())
    rb.extend(Obs(x=torch.ones(4, 2), step=torch.arange(4), batch_size=[4]))
    rb.add(Obs(x=torch.zeros(2), step=torch.tensor(4), batch_size=[]))
    s = rb.sample()
    assert isinstance(s, Obs) and s.batch_size == torch.Size([3])
    assert len(rb) == 5 and rb.storage[4].step.item() == 4
    other = replay_buffer(td_id=rb.storage.td_id, batch_size=2, tensordict=False, tensorclass_cls=Obs, **real.kwargs())
    assert isinstance(other.sample(), Obs)


def test_plain_tensors(real):
    rb = replay_buffer(8, batch_size=5, tensordict=False, **real.kwargs())
    rb.extend(torch.arange(6.0))
    rb.add(torch.tensor(6.0))
    s = rb.sample()
    assert isinstance(s, torch.Tensor) and s.shape == (5,) and set(s.tolist()) <= set(map(float, range(7)))
    assert rb.storage[:].tolist() == list(map(float, range(7)))
    other = attach(rb.storage.td_id, batch_size=2, tensordict=False, **real.kwargs())
    assert isinstance(other.sample(), torch.Tensor)  # a process that never wrote knows from the store's keys


def test_varying_shapes_sample_as_a_lazy_stack(real):
    rb = replay_buffer(8, batch_size=16, ragged=True, **real.kwargs())
    rb.extend(lazy_stack([TensorDict(tokens=torch.full((1 + i % 3,), i)) for i in range(6)]))
    s = rb.sample()
    assert isinstance(s, LazyStackedTensorDict)
    for el, i in zip(s.unbind(0), s["index"].tolist()):
        assert el["tokens"].tolist() == [i] * (1 + i % 3)


def test_fixed_shape_data_is_a_dense_store_and_ragged_rows_name_the_keyword(real):
    rb = replay_buffer(8, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 6))
    raw = real.client()
    meta = rb.storage._store.stack_ops.engine.keys.meta
    assert raw.hget(meta, "type") == b"dense"
    s = rb.sample()
    assert type(s) is TensorDict and whole(s)
    with pytest.raises(DenseShapeError, match=r"'obs'.*\[8\].*\[\[5\]\].*ragged=True"):
        rb.extend(TensorDict(obs=torch.zeros(2, 5), step=torch.zeros(2, dtype=torch.int64), batch_size=[2]))
    assert len(rb) == 6 and rb.write_count == 6  # nothing was written
    other = attach(rb.storage.td_id, batch_size=3, **real.kwargs())  # opens the dense store as it is
    assert type(other.sample()) is TensorDict and len(other) == 6
    text = replay_buffer(8, batch_size=3, **real.kwargs())  # non-tensor rows too read as one TensorDict
    text.extend(TensorDict(obs=torch.zeros(4, 2), text=NonTensorStack(*"abcd"), batch_size=[4]))
    got = text.sample()
    assert type(got) is TensorDict and set(got["text"]) <= set("abcd") and text[:2]["text"] == ["a", "b"]
    ragged = replay_buffer(8, batch_size=4, ragged=True, **real.kwargs())
    ragged.extend(rows(0, 2))
    assert raw.hget(ragged.storage._store.stack_ops.engine.keys.meta, "type") == b"lazy"
    ragged.extend(lazy_stack([TensorDict(obs=torch.zeros(n), step=torch.tensor(0)) for n in (5, 6)]))
    assert isinstance(attach(ragged.storage.td_id, batch_size=4, **real.kwargs()).sample(), LazyStackedTensorDict)


def test_a_writer_with_its_own_cursor_writes_at_the_servers_cursor(real):
    """torchrl's RoundRobinWriter works while its cursor is the server's (test_torchrl_dropin: when it is not)."""
    rb = ReplayBuffer(storage=StoreStorage(8, **real.kwargs()), writer=RoundRobinWriter(), batch_size=2)
    rb.extend(rows(0, 2))
    assert len(rb) == 2 and rb.storage._store.write_count == 2 and whole(rb[:])
    rb = ReplayBuffer(storage=StoreStorage(8, **real.kwargs()), writer=StoreWriter(), sampler=StoreSampler(), batch_size=2)
    rb.extend(rows(0, 2))
    assert len(rb) == 2 and whole(rb.sample())


@pytest.mark.parametrize("sampler", ["RandomSampler", "SamplerWithoutReplacement", "SliceSampler-traj", "SliceSampler-end"])
def test_torchrls_samplers_on_the_store(real, sampler):
    make = {
        "RandomSampler": RandomSampler,
        "SamplerWithoutReplacement": SamplerWithoutReplacement,
        "SliceSampler-traj": lambda: SliceSampler(slice_len=4, traj_key="episode"),
        "SliceSampler-end": lambda: SliceSampler(slice_len=4, end_key="done"),
    }[sampler]
    rb = replay_buffer(20, batch_size=8, sampler=make(), **real.kwargs())
    data = rows(0, 16)
    data["episode"] = torch.arange(16) // 8
    data["done"] = (torch.arange(16) % 8 == 7)[:, None]
    rb.extend(data)
    s = rb.sample()
    assert s.batch_size == torch.Size([8]) and whole(s)
    if sampler.startswith("Slice"):
        for part in s.split(4):  # each slice is 4 consecutive steps of one episode
            steps = part["step"]
            assert (steps.diff() == 1).all() and part["episode"].unique().numel() == 1
    if sampler == "SamplerWithoutReplacement":
        assert sorted(s["step"].tolist() + rb.sample()["step"].tolist()) == list(range(16))


def test_store_sampler_draws_rows_written_since_its_last_batch(real):
    rb = replay_buffer(64, batch_size=64, **real.kwargs())
    rb.extend(rows(0, 2))
    assert set(rb.sample()["step"].tolist()) <= {0, 1}
    rb.extend(rows(2, 30))
    rb.sample()  # sees the new length
    s = rb.sample()
    assert whole(s) and int(s["step"].max()) >= 2 and set(s["step"].tolist()) <= set(range(32))


def test_store_sampler_without_replacement_follows_a_growing_buffer(real):
    assert isinstance(StoreSampler(replacement=False), StoreSamplerWithoutReplacement)
    rb = replay_buffer(32, batch_size=4, sampler="without_replacement", **real.kwargs())
    rb.extend(rows(0, 8))
    seen = rb.sample()["step"].tolist()
    rb.extend(rows(8, 8))  # the buffer grows between two batches: the slots not drawn yet stay
    for _ in range(3):
        seen += rb.sample()["step"].tolist()
    assert sorted(seen) == list(range(16))


def test_storage_writer_and_sampler_read_a_mask_as_indexing_does(real):
    """A bool or uint8 mask selects slots in every torchrl path, as ``store[mask]`` does (never slots 0 and 1)."""
    rb = replay_buffer(8, batch_size=4, sampler="prioritized", alpha=1.0, eps=0.0, **real.kwargs())
    rb.extend(rows(0, 8))
    mask = torch.tensor([0, 0, 0, 1, 0, 1, 0, 0], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="uint8"):
        assert rb.storage.get(mask)["step"].tolist() == [3, 5]
    assert rb.storage.get(mask.bool())["step"].tolist() == [3, 5]
    assert rb.writer.generations_of(mask.bool()).tolist() == [0, 0]
    rb.storage.set(mask.bool(), rows(50, 2), set_cursor=False)
    assert rb.storage[:]["step"].tolist() == [0, 1, 2, 50, 4, 51, 6, 7]
    rb.sample()  # the sampler needs its storage: the last batch drawn names it
    rb.sampler.update_priority(mask.bool(), torch.tensor([30.0, 30.0]))
    drawn = rb.storage.with_store(lambda st: st.sample(2048, generator=torch.Generator().manual_seed(0), prioritized=True))
    boosted = {int(i) for i, p in zip(drawn.indices, drawn.probabilities) if p > 1 / 8}
    assert boosted == {3, 5}


def test_prioritized_sampler_keeps_the_tree_on_the_server(real):
    """torchrl's PrioritizedSampler API: weights in the sample, update_tensordict_priority, a second
    process's buffer on the same store draws by the same priorities."""
    rb = replay_buffer(16, batch_size=64, sampler="prioritized", alpha=1.0, beta=0.5, eps=0.0, **real.kwargs())
    rb.extend(rows(0, 8))  # the server gives every new row the largest priority so far (1)
    s = rb.sample()
    assert whole(s) and torch.allclose(s["priority_weight"], torch.ones(64))
    # the learner's TD errors become the priorities of the rows it drew (only where they were not overwritten)
    s.set("td_error", torch.where(s["step"] == 3, 30.0, 1.0).to(torch.float32))
    rb.update_tensordict_priority(s)
    other = attach(rb.storage.td_id, batch_size=2000, sampler="prioritized", alpha=1.0, beta=0.5, **real.kwargs())
    big = other.sample()
    share = float((big["step"] == 3).double().mean())
    drawn = set(s["step"].tolist())
    total = 30.0 + (len(drawn) - 1) + (8 - len(drawn))  # rows never drawn keep priority 1
    assert abs(share - 30.0 / total) < 0.05
    assert isinstance(other.sampler, StorePrioritizedSampler) and other.storage.with_store(lambda st: st.sampling_policy.alpha) == 1.0
    # the weights are torchrl's: (P(i) / min P) ** -beta, at most 1
    w = big["priority_weight"]
    assert float(w.max()) <= 1.0 and torch.allclose(w[big["step"] == 3], torch.full_like(w[big["step"] == 3], 30.0**-0.5))
    with pytest.raises(ValueError, match="alpha=1"):
        replay_buffer(sampler="prioritized", td_id=rb.storage.td_id, alpha=0.5, **real.kwargs())


def heavy_draws(rb: ReplayBuffer, batches: int = 10) -> int:
    """How many of ``batches`` samples' rows are slot 7 (see the test below)."""
    return sum(int((rb.sample()["step"] == 7).sum()) for _ in range(batches))


def test_a_default_attach_samples_as_the_buffer_that_made_it(one_node):
    """The buffer's policy is the server's: ``attach(td_id)`` of a prioritized buffer samples by priority
    with the store's alpha and max_times_sampled, and keeps its rate limiter and queue; a sampler the
    caller names wins. Before, a default attach sampled uniformly, silently: slot 7, holding ~99.9%
    of the priority mass, was drawn ~40 times in 640 (1/16) instead of ~639."""
    kw = one_node.kwargs()
    rb = replay_buffer(16, batch_size=64, sampler="prioritized", alpha=0.8, **kw)
    rb.extend(rows(0, 16))
    rb.update_priority(torch.arange(16), torch.where(torch.arange(16) == 7, 1e4, 1e-3))  # weight of 7: 1585 of 1585.06
    store = rb.storage._store
    store.set_rate_limit(min_size=16)
    store.set_queue(True)
    before = store.sampling_policy
    assert heavy_draws(rb) >= 600  # the maker's buffer
    other = attach(rb.storage.td_id, batch_size=64, **kw)
    assert isinstance(other.sampler, StorePrioritizedSampler) and other.sampler.alpha == 0.8
    engine = other.storage._store.stack_ops.engine
    sn = int(engine.command("HGET", engine.keys.meta, "sn"))
    assert heavy_draws(other) >= 600  # uniform draws ~40
    assert int(engine.command("HGET", engine.keys.meta, "sn")) == sn + 640  # the limiter counted the attached buffer's rows
    assert "priority_weight" in other.sample().keys() and other.storage._store.sampling_policy == before  # queue, limiter kept
    # sampler="prioritized" without alpha takes the store's (it raised: 0.6 is not the store's 0.8)
    assert attach(rb.storage.td_id, sampler="prioritized", **kw).sampler.alpha == 0.8
    # a sampler named explicitly wins
    uniform = attach(rb.storage.td_id, batch_size=64, sampler="uniform", **kw)
    assert type(uniform.sampler) is StoreSampler and heavy_draws(uniform) < 200
    mine = RandomSampler()
    assert attach(rb.storage.td_id, sampler=mine, **kw).sampler is mine
    # the store's max_times_sampled too (a uniform sample of such a store raised: only prioritized ones count)
    retiring = replay_buffer(8, batch_size=4, sampler="prioritized", max_times_sampled=3, **kw)
    retiring.extend(rows(0, 4))
    assert attach(retiring.storage.td_id, batch_size=4, **kw).sample()["priority_weight"].shape == (4,)
    # a buffer without priorities attaches with the uniform sampler, as before
    plain = replay_buffer(8, batch_size=4, **kw)
    plain.extend(rows(0, 4))
    assert type(attach(plain.storage.td_id, **kw).sampler) is StoreSampler


def test_extend_and_sample_are_one_round_trip(real):
    replay_buffer(64, batch_size=16, **real.kwargs()).extend(rows(0, 8))  # the scripts are on the server now
    rb = replay_buffer(64, batch_size=16, **real.kwargs())
    # the first extend creates the store (on a new connection, unless the process's client for this server has
    # an idle one), then writes the rows, the schema they make and the keys they need as one transaction
    # (rows as SETRANGEs, see _direct); the next ones are that transaction alone
    first = round_trips(top_level_commands(real.client, lambda: rb.extend(rows(0, 8))))
    assert first in (["hello", "evalsha", "transaction"], ["evalsha", "transaction"]), first
    assert round_trips(top_level_commands(real.client, lambda: rb.extend(rows(8, 8)))) == ["transaction"]
    assert round_trips(top_level_commands(real.client, lambda: rb.add(rows(16, 1)[0]))) == ["transaction"]
    rb.sample()  # a sampler's first batch reads the written length first
    assert round_trips(top_level_commands(real.client, lambda: rb.sample())) == ["transaction"]
    lazy = replay_buffer(16, batch_size=8, ragged=True, **real.kwargs())
    lazy.extend(lazy_stack([TensorDict(tokens=torch.arange(1 + i % 3)) for i in range(6)]))
    lazy.sample()  # (on a fresh server, the first sample loads read.lua)
    assert round_trips(top_level_commands(real.client, lambda: lazy.sample())) == ["evalsha"]  # the server draws
    full = replay_buffer(16, batch_size=16, track_generations=True, **real.kwargs())
    full.extend(rows(0, 16))
    full.sample()  # the ring is full: samples are one read transaction from now on (generations included)
    assert round_trips(top_level_commands(real.client, lambda: full.sample())) == ["transaction"]
    other = replay_buffer(batch_size=4, td_id=full.storage.td_id, **real.kwargs())
    assert len(other) == 16  # a handle that saw the ring full draws its first batch without reading the length
    assert round_trips(top_level_commands(real.client, lambda: other.sample())) == ["transaction"]


# -- processes ----------------------------------------------------------------------------------------
def _extend_in_child(rb, start):
    rb.extend(rows(start, 5))


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_pickled_buffer_writes_from_a_child(real, method):
    rb = replay_buffer(20, batch_size=4, **real.kwargs())
    rb.extend(rows(0, 3))
    ctx = mp.get_context(method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded pytest
        p = ctx.Process(target=_extend_in_child, args=(rb, 100))
        p.start()
        p.join(120)
    assert p.exitcode == 0
    assert len(rb) == 8 and rb.storage[:]["step"].tolist() == [0, 1, 2, 100, 101, 102, 103, 104]


ACTORS, CHUNKS, CHUNK = 4, 6, 25  # 600 rows into 1,000 slots: every row within one lap


def _actor(url, prefix, td_id, actor, go, done_q, all_done):
    rb = replay_buffer(url=url, prefix=prefix, td_id=td_id)  # its own handle on the same store
    go.wait(60)
    slots = []
    for c in range(CHUNKS):
        start = actor * 100_000 + c * CHUNK
        slots += rb.extend(rows(start, CHUNK)).tolist()
    done_q.put(("done", actor, slots))
    all_done.wait(120)
    done_q.put(("len", actor, len(rb)))


def test_four_actor_processes_and_a_learner(real):
    learner = replay_buffer(1000, batch_size=64, **real.kwargs())
    td_id = learner.storage.td_id  # creates the store, so the actors attach to it by id
    ctx = mp_context()
    go, all_done, q = ctx.Event(), ctx.Event(), ctx.Queue()
    kw = real.kwargs()
    procs = [ctx.Process(target=_actor, args=(kw["url"], kw["prefix"], td_id, a, go, q, all_done)) for a in range(ACTORS)]
    for p in procs:
        p.start()
    go.set()
    slots: dict[int, list[int]] = {}
    lens: dict[int, int] = {}
    samples = 0
    try:
        while len(slots) < ACTORS:
            if len(learner) > 0:  # the learner samples while the actors extend
                s = learner.sample()
                assert whole(s), s["step"]
                samples += 1
            try:
                kind, actor, value = q.get(timeout=0.01)
            except queue.Empty:
                continue
            slots[actor] = value
        all_done.set()
        while len(lens) < ACTORS:
            kind, actor, value = q.get(timeout=120)
            lens[actor] = value
    finally:
        all_done.set()
        for p in procs:
            p.join(120)
    assert [p.exitcode for p in procs] == [0] * ACTORS
    total = ACTORS * CHUNKS * CHUNK
    assert len(learner) == total and set(lens.values()) == {total}
    every = sorted(s for v in slots.values() for s in v)
    assert every == list(range(total))  # every row in its own slot
    got = learner.storage[:]
    assert whole(got)
    expected = sorted(a * 100_000 + i for a in range(ACTORS) for i in range(CHUNKS * CHUNK))
    assert sorted(got["step"].tolist()) == expected  # every row present exactly once
    s = learner.sample()
    assert whole(s)


# -- torchrl's own StoreStorage, given tdstore's TensorDictStore --------------------------------------
@pytest.fixture(scope="module")
def tcp_server():
    """torchrl's StoreStorage reconnects by host and port only (load_state_dict drops other keywords)."""
    with EmbeddedServer(unix_socket=False) as srv:
        yield srv


@pytest.fixture
def torchrl_store(monkeypatch, tcp_server):
    import tensordict.store

    import tdstore

    monkeypatch.setattr(tensordict.store, "TensorDictStore", tdstore.TensorDictStore)
    from torchrl.data.replay_buffers.storages.store import StoreStorage as TorchrlStoreStorage

    return lambda n: TorchrlStoreStorage(
        n, host="127.0.0.1", port=tcp_server.port
    )  # the default prefix: its load_state_dict drops every other keyword


def test_torchrls_store_storage_over_tdstore(torchrl_store):
    rb = ReplayBuffer(storage=torchrl_store(10), batch_size=4)
    rb.extend(rows(0, 6))
    rb.add(rows(6, 1)[0])
    assert len(rb) == 7 and whole(rb.sample())
    rb.extend(rows(7, 5))  # wraps around
    got = rb.storage.get(torch.arange(10))
    assert whole(got) and sorted(got["step"].tolist()) == list(range(2, 12))
    other = ReplayBuffer(storage=torchrl_store(10), batch_size=4)
    other.load_state_dict(rb.state_dict())
    assert len(other) == 10 and whole(other.sample())
    rb.empty()
    assert len(rb) == 0
    rb.extend(rows(20, 3))
    assert len(rb) == 3


def test_torchrls_store_storage_over_tdstore_tensorclass_and_samplers(torchrl_store):
    rb = ReplayBuffer(storage=torchrl_store(8), batch_size=3)
    rb.extend(Obs(x=torch.ones(4, 2), step=torch.arange(4), batch_size=[4]))
    assert isinstance(rb.sample(), Obs)
    td = TensorDictReplayBuffer(storage=torchrl_store(8), batch_size=4, sampler=SamplerWithoutReplacement())
    td.extend(rows(0, 8))
    assert sorted(td.sample()["step"].tolist() + td.sample()["step"].tolist()) == list(range(8))


# -- the benchmark ---------------------------------------------------------------------------------------
def test_benchmark_smoke():
    """A tiny run of ``python -m tools.torchrl_bench`` (its actors are spawned processes); no speed is asserted."""
    repo = Path(__file__).resolve().parents[2]
    args = [
        "--max-size",
        "200",
        "--fill",
        "100",
        "--chunk",
        "25",
        "--batch",
        "16",
        "--reps",
        "1",
        "--samples",
        "3",
        "--actors",
        "2",
        "--json",
    ]
    run = subprocess.run([sys.executable, "-m", "tools.torchrl_bench", *args], cwd=repo, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    names = {r["storage"] for r in out["rows"]}
    assert {"LazyTensorStorage", "torchrl StoreStorage / tensordict.store", "tdstore.torchrl"} <= names
    assert out["actors"]["rows"] == 2 * 100 and out["actors"]["write_count"] == 2 * 100 + 2  # + one schema row each


def test_demo_through_a_torchrl_replay_buffer(monkeypatch):
    children_from_forkserver(monkeypatch)
    from tdstore.demo import run_demo

    f = run_demo(actors=2, count=48, seconds=1.0, batch=16, torchrl=True, progress=False, out=sys.stderr)
    assert f["ok"] and f["torn"] == 0 and f["verified"] == 48 and f["writes"] > 0 and f["reads"] > 0
    assert "torchrl" in f["server"]


def test_demo_torchrl_flag_on_the_command_line():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tdstore",
            "demo",
            "--torchrl",
            "--actors",
            "1",
            "--count",
            "16",
            "--seconds",
            "0.5",
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert '"ok": true' in out.stdout
