"""The demo end to end, its consistency checker, and the CLI around it.

The demo is the project's proof that concurrent writers never tear an element
for a concurrent reader, so the tests check both that it runs clean and that its
checker really catches torn elements (a checker that sees nothing would also
report 0).  Every server here is one the tests start themselves: the demo's own
embedded server, or the session's private server from ``conftest.py``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from helpers import children_from_forkserver, no_retry
from tensordict import TensorDict, lazy_stack

from tdstore.cli import main
from tdstore.demo import check_batch, initial_stack, lost_writes, make_element, redact_url, run_demo, slot_of
from tdstore.demo.llm import check_items, make_rollout
from tdstore.server import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]


def _assert_clean(figures: dict, *, actors: int, count: int, batch: int) -> None:
    """What every successful demo run must report."""
    assert figures["actors"] == actors and figures["count"] == count and figures["batch"] == batch
    assert figures["writes"] > 0 and all(w > 0 for w in figures["writes_per_actor"])
    assert figures["writes"] == sum(figures["writes_per_actor"])
    assert figures["reads"] > 0 and figures["elements_read"] == figures["reads"] * batch
    assert figures["writes_per_s"] > 0 and figures["reads_per_s"] > 0 and figures["elements_read_per_s"] > 0
    assert figures["torn"] == 0, figures["torn_examples"]
    assert figures["verified"] == count, figures["final_examples"]
    assert figures["inconsistent"] == 0 and figures["lost_writes"] == 0
    assert figures["keys_deleted"] > 0
    assert figures["ok"] is True


# -- the checker ---------------------------------------------------------------------------------


def _written(pairs: list[tuple[int, int]], count: int) -> tuple[list[TensorDict], list[int]]:
    """Elements written as (actor, seq) and the slots those writes went to."""
    return [make_element(a, s) for a, s in pairs], [int(slot_of(a, s, count)) for a, s in pairs]


def test_checker_accepts_consistent_batches() -> None:
    count = 64
    els, idx = _written([(0, s) for s in range(20)] + [(1, s) for s in range(20)], count)
    assert check_batch(lazy_stack(els), idx, count=count, actors=2) == {}
    # equal token lengths come back from the store as a dense TensorDict: same verdict
    same = [(a, s) for a in range(3) for s in range(200) if len(make_element(a, s)["tokens"]) == 5][:8]
    els, idx = _written(same, count)
    assert check_batch(torch.stack(els), idx, count=count, actors=3) == {}
    # and the initial content sits at its own index
    assert check_batch(initial_stack(count), np.arange(count), count=count, actors=1) == {}


def test_checker_flags_torn_elements() -> None:
    count = 64
    els, idx = _written([(0, 5), (1, 7), (0, 6), (1, 8), (0, 9)], count)
    # position 0: tokens of another write (length and values disagree with actor/seq)
    els[0]["tokens"] = make_element(1, 7)["tokens"]
    # position 1: obs of another write
    els[1]["obs"] = make_element(1, 6)["obs"]
    # position 2: the nested check leaf from another write
    els[2]["meta", "check"] = make_element(0, 7)["meta", "check"]
    # position 3: a consistent element read at the wrong index (misplaced write)
    idx[3] = (idx[3] + 1) % count
    bad = check_batch(lazy_stack(els), idx, count=count, actors=2)
    assert sorted(bad) == [0, 1, 2, 3]
    assert "tokens" in bad[0][0] and "obs" in bad[1][0] and "check" in bad[2][0] and "went to element" in bad[3][0]
    # an unknown writer is torn too
    els, idx = _written([(0, 1)], count)
    assert list(check_batch(lazy_stack(els), idx, count=count, actors=0)) == [0]


def test_lost_writes_are_found() -> None:
    count = 8
    final = initial_stack(count)
    last_seq = np.full((2, count), -1, dtype=np.int64)
    assert lost_writes(final, np.arange(count), last_seq) == {}
    last_seq[1, 3] = 12  # actor 1 wrote element 3, yet it still holds the initial content
    assert list(lost_writes(final, np.arange(count), last_seq)) == [3]


def test_redact_url_hides_passwords() -> None:
    assert redact_url("redis://user:secret@host:7000/0") == "redis://user:***@host:7000/0"
    assert redact_url("redis://:secret@host") == "redis://:***@host"
    assert redact_url("unix:///tmp/x.sock") == "unix:///tmp/x.sock"


# -- the demo end to end -----------------------------------------------------------------------------


def test_run_demo_in_process(redis_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the session's private server (a given url), so the test can also see that no key is left.

    The path without a url (the demo starts its own server) is run by the CLI test below, whose actors are
    spawned as the demo does it; here they come from the tests' preloaded forkserver.
    """
    children_from_forkserver(monkeypatch)  # the CLI tests below run the demo as it is, with spawn
    prefix = f"test-demo-{uuid.uuid4().hex[:8]}"
    out = io.StringIO()
    figures = run_demo(url=redis_server.url, actors=2, count=64, seconds=1.5, batch=16, prefix=prefix, progress=False, out=out)
    _assert_clean(figures, actors=2, count=64, batch=16)
    assert redis_server.unix_socket_path in figures["server"]
    assert figures["seconds"] > 1.4  # the learner sampled for the whole run (no upper bound: a busy machine may stretch it)
    assert redis_server.client().keys(f"{prefix}:*") == []
    text = out.getvalue()
    assert "0 torn elements" in text and "64/64 elements verified" in text and "OK" in text


