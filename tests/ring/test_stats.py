"""A ring's counters (``stats()``, ``lua/_lib.lua`` ``tds_stat``) cost no round trip, go with the store, and are
what ``tdstore top`` and ``tdstore metrics`` show. (The counts per kind of ring: tests/contract, test_stats_*.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from helpers import round_trips, top_level_commands
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, ShardedRing
from tdstore._inspect.stats import add_up
from tdstore.cli.watch import collect, prometheus_text, top_frame

REPO = Path(__file__).resolve().parents[2]
HANG = 60.0  # seconds: only bounds a hang


def rows(lo: int, n: int) -> TensorDict:
    return TensorDict(obs=torch.arange(lo, lo + n, dtype=torch.float32).unsqueeze(-1).expand(n, 3).clone(), batch_size=[n])


def test_counting_costs_no_round_trip(real):
    ring = LazyStackedTensorDictStore(count=64, **real.kwargs())
    ring.extend(rows(0, 8))
    ring.extend(rows(8, 8))  # scripts loaded, header cached
    ring.sample(4)
    calls = {
        "extend": lambda: ring.extend(rows(16, 8)),
        "sample": lambda: ring.sample(16),
        "pop": lambda: ring.pop(4),
        "leased pop": lambda: ring.pop(4, lease=600),
    }
    for name, fn in calls.items():
        before = ring.stats()
        top = top_level_commands(real.client, fn)
        assert len(round_trips(top)) == 1, (name, top)
        lua = top_level_commands(real.client, fn, lua=True)  # the same call again: what its script ran
        assert "hincrby" in lua, (name, lua)  # counted by the call's own script
        assert ring.stats() != before, name
    ring.extend(rows(100, 64))  # full: a uniform sample is one transaction of GETRANGEs, its counter inside it
    ring.sample(8)
    ring.sample(8)  # the first transaction makes the field 'smpx': the client then gives the hash the deadline (once)
    before = ring.stats()["sampled"]
    top = top_level_commands(real.client, lambda: ring.sample(8))
    # distinct rows not tracked (the default): a plain HINCRBY, no bitmap, no script
    assert round_trips(top) == ["transaction"] and "hincrby" in top, top
    assert not {"bitfield", "eval", "evalsha"} & set(top), top
    assert ring.stats()["sampled"] == before + 8 and ring.stats()["distinct_sampled"] is None
    assert not real.client().exists(ring._engine.keys.sampled_rows)
    ring.track_distinct()
    top = top_level_commands(real.client, lambda: ring.sample(8))
    assert round_trips(top) == ["transaction"] and "bitfield" in top and "eval" in top, top  # lua/sampled.lua (its text, once)
    assert "hincrby" in top_level_commands(real.client, lambda: ring.sample(8), lua=True)
    assert "evalsha" in top_level_commands(real.client, lambda: ring.sample(8))  # then by its sha
    ring.clear_redis()


def test_distinct_rows_off_by_default_no_bitmap_work(real):
    """Off (the default): no script samples or writes touch a bitmap, and the distinct stats are None."""
    ring = LazyStackedTensorDictStore(count=16, **real.kwargs())
    ring.extend(rows(0, 8))
    ring.sample(4)
    lua = top_level_commands(real.client, lambda: ring.sample(4), lua=True)  # read.lua, half-full
    assert "hincrby" in lua and "bitfield" not in lua, lua
    lua = top_level_commands(real.client, lambda: ring.extend(rows(8, 12)), lua=True)  # overwrites rows
    assert not {"bitfield", "bitcount", "setrange"} & set(lua), lua
    st = ring.stats()
    assert st["inserted"] == 20 and st["sampled"] == 8
    assert all(st[k] is None for k in ("distinct_sampled", "overwritten_unsampled", "overwritten_sampled", "sampled_resident")), st
    assert not real.client().exists(ring._engine.keys.sampled_rows)
    assert "ovu" not in {k.decode() for k in real.client().hkeys(ring._engine.keys.stats)}
    ring.clear_redis()


def test_distinct_rows_counted_from_when_turned_on_and_seen_by_every_handle(real):
    """Turned on by one handle: another (its header cached before) marks its samples, transaction ones too;
    the bitmap starts empty; turned off, the bitmap is gone and the stats say None again."""
    ring = LazyStackedTensorDictStore(count=8, **real.kwargs())
    ring.extend(rows(0, 8))
    other = LazyStackedTensorDictStore.from_store(td_id=ring.td_id, **real.kwargs())
    other.sample(4)
    other.sample(4)  # a full ring: transactions, planned from a header without the setting
    ring.track_distinct()
    assert ring.stats()["distinct_sampled"] == 0  # nothing counted from before
    got = other.sample(6)  # stale handle: still marks
    assert ring.stats()["sampled_resident"] == len(set(got.indices.tolist()))
    other.track_distinct(True)  # already on: changes nothing
    assert ring.stats()["sampled_resident"] == len(set(got.indices.tolist()))
    ring.track_distinct(False)
    other.sample(6)
    assert ring.stats()["distinct_sampled"] is None and not real.client().exists(ring._engine.keys.sampled_rows)
    with pytest.raises(TypeError, match="track_distinct"):
        ring.track_distinct("yes")  # type: ignore[arg-type]
    ring.clear_redis()


def test_counters_go_with_the_store_and_its_time_to_live(backend):
    td_id = f"stats-{uuid.uuid4().hex[:8]}"
    ring = LazyStackedTensorDictStore(count=8, td_id=td_id, **backend.kwargs())
    if isinstance(ring, ShardedRing):
        pytest.skip("a sharded ring has no time to live")
    ring.expire(600)
    ring.extend(rows(0, 5))
    ring.sample(3)
    stats_key = ring._engine.keys.stats
    client = backend.client()
    assert client.exists(stats_key) and 0 < client.pttl(stats_key) <= 600_000  # expires with the store
    assert ring.stats()["inserted"] == 5
    ring.clear_redis()
    assert not client.exists(stats_key)  # deleted with it
    again = LazyStackedTensorDictStore(count=8, td_id=td_id, **backend.kwargs())
    assert again.stats()["inserted"] == 0 and again.stats()["sampled"] == 0  # a new store starts at zero
    again.clear_redis()


def test_a_read_only_handle_samples_without_counting(real):
    ring = LazyStackedTensorDictStore(count=8, **real.kwargs())
    ring.extend(rows(0, 4))
    reader = LazyStackedTensorDictStore(count=8, td_id=ring.td_id, readonly=True, **real.kwargs())
    reader.sample(3)
    assert ring.stats()["sampled"] == 0 and reader.stats()["inserted"] == 4
    ring.clear_redis()


def test_the_time_a_call_was_held_is_counted_by_the_try_that_goes_through(real):
    ring = LazyStackedTensorDictStore(count=4, **real.kwargs())
    other = LazyStackedTensorDictStore(count=4, td_id=ring.td_id, **real.kwargs())
    ring.set_queue(True)
    ring.extend(rows(0, 4))

    def later(call) -> threading.Thread:
        def run() -> None:
            end = time.monotonic() + HANG
            while not ring.stats()["waiting"]:  # the held call was answered WAIT and waits on the store's channel
                assert time.monotonic() < end
                time.sleep(0.02)
            time.sleep(0.3)  # so it waits at least this long: it goes on only after this call
            call()

        t = threading.Thread(target=run)
        t.start()
        return t

    t = later(lambda: other.pop(2))
    ring.extend(rows(4, 2), timeout=HANG)  # a full queue: held until the pop
    t.join()
    other.pop(4)
    t = later(lambda: other.extend(rows(6, 1)))
    ring.pop(1, timeout=HANG)  # nothing unread: held until the extend
    t.join()
    st = ring.stats()
    assert st["held_writes"] >= 1 and st["held_writes_ms"] >= 300
    assert st["held_pops_ms"] >= 300 and st["held_samples_ms"] == 0
    ring.clear_redis()


# -- distinct rows sampled, and the stats keys' time to live ---------------------------------------------


class _Model:
    """What ``distinct_sampled`` and ``overwritten_unsampled`` must say: each slot's row, sampled since written or not."""

    def __init__(self, count: int) -> None:
        self.count, self.rw, self.sampled = count, 0, [False] * count
        self.over_sampled = self.over_unsampled = 0

    def extend(self, n: int) -> None:
        for w in range(self.rw, self.rw + n):
            if w >= self.count:  # overwrites the row of ring write w - count
                if self.sampled[w % self.count]:
                    self.over_sampled += 1
                else:
                    self.over_unsampled += 1
            self.sampled[w % self.count] = False
        self.rw += n

    def sample(self, slots: list[int]) -> None:
        for s in slots:
            self.sampled[s] = True

    def check(self, st: dict) -> None:
        resident = sum(self.sampled)
        assert (st["sampled_resident"], st["overwritten_unsampled"]) == (resident, self.over_unsampled), st
        assert st["distinct_sampled"] == self.over_sampled + resident


