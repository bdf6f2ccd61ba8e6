"""``tdstore ls``, ``info``, ``rm`` and ``bench`` end to end, on the session's private server.

Every command gets ``--url`` of the server ``conftest.py`` started (or a port the
test just closed), never a default: nothing here may reach a server the tests did
not start.  Each test works under its own prefix, so stores of other tests never
show up in a listing.
"""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, lazy_stack

import tdstore
from tdstore import LazyStackedTensorDictStore
from tdstore._format.keys import StoreKeys, registry_key
from tdstore.cli import main
from tdstore.server import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(redis_server: EmbeddedServer) -> str:
    return redis_server.url


@pytest.fixture
def prefix() -> str:
    return f"cli-{uuid.uuid4().hex[:10]}"


def _het_stack(n: int = 4) -> TensorDict:
    """Elements with a homogeneous, a nested and a heterogeneous (varying length) key."""
    return lazy_stack(
        [
            TensorDict(
                {"obs": torch.full((3,), float(i)), "tokens": torch.arange(i + 1, dtype=torch.int32), "meta": {"step": torch.tensor(i)}},
                [],
            )
            for i in range(n)
        ]
    )


def _dense_stack(n: int = 5) -> TensorDict:
    return lazy_stack([TensorDict({"x": torch.zeros(2, 2, dtype=torch.float64), "done": torch.tensor(False)}, []) for _ in range(n)])


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str, size: str = "SIZE") -> dict[str, list[str]]:
    """The table of ``ls`` by id: between the column names and the summary line, without the error notes.

    Cells are two or more spaces apart (a size such as ``1.5 KiB`` holds one)."""
    lines = out.splitlines()
    assert lines[0].split() == ["TD_ID", "TYPE", "COUNT", "KEYS", size, "TTL", "STATE", "RING"]
    assert " stores under prefix " in lines[-1] or " store under prefix " in lines[-1]
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[1:-1] if not line.startswith("unreadable ")]
    return {row[0]: row for row in rows}


def _closed_port() -> int:
    """A loopback port nobody listens on: bound by us a moment ago, then released."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Terminal(io.StringIO):
    """Stdin that says it is a terminal, holding the user's answer."""

    def isatty(self) -> bool:
        return True


# -- ls ------------------------------------------------------------------------------------------------


def test_ls_lists_homogeneous_heterogeneous_and_ttl_stores(capsys, url, prefix) -> None:
    het = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(4), url=url, prefix=prefix, td_id="het")
    dense = LazyStackedTensorDictStore.from_lazy_stack(_dense_stack(5), url=url, prefix=prefix, td_id="dense")
    ttl = LazyStackedTensorDictStore(url=url, prefix=prefix, count=7, ttl=3600, td_id="with-ttl")
    try:
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix, "--bytes")
        assert code == 0, err
        rows = _rows(out, size="BYTES")
        assert set(rows) == {"het", "dense", "with-ttl"}
        # TD_ID TYPE COUNT KEYS BYTES TTL STATE RING
        assert rows["het"][1:4] == ["lazy", "4", "3"] and rows["het"][5:] == ["-", "ready", "4/4"]  # an upload is a full ring
        # obs 4*3 float32 + tokens 1+2+3+4 int32 + step 4 int64 + the offset (5 int64) and shape (4x1 int64) tables
        assert int(rows["het"][4]) == 48 + 40 + 32 + 40 + 32
        assert rows["dense"][1:] == ["lazy", "5", "2", str(5 * 4 * 8 + 5 * 1), "-", "ready", "5/5"]
        assert rows["with-ttl"][1:4] == ["lazy", "7", "0"] and rows["with-ttl"][6:] == ["ready", "0/7"]
        # a unit, rounded up; read within a tenth of the time to live, so a busy machine never runs out the window
        assert rows["with-ttl"][5] in {*(f"{m}m{s:02d}s" for m in range(54, 60) for s in range(60)), "1h00m"}
        assert out.splitlines()[-1] == f"3 stores under prefix {prefix!r} on unix://{Path(url[len('unix://') :])}?db=0"
        assert err == ""
        # without --bytes: sizes with their unit
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        rows = _rows(out)
        assert rows["het"][4] == "192 B" and rows["dense"][4] == "165 B" and rows["with-ttl"][4] == "0 B"
    finally:
        for store in (het, dense, ttl):
            store.clear_redis()


