"""What building a lazy stack costs in tensordict itself, with no server involved.

A heterogeneous read that returns a ``LazyStackedTensorDict`` must make one ``TensorDict`` per
element (and one per nested sub-tree of each element) and one tensor view per leaf and
element, whatever the store does. This tool times exactly that on the benchmark's elements
(``obs`` f32[64], ``action`` f32[4], ``reward`` f32[1], ``nested.b`` i64[3], ``tokens``
i64[1 + i % 17]), from columns already in memory, with tensordict's fastest constructors
(``TensorDict._new_unsafe``, ``LazyStackedTensorDict._new_lazy_unsafe``) and with its public
ones; and, as the yardstick, one dense ``TensorDict`` of the same batch (what a homogeneous read
builds). ``python -m tools.bench`` times the reads themselves; set the two side by side.

    python -m tools.lazy_floor [--reps 50]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack

PERIOD = 17


def columns(n: int) -> dict[str, torch.Tensor]:
    """The benchmark's keys for ``n`` elements, as one tensor per key (tokens back to back)."""
    lengths = torch.tensor([1 + i % PERIOD for i in range(n)])
    return {
        "obs": torch.randn(n, 64),
        "action": torch.randn(n, 4),
        "reward": torch.randn(n, 1),
        "b": torch.randint(0, 1 << 30, (n, 3)),
        "tokens": torch.randint(0, 50_000, (int(lengths.sum()),)),
        "lengths": lengths,
    }


def views(c: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """One view per element and leaf: what any lazy stack of these elements holds."""
    return [c["obs"].unbind(0), c["action"].unbind(0), c["reward"].unbind(0), c["b"].unbind(0), c["tokens"].split(c["lengths"].tolist())]


def unchecked(c: dict[str, torch.Tensor]) -> LazyStackedTensorDict:
    obs, act, rew, b, tok = views(c)
    new, empty = TensorDict._new_unsafe, torch.Size([])
    tds = [
        new(
            {"obs": obs[k], "action": act[k], "reward": rew[k], "nested": new({"b": b[k]}, batch_size=empty), "tokens": tok[k]},
            batch_size=empty,
        )
        for k in range(len(obs))
    ]
    return LazyStackedTensorDict._new_lazy_unsafe(*tds, stack_dim=0)


def public(c: dict[str, torch.Tensor]) -> LazyStackedTensorDict:
    obs, act, rew, b, tok = views(c)
    tds = [
        TensorDict({"obs": obs[k], "action": act[k], "reward": rew[k], "nested": {"b": b[k]}, "tokens": tok[k]}, batch_size=[])
        for k in range(len(obs))
    ]
    return lazy_stack(tds)


def dense(c: dict[str, torch.Tensor]) -> TensorDict:
    n = c["obs"].shape[0]
    bs = torch.Size([n])
    return TensorDict._new_unsafe(
        {"obs": c["obs"], "action": c["action"], "reward": c["reward"], "nested": TensorDict._new_unsafe({"b": c["b"]}, batch_size=bs)},
        batch_size=bs,
    )


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median of ``reps`` calls, with the cyclic GC paused during each, as tdstore's reads pause it
    (otherwise tens of thousands of new objects set off collections that walk every live object),
    and the one collection of the young objects that re-enabling it leads to counted in, as it is in
    a read's time."""
    fn()
    times = []
    for _ in range(reps):
        gc.disable()
        try:
            t = time.perf_counter()
            out = fn()
            gc.enable()
            gc.collect(0)
            times.append(time.perf_counter() - t)
        finally:
            gc.enable()
        del out
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tools.lazy_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    print(f"torch {torch.__version__}; median ms of building, from columns in memory (no server)")
    print(f"{'elements':>9} {'one view per leaf':>18} {'lazy, unchecked':>16} {'lazy, public':>13} {'dense TensorDict':>17}")
    for n in (256, 10_000):
        c = columns(n)
        reps = args.reps if n <= 256 else max(3, args.reps // 10)
        row = [median_ms(lambda c=c: views(c), reps), median_ms(lambda c=c: unchecked(c), reps), median_ms(lambda c=c: public(c), reps)]
        row.append(median_ms(lambda c=c: dense(c), reps))
        print(f"{n:>9,} {row[0]:>18.3f} {row[1]:>16.3f} {row[2]:>13.3f} {row[3]:>17.4f}")


if __name__ == "__main__":
    main()
