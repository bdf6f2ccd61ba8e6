"""The index planner on its own (no server): every plan reproduces torch's indexing exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tdstore._plan import index as _index


def random_component(rng: random.Random, size: int):
    kind = rng.choice(["int", "slice", "step", "neg", "list", "tensor", "mask", "full"])
    if kind == "int":
        return rng.randrange(-size, size)
    if kind == "slice":
        a, b = sorted(rng.randrange(-size, size + 1) for _ in range(2))
        return slice(a, b)
    if kind == "step":
        return slice(rng.choice([None, 0, 1]), None, rng.choice([2, 3]))
    if kind == "neg":
        return slice(None, None, -rng.choice([1, 2]))
    if kind == "list":
        return [rng.randrange(-size, size) for _ in range(rng.randrange(1, 4))]
    if kind == "tensor":
        return torch.tensor([rng.randrange(-size, size) for _ in range(rng.randrange(1, 4))])
    if kind == "mask":
        return torch.tensor([rng.random() < 0.5 for _ in range(size)])
    return slice(None)


def reference(grid: torch.Tensor, index) -> torch.Tensor:
    """numpy semantics (torch's, plus negative steps, which torch lacks)."""
    comps = index if isinstance(index, tuple) else (index,)
    np_index = tuple(c.numpy() if isinstance(c, torch.Tensor) else np.asarray(c) if isinstance(c, list) else c for c in comps)
    return torch.from_numpy(np.array(grid.numpy()[np_index]))


@pytest.mark.parametrize("seed", range(200))
def test_plan_matches_torch_indexing(seed):
    rng = random.Random(seed)
    inner = tuple(rng.randrange(1, 4) for _ in range(rng.randrange(0, 3)))
    count = rng.randrange(1, 7)
    stack_pos = rng.randrange(0, len(inner) + 1)
    batch = list(inner)
    batch.insert(stack_pos, count)
    batch = torch.Size(batch)
    inner_numel = int(np.prod(inner)) if inner else 1
    # storage row id of each batch position: element-major layout
    grid = torch.arange(count * inner_numel).reshape(count, *inner).movedim(0, stack_pos)
    n = rng.randrange(1, len(batch) + 1)
    index = tuple(random_component(rng, batch[d]) for d in range(n))
    if sum(1 for c in index if not isinstance(c, (int, slice))) > 1:
        sizes = {
            len(c) if isinstance(c, list) else int(c.sum()) if c.dtype == torch.bool else c.numel()
            for c in index
            if not isinstance(c, (int, slice))
        }
        if len(sizes - {1}) > 1:
            index = index[:1]  # index arrays that cannot broadcast together: an error in numpy too
    norm = _index.normalize(index, batch)
    plan = _index.plan(norm, batch, stack_pos)
    got = _index.storage_rows(plan, inner)
    want = reference(grid, index)
    assert torch.equal(got, want), (batch, stack_pos, index)
    # the planned elements cover every row the index selects (equal unless an inner dim selects nothing)
    touched = set((want // inner_numel).reshape(-1).tolist())
    assert touched <= set(plan.elements.tolist())
    if want.numel():
        assert touched == set(plan.elements.tolist())


def test_two_advanced_indices_broadcast_like_torch():
    batch = torch.Size([4, 3])
    grid = torch.arange(12).reshape(4, 3)
    index = (torch.tensor([[0], [3]]), torch.tensor([2, 0, 1]))
    plan = _index.plan(_index.normalize(index, batch), batch, 0)
    assert torch.equal(_index.storage_rows(plan, (3,)), grid[index])


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (5, "out of range"),
        (-6, "out of range"),
        ([0, 5], "5"),
        (torch.tensor([True]), "mask"),
        ((0, 0), "too many"),
        (None, "None"),
        (1.5, "unsupported"),
    ],
)
def test_normalize_rejects(index, message):
    with pytest.raises(IndexError, match=message):
        _index.normalize(index, torch.Size([5]))


def test_runs_and_packing():
    ids = np.array([0, 1, 2, 5, 7, 8])
    assert _index.runs(ids) == [(0, 2), (5, 5), (7, 8)]
    lo, hi = _index.run_bounds(ids)
    packed = np.frombuffer(_index.pack_pairs(lo, hi), dtype="<i8")
    assert packed.tolist() == [0, 2, 5, 5, 7, 8]
    assert _index.runs(np.array([], dtype=np.int64)) == []
