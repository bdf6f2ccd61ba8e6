"""The stress test's parent: setup, run, final check and report."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import queue as queue_mod
import sys
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from tensordict import lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore.cluster_server import EmbeddedCluster
from tdstore.server import EmbeddedServer, check_loopback, resolve_binary
from tools.stress.elements import MAX_EXAMPLES, RING_SLOTS, check_element, check_ring_row, initial_element, make_ring_rows
from tools.stress.workers import Layout, Tally, WorkerConfig, child_main


# ---------------------------------------------------------------------------------------------
# parent: setup, run, final check, report
# ---------------------------------------------------------------------------------------------
def final_check(store: LazyStackedTensorDictStore, layout: Layout, results: list[Tally]) -> tuple[int, int, list[str], list[str]]:
    """Every row must hold exactly its owner's last write. Returns (lost, torn, lost examples, torn examples)."""
    last: dict[int, int] = {}
    maybe: dict[int, int] = {}
    for t in results:
        last.update(t.last_seq)
        maybe.update(t.maybe_seq)
    owner = layout.owner
    full = store.to_tensordict()  # one atomic read of everything
    stamps = store["stamp"]
    lost = torn = 0
    lost_ex: list[str] = []
    torn_ex: list[str] = []
    for row, td in enumerate(full.unbind(0)):
        seq, problem = check_element(td, row, owner)
        if problem is None and tuple(stamps[row].tolist()) != (owner[row], seq):
            problem = f"row {row}: store['stamp'] holds {stamps[row].tolist()}, the full read (w{owner[row]}, seq {seq})"
        if problem is not None:
            torn += 1
            if len(torn_ex) < MAX_EXAMPLES:
                torn_ex.append(f"[final] {problem}")
            continue
        want = last.get(row, 0)
        allowed = {want} | ({maybe[row]} if maybe.get(row, -1) > want else set())
        if seq not in allowed:
            lost += 1
            if len(lost_ex) < MAX_EXAMPLES:
                lost_ex.append(f"[final] row {row}: holds seq {seq}, the owner's last write was seq {want}")
    return lost, torn, lost_ex, torn_ex


class _Inbox:
    """Messages ``(kind, name, payload)`` from the children: "ready" once set up, "result" at the end."""

    def __init__(self, procs: dict[str, Any], out: Any) -> None:
        self.procs = procs
        self.out = out
        self.ready: set[str] = set()
        self.results: dict[str, Tally] = {}
        self.gone: set[str] = set()  # died, and nothing more came from them

    def pump(self, done: Callable[[], bool], timeout: float) -> None:
        """Read messages until ``done()``, or the timeout."""
        end = time.monotonic() + timeout
        silent_before: set[str] = set()
        while not done() and time.monotonic() < end:
            try:
                kind, name, payload = self.out.get(timeout=0.2)
            except queue_mod.Empty:
                # a dead child's messages are in the pipe before it exits: silent twice means gone
                silent = {n for n, p in self.procs.items() if not p.is_alive() and n not in self.results}
                self.gone |= silent & silent_before
                silent_before = silent
                continue
            self.ready.add(name)
            if kind == "result":
                self.results[name] = payload

    def all_ready(self) -> bool:
        return all(n in self.ready or n in self.gone for n in self.procs)

    def all_reported(self) -> bool:
        return all(n in self.results or n in self.gone for n in self.procs)


def _start_server(args: argparse.Namespace) -> tuple[str, dict[str, Any], EmbeddedServer | None, EmbeddedCluster | None]:
    """The URL to test (``--url``, else a private cluster or server started here), what to report of it, and what to stop."""
    server: EmbeddedServer | None = None
    cluster: EmbeddedCluster | None = None
    if args.url:
        check_loopback(args.url)
        url = args.url
        server_info: dict[str, Any] = {"url": url, "embedded": False}
    elif args.cluster:
        cluster = EmbeddedCluster(binary=resolve_binary(args.binary)).start()
        url = cluster.url
        server_info = {
            "url": url,
            "embedded": True,
            "binary": cluster.servers[0].binary,
            "version": f"{cluster.version}, cluster of 3 primaries",
        }
    else:
        server = EmbeddedServer(binary=resolve_binary(args.binary)).start()
        url = server.url
        server_info = {"url": url, "embedded": True, "binary": server.binary, "version": server.version}
    return url, server_info, server, cluster


