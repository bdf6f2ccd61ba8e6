"""Tests of ``python -m tools.stress``: its checks on their own, then short runs in a subprocess.

The runs start their own embedded redis-server (unix socket, no persistence),
never one they did not start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import load_tool

ROOT = Path(__file__).resolve().parents[2]


stress = load_tool("stress")
stress_workers = load_tool("stress.workers")


def run_tool(tmp_path: Path, *args: str, timeout: float = 1200) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """Run the tool with ``args`` and return the process and its ``--json`` figures.

    ``timeout`` bounds a hang only: a run takes 10-20 s, several times that on a busy CI machine.
    """
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.stress", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), f"no figures written (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out.read_text())


# -- the checks themselves (no server) ------------------------------------------------------
OWNER = [0, 0, 1, 1]


def _element(w: int, seq: int, row: int) -> Any:
    td = stress.initial_element(w, row)
    td.update(stress.make_element(w, seq, row))
    return td


def test_consistent_element_passes() -> None:
    for seq in (0, 1, 2, 7, stress.SEQ_LIMIT - 2):
        got_seq, problem = stress.check_element(_element(1, seq, 3), 3, OWNER)
        assert problem is None and got_seq == seq


def test_tokens_length_changes_with_seq_and_row() -> None:
    lengths = {stress.tokens_len(1, seq, row) for seq in range(20) for row in range(4)}
    assert len(lengths) > 3
    # odd seqs spread lengths over rows (lazy-stack batches), even seqs do not (dense batches)
    assert len({stress.tokens_len(1, 3, row) for row in range(8)}) > 1
    assert len({stress.tokens_len(1, 4, row) for row in range(8)}) == 1


@pytest.mark.parametrize("leaf", [("obs",), ("tokens",), ("small",), ("nested", "a"), ("nested", "deeper", "b"), ("nested", "ragged")])
def test_leaf_from_another_write_is_torn(leaf: tuple[str, ...]) -> None:
    td = _element(1, 10, 2)
    td[leaf] = stress.make_element(1, 11, 2)[leaf]
    seq, problem = stress.check_element(td, 2, OWNER)
    assert problem is not None and repr(leaf[0] if len(leaf) == 1 else leaf) in problem


def test_wrong_tokens_length_and_wrong_owner_are_torn() -> None:
    td = _element(1, 10, 2)
    td["tokens"] = torch.cat([td["tokens"], torch.zeros(1, dtype=torch.int64)])
    assert stress.check_element(td, 2, OWNER)[1] is not None
    assert stress.check_element(_element(0, 10, 2), 2, OWNER)[1] is not None  # row 2 belongs to writer 1


def test_racer_keys_are_checked() -> None:
    td = _element(1, 10, 2)
    td["extra_k"] = torch.full((3,), stress.EXTRA_VALUE)
    td["spare"] = torch.full((2,), 3, dtype=torch.int64)
    assert stress.check_element(td, 2, OWNER)[1] is None
    td["spare"] = torch.full((2,), 3.0, dtype=torch.float64)  # 3 is the int64 value, not the float64 one
    assert stress.check_element(td, 2, OWNER)[1] is not None
    td = _element(1, 10, 2)
    td["aux_renamed"] = td["aux"]  # both names at once: not one atomic schema
    assert stress.check_element(td, 2, OWNER)[1] is not None


def test_observer_counts_regressions() -> None:
    tally = stress.Tally("t")
    obs = stress_workers._Observer(tally, OWNER)
    obs.element(2, _element(1, 5, 2), "read")
    obs.element(2, _element(1, 5, 2), "read")
    obs.element(2, _element(1, 7, 2), "read")
    assert tally.regressed == 0 and tally.torn == 0
    obs.element(2, _element(1, 6, 2), "read")
    assert tally.regressed == 1


# -- short runs on a private server ------------------------------------------------------------
def test_smoke_run(tmp_path: Path) -> None:
    proc, fig = run_tool(tmp_path, "--writers", "3", "--readers", "2", "--seconds", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert fig["ok"] is True
    assert fig["torn"] == 0 and fig["lost"] == 0 and fig["errors"] == 0, fig
    assert fig["writes_total"] > 0 and fig["reads_total"] > 0
    # three writers share the five write kinds; every kind and every read kind ran
    for kind in stress.WRITE_KINDS:
        assert fig["ops"].get(f"write.{kind}", 0) > 0, fig["ops"]
    for kind in stress.READ_KINDS:
        assert fig["ops"].get(f"read.{kind}", 0) > 0, fig["ops"]
    assert "result: PASS" in proc.stdout


def test_segmented_run(tmp_path: Path) -> None:
    """The same mix on a store cut into many segments: batch, slice and schema calls cross them."""
    proc, fig = run_tool(
        tmp_path,
        "--writers",
        "2",
        "--readers",
        "2",
        "--seconds",
        "3",
        "--segment-bytes",
        "256",
        "--schema-races",
        "--schema-interval",
        "0.05",
    )
    assert fig["server"]["segments"] > 8, fig["server"]
    assert fig["torn"] == 0 and fig["lost"] == 0 and fig["errors"] == 0, fig
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_cluster_run(tmp_path: Path) -> None:
    """The same mix on a private three-primary Redis Cluster, with a process changing the schema."""
    proc, fig = run_tool(
        tmp_path, "--cluster", "--writers", "2", "--readers", "2", "--seconds", "3", "--schema-races", "--schema-interval", "0.05"
    )
    assert "cluster of 3 primaries" in fig["server"]["version"]
    assert fig["torn"] == 0 and fig["lost"] == 0 and fig["errors"] == 0, fig
    assert fig["writes_total"] > 0 and fig["reads_total"] > 0
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_race_run(tmp_path: Path) -> None:
    proc, fig = run_tool(tmp_path, "--writers", "2", "--readers", "2", "--seconds", "3", "--schema-races", "--schema-interval", "0.05")
    assert fig["torn"] == 0 and fig["lost"] == 0, fig
    assert fig["writes_total"] > 0 and fig["reads_total"] > 0
    for kind in stress.SCHEMA_KINDS:
        assert fig["ops"].get(f"schema.{kind}", 0) > 0, fig["ops"]
    assert proc.returncode == 0 and fig["errors"] == 0, proc.stdout + proc.stderr


def test_ring_row_from_two_extends_is_torn() -> None:
    rows = stress.make_ring_rows(1, 9, 4)
    assert stress.check_ring_row(rows[2], "r", 2) is None
    torn = rows[2].clone()
    torn["obs"] = stress.make_ring_rows(1, 8, 4)[2]["obs"]  # the obs of the writer's previous extend
    assert "holds" in (stress.check_ring_row(torn, "r", 2) or "")
    assert "never written" in (stress.check_ring_row(rows[2], "r", 1) or "")  # writer 1 of one


def test_ring_run(tmp_path: Path) -> None:
    """Ring writers extending as fast as they can (rows as SETRANGEs in a transaction when the cursor is
    theirs, else write.lua) beside the element mix: no reader sees a torn row, the counter adds up."""
    proc, fig = run_tool(tmp_path, "--writers", "1", "--readers", "1", "--ring-writers", "2", "--ring-readers", "2", "--seconds", "3")
    assert fig["torn"] == 0 and fig["lost"] == 0 and fig["errors"] == 0, fig
    assert fig["ring_extends"].get("direct", 0) > 0, fig["ring_extends"]
    for kind in stress.RING_READ_KINDS:
        assert fig["ops"].get(f"read.ring_{kind}", 0) > 0, fig["ops"]
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_injected_faults_are_caught(tmp_path: Path) -> None:
    """The run fails when elements are written in two calls: the checks are not vacuous."""
    proc, fig = run_tool(tmp_path, "--writers", "1", "--readers", "2", "--seconds", "2", "--rows-per-writer", "4", "--fault", "split")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert fig["torn"] > 0 and fig["ok"] is False, proc.stdout
