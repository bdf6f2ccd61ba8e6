"""The files of a checkpoint folder, read as input from outside (``_checkpoint.disk_format`` says what they hold).

Every file is opened by :func:`open_file`, one path component at a time without following a symlink, and
must be a regular file: a link to something outside the folder, a FIFO or a device is refused, never read.
Files are read by ``pread`` a range at a time and closed (:func:`read_range`): no descriptor outlives a
read, whatever the number of files. JSON is parsed strictly (:func:`load_json`): a bounded size and
nesting depth, no ``NaN``, ``Infinity`` or number beyond a double. No torch, no numpy.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Most bytes of a JSON file of a checkpoint (``tdstore.json`` of 20,000 keys is ~2 MB).
MAX_JSON_BYTES = 64 << 20
#: Deepest nesting of a checkpoint's JSON (``tdstore.json`` nests 4 deep), and of the folders of a
#: ``TensorDict.memmap`` of nested keys.
MAX_DEPTH = 32

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO is refused by fstat, not waited on by open


class CheckpointError(ValueError):
    """A checkpoint that is not one, or is malformed: refused before anything is written to a server."""


def bad(path: Path, what: str) -> CheckpointError:
    """The error of a malformed checkpoint in ``path``, saying what is wrong."""
    return CheckpointError(f"{path} is not a valid tdstore checkpoint: {what}")


def _parts(root: Path, rel: Any, what: str) -> list[str]:
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\0" in rel:
        raise bad(root, f"{what} names the file {rel!r}, which is not a relative path inside the checkpoint"[:300])
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise bad(root, f"{what} names the file {rel!r}, which is not a relative path inside the checkpoint"[:300])
    return parts


def inside(root: Path, rel: Any, what: str) -> Path:
    """``root / rel`` for a relative path that stays inside ``root`` (no absolute path, no ``..``)."""
    _parts(root, rel, what)
    return root / rel


def open_file(root: Path, rel: Any, what: str) -> int:
    """A read-only descriptor of the regular file ``rel`` inside ``root`` (the caller closes it).

    Each component below ``root`` is opened relative to the one before with ``O_NOFOLLOW``, so a
    symlink anywhere in the path is refused rather than followed out of the folder, and the file
    must be a regular file (a FIFO, a device or a socket is refused: ``O_NONBLOCK`` keeps a FIFO
    from blocking the open). ``FileNotFoundError`` when it is absent."""
    parts = _parts(root, rel, what)
    fd = os.open(root, os.O_RDONLY | _DIRECTORY)
    try:
        for name in parts[:-1]:
            nxt = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise bad(root, f"{what}: {rel!r} passes through a symlink or something that is not a folder (never followed)") from None
        raise
    finally:
        os.close(fd)
    info = os.fstat(leaf)
    if not stat.S_ISREG(info.st_mode):
        os.close(leaf)
        raise bad(root, f"{what}: {rel!r} is not a regular file (never read)")
    return leaf


@contextmanager
def opened(root: Path, rel: Any, what: str) -> Iterator[int]:
    """:func:`open_file` as a context: the descriptor is closed on leaving (one open file at a time)."""
    fd = open_file(root, rel, what)
    try:
        yield fd
    finally:
        os.close(fd)


def read_at(fd: int, offset: int, size: int) -> bytearray:
    """``size`` bytes at ``offset`` of ``fd`` (``CheckpointError``-free: the caller checked the file's size)."""
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(errno.EIO, f"the file ended {size - got} bytes early (it changed while it was read)")
        got += n
    return out


def read_range(root: Path, rel: str, offset: int, size: int, what: str) -> bytearray:
    """``size`` bytes at ``offset`` of the file ``rel`` (opened, read and closed)."""
    with opened(root, rel, what) as fd:
        return read_at(fd, offset, size)


def file_size(root: Path, rel: str, what: str) -> int:
    with opened(root, rel, what) as fd:
        return os.fstat(fd).st_size


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is out of range")
    return v


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (NaN and Infinity are refused)")


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def load_json(root: Path, rel: str, what: str) -> Any:
    """The JSON document in the file ``rel``: at most :data:`MAX_JSON_BYTES`, nested at most
    :data:`MAX_DEPTH` deep, without ``NaN``, ``Infinity`` or a number out of a double's range."""
    with opened(root, rel, what) as fd:
        size = os.fstat(fd).st_size
        if size > MAX_JSON_BYTES:
            raise bad(root, f"{what} holds {size} bytes, more than {MAX_JSON_BYTES} (not a checkpoint's)")
        raw = read_at(fd, 0, size)
    try:
        text = raw.decode("utf-8")
        depth = 0
        for ch in _NOT_BRACKET.sub("", _STRING.sub("", text)):  # (a few per key: strings and numbers gone)
            depth += 1 if ch in "[{" else -1
            if depth > MAX_DEPTH:
                raise ValueError(f"it nests more than {MAX_DEPTH} deep")
        return json.loads(text, parse_constant=_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise bad(root, f"{what} is not JSON a checkpoint holds ({str(err)[:200]})") from None


def exists(root: Path, rel: str) -> bool:
    """Whether ``rel`` is a file inside ``root`` (a symlink or special file raises :class:`CheckpointError`)."""
    try:
        file_size(root, rel, rel)
    except FileNotFoundError:
        return False
    return True


def prepare_dir(path: Path, meta_file: str) -> Path:
    """A fresh temporary sibling of ``path``, renamed onto it once the checkpoint is whole; ``path`` itself
    may be absent, an empty directory or an earlier checkpoint (replaced), nothing else."""
    if path.exists():
        if not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a directory")
        if any(path.iterdir()) and not (path / meta_file).is_file():
            raise FileExistsError(f"{path} is a directory that holds something else than a tdstore checkpoint; pick another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, path: Path) -> None:
    """``tmp`` (:func:`prepare_dir`), whole, renamed onto ``path`` (an earlier checkpoint there moved aside, then deleted)."""
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)
