"""Shared test helpers: reference data and tensordict comparison."""

from __future__ import annotations

import math
import multiprocessing
import time
from typing import Any

import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack


def make_stack(n: int = 6, het: bool = True, inner: tuple[int, ...] = (), stack_dim: int = 0) -> LazyStackedTensorDict:
    """A lazy stack with homogeneous keys, a nested key and (optionally) a heterogeneous one."""
    tds = []
    for i in range(n):
        d = {
            "obs": torch.arange(4, dtype=torch.float32).expand(*inner, 4) + 10 * i,
            "done": torch.full((*inner, 1), i % 2 == 0),
            ("nested", "b"): torch.arange(3, dtype=torch.int64).expand(*inner, 3) + 100 * i,
        }
        if het:
            d["tokens"] = torch.arange(1 + i % 4, dtype=torch.int64).expand(*inner, 1 + i % 4) + 1000 * i
        td = TensorDict(batch_size=inner)
        for k, v in d.items():
            td.set(k, v.clone())
        tds.append(td)
    return lazy_stack(tds, dim=stack_dim)


def assert_same(a: TensorDictBase, b: TensorDictBase) -> None:
    """Equal batch sizes, keys and values; lazy stacks compared element by element."""
    assert a.batch_size == b.batch_size, (a.batch_size, b.batch_size)
    if a.batch_size.numel() == 0:
        return
    ka = sorted(map(str, a.keys(True, True)))
    kb = sorted(map(str, b.keys(True, True)))
    assert ka == kb, (ka, kb)
    if isinstance(a, LazyStackedTensorDict) or isinstance(b, LazyStackedTensorDict):
        dim = a.stack_dim if isinstance(a, LazyStackedTensorDict) else b.stack_dim
        if a.batch_size[dim] == 0:
            return
        for x, y in zip(a.unbind(dim), b.unbind(dim)):
            assert_same(x, y)
        return
    for key in a.keys(True, True):
        va, vb = a.get(key), b.get(key)
        assert va.dtype == vb.dtype, (key, va.dtype, vb.dtype)
        assert va.shape == vb.shape, (key, va.shape, vb.shape)
        assert torch.equal(va, vb), (key, va, vb)


def top_level_commands(client_factory, fn, *, lua: bool = False) -> list[str]:
    """Names of the commands clients sent to the server while ``fn`` ran, read with MONITOR.

    Commands that scripts issue (MONITOR marks them 'lua') are left out, so the
    list is exactly the round trips the server received; ``lua=True`` gives those instead.
    """
    import threading
    import uuid

    sentinel = f"tdstore-sentinel-{uuid.uuid4().hex}"
    seen: list[str] = []
    started = threading.Event()
    poke = client_factory()
    poke.ping()  # connect now, so its handshake is not counted
    with client_factory().monitor() as mon:

        def collect() -> None:
            started.set()
            for cmd in mon.listen():
                text = cmd["command"]
                if sentinel in text:
                    return
                if (cmd.get("client_type") == "lua") == lua:
                    seen.append(text.split(" ", 1)[0].lower())

        thread = threading.Thread(target=collect, daemon=True)
        thread.start()
        started.wait(120)
        fn()
        poke.echo(sentinel)
        thread.join(120)  # the reader stops at the sentinel: a long limit only bounds a hang
        assert not thread.is_alive(), "MONITOR never showed the sentinel: the command list would be cut short"
    return seen


def round_trips(commands: list[str]) -> list[str]:
    """``commands`` (from ``top_level_commands``) with each MULTI ... EXEC as one ``"transaction"``.

    A read transaction goes out in one write and its replies come back together (tested in
    ``test_wire.py``), so it is one round trip like an EVALSHA.
    """
    out: list[str] = []
    inside = False
    for c in commands:
        if c == "multi":
            inside = True
        elif c == "exec":
            inside = False
            out.append("transaction")
        elif not inside:
            out.append(c)
    assert not inside, commands
    return out


def load_tool(name: str):
    """The tool ``python -m tools.<name>`` as a module (``tools`` is a package of the checkout, the test command's
    working directory)."""
    import importlib

    return importlib.import_module(f"tools.{name}")


def learner_url(srv: Any, user: str = "learner") -> str:
    """The URL of ``srv`` (an ``EmbeddedServer`` on TCP) logged in as ``user`` with the README's password ``pw``."""
    return f"redis://{user}:pw@127.0.0.1:{srv.port}/0"


# -- stamped elements: every leaf carries one number, so a torn element is visible ----------------


def stamped(stamp: int) -> TensorDict:
    """An element whose every leaf carries ``stamp`` (tokens also in their length): leaves of two writes show."""
    return TensorDict(
        obs=torch.full((8,), float(stamp)), tokens=torch.full((stamp % 5 + 1,), stamp, dtype=torch.int64), stamp=torch.tensor(stamp)
    )


def consistent(td: TensorDict) -> bool:
    """Whether every leaf of ``td`` carries the same stamp (see :func:`stamped`)."""
    s = int(td["stamp"])
    return bool((td["obs"] == s).all()) and td["tokens"].numel() == s % 5 + 1 and bool((td["tokens"] == s).all())


