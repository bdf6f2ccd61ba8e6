"""The argparse types of the command line's numeric options: each refuses a value out of its range with a message
naming the value (argparse prints it as a usage error, exit 2), and every one parses the same way."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

__all__ = ["interval_seconds", "port_number", "positive_float", "positive_int"]

_N = TypeVar("_N", int, float)


def _number(text: str, kind: Callable[[str], _N], noun: str, ok: Callable[[_N], bool], rule: str) -> _N:
    """``kind(text)``, refused as not ``noun`` when it does not parse, and with ``rule`` when ``ok`` says no."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text.strip()}")
    return value


def positive_int(text: str) -> int:
    """A count: 1 or more."""
    return _number(text, int, "an integer", lambda v: v >= 1, "at least 1")


def positive_float(text: str) -> float:
    """A duration in seconds, strictly positive."""
    return _number(text, float, "a number", lambda v: v > 0, "positive")


def interval_seconds(text: str) -> float:
    """Seconds between two frames or reads: 0.05 to 3600."""
    return _number(text, float, "a number", lambda v: 0.05 <= v <= 3600, "between 0.05 and 3600 seconds")


def port_number(text: str) -> int:
    """A TCP port to serve on: 0 (any free port) to 65535."""
    return _number(text, int, "a port", lambda v: 0 <= v <= 65535, "0 to 65535 (0: any free port)")
