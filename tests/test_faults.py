"""Tests of ``tools/faults.py`` (issue #4): every fault case, quickly, each on its own private server.

The cases start their own embedded redis-server (unix socket, no persistence, the
``--maxmemory`` / ``--proto-max-bulk-len`` arguments they need) and never touch a
server they did not start.  Every check of every case must pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "faults.py"


faults = load_tool("faults")

QUICK = faults.Options(quick=True, seed=1)


@pytest.mark.layout
@pytest.mark.parametrize("name", faults.CASE_NAMES)
def test_fault_case(name: str) -> None:
    """Each case passes on its own private server, every check of it."""
    res = faults.run_case(name, QUICK)
    report = faults.format_line(res) + "\n" + faults.format_checks(res)
    assert res.status != "SKIP", report
    assert res.checks, report
    assert all(c.ok for c in res.checks), report
    assert res.status == "PASS", report


def test_cli_one_case_json() -> None:
    """``python tools/faults.py --case store-deleted --json``: JSON on stdout, the table on stderr, exit 0."""
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--case", "store-deleted", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    [case] = report["cases"]
    assert case["name"] == "store-deleted" and case["status"] == "PASS", case
    assert "KeyError" in case["saw"] and "td_id" in case["saw"], case["saw"]
    assert "0 keys under the prefix" in case["proof"], case["proof"]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("store-deleted")]
    assert len(lines) == 1 and " PASS " in lines[0], proc.stderr


def test_url_skips_cases_that_need_their_own_server() -> None:
    """With ``--url``, cases that restart, configure or flush the server are skipped without connecting."""
    opts = faults.Options(url="redis://127.0.0.1:1")  # never contacted: skipped before connecting
    for name in ("restart", "script-flush", "maxmemory", "proto-max-bulk-len"):
        res = faults.run_case(name, opts)
        assert res.status == "SKIP" and "skipped with --url" in res.note, res
    with pytest.raises(ValueError, match="loopback"):
        faults.check_loopback("redis://10.1.2.3:7000")
    faults.check_loopback("unix:///tmp/x.sock")


def test_allowed_seqs_after_a_kill() -> None:
    """The sigkill check allows old-or-new only for the element in flight, the last write elsewhere."""
    n, base = 4, 100
    # ops 0..5 started (op k writes element k % n with seq base + k // n + 1); op 5 not acknowledged
    allowed = faults.allowed_seqs([0] * n, n, base, started=5, done=4)
    assert allowed == [{102}, {101, 102}, {101}, {101}]
    assert faults.allowed_seqs([0] * n, n, base, started=5, done=5)[1] == {102}
    assert faults.allowed_seqs([7, 8, 9, 10], n, base, started=1, done=0) == [{101}, {8, 101}, {9}, {10}]
    assert faults.allowed_seqs([7, 8, 9, 10], n, base, started=-1, done=-1) == [{7}, {8}, {9}, {10}]


def test_checks_catch_a_torn_element() -> None:
    """An element whose leaves come from two writes is reported, a whole one is not."""
    good = faults.element(3, 2, 4)
    assert faults.decode(good, 2, lambda s, i: faults.element(s, i, 4)) == (3, None)
    torn = good.clone()
    torn["tokens"] = faults.element(4, 2, 4)["tokens"]
    seq, problem = faults.decode(torn, 2, lambda s, i: faults.element(s, i, 4))
    assert seq == 3 and problem is not None and "torn" in problem
    moved = good.clone()
    moved["obs"] = torch.zeros_like(moved["obs"])
    assert faults.decode(moved, 2, lambda s, i: faults.element(s, i, 4))[1] is not None
    assert faults.decode(good, 1, lambda s, i: faults.element(s, i, 4))[1] is not None  # another element's value
