"""What the ``tdstore`` command line prints: escaped names, aligned tables, sizes and times with
units, the text of ``info`` and ``check``; and the exit codes its commands return.

Nothing here talks to a server or imports torch: the commands of :mod:`tdstore.cli.stores` read,
this module words what they read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tdstore.inspect_store import Audit, StoreInfo

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "damage_advice",
    "human_duration",
    "human_size",
    "info_lines",
    "integrity_text",
    "plural",
    "safe",
    "shape_text",
    "size_text",
    "state_text",
    "table",
    "ttl_text",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def safe(text: str) -> str:
    """``text`` with non-printable characters escaped: ids and key names come from the server,
    and an escape sequence in one must not reach the terminal as a command."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned columns (columns in ``right`` right-aligned), two spaces apart, no trailing blanks."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = []
    for row in (header, *rows):
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def shape_text(shape: Sequence[int]) -> str:
    """A shape as ``[2, 3]`` (``[]`` for a scalar)."""
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


def size_text(n: int, raw: bool) -> str:
    """``n`` bytes exactly (``--bytes``), else with a unit."""
    return str(n) if raw else human_size(n)


def ttl_text(info: StoreInfo) -> str:
    """The time to live with a unit, or ``-`` for a store without one."""
    return "-" if info.ttl_ms is None else human_duration(info.ttl_ms)


def state_text(state: str) -> str:
    """``uploading:<token>`` is shown as ``uploading``: the token means nothing to a reader."""
    return "uploading" if state.startswith("uploading") else safe(state)


def info_lines(info: StoreInfo, where: str, raw: bool = False) -> list[str]:
    """The human form of ``info``: the header facts that apply to this store, then one row per key.

    A spread store (or a dense one) has no ring buffer, so it shows no ring line.
    """
    table_bytes = sum(leaf.table_bytes for leaf in info.leaves)
    data_bytes = sum(leaf.data_bytes for leaf in info.leaves)
    ring = [("ring", f"cursor {info.cursor}, write_count {info.write_count}, written {info.written}/{info.count}")] if info.has_ring else []
    # a dense store is one tensordict: its batch size is what applies (no stack of elements to count)
    shape: list[tuple[str, str]] = (
        [("batch size", shape_text(info.batch_size))]
        if info.kind == "dense"
        else [("count", str(info.count)), ("stack dim", str(info.stack_dim)), ("inner batch size", shape_text(info.inner))]
    )
    facts = [
        ("type", safe(info.kind)),
        *shape,
        ("device", safe(info.device) or "-"),
        ("version", str(info.version)),
        ("state", safe(info.state)),
        *([("tensorclass", safe(info.tensorclass))] if info.tensorclass else []),
        ("ttl", ttl_text(info)),
        (
            "bytes" if raw else "size",
            f"{size_text(info.bytes, raw)} (data {size_text(data_bytes, raw)}, heterogeneous tables {size_text(table_bytes, raw)})",
        ),
        ("server keys", str(info.server_keys)),
        *ring,
        *([("sampling", safe(info.sampling))] if info.sampling else []),
        (
            "segments",
            str(info.segments)
            + (f" of {info.segment_length} elements" if info.segments > 1 else "")
            + (", spread over the cluster's nodes" if info.spread else ""),
        ),
        (
            "row block",
            ", ".join(
                safe(leaf.name) for leaf in sorted((lf for lf in info.leaves if lf.column is not None), key=lambda lf: lf.column or 0)
            )
            or "-",
        ),
    ]
    width = max(len(name) for name, _ in facts) + 1
    lines = [f"store {safe(info.td_id)} under prefix {safe(info.prefix)!r} on {where}"]
    lines += [f"  {name + ':':<{width}} {value}" for name, value in facts]
    lines.append(f"  keys: {len(info.leaves)}")
    if info.leaves:
        rows = [
            [
                safe(leaf.name),
                leaf.dtype,
                leaf.layout,
                shape_text(leaf.shape) if leaf.shape is not None else f"ndim {leaf.ndim}, shapes vary",
                size_text(leaf.data_bytes, raw),
            ]
            for leaf in info.leaves
        ]
        lines += ["    " + line for line in table(["KEY", "DTYPE", "LAYOUT", "ELEMENT SHAPE", "BYTES" if raw else "SIZE"], rows, right={4})]
    return lines


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun in the number it takes: ``1 key``, ``2 keys``, ``0 keys``."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def integrity_text(found: Audit, *, from_info: bool = False) -> str:
    """The one-line verdict of ``check``, and (``from_info``) the ``integrity`` line of ``info``,
    which points to ``check`` for the list and what to do."""
    if found.intact:
        absent = f"; {found.never_written} of them absent, in segments never written" if found.never_written else ""
        return f"intact ({plural(found.checked, 'key')} checked{absent})"
    verdict = f"DAMAGED: {plural(len(found.problems), 'key')} lost or cut short"
    if from_info:
        verdict += f"; 'tdstore check {safe(found.td_id)}' lists them and what to do"
    return verdict


def damage_advice(found: Audit, prefix: str) -> list[str]:
    """What ``check`` tells the owner of a damaged store to do next: keep the rest by deleting the
    damaged keys (naming them) and writing them again, or restore the whole store."""
    where = "" if prefix == "tensordict" else f" --prefix {safe(prefix)}"
    lines = [
        "The server evicted these keys (a maxmemory-policy other than noeviction) or someone deleted them; every read "
        "or write that touches them raises StoreDamagedError, and nothing rebuilds them. What to do next:",
    ]
    if found.damaged_keys:
        names = ", ".join(repr(safe(k)) for k in found.damaged_keys)
        dels = "; ".join(f"del store[{safe(k)!r}]" for k in found.damaged_keys[:3]) + ("; ..." if len(found.damaged_keys) > 3 else "")
        lines.append(
            f"  - to keep the rest, delete the damaged {'key' if len(found.damaged_keys) == 1 else 'keys'} "
            f"({names}) from the store ({dels}) and write them again from your data (store.set(key, value))"
        )
    lines.append(
        f"  - or restore the whole store from a checkpoint or its source: 'tdstore rm {safe(found.td_id)}{where}' "
        "deletes it, then upload it again (TensorDictStore.from_tensordict(..., td_id=...))"
    )
    lines.append("  - and run the server with maxmemory-policy noeviction, so that it refuses writes instead of losing data")
    return lines