def test_run_demo_as_a_prioritized_rate_limited_replay_buffer(redis_server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--replay``: actors extend the ring with priorities, the learner samples by priority and
    updates them, under the server's samples-per-insert limiter; every element checked, none left."""
    children_from_forkserver(monkeypatch)  # the CLI tests below run the demo as it is, with spawn
    prefix = f"test-demo-{uuid.uuid4().hex[:8]}"
    out = io.StringIO()
    figures = run_demo(url=redis_server.url, actors=2, count=32, seconds=1.0, batch=16, prefix=prefix, progress=False, out=out, replay=True)
    assert figures["ok"] and figures["torn"] == 0 and figures["verified"] == 32 and figures["lost_writes"] == 0
    assert "prioritized, rate-limited" in figures["server"] and figures["samples_per_insert"] > 0
    assert redis_server.client().keys(f"{prefix}:*") == []
    assert "rows sampled per row written" in out.getvalue()
    with pytest.raises(ValueError, match="pick one"):
        run_demo(replay=True, torchrl=True, progress=False)


def _cli_demo(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``python -m tdstore demo`` on 2 actors, 32 elements, 1 s, JSON out, in a subprocess; it must succeed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "tdstore", "demo", "--seconds", "1", "--actors", "2", "--count", "32", "--json", *extra],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1200,  # bounds a hang only: a run takes seconds, several times that on a busy CI machine
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_cli_demo_json_in_a_subprocess(tmp_path: Path) -> None:
    proc = _cli_demo(tmp_path)
    figures = json.loads(proc.stdout)  # stdout holds only the JSON
    _assert_clean(figures, actors=2, count=32, batch=32)
    assert figures["server"].startswith("embedded redis-server")  # no --url: the demo started its own
    assert "32/32 elements verified" in proc.stderr  # the human summary went to stderr
    # while the actors start, the demo says so (no silent 0 % bar): each step, then each actor
    steps = [line for line in proc.stderr.splitlines() if line.startswith("tdstore demo: ")]
    assert steps[0] == "tdstore demo: starting an embedded redis-server..."
    assert steps[1].startswith("tdstore demo: server: embedded redis-server") and steps[1].endswith("uploading 32 elements...")
    assert steps[2].startswith("tdstore demo: starting 2 actor processes (each imports torch and connects")
    assert all(" connected (" in line for line in steps[3:5]) and {line[-5:] for line in steps[3:5]} == {"(1/2)", "(2/2)"}
    assert steps[5].startswith("tdstore demo: 2 actors ready after ") and steps[5].endswith("writing and sampling for 1 s")


@pytest.mark.slow
def test_cli_demo_on_its_own_cluster(tmp_path: Path) -> None:
    """``demo --cluster``: the demo starts a three-primary Redis Cluster and runs on it."""
    proc = _cli_demo(tmp_path, "--cluster", "--no-progress")
    figures = json.loads(proc.stdout)
    _assert_clean(figures, actors=2, count=32, batch=32)
    assert figures["server"].startswith("embedded Redis Cluster of 3 primaries") and "redis+cluster://" in figures["server"]


@pytest.mark.slow
def test_cli_demo_on_a_spread_store(tmp_path: Path) -> None:
    """``demo --cluster --spread``: the demo's store has its segments on the cluster's nodes."""
    proc = _cli_demo(tmp_path, "--cluster", "--spread", "--no-progress")
    figures = json.loads(proc.stdout)
    _assert_clean(figures, actors=2, count=32, batch=32)
    assert "the store spread in" in figures["server"]


def test_cluster_tool_starts_and_stops(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cluster", "--seconds", "0.5"], cwd=REPO, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    url = next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("url: "))
    assert url.startswith("redis+cluster://127.0.0.1:") and proc.stdout.rstrip().endswith("stopped")
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(redis.ConnectionError):  # stopped: nothing listens there any more
        redis.Redis(port=port, socket_connect_timeout=1, retry=no_retry()).ping()


# -- the CLI's errors ----------------------------------------------------------------------------------


def test_cli_unreachable_url_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    # port 1 on loopback: nothing listens there, and nothing is started
    assert main(["demo", "--url", "redis://127.0.0.1:1", "--seconds", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server at redis://127.0.0.1:1/0" in err
    assert "Traceback" not in err


def test_cli_contradictory_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing is started: the flags are checked before any server or process."""
    cases = {
        ("demo", "--spread"): "--spread spreads the store over a Redis Cluster's nodes: add --cluster",
        ("demo", "--spread", "--url", "redis://127.0.0.1:1"): "or give --url redis+cluster://HOST:PORT",
        (
            "demo",
            "--cluster",
            "--url",
            "redis+cluster://127.0.0.1:1",
        ): "--cluster starts an embedded cluster, so it cannot be used with --url",
    }
    for argv, message in cases.items():
        assert main([*argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("tdstore demo: error: ") and message in err, err
    with pytest.raises(ValueError, match="--spread"):
        run_demo(spread=True, progress=False)


def test_cli_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["demo", "--count", "0"], ["demo", "--seconds", "-1"], ["demo", "--url", "foo://x", "--no-progress"]):
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse's own usage errors
            code = stop.code
        assert code == 2, argv
    assert "invalid server url 'foo://x'" in capsys.readouterr().err


# -- demo --llm ------------------------------------------------------------------------------------


def test_cli_demo_llm_holds_its_bounds(tmp_path: Path) -> None:
    """``demo --llm``: actor processes write whole groups stamped with versions, the learner pops them by
    token budget with max_staleness and bumps the version; every check holds, exit code 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = ["demo", "--llm", "--actors", "2", "--seconds", "2", "--max-staleness", "1", "--token-budget", "400", "--json"]
    proc = subprocess.run([sys.executable, "-m", "tdstore", *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    f = json.loads(proc.stdout)
    assert f["ok"] is True and f["errors"] == []
    assert f["batches"] > 0 and f["rollouts_written"] > 0 and f["groups_popped"] > 0
    assert f["rows_popped"] == f["groups_popped"] * f["group_size"]  # whole groups, never part of one
    assert f["max_staleness_seen"] <= 1 and 0 < f["max_tokens_per_batch"] <= 400
    assert f["final_version"] == f["batches"]  # one set_version per batch
    assert "OK: the staleness bound held" in proc.stderr and "stale rows skipped" in proc.stderr


def test_llm_checker_catches_partial_and_stale_groups() -> None:
    """The --llm demo's checker is not blind: a partial group, a stale row and a wrong row are each reported."""
    rows = [make_rollout(0, 5, r, 3) for r in range(4)]
    td = lazy_stack(rows)
    ok = {"group_size": 4, "current": 4, "max_staleness": 1}
    assert check_items(td, torch.full((4,), 3), torch.tensor([4]), **ok) == []
    assert "not whole groups" in check_items(td[:3], torch.full((3,), 3), torch.tensor([3]), **ok)[0]
    assert any("more than max_staleness" in e for e in check_items(td, torch.full((4,), 3), torch.tensor([4]), **{**ok, "current": 6}))
    bad = lazy_stack([*rows[:3], make_rollout(0, 5, 3, 3).set("reward", torch.tensor([9.0]))])
    assert any("not what its writer wrote" in e for e in check_items(bad, torch.full((4,), 3), torch.tensor([4]), **ok))
