"""Fault injection for ``LazyStackedTensorDictStore``: what a user sees when the server misbehaves.

Run it as ``python -m tools.faults`` from the repository root (``--help`` lists the cases); the
cases are described in :mod:`tools.faults.__main__`.  The names below are what tests reuse.
"""

from tools.faults.base import CASE_NAMES, Options, decode, element
from tools.faults.processes import allowed_seqs
from tools.faults.proxy import Cut, CuttingProxy, RespScanner
from tools.faults.runner import format_checks, format_line, run_case

__all__ = [
    "CASE_NAMES",
    "Cut",
    "CuttingProxy",
    "Options",
    "RespScanner",
    "allowed_seqs",
    "decode",
    "element",
    "format_checks",
    "format_line",
    "run_case",
]
