import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore, TensorDictStore


def test_round_trip(backend):
    local = lazy_stack([TensorDict(x=torch.arange(3 + i, dtype=torch.float32), y=torch.full((2,), float(i))) for i in range(4)])
    store = TensorDictStore.from_tensordict(local, **backend.kwargs())
    assert isinstance(store, LazyStackedTensorDictStore)
    for i in range(4):
        assert torch.equal(store[i]["x"], local[i]["x"])
    store.clear_redis()
    assert backend.keys() == []