def stamp_writer(url: str, prefix: str, td_id: str, seed: int, seconds: float, rows: int) -> None:
    """A process that writes ``stamped`` elements to random rows of a store for ``seconds``."""
    from tdstore import LazyStackedTensorDictStore

    store = LazyStackedTensorDictStore.from_store(td_id=td_id, url=url, prefix=prefix)
    g = torch.Generator().manual_seed(seed)
    stamp = seed * 1_000_000
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stamp += 1
        store[int(torch.randint(0, rows, (1,), generator=g))] = stamped(stamp)


def torn_while_running(store, procs, rows: list[int]) -> tuple[int, int]:
    """Start ``procs``, read ``store[rows]`` until they end, join them (each must succeed); (reads, torn)."""
    for p in procs:
        p.start()
    reads = torn = 0
    while any(p.is_alive() for p in procs):
        batch = store[torch.tensor(rows)]
        for j in range(len(rows)):
            reads += 1
            torn += not consistent(batch[j])
    for p in procs:
        p.join()
        assert p.exitcode == 0
    return reads, torn


#: Taken at import, before :func:`children_from_forkserver` replaces ``multiprocessing.get_context``.
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "tensordict", "tdstore"])


def mp_context() -> Any:
    """A ``forkserver`` context whose server imports torch, tensordict and tdstore once: each child
    process starts in milliseconds, where a ``spawn`` child spends ~3 s importing them. Like spawn
    (and unlike fork) a child starts from a clean process, so a test's threads and sockets do not leak into it."""
    return _FORKSERVER


def children_from_forkserver(monkeypatch: Any) -> None:
    """Code under test that asks ``multiprocessing.get_context(...)`` for its child processes (the demo's
    actors) gets :func:`mp_context` instead, for the rest of the test."""
    monkeypatch.setattr(multiprocessing, "get_context", lambda method=None: _FORKSERVER)


def no_retry() -> Retry:
    """A redis-py retry policy that retries nothing: a test that expects a connection to fail gets the
    failure at once, where redis-py's default policy retries it with a growing backoff (seconds in all)."""
    return Retry(NoBackoff(), 0)


# -- shared by several test files: written once ----------------------------------------------------------


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = expected_p * n
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a slot of probability 0 was drawn"
    return float((((counts[keep] - exp[keep]) ** 2) / exp[keep]).sum())


def chi2_critical(df: int) -> float:
    """The 0.1 % critical value of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    z = 3.090232  # the 0.999 quantile of the standard normal
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# Each key's time to live as of one instant (the script's first TIME), so keys that share a
# deadline show the very same number: from PEXPIRETIME where the server has it (Redis 7,
# fakeredis); on Redis 6, whose clock moves inside a script, from a PTTL read within the
# same millisecond as a TIME (read again until it is), shifted back to that instant.
_PTTLS = """
local function ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end
local m0 = ms(redis.call('TIME'))
local r = {}
for i, k in ipairs(KEYS) do
  local p = redis.pcall('PEXPIRETIME', k)
  if type(p) == 'number' then
    r[i] = p < 0 and p or p - m0
  else
    local a, b
    repeat
      a = ms(redis.call('TIME'))
      p = redis.call('PTTL', k)
      b = ms(redis.call('TIME'))
    until a == b
    r[i] = p < 0 and p or p + (a - m0)
  end
end
table.insert(r, 1, m0)
return r
"""


def pttls(backend, store) -> dict[bytes, int]:
    keys = [k for k in backend.keys() if b"{" in k and store.td_id.encode() in k]
    client = backend.client()
    # one script per hash tag (a spread store's segments live in several slots), each read as of
    # its own first instant: shifted to the first one's, so one deadline still shows one number
    by_tag: dict[bytes, list[bytes]] = {}
    for k in keys:
        by_tag.setdefault(k[k.index(b"{") : k.index(b"}") + 1], []).append(k)
    out: dict[bytes, int] = {}
    start = None
    for group in by_tag.values():
        m0, *ttls = client.eval(_PTTLS, len(group), *group)
        start = m0 if start is None else start
        out.update((k, t if t < 0 else t + m0 - start) for k, t in zip(group, ttls))
    return out


def same_deadline(backend, ttls: dict[bytes, int]) -> bool:
    """One deadline for every key: exactly on redis-server (see _PTTLS); fakeredis reads its clock
    on each command, so there a millisecond or two may pass."""
    values = set(ttls.values())
    return len(values) == 1 if backend.server is not None else max(values) - min(values) <= 5


def round_trips_per_node(cluster: Any, fn) -> list[list[str]]:
    """Each primary's round trips (MONITOR, the commands scripts issue left out) while ``fn`` runs."""
    seen: dict[int, list[str]] = {}

    def watch(i: int) -> None:
        if i == 3:
            fn()
            return
        seen[i] = round_trips(top_level_commands(lambda: cluster.node_client(i), lambda: watch(i + 1)))

    watch(0)
    return [seen[i] for i in range(3)]
