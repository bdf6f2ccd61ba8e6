"""The commands on the stores of a server: ``ls``, ``info``, ``check`` and ``rm``, and their options.

They connect to ``--url``, else ``$TDSTORE_URL``, else ``redis://localhost:6379/0`` (see
:func:`tdstore.inspect_store.resolve_url`), read through :mod:`tdstore.inspect_store` (imported
when a command runs, so that ``--help`` stays quick) and print with :mod:`tdstore.cli.output`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tdstore.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    damage_advice,
    human_size,
    info_lines,
    integrity_text,
    plural,
    safe,
    size_text,
    state_text,
    table,
    ttl_text,
)

if TYPE_CHECKING:
    from tdstore.inspect_store import Audit, ServerConnection, StoreInfo

__all__ = ["DEFAULT_PREFIX", "add_server_options", "add_store_commands", "connect_or_exit"]

DEFAULT_PREFIX = "tensordict"


def _connect(command: str, url: str | None) -> ServerConnection | int:
    """The connection, or the exit code after printing why there is none (a refused password included)."""
    from tdstore.inspect_store import InvalidURL, ServerUnreachable, connect, resolve_url

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
    print(f"tdstore {command}: error: no store {safe(td_id)} under prefix {safe(prefix)!r} on {conn.where}", file=sys.stderr)
    return EXIT_USAGE


def _cmd_ls(args: argparse.Namespace) -> int:
    """One row per store of the prefix; stale registry entries are noted on stderr, never removed."""
    import redis

    from tdstore.inspect_store import list_stores

    conn = _connect("ls", args.url)
    if isinstance(conn, int):
        return conn
    with conn:
        try:
            listing = list_stores(conn.client, args.prefix)
            audits = _audit_all(conn.client, args.prefix, listing.stores)
        except redis.RedisError as err:
            return _server_failed("ls", conn, err)
    damaged = sorted(td_id for td_id, found in audits.items() if found is not None and not found.intact)
    from tdstore.inspect_store import group_shards

    plain, rings = group_shards(listing.stores)
    if args.json:
        _print_ls_json(conn.where, args.prefix, listing, audits, rings)
        return EXIT_OK
    rows = _ls_rows(args, conn.client, listing, plain, rings, damaged)
    total = len(listing.stores) + len(listing.unreadable)
    if rows:
        size = "BYTES" if args.bytes else "SIZE"
        for line in table(["TD_ID", "TYPE", "COUNT", "KEYS", size, "TTL", "STATE", "RING"], rows, right={2, 3, 4, 5}):
            print(line)
        for bad in listing.unreadable:
            print(f"unreadable {safe(bad.td_id)}: {safe(bad.error)}")
    print(f"{plural(total, 'store')} under prefix {safe(args.prefix)!r} on {conn.where}")
    _print_ls_notes(listing, audits, damaged)
    return EXIT_OK


def _print_ls_json(where: str, prefix: str, listing: Any, audits: dict[str, Audit | None], rings: dict[str, Any]) -> None:
    """``tdstore ls --json``: every store, the sharded rings, stale entries and stores of the reference."""
    print(
        json.dumps(
            {
                "server": where,
                "prefix": prefix,
                "stores": [{**info.to_json(schema=False), "integrity": _json_or_none(audits.get(info.td_id))} for info in listing.stores],
                "unreadable": [bad.to_json() for bad in listing.unreadable],
                "sharded": {
                    ring: [{"shard": k, "td_id": i.td_id, "written": i.written, "count": i.count} for k, i in parts]
                    for ring, parts in rings.items()
                },
                "stale": listing.stale,
                "reference": listing.reference,
            },
            indent=2,
        )
    )


def _ls_rows(
    args: argparse.Namespace, client: Any, listing: Any, plain: list[StoreInfo], rings: dict[str, Any], damaged: list[str]
) -> list[list[str]]:
    """The table of ``tdstore ls``: a row per store, a sharded ring's row then one per shard, unreadable entries."""
    from tdstore.inspect_store import node_of_store

    rows = [
        [
            safe(i.td_id),
            safe(i.kind),
            str(i.count),
            str(len(i.leaves)),
            size_text(i.bytes, args.bytes),
            ttl_text(i),
            "DAMAGED" if i.td_id in damaged else state_text(i.state),
            f"{i.written}/{i.count}" if i.has_ring else "-",
        ]
        for i in plain
    ]
    for ring, parts in rings.items():  # a sharded ring: one row, then one per shard (its node in the state column)
        rows.append(
            [safe(ring), f"sharded/{len(parts)}", str(sum(i.count for _, i in parts)), str(len(parts[0][1].leaves)),
             size_text(sum(i.bytes for _, i in parts), args.bytes), "-", "ready",
             f"{sum(i.written for _, i in parts)}/{sum(i.count for _, i in parts)}"]
        )  # fmt: skip
        for k, i in parts:
            node = node_of_store(client, args.prefix, i.td_id)
            rows.append([safe(ring) + f" ~shard {k}", "shard", str(i.count), "-", size_text(i.bytes, args.bytes), "-", safe(node),
                         f"{i.written}/{i.count}"])  # fmt: skip
    rows += [[safe(bad.td_id), "?", "-", "-", "-", "-", "unreadable", "-"] for bad in listing.unreadable]
    rows.sort(key=lambda row: row[0])
    return rows