def test_ls_json_is_only_json_with_every_field(capsys, url, prefix) -> None:
    ring = LazyStackedTensorDictStore(url=url, prefix=prefix, count=4, ttl=600, td_id="ring")
    for n in (4, 2):  # 6 writes on 4 slots: one and a half laps
        ring.extend(TensorDict({"x": torch.ones(n, 2)}, [n]))
    het = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(3), url=url, prefix=prefix, td_id="het")
    try:
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix, "--json")
        assert code == 0, err
        doc = json.loads(out)  # the whole of stdout
        assert doc["prefix"] == prefix and doc["server"].startswith("unix://")
        assert doc["unreadable"] == [] and doc["stale"] == []
        by_id = {s["td_id"]: s for s in doc["stores"]}
        assert set(by_id) == {"ring", "het"}
        r = by_id["ring"]
        for name in (
            "type",
            "count",
            "keys",
            "bytes",
            "ttl_seconds",
            "state",
            "ring",
            "stack_dim",
            "inner_batch_size",
            "device",
            "version",
            "server_keys",
        ):
            assert name in r, name
        assert (r["type"], r["count"], r["keys"], r["bytes"], r["state"]) == ("lazy", 4, 1, 4 * 2 * 4, "ready")
        assert r["ring"] == {"cursor": 2, "write_count": 6, "written": 4}
        assert 540 < r["ttl_seconds"] <= 600
        h = by_id["het"]
        assert h["ttl_seconds"] is None and h["keys"] == 3 and h["ring"] == {"cursor": 0, "write_count": 3, "written": 3}
        # header, inventory, the row block of the two small homogeneous keys, the heterogeneous key's blob and tables
        assert h["server_keys"] == 1 + 1 + 1 + 3
    finally:
        ring.clear_redis()
        het.clear_redis()


def test_ls_skips_stale_registry_entries_without_touching_them(capsys, url, prefix, redis_server) -> None:
    live = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="live")
    LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, ttl=0.05, td_id="expired")
    admin = redis_server.client()
    admin.sadd(registry_key(prefix), "never-created")
    deadline = time.monotonic() + 5
    while admin.exists(StoreKeys(prefix, "expired").meta) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert code == 0, err
        assert set(_rows(out)) == {"live"}
        assert "skipped 2 registry entries" in err and "expired" in err and "never-created" in err
        # listing reads only: the entries stay for `tdstore rm`
        assert admin.smembers(registry_key(prefix)) == {b"live", b"expired", b"never-created"}
        code, out, _ = _run(capsys, "ls", "--url", url, "--prefix", prefix, "--json")
        assert json.loads(out)["stale"] == ["expired", "never-created"]
    finally:
        live.clear_redis()
        admin.delete(registry_key(prefix))


def test_ls_reports_unreadable_headers_and_escapes_names(capsys, url, prefix, redis_server) -> None:
    admin = redis_server.client()
    good = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="good")
    evil = "evil\x1b[2J"
    admin.hset(StoreKeys(prefix, evil).meta, mapping={"format": "99", "schema": "cos.system"})
    admin.set(StoreKeys(prefix, "not-a-hash").meta, b"\x80\x04 junk")
    admin.sadd(registry_key(prefix), evil, "not-a-hash")
    try:
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert code == 0, err
        assert "\x1b" not in out + err
        rows = _rows(out)
        assert rows["good"][6] == "ready"
        assert rows["evil\\x1b[2J"][1:] == ["?", "-", "-", "-", "-", "unreadable", "-"]
        assert rows["not-a-hash"][6] == "unreadable"
        assert "format '99'" in out and "WRONGTYPE" in out
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert sorted(u["td_id"] for u in doc["unreadable"]) == [evil, "not-a-hash"]
        # info of an unreadable store says so, and exits 1
        code, out, err = _run(capsys, "info", evil, "--url", url, "--prefix", prefix)
        assert code == 1 and "cannot read" in err and "\x1b" not in err
    finally:
        good.clear_redis()
        admin.delete(StoreKeys(prefix, evil).meta, StoreKeys(prefix, "not-a-hash").meta, registry_key(prefix))


