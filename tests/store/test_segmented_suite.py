"""The behavioural suite again, with stores cut into many tiny segments.

Test stores are small, so by default they keep one segment.  This runs the modules
that exercise reads, writes, schema changes, the ring buffer, dense stores and the
TensorDictBase surface with a default segment size of 64 bytes (``--segment-bytes``,
see conftest.py), where nearly every element sits in a segment of its own and every
slice, batch, fill, rename and upload crosses segment boundaries, on both engines.
Tests that assert the default layout itself (key counts, round trips per chunk) are
marked ``layout`` and skipped there.  A second run does the same on the cluster with
*spread* stores (``--cluster-spread``: segments on every node, see ``_engine.spread``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

#: The modules, in groups of about a minute each: one pytest process per group, since a process
#: costs ~7 s to start (torch, tensordict, the servers) and 28 of them cost more than their tests.
GROUPS = {
    "surface-rows-nontensor": ["test_surface.py", "test_rows.py", "test_nontensor.py"],
    "segments-trips-dropin-lifecycle": ["test_segments.py", "test_round_trips.py", "test_dropin.py", "test_lifecycle.py"],
    "badinput-dense-writes": ["test_bad_input.py", "test_dense.py", "test_writes.py"],
    "api-reads-ring-newkeys": ["test_api.py", "test_reads.py", "test_ring.py", "test_new_keys.py"],
}
MODULES = [m for group in GROUPS.values() for m in group]


def _run(modules: list[str], *options: str) -> None:
    tests = Path(__file__).resolve().parents[1]  # the test folders: each module found by its name
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",
        "--segment-bytes",
        "64",
        *options,
        *(str(next(tests.rglob(m))) for m in modules),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tests.parent, timeout=1200)
    assert proc.returncode == 0, f"segmented suite failed ({', '.join(modules)}):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    # a module whose tests all use the ring is skipped whole on spread stores (they refuse the ring)
    assert (" passed" in proc.stdout or (options and " skipped" in proc.stdout)) and " failed" not in proc.stdout


# One run per group, so that a parallel test run (pytest -n) spreads them over its workers.
@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_behavioural_suite_with_tiny_segments(group: str) -> None:
    _run(GROUPS[group])


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS)
def test_behavioural_suite_on_spread_stores(group: str) -> None:
    """The cluster's stores spread (``--cluster-spread``): each tiny segment under its own hash
    tag, so nearly every call crosses nodes; ring tests are skipped (a spread store refuses them)."""
    _run(GROUPS[group], "--cluster-spread", "-k", "cluster")
