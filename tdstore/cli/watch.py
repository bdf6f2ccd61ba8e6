"""``tdstore top`` and ``tdstore metrics``: the rings of a prefix while they run, for a person and for Prometheus.

Both read every store's counters and state (``tdstore.inspect_store.ring_stats``: one round trip per store, reads
only) of the stores under ``--prefix`` (those named, or every one in the prefix's registry); a sharded
ring's shards are stores of their own (``<ring>~s<k>.<j>``), shown per shard under the ring's id. Rates
are counter deltas over the seconds between two reads. Torch-free, as every store command.
"""

from __future__ import annotations

import argparse
import select
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tdstore.cli.arg_types import interval_seconds, port_number
from tdstore.cli.output import EXIT_FAILED, EXIT_OK, safe, table
from tdstore.cli.stores import add_server_options, connect_or_exit

__all__ = ["add_watch_commands", "prometheus_text", "top_frame"]

#: Counters shown as rates by ``top`` (stats key, column).
_RATES = (("inserted", "INS/S"), ("sampled", "SMP/S"), ("popped", "POP/S"), ("acknowledged", "ACK/S"))

#: ``metrics``: (name, stats key, type, help). Counters end in ``_total``, as Prometheus names them.
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("tdstore_inserted_total", "inserted", "counter", "Rows written into the ring by extend/append."),
    ("tdstore_sampled_total", "sampled", "counter", "Rows drawn by sample."),
    ("tdstore_popped_total", "popped", "counter", "Items handed out by pop (redeliveries included)."),
    ("tdstore_acknowledged_total", "acknowledged", "counter", "Leased items settled by ack."),
    ("tdstore_redelivered_total", "redelivered", "counter", "Items popped again after their lease lapsed."),
    ("tdstore_expired_total", "expired", "counter", "Items whose lease lapsed."),
    ("tdstore_lost_total", "lost", "counter", "Unread items writers overwrote."),
    ("tdstore_stale_total", "stale", "counter", "Rows pops with max_staleness dropped as too old."),
    ("tdstore_held_writes_total", "held_writes", "counter", "Writes the rate limiter or a full queue held back (WAIT replies)."),
    ("tdstore_held_samples_total", "held_samples", "counter", "Samples the rate limiter or min_size held back (WAIT replies)."),
    ("tdstore_held_writes_seconds_total", "held_writes_ms", "counter", "Seconds writes that went through had been held back first."),
    ("tdstore_held_samples_seconds_total", "held_samples_ms", "counter", "Seconds samples that went through had been held back first."),
    ("tdstore_held_pops_seconds_total", "held_pops_ms", "counter", "Seconds pops that went through had waited for items first."),
    ("tdstore_sample_age_rows_total", "age_rows", "counter", "Sampled rows whose age was measured."),
    ("tdstore_sample_age_sum_total", "age_sum", "counter", "Sum of the ages (in ring writes) of the rows sampled."),
    ("tdstore_sample_age_max", "age_max", "gauge", "Oldest row sampled so far, in ring writes."),
    ("tdstore_sampled_age_versions_rows_total", "age_versions_rows", "counter", "Rows sampled or popped, aged in policy versions."),
    ("tdstore_sampled_age_versions_sum_total", "age_versions_sum", "counter", "Sum of those rows' ages in policy versions."),
    ("tdstore_sampled_age_versions_max", "age_policy_versions_max", "gauge", "Oldest row sampled or popped so far, in policy versions."),
    ("tdstore_distinct_sampled_total", "distinct_sampled", "counter", "Rows sampled at least once (a ring write is a row; opt-in)."),
    ("tdstore_overwritten_unsampled_total", "overwritten_unsampled", "counter", "Rows overwritten without ever being sampled."),
    ("tdstore_sampled_resident", "sampled_resident", "gauge", "Rows the ring holds now that were sampled at least once."),
    ("tdstore_capacity", "capacity", "gauge", "Slots of the ring."),
    ("tdstore_written", "written", "gauge", "Items the ring holds."),
    ("tdstore_write_count_total", "write_count", "counter", "Ring writes so far (all laps)."),
    ("tdstore_unread", "unread", "gauge", "Items no pop took yet."),
    ("tdstore_leased", "leased", "gauge", "Items under a live lease."),
    ("tdstore_awaiting_redelivery", "awaiting_redelivery", "gauge", "Items whose lease lapsed, waiting for the next pop."),
    ("tdstore_waiting_clients", "waiting", "gauge", "Clients waiting on the store's channel (limiter, data or room)."),
    ("tdstore_limiter_room", "limiter.room", "gauge", "Samples the rate limiter allows before it holds them (negative: held)."),
    ("tdstore_priority_total", "priority.total", "gauge", "Total priority mass (sum of priority ** alpha)."),
    ("tdstore_priority_max", "priority.max_priority", "gauge", "Largest priority given so far."),
)


