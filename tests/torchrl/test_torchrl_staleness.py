"""torchrl's ``StalenessAwareSampler`` on a tdstore buffer: the server holds its ``max_staleness`` (issue 40).

Rows are written by several processes, each stamping the policy version it used (``extend(version=)``);
the learner's buffer, built with torchrl's sampler, draws the same rows as torchrl's in-memory buffer
would let through the same bound.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl")

import torch
from helpers import mp_context
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import StalenessAwareSampler

from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.torchrl import StoreStalenessSampler, replay_buffer

WRITERS, VERSIONS = 3, 6


def _row(w: int, v: int) -> TensorDict:
    return TensorDict(obs=torch.tensor([float(w), float(v)]), policy_version=torch.tensor(v), batch_size=[])


def _writer(url: str, prefix: str, td_id: str, w: int, out) -> None:
    store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
    for v in range(VERSIONS):  # one row a version, stamped with it on the server
        store.extend(_row(w, v).unsqueeze(0), version=v)
    out.put(w)


def _versions(rb, n: int = 512) -> set[int]:
    batch, info = rb.sample(n, return_info=True)
    staleness = info["staleness"]
    assert staleness.shape == (n,)
    assert torch.equal(torch.as_tensor(staleness).long(), rb.sampler.consumer_version - batch["policy_version"].reshape(-1).long())
    return set(batch["policy_version"].reshape(-1).tolist())


def test_staleness_aware_sampler_is_held_by_the_server(redis_server) -> None:
    prefix = "torchrl-staleness"
    sampler = StalenessAwareSampler(max_staleness=2)
    rb = replay_buffer(64, url=redis_server.url, prefix=prefix, sampler=sampler, ragged=True)
    assert rb.sampler is sampler and isinstance(sampler, StoreStalenessSampler)  # the same object, on the server
    rb.extend(_row(-1, 0).unsqueeze(0))  # the buffer's store and its keys
    td_id = rb.storage.with_store(lambda s: s.td_id)
    ctx = mp_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(redis_server.url, prefix, td_id, w, out)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    assert sorted(out.get(timeout=120) for _ in procs) == list(range(WRITERS))
    for p in procs:
        p.join(60)

    mem = TensorDictReplayBuffer(storage=LazyTensorStorage(64), sampler=StalenessAwareSampler(max_staleness=2))
    mem.extend(torch.stack([_row(-1, 0)] + [_row(w, v) for w in range(WRITERS) for v in range(VERSIONS)]))
    # (torchrl's in-memory sampler refuses rows ahead of its consumer version: negative weights)
    for consumer, bound in ((5, 2), (5, 0), (5, -1), (6, 3), (8, 3)):  # a bound, exact, none, further on
        for buf in (rb, mem):
            buf.sampler.consumer_version = consumer
            buf.sampler.max_staleness = bound
        expected = _versions(mem)
        assert _versions(rb) == expected, (consumer, bound)
        assert expected == ({v for v in range(VERSIONS) if v >= consumer - bound} if bound >= 0 else set(range(VERSIONS)))
    for buf in (rb, mem):  # every row too stale: both refuse
        buf.sampler.consumer_version, buf.sampler.max_staleness = 9, 2
        with pytest.raises(RuntimeError, match="max_staleness"):
            buf.sample(8)
    assert rb.storage.with_store(lambda s: s.policy_version) == 9  # the learner's version, published
    rb.sampler.consumer_version = 5  # backwards, as torchrl allows: published again
    assert _versions(rb) == {3, 4, 5} and rb.storage.with_store(lambda s: s.policy_version) == 5
    rb.storage.with_store(lambda s: s.clear_redis())


def test_a_custom_weighting_is_refused(redis_server) -> None:
    sampler = StalenessAwareSampler(max_staleness=1, staleness_weight_fn=lambda s: torch.ones_like(s, dtype=torch.float))
    rb = replay_buffer(16, url=redis_server.url, prefix="torchrl-staleness-fn", sampler=sampler, batch_size=4)
    rb.extend(torch.stack([_row(0, 0)] * 4))
    with pytest.raises(NotImplementedError, match="staleness_weight_fn"):
        rb.sample()
    rb.storage.with_store(lambda s: s.clear_redis())