def _join_children(procs: dict[str, Any], results_by_name: dict[str, Tally], setup_errors: list[str]) -> None:
    """Wait for every child once stopped; one that hangs is terminated, one without a report noted."""
    for name, p in procs.items():
        p.join(timeout=30)
        if p.is_alive():  # hung: stop it (it is ours)
            p.terminate()
            p.join(timeout=5)
            if name not in results_by_name:
                setup_errors.append(f"{name}: did not stop within the time bound; terminated")
        elif name not in results_by_name:
            setup_errors.append(f"{name}: exited with code {p.exitcode} without a report")


def final_ring_check(ring: LazyStackedTensorDictStore, writers: int, results: list[Tally]) -> tuple[int, int, list[str], list[str]]:
    """Every slot holds a whole row, and the ring's write counter moved by exactly the rows extended
    (between the rows that surely went in and those that may have). Returns (lost, torn, examples...)."""
    torn_ex = [
        p
        for k, td in enumerate(ring.to_tensordict().unbind(0))
        if int(td["stamp"][0]) >= 0 and (p := check_ring_row(td, f"[final] ring slot {k}", writers))
    ]
    sure, maybe = sum(t.ring_rows for t in results), sum(t.ring_maybe for t in results)
    counted = ring.write_count - RING_SLOTS  # the first extend of a store filled by index starts at rw = count
    lost_ex = (
        []
        if sure <= counted <= sure + maybe
        else [f"[final] the ring's write counter moved by {counted} rows; writers extended {sure} (+{maybe} unsure)"]
    )
    return len(lost_ex), len(torn_ex), lost_ex, torn_ex[:MAX_EXAMPLES]