@pytest.mark.parametrize("policy", ["none", "limiter"])  # direct writes and uniform draws, or write.lua and the 'P' op
def test_distinct_rows_sampled_and_rows_overwritten_unsampled(backend, policy):
    """Ring writes of every length (wrapping, cutting bytes of the bitmap anywhere) between samples of a half-full
    and a full ring (read.lua, then a transaction), against a model of each slot."""
    count = 37  # not a multiple of 8: every bit position of a byte starts and ends some write
    ring = LazyStackedTensorDictStore(count=count, **backend.kwargs())
    ring.track_distinct()
    if policy == "limiter":
        ring.set_rate_limit(min_size=1)
    model = _Model(count)
    gen = torch.Generator().manual_seed(7)
    for step, n in enumerate([5, 3, 9, 1, 8, 16, 37, 2, 30, 7, 11, 36, 4]):
        ring.extend(rows(100 * step, n))
        model.extend(n)
        got = ring.sample(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen)
        model.sample(got.indices.tolist())
        model.check(ring.stats())
    st = ring.stats()
    assert st["inserted"] == model.rw and st["sampled"] > 0
    assert st["age_policy_versions"] is None  # no rollouts on this ring: no row carries a policy version
    ring.clear_redis()
    client = backend.client()
    assert not client.exists(ring._engine.keys.sampled_rows) and not client.exists(ring._engine.keys.stats)


