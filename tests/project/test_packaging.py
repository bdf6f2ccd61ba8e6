"""The Lua scripts ship inside the package and load from an installed copy too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tdstore._engine import scripts as _scripts

REPO = Path(__file__).resolve().parents[2]


def test_scripts_load_from_a_namespace_package_path(monkeypatch):
    """An installed ``tdstore._lua`` is a namespace package: ``files()`` gives a MultiplexedPath."""
    from importlib.resources.readers import MultiplexedPath

    monkeypatch.setattr(_scripts.resources, "files", lambda name: MultiplexedPath(str(REPO / "lua")))
    _scripts.script_source.cache_clear()
    try:
        for name in _scripts.SCRIPT_NAMES:
            text, sha = _scripts.script_source(name)
            assert f"{name}.lua:" in text and len(sha) == 40
    finally:
        _scripts.script_source.cache_clear()


def test_every_script_has_a_header():
    for name in (*_scripts.SCRIPT_NAMES, _scripts.LIBRARY, _scripts.TREE_LIBRARY, _scripts.LEASE_LIBRARY, _scripts.ROLLOUT_LIBRARY):
        text = (REPO / "lua" / f"{name}.lua").read_text()
        assert text.startswith("--[[") and f"{name}.lua:" in text.splitlines()[1]
        if name not in (_scripts.LIBRARY, _scripts.TREE_LIBRARY, _scripts.LEASE_LIBRARY, _scripts.ROLLOUT_LIBRARY):
            for part in ("KEYS[1]", "ARGV[1]", "Reply"):
                assert part in text, (name, part)


def test_installed_package_loads_its_scripts(tmp_path):
    """Run from outside the checkout, so an installed tdstore (as in CI) is the one imported."""
    code = "import tdstore, tdstore._engine.scripts as s; print(tdstore.__file__); print(len(s.script_source('write')[0]))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    if proc.returncode != 0 and "No module named 'tdstore'" in proc.stderr:
        pytest.skip("tdstore is not installed in this environment (only the checkout is on sys.path)")
    assert proc.returncode == 0, proc.stderr
    path, size = proc.stdout.split()
    assert int(size) > 1000


def _requirement_names(reqs: list[str]) -> set[str]:
    from packaging.requirements import Requirement

    return {Requirement(r).name.lower().replace("_", "-") for r in reqs if "extra ==" not in r}


def test_the_torchrl_extra_installs_what_torchrl_imports():
    """torchrl-nightly is installed with --no-deps (its tensordict-nightly would replace tensordict): the
    ``torchrl`` extra must bring every other package it requires, or ``import tdstore.torchrl`` fails."""
    import importlib.metadata
    import tomllib

    try:
        torchrl_requires = importlib.metadata.requires("torchrl-nightly") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchrl-nightly is not installed")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ours = _requirement_names(project["dependencies"]) | _requirement_names(project["optional-dependencies"]["torchrl"])
    # tensordict-nightly is what --no-deps leaves out on purpose (tensordict is ours)
    missing = _requirement_names(torchrl_requires) - ours - {"tensordict-nightly"}
    assert not missing, f"the torchrl extra lacks {sorted(missing)}"
    assert _requirement_names(project["optional-dependencies"]["torchrl"]) <= _requirement_names(project["optional-dependencies"]["test"])


def test_the_demo_names_the_module_torchrl_misses():
    from tdstore.demo import torchrl_missing

    err = ModuleNotFoundError("No module named 'packaging'", name="packaging")
    assert "'packaging' is missing" in torchrl_missing(err) and '".[torchrl]"' in torchrl_missing(err)
    assert "not installed" in torchrl_missing(ModuleNotFoundError("No module named 'torchrl'", name="torchrl"))