def _clean_up(
    stop: Any,
    procs: dict[str, Any],
    store: LazyStackedTensorDictStore | None,
    server: EmbeddedServer | None,
    cluster: EmbeddedCluster | None,
    ring: LazyStackedTensorDictStore | None = None,
) -> None:
    """Stop the children still running (only after a failure of the parent), delete the store, stop our server."""
    if stop is not None:
        stop.set()
    for p in procs.values():
        p.join(timeout=5 if p.is_alive() else 0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for st in (store, ring):
        if st is not None:
            try:
                st.clear_redis()
                st.close()
            except Exception:
                pass
    if server is not None:
        server.stop()
    if cluster is not None:
        cluster.stop()


def run_stress(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole test and return the figures (see ``--json``)."""
    layout = Layout(args.writers, args.rows_per_writer)
    started = time.time()
    url, server_info, server, cluster = _start_server(args)
    prefix = f"tdstore-stress-{uuid.uuid4().hex[:12]}"
    store: LazyStackedTensorDictStore | None = None
    ring: LazyStackedTensorDictStore | None = None
    procs: dict[str, Any] = {}
    stop: Any = None
    try:
        stack = lazy_stack([initial_element(o, r) for r, o in enumerate(layout.owner)], 0)
        store = LazyStackedTensorDictStore.from_lazy_stack(
            stack, url=url, prefix=prefix, segment_bytes=args.segment_bytes, spread=args.spread
        )
        server_info["segments"] = store._engine.header.segments.n
        server_info["spread"] = store._engine.header.spread
        server_info["row_block"] = [".".join(leaf.path) for leaf in store._engine.header.grouped()]
        if args.ring_writers:
            # slots no extend reached yet hold stamp (-1, 0, 0): readers skip them
            blank = make_ring_rows(0, 0, RING_SLOTS).zero_()
            blank["stamp"][:, 0] = -1
            ring = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(list(blank.unbind(0)), 0), url=url, prefix=f"{prefix}-ring")
        cfg = WorkerConfig(
            pickle.dumps(store),
            layout,
            args.seconds,
            args.max_ops,
            args.max_errors,
            args.seed,
            args.schema_interval,
            args.fault,
            pickle.dumps(ring) if ring is not None else b"",
            args.ring_writers,
        )
        procs, go, stop, out = _children(args, cfg)
        for p in procs.values():
            p.start()
        inbox = _Inbox(procs, out)
        inbox.pump(inbox.all_ready, args.startup_timeout)
        setup_errors = [
            f"{n}: not ready within {args.startup_timeout:g} s (exit code {p.exitcode})" for n, p in procs.items() if n not in inbox.ready
        ]
        t0 = time.monotonic()
        go.set()
        while time.monotonic() - t0 < args.seconds and any(p.is_alive() for p in procs.values()):
            time.sleep(min(0.2, max(0.0, args.seconds - (time.monotonic() - t0))))
        stop.set()
        run_seconds = time.monotonic() - t0
        inbox.pump(inbox.all_reported, args.seconds + 60)
        results_by_name = inbox.results
        _join_children(procs, results_by_name, setup_errors)
        results = [results_by_name[n] for n in procs if n in results_by_name]
        final = _final_checks(store, ring, layout, args.ring_writers, results, setup_errors)
    finally:
        _clean_up(stop, procs, store, server, cluster, ring)
    return _figures(args, layout, server_info, results, run_seconds, time.time() - started, final, setup_errors)


def _children(args: argparse.Namespace, cfg: WorkerConfig) -> tuple[dict[str, Any], Any, Any, Any]:
    """The child processes of every role (not started yet), and the events and queue they share."""
    ctx = mp.get_context(args.start_method)
    if args.start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "tensordict", "tdstore"])
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    roles = [("writer", w) for w in range(args.writers)] + [("reader", r) for r in range(args.readers)]
    if args.schema_races:
        roles.append(("schema", 0))
    roles += [("ringwriter", w) for w in range(args.ring_writers)] + [("ringreader", r) for r in range(args.ring_readers)]
    procs = {
        f"{role}{i}": ctx.Process(target=child_main, args=(role, i, cfg, go, stop, out), name=f"stress-{role}{i}", daemon=True)
        for role, i in roles
    }
    return procs, go, stop, out


class _Final(NamedTuple):
    """What the final checks of the store (and the ring) found after the run."""

    lost: int
    torn: int
    lost_ex: list[str]
    torn_ex: list[str]
    tb: str | None = None


def _final_checks(store: Any, ring: Any, layout: Layout, ring_writers: int, results: list[Tally], setup_errors: list[str]) -> _Final:
    """The whole store (and ring) checked against what the writers report; a failing check is a harness error."""
    try:
        lost, torn, lost_ex, torn_ex = final_check(store, layout, results)
        if ring is not None:
            r_lost, r_torn, r_lost_ex, r_torn_ex = final_ring_check(ring, ring_writers, results)
            lost, torn, lost_ex, torn_ex = lost + r_lost, torn + r_torn, lost_ex + r_lost_ex, torn_ex + r_torn_ex
        return _Final(lost, torn, lost_ex, torn_ex)
    except Exception:
        setup_errors.append(f"final check: {traceback.format_exception_only(sys.exc_info()[1])[-1].strip()}")
        return _Final(0, 0, [], [], traceback.format_exc())


def _figures(
    args: argparse.Namespace,
    layout: Layout,
    server_info: dict[str, Any],
    results: list[Tally],
    run_seconds: float,
    wall_seconds: float,
    final: _Final,
    setup_errors: list[str],
) -> dict[str, Any]:
    final_lost, final_torn, final_lost_ex, final_torn_ex, final_tb = final
    ops: Counter = Counter()
    max_ms: dict[str, float] = {}
    error_kinds: Counter = Counter()
    torn_ex: list[str] = []
    lost_ex: list[str] = []
    first_tb = None
    for t in results:
        ops.update(t.ops)
        for k, v in t.max_ms.items():
            max_ms[k] = max(max_ms.get(k, 0.0), v)
        error_kinds.update(t.error_kinds)
        torn_ex += t.torn_examples
        lost_ex += t.regress_examples
        first_tb = first_tb or t.first_traceback
    for e in setup_errors:
        error_kinds[f"harness: {e}"] += 1
    first_tb = first_tb or final_tb
    torn_seen = sum(t.torn for t in results)
    regressed = sum(t.regressed for t in results)
    errors = sum(t.errors for t in results) + len(setup_errors)
    figures = {
        "ok": torn_seen + final_torn == 0 and regressed + final_lost == 0 and errors == 0,
        "ops": dict(sorted(ops.items())),
        "ops_total": sum(ops.values()),
        "writes_total": sum(v for k, v in ops.items() if k.startswith("write.")),
        "reads_total": sum(v for k, v in ops.items() if k.startswith("read.")),
        "schema_total": sum(v for k, v in ops.items() if k.startswith("schema.")),
        "ops_per_second": {k: round(v / run_seconds, 1) for k, v in sorted(ops.items())} if run_seconds > 0 else {},
        "max_latency_ms": {k: round(v, 2) for k, v in sorted(max_ms.items())},
        "ring_extends": dict(sum((t.ring_paths for t in results), Counter())),
        "torn": torn_seen + final_torn,
        "torn_seen_by_readers": torn_seen,
        "torn_final": final_torn,
        "lost": regressed + final_lost,
        "regressed_seen_by_readers": regressed,
        "lost_final": final_lost,
        "errors": errors,
        "error_kinds": dict(error_kinds.most_common()),
        "first_traceback": first_tb,
        "torn_examples": (torn_ex + final_torn_ex)[: 2 * MAX_EXAMPLES],
        "lost_examples": (lost_ex + final_lost_ex)[: 2 * MAX_EXAMPLES],
        "config": _config(args, layout),
        "server": server_info,
        "run_seconds": round(run_seconds, 3),
        "wall_seconds": round(wall_seconds, 3),
    }
    return figures


def _config(args: argparse.Namespace, layout: Layout) -> dict[str, Any]:
    """The run's settings, as the figures report them."""
    return {
        "writers": args.writers,
        "readers": args.readers,
        "seconds": args.seconds,
        "rows": layout.count,
        "rows_per_writer": args.rows_per_writer,
        "writer_kinds": {f"writer{w}": list(layout.kinds(w)) for w in range(args.writers)},
        "schema_races": args.schema_races,
        "schema_interval": args.schema_interval if args.schema_races else None,
        "max_ops": args.max_ops,
        "seed": args.seed,
        "start_method": args.start_method,
        "fault": args.fault,
        "ring_writers": args.ring_writers,
        "ring_readers": args.ring_readers,
    }


def report(fig: dict[str, Any]) -> str:
    """The human-readable summary."""
    c, s = fig["config"], fig["server"]
    where = f"redis {s['version']} ({s['binary']})" if s.get("embedded") else s["url"]
    lines = [
        f"tdstore stress: {c['writers']} writers, {c['readers']} readers{', schema races' if c['schema_races'] else ''}, "
        f"{fig['run_seconds']:.1f} s, {c['rows']} rows in {s.get('segments', 1)} segment(s)"
        f"{' spread over the nodes' if s.get('spread') else ''}, "
        f"row block {', '.join(s.get('row_block', [])) or '-'}, server {where}",
        "operations:",
    ]
    for kind, n in fig["ops"].items():
        lines.append(
            f"  {kind:<15} {n:>9}  ({fig['ops_per_second'].get(kind, 0):>8.1f}/s, max {fig['max_latency_ms'].get(kind, 0):.1f} ms)"
        )
    lines.append(f"  {'total':<15} {fig['ops_total']:>9}")
    if fig["ring_extends"]:
        paths = ", ".join(f"{k} {v}" for k, v in sorted(fig["ring_extends"].items()))
        lines.append(f"ring extends:    {paths} (direct: rows as SETRANGEs; else through write.lua)")
    lines.append(f"torn elements:   {fig['torn']} (seen by readers {fig['torn_seen_by_readers']}, final check {fig['torn_final']})")
    lines.append(
        f"lost/regressed:  {fig['lost']} (regressions seen by readers {fig['regressed_seen_by_readers']}, final check {fig['lost_final']})"
    )
    lines.append(f"errors:          {fig['errors']}")
    for kind, n in list(fig["error_kinds"].items())[:10]:
        lines.append(f"  {n:>7} x {kind}")
    for ex in fig["torn_examples"]:
        lines.append(f"  torn: {ex}")
    for ex in fig["lost_examples"]:
        lines.append(f"  lost: {ex}")
    if fig["first_traceback"]:
        lines.append("first traceback:")
        lines.append(fig["first_traceback"].rstrip())
    lines.append(f"result: {'PASS' if fig['ok'] else 'FAIL'}")
    return "\n".join(lines)