def test_ls_of_an_empty_prefix(capsys, url, prefix) -> None:
    code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
    assert code == 0 and err == ""
    assert out.strip() == f"0 stores under prefix {prefix!r} on unix://{url[len('unix://') :]}?db=0"
    code, out, _ = _run(capsys, "ls", "--url", url, "--prefix", prefix, "--json")
    assert json.loads(out)["stores"] == []


def test_url_defaults_to_the_environment(capsys, url, prefix, monkeypatch) -> None:
    monkeypatch.setenv("TDSTORE_URL", url)
    store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=3, td_id="from-env")
    try:
        code, out, err = _run(capsys, "ls", "--prefix", prefix)
        assert code == 0, err
        assert set(_rows(out)) == {"from-env"}
    finally:
        store.clear_redis()


# -- info ----------------------------------------------------------------------------------------------


def test_info_shows_header_and_schema(capsys, url, prefix) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(4), url=url, prefix=prefix, td_id="het")
    try:
        code, out, err = _run(capsys, "info", "het", "--url", url, "--prefix", prefix)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith(f"store het under prefix {prefix!r} on unix://")
        facts = {
            line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
            for line in lines[1:]
            if ":" in line and not line.startswith("    ")
        }
        assert facts["type"] == "lazy" and facts["count"] == "4" and facts["stack dim"] == "0"
        assert facts["inner batch size"] == "[]" and facts["device"] == "-" and facts["state"] == "ready"
        assert facts["ttl"] == "-" and facts["segments"] == "1" and facts["keys"] == "3"
        assert facts["row block"] == "obs, meta.step"  # side by side, in column order
        assert facts["ring"] == "cursor 0, write_count 4, written 4/4"  # an upload is a full ring
        assert facts["size"] == "192 B (data 120 B, heterogeneous tables 72 B)"
        table = [line for line in lines if line.startswith("    ")]
        assert table[0].split() == ["KEY", "DTYPE", "LAYOUT", "ELEMENT", "SHAPE", "SIZE"]
        rows = {line.split()[0]: line.split(None, 3) for line in table[1:]}
        assert rows["obs"][1:3] == ["float32", "homogeneous"] and rows["obs"][3].split() == ["[3]", "48", "B"]
        assert rows["meta.step"][1:3] == ["int64", "homogeneous"] and rows["meta.step"][3].split() == ["[]", "32", "B"]
        assert rows["tokens"][1:3] == ["int32", "heterogeneous"] and rows["tokens"][3].split() == [
            "ndim",
            "1,",
            "shapes",
            "vary",
            "40",
            "B",
        ]
        # --bytes: exact byte counts, no unit
        code, out, err = _run(capsys, "info", "het", "--url", url, "--prefix", prefix, "--bytes")
        assert "  bytes:            192 (data 120, heterogeneous tables 72)" in out.splitlines()
        assert [line.split() for line in out.splitlines() if line.startswith("    obs")] == [["obs", "float32", "homogeneous", "[3]", "48"]]
    finally:
        store.clear_redis()


def test_info_of_a_segmented_store(capsys, url, prefix) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(10), url=url, prefix=prefix, td_id="seg", segment_bytes=64)
    try:
        segs = store._engine.header.segments
        assert segs.n > 1
        code, out, err = _run(capsys, "info", "seg", "--url", url, "--prefix", prefix)
        assert code == 0, err
        assert f"segments: {segs.n} of {segs.per} elements" in " ".join(out.split())
        code, out, err = _run(capsys, "info", "seg", "--url", url, "--prefix", prefix, "--json")
        doc = json.loads(out)
        assert doc["segments"] == segs.n and doc["segment_length"] == segs.per
        assert all(leaf["segments"] == segs.n for leaf in doc["schema"])
        # the byte counts add every segment's blobs up: the same as a one-segment copy of the data
        whole = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(10), url=url, prefix=prefix, td_id="whole")
        _, out_whole, _ = _run(capsys, "info", "whole", "--url", url, "--prefix", prefix, "--json")
        assert [leaf["bytes"] for leaf in doc["schema"]] == [leaf["bytes"] for leaf in json.loads(out_whole)["schema"]]
        whole.clear_redis()
    finally:
        store.clear_redis()


