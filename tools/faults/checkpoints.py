"""Fault case ``hostile-checkpoint``: checkpoint folders edited as an adversary would, restored three ways.

A checkpoint is input from outside (issue 38). Each edit of :data:`HOSTILE` is applied to a buffer's own
checkpoint (``rb.dumps``) and the result restored through ``import_checkpoint``, ``tdstore import`` and
``rb.loads`` of the buffer that wrote it (which has written more rows since): each must be refused with
a clear error (one line on the command line, exit 1), and the server must hold exactly what it held
before, byte for byte (every key under the prefix), the buffer its rows. Two more checks: a checkpoint
whose td_id names another user's store never replaces it (``rb.loads`` lands on the buffer's own id),
and a checkpoint of :data:`MANY_KEYS` keys imports in a process allowed :data:`FD_LIMIT` open files.

The builders are what ``tests/checkpoint/test_hostile_checkpoints.py`` runs too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, lazy_stack

from tdstore import LazyStackedTensorDictStore
from tdstore._checkpoint.export_import import CheckpointError, import_checkpoint
from tdstore.cli import main as cli_main
from tdstore.torchrl import replay_buffer
from tools._probes import raw_snapshot
from tools.faults.base import Check, Env, describe_exc

#: Slots of the buffer whose checkpoint is edited, and the rows written before the checkpoint.
SLOTS, WRITTEN = 8, 5
#: Keys of the checkpoint imported under a low limit of open files, and that limit.
MANY_KEYS, FD_LIMIT = 1500, 256


def rows(start: int, n: int) -> Any:
    """``n`` rows: a dense ``obs`` and a ragged ``tok`` (1 to 3 tokens)."""
    return lazy_stack([TensorDict(obs=torch.full((3,), float(i)), tok=torch.arange(1 + i % 3) + 10 * i) for i in range(start, start + n)])


def buffer(kwargs: dict[str, Any]) -> Any:
    """A prioritized ragged buffer of :data:`SLOTS` slots holding :data:`WRITTEN` rows."""
    rb = replay_buffer(SLOTS, batch_size=4, sampler="prioritized", ragged=True, **kwargs)
    rb.extend(rows(0, WRITTEN))
    return rb


def content(rb: Any) -> list[tuple[list[float], list[int]]]:
    """The buffer's rows as plain lists (``obs``, ``tok``), to compare before and after."""
    got = rb[:]
    return [(r["obs"].tolist(), r["tok"].tolist()) for r in got.unbind(0)]


def dumped(kwargs: dict[str, Any], root: Path) -> tuple[Any, Path]:
    """A buffer, its checkpoint in ``root`` (``rb.dumps``), and then one more row written: returns the
    buffer and the storage's checkpoint folder (``root/storage``)."""
    rb = buffer(kwargs)
    root.parent.mkdir(parents=True, exist_ok=True)
    rb.dumps(root)
    rb.extend(rows(WRITTEN, 1))
    return rb, root / "storage"


# -- the edits --------------------------------------------------------------------------------------