def test_slices_sampled_are_distinct_rows_too(one_node):
    """``sample_slices`` (read.lua's 'J' op) marks its rows like ``sample``."""
    ring = LazyStackedTensorDictStore(count=24, **one_node.kwargs())
    ring.track_distinct()
    ring.set_trajectories(traj_key="episode")
    n = 20
    ring.extend(TensorDict(obs=torch.randn(n, 3), episode=torch.arange(n) // 5, batch_size=[n]))
    got = ring.sample_slices(8, num_slices=2)
    st = ring.stats()
    assert st["sampled"] == 8 and st["distinct_sampled"] == len(set(got.indices.tolist()))
    ring.clear_redis()


def _deadlines(client, ring) -> tuple[int, int]:
    keys = ring._engine.keys
    return client.pttl(keys.stats), client.pttl(keys.sampled_rows)


@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("first", ["upload", "extend", "limiter"])
def test_the_stats_keys_get_the_store_time_to_live_whatever_call_makes_them(backend, first, distinct):
    """A store made with ``ttl=``: the stats hash and the bitmap expire with it, made by a full ring's sample read
    as a transaction (the first counted call of an uploaded ring), a direct extend and read.lua's uniform draws,
    or write.lua and the sampling policy's draws."""
    if backend.name == "cluster" and first == "upload":
        pytest.skip("a sharded ring is made otherwise (test_sharded)")
    client = backend.client()
    if first == "upload":
        ring = LazyStackedTensorDictStore.from_lazy_stack(torch.stack([rows(i, 1)[0] for i in range(12)]), ttl=600, **backend.kwargs())
    else:
        ring = LazyStackedTensorDictStore(count=12, ttl=600, **backend.kwargs())
        if first == "limiter":
            ring.set_rate_limit(min_size=1)
        ring.extend(rows(0, 12))
    if isinstance(ring, ShardedRing):
        pytest.skip("a sharded ring has no time to live")
    if distinct:
        ring.track_distinct()
    ring.sample(6)
    ring.extend(rows(20, 5))  # overwrites: clears bits
    ring.sample(6)
    hash_ms, bits_ms = _deadlines(client, ring)
    if distinct:
        assert 0 < hash_ms <= 600_000 and 0 < bits_ms <= 600_000, (hash_ms, bits_ms)
        assert ring.stats()["distinct_sampled"] >= 1
    else:  # a plain HINCRBY in the transaction made the hash: the client gave it the deadline after
        assert 0 < hash_ms <= 600_000 and bits_ms == -2, (hash_ms, bits_ms)
        assert ring.stats()["distinct_sampled"] is None
    ring.clear_redis()


def test_a_transaction_sample_is_counted_once_after_the_scripts_were_flushed(real):
    ring = LazyStackedTensorDictStore(count=8, **real.kwargs())
    ring.extend(rows(0, 8))
    ring.sample(4)
    ring.sample(4)  # a full ring: a transaction of GETRANGEs, its counting script at the end
    before = ring.stats()["sampled"]
    real.client().script_flush()
    top = top_level_commands(real.client, lambda: ring.sample(5))
    assert "exec" in top and ring.stats()["sampled"] == before + 5  # run again through the script path, once
    ring.clear_redis()


def test_the_counting_script_of_a_transaction_leaves_nothing_for_a_store_that_is_gone(real):
    from tdstore._engine import scripts

    ring = LazyStackedTensorDictStore(count=8, **real.kwargs())
    keys = ring._engine.keys
    ring.clear_redis()
    client = real.client()
    client.setbit(keys.sampled_rows, 3, 1)  # what the transaction's BITFIELD made just before
    reply = scripts.call(client, "sampled", [keys.meta, keys.stats, keys.sampled_rows], [4])
    assert reply == [b"GONE"] and not client.exists(keys.sampled_rows) and not client.exists(keys.stats)


def test_readers_held_time_and_the_priority_summary(real):
    ring = LazyStackedTensorDictStore(count=8, **real.kwargs())
    other = LazyStackedTensorDictStore(count=8, td_id=ring.td_id, **real.kwargs())
    ring.set_rate_limit(min_size=4)
    ring.extend(rows(0, 2))
    done = threading.Event()

    def later() -> None:
        end = time.monotonic() + HANG
        while other.stats()["held_samples"] < 1:  # the sample was answered WAIT: it is held from before now
            assert time.monotonic() < end
            time.sleep(0.02)
        time.sleep(0.3)  # so it is held at least this long
        other.extend(rows(2, 2))
        done.set()

    t = threading.Thread(target=later)
    t.start()
    ring.sample(2, timeout=HANG)  # held by min_size until the extend
    t.join()
    st = ring.stats()
    assert done.is_set() and st["held_samples_ms"] >= 299 and st["held_samples"] >= 1  # (whole ms)
    ring.enable_priorities(1.0)
    ring.update_priority(torch.tensor([0, 1]), torch.tensor([5.0, 3.0]))
    pr = ring.stats()["priority"]
    assert pr["alpha"] == 1.0 and pr["max_priority"] == 5.0 and pr["total"] == pytest.approx(5.0 + 3.0 + 2 * 1.0)
    ring.clear_redis()


# -- tdstore top and tdstore metrics ------------------------------------------------------------------


def _cli(*argv: str, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tdstore", *argv], capture_output=True, text=True, env=env, timeout=HANG, **kw)


@pytest.fixture
def busy(real):
    """A ring under a test-private prefix with known counts: 40 rows inserted, 24 sampled (the distinct rows among
    them: the third item), 5 popped."""
    ring = LazyStackedTensorDictStore(count=48, td_id="busy-ring", **real.kwargs())
    ring.track_distinct()
    ring.extend(rows(0, 20))
    ring.extend(rows(20, 20))
    drawn = {int(i) for n in (16, 8) for i in ring.sample(n).indices}
    ring.pop(5)
    ring.set_rate_limit(min_size=4)
    yield real, ring, len(drawn)
    ring.clear_redis()


def test_top_and_metrics_of_a_ring_not_tracking_distinct_rows(real):
    """Off (the default): top shows '-' under DISTINCT/UNSAMPLED, metrics omit those series."""
    ring = LazyStackedTensorDictStore(count=8, td_id="plain-ring", **real.kwargs())
    ring.extend(rows(0, 8))
    ring.sample(4)
    got = collect(real.client(), real.prefix, [], False)
    screen = "\n".join(top_frame(got, {}, 1.0, "here", real.prefix))
    assert _column(screen, "plain-ring", "DISTINCT") == "-" and _column(screen, "plain-ring", "UNSAMPLED") == "-", screen
    text = prometheus_text(got, real.prefix)
    assert "tdstore_sampled_total{" in text and "tdstore_distinct_sampled_total{" not in text
    assert "tdstore_sampled_resident{" not in text and "tdstore_overwritten_unsampled_total{" not in text
    ring.clear_redis()


def test_top_once_prints_one_frame_with_rates(busy):
    real, ring, distinct = busy
    got = _cli("top", "--once", "--interval", "0.3", "--url", real.server.url, "--prefix", real.prefix)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert "1 stores under prefix" in lines[0] and "FILL" in lines[1] and "INS/S" in lines[1]
    row = lines[2].split()
    assert row[0] == "busy-ring" and row[2] == "40/48" and row[3] == "0.0"  # nothing inserted during the interval
    assert _column(got.stdout, "busy-ring", "DISTINCT") == str(distinct) and _column(got.stdout, "busy-ring", "UNSAMPLED") == "0"
    assert "ok" in lines[2]  # the limiter (min_size 4) lets samples through


def test_metrics_once_is_prometheus_text(busy):
    real, ring, distinct = busy
    got = _cli("metrics", "--once", "--url", real.server.url, "--prefix", real.prefix)
    assert got.returncode == 0, got.stderr
    samples, types = _parse_exposition(got.stdout)
    labels = f'prefix="{real.prefix}",store="busy-ring",shard=""'
    assert samples[f"tdstore_inserted_total{{{labels}}}"] == 40.0
    assert samples[f"tdstore_sampled_total{{{labels}}}"] == 24.0
    assert samples[f"tdstore_popped_total{{{labels}}}"] == 5.0
    assert samples[f"tdstore_capacity{{{labels}}}"] == 48.0
    assert samples[f"tdstore_distinct_sampled_total{{{labels}}}"] == distinct == samples[f"tdstore_sampled_resident{{{labels}}}"]
    assert samples[f"tdstore_overwritten_unsampled_total{{{labels}}}"] == 0.0 and types["tdstore_distinct_sampled_total"] == "counter"
    assert types["tdstore_inserted_total"] == "counter" and types["tdstore_written"] == "gauge"


def _parse_exposition(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus' text format, line by line: every metric HELP'd and TYPE'd before its samples."""
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    helped: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge") and name in helped
            types[name] = kind
        else:
            m = re.fullmatch(r'(tdstore_[a-z_]+)\{prefix="[^"]*",store="[^"]*",shard="\d*"\} (\S+)', line)
            assert m is not None, line
            assert m.group(1) in types, line
            samples[line.rsplit(" ", 1)[0]] = float(m.group(2))
    return samples, types


def test_metrics_served_over_http(busy):
    real, ring, distinct = busy
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "tdstore", "metrics", "--port", "0", "--url", real.server.url, "--prefix", real.prefix]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # "serving http://127.0.0.1:PORT/metrics ..."
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert m is not None, line
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=HANG) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            samples, _ = _parse_exposition(resp.read().decode())
        assert samples[f'tdstore_inserted_total{{prefix="{real.prefix}",store="busy-ring",shard=""}}'] == 40.0
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/other", timeout=HANG)
    finally:
        proc.terminate()
        proc.wait(HANG)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux): top's live view is tested in it")
def test_top_in_a_terminal_shows_the_store_and_quits_on_q(busy, tmp_path):
    real, ring, distinct = busy
    sock, session, done = f"tdstore-test-{uuid.uuid4().hex[:8]}", "top", tmp_path / "exit-code"
    command = f"PYTHONPATH={REPO} {sys.executable} -m tdstore top --url {real.server.url} --prefix {real.prefix}; echo $? > {done}"
    tmux = ["tmux", "-L", sock]  # a private tmux server: nobody else's sessions
    subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "40", "-s", session, command], check=True, timeout=HANG)
    try:
        screen = _screen_once(tmux, session, lambda s: re.search(r"busy-ring\s+-\s+\d+/48\s+0\.0", s) is not None)  # rates: none yet
        assert _column(screen, "busy-ring", "DISTINCT") == str(distinct) and _column(screen, "busy-ring", "UNSAMPLED") == "0"
        ring.extend(rows(100, 48))  # every row overwritten: those never sampled are counted
        unsampled = str(40 - distinct)  # rows 0..39 overwritten (slots 40..47 held none), those sampled are not counted
        _screen_once(tmux, session, lambda s: _column(s, "busy-ring", "UNSAMPLED") == unsampled)
        ring.extend(rows(0, 10))  # the next frame shows inserts per second (the frame stays a second)
        _screen_once(tmux, session, lambda s: re.search(r"busy-ring\s+-\s+\d+/48\s+([1-9]\d*\.\d|0\.[1-9])", s) is not None)
        subprocess.run([*tmux, "send-keys", "-t", session, "q"], check=True, timeout=HANG)
        end = time.monotonic() + HANG
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < end, "top did not quit on q"
            time.sleep(0.05)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=HANG)