def test_info_json(capsys, url, prefix) -> None:
    inner = lazy_stack([TensorDict({"img": torch.zeros(2, 5, 5, dtype=torch.uint8), "len": torch.ones(2, i + 1)}, [2]) for i in range(3)])
    store = LazyStackedTensorDictStore.from_lazy_stack(inner, url=url, prefix=prefix, td_id="inner", ttl=600)
    try:
        code, out, err = _run(capsys, "info", "inner", "--url", url, "--prefix", prefix, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert (doc["td_id"], doc["prefix"], doc["type"], doc["count"], doc["inner_batch_size"]) == ("inner", prefix, "lazy", 3, [2])
        assert doc["state"] == "ready" and doc["segments"] == 1 and doc["keys"] == 2
        assert 540 < doc["ttl_seconds"] <= 600
        assert doc["ring"] == {"cursor": 0, "write_count": 3, "written": 3}
        schema = {leaf["key"]: leaf for leaf in doc["schema"]}
        assert schema["img"]["dtype"] == "uint8" and schema["img"]["layout"] == "homogeneous"
        assert schema["img"]["shape"] == [2, 5, 5] and schema["img"]["bytes"] == 3 * 2 * 25 and schema["img"]["table_bytes"] == 0
        assert schema["len"]["dtype"] == "float32" and schema["len"]["layout"] == "heterogeneous"
        assert schema["len"]["shape"] is None and schema["len"]["ndim"] == 2 and schema["len"]["bytes"] == 2 * (1 + 2 + 3) * 4
        assert doc["bytes"] == sum(leaf["bytes"] + leaf["table_bytes"] for leaf in doc["schema"])
    finally:
        store.clear_redis()


def test_info_of_a_ring(capsys, url, prefix) -> None:
    store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=8, td_id="ring")
    try:
        for n in (8, 2):  # one lap and two more: the cursor wraps
            store.extend(TensorDict({"r": torch.arange(float(n))}, [n]))
        code, out, err = _run(capsys, "info", "ring", "--url", url, "--prefix", prefix)
        assert code == 0, err
        assert "ring:             cursor 2, write_count 10, written 8/8" in out
    finally:
        store.clear_redis()


# -- rm ------------------------------------------------------------------------------------------------


def test_rm_with_yes_deletes_every_key(capsys, url, prefix, redis_server) -> None:
    LazyStackedTensorDictStore.from_lazy_stack(_het_stack(3), url=url, prefix=prefix, td_id="doomed")
    keep = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="kept")
    try:
        code, out, err = _run(capsys, "rm", "doomed", "--url", url, "--prefix", prefix, "--yes")
        assert code == 0, err
        assert out.strip() == "deleted store doomed: 6 server keys"  # header, inventory, row block, heterogeneous blob and tables
        admin = redis_server.client()
        assert admin.keys(f"{prefix}:{{doomed}}*") == []
        assert admin.smembers(registry_key(prefix)) == {b"kept"}
        code, out, _ = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert set(_rows(out)) == {"kept"}
    finally:
        keep.clear_redis()


def test_rm_refuses_without_yes_when_stdin_is_not_a_terminal(capsys, url, prefix, monkeypatch) -> None:
    store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="safe")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped input is not a confirmation
    try:
        code, out, err = _run(capsys, "rm", "safe", "--url", url, "--prefix", prefix)
        assert code == 2 and out == ""
        assert "stdin is not a terminal" in err and "--yes" in err
        assert LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id="safe").batch_size[0] == 2
    finally:
        store.clear_redis()


@pytest.mark.layout
def test_rm_asks_and_honours_the_answer(capsys, url, prefix, monkeypatch) -> None:
    LazyStackedTensorDictStore.from_lazy_stack(_dense_stack(5), url=url, prefix=prefix, td_id="asked")
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    code, out, err = _run(capsys, "rm", "asked", "--url", url, "--prefix", prefix)
    assert code == 1 and out == ""
    assert err.startswith(f"Delete store asked (2 keys, {5 * 32 + 5} B)? [y/N] ") and "not deleted" in err
    monkeypatch.setattr(sys, "stdin", _Terminal(""))  # end of input: no
    assert main(["rm", "asked", "--url", url, "--prefix", prefix]) == 1
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    code, out, err = _run(capsys, "rm", "asked", "--url", url, "--prefix", prefix)
    assert code == 0, err
    assert "Delete store asked" in err and out.strip() == "deleted store asked: 3 server keys"  # header, inventory and row block
    with pytest.raises(KeyError):
        LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id="asked")