def _edit(ck: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    meta = json.loads((ck / "tdstore.json").read_text())
    fn(meta)
    (ck / "tdstore.json").write_text(json.dumps(meta))


def _key(ck: Path, name: str) -> dict[str, Any]:
    return next(k for k in json.loads((ck / "tdstore.json").read_text())["keys"] if k["path"] == [name])


def _text(ck: Path, old: str, new: str) -> None:
    text = (ck / "tdstore.json").read_text()
    assert old in text, old
    (ck / "tdstore.json").write_text(text.replace(old, new, 1))


def tree_bytes_of(leaves: np.ndarray) -> bytes:
    """A priority tree (``lua/_tree.lua``: fan-out 16, sums and smallest positive weights) over ``leaves``,
    its sums consistent: what a checkpoint's ``priorities.f64`` holds."""
    out, sums, mins = [leaves.astype("<f8").tobytes()], leaves.astype(np.float64), leaves.astype(np.float64)
    while len(sums) > 1:
        pad = -len(sums) % 16
        s = np.concatenate([sums, np.zeros(pad)]).reshape(-1, 16)
        m = np.concatenate([np.where(mins > 0, mins, np.inf), np.full(pad, np.inf)]).reshape(-1, 16).min(axis=1)
        sums, mins = s.sum(axis=1), np.where(np.isinf(m), 0.0, m)
        out.append(np.stack([sums, mins], axis=1).astype("<f8").tobytes())
    return b"".join(out)


def _tree_on_unwritten(ck: Path, outside: Path) -> None:
    """All the weight on the slots never written (their rows are zeros), the sums consistent."""
    leaves = np.zeros(SLOTS)
    leaves[WRITTEN:] = 1.0
    (ck / "_tdstore" / "priorities.f64").write_bytes(tree_bytes_of(leaves))


def _ragged_overflow(ck: Path, outside: Path) -> None:
    """``tok`` of two dims; element 0 of shape [2**32, 2**32] and no bytes (the product wraps to 0 in int64)."""
    stem = ck / _key(ck, "tok")["file"]
    off = np.fromfile(f"{stem}.offsets", dtype="<i8")
    dims = np.fromfile(f"{stem}.shapes", dtype="<i8")
    data = Path(f"{stem}.data").read_bytes()
    np.concatenate([[0], off[1:] - off[1]]).astype("<i8").tofile(f"{stem}.offsets")
    Path(f"{stem}.data").write_bytes(data[off[1] :])
    shapes = np.stack([np.ones_like(dims), dims], axis=1)
    shapes[0] = [2**32, 2**32]
    shapes.astype("<i8").tofile(f"{stem}.shapes")
    _edit(ck, lambda m: next(k for k in m["keys"] if k["path"] == ["tok"]).__setitem__("ndim", 2))


def _symlink_file(ck: Path, outside: Path) -> None:
    """``obs.memmap`` a symlink to a file outside the folder, of the right size."""
    secret = outside / "secret.bin"
    secret.write_bytes(b"S" * (ck / "obs.memmap").stat().st_size)
    (ck / "obs.memmap").unlink()
    (ck / "obs.memmap").symlink_to(secret)


def _symlink_dir(ck: Path, outside: Path) -> None:
    """``_tdstore`` a symlink to a folder outside (a copy of it)."""
    shutil.move(str(ck / "_tdstore"), str(outside / "_tdstore"))
    (ck / "_tdstore").symlink_to(outside / "_tdstore", target_is_directory=True)


def _deep(ck: Path, outside: Path) -> None:
    _text(ck, '"sub": []', '"sub": ' + "[" * 100_000 + "]" * 100_000)


def _count_huge(ck: Path, outside: Path) -> None:
    def edit(m: dict[str, Any]) -> None:
        m.update(count=2**60, keys=[], priorities=None, ring={})

    _edit(ck, edit)


#: name -> edit of a checkpoint folder (``outside``: a folder beside it, for what a link points to).
HOSTILE: dict[str, Callable[[Path, Path], None]] = {
    "inner mismatch": lambda ck, out: _edit(ck, lambda m: m.__setitem__("inner", [3])),
    "symlink to a file outside": _symlink_file,
    "symlinked folder": _symlink_dir,
    "tree weight on unwritten slots": _tree_on_unwritten,
    "dims whose product overflows": _ragged_overflow,
    "count 2**60": _count_huge,
    "rw 2**60": lambda ck, out: _edit(ck, lambda m: m["ring"].__setitem__("rw", 2**60)),
    "pm 1e308": lambda ck, out: _edit(ck, lambda m: m["ring"].__setitem__("pm", 1e308)),
    "NaN in the JSON": lambda ck, out: _text(ck, '"format"', '"note": NaN, "format"'),
    "deep nesting": _deep,
    "sub-tree of no dims": lambda ck, out: _edit(ck, lambda m: m.__setitem__("sub", [[["obs"], []]])),
    # a checkpoint taken while writers ran (rows absent below ring.ho, stats counters): out of range
    "absent rows below rw - count": lambda ck, out: _edit(ck, lambda m: m["ring"].update(rw=2 * SLOTS, ho=1)),
    "absent rows beyond rw": lambda ck, out: _edit(ck, lambda m: m["ring"].__setitem__("ho", m["ring"]["rw"] + 1)),
    "stats counter of a bad name": lambda ck, out: _edit(ck, lambda m: m.__setitem__("stats", {"ins x": 1})),
    "stats counter negative": lambda ck, out: _edit(ck, lambda m: m.__setitem__("stats", {"ins": -1})),
}


# -- the three ways in ------------------------------------------------------------------------------


def cli_import(url: str, prefix: str, ck: Path, td_id: str) -> tuple[int, str]:
    """``tdstore import CK --td-id TD_ID`` in this process: its exit code and what it printed on stderr
    (an exception escaping it is returned as ``-1`` and its traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli_main(["import", str(ck), "--url", url, "--prefix", prefix, "--td-id", td_id, "--no-progress"])
        except BaseException as exc:  # what a user would see as a traceback
            return -1, f"Traceback: {describe_exc(exc)}"
    return rc, err.getvalue()


def one_clear_line(rc: int, err: str, want: int = 1) -> bool:
    """Exit ``want`` and one line on stderr, no traceback."""
    return rc == want and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def many_keys_checkpoint(root: Path, n: int = MANY_KEYS, count: int = 4) -> Path:
    """A checkpoint of ``n`` dense float32 keys of ``count`` elements (one file each), written by hand."""
    root.mkdir(parents=True)
    keys = []
    for i in range(n):
        np.arange(count, dtype="<f4").tofile(root / f"k{i}.memmap")
        keys.append({"path": [f"k{i}"], "dtype": "float32", "layout": "dense", "ndim": 0, "shape": [], "file": f"k{i}.memmap"})
    meta = {"format": "tdstore-checkpoint", "version": 1, "td_id": "many", "kind": "lazy", "count": count, "stack_dim": 0,
            "inner": [], "keys": keys, "ring": {"rw": count}}  # fmt: skip
    (root / "tdstore.json").write_text(json.dumps(meta))
    return root


_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[4]), int(sys.argv[4])))
from tdstore._checkpoint.export_import import import_checkpoint
s = import_checkpoint(sys.argv[1], url=sys.argv[2], prefix=sys.argv[3], td_id="many")
print(len(list(s.keys())), float(s["k7"].sum()))
"""


def import_under_fd_limit(ck: Path, url: str, prefix: str, limit: int = FD_LIMIT) -> subprocess.CompletedProcess[str]:
    """``import_checkpoint`` of ``ck`` in a child process whose limit of open files is ``limit``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(ck), url, prefix, str(limit)], capture_output=True, text=True, timeout=600, env=env
    )


# -- the case -------------------------------------------------------------------------------------


def _saw(exc: BaseException | None, ck: Path) -> str:
    return describe_exc(exc, 400).replace(f"{ck} is not a valid tdstore checkpoint: ", "")[:110]


def _refused(name: str, env: Env, work: Path, edit: Callable[[Path, Path], None]) -> list[Check]:
    kwargs = {"url": env.url, "prefix": env.prefix}
    rb, ck = dumped(kwargs, work / "rb")
    outside = work / "outside"
    outside.mkdir()
    edit(ck, outside)
    before, rows_before = raw_snapshot(env.client, env.prefix), content(rb)
    checks = []
    exc: BaseException | None = None
    try:
        import_checkpoint(ck, td_id=f"{name}-copy", **kwargs)
    except Exception as e:  # (anything but a CheckpointError fails the check)
        exc = e
    same = raw_snapshot(env.client, env.prefix) == before
    checks.append(
        Check(f"{name}: import_checkpoint", isinstance(exc, CheckpointError) and same, _saw(exc, ck), f"server unchanged: {same}")
    )
    rc, err = cli_import(env.url, env.prefix, ck, f"{name}-cli")
    same = raw_snapshot(env.client, env.prefix) == before
    line = err.strip().replace(str(ck), "CK")[:90]
    checks.append(Check(f"{name}: tdstore import", one_clear_line(rc, err) and same, f"exit {rc}: {line}", f"server unchanged: {same}"))
    exc = None
    try:
        rb.loads(work / "rb")
    except Exception as e:
        exc = e
    kept = raw_snapshot(env.client, env.prefix) == before and content(rb) == rows_before and len(rb) == WRITTEN + 1
    checks.append(
        Check(f"{name}: rb.loads", isinstance(exc, CheckpointError) and kept, _saw(exc, ck), f"buffer and server unchanged: {kept}")
    )
    with contextlib.suppress(Exception):
        rb.storage.delete()
    return checks


def _foreign_td_id(env: Env, work: Path) -> Check:
    kwargs = {"url": env.url, "prefix": env.prefix}
    other = LazyStackedTensorDictStore(count=SLOTS, td_id="someone-else", **kwargs)  # made, nothing written yet
    rb, ck = dumped(kwargs, work / "rb")
    _edit(ck, lambda m: m.__setitem__("td_id", "someone-else"))
    theirs = {k: v for k, v in raw_snapshot(env.client, env.prefix).items() if b"{someone-else}" in k}
    rb2 = replay_buffer(SLOTS, batch_size=4, sampler="prioritized", ragged=True, **kwargs)
    own = rb2.storage.td_id
    rb2.loads(work / "rb")  # (an error here ends the case: FAIL with its traceback)
    kept = {k: v for k, v in raw_snapshot(env.client, env.prefix).items() if b"{someone-else}" in k} == theirs
    ok = kept and rb2.storage.td_id == own and len(rb2) == WRITTEN
    rb.storage.delete()
    rb2.storage.delete()
    other.clear_redis()
    return Check(
        "rb.loads of another user's td_id",
        ok,
        f"loaded under the buffer's own id: {rb2.storage.td_id == own}",
        f"their store unchanged: {kept}",
    )


def case_hostile_checkpoint(env: Env) -> list[Check]:
    """Every edit of :data:`HOSTILE` refused three ways with the server unchanged; another user's td_id
    never replaced; :data:`MANY_KEYS` keys under :data:`FD_LIMIT` open files."""
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="tdstore-hostile-") as tmp:
        for i, (name, edit) in enumerate(HOSTILE.items()):
            work = Path(tmp) / f"c{i}"
            work.mkdir()
            checks += _refused(name, env, work, edit)
        checks.append(_foreign_td_id(env, Path(tmp) / "foreign"))
        proc = import_under_fd_limit(many_keys_checkpoint(Path(tmp) / "many"), env.url, env.prefix)
        ok = proc.returncode == 0 and proc.stdout.split() == [str(MANY_KEYS), "6.0"]
        saw = proc.stdout.strip() or proc.stderr.strip().splitlines()[-1:]
        checks.append(Check(f"{MANY_KEYS} keys under ulimit -n {FD_LIMIT}", ok, f"{saw}", f"exit {proc.returncode}"))
    return checks
