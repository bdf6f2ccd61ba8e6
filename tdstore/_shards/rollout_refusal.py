"""Rollouts (policy versions, groups that appear whole, token budgets: ``_ring.rollouts``) on a sharded ring: not
supported yet, each call and argument refused with a ``NotImplementedError`` saying why.

Why: a group written by several processes must complete atomically in one place, and a staleness bound
or token budget over the whole ring needs one published version and one queue order; a sharded ring's
shards are independent one-node rings on different primaries, whose scripts cannot see each other.
(A design that pins each group to one shard by its id, and publishes the version on every shard, would
work; it is not built.)
"""

from __future__ import annotations

from typing import Any

WHY = (
    "rollouts (version=, max_ahead=, group=, max_staleness=, groups=, token_budget=, set_version) are not supported "
    "on a sharded ring yet: a group, a published version and a pop order each live in one shard's scripts"
)


def refuse(what: str, **given: Any) -> None:
    """``NotImplementedError`` when any rollout argument of ``what`` is given (not None)."""
    named = sorted(k for k, v in given.items() if v is not None)
    if named:
        raise NotImplementedError(f"{what}({', '.join(f'{k}=' for k in named)}): {WHY}")


class ShardRollouts:
    """The ring's rollout calls on a sharded ring: refused."""

    def set_version(self, version: int, *, allow_backwards: bool = False) -> int:
        """Not on a sharded ring (see the module docstring)."""
        raise NotImplementedError(f"set_version: {WHY}")

    @property
    def policy_version(self) -> int:
        """Not on a sharded ring (see the module docstring)."""
        raise NotImplementedError(f"policy_version: {WHY}")