def test_rm_removes_a_stale_registry_entry(capsys, url, prefix, redis_server, monkeypatch) -> None:
    admin = redis_server.client()
    admin.sadd(registry_key(prefix), "ghost")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # nothing to confirm: no data goes
    code, out, err = _run(capsys, "rm", "ghost", "--url", url, "--prefix", prefix)
    assert code == 0, err
    assert "removed the registry entry of store ghost" in out and "gone" in out
    assert admin.smembers(registry_key(prefix)) == set()
    code, _, err = _run(capsys, "rm", "ghost", "--url", url, "--prefix", prefix, "--yes")
    assert code == 2 and "no store ghost" in err


def test_rm_of_an_unreadable_header_only_drops_the_registry_entry(capsys, url, prefix, redis_server) -> None:
    admin = redis_server.client()
    meta = StoreKeys(prefix, "foreign").meta
    admin.hset(meta, mapping={"format": "7"})
    admin.sadd(registry_key(prefix), "foreign")
    try:
        code, out, err = _run(capsys, "rm", "foreign", "--url", url, "--prefix", prefix, "--yes")
        assert code == 0, err
        assert "unreadable" in out and "left on the server" in out
        assert admin.exists(meta) == 1 and admin.smembers(registry_key(prefix)) == set()
        # now neither readable nor registered: refused
        code, _, err = _run(capsys, "rm", "foreign", "--url", url, "--prefix", prefix, "--yes")
        assert code == 1 and "cannot read" in err
        assert admin.exists(meta) == 1
    finally:
        admin.delete(meta)


def test_unknown_ids(capsys, url, prefix) -> None:
    for argv in (["info", "nope"], ["rm", "nope", "--yes"], ["info", "nope", "--json"]):
        code, out, err = _run(capsys, *argv, "--url", url, "--prefix", prefix)
        assert code == 2 and out == ""
        assert f"no store nope under prefix {prefix!r}" in err


# -- errors --------------------------------------------------------------------------------------------


def test_unreachable_server(capsys) -> None:
    port = _closed_port()
    for argv in (["ls"], ["info", "x"], ["rm", "x", "--yes"], ["ls", "--json"]):
        code, out, err = _run(capsys, *argv, "--url", f"redis://127.0.0.1:{port}/0")
        assert code == 2 and out == ""
        assert err.startswith(f"tdstore {argv[0]}: error: cannot reach the server at redis://127.0.0.1:{port}/0: ")


def test_bad_url_and_bad_arguments(capsys) -> None:
    code, out, err = _run(capsys, "ls", "--url", "http://user:hunter2@example.invalid/")
    assert code == 2 and "invalid server url" in err and "hunter2" not in err + out
    with pytest.raises(SystemExit) as exit_info:
        main(["ls", "--bogus", "--url", "redis://127.0.0.1:1/0"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_passwords_are_never_printed(capsys, url, prefix, redis_server) -> None:
    admin = redis_server.client()
    user, password = f"cli-{uuid.uuid4().hex[:6]}", f"pw-{uuid.uuid4().hex}"
    admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    sock = url[len("unix://") :]
    store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="secret-test")
    try:
        seen = ""
        good = f"unix://{user}:{password}@{sock}"
        for argv in (["ls"], ["ls", "--json"], ["info", "secret-test"], ["info", "secret-test", "--json"], ["info", "missing"]):
            code, out, err = _run(capsys, *argv, "--url", good, "--prefix", prefix)
            assert code in (0, 2), err
            seen += out + err
        assert "secret-test" in seen and f"unix://{sock}?db=0" in seen
        # wrong password: refused with a clear error, and the (wrong) password is not echoed either
        code, out, err = _run(capsys, "ls", "--url", f"unix://{user}:wrong-{password}@{sock}", "--prefix", prefix)
        assert code == 2 and f"the server at unix://{sock}?db=0 needs a password (or the one given is wrong)" in err
        seen += out + err
        port = _closed_port()
        code, out, err = _run(capsys, "ls", "--url", f"redis://{user}:{password}@127.0.0.1:{port}/0")
        assert code == 2 and f"redis://127.0.0.1:{port}/0" in err
        seen += out + err
        code, out, err = _run(capsys, "rm", "secret-test", "--url", good, "--prefix", prefix, "--yes")
        assert code == 0, err
        seen += out + err
        assert password not in seen and user + ":" not in seen
    finally:
        store.clear_redis()
        admin.execute_command("ACL", "DELUSER", user)


def test_python_dash_m_ls(url, prefix) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(2), url=url, prefix=prefix, td_id="sub")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tdstore", "ls", "--url", url, "--prefix", prefix],
            capture_output=True,
            text=True,
            timeout=600,  # a limit on a hang only: the run takes a few seconds
        )
        assert proc.returncode == 0, proc.stderr
        assert _rows(proc.stdout)["sub"][1:4] == ["lazy", "2", "3"]
    finally:
        store.clear_redis()