@dataclass
class Row:
    """One store's reading: the ring it belongs to, its shard (None: not a shard) and its stats."""

    store: str
    shard: int | None
    td_id: str
    stats: dict[str, Any] | None  # None: gone or unreadable
    error: str = ""


def collect(client: Any, prefix: str, names: Sequence[str], cluster: bool) -> list[Row]:
    """Every store of ``prefix`` (or those ``names`` name: a sharded ring's id stands for its shards), read now."""
    from tdstore.inspect_store import registered_ids, ring_stats, shard_of_id

    ids = registered_ids(client, prefix)
    if names:
        ids = [i for i in ids if i in names or (shard_of_id(i) or ("",))[0] in names]
    rows = []
    for td_id in ids:
        found = shard_of_id(td_id)
        try:
            got: dict[str, Any] | None = ring_stats(client, prefix, td_id, cluster=cluster)
            error = ""
        except KeyError:
            got, error = None, "gone"
        except Exception as err:  # a damaged header, a wrong type: shown on its row, the others go on
            got, error = None, f"{type(err).__name__}: {err}"
        rows.append(Row(found[0] if found else td_id, found[1] if found else None, td_id, got, error))
    return rows


def _rate(now: Row, before: dict[str, Row], key: str, seconds: float) -> str:
    old = before.get(now.td_id)
    if now.stats is None or old is None or old.stats is None or seconds <= 0:
        return "-"
    return f"{max(0, now.stats[key] - old.stats[key]) / seconds:.1f}"


def _limiter(s: dict[str, Any]) -> str:
    lim = s["limiter"]
    if lim is None:
        return "queue" if s["queue"] else "-"
    room = lim["room"]
    return f"{'HOLD' if room < 0 else 'ok'} room {room:g}"


def _count(v: Any) -> str:
    """A counter's cell: '-' for one the store does not keep (distinct rows while not tracked)."""
    return "-" if v is None else str(v)


def top_frame(rows: list[Row], before: dict[str, Row], seconds: float, where: str, prefix: str) -> list[str]:
    """The lines of one frame of ``top``: a title, then a row per store (per shard), rates over ``seconds``."""
    head = ["STORE", "SHARD", "FILL", *(c for _, c in _RATES), "HELD W/S", "AGE", "AGE V", "DISTINCT", "UNSAMPLED", "LIMITER", "WAITING"]
    lines = []
    for r in rows:
        s = r.stats
        shard = "-" if r.shard is None else str(r.shard)
        if s is None:
            lines.append([safe(r.store), shard, r.error, *("-" for _ in _RATES), "-", "-", "-", "-", "-", "-", "-"])
            continue
        age = "-" if s["age_mean"] is None else f"{s['age_mean']:.1f}/{s['age_max']}"
        age_v = "-" if s["age_policy_versions"] is None else f"{s['age_policy_versions']:.1f}/{s['age_policy_versions_max']}"
        lines.append(
            [safe(r.store), shard, f"{s['written']}/{s['capacity']}", *(_rate(r, before, k, seconds) for k, _ in _RATES),
             f"{s['held_writes']}/{s['held_samples']}", age, age_v, _count(s["distinct_sampled"]), _count(s["overwritten_unsampled"]),
             _limiter(s), "-" if s["waiting"] is None else str(s["waiting"])]
        )  # fmt: skip
    title = f"tdstore top: {len(rows)} stores under prefix {safe(prefix)!r} on {where}, {time.strftime('%H:%M:%S')} (q quits)"
    return [title, *table(head, lines, right={2, 3, 4, 5, 6, 10, 11})] if lines else [title, "(no store)"]


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(s: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        s = s.get(part) if isinstance(s, dict) else None  # type: ignore[assignment]
    return s


def prometheus_text(rows: list[Row], prefix: str) -> str:
    """The readings in Prometheus' text exposition format: each metric's HELP and TYPE, then one sample per
    store (labels ``prefix``, ``store``, ``shard``: empty for a store that is not a shard)."""
    out = []
    for name, key, kind, text in METRICS:
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for r in rows:
            v = None if r.stats is None else _value(r.stats, key)
            if v is None:
                continue
            if key.endswith("_ms"):  # Prometheus' unit is the second
                v = v / 1000.0
            labels = f'prefix="{_label(prefix)}",store="{_label(r.store)}",shard="{"" if r.shard is None else r.shard}"'
            out.append(f"{name}{{{labels}}} {float(v):.17g}" if isinstance(v, float) else f"{name}{{{labels}}} {int(v)}")
    return "\n".join(out) + "\n"


def _cmd_top(args: argparse.Namespace) -> int:
    import redis

    conn = connect_or_exit("top", args.url)
    if isinstance(conn, int):
        return conn
    cluster = type(conn.client).__name__ == "RedisCluster"
    with conn:
        try:
            read = lambda: collect(conn.client, args.prefix, args.td_ids, cluster)  # noqa: E731
            if args.once:
                first, t0 = read(), time.monotonic()
                time.sleep(args.interval)
                rows = read()
                print("\n".join(top_frame(rows, {r.td_id: r for r in first}, time.monotonic() - t0, conn.where, args.prefix)))
                return EXIT_OK
            return _live(read, args.interval, conn.where, args.prefix)
        except redis.RedisError as err:
            print(f"tdstore top: failed: the server at {conn.where} answered with an error: {conn.scrub(str(err))}", file=sys.stderr)
            return EXIT_FAILED


def _live(read: Callable[[], list[Row]], interval: float, where: str, prefix: str) -> int:
    """Redraw a frame every ``interval`` seconds until ``q`` (or Ctrl-C); the terminal is put back as it was."""
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = None
    if fd is not None:
        import termios
        import tty

        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
    before: dict[str, Row] = {}
    t0 = time.monotonic()
    try:
        sys.stdout.write("\x1b[?25l")  # no cursor while it redraws
        while True:
            rows, now = read(), time.monotonic()
            frame = top_frame(rows, before, now - t0, where, prefix)
            sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(frame) + "\n")
            sys.stdout.flush()
            before, t0 = {r.td_id: r for r in rows}, now
            deadline = now + interval
            while (left := deadline - time.monotonic()) > 0:
                if fd is None:
                    time.sleep(left)
                    break
                ready, _, _ = select.select([fd], [], [], left)
                if ready and sys.stdin.read(1) in ("q", "Q"):
                    return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        sys.stdout.write("\x1b[?25h")
        sys.stdout.flush()
        if fd is not None and saved is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _cmd_metrics(args: argparse.Namespace) -> int:
    import redis

    conn = connect_or_exit("metrics", args.url)
    if isinstance(conn, int):
        return conn
    cluster = type(conn.client).__name__ == "RedisCluster"
    with conn:
        if args.port is None:
            try:
                sys.stdout.write(prometheus_text(collect(conn.client, args.prefix, args.td_ids, cluster), args.prefix))
            except redis.RedisError as err:
                failed = f"the server at {conn.where} answered with an error: {conn.scrub(str(err))}"
                print(f"tdstore metrics: failed: {failed}", file=sys.stderr)
                return EXIT_FAILED
            return EXIT_OK
        return _serve(conn, args, cluster)


