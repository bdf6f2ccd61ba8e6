"""The ops of ``write.lua`` and ``read.lua``, each kind defined once.

A call to either script carries a list of ops: a one-letter marker, then the op's arguments
(``lua/write.lua`` and ``lua/read.lua`` parse them; their headers say what each one does on the
server). Everything the client needs to know about an op kind is declared here, in one
:class:`OpKind`: its arguments, which of them are indices into the call's KEYS (and which of
those keys it changes), whether it picks rows or is addressed by them, and, for a read op, how
many pieces it adds to the reply. The planners build ops by calling the kind
(``Write.S(key, blob)``, which checks the argument count), and the code that rewrites planned
ops — per segment (``_format.segments``), per cluster node (``_engine.spread``), for staging (``_engine.engine``) —
reads these declarations. A new op kind is one entry here, its parser in the Lua script, the
planner that emits it, and, when it names a whole leaf's keys, how ``_format.segments`` cuts it per
segment (``localize_write`` / ``localize_read`` refuse a kind they do not know).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OpKind:
    """One op kind of a script: its marker and what its arguments are."""

    marker: str
    args: tuple[str, ...]  # the fixed arguments after the marker, by name
    keys: tuple[int, ...] = ()  # positions (the marker is 0) of arguments that are KEYS indices (0: no key)
    writes: tuple[int, ...] = ()  # of ``keys``, those whose key the op changes (the others it reads or checks)
    rest: str = ""  # name of the trailing arguments whose count varies (write ops), '' for none
    picks_rows: bool = False  # chooses the rows that the ops after it address (needs a 'Q' op first on a segmented store)
    by_row: bool = False  # addressed by the picked rows: each key index names a block of keys, one per segment
    pieces: int | Callable[[Sequence[Any]], int] = 0  # read ops: pieces the op adds to the reply

    def __call__(self, *args: Any) -> list[Any]:
        """The op as sent: ``[marker, *args]``, refused when the argument count is wrong."""
        n = len(self.args)
        if len(args) != n and not (self.rest and len(args) > n):
            rest = f", {self.rest}..." if self.rest else ""
            raise TypeError(f"op {self.marker!r} takes ({', '.join(self.args)}{rest}), got {len(args)} arguments")
        return [self.marker, *args]

    @property
    def size(self) -> int:
        """Items of the op in a flat op list, its marker included (fixed-size ops only)."""
        return 1 + len(self.args)

    def reply_pieces(self, op: Sequence[Any]) -> int:
        """How many pieces ``op`` (of this kind) adds to a ``read.lua`` reply."""
        return self.pieces(op) if callable(self.pieces) else self.pieces

    def key_indices(self, op: Sequence[Any]) -> list[int]:
        """The KEYS indices ``op`` names (0 means no key and is left out)."""
        return [op[i] for i in self.keys if op[i]]

    def written(self, op: Sequence[Any]) -> list[int]:
        """The KEYS indices of the keys ``op`` changes."""
        return [op[i] for i in self.writes if op[i]]


class Write:
    """The ops of ``write.lua`` (see its header for what each one does on the server)."""

    R = OpKind("R", ("k", "n", "ranges", "data"), keys=(1,), writes=(1,))
    S = OpKind("S", ("k", "bytes"), keys=(1,), writes=(1,))
    D = OpKind("D", ("k",), keys=(1,), writes=(1,))
    T = OpKind("T", ("k",), keys=(1,))
    Z = OpKind("Z", ("k", "n"), keys=(1,), writes=(1,))
    M = OpKind("M", ("ks", "kt", "n"), keys=(1, 2), writes=(2,))
    O = OpKind("O", ("ks", "kd"), keys=(1, 2), writes=(2,))  # noqa: E741 (the script's marker)
    C = OpKind("C", ("kb", "kd", "stride", "col", "nb"), keys=(1, 2), writes=(2,))
    F = OpKind("F", ("kd", "ko", "a", "b", "pattern"), keys=(1, 2), writes=(1,))
    E = OpKind("E", ("kd", "ko", "ks", "rec", "lo", "hi", "shapes", "data"), keys=(1, 2, 3), writes=(1, 2, 3), rest="sizes")
    W = OpKind("W", ("n", "channel"), picks_rows=True)
    G = OpKind("G", ("n", "pairs"), picks_rows=True)
    P = OpKind("P", ("kt", "kc", "priorities"), keys=(1, 2), writes=(1, 2))
    J = OpKind("J", ("kj", "ids"), keys=(1,))  # the episode index (a zset, kept by the script: no data key)
    X = OpKind("X", ("k", "nb", "data"), keys=(1,), writes=(1,), by_row=True)
    K = OpKind("K", ("k", "nb", "stride", "col", "data"), keys=(1,), writes=(1,), by_row=True)
    Y = OpKind("Y", ("kd", "ko", "ks", "rec", "shapes", "data"), keys=(1, 2, 3), writes=(1, 2, 3), rest="sizes", by_row=True)
    Q = OpKind("Q", ("per",))
    # rollouts (lua/_rollouts.lua), after 'W': the rows' version and group, KEYS[kz..kq] the rollout index
    V = OpKind("V", ("kz", "kr", "kg", "ks", "kq", "version", "max_ahead", "group", "size"), keys=(1, 2, 3, 4, 5), writes=(1, 2, 3, 4, 5))
    N = OpKind("N", ("k", "rid"), keys=(1,), writes=(1,))  # the call's request id (first op), KEYS[k] the reply cache
    # KEYS[k] the stats hash: the call's ring work (and ms held) counted there; KEYS[k + 1] the sampled-rows bitmap
    A = OpKind("A", ("k", "ms"), keys=(1,), writes=(1,))
    B = OpKind("B", ("k",), keys=(1,), writes=(1,))  # KEYS[k] the header: its in-place write count 'tr' + 1, with the write


class Read:
    """The ops of ``read.lua`` (see its header for what each one does on the server)."""

    R = OpKind("R", ("k", "n", "ranges", "join"), keys=(1,), pieces=lambda op: 1 if op[4] == "1" else int(op[2]))
    E = OpKind("E", ("kd", "ko", "ks", "rec", "n", "runs"), keys=(1, 2, 3), pieces=lambda op: 3 * int(op[5]))
    U = OpKind("U", ("n", "draws"), picks_rows=True, pieces=2)
    P = OpKind("P", ("n", "draws", "kt", "kc", "channel", "min_size", "prioritized"), keys=(3, 4), picks_rows=True, pieces=4)
    F = OpKind("F", ("n", "channel"), picks_rows=True, pieces=2)
    J = OpKind("J", ("m", "L", "strict", "span0", "span1", "draws", "kj", "ranked"), keys=(7,), picks_rows=True, pieces=3)
    L = OpKind("L", ("n", "channel", "ms", "receipt", "kl", "kd", "kq", "ko", "kk"), keys=(5, 6, 7, 8, 9), picks_rows=True, pieces=5)
    I = OpKind("I", ("n", "rows"), picks_rows=True)  # noqa: E741 (the script's marker)
    # rollouts (lua/_rollouts.lua): visible rows or whole groups sampled or popped, KEYS[kz..kq] the rollout index
    G = OpKind(
        "G",
        ("mode", "n", "groups", "staleness", "budget", "fixed", "draws", "channel", "kz", "kr", "kg", "ks", "kq"),
        keys=(9, 10, 11, 12, 13),
        writes=(9, 10, 11, 12, 13),
        picks_rows=True,
        pieces=5,
    )
    H = OpKind("H", ("ko", "ks", "rec", "isz"), keys=(1, 2), by_row=True)  # before 'G': the leaf whose lengths a token budget adds
    X = OpKind("X", ("k", "nb"), keys=(1,), by_row=True, pieces=1)
    B = OpKind("B", ("k", "nb"), keys=(1,), by_row=True, pieces=1)
    Y = OpKind("Y", ("kd", "ko", "ks", "rec"), keys=(1, 2, 3), by_row=True, pieces=3)
    V = OpKind("V", ("kd", "ko", "ks", "rec"), keys=(1, 2, 3), by_row=True, pieces=3)
    T = OpKind("T", ("ko",), keys=(1,), pieces=1)
    Q = OpKind("Q", ("per",))
    N = OpKind("N", ("k", "rid"), keys=(1,), writes=(1,))  # the call's request id (before 'P'/'F'), KEYS[k] the reply cache
    # KEYS[k] the stats hash (before 'U'/'P'/'F'/'L'): the call's work counted; KEYS[k + 1] the sampled-rows bitmap
    A = OpKind("A", ("k", "ms"), keys=(1,), writes=(1,))


def _table(ns: type) -> dict[str, OpKind]:
    return {kind.marker: kind for kind in vars(ns).values() if isinstance(kind, OpKind)}


#: Each script's op kinds by marker.
WRITE_OPS: dict[str, OpKind] = _table(Write)
READ_OPS: dict[str, OpKind] = _table(Read)


def write_kind(op: Sequence[Any]) -> OpKind:
    """The kind of a ``write.lua`` op."""
    return WRITE_OPS[op[0]]


def read_kind(op: Sequence[Any]) -> OpKind:
    """The kind of a ``read.lua`` op."""
    return READ_OPS[op[0]]


def read_ops(flat: Sequence[Any]) -> Iterator[list[Any]]:
    """The ops of a flat ``read.lua`` op list (markers and arguments back to back), one list each."""
    a = 0
    while a < len(flat):
        size = READ_OPS[flat[a]].size
        yield list(flat[a : a + size])
        a += size