# -- bench ---------------------------------------------------------------------------------------------


def test_bench_passes_arguments_through(capfd) -> None:
    assert (REPO / "tools" / "bench" / "__main__.py").is_file()
    assert main(["bench", "--help"]) == 0
    out, _ = capfd.readouterr()
    assert "--quick" in out and "--mp-writers" in out
    # the benchmark's own exit code comes back (argparse: 2 for an unknown option)
    assert main(["bench", "--no-such-option"]) == 2
    assert "--no-such-option" in capfd.readouterr().err


def test_bench_outside_a_source_checkout(capsys, monkeypatch, tmp_path) -> None:
    fake = tmp_path / "site-packages" / "tdstore" / "__init__.py"
    fake.parent.mkdir(parents=True)
    fake.touch()
    monkeypatch.setattr(tdstore, "__file__", str(fake))
    code, out, err = _run(capsys, "bench", "--quick")
    assert code == 2 and out == ""
    assert "source tree" in err and "git clone" in err


def test_dense_stores_are_listed_and_deleted(capsys, url, prefix) -> None:
    """A dense store (type "dense") goes through the same commands; skipped where dense stores do not exist yet."""
    td = TensorDict({"obs": torch.zeros(3, 4), "reward": torch.ones(3)}, [3])
    try:
        dense = tdstore.TensorDictStore.from_tensordict(td, url=url, prefix=prefix, td_id="dense")
    except NotImplementedError:
        pytest.skip("this tdstore has no dense TensorDictStore")
    try:
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert code == 0, err
        assert _rows(out)["dense"][1] == "dense"
        code, out, err = _run(capsys, "info", "dense", "--url", url, "--prefix", prefix, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["type"] == "dense" and {leaf["key"] for leaf in doc["schema"]} == {"obs", "reward"}
        code, out, err = _run(capsys, "rm", "dense", "--url", url, "--prefix", prefix, "--yes")
        assert code == 0, err
        assert out.startswith("deleted store dense: ")
    finally:
        dense.clear_redis()


# -- units and what applies -----------------------------------------------------------------------------


def test_human_units() -> None:
    from tdstore.cli import human_duration, human_size

    sizes = {0: "0 B", 1023: "1023 B", 1024: "1 KiB", 1536: "1.5 KiB", 10 * 1024 + 1: "10 KiB", 1000 * 1024: "1000 KiB"}
    sizes.update({5 << 20: "5 MiB", (3 << 30) + (1 << 29): "3.5 GiB", 2000 << 40: "1.95 PiB"})
    for n, text in sizes.items():
        assert human_size(n) == text, n
    durations = {1: "1s", 400: "1s", 59_000: "59s", 59_001: "1m00s", 61_000: "1m01s", 3_600_000: "1h00m", 3_661_000: "1h01m"}
    durations.update({86_400_000: "1d00h", 90_000_000: "1d01h"})
    for ms, text in durations.items():
        assert human_duration(ms) == text, ms


def test_info_and_ls_of_a_dense_store_show_what_applies(capsys, url, prefix) -> None:
    store = tdstore.TensorDictStore.from_tensordict(
        TensorDict(obs=torch.zeros(6, 2, 3), batch_size=[6, 2]), url=url, prefix=prefix, td_id="d"
    )
    try:
        code, out, err = _run(capsys, "info", "d", "--url", url, "--prefix", prefix)
        assert code == 0, err
        names = [line.split(":", 1)[0].strip() for line in out.splitlines()[1:] if not line.startswith("    ")]
        assert "batch size" in names and "ring" in names and "count" not in names and "stack dim" not in names
        assert "  batch size:  [6, 2]" in out.splitlines()
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert _rows(out)["d"][7] == "6/6"  # its first dim is a ring (an upload is a full one)
        code, out, err = _run(capsys, "info", "d", "--url", url, "--prefix", prefix, "--json")
        doc = json.loads(out)
        assert doc["ring"] == {"cursor": 0, "write_count": 6, "written": 6} and doc["batch_size"] == [6, 2]
        one = tdstore.TensorDictStore.from_tensordict(TensorDict(obs=torch.zeros(3)), url=url, prefix=prefix, td_id="one")
        code, out, err = _run(capsys, "info", "one", "--url", url, "--prefix", prefix, "--json")
        assert json.loads(out)["ring"] is None  # batch size []: no rows, no ring
        one.clear_redis()
    finally:
        store.clear_redis()


def test_info_and_ls_of_a_spread_store_show_no_ring(capsys, redis_cluster, prefix) -> None:
    url = redis_cluster.url
    store = LazyStackedTensorDictStore.from_lazy_stack(
        _het_stack(12), url=url, prefix=prefix, td_id="spread", spread=True, segment_bytes=16
    )
    ring = LazyStackedTensorDictStore(url=url, prefix=prefix, count=3, td_id="ring")
    ring.extend(TensorDict({"x": torch.ones(2)}, [2]))
    try:
        assert store._engine.header.spread and store._engine.header.segments.n > 1
        code, out, err = _run(capsys, "info", "spread", "--url", url, "--prefix", prefix)
        assert code == 0, err
        names = [line.split(":", 1)[0].strip() for line in out.splitlines()[1:] if not line.startswith("    ")]
        assert "ring" not in names and "count" in names
        assert "spread over the cluster's nodes" in out
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert code == 0, err
        rows = _rows(out)
        assert rows["spread"][7] == "-" and rows["ring"][7] == "2/3"
        code, out, err = _run(capsys, "info", "spread", "--url", url, "--prefix", prefix, "--json")
        doc = json.loads(out)
        assert doc["ring"] is None and doc["spread"] is True
        # rm of a spread store deletes every segment on every node
        code, out, err = _run(capsys, "rm", "spread", "--url", url, "--prefix", prefix, "--yes")
        assert code == 0 and out.startswith("deleted store spread: "), err
        for i in range(len(redis_cluster.ports)):
            node = redis_cluster.node_client(i)
            assert node.keys(f"{prefix}:*spread*") == []
            node.close()
    finally:
        store.clear_redis()
        ring.clear_redis()


def test_rm_on_a_cluster_deletes_a_segmented_store_and_its_registry_entry(capsys, redis_cluster, prefix) -> None:
    url = redis_cluster.url
    LazyStackedTensorDictStore.from_lazy_stack(_het_stack(12), url=url, prefix=prefix, td_id="segs", segment_bytes=16)
    keep = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="keep")
    try:
        code, out, err = _run(capsys, "rm", "segs", "--url", url, "--prefix", prefix, "--yes")
        assert code == 0 and out.startswith("deleted store segs: "), err
        assert int(out.split(": ")[1].split()[0]) > 5
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert set(_rows(out)) == {"keep"}
    finally:
        keep.clear_redis()


