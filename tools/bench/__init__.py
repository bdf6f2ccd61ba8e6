"""Benchmark of tdstore against the reference ``tensordict.store`` and a raw redis-py floor.

Run it as ``python -m tools.bench`` from the repository root (``--help`` lists the options; the
method is described in :mod:`tools.bench.__main__`).
"""
