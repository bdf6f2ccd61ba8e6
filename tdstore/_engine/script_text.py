"""A script's text as the server gets it: the shared helpers it uses, then the script itself.

Every ``EVALSHA`` runs the whole text, and each top-level ``local function`` of a helper
library is made again (a closure) on every call, used or not: ``_lib.lua``'s 40-odd helpers
cost a small script more than its own work. So a script is sent with only the helpers it
names, directly or through other helpers, kept in their order in the library (a Lua local is
visible only below its definition, so that order already puts each helper after the ones it
calls).

A library is cut into top-level definitions: a line starting ``local function NAME`` or
``local NAME[, NAME...] =`` opens one, which runs to the next; a top-level ``do`` block
belongs to the definition above it (``_tree.lua`` fills ``tds_struct`` that way); lines
before the first definition always go. Names are found as Lua identifiers outside comments
(over-inclusion from a name in a string costs a closure, never a wrong script).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPENS = re.compile(r"^local\s+(?:function\s+([A-Za-z_]\w*)|([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*=)")
_NAME = re.compile(r"[A-Za-z_]\w*")
_LONG_COMMENT = re.compile(r"--\[(=*)\[.*?\]\1\]", re.S)
_LINE_COMMENT = re.compile(r"--[^\n]*")


@dataclass(frozen=True)
class Definition:
    """One top-level definition of a library: the names it defines, the names it uses, its text."""

    defines: frozenset[str]
    uses: frozenset[str]
    text: str


def names_in(text: str) -> frozenset[str]:
    """The identifiers ``text`` uses, comments left out."""
    return frozenset(_NAME.findall(_LINE_COMMENT.sub("", _LONG_COMMENT.sub("", text))))


def definitions(library: str) -> tuple[str, list[Definition]]:
    """``library`` cut into its preamble (the lines before its first definition) and its definitions."""
    lines = library.splitlines(keepends=True)
    preamble: list[str] = []
    chunks: list[tuple[frozenset[str], list[str]]] = []
    for line in lines:
        m = _OPENS.match(line)
        if m is not None:
            names = m.group(1) or m.group(2)
            chunks.append((frozenset(n.strip() for n in names.split(",")), [line]))
        elif chunks:
            chunks[-1][1].append(line)
        else:
            preamble.append(line)
    out = []
    for defines, body in chunks:
        text = "".join(body)
        out.append(Definition(defines, names_in(text) - defines, text))
    return "".join(preamble), out


#: A line of a script after which the helpers that only the code below it uses are made (Lua makes a
#: closure when it reaches a ``local function``): a script whose common calls return above it skips them.
REST = "-- tds:rest"


def _needed(cut: list[tuple[str, list[Definition]]], names: set[str]) -> set[tuple[int, int]]:
    """The definitions (library, position) that ``names`` need, directly or through each other."""
    needed = set(names)
    keep: set[tuple[int, int]] = set()
    for li in range(len(cut) - 1, -1, -1):  # a definition only uses what stands above it
        for di in range(len(cut[li][1]) - 1, -1, -1):
            d = cut[li][1][di]
            if d.defines & needed:
                keep.add((li, di))
                needed |= d.uses
    return keep


def assemble(libraries: list[str], script: str) -> str:
    """The text to send: each library's preamble and the definitions ``script`` needs (transitively,
    across libraries, later ones may use earlier ones), in their order, then ``script``.

    When ``script`` has a :data:`REST` line, the definitions needed only below it go there instead
    (still in their order: none of those above uses one of them)."""
    cut = [definitions(lib) for lib in libraries]
    head, marker, rest = script.partition(f"\n{REST}\n")
    first = _needed(cut, set(names_in(head)))
    later = _needed(cut, set(names_in(rest))) - first if marker else set()
    parts = []
    for li, (preamble, defs) in enumerate(cut):
        parts.append(preamble)
        parts += [d.text for di, d in enumerate(defs) if (li, di) in first]
        parts.append("\n")
    if not marker:
        return "".join(parts) + script
    parts += [head, marker]
    for li, (_, defs) in enumerate(cut):
        parts += [d.text for di, d in enumerate(defs) if (li, di) in later]
    return "".join(parts) + "\n" + rest
