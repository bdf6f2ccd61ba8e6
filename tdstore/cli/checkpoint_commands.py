"""``tdstore export TD_ID PATH``, ``tdstore import PATH`` and ``tdstore import-reference TD_ID`` on the command line.

The checkpoint code (:mod:`tdstore.checkpoint`, which needs torch) is imported when the
command runs, so that ``tdstore --help`` and the other commands stay quick.  Exit codes: 0
success; 1 a malformed checkpoint, a store whose schema or policy changed while it was exported (writers
may run: see ``export_import``) or that is damaged,
a server error; 2 a usage error, an unreachable server, an unknown id, a store that exists
(``import`` without ``--replace``) or a path that holds something else; 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from tdstore.cli.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, safe
from tdstore.cli.stores import _add_server_options, _connect, _no_store, _server_failed

__all__ = ["add_checkpoint_commands"]


def _cmd_export(args: argparse.Namespace) -> int:
    import redis

    from tdstore import StoreDamagedError
    from tdstore.checkpoint import export_checkpoint
    from tdstore.store import TensorDictStore

    conn = _connect("export", args.url)
    if isinstance(conn, int):
        return conn
    with conn:
        try:
            store = TensorDictStore.from_store(td_id=args.td_id, client=conn.client, prefix=args.prefix, tensorclass_cls=None)
        except KeyError:
            return _no_store("export", args.td_id, args.prefix, conn)
        except redis.RedisError as err:
            return _server_failed("export", conn, err)
        try:
            meta = export_checkpoint(store, args.path, pbar=not args.no_progress)
        except (FileExistsError, NotADirectoryError, PermissionError) as err:
            print(f"tdstore export: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        except (RuntimeError, StoreDamagedError) as err:
            print(f"tdstore export: failed: {safe(str(err))}", file=sys.stderr)
            return EXIT_FAILED
        except redis.RedisError as err:
            return _server_failed("export", conn, err)
    rw = meta.ring.get("rw", 0)
    # writers may run meanwhile: the rows they overwrote during the export are left absent, and counted
    late = f", {meta.overwritten_during_export} rows overwritten during the export (left absent)" if meta.overwritten_during_export else ""
    print(f"exported store {safe(args.td_id)}: {meta.count} elements, {len(meta.keys)} keys, ring writes {rw}{late} -> {args.path}")
    return EXIT_OK


def _import_failed(err: BaseException) -> int:
    """One line on stderr for an import refused or failed (never a traceback: a checkpoint is input from outside)."""
    text = str(err) if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {err}"  # (a CheckpointError is a ValueError)
    print(f"tdstore import: failed: {safe(text)}", file=sys.stderr)
    return EXIT_FAILED


def _cmd_import(args: argparse.Namespace) -> int:
    import redis

    from tdstore import StoreDamagedError
    from tdstore.checkpoint import CheckpointError, import_checkpoint, read_checkpoint

    try:
        _, meta = read_checkpoint(args.path)  # a malformed checkpoint fails before any connection
    except (CheckpointError, OSError, RecursionError, MemoryError) as err:
        return _import_failed(err)
    conn = _connect("import", args.url)
    if isinstance(conn, int):
        return conn
    td_id = args.td_id or meta.td_id
    with conn:
        try:
            import_checkpoint(
                args.path, td_id=td_id, replace=args.replace, pbar=not args.no_progress, client=conn.client, prefix=args.prefix
            )
        except FileExistsError as err:
            print(f"tdstore import: error: {safe(str(err))} (pass --replace to overwrite it, or --td-id)", file=sys.stderr)
            return EXIT_USAGE
        except redis.RedisError as err:
            return _server_failed("import", conn, err)
        except (ValueError, OSError, RecursionError, MemoryError, KeyError, RuntimeError, StoreDamagedError) as err:
            return _import_failed(err)  # (CheckpointError is a ValueError)
    print(f"imported {args.path} as store {safe(td_id)} under prefix {safe(args.prefix)!r}: {meta.count} elements, {len(meta.keys)} keys")
    return EXIT_OK


def _cmd_import_reference(args: argparse.Namespace) -> int:
    import redis

    from tdstore.checkpoint import CheckpointError, ReferenceStoreError, import_reference, is_reference_store

    conn = _connect("import-reference", args.url)
    if isinstance(conn, int):
        return conn
    target = args.td_id or args.source
    with conn:
        try:
            if not is_reference_store(conn.client, args.prefix, args.source):
                print(
                    f"tdstore import-reference: error: no store of tensordict.store {safe(args.source)} under prefix "
                    f"{safe(args.prefix)!r} on {conn.where}",
                    file=sys.stderr,
                )
                return EXIT_USAGE
            store = import_reference(args.source, new_td_id=target, prefix=args.prefix, pbar=not args.no_progress, client=conn.client)
        except (ReferenceStoreError, CheckpointError) as err:
            print(f"tdstore import-reference: failed: {safe(str(err))}", file=sys.stderr)
            return EXIT_FAILED
        except (FileExistsError, ValueError) as err:
            print(f"tdstore import-reference: error: {safe(str(err))} (pass --td-id)", file=sys.stderr)
            return EXIT_USAGE
        except redis.RedisError as err:
            return _server_failed("import-reference", conn, err)
        n = len(list(store.keys(include_nested=True, leaves_only=True)))
    print(f"copied the tensordict.store store {safe(args.source)} into tdstore store {safe(target)}: {n} keys")
    return EXIT_OK


def add_checkpoint_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The parsers of ``export`` and ``import`` on ``sub`` (``add_subparsers()``'s result)."""
    export = sub.add_parser(
        "export",
        help="write a store (rows, ring state, priorities, policy) into a checkpoint directory",
        description=(
            "Read the store in chunks and write every key's rows, the ring's write count, the priorities and the sampling "
            "policy into PATH (absent, empty, or an earlier checkpoint, replaced once the new one is whole). Homogeneous keys "
            "are in torchrl's memmap layout. Exit 1 when the store changed while it was read."
        ),
    )
    export.add_argument("td_id", metavar="TD_ID", help="id of the store")
    export.add_argument("path", metavar="PATH", help="the checkpoint directory")
    _add_server_options(export, json_help=None)
    export.add_argument("--no-progress", action="store_true", help="do not show a progress bar on stderr")
    export.set_defaults(handler=_cmd_export)

    imp = sub.add_parser(
        "import",
        help="restore a checkpoint (of 'tdstore export', rb.dumps or torchrl's LazyTensorStorage) as a new store",
        description=(
            "Check the checkpoint in PATH, upload it in chunks as a new store (with the checkpoint's td_id unless --td-id), "
            "then give it the ring state, priorities and policy in one call. Exit 1 for a malformed checkpoint."
        ),
    )
    imp.add_argument("path", metavar="PATH", help="the checkpoint directory")
    imp.add_argument("--td-id", default=None, help="id of the new store (default: the checkpoint's)")
    imp.add_argument("--replace", action="store_true", help="delete a store of that id first (default: refuse)")
    _add_server_options(imp, json_help=None)
    imp.add_argument("--no-progress", action="store_true", help="do not show a progress bar on stderr")
    imp.set_defaults(handler=_cmd_import)

    ref = sub.add_parser(
        "import-reference",
        help="copy a store written by tensordict.store (the reference) into a tdstore store",
        description=(
            "Stream every key of the reference's store into a tdstore store of the same id (or --td-id) on the same server; "
            "the reference's keys are left as they are. Pickled non-tensor values are refused (exit 1), never unpickled."
        ),
    )
    ref.add_argument("source", metavar="TD_ID", help="id of the tensordict.store store")
    ref.add_argument("--td-id", default=None, help="id of the new tdstore store (default: the same)")
    _add_server_options(ref, json_help=None)
    ref.add_argument("--no-progress", action="store_true", help="do not show a progress bar on stderr")
    ref.set_defaults(handler=_cmd_import_reference)