def _column(screen: str, store: str, name: str) -> str | None:
    """The cell under the header ``name`` in the row of ``store`` on a screen of ``top`` (cells: runs without two spaces)."""
    lines = screen.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("STORE")), None)
    if head is None:
        return None
    names = re.split(r"\s{2,}", lines[head].strip())
    for line in lines[head + 1 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == store and len(cells) == len(names):
            return cells[names.index(name)]
    return None


def _screen_once(tmux: list[str], session: str, ok) -> str:
    """The pane's text, once ``ok(text)`` holds (read every 0.1 s; a long limit only bounds a hang)."""
    end = time.monotonic() + HANG
    screen = ""
    while time.monotonic() < end:
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, timeout=HANG).stdout
        if ok(screen):
            return screen
        time.sleep(0.1)
    pytest.fail(f"the screen never showed what was expected:\n{screen}")


def test_age_in_policy_versions_of_rows_sampled_and_popped(real):
    """Rows stamped versions 1, 2, 3 taken at published version 5: each is 5 - v versions old, counted by the call
    that takes it (sample and pop, not a resent pop); a row ahead of the published version counts 0. A ring
    without rollouts says None. Top shows it under AGE V, metrics as tdstore_sampled_age_versions_*."""
    plain = LazyStackedTensorDictStore(count=8, td_id="plain-ring", **real.kwargs())
    plain.extend(rows(0, 8))
    plain.sample(4)
    plain.pop(2)
    st = plain.stats()
    assert st["age_policy_versions"] is None and st["age_policy_versions_max"] is None and st["age_versions_rows"] == 0
    ring = LazyStackedTensorDictStore(count=16, td_id="versioned-ring", **real.kwargs())
    for v in (1, 2, 3):
        ring.extend(rows(10 * v, 2), version=v)
    ring.set_version(5)
    assert ring.stats()["age_policy_versions"] is None  # nothing taken yet
    got = ring.sample(40, generator=torch.Generator().manual_seed(3))
    ages = [5 - v for v in got.versions.tolist()]
    popped = ring.pop(3, request_id="cd" * 16)  # versions 1, 1, 2: 4, 4, 3 old
    assert popped.versions.tolist() == [1, 1, 2]
    ring.pop(3, request_id="cd" * 16)  # resent: counted once
    ages += [4, 4, 3]
    ring.extend(rows(90, 1), version=7)  # ahead of the published version
    ring.sample(2, max_staleness=0)
    ages += [0, 0]
    st = ring.stats()
    assert st["age_versions_rows"] == len(ages) and st["age_versions_sum"] == sum(ages)
    assert st["age_policy_versions"] == sum(ages) / len(ages) and st["age_policy_versions_max"] == max(ages) == 4
    assert st["sampled"] == 42 and st["popped"] == 3
    totals = add_up([st, st])  # a sharded ring's stats (it refuses rollouts): None
    assert totals["age_policy_versions"] is None and totals["age_policy_versions_max"] is None
    seen = collect(real.client(), real.prefix, [], False)
    screen = "\n".join(top_frame(seen, {}, 1.0, "here", real.prefix))
    assert _column(screen, "versioned-ring", "AGE V") == f"{sum(ages) / len(ages):.1f}/4", screen
    assert _column(screen, "plain-ring", "AGE V") == "-", screen
    text = prometheus_text(seen, real.prefix)
    assert f'tdstore_sampled_age_versions_sum_total{{prefix="{real.prefix}",store="versioned-ring",shard=""}} {sum(ages)}' in text
    assert f'tdstore_sampled_age_versions_max{{prefix="{real.prefix}",store="versioned-ring",shard=""}} 4' in text
    assert 'tdstore_sampled_age_versions_max{prefix="' + real.prefix + '",store="plain-ring"' not in text
    plain.clear_redis()
    ring.clear_redis()
