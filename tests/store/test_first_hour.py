"""What a new user meets in the first hour: extend's inputs, a server that is down."""

from __future__ import annotations

import pytest
import redis
import torch
from helpers import no_retry
from tensordict import TensorDict, lazy_stack, tensorclass

from tdstore import LazyStackedTensorDictStore, TensorDictStore


@tensorclass
class Step:
    obs: torch.Tensor


@pytest.mark.ring
def test_extend_takes_lists_tuples_batches_and_tensorclasses(backend):
    store = LazyStackedTensorDictStore(count=10, **backend.kwargs())
    assert store.extend([TensorDict(obs=torch.ones(2), tok=torch.arange(i + 1)) for i in range(3)]).indices.tolist() == [0, 1, 2]
    assert store.extend((TensorDict(obs=torch.ones(2), tok=torch.arange(4)),)).indices.tolist() == [3]
    assert store.extend(lazy_stack([TensorDict(obs=torch.ones(2), tok=torch.arange(1)) for _ in range(2)])).indices.tolist() == [4, 5]
    assert [store[i]["tok"].tolist() for i in range(6)] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0], [0]]
    dense = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    dense.extend(TensorDict(obs=torch.ones(2, 3), batch_size=[2]))  # a leading batch dim
    dense.extend(Step(obs=torch.full((2, 3), 2.0), batch_size=[2]))
    assert dense["obs"][:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


@pytest.mark.ring
@pytest.mark.parametrize(
    "value, error, match",
    [
        ([], ValueError, "empty"),
        ([1, 2], TypeError, "list of TensorDicts"),
        (TensorDict(obs=torch.ones(2)), ValueError, "use append"),
    ],
    ids=["empty", "junk", "one element"],
)
def test_extend_says_what_it_takes(backend, value, error, match):
    store = LazyStackedTensorDictStore(count=4, **backend.kwargs())
    with pytest.raises(error, match=match):
        store.extend(value)
    assert store.write_count == 0


def test_a_server_that_is_down_is_named_with_the_store():
    with pytest.raises(redis.ConnectionError, match=r"td_id 'gone' under prefix 'p' on redis://127\.0\.0\.1:1/0 cannot be reached"):
        TensorDictStore(batch_size=[3], url="redis://127.0.0.1:1/0", prefix="p", td_id="gone", retry=no_retry())
