"""Which key tells a ring's trajectories apart: header field ``tj``, set by ``lua/trajectories.lua``.

A ring with trajectories keeps an *episode index* on the server (``lua/_episodes.lua``): every ring
write passes, per row, the trajectory id (``by="id"``: a run of consecutive rows with the same id is
one trajectory, as torchrl's ``SliceSampler(traj_key=...)`` reads them) or the end flag (``by="end"``:
a row whose flag is set ends its trajectory, torchrl's ``end_key``), and the script keeps the runs
of write numbers that are trajectories, so ``sample_slices`` draws slices without reading the key.
Setting it bumps the header's versions: a writer that planned without knowing it is answered STALE
and plans again with the ids. This module is torch-free (the command line reads headers too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: How a trajectory is told apart: by an id per row, or by an end flag per row.
BY = ("id", "end")


@dataclass(frozen=True)
class Trajectories:
    """What ``tj`` holds: ``by`` (``"id"`` or ``"end"``) and ``key``, the path of the key read per row."""

    by: str
    key: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.by not in BY:
            raise ValueError(f"trajectories are told apart by one of {BY}, got {self.by!r}")
        if not self.key or not all(isinstance(p, str) and p for p in self.key):
            raise ValueError(f"a trajectory key is a non-empty str or tuple of str, got {self.key!r}")

    def to_json(self) -> str:
        return json.dumps({"by": self.by, "key": list(self.key)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | None) -> Trajectories | None:
        """The setting ``tj`` holds (None: the ring keeps no episode index); ``ValueError`` for a bad one."""
        if text is None or text == "":
            return None
        raw: Any = json.loads(text)
        if not isinstance(raw, dict) or not isinstance(raw.get("key"), list):
            raise ValueError(f"not a trajectory setting: {text[:60]!r}")
        return cls(str(raw.get("by")), tuple(raw["key"]))

    def describe(self) -> str:
        name = self.key[0] if len(self.key) == 1 else self.key
        return f"{'traj_key' if self.by == 'id' else 'end_key'}={name!r}"


#: its public home: pickles name it there (set once made: a dataclass resolves its annotations in its own module)
Trajectories.__module__ = "tdstore.ring_interface"
