"""The ``tdstore`` command line (``python -m tdstore``).

One subcommand per task: ``demo`` (concurrent writers never tear an element),
``ls``/``info``/``rm`` (the stores of a prefix on a server), ``bench`` (the
benchmark of the source tree).  This module only parses and formats; what is
read from the server comes from :mod:`tdstore.inspect_store`.

``ls``, ``info`` and ``rm`` connect to ``--url``, else ``$TDSTORE_URL``, else
``redis://localhost:6379/0``, with the password of the URL, else
``$TDSTORE_PASSWORD`` (the rule of :mod:`tdstore._connection`).  Server addresses
are printed without credentials, and names read from the server are printed with
control characters escaped.  Sizes are shown in B/KiB/MiB/GiB and times to live
with a unit; ``--bytes`` prints exact byte counts (``--json`` always has raw numbers).

``--help``, ``ls``, ``info`` and ``rm`` never import torch or tensordict (they
read headers with :mod:`tdstore._headerinfo`), so they answer at once; ``demo``
and ``bench`` import what they need when they run.

Exit codes:

* 0 success;
* 1 the demo saw a torn or inconsistent element (or an actor failed); ``info``
  or ``rm`` found a header it cannot read; ``rm`` was answered "no" or the store
  is still being uploaded; the server failed during a command;
* 2 a usage error (contradictory flags included), an invalid or unreachable server
  URL, a server that needs a password (or refused the one given), an unknown store id,
  ``rm`` without ``--yes`` when stdin is not a terminal, or ``bench`` run from an
  installed package (the benchmark ships with the source tree only);
* ``bench`` otherwise exits with the benchmark's own code;
* 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .inspect_store import ServerConnection, StoreInfo

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _positive_int(text: str) -> int:
    """argparse type: refuse 0 and negatives with a message naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    """argparse type: a duration in seconds, strictly positive."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; with --json, stdout holds only the JSON (the summary goes to stderr)."""
    # Each subcommand imports what it needs when it runs, so adding subcommands keeps the others as quick to start.
    import redis

    from .demo import DemoError, ServerUnreachable, run_demo

    try:
        figures = run_demo(
            url=args.url,
            actors=args.actors,
            count=args.count,
            seconds=args.seconds,
            batch=args.batch,
            progress=not args.no_progress,
            out=sys.stderr if args.json else sys.stdout,
            cluster=args.cluster,
            spread=args.spread,
            torchrl=args.torchrl,
            replay=args.replay,
        )
    except ServerUnreachable as err:
        print(f"tdstore demo: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as err:
        print(f"tdstore demo: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except DemoError as err:
        print(f"tdstore demo: failed: {err}", file=sys.stderr)
        return EXIT_FAILED
    except redis.RedisError as err:  # e.g. the server went away during the run
        print(f"tdstore demo: failed: the server stopped answering: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(figures, indent=2))
    return EXIT_OK if figures["ok"] else EXIT_FAILED


# -- ls / info / rm --------------------------------------------------------------------------------

DEFAULT_PREFIX = "tensordict"


def _safe(text: str) -> str:
    """``text`` with non-printable characters escaped: ids and key names come from the server,
    and an escape sequence in one must not reach the terminal as a command."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned columns (columns in ``right`` right-aligned), two spaces apart, no trailing blanks."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(n: int) -> str:
    """``n`` bytes as a person reads them: ``512 B``, ``1.5 KiB``, ``23 MiB`` (3 significant digits)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def human_duration(ms: int) -> str:
    """A time to live with its unit: ``45s``, ``12m05s``, ``3h20m``, ``2d03h``; below a minute in whole seconds
    rounded up (a store that has 0.4 s left is not shown as 0s)."""
    seconds = math.ceil(ms / 1000)
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _size(n: int, raw: bool) -> str:
    return str(n) if raw else human_size(n)


def _ls_ttl(info: StoreInfo) -> str:
    """The time to live with a unit, or ``-`` for a store without one."""
    return "-" if info.ttl_ms is None else human_duration(info.ttl_ms)


def _state_text(state: str) -> str:
    """``uploading:<token>`` is shown as ``uploading``: the token means nothing to a reader."""
    return "uploading" if state.startswith("uploading") else _safe(state)


def _connect(command: str, url: str | None) -> ServerConnection | int:
    """The connection, or the exit code after printing why there is none (a refused password included)."""
    from .inspect_store import InvalidURL, ServerUnreachable, connect, resolve_url

    target = resolve_url(url)
    try:
        return connect(target)
    except InvalidURL as err:
        # the message is redis-py's parse error, which may quote the URL: scrub its password
        print(f"tdstore {command}: error: invalid server url: {_scrub_url_password(target, str(err))}", file=sys.stderr)
    except ServerUnreachable as err:  # LoginRefused too: "the server at ... needs a password ..."
        print(f"tdstore {command}: error: {err}", file=sys.stderr)
    return EXIT_USAGE


def _scrub_url_password(url: str | None, text: str) -> str:
    """``text`` without the password of ``url`` (a URL redis-py could not parse is parsed by hand here)."""
    from urllib.parse import urlsplit

    try:
        password = urlsplit(url or "").password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def _server_failed(command: str, conn: ServerConnection, err: Exception) -> int:
    print(
        f"tdstore {command}: failed: the server at {conn.where} answered with an error: {type(err).__name__}: {conn.scrub(str(err))}",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _no_store(command: str, td_id: str, prefix: str, conn: ServerConnection) -> int:
    print(f"tdstore {command}: error: no store {_safe(td_id)} under prefix {_safe(prefix)!r} on {conn.where}", file=sys.stderr)
    return EXIT_USAGE


def _cmd_ls(args: argparse.Namespace) -> int:
    """One row per store of the prefix; stale registry entries are noted on stderr, never removed."""
    import redis

    from .inspect_store import list_stores

    conn = _connect("ls", args.url)
    if isinstance(conn, int):
        return conn
    with conn:
        try:
            listing = list_stores(conn.client, args.prefix)
        except redis.RedisError as err:
            return _server_failed("ls", conn, err)
    if args.json:
        print(
            json.dumps(
                {
                    "server": conn.where,
                    "prefix": args.prefix,
                    "stores": [info.to_json(schema=False) for info in listing.stores],
                    "unreadable": [bad.to_json() for bad in listing.unreadable],
                    "stale": listing.stale,
                },
                indent=2,
            )
        )
        return EXIT_OK
    rows = [
        [
            _safe(i.td_id),
            _safe(i.kind),
            str(i.count),
            str(len(i.leaves)),
            _size(i.bytes, args.bytes),
            _ls_ttl(i),
            _state_text(i.state),
            f"{i.written}/{i.count}" if i.has_ring else "-",
        ]
        for i in listing.stores
    ]
    rows += [[_safe(bad.td_id), "?", "-", "-", "-", "-", "unreadable", "-"] for bad in listing.unreadable]
    rows.sort(key=lambda row: row[0])
    total = len(listing.stores) + len(listing.unreadable)
    if rows:
        size = "BYTES" if args.bytes else "SIZE"
        for line in _table(["TD_ID", "TYPE", "COUNT", "KEYS", size, "TTL", "STATE", "RING"], rows, right={2, 3, 4, 5}):
            print(line)
        for bad in listing.unreadable:
            print(f"unreadable {_safe(bad.td_id)}: {_safe(bad.error)}")
    noun = "store" if total == 1 else "stores"
    print(f"{total} {noun} under prefix {_safe(args.prefix)!r} on {conn.where}")
    if listing.stale:
        ids = ", ".join(_safe(t) for t in listing.stale)
        print(
            f"tdstore ls: note: skipped {len(listing.stale)} registry entr{'y' if len(listing.stale) == 1 else 'ies'} "
            f"of stores that no longer exist (expired?): {ids}; 'tdstore rm ID' removes an entry",
            file=sys.stderr,
        )
    return EXIT_OK


def _info_lines(info: StoreInfo, where: str, raw: bool = False) -> list[str]:
    """The human form of ``info``: the header facts that apply to this store, then one row per key.

    A spread store (or a dense one) has no ring buffer, so it shows no ring line.
    """
    table_bytes = sum(leaf.table_bytes for leaf in info.leaves)
    data_bytes = sum(leaf.data_bytes for leaf in info.leaves)
    ring = [("ring", f"cursor {info.cursor}, write_count {info.write_count}, written {info.written}/{info.count}")] if info.has_ring else []
    # a dense store is one tensordict: its batch size is what applies (no stack of elements to count)
    shape: list[tuple[str, str]] = (
        [("batch size", _shape_text(info.batch_size))]
        if info.kind == "dense"
        else [("count", str(info.count)), ("stack dim", str(info.stack_dim)), ("inner batch size", _shape_text(info.inner))]
    )
    facts = [
        ("type", _safe(info.kind)),
        *shape,
        ("device", _safe(info.device) or "-"),
        ("version", str(info.version)),
        ("state", _safe(info.state)),
        *([("tensorclass", _safe(info.tensorclass))] if info.tensorclass else []),
        ("ttl", _ls_ttl(info)),
        (
            "bytes" if raw else "size",
            f"{_size(info.bytes, raw)} (data {_size(data_bytes, raw)}, heterogeneous tables {_size(table_bytes, raw)})",
        ),
        ("server keys", str(info.server_keys)),
        *ring,
        *([("sampling", _safe(info.sampling))] if info.sampling else []),
        (
            "segments",
            str(info.segments)
            + (f" of {info.segment_length} elements" if info.segments > 1 else "")
            + (", spread over the cluster's nodes" if info.spread else ""),
        ),
        (
            "row block",
            ", ".join(
                _safe(leaf.name) for leaf in sorted((lf for lf in info.leaves if lf.column is not None), key=lambda lf: lf.column or 0)
            )
            or "-",
        ),
    ]
    width = max(len(name) for name, _ in facts) + 1
    lines = [f"store {_safe(info.td_id)} under prefix {_safe(info.prefix)!r} on {where}"]
    lines += [f"  {name + ':':<{width}} {value}" for name, value in facts]
    lines.append(f"  keys: {len(info.leaves)}")
    if info.leaves:
        rows = [
            [
                _safe(leaf.name),
                leaf.dtype,
                leaf.layout,
                _shape_text(leaf.shape) if leaf.shape is not None else f"ndim {leaf.ndim}, shapes vary",
                _size(leaf.data_bytes, raw),
            ]
            for leaf in info.leaves
        ]
        lines += [
            "    " + line for line in _table(["KEY", "DTYPE", "LAYOUT", "ELEMENT SHAPE", "BYTES" if raw else "SIZE"], rows, right={4})
        ]
    return lines


def _read_store(command: str, args: argparse.Namespace, read: Callable[[Any], Any]) -> tuple[Any, Any] | int:
    """``(connection, read(client))`` for a command on one store (``info``, ``check``), or the exit
    code after printing why not: no server, no such store, an unreadable header, a server error."""
    import redis

    from .inspect_store import NoSuchStore, UnreadableStore

    conn = _connect(command, args.url)
    if isinstance(conn, int):
        return conn
    with conn:
        try:
            return conn, read(conn.client)
        except NoSuchStore:
            return _no_store(command, args.td_id, args.prefix, conn)
        except UnreadableStore as err:
            print(
                f"tdstore {command}: failed: store {_safe(args.td_id)} has a header this tdstore cannot read: {_safe(str(err))}",
                file=sys.stderr,
            )
            return EXIT_FAILED
        except redis.RedisError as err:
            return _server_failed(command, conn, err)


def _cmd_info(args: argparse.Namespace) -> int:
    from .inspect_store import audit, store_info

    got = _read_store("info", args, lambda client: (store_info(client, args.prefix, args.td_id), audit(client, args.prefix, args.td_id)))
    if isinstance(got, int):
        return got
    conn, (info, found) = got
    if args.json:
        print(json.dumps({"server": conn.where, **info.to_json(schema=True), "integrity": found.to_json()}, indent=2))
    else:
        lines = _info_lines(info, conn.where, raw=args.bytes)
        lines.insert(1, f"  integrity: {_integrity_text(found)}")
        print("\n".join(lines))
    return EXIT_OK


def _integrity_text(found: Any) -> str:
    if found.intact:
        return f"intact ({found.checked} keys checked; {found.never_written} of them absent, in segments never written)"
    return f"DAMAGED: {len(found.problems)} keys lost or cut short; 'tdstore check {_safe(found.td_id)}' lists them"


def _cmd_check(args: argparse.Namespace) -> int:
    from .inspect_store import audit

    got = _read_store("check", args, lambda client: audit(client, args.prefix, args.td_id))
    if isinstance(got, int):
        return got
    conn, found = got
    if args.json:
        print(json.dumps({"server": conn.where, **found.to_json()}, indent=2))
    else:
        print(f"store {_safe(found.td_id)} under prefix {_safe(args.prefix)!r} on {conn.where}: {_integrity_text(found)}")
        for line in found.problems:
            print(f"  {_safe(line)}")
        if not found.intact:
            print(
                "  The server evicted these keys (a maxmemory-policy other than noeviction) or someone deleted them; reads and writes "
                f"of them raise StoreDamagedError. Delete the store ('tdstore rm {_safe(found.td_id)}') and write it again."
            )
    return EXIT_OK if found.intact else EXIT_FAILED


def _confirm(question: str) -> bool | None:
    """Ask on stderr, read one line from stdin; ``None`` when stdin is no terminal (nobody to answer)."""
    stdin = sys.stdin
    if stdin is None or not stdin.isatty():
        return None
    print(question, end="", file=sys.stderr, flush=True)
    answer = stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def _cmd_rm(args: argparse.Namespace) -> int:
    """Delete one store after confirmation; a registry entry whose store is gone is removed without asking."""
    import redis

    from .inspect_store import NoSuchStore, StoreBusy, UnreadableStore, delete_store, inspect_for_delete

    conn = _connect("rm", args.url)
    if isinstance(conn, int):
        return conn
    shown = _safe(args.td_id)
    with conn:
        try:
            info, error, registered = inspect_for_delete(conn.client, args.prefix, args.td_id)
            if info is None and not registered:
                if error is None:
                    return _no_store("rm", args.td_id, args.prefix, conn)
                print(
                    f"tdstore rm: failed: store {shown} has a header this tdstore cannot read, and is not in the registry; not deleting it: {_safe(error)}",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            if info is not None and not args.yes:
                answer = _confirm(f"Delete store {shown} ({len(info.leaves)} keys, {human_size(info.bytes)})? [y/N] ")
                if answer is None:
                    print(
                        f"tdstore rm: error: not deleting store {shown}: stdin is not a terminal, so nobody can confirm; pass --yes",
                        file=sys.stderr,
                    )
                    return EXIT_USAGE
                if not answer:
                    print(f"tdstore rm: store {shown} not deleted", file=sys.stderr)
                    return EXIT_FAILED
            done = delete_store(conn.client, args.prefix, args.td_id)
        except NoSuchStore:
            return _no_store("rm", args.td_id, args.prefix, conn)
        except StoreBusy as err:
            print(f"tdstore rm: failed: {_safe(str(err))}", file=sys.stderr)
            return EXIT_FAILED
        except UnreadableStore as err:
            print(f"tdstore rm: failed: cannot delete store {shown}: {_safe(str(err))}", file=sys.stderr)
            return EXIT_FAILED
        except redis.RedisError as err:
            return _server_failed("rm", conn, err)
    if done.registry_only:
        print(f"removed the registry entry of store {shown}: {_safe(done.reason)}")
    else:
        print(f"deleted store {shown}: {done.keys_deleted} server keys")
    return EXIT_OK


# -- bench -------------------------------------------------------------------------------------------


def bench_script() -> Path | None:
    """``tools/bench.py`` of the source checkout this package runs from, or ``None`` (an installed wheel has no tools/)."""
    import tdstore

    path = Path(tdstore.__file__).resolve().parent.parent / "tools" / "bench.py"
    return path if path.is_file() else None


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark in a child interpreter, so its worker processes and private server behave as when run directly."""
    script = bench_script()
    if script is None:
        print(
            "tdstore bench: error: the benchmark (tools/bench.py) ships with the source tree, not with the installed package; "
            "clone the repository (git clone) and run 'tdstore bench' or 'python tools/bench.py' from the checkout",
            file=sys.stderr,
        )
        return EXIT_USAGE
    import os

    proc = subprocess.Popen([sys.executable, str(script), *args.bench_args], env={**os.environ, "TDSTORE_BENCH_PROG": "tdstore bench"})
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        _stop_child(proc)
        raise
    return code if code >= 0 else 128 - code  # killed by signal N: the shell convention 128 + N


def _stop_child(proc: subprocess.Popen[Any]) -> None:
    """After Ctrl-C, let the benchmark stop its own server; nudge it, then end it, if it does not."""
    import signal

    deadline = time.monotonic() + 10
    for step in ("wait", signal.SIGINT, signal.SIGTERM):
        if step != "wait":
            proc.send_signal(step)
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            deadline = time.monotonic() + 10
    proc.kill()
    proc.wait()


def _add_server_options(parser: argparse.ArgumentParser, *, json_help: str | None, sizes: bool = False) -> None:
    parser.add_argument(
        "--url",
        default=None,
        help=(
            "redis://, rediss://, unix:// or redis+cluster:// URL of the server (default: $TDSTORE_URL, else redis://localhost:6379/0); "
            "a password goes in it (redis://:PASSWORD@host:port) or in $TDSTORE_PASSWORD"
        ),
    )
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"key prefix the stores were created under (default: {DEFAULT_PREFIX})")
    if json_help is not None:
        parser.add_argument("--json", action="store_true", help=json_help)
    if sizes:
        parser.add_argument("--bytes", action="store_true", help="print sizes as exact byte counts instead of KiB/MiB/GiB")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand; a function so tests and docs can inspect it."""
    parser = argparse.ArgumentParser(
        prog="tdstore", description="TensorDicts shared between processes and machines through a Redis-wire server."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="actors write a shared store while a learner samples it, checking that no element is ever torn",
        description=(
            "Actor processes overwrite random elements of a store (varying token lengths) while this process samples "
            "random batches and checks every sampled element is consistent. Without --url a private redis-server is "
            "started for the run. The store is deleted at the end. Exit code 1 if a torn or inconsistent element was seen."
        ),
    )
    demo.add_argument(
        "--url",
        default=None,
        help=(
            "redis://, rediss://, unix:// or redis+cluster:// URL of the server (default: start an embedded one); "
            "a password goes in it (redis://:PASSWORD@host:port) or in $TDSTORE_PASSWORD, and reaches the actor processes"
        ),
    )
    demo.add_argument(
        "--cluster", action="store_true", help="start an embedded three-primary Redis Cluster instead of one server (not with --url)"
    )
    demo.add_argument(
        "--spread",
        action="store_true",
        help="spread the store's segments over every node of the cluster (needs --cluster or a redis+cluster:// --url)",
    )
    demo.add_argument(
        "--torchrl",
        action="store_true",
        help="go through a torchrl replay buffer (tdstore.torchrl): actors extend it, the learner samples it (needs torchrl)",
    )
    demo.add_argument(
        "--replay",
        action="store_true",
        help="use the store as a prioritized, rate-limited replay buffer: actors extend it with priorities, the learner samples by priority and updates them",
    )
    demo.add_argument("--actors", type=_positive_int, default=4, help="writer processes (default: 4)")
    demo.add_argument("--count", type=_positive_int, default=256, help="elements in the store (default: 256)")
    demo.add_argument("--seconds", type=_positive_float, default=5.0, help="duration of the run (default: 5)")
    demo.add_argument("--batch", type=_positive_int, default=32, help="elements per sampled batch (default: 32)")
    demo.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (the summary goes to stderr)")
    demo.add_argument("--no-progress", action="store_true", help="do not show live progress on stderr")
    demo.set_defaults(handler=_cmd_demo)

    ls = sub.add_parser(
        "ls",
        help="list the stores under a prefix",
        description=(
            "One row per store of the prefix: id, type, element count, number of keys, size on the server, "
            "time to live, state, and ring slots written / count ('-' where the ring does not apply). Read-only: "
            "registry entries of expired stores are skipped (and named on stderr), not removed."
        ),
    )
    _add_server_options(ls, json_help="print JSON on stdout instead of the table (raw numbers: bytes, seconds)", sizes=True)
    ls.set_defaults(handler=_cmd_ls)

    info = sub.add_parser(
        "info",
        help="show the header and the schema of one store",
        description=(
            "Header facts (count, stack dim, inner batch size, device, version, state, ttl, size, server keys, ring where it applies, "
            "segments, row block) and one row per key."
        ),
    )
    info.add_argument("td_id", metavar="TD_ID", help="id of the store")
    _add_server_options(info, json_help="print JSON on stdout instead of text (raw numbers: bytes, seconds)", sizes=True)
    info.set_defaults(handler=_cmd_info)

    check = sub.add_parser(
        "check",
        help="check every key of one store against its header (lost or cut-short keys)",
        description=(
            "Check each data and table key of one store against the length its header implies, as every read and write does "
            "for the keys it touches; list the keys lost (evicted or deleted) or cut short. Exit 0 when intact, 1 when damaged. Never writes."
        ),
    )
    check.add_argument("td_id", metavar="TD_ID", help="id of the store")
    _add_server_options(check, json_help="print JSON on stdout instead of text")
    check.set_defaults(handler=_cmd_check)

    rm = sub.add_parser(
        "rm",
        help="delete one store",
        description=(
            "Delete every key of one store in one atomic call, after a confirmation read from the terminal "
            "(or --yes). A registry entry whose store is already gone is removed without asking."
        ),
    )
    rm.add_argument("td_id", metavar="TD_ID", help="id of the store")
    _add_server_options(rm, json_help=None)
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    rm.set_defaults(handler=_cmd_rm)

    bench = sub.add_parser(
        "bench",
        help="run the benchmark (tools/bench.py of a source checkout); arguments pass through ('tdstore bench --help')",
        add_help=False,  # --help belongs to the benchmark
        description="Runs tools/bench.py of the source tree with the arguments given; see 'tdstore bench --help'.",
    )
    bench.set_defaults(handler=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit code.

    ``bench`` takes every argument after it unparsed (they belong to the
    benchmark, ``--help`` included), so the arguments argparse does not know are
    kept for it; for any other command they are an error, as with ``parse_args``.
    """
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("tdstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
