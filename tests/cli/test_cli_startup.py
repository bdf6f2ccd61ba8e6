"""``tdstore --help``, ``ls``, ``info`` and ``rm`` start without torch or tensordict.

Each command runs in a fresh interpreter with ``-X importtime`` (and the console
script with ``PYTHONPROFILEIMPORTTIME``), whose report names every module the
process imported; none may be torch or tensordict.  No timing is asserted: the
import list is what makes the commands quick, and it does not depend on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, TensorDictStore
from tdstore.server import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "tensordict")


def _imported(stderr: str) -> set[str]:
    """Module names in an ``-X importtime`` report (``import time: self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line)
        if m:
            names.add(m.group(1))
    return names


def _run(argv: list[str], *, console_script: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TDSTORE_URL", "TDSTORE_PASSWORD")}
    if console_script:
        exe = shutil.which("tdstore", path=str(Path(sys.executable).parent))
        if exe is None:
            pytest.skip("the tdstore console script is not installed next to this interpreter")
        cmd = [exe, *argv]
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    else:
        cmd = [sys.executable, "-X", "importtime", "-m", "tdstore", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def _assert_light(proc: subprocess.CompletedProcess[str]) -> None:
    names = _imported(proc.stderr)
    assert "tdstore.cli" in names, "the import report is missing: the check would pass vacuously"
    heavy = sorted(n for n in names if n.split(".")[0] in HEAVY)
    assert heavy == [], f"imported {heavy[:5]}..."


@pytest.fixture
def stores(redis_server: EmbeddedServer):
    """A lazy and a dense store under a private prefix; yields (url, prefix)."""
    prefix = f"startup-{uuid.uuid4().hex[:8]}"
    url = redis_server.url
    lazy = LazyStackedTensorDictStore(url=url, prefix=prefix, count=4, td_id="lazy")
    lazy.set("x", torch.zeros(4, 3))
    dense = TensorDictStore.from_tensordict(TensorDict(y=torch.ones(5, 2), batch_size=[5]), url=url, prefix=prefix, td_id="dense")
    yield url, prefix
    for store in (lazy, dense):
        store.clear_redis()


def test_help_imports_neither_torch_nor_tensordict() -> None:
    for argv in (["--help"], ["ls", "--help"], ["info", "--help"], ["rm", "--help"], ["demo", "--help"]):
        proc = _run(argv)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "usage: tdstore" in proc.stdout
        _assert_light(proc)


def test_ls_info_top_metrics_rm_import_neither_torch_nor_tensordict(stores) -> None:
    url, prefix = stores
    proc = _run(["ls", "--url", url, "--prefix", prefix])
    assert proc.returncode == 0 and "lazy" in proc.stdout and "dense" in proc.stdout, proc.stderr[-2000:]
    _assert_light(proc)
    for td_id in ("lazy", "dense"):
        proc = _run(["info", td_id, "--url", url, "--prefix", prefix, "--json"])
        assert proc.returncode == 0 and f'"td_id": "{td_id}"' in proc.stdout, proc.stderr[-2000:]
        _assert_light(proc)
    for argv in (["top", "--once", "--interval", "0.1"], ["metrics", "--once"]):  # the live view and the metrics too
        proc = _run([*argv, "--url", url, "--prefix", prefix])
        assert proc.returncode == 0 and "lazy" in proc.stdout and "dense" in proc.stdout, proc.stderr[-2000:]
        _assert_light(proc)
    for td_id in ("lazy", "dense"):
        proc = _run(["rm", td_id, "--url", url, "--prefix", prefix, "--yes"])
        assert proc.returncode == 0 and proc.stdout.startswith(f"deleted store {td_id}: "), proc.stderr[-2000:]
        _assert_light(proc)


def test_console_script_imports_neither_torch_nor_tensordict(stores) -> None:
    url, prefix = stores
    proc = _run(["ls", "--url", url, "--prefix", prefix], console_script=True)
    assert proc.returncode == 0 and "lazy" in proc.stdout, proc.stderr[-2000:]
    _assert_light(proc)


def test_errors_are_light_too() -> None:
    """A refused connection is reported without loading torch either."""
    proc = _run(["ls", "--url", "redis://127.0.0.1:1/0"])
    assert proc.returncode == 2 and "cannot reach the server" in proc.stderr
    _assert_light(proc)


def test_the_package_imports_the_store_classes_on_first_use() -> None:
    code = (
        "import sys, tdstore\n"
        "assert 'torch' not in sys.modules and 'tdstore.lazy' not in sys.modules\n"
        "cls = tdstore.LazyStackedTensorDictStore\n"
        "assert cls.__module__ == 'tdstore' and 'tdstore.lazy' in sys.modules and 'torch' in sys.modules\n"
        "assert tdstore.TensorDictStore.__name__ == 'TensorDictStore' and callable(tdstore.register_tensorclass)\n"
        "assert issubclass(tdstore.StoreFormatError, RuntimeError)\n"
        "from tdstore import *\n"
        "try:\n    tdstore.nope\nexcept AttributeError as err:\n    assert 'nope' in str(err)\nelse:\n    raise SystemExit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_bench_help_names_its_command_and_no_issue() -> None:
    proc = _run(["bench", "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: tdstore bench ")
    assert "issue" not in proc.stdout.lower() and not re.search(r"#\d", proc.stdout)
    direct = subprocess.run([sys.executable, "-m", "tools.bench", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0 and direct.stdout.startswith("usage: python -m tools.bench ")
    assert "issue" not in direct.stdout.lower()
    # the arguments are parsed before torch is imported: --help answers at once
    code = (
        "import runpy, sys\nsys.argv = ['bench', '--help']\n"
        "try:\n    runpy.run_module('tools.bench', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'tensordict' not in sys.modules, 'imported'\n"
    )
    light = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert light.returncode == 0, light.stderr[-2000:]
