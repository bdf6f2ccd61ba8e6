"""The one place that loads and calls the Lua scripts in ``lua/``.

Each script is sent as ``EVALSHA`` with the SHA1 computed locally, so the first
call costs no extra round trip when the server already knows the script.  On
``NOSCRIPT`` (server restart, failover, ``SCRIPT FLUSH``, script-cache eviction)
the script is loaded with ``SCRIPT LOAD`` (on Redis Cluster, on the primary that serves
the call's slot) and the call is retried once; if the
cache was flushed again in between, the call is sent as ``EVAL`` with the text.  redis-py
``Script`` objects are not used: in pipelines they add a ``SCRIPT EXISTS`` round
trip on every execute.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

LIBRARY = "_lib"
SCRIPT_NAMES = ("create", "read", "write", "commit", "clear", "expire", "copy")


class ServerScriptError(RuntimeError):
    """A tdstore script refused a call (a bug or a corrupt store, never user input)."""


def _lua_dir() -> Any:
    """Where the ``.lua`` files are: inside the installed package (``tdstore._lua``) or in a source checkout.

    Returns a ``Traversable`` (a namespace package gives a ``MultiplexedPath``, which
    is not a ``Path``), so files are only read through ``joinpath(...).read_text()``.
    """
    try:
        packaged = resources.files("tdstore._lua")
        if packaged.joinpath("read.lua").is_file():
            return packaged
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parent.parent / "lua"


@cache
def script_source(name: str) -> tuple[str, str]:
    """``(text, sha1)`` of script ``name`` with the shared helpers prepended."""
    folder = _lua_dir()
    text = folder.joinpath(f"{LIBRARY}.lua").read_text() + "\n" + folder.joinpath(f"{name}.lua").read_text()
    return text, hashlib.sha1(text.encode()).hexdigest()  # lowercase, as fakeredis needs


def call(client: redis.Redis, name: str, keys: list[str], args: list[Any], execute: Callable[..., Any] | None = None) -> list:
    """Run script ``name`` in one round trip (two more only after NOSCRIPT).

    ``execute(client, *command)`` sends one command (a handle's held connection,
    see ``_connection.HeldConnection``); by default ``client.execute_command``.
    """
    text, sha = script_source(name)
    run = execute or (lambda c, *command: c.execute_command(*command))
    try:
        try:
            return run(client, "EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            if isinstance(client, RedisCluster):
                # on the primary that serves the call's slot (after a failover, the new one):
                # a plain SCRIPT LOAD would go to every primary and fail while any one is down
                client.execute_command("SCRIPT", "LOAD", text, target_nodes=client.get_node_from_key(keys[0]))
            else:
                run(client, "SCRIPT", "LOAD", text)  # on the same connection as the call
        try:
            return run(client, "EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            # flushed again between our load and the retry: send the text itself
            return run(client, "EVAL", text, len(keys), *keys, *args)
    except ResponseError as err:
        raise translate(err) from None


def translate(err: ResponseError) -> Exception:
    """Turn a server error into the exception a user should see."""
    msg = str(err)
    if "TDSTORE too large" in msg:
        return ValueError(f"the write would make a value larger than the server accepts; nothing was written: {msg[msg.index('TDSTORE') :]}")
    if "TDSTORE exists" in msg:
        return ValueError(msg[msg.index("TDSTORE exists") + 16 :])
    if "TDSTORE empty" in msg:
        return ValueError(f"cannot sample: {msg[msg.index('TDSTORE empty') + 14 :]}")
    if "TDSTORE" in msg:
        return ServerScriptError(msg[msg.index("TDSTORE") :])
    low = msg.lower()
    if "unknown command" in low and ("evalsha" in low or "script" in low):
        return RuntimeError(f"the server does not support Lua scripting (EVALSHA), which tdstore needs: {msg}")
    if "oom" in low or "maxmemory" in low:
        return MemoryError(f"the server is out of memory (maxmemory reached); nothing was written by this call: {msg}")
    if "noperm" in low or "no permissions" in low or "can't run this command" in low:
        return PermissionError(f"the server's ACL refused the call: {msg}")
    if "string exceeds maximum allowed size" in low:
        return ValueError(f"the value is larger than the server allows for one string (proto-max-bulk-len): {msg}")
    return err
