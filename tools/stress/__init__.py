"""Concurrency stress test of ``LazyStackedTensorDictStore``: torn reads, lost updates, errors.

Run it as ``python -m tools.stress`` from the repository root (``--help`` lists the options; the
checks are described in :mod:`tools.stress.__main__`).  The names below are what tests reuse.
"""

from tools.stress.elements import (
    EXTRA_VALUE,
    READ_KINDS,
    RING_READ_KINDS,
    SCHEMA_KINDS,
    SEQ_LIMIT,
    WRITE_KINDS,
    check_element,
    check_ring_row,
    initial_element,
    make_element,
    make_ring_rows,
    tokens_len,
)
from tools.stress.workers import Tally

__all__ = [
    "EXTRA_VALUE",
    "READ_KINDS",
    "RING_READ_KINDS",
    "SCHEMA_KINDS",
    "SEQ_LIMIT",
    "WRITE_KINDS",
    "Tally",
    "check_element",
    "check_ring_row",
    "initial_element",
    "make_element",
    "make_ring_rows",
    "tokens_len",
]