def _print_ls_notes(listing: Any, audits: dict[str, Audit | None], damaged: list[str]) -> None:
    """Notes of ``tdstore ls`` on stderr: damaged stores, stores of the reference, stale registry entries."""
    for td_id in damaged:
        found = audits[td_id]
        assert found is not None
        print(
            f"tdstore ls: note: store {safe(td_id)} is DAMAGED ({plural(len(found.problems), 'key')} lost or cut short); "
            f"'tdstore check {safe(td_id)}' lists them and what to do",
            file=sys.stderr,
        )
    if listing.reference:
        ids = ", ".join(safe(t) for t in listing.reference)
        print(
            f"tdstore ls: note: {plural(len(listing.reference), 'store')} under this prefix "
            f"{'was' if len(listing.reference) == 1 else 'were'} written by tensordict.store, whose "
            f"layout tdstore does not read: {ids}; 'tdstore import-reference ID' copies one",
            file=sys.stderr,
        )
    if listing.stale:
        ids = ", ".join(safe(t) for t in listing.stale)
        print(
            f"tdstore ls: note: skipped {len(listing.stale)} registry entr{'y' if len(listing.stale) == 1 else 'ies'} "
            f"of stores that no longer exist (expired?): {ids}; 'tdstore rm ID' removes an entry",
            file=sys.stderr,
        )


def _audit_all(client: Any, prefix: str, stores: Sequence[StoreInfo]) -> dict[str, Audit | None]:
    """Every key of each ready store checked against its header (what ``check`` does), so that ``ls``
    shows a damaged store as damaged; None for a store being uploaded or gone meanwhile. Reads only."""
    from tdstore.inspect_store import NoSuchStore, UnreadableStore, audit

    out: dict[str, Audit | None] = {}
    for info in stores:
        out[info.td_id] = None
        if info.state == "ready":
            try:
                out[info.td_id] = audit(client, prefix, info.td_id)
            except (NoSuchStore, UnreadableStore):
                pass
    return out


def _json_or_none(found: Audit | None) -> dict[str, Any] | None:
    return None if found is None else {k: v for k, v in found.to_json().items() if k != "td_id"}


def _read_store(command: str, args: argparse.Namespace, read: Callable[[Any], Any]) -> tuple[Any, Any] | int:
    """``(connection, read(client))`` for a command on one store (``info``, ``check``), or the exit
    code after printing why not: no server, no such store, an unreadable header, a server error."""
    import redis

    from tdstore.inspect_store import NoSuchStore, UnreadableStore

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
                f"tdstore {command}: failed: store {safe(args.td_id)} has a header this tdstore cannot read: {safe(str(err))}",
                file=sys.stderr,
            )
            return EXIT_FAILED
        except redis.RedisError as err:
            return _server_failed(command, conn, err)


