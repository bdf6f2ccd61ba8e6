#!/usr/bin/env python3
"""What a script's helpers cost the server: every helper of the libraries, or only those it uses.

Each ``EVALSHA`` runs the whole script text, making every top-level helper of ``_lib.lua``
(and ``_tree.lua``, ``_lease.lua``) again; ``tdstore/_engine/script_text.py`` sends only the
helpers a script uses. This runs the same calls with both texts, alternating rounds on one
private server: the server's microseconds per ``EVALSHA`` (``INFO commandstats``) of an element
write, an element read and a 500-row ``extend`` (both ends of ``direct.lua``), and the element
write's wall time against the raw floor (one pipeline of plain ``SETRANGE``s of the same bytes).

Usage::

    python -m tools.helpers_cost [--rounds 6] [--calls 400] [--count 10000] [--binary PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from tensordict import TensorDict

import tdstore._engine.scripts as _scripts
import tdstore._ring.direct_extend as _direct
from tdstore import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer
from tools.bench.workload import TOKENS_PERIOD, RawFloor, make_element, make_stack, raw_layout

MODES = ("every helper", "helpers used")


def _every_helper(libraries: list[str], script: str) -> str:
    return "".join(lib + "\n" for lib in libraries) + script


@contextmanager
def texts(mode: str) -> Iterator[None]:
    """Scripts sent with ``mode``'s text (new SHA1s: the server loads them on first use)."""
    real = _scripts.assemble
    if mode == MODES[0]:
        _scripts.assemble = _every_helper
    _scripts.script_source.cache_clear()
    _direct._LOADED_ON.clear()
    try:
        yield
    finally:
        _scripts.assemble = real
        _scripts.script_source.cache_clear()
        _direct._LOADED_ON.clear()


def evalsha_usec(admin: Any, run: Callable[[int], Any], calls: int) -> float:
    """Server microseconds per EVALSHA over ``calls`` runs (commandstats reset first)."""
    admin.config_resetstat()
    for i in range(calls):
        run(i)
    return float(admin.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call", 0.0))


def one_round(url: str, admin: Any, count: int, calls: int, het: bool) -> dict[str, float]:
    """Server time of each call kind, and the element write's wall time over the raw floor's."""
    stack = make_stack(count, het, 0)
    store = LazyStackedTensorDictStore.from_lazy_stack(stack, url=url)
    raw = RawFloor(admin, "helpers-cost-raw", raw_layout(stack))
    raw.upload()
    gen = torch.Generator().manual_seed(1)
    args = []
    for k in range(calls):
        i = (k * 7919) % count
        td = make_element(i, het, gen, 1 + i % TOKENS_PERIOD)
        args.append((i, td, raw.write_ops(i, td)))
    ring = LazyStackedTensorDictStore(count=10 * 500, url=url)
    rows = TensorDict(obs=torch.randn(500, 64), action=torch.randn(500, 4), reward=torch.randn(500, 1), batch_size=[500])
    ring.extend(rows)
    out = {
        "write_us": evalsha_usec(admin, lambda k: store.__setitem__(args[k][0], args[k][1]), calls),
        "read_us": evalsha_usec(admin, lambda k: store[args[k][0]].to_tensordict(), calls),
        "extend_us": evalsha_usec(admin, lambda k: ring.extend(rows), max(10, calls // 5)),
    }
    mine, floor = [], []
    for i, td, ops in args:
        t = time.perf_counter()
        store[i] = td
        mine.append(time.perf_counter() - t)
        t = time.perf_counter()
        raw.write(ops)
        floor.append(time.perf_counter() - t)
    out["write_vs_floor"] = statistics.median(mine) / statistics.median(floor)
    store.clear_redis()
    ring.clear_redis()
    raw.drop("helpers-cost-raw")
    return out


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per mode, alternating (default 6)")
    ap.add_argument("--calls", type=int, default=400, help="calls of each kind per round (default 400)")
    ap.add_argument("--count", type=int, default=10_000, help="elements of the store written (default 10,000)")
    ap.add_argument("--heterogeneous", action="store_true", help="the benchmark's heterogeneous stack")
    ap.add_argument("--binary", default=None, help="redis-server to start (default: found as the tests find it)")
    args = ap.parse_args(argv)
    got: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    with EmbeddedServer(binary=args.binary) as server:
        admin = server.client()
        print(f"server: {admin.info('server')['redis_version']}; {args.rounds} rounds of {args.calls} calls, alternating")
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                with texts(mode):
                    for k, v in one_round(server.url, admin, args.count, args.calls, args.heterogeneous).items():
                        got[mode].setdefault(k, []).append(v)
    result = {m: {k: statistics.median(v) for k, v in kinds.items()} for m, kinds in got.items()}
    for m in MODES:
        r = result[m]
        print(
            f"{m:<13} server us per EVALSHA: element write {r['write_us']:6.1f}  element read {r['read_us']:6.1f}  "
            f"extend(500) {r['extend_us']:6.1f};  element write / raw floor {r['write_vs_floor']:.2f}x"
        )
    return result


if __name__ == "__main__":
    main()
