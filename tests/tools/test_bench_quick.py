"""``python -m tools.bench --quick`` keeps running: every operation yields timings (no speed is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: The operations of issue #6, per case.
EXPECTED = {
    "homogeneous": {
        "upload",
        "upload_vs_plain_upload",
        "dense_upload",
        "element_read",
        "element_write",
        "batch_read",
        "slice_read",
        "full_read",
        "extend",
        "fill",
    },
    "heterogeneous": {
        "upload",
        "upload_vs_plain_upload",
        "element_read",
        "element_write",
        "shape_change_write",
        "batch_read",
        "slice_read",
        "full_read",
        "padded_batch",
        "nested_batch",
        "padded_slice",
        "nested_slice",
        "padded_full",
        "nested_full",
    },
    "large": {"large_read", "large_write"},
}


@pytest.mark.slow
def test_quick_bench_writes_every_operation(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,  # bounds a hang only: a quick run takes about 30 s, several times that on a busy CI machine
    )
    assert proc.returncode == 0, f"bench exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())

    assert report["meta"]["quick"] is True
    assert report["problems"] == []
    seen: dict[str, set[str]] = {}
    for entry in report["results"]:
        seen.setdefault(entry["case"], set()).add(entry["op"])
        for contender in ("tdstore", "raw"):
            summary = entry[contender]
            assert summary["status"] == "ok", (entry["case"], entry["op"], contender, summary)
            assert summary["n"] >= 1
            assert summary["median_ms"] > 0 and summary["min_ms"] > 0
        # the reference either ran or is recorded as raising, never silently missing
        assert entry["reference"]["status"] in ("ok", "raises", "unavailable")
        if entry["reference"]["status"] == "ok":
            assert entry["ratio_ref"] > 0
        assert entry["ratio_raw"] > 0
    assert seen == EXPECTED
    # each heterogeneous read against its homogeneous yardstick (or the raw floor), from the same run
    het = {r["op"]: r for r in report["het_vs_hom"]}
    assert set(het) == {f"{kind}_{what}" for kind in ("padded", "nested") for what in ("batch", "slice", "full")} | {
        "batch_read",
        "slice_read",
        "full_read",
    }
    assert all(r["ratio"] > 0 and r["ms"] > 0 and r["against_ms"] > 0 for r in het.values())

    # the large leaf of --quick stays at 8 MiB
    assert all(e["leaf_bytes"] <= 8 << 20 for e in report["results"] if e["case"] == "large")

    mp = report["mp"]
    assert mp["writers"] == 4 and mp["seconds"] == 1.0
    for contender in ("tdstore", "raw"):
        assert mp[contender]["status"] == "ok", mp[contender]
        assert mp[contender]["writes_per_s"] > 0
    assert mp["reference"]["status"] in ("ok", "raises", "unavailable")
    # the learner's sample rate alone and under 4 extending writers (issue #30), for tdstore and the raw floor
    learner = mp["learner"]
    assert learner["writers"] == 4 and learner["batch"] == 256 and learner["writer_rows"] == 100
    for contender in ("tdstore", "raw"):
        line = learner[contender]
        assert line["status"] == "ok", line
        assert line["idle_per_s"] > 0 and line["loaded_per_s"] > 0 and line["writer_rows_per_s"] > 0
        assert line["kept"] == pytest.approx(line["loaded_per_s"] / line["idle_per_s"])
        assert len(line["cpu_ms_per_sample"]) == 2 and all(0 < share <= 1.5 for share in line["learner_cpu_share"])
    niced = learner["tdstore"]["niced_writers"]  # the diagnosis: the same writers yielding the CPU
    assert niced["loaded_per_s"] > 0 and niced["writer_rows_per_s"] > 0
    assert niced["kept"] == pytest.approx(niced["loaded_per_s"] / learner["tdstore"]["idle_per_s"])