def _cmd_info(args: argparse.Namespace) -> int:
    from tdstore.inspect_store import audit, ring_info, ring_info_lines, store_info

    sharded = _read_store("info", args, lambda client: ring_info(client, args.prefix, args.td_id))
    if isinstance(sharded, int):
        return sharded
    if sharded[1] is not None:
        conn, info = sharded
        print(json.dumps({"server": conn.where, **info}, indent=2) if args.json else "\n".join(ring_info_lines(info, conn.where)))
        return EXIT_OK

    got = _read_store("info", args, lambda client: (store_info(client, args.prefix, args.td_id), audit(client, args.prefix, args.td_id)))
    if isinstance(got, int):
        return got
    conn, (info, found) = got
    if args.json:
        print(json.dumps({"server": conn.where, **info.to_json(schema=True), "integrity": found.to_json()}, indent=2))
    else:
        lines = info_lines(info, conn.where, raw=args.bytes)
        lines.insert(1, f"  integrity: {integrity_text(found, from_info=True)}")
        print("\n".join(lines))
    return EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    from tdstore.inspect_store import audit

    got = _read_store("check", args, lambda client: audit(client, args.prefix, args.td_id))
    if isinstance(got, int):
        return got
    conn, found = got
    if args.json:
        print(json.dumps({"server": conn.where, **found.to_json()}, indent=2))
    else:
        print(f"store {safe(found.td_id)} under prefix {safe(args.prefix)!r} on {conn.where}: {integrity_text(found)}")
        for line in found.problems:
            print(f"  {safe(line)}")
        if not found.intact:
            for line in damage_advice(found, args.prefix):
                print(f"  {line}")
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

    from tdstore.inspect_store import NoSuchStore, StoreBusy, UnreadableStore, delete_store, inspect_for_delete

    conn = _connect("rm", args.url)
    if isinstance(conn, int):
        return conn
    shown = safe(args.td_id)
    with conn:
        try:
            info, error, registered = inspect_for_delete(conn.client, args.prefix, args.td_id)
            if info is None and not registered:
                if error is None:
                    return _no_store("rm", args.td_id, args.prefix, conn)
                print(
                    f"tdstore rm: failed: store {shown} has a header this tdstore cannot read, and is not in the registry; "
                    f"not deleting it: {safe(error)}",
                    file=sys.stderr,
                )
                return EXIT_FAILED
            if info is not None and not args.yes:
                answer = _confirm(f"Delete store {shown} ({plural(len(info.leaves), 'key')}, {human_size(info.bytes)})? [y/N] ")
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
            print(f"tdstore rm: failed: {safe(str(err))}", file=sys.stderr)
            return EXIT_FAILED
        except UnreadableStore as err:
            print(f"tdstore rm: failed: cannot delete store {shown}: {safe(str(err))}", file=sys.stderr)
            return EXIT_FAILED
        except redis.RedisError as err:
            return _server_failed("rm", conn, err)
    if done.registry_only:
        print(f"removed the registry entry of store {shown}: {safe(done.reason)}")
    else:
        print(f"deleted store {shown}: {plural(done.keys_deleted, 'server key')}")
    return EXIT_OK


def _add_server_options(parser: argparse.ArgumentParser, *, json_help: str | None, sizes: bool = False) -> None:
    """The options every store command takes: the server, the prefix, and ``--json``/``--bytes`` where they apply."""
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


def add_store_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The parsers of ``ls``, ``info``, ``check`` and ``rm`` on ``sub`` (``add_subparsers()``'s result)."""
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
            "for the keys it touches; list the keys lost (evicted or deleted) or cut short. "
            "Exit 0 when intact, 1 when damaged. Never writes."
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


#: The connection of a store command, or the exit code after saying why there is none (``top``, ``metrics``).
connect_or_exit = _connect
#: The options every store command takes (``--url``, ``--prefix``, ``--json``).
add_server_options = _add_server_options