def _serve(conn: Any, args: argparse.Namespace, cluster: bool) -> int:
    """Serve ``/metrics`` on ``args.host:args.port`` until interrupted (one reading per scrape)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    lock = threading.Lock()  # one reading at a time on the one connection

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            try:
                with lock:
                    body = prometheus_text(collect(conn.client, args.prefix, args.td_ids, cluster), args.prefix).encode()
            except Exception as err:
                self.send_error(503, f"cannot read the server: {type(err).__name__}")
                print(f"tdstore metrics: scrape failed: {conn.scrub(str(err))}", file=sys.stderr)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *a: Any) -> None:  # no line per scrape
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    where = f"stores under prefix {args.prefix!r} on {conn.where}"
    print(f"tdstore metrics: serving http://{host}:{port}/metrics ({where})", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return EXIT_OK


def add_watch_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The parsers of ``top`` and ``metrics`` on ``sub``."""
    top = sub.add_parser(
        "top",
        help="a live view of the rings under a prefix: fill, rates, limiter, waiting clients, per shard",
        description=(
            "Every store under the prefix (or the TD_IDs named; a sharded ring's id shows its shards), redrawn every "
            "second: fill, inserts/samples/pops/acks per second, WAIT replies of writers and samplers, the mean and "
            "largest age (in ring writes) of the rows sampled, in policy versions of those sampled or popped (AGE V, rollouts), "
            "rows sampled at least once (DISTINCT) and rows "
            "overwritten without being sampled (UNSAMPLED), the rate limiter, clients waiting. q quits."
        ),
    )
    top.add_argument("td_ids", nargs="*", metavar="TD_ID", help="stores to show (default: every store of the prefix)")
    top.add_argument("--once", action="store_true", help="print one frame (rates over one interval) and exit")
    top.add_argument("--interval", type=interval_seconds, default=1.0, help="seconds between frames (default: 1)")
    add_server_options(top, json_help=None)
    top.set_defaults(handler=_cmd_top)
    metrics = sub.add_parser(
        "metrics",
        help="the rings' counters in Prometheus' text format (--once, or served on --port)",
        description=(
            "The counters and state of every store under the prefix (or the TD_IDs named) as tdstore_* metrics with "
            "labels prefix, store and shard: --once prints them, --port P serves them at http://HOST:P/metrics."
        ),
    )
    metrics.add_argument("td_ids", nargs="*", metavar="TD_ID", help="stores to export (default: every store of the prefix)")
    how = metrics.add_mutually_exclusive_group(required=True)
    how.add_argument("--once", action="store_true", help="print the metrics once to stdout")
    how.add_argument("--port", type=port_number, default=None, help="serve /metrics on this port (0: any free port, printed on stderr)")
    metrics.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    add_server_options(metrics, json_help=None)
    metrics.set_defaults(handler=_cmd_metrics)
