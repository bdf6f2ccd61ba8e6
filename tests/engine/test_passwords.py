"""One password rule for every entry point, against a private password-protected redis-server.

The rule (``tdstore._engine.connection``): the password given (``password=`` or the URL's
user info), else ``password_provider()``, else ``$TDSTORE_PASSWORD``.  It holds for
the store classes, ``tdstore ls/info/rm/demo`` and the demo's actor processes; a
refused login is one clear sentence naming the server; the password shows up in no
output, repr, pickle or command line.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
import torch
from helpers import no_retry
from tensordict import TensorDict

import tdstore
from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore._engine.connection import PasswordError
from tdstore.cli import main
from tdstore.server import EmbeddedServer, commandstats

PASSWORD = 'p@ss:w/rd "x" ' + uuid.uuid4().hex[:6]
NEEDS = "needs a password (or the one given is wrong)"


def provide() -> str:
    """A picklable provider, as a user writes one."""
    return PASSWORD


@pytest.fixture(scope="module")
def server():
    with EmbeddedServer(password=PASSWORD) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _no_ambient_password(monkeypatch):
    monkeypatch.delenv("TDSTORE_PASSWORD", raising=False)
    monkeypatch.delenv("TDSTORE_URL", raising=False)


def _url(server: EmbeddedServer, password: str | None = PASSWORD) -> str:
    auth = "" if password is None else f":{quote(password, safe='')}@"
    return f"unix://{auth}{server.unix_socket_path}"


def _secret_free(*texts: object) -> None:
    for text in texts:
        blob = text if isinstance(text, bytes) else str(text).encode()
        assert PASSWORD.encode() not in blob and quote(PASSWORD, safe="").encode() not in blob


# -- the server ----------------------------------------------------------------------------------------


def test_embedded_server_requires_its_password_and_hides_it(server) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(unix_socket_path=server.unix_socket_path, retry=no_retry()).ping()
    assert server.client().ping()
    assert server.password == PASSWORD and PASSWORD not in server.url
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    assert b"requirepass" not in cmdline
    _secret_free(cmdline, repr(server))


# -- the store classes -------------------------------------------------------------------------------


def test_every_source_of_the_password_opens_a_store(server, monkeypatch) -> None:
    sock = server.unix_socket_path
    prefix = f"pw-{uuid.uuid4().hex[:6]}"
    made = [
        LazyStackedTensorDictStore(url=_url(server), count=2, prefix=prefix),
        LazyStackedTensorDictStore(unix_socket_path=sock, password=PASSWORD, count=2, prefix=prefix),
        LazyStackedTensorDictStore(unix_socket_path=sock, password_provider=provide, count=2, prefix=prefix),
        TensorDictStore.from_tensordict(TensorDict(a=torch.ones(3), batch_size=[3]), url=_url(server), prefix=prefix),
    ]
    monkeypatch.setenv("TDSTORE_PASSWORD", PASSWORD)
    made.append(LazyStackedTensorDictStore(unix_socket_path=sock, count=2, prefix=prefix))
    monkeypatch.delenv("TDSTORE_PASSWORD")
    for store in made[:3] + made[4:]:
        store.set("x", torch.ones(2))
        assert store["x"].tolist() == [1.0, 1.0]
        _secret_free(repr(store), pickle.dumps(store))
    assert made[3]["a"].tolist() == [1.0, 1.0, 1.0]
    _secret_free(repr(made[3]), pickle.dumps(made[3]))
    for store in made:
        store.clear_redis()


@pytest.mark.parametrize("how", ["none", "wrong in the URL", "wrong password=", "wrong in the environment", "wrong provider"])
def test_a_refused_login_is_one_clear_error(server, monkeypatch, how) -> None:
    sock = server.unix_socket_path
    kwargs: dict = {"unix_socket_path": sock}
    if how == "wrong in the URL":
        kwargs = {"url": _url(server, "nope")}
    elif how == "wrong password=":
        kwargs["password"] = "nope"
    elif how == "wrong in the environment":
        monkeypatch.setenv("TDSTORE_PASSWORD", "nope")
    elif how == "wrong provider":
        kwargs["password_provider"] = lambda: "nope"
    admin = server.client()
    before = commandstats(admin)
    with pytest.raises(PasswordError) as err:  # redis-py's own retry policy: a refused login is not tried again
        LazyStackedTensorDictStore(count=2, prefix="refused", **kwargs)
    after = commandstats(admin)
    logins = sum(after.get(c, 0) - before.get(c, 0) for c in ("hello", "auth"))
    assert logins == 1, (before, after)
    assert isinstance(err.value, redis.AuthenticationError)  # code that catches redis-py's error keeps working
    assert tdstore.PasswordError is PasswordError
    assert str(err.value).startswith(f"the server at unix://{sock}?db=0 {NEEDS}")
    assert "TDSTORE_PASSWORD" in str(err.value) and "HELLO" not in str(err.value)
    assert server.client().keys("refused:*") == []


def test_an_unpickled_store_in_a_child_uses_the_environment(server, tmp_path) -> None:
    """A pickle holds no password: a child process gets it from ``$TDSTORE_PASSWORD``."""
    store = LazyStackedTensorDictStore(url=_url(server), count=2, prefix=f"pw-{uuid.uuid4().hex[:6]}")
    store.set("x", torch.full((2,), 7.0))
    blob = tmp_path / "store.pkl"
    blob.write_bytes(pickle.dumps(store))
    _secret_free(blob.read_bytes())
    code = f"import pickle; s = pickle.loads(open({str(blob)!r}, 'rb').read()); print(s['x'].tolist())"
    env = {k: v for k, v in os.environ.items() if k != "TDSTORE_PASSWORD"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**env, "TDSTORE_PASSWORD": PASSWORD}
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[7.0, 7.0]", proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and NEEDS in proc.stderr
    _secret_free(proc.stdout, proc.stderr)
    store.clear_redis()


# -- the command line --------------------------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    _secret_free(out, err)
    return code, out, err


def test_ls_info_rm_take_the_password_from_the_url_or_the_environment(server, capsys, monkeypatch) -> None:
    prefix = f"pw-{uuid.uuid4().hex[:6]}"
    for td_id in ("a", "b"):
        LazyStackedTensorDictStore(url=_url(server), count=2, prefix=prefix, td_id=td_id).set("x", torch.ones(2))
    bare = _url(server, None)
    for argv in (["ls"], ["info", "a"], ["rm", "a", "--yes"]):
        code, out, err = _cli(capsys, *argv, "--url", bare, "--prefix", prefix)
        assert code == 2 and out == ""
        assert err == f"tdstore {argv[0]}: error: the server at unix://{server.unix_socket_path}?db=0 {NEEDS}: " + err.split(": ", 3)[-1]
        assert NEEDS in err and "HELLO" not in err and "cannot reach" not in err
    code, out, err = _cli(capsys, "ls", "--url", _url(server), "--prefix", prefix)
    assert code == 0 and "2 stores under prefix" in out, err
    code, out, err = _cli(capsys, "info", "a", "--url", _url(server), "--prefix", prefix)
    assert code == 0 and out.startswith("store a under prefix"), err
    code, out, err = _cli(capsys, "rm", "a", "--url", _url(server), "--prefix", prefix, "--yes")
    assert code == 0 and out.startswith("deleted store a"), err
    monkeypatch.setenv("TDSTORE_PASSWORD", PASSWORD)
    monkeypatch.setenv("TDSTORE_URL", bare)
    code, out, err = _cli(capsys, "ls", "--prefix", prefix)
    assert code == 0 and "1 store under prefix" in out, err
    code, out, err = _cli(capsys, "rm", "b", "--prefix", prefix, "--yes")
    assert code == 0 and out.startswith("deleted store b"), err
    monkeypatch.setenv("TDSTORE_PASSWORD", "nope")
    code, out, err = _cli(capsys, "ls", "--prefix", prefix)
    assert code == 2 and NEEDS in err


def test_rm_asks_without_showing_the_password(server, capsys, monkeypatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    prefix = f"pw-{uuid.uuid4().hex[:6]}"
    LazyStackedTensorDictStore(url=_url(server), count=2, prefix=prefix, td_id="c").set("x", torch.ones(2))
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))
    code, out, err = _cli(capsys, "rm", "c", "--url", _url(server), "--prefix", prefix)
    assert code == 0 and "Delete store c (1 key, 8 B)?" in err


# -- the demo and its actor processes ------------------------------------------------------------------


def _children_cmdlines(stop: threading.Event, seen: list[bytes]) -> None:
    """Command lines of this process's children (the actors), polled until ``stop``."""
    me = str(os.getpid())
    while not stop.wait(0.05):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[1] == me:
                    seen.append(Path(f"/proc/{pid}/cmdline").read_bytes())
            except (OSError, IndexError):
                continue


def test_demo_actors_get_the_password_of_the_url(server, capsys) -> None:
    from tdstore.demo import run_demo

    seen: list[bytes] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_children_cmdlines, args=(stop, seen), daemon=True)
    watcher.start()
    try:
        figures = run_demo(url=_url(server), actors=2, count=16, seconds=0.5, batch=4, prefix=f"pw-{uuid.uuid4().hex[:6]}", progress=True)
    finally:
        stop.set()
        watcher.join()
    out, err = capsys.readouterr()
    assert figures["ok"] and figures["writes"] > 0, figures
    assert "TDSTORE_PASSWORD" not in os.environ  # set for the spawn only, then restored
    assert any(b"multiprocessing" in c for c in seen), "no actor command line was seen: the check below would be vacuous"
    _secret_free(out, err, figures, *seen)
    assert "actor 1 connected" in err or "actor 0 connected" in err


def test_demo_without_the_password_says_so(server, capsys) -> None:
    code = main(["demo", "--url", _url(server, None), "--seconds", "0.2", "--actors", "1", "--no-progress"])
    _, err = capsys.readouterr()
    assert code == 2 and NEEDS in err and "Traceback" not in err