def test_rm_refuses_a_store_whose_schema_changed_and_reads_it_again(capsys, url, prefix, monkeypatch) -> None:
    """``rm`` deletes under the header's epoch and version: a key added between its read and its
    delete makes the script refuse, and the second try deletes the new key too."""
    from tdstore import inspect_store

    store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=2, td_id="moving")
    store.set("a", torch.ones(2))
    real_clear = inspect_store._clear
    calls = []

    def clear_after_a_change(client, keys, header):
        if not calls:
            store.set("late", torch.zeros(2, 1000))  # a new leaf number: the header moves on
        calls.append(header.version)
        return real_clear(client, keys, header)

    monkeypatch.setattr(inspect_store, "_clear", clear_after_a_change)
    code, out, err = _run(capsys, "rm", "moving", "--url", url, "--prefix", prefix, "--yes")
    assert code == 0, err
    assert len(calls) == 2 and calls[1] > calls[0]
    assert out.strip() == "deleted store moving: 4 server keys"  # header, inventory, the key a, the late key
    with pytest.raises(KeyError):
        LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id="moving")


# -- damaged stores, and words in the number they take ---------------------------------------------


def _one_key_stack(n: int = 3) -> TensorDict:
    """Elements of one homogeneous key, too large for a row block: one blob, one server data key."""
    return lazy_stack([TensorDict({"img": torch.full((64,), float(i))}, []) for i in range(n)])


