"""The ``tdstore`` command line (``python -m tdstore``).

One subcommand per task: ``demo`` (concurrent writers never tear an element),
``ls``/``info``/``rm`` (the stores of a prefix on a server), ``bench`` (the
benchmark of the source tree).  This module parses and dispatches, and runs
``demo`` and ``bench``; the store commands live in :mod:`tdstore.cli.stores`
(what they read comes from :mod:`tdstore.inspect_store`), and what is printed is
worded by :mod:`tdstore.cli.output`.

``ls``, ``info`` and ``rm`` connect to ``--url``, else ``$TDSTORE_URL``, else
``redis://localhost:6379/0``, with the password of the URL, else
``$TDSTORE_PASSWORD`` (the rule of :mod:`tdstore._engine.connection`).  Server addresses
are printed without credentials, and names read from the server are printed with
control characters escaped.  Sizes are shown in B/KiB/MiB/GiB and times to live
with a unit; ``--bytes`` prints exact byte counts (``--json`` always has raw numbers).

``--help``, ``ls``, ``info`` and ``rm`` never import torch or tensordict (they
read headers with :mod:`tdstore._format.header_info`), so they answer at once; ``demo``
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
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tdstore.cli.arg_types import positive_float, positive_int
from tdstore.cli.checkpoint_commands import add_checkpoint_commands
from tdstore.cli.output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, human_duration, human_size
from tdstore.cli.stores import add_store_commands
from tdstore.cli.watch import add_watch_commands

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "bench_script",
    "build_parser",
    "human_duration",
    "human_size",
    "main",
]


#: ``demo --count``'s default (``--llm`` makes it 1024 unless given).
COUNT_DEFAULT = 256


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo; with --json, stdout holds only the JSON (the summary goes to stderr)."""
    # Each subcommand imports what it needs when it runs, so adding subcommands keeps the others as quick to start.
    import redis

    from tdstore.demo import DemoError, ServerUnreachable, run_demo, run_llm_demo

    try:
        if args.llm and (args.torchrl or args.replay or args.cluster or args.spread or args.sharded):
            raise ValueError(
                "--llm runs its own GRPO-shaped loop on one server: not with --torchrl, --replay, --cluster, --spread or --sharded"
            )
        figures = (
            run_llm_demo(
                url=args.url,
                actors=args.actors,
                count=max(args.count, 1024) if args.count == COUNT_DEFAULT else args.count,
                seconds=args.seconds,
                max_staleness=args.max_staleness,
                token_budget=args.token_budget,
                group_size=args.group_size,
                progress=not args.no_progress,
                out=sys.stderr if args.json else sys.stdout,
            )
            if args.llm
            else run_demo(
                url=args.url,
                actors=args.actors,
                count=args.count,
                seconds=args.seconds,
                batch=args.batch,
                progress=not args.no_progress,
                out=sys.stderr if args.json else sys.stdout,
                cluster=args.cluster,
                spread=args.spread,
                sharded=args.sharded,
                torchrl=args.torchrl,
                replay=args.replay,
            )
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


def _add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The parser of ``demo`` on ``sub`` (``add_subparsers()``'s result)."""
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
        help="spread the store's segments over every node of the cluster (needs --cluster or a redis+cluster:// --url); "
        "with --replay, the same as --sharded",
    )
    demo.add_argument(
        "--sharded",
        action="store_true",
        help="with --replay: the buffer is a sharded ring (tdstore.ShardedRing), one ring per primary of the cluster "
        "(needs --cluster or a redis+cluster:// --url)",
    )
    demo.add_argument(
        "--torchrl",
        action="store_true",
        help="go through a torchrl replay buffer (tdstore.torchrl): actors extend it, the learner samples it (needs torchrl)",
    )
    demo.add_argument(
        "--replay",
        action="store_true",
        help=(
            "use the store as a prioritized, rate-limited replay buffer: actors extend it with priorities, "
            "the learner samples by priority and updates them"
        ),
    )
    demo.add_argument(
        "--llm",
        action="store_true",
        help="an async GRPO-shaped loop: actors write whole groups of ragged rollouts stamped with policy versions, "
        "the learner pops by token budget with --max-staleness and bumps the version",
    )
    demo.add_argument("--max-staleness", type=int, default=2, help="with --llm: versions a popped rollout may lag (default: 2)")
    demo.add_argument("--token-budget", type=positive_int, default=512, help="with --llm: tokens per popped batch (default: 512)")
    demo.add_argument("--group-size", type=positive_int, default=4, help="with --llm: completions per prompt (default: 4)")
    demo.add_argument("--actors", type=positive_int, default=4, help="writer processes (default: 4)")
    demo.add_argument(
        "--count", type=positive_int, default=COUNT_DEFAULT, help="elements in the store (default: 256; 1024 rows with --llm)"
    )
    demo.add_argument("--seconds", type=positive_float, default=5.0, help="duration of the run (default: 5)")
    demo.add_argument("--batch", type=positive_int, default=32, help="elements per sampled batch (default: 32)")
    demo.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (the summary goes to stderr)")
    demo.add_argument("--no-progress", action="store_true", help="do not show live progress on stderr")
    demo.set_defaults(handler=_cmd_demo)


# -- bench -------------------------------------------------------------------------------------------


def bench_script() -> Path | None:
    """``tools/bench/__main__.py`` of the source checkout this package runs from, or ``None`` (an installed wheel has no tools/)."""
    import tdstore

    path = Path(tdstore.__file__).resolve().parent.parent / "tools" / "bench" / "__main__.py"
    return path if path.is_file() else None


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark in a child interpreter, so its worker processes and private server behave as when run directly."""
    script = bench_script()
    if script is None:
        print(
            "tdstore bench: error: the benchmark (tools/bench/) ships with the source tree, not with the installed package; "
            "clone the repository (git clone) and run 'tdstore bench' or 'python -m tools.bench' from the checkout",
            file=sys.stderr,
        )
        return EXIT_USAGE
    import os

    # `python -m tools.bench` with the checkout first on the path and not the current directory, which may hold
    # another `tools`; relative paths in the arguments (--json) stay relative to where the command was run
    root = str(script.parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TDSTORE_BENCH_PROG": "tdstore bench", "PYTHONPATH": path, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tools.bench", *args.bench_args], env=env)
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
    for step in (None, signal.SIGINT, signal.SIGTERM):  # None: first wait without a signal
        if step is not None:
            proc.send_signal(step)
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            deadline = time.monotonic() + 10
    proc.kill()
    proc.wait()


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand; a function so tests and docs can inspect it."""
    parser = argparse.ArgumentParser(
        prog="tdstore", description="TensorDicts shared between processes and machines through a Redis-wire server."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo_command(sub)
    add_store_commands(sub)
    add_checkpoint_commands(sub)
    add_watch_commands(sub)
    bench = sub.add_parser(
        "bench",
        help="run the benchmark (python -m tools.bench of a source checkout); arguments pass through ('tdstore bench --help')",
        add_help=False,  # --help belongs to the benchmark
        description="Runs python -m tools.bench in the source tree with the arguments given; see 'tdstore bench --help'.",
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
