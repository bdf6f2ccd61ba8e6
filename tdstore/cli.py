"""The ``tdstore`` command line (``python -m tdstore``).

One subcommand per task, so later ones (listing, inspecting, deleting stores,
benchmarks) slot in beside ``demo`` without changing how it is called.

Exit codes: 0 success, 1 the demo saw a torn or inconsistent element (or an
actor failed), 2 a usage error or an unreachable server, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

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
    demo.add_argument("--url", default=None, help="redis://, rediss:// or unix:// URL of the server (default: start an embedded one)")
    demo.add_argument("--actors", type=_positive_int, default=4, help="writer processes (default: 4)")
    demo.add_argument("--count", type=_positive_int, default=256, help="elements in the store (default: 256)")
    demo.add_argument("--seconds", type=_positive_float, default=5.0, help="duration of the run (default: 5)")
    demo.add_argument("--batch", type=_positive_int, default=32, help="elements per sampled batch (default: 32)")
    demo.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (the summary goes to stderr)")
    demo.add_argument("--no-progress", action="store_true", help="do not show live progress on stderr")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit code."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("tdstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