def test_ls_shows_a_damaged_store_as_damaged(capsys, url, prefix, redis_server) -> None:
    ok = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(4), url=url, prefix=prefix, td_id="ok")
    hurt = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(4), url=url, prefix=prefix, td_id="hurt")
    try:
        lost = hurt._engine.keys.data(hurt._engine.header.leaves[("tokens",)].number)
        assert redis_server.client().delete(lost) == 1  # evicted, say
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert code == 0, err
        rows = _rows(out)
        assert rows["hurt"][6] == "DAMAGED" and rows["ok"][6] == "ready"
        assert "store hurt is DAMAGED (1 key lost or cut short); 'tdstore check hurt'" in err and "store ok" not in err
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix, "--json")
        assert code == 0, err
        by_id = {s["td_id"]: s for s in json.loads(out)["stores"]}
        assert by_id["hurt"]["integrity"]["intact"] is False and by_id["hurt"]["integrity"]["damaged_keys"] == ["tokens"]
        assert by_id["ok"]["integrity"]["intact"] is True
    finally:
        ok.clear_redis()
        hurt.clear_redis()


def test_check_says_what_to_do_next_naming_the_keys(capsys, url, prefix, redis_server) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(_het_stack(4), url=url, prefix=prefix, td_id="hurt")
    try:
        lost = store._engine.keys.data(store._engine.header.leaves[("tokens",)].number)
        redis_server.client().delete(lost)
        code, out, err = _run(capsys, "check", "hurt", "--url", url, "--prefix", prefix)
        assert code == 1, err
        assert "DAMAGED: 1 key lost or cut short" in out and lost in out
        assert "tdstore check" not in out  # the advice is the next step, not this command again
        assert "del store['tokens']" in out and "'tokens'" in out  # keep the rest: which key to delete and rewrite
        assert f"'tdstore rm hurt --prefix {prefix}'" in out and "checkpoint" in out  # or restore the whole store
        assert "noeviction" in out
        code, out, err = _run(capsys, "info", "hurt", "--url", url, "--prefix", prefix)
        assert code == 0 and "integrity: DAMAGED: 1 key lost or cut short; 'tdstore check hurt' lists them and what to do" in out
        del store["tokens"]  # the advice works: the rest of the store is intact again
        code, out, err = _run(capsys, "check", "hurt", "--url", url, "--prefix", prefix)
        assert code == 0 and "intact" in out
    finally:
        store.clear_redis()


def test_counts_take_the_singular_for_one(capsys, url, prefix, monkeypatch) -> None:
    store = LazyStackedTensorDictStore.from_lazy_stack(_one_key_stack(), url=url, prefix=prefix, td_id="single")
    try:
        code, out, err = _run(capsys, "check", "single", "--url", url, "--prefix", prefix)
        assert code == 0 and "intact (1 key checked)" in out
        code, out, err = _run(capsys, "ls", "--url", url, "--prefix", prefix)
        assert out.splitlines()[-1].startswith("1 store under prefix")
        monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
        code, out, err = _run(capsys, "rm", "single", "--url", url, "--prefix", prefix)
        assert err.startswith("Delete store single (1 key, ")
        for text in (out, err):
            assert not re.search(r"\b1 (keys|stores|server keys|bytes)\b", text)
    finally:
        store.clear_redis()
