"""The measuring tools of tools/ run end to end on small sizes (their figures are in tools/README.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(name: str, *args: str) -> str:
    """``python -m tools.<name> ARGS`` from the repository root."""
    proc = subprocess.run([sys.executable, "-m", f"tools.{name}", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_request_id_cost_prints_both_ways_and_the_cache() -> None:
    out = _run("request_id_cost", "--calls", "30")
    assert re.search(r"extend\( 1\) EVALSHA\s+without id\s+[\d.]+ us\s+with id\s+[\d.]+ us\s+ratio [\d.]+", out), out
    assert re.search(r"extend\(32\) whole\s+without id\s+[\d.]+ us\s+with id\s+[\d.]+ us", out), out
    assert re.search(r"reply cache: \d+ records, \d+ bytes", out), out


@pytest.mark.slow
def test_element_cost_prints_both_cases_and_ratios() -> None:
    out = _run("element_cost", "--calls", "20", "--count", "40")
    assert re.search(r"homogeneous\s+read\s+[\d.]+ us\s+write\s+[\d.]+ us", out)
    assert re.search(r"heterogeneous / homogeneous: read [\d.]+x, write [\d.]+x", out)


@pytest.mark.slow
def test_batch_server_time_reports_server_time_and_the_reference() -> None:
    out = _run("batch_server_time", "--count", "300", "--reads", "3", "--reference", "--alternatives")
    assert re.search(
        r"store\[idx\], 256 random\s+wall\s+[\d.]+ ms per read, server\s+[\d.]+ ms per call \(3 EXEC calls\), "
        r"server CPU\s+[\d.]+ ms per read",
        out,
    )
    assert re.search(r"ring.sample\(256\), half\s+wall\s+[\d.]+ ms per read, server\s+[\d.]+ ms per call \(3 EVALSHA calls\)", out)
    assert re.search(r"ring.sample\(256\), full\s+wall\s+[\d.]+ ms per read, server\s+[\d.]+ ms per call \(3 EXEC calls\)", out)
    assert "back to back: tdstore" in out and "right after a reference read" in out
    assert re.search(r"one HMGET of a hash of rows\s+server\s+[\d.]+ ms per call", out) and "memory per 300-byte row" in out


@pytest.mark.slow
def test_spread_bench_compares_both_layouts_on_a_cluster() -> None:
    out = _run("spread_bench", "--mib", "2", "--segment-mib", "1", "--reps", "1")
    assert re.search(r"\d+ elements, 2 MiB, \d+ segments of 1 MiB", out)
    for call in ("whole store", "random batch of 256", r"store\[i\] = td write", "schema change"):
        assert re.search(call + r".*\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), call


@pytest.mark.slow
def test_sharded_bench_compares_a_sharded_ring_with_one_node() -> None:
    out = _run("sharded_bench", "--count", "3000", "--reps", "2", "--writers", "2", "--seconds", "0.5")
    for kind in ("uniform", "prioritized"):
        assert re.search(rf"sample\(256\) {kind}\s*: one node [\d.]+ ms, sharded over 3 [\d.]+ ms, ratio [\d.]+x", out), out
    assert re.search(r"2 writer processes, \d+ rows: script time per primary [\d.]+%, [\d.]+%, [\d.]+%", out), out


@pytest.mark.slow
def test_priority_bench_reports_both_operations_by_capacity() -> None:
    out = _run("priority_bench", "--capacities", "1000,5000", "--reps", "2")
    for cap in (1000, 5000):
        for op in ("sample", "update"):
            assert re.search(rf"^\s+{cap} \| {op}\s+\|\s+[\d.]+ \|", out, re.M), out
    assert re.search(r"tree bytes per capacity: 1000: 9\d+, 5000: \d+", out)


@pytest.mark.slow
def test_wait_bench_compares_pubsub_and_polling() -> None:
    out = _run("wait_bench", "--reps", "3", "--idle", "0.2")
    assert re.search(r"^pubsub\s+\|\s+[\d.]+ \|\s+[\d.]+ \|\s+\d+$", out, re.M), out
    assert re.search(r"^poll 1 ms\s+\|\s+[\d.]+ \|", out, re.M), out


@pytest.mark.slow
def test_lazy_floor_times_both_sizes_and_every_way() -> None:
    out = _run("lazy_floor", "--reps", "3")
    for n in ("256", "10,000"):
        assert re.search(rf"^\s+{n}(\s+[\d.]+){{4}}$", out, re.M), out


@pytest.mark.slow
def test_stall_audit_prints_the_slowest_command_of_every_call() -> None:
    out = _run("stall_audit", "--segments", "32", "--ring", "20000")
    for label in ("upload \\(commit.lua\\)", "expire \\(expire.lua\\)", "clear_redis \\(clear.lua\\)", "enable_priorities on 20000 slots"):
        assert re.search(label + r"\s+slowest\s+[\d.]+ ms", out), out
    assert re.search(r"longest PING gap [\d.]+ ms", out)


@pytest.mark.slow
def test_lease_bench_times_pops_acks_and_the_worst_reclaim() -> None:
    out = _run("lease_bench", "--reps", "1")
    for name in ("plain pop\\(1000\\)", "leased pop\\(1000\\)", "ack\\(1000\\)", "pop\\(1024\\) reclaiming 64 leases"):
        assert re.search(rf"^{name}\s+\|\s+[\d.]+ \|\s+[\d.]+$", out, re.M), out


@pytest.mark.slow
def test_checkpoint_bench_reports_export_and_import() -> None:
    out = _run("checkpoint_bench", "--elements", "3000", "--ragged")
    for mode in ("export", "import"):
        assert re.search(rf"^{mode}\s+[\d.]+ s\s+\d+ MiB/s\s+peak memory over baseline\s+[\d.]+ MiB$", out, re.M), out
    assert "restored ring state and 'step' identical: True" in out


@pytest.mark.slow
def test_helpers_cost_compares_both_script_texts() -> None:
    out = _run("helpers_cost", "--rounds", "2", "--calls", "20", "--count", "100")
    for mode in ("every helper", "helpers used"):
        assert re.search(
            mode + r"\s+server us per EVALSHA: element write\s+[\d.]+\s+element read\s+[\d.]+\s+extend\(500\)\s+[\d.]+;"
            r"\s+element write / raw floor [\d.]+x",
            out,
        ), out


@pytest.mark.slow
def test_grpo_bench_runs_the_tdstore_side() -> None:
    """The GRPO-shaped workload on tdstore, tiny; the Ray side is skipped here (it starts a Ray cluster, and
    ray is an optional ``bench`` extra): the tool says so."""
    out = _run("grpo_bench", "--writers", "2", "--groups", "3", "--group", "4", "--samples", "5", "--no-ray")
    assert re.search(r"^tdstore\s+\|\s+[\d.]+\s+\|\s+[\d.]+\s*$", out, re.M), out
    assert "ray side skipped" in out, out


@pytest.mark.slow
def test_slice_bench_compares_server_slices_with_torchrl_in_memory() -> None:
    out = _run("slice_bench", "--sizes", "3000", "--reps", "2", "--before-reps", "1")
    assert re.search(
        r"3,000\s+\d+\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+ \(\s*[\d.]+\)\s+[\d.]+x\s+1.00x\s+[\d.]+ ms", out
    ), out
