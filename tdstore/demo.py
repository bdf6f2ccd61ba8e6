"""The tdstore demo: actor processes write a shared lazy stack while a learner samples it.

This is the project's headline scenario (an RL-style replay buffer): ``actors``
processes keep overwriting random elements of one
:class:`~tdstore.LazyStackedTensorDictStore` with elements of *varying* token
length, while the main process (the "learner") samples random batches from the
same store.  Because every store operation is one atomic Lua call, the learner
must never see a *torn* element (leaves from two different writes, or a token
length that does not match the write it came from).  The demo proves it, instead
of just claiming it: every leaf of every written element encodes who wrote it
and when, so each sampled element can be checked on its own.

The encoding of element ``(actor, seq)`` (``actor == -1`` for the initial content,
whose ``seq`` is the element's index):

======================  =================================================================
``actor``               i64[1], the writer's id
``seq``                 i64[1], the writer's sequence number (its count of earlier writes)
``obs``                 f32[8], every entry ``actor * 1e6 + seq`` (rounded to float32)
``tokens``              i64[L], ``arange(L) + seq`` with ``L = token_length(actor, seq)``
``("meta","check")``    f32[1], ``check_value(actor, seq)``, another function of both
======================  =================================================================

The slot an actor writes is a hash of ``(actor, seq)`` too, so a reader can also
check that an element sits where its writer put it, and at the end the final
content is compared with the last write of each actor to each slot (a lost or
misplaced write shows up there).

With ``replay=True`` (``tdstore demo --replay``) the store is a ring of ``count`` slots used
as a prioritized, rate-limited replay buffer: each actor attaches by ``td_id`` and
``extend``s it with a priority (the server picks the slots), and the learner samples by
priority and writes priorities back (``update_priority``) under Reverb's samples-per-insert
limiter, held on the server.  With ``torchrl=True`` (``tdstore demo --torchrl``) the same run goes through a torchrl
replay buffer (:func:`tdstore.torchrl.replay_buffer`): the store is a ring of ``count``
slots, each actor attaches to it by ``td_id`` and ``extend``s it (the server picks the
slots), and the learner calls ``rb.sample()``.  The buffer is prioritized on the server
(the learner sends each batch's "TD errors" back as priorities) and rate-limited (Reverb's
samples-per-insert ratio, held across processes).  Elements are checked the same way, except
where they sit: the ring, not a hash, places them, so each actor records the slots its
writes got for the final check.

Run it with ``python -m tdstore demo`` (see :mod:`tdstore.cli`), or call
:func:`run_demo`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase, lazy_stack

from ._connection import PASSWORD_ENV
from .cluster_server import EmbeddedCluster
from .lazy import LazyStackedTensorDictStore
from .server import EmbeddedServer

__all__ = [
    "DemoError",
    "ServerUnreachable",
    "check_batch",
    "check_reachable",
    "check_value",
    "make_element",
    "obs_value",
    "redact_url",
    "run_demo",
    "slot_of",
    "token_length",
]

DEFAULT_PREFIX = "tdstore-demo"
#: The ``actor`` of the initial content uploaded before the actors start.
INITIAL_ACTOR = -1
OBS_SIZE = 8
#: Segment size of the demo's store with ``spread=True``: a few elements per segment, so that a
#: store of a few hundred elements has its segments on every node of the cluster.
SPREAD_SEGMENT_BYTES = 2048
#: Token lengths cycle through 1..MAX_TOKENS, so sampled batches are nearly always heterogeneous.
MAX_TOKENS = 13
#: At most this many torn-element descriptions are kept in the figures (the count is exact).
MAX_EXAMPLES = 5
#: Seconds a spawned actor may take to import torch and connect before the demo gives up.
ACTOR_START_TIMEOUT = 120.0
#: Seconds an actor may take to report after the run ends (one write is milliseconds).
ACTOR_STOP_TIMEOUT = 30.0
_TICK = 0.2
_U64 = np.uint64


class DemoError(RuntimeError):
    """The demo could not run (an actor failed, or the server went away)."""


class ServerUnreachable(DemoError):
    """The ``url`` given to the demo does not answer; the CLI turns this into exit code 2."""


# -- the encoding: every leaf is a function of (actor, seq) ------------------------------------
# All functions take numpy arrays (or ints) and are used by both the writers and the
# checkers, so the two can never disagree about what a consistent element is.


#: The torchrl demo's rate limiter: the learner's samples per row the actors insert (Reverb's ratio).
SAMPLES_PER_INSERT = 4.0


def token_length(actor: Any, seq: Any) -> np.ndarray:
    """Length of the ``tokens`` leaf written as ``(actor, seq)``: varies with both, in 1..MAX_TOKENS.

    For the initial content (actor -1) this is ``1 + index % MAX_TOKENS``.
    """
    a = np.asarray(actor, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    return 1 + (s + 3 * (a + 1)) % MAX_TOKENS


def obs_value(actor: Any, seq: Any) -> np.ndarray:
    """The value that fills ``obs``: ``actor * 1e6 + seq`` as float32.

    Exact while it is below 2**24; beyond that two writes may share a value, which
    can only hide a torn element, never report a false one (the other leaves still
    disagree).
    """
    a = np.asarray(actor, dtype=np.float64)
    s = np.asarray(seq, dtype=np.float64)
    return (a * 1e6 + s).astype(np.float32)


def check_value(actor: Any, seq: Any) -> np.ndarray:
    """The ``("meta", "check")`` value: a second, different mix of actor and seq (exact in float32)."""
    a = np.asarray(actor, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    return (((a + 1) * 7919 + (s % 1_000_003) * 104_729) % 65_521).astype(np.float32)


def slot_of(actor: Any, seq: Any, count: int) -> np.ndarray:
    """The element that write ``(actor, seq)`` goes to: a splitmix64 hash, so slots look random.

    Deriving the slot from the write (instead of drawing it) lets a reader check
    that an element sits where its writer put it.  The initial content of element
    ``i`` is ``(-1, i)`` and maps to ``i``.  Unsigned numpy arithmetic wraps
    modulo 2**64 by definition, so the hash is the same in every process.
    """
    a = np.asarray(actor, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    with np.errstate(over="ignore"):
        z = (np.clip(a + 1, 0, None).astype(_U64) << _U64(32)) ^ s.astype(_U64)
        z = z + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z = z ^ (z >> _U64(31))
        hashed = (z % _U64(count)).astype(np.int64)
    return np.where(a < 0, s % count, hashed)


def make_element(actor: int, seq: int) -> TensorDict:
    """The element that actor ``actor`` writes as its ``seq``-th write (or the initial one, actor -1)."""
    length = int(token_length(actor, seq))
    return TensorDict(
        {
            "obs": torch.full((OBS_SIZE,), float(obs_value(actor, seq)), dtype=torch.float32),
            "tokens": torch.arange(length, dtype=torch.int64) + seq,
            "actor": torch.tensor([actor], dtype=torch.int64),
            "seq": torch.tensor([seq], dtype=torch.int64),
            "meta": {"check": torch.tensor([float(check_value(actor, seq))], dtype=torch.float32)},
        },
        batch_size=(),
    )


def initial_stack(count: int) -> LazyStackedTensorDict:
    """The content uploaded first, so every key exists (and is heterogeneous) before anyone writes."""
    return lazy_stack([make_element(INITIAL_ACTOR, i) for i in range(count)])


# -- checking ------------------------------------------------------------------------------------


def element_problems(td: TensorDictBase, index: int, *, count: int, actors: int, placed: bool = True) -> list[str]:
    """Everything wrong with one element read at ``index`` (empty when it is consistent).

    The slow, explicit path: :func:`check_batch` uses it only to describe the
    elements its vectorized pass flagged, so messages stay precise.
    """
    problems: list[str] = []
    try:
        actor_t, seq_t = td.get("actor"), td.get("seq")
    except KeyError as err:
        return [f"missing key: {err}"]
    if actor_t.shape != (1,) or seq_t.shape != (1,):
        return [f"actor/seq shapes {tuple(actor_t.shape)}/{tuple(seq_t.shape)} instead of (1,)"]
    a, s = int(actor_t[0]), int(seq_t[0])
    who = f"element {index} says (actor {a}, seq {s})"
    if not INITIAL_ACTOR <= a < actors or s < 0:
        return [f"{who}: no such writer"]
    expected = make_element(a, s)
    for key in (("obs",), ("tokens",), ("meta", "check")):
        name = key[0] if len(key) == 1 else key
        got = td.get(key, None)
        want = expected.get(key)
        if got is None:
            problems.append(f"{who}: {name!r} is missing")
        elif got.shape != want.shape:
            problems.append(f"{who}: {name!r} has shape {tuple(got.shape)}, that write had {tuple(want.shape)}")
        elif not torch.equal(got, want):
            problems.append(f"{who}: {name!r} holds {got.tolist()}, that write had {want.tolist()}")
    slot = int(slot_of(a, s, count))
    if placed and slot != index:
        problems.append(f"{who}: that write went to element {slot}")
    return problems


def _token_rows(td: TensorDictBase) -> list[torch.Tensor]:
    """The ``tokens`` of each element of a batch (a lazy stack when lengths differ, else dense)."""
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        return [member.get("tokens") for member in td.tensordicts]
    return list(td.get("tokens").unbind(0))


def _consistent_mask(td: TensorDictBase, idx: np.ndarray, *, count: int, actors: int, placed: bool = True) -> np.ndarray:
    """Vectorized check of a batch read at ``idx``: True where an element is consistent.

    Per-element Python checks would cost as much as the read itself and halve the
    measured read rate; this pass touches each leaf once for the whole batch.
    """
    n = idx.size
    a = td.get("actor").reshape(n).numpy()
    s = td.get("seq").reshape(n).numpy()
    obs = td.get("obs").reshape(n, OBS_SIZE).numpy()
    chk = td.get(("meta", "check")).reshape(n).numpy()
    ok = (a >= INITIAL_ACTOR) & (a < actors) & (s >= 0)
    a = np.where(ok, a, 0)
    s = np.where(ok, s, 0)
    ok &= (obs == obs_value(a, s)[:, None]).all(axis=1)
    ok &= chk == check_value(a, s)
    if placed:  # else a ring placed the element (torchrl mode): where it sits is checked at the end
        ok &= slot_of(a, s, count) == idx
    toks = _token_rows(td)
    lengths = np.array([t.shape[0] if t.ndim == 1 else -1 for t in toks], dtype=np.int64)
    ok &= lengths == token_length(a, s)
    sel = np.flatnonzero(ok)
    if sel.size:
        flat = torch.cat([toks[k] for k in sel]).numpy()
        lens = lengths[sel]
        starts = np.cumsum(lens) - lens
        want = np.repeat(s[sel], lens) + (np.arange(flat.size) - np.repeat(starts, lens))
        wrong = np.bincount(np.repeat(np.arange(sel.size), lens), weights=flat != want, minlength=sel.size)
        ok[sel[wrong > 0]] = False
    return ok


def check_batch(td: TensorDictBase, indices: Any, *, count: int, actors: int, placed: bool = True) -> dict[int, list[str]]:
    """Check a batch read at ``indices``; return ``{position in batch: problems}`` for torn elements.

    A fast vectorized pass flags elements, and only flagged ones are described
    element by element.  If the batch is so broken that the fast pass cannot even
    stack a leaf, every element is checked the slow way.
    """
    idx = np.asarray(indices.numpy() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64).reshape(-1)
    try:
        suspects = np.flatnonzero(~_consistent_mask(td, idx, count=count, actors=actors, placed=placed))
    except (RuntimeError, ValueError, KeyError, TypeError):
        suspects = np.arange(idx.size)
    out: dict[int, list[str]] = {}
    for k in suspects.tolist():
        problems = element_problems(td[k], int(idx[k]), count=count, actors=actors, placed=placed)
        if problems:
            out[k] = problems
    return out


def lost_writes(td: TensorDictBase, indices: np.ndarray, last_seq: np.ndarray) -> dict[int, str]:
    """Elements (``td[k]`` is element ``indices[k]``) that are not the last write an actor made to them.

    ``last_seq[a, i]`` is the seq of actor ``a``'s last write to element ``i`` (-1 if
    none).  Each actor writes sequentially, so if element ``i`` finally holds
    ``(a, s)``, no later write of ``a`` went to ``i``: ``s`` must be ``last_seq[a, i]``.
    If it still holds the initial content, no actor may have written it at all.
    Call this only on elements that passed :func:`check_batch`.
    """
    n = len(indices)
    a = td.get("actor").reshape(n).numpy()
    s = td.get("seq").reshape(n).numpy()
    out: dict[int, str] = {}
    for k, i in enumerate(indices.tolist()):
        if a[k] == INITIAL_ACTOR:
            writers = np.flatnonzero(last_seq[:, i] >= 0)
            if writers.size:
                out[i] = (
                    f"element {i} still holds its initial content, but actor {int(writers[0])} wrote it (seq {int(last_seq[writers[0], i])})"
                )
        elif last_seq[a[k], i] != s[k]:
            out[i] = (
                f"element {i} holds (actor {int(a[k])}, seq {int(s[k])}), but that actor's last write there was seq {int(last_seq[a[k], i])}"
            )
    return out


# -- the actors ------------------------------------------------------------------------------------


def _actor_main(
    store: LazyStackedTensorDictStore,
    actor: int,
    seconds: float,
    start: Any,
    stop: Any,
    counter: Any,
    results: Any,
) -> None:
    """One actor process: overwrite elements for ``seconds``, then report what it wrote where.

    It ignores SIGINT (see :func:`_start_ignoring_sigint`): Ctrl-C reaches only
    the main process, which stops everyone through ``stop`` and still cleans the
    server up.  ``counter`` is a shared int the main process reads for live progress.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also when started from another thread
    try:
        count = len(store)
        store[actor % count].to_tensordict()  # connect and load the scripts before the clock starts

        def write(seq: int) -> int:
            slot = int(slot_of(actor, seq, count))
            store[slot] = make_element(actor, seq)
            return slot

        _write_until_stopped(write, count, actor, seconds, start, stop, counter, results)
    except BaseException:  # report anything, including SystemExit, instead of dying silently
        results.put(("error", actor, traceback.format_exc()))
    finally:
        store.close()


def _write_until_stopped(
    write: Callable[[int], int], count: int, actor: int, seconds: float, start: Any, stop: Any, counter: Any, results: Any
) -> None:
    """An actor's timed loop: ``write(seq)`` (which returns the slot written) until ``stop`` or the
    clock; reports ready, then done with the last sequence number written to each slot."""
    last_seq = np.full(count, -1, dtype=np.int64)
    results.put(("ready", actor))
    start.wait()
    t0 = time.monotonic()
    end = t0 + seconds
    seq = 0
    while not stop.is_set() and time.monotonic() < end:
        last_seq[write(seq)] = seq
        seq += 1
        counter.value = seq
    results.put(("done", actor, seq, time.monotonic() - t0, last_seq))


def _replay_actor_main(
    url: str, prefix: str, td_id: str, actor: int, seconds: float, start: Any, stop: Any, counter: Any, results: Any
) -> None:
    """One actor of the replay demo: attach to the ring by ``td_id`` and ``extend`` it with a priority.

    As in the torchrl demo, the server picks each write's slot and the actor records it. The
    rate limiter may hold an ``extend`` until the learner has sampled enough.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)

        def write(seq: int) -> int:
            return int(store.extend(lazy_stack([make_element(actor, seq)]), priority=1.0 + seq % 3).indices[0])

        _write_until_stopped(write, len(store), actor, seconds, start, stop, counter, results)
    except BaseException:
        results.put(("error", actor, traceback.format_exc()))


class _RingLearner:
    """The learner's side of ``tdstore demo --replay``: the calls the demo's loop makes on a torchrl
    buffer, made on the store itself (``sample`` by priority, ``update_priority`` where not overwritten)."""

    def __init__(self, store: LazyStackedTensorDictStore, batch: int) -> None:
        self.store, self.batch = store, batch
        self.sampler = self  # the loop sets ``rb.sampler.timeout``
        self.timeout: float | None = None
        self._gen: torch.Generator | None = None
        self._last: Any = None

    def set_rng(self, gen: torch.Generator) -> None:
        self._gen = gen

    def sample(self) -> TensorDictBase:
        s = self.store.sample(self.batch, self._gen, beta=0.4, timeout=self.timeout)
        self._last = s
        return s.td.set("index", s.indices)

    def update_tensordict_priority(self, td: TensorDictBase) -> None:
        self.store.update_priority(self._last.indices, td.get("td_error"), generation=self._last.generations)


def _torchrl_actor_main(
    url: str, prefix: str, td_id: str, actor: int, seconds: float, start: Any, stop: Any, counter: Any, results: Any
) -> None:
    """One actor of the torchrl demo: attach to the replay buffer by ``td_id`` and extend it.

    The server picks the slot of each write (its ring cursor); the actor records the
    slot each of its writes got, for the final check.  The URL has no password (the
    actor gets it from the environment, as in :func:`_password_for_children`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from .torchrl import attach

        rb = attach(td_id, url=url, prefix=prefix)
        _write_until_stopped(
            lambda seq: int(rb.extend(lazy_stack([make_element(actor, seq)]))[0]), len(rb), actor, seconds, start, stop, counter, results
        )
    except BaseException:
        results.put(("error", actor, traceback.format_exc()))


# -- the server ----------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """``url`` without its password, for messages and the returned figures."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = f"{parts.username}:***@" if parts.username else ":***@"
        netloc += parts.hostname or ""
        if parts.port is not None:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparsable url>"


def check_reachable(url: str, timeout: float = 5.0) -> str:
    """PING ``url`` once and return the server version; raise :class:`ServerUnreachable` otherwise.

    Without this, a wrong ``--url`` would surface as a traceback from deep inside
    the upload; checking first gives one clear sentence (and the CLI exit code 2).
    The connection follows tdstore's password rule (the URL's, else
    ``$TDSTORE_PASSWORD``), as the store and the actors will.
    """
    from .inspect_store import InvalidURL, connect
    from .inspect_store import ServerUnreachable as Unreachable

    try:
        conn = connect(url, timeout=timeout)
    except InvalidURL as err:
        raise ServerUnreachable(f"invalid server url {redact_url(url)!r}: {err}") from None
    except Unreachable as err:  # "cannot reach ...", or "the server at ... needs a password ..."
        raise ServerUnreachable(str(err)) from None
    with conn:
        try:
            return str(conn.client.info("server").get("redis_version", "unknown"))
        except redis.ResponseError:  # INFO may be forbidden by an ACL; PING was enough
            return "unknown"


@contextlib.contextmanager
def _password_for_children(url: str) -> Any:
    """Put the URL's password in ``$TDSTORE_PASSWORD`` while the actors are spawned, then restore it.

    A pickled store holds no password; a spawned actor reconnects with the password
    rule, whose last resort is the environment it inherits.  The environment is
    readable only by the same user (``/proc/PID/environ``), unlike a command line,
    which ``ps`` shows to everyone; nothing else carries the password to a child.
    """
    from redis.connection import parse_url

    try:
        password = parse_url(url.replace("+cluster://", "://", 1)).get("password")
    except ValueError:
        password = None
    if not password:
        yield
        return
    before = os.environ.get(PASSWORD_ENV)
    os.environ[PASSWORD_ENV] = password
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PASSWORD_ENV, None)
        else:
            os.environ[PASSWORD_ENV] = before


# -- progress ------------------------------------------------------------------------------------------


class _Progress:
    """Live figures on stderr: a tqdm bar when tqdm is installed, else one line per second."""

    def __init__(self, seconds: float, enabled: bool, stream: TextIO) -> None:
        self._bar: Any = None
        self._enabled = enabled
        self._stream = stream
        self._next_line = 1.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=round(seconds, 1),
            unit="s",
            desc="demo",
            file=stream,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f}s{postfix}",
        )

    def update(self, elapsed: float, writes: int, reads: int, torn: int) -> None:
        if not self._enabled:
            return
        rate_w = writes / elapsed if elapsed > 0 else 0.0
        rate_r = reads / elapsed if elapsed > 0 else 0.0
        if self._bar is not None:
            self._bar.n = round(min(elapsed, self._bar.total), 1)
            self._bar.set_postfix_str(f"writes {writes} ({rate_w:.0f}/s), batch reads {reads} ({rate_r:.0f}/s), torn {torn}", refresh=False)
            self._bar.refresh()
        elif elapsed >= self._next_line:
            self._next_line += 1.0
            print(
                f"[{elapsed:5.1f}s] writes {writes} ({rate_w:.0f}/s)  batch reads {reads} ({rate_r:.0f}/s)  torn {torn}",
                file=self._stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# -- the demo ------------------------------------------------------------------------------------------


def _check_args(
    actors: int,
    count: int,
    seconds: float,
    batch: int,
    *,
    url: str | None = None,
    cluster: bool = False,
    spread: bool = False,
    torchrl: bool = False,
    replay: bool = False,
) -> None:
    """Refuse nonsense and contradictions early, before a server is started or a process spawned."""
    for name, value in (("actors", actors), ("count", count), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    if cluster and url is not None:
        raise ValueError(
            "--cluster starts an embedded cluster, so it cannot be used with --url; for a cluster of yours give --url redis+cluster://HOST:PORT"
        )
    if spread and not cluster and not (url or "").lower().startswith(("redis+cluster://", "rediss+cluster://")):
        raise ValueError(
            "--spread spreads the store over a Redis Cluster's nodes: add --cluster (an embedded cluster), or give --url redis+cluster://HOST:PORT"
        )
    if torchrl and replay:
        raise ValueError("--torchrl and --replay are two ways to run the replay demo: pick one")
    if (torchrl or replay) and spread:
        raise ValueError(f"--{'torchrl' if torchrl else 'replay'} uses the store as a ring, whose calls need one slot: not with --spread")
    if torchrl:
        try:
            import torchrl as _  # noqa: F401
        except ImportError:
            raise ValueError("--torchrl needs torchrl: pip install --no-deps torchrl-nightly==2026.10.27 && pip install hoptorch") from None


def run_demo(
    url: str | None = None,
    actors: int = 4,
    count: int = 256,
    seconds: float = 5.0,
    batch: int = 32,
    *,
    prefix: str = DEFAULT_PREFIX,
    progress: bool = True,
    out: TextIO | None = None,
    seed: int = 0,
    cluster: bool = False,
    spread: bool = False,
    torchrl: bool = False,
    replay: bool = False,
) -> dict[str, Any]:
    """Run the concurrent write/sample demo and return its figures.

    Args:
        url: a ``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://`` URL;
            ``None`` starts a private embedded redis-server for the run (and stops it
            afterwards).
        cluster: with no ``url``, start a private three-primary Redis Cluster instead.
        spread: on a cluster, spread the store's segments over every node (``spread=True``,
            with segments of ``SPREAD_SEGMENT_BYTES`` so that a small demo store has many).
        actors: writer processes (spawned, each gets the pickled store).
        count: elements in the store.
        seconds: how long actors write and the learner samples.
        batch: elements per sampled batch.
        prefix: key namespace on the server; the store's keys are deleted at the end.
        progress: show live progress on stderr.
        out: where the human-readable summary goes (default stdout).
        seed: seed of the learner's sampling.
        torchrl: go through a torchrl replay buffer (``tdstore.torchrl``): actors
            ``extend`` it, the learner calls ``sample()``.
        replay: the same replay buffer on the store's own calls (no torchrl): actors
            ``extend(td, priority=...)``, the learner ``sample``s by priority and writes back
            ``update_priority``, under a rate limiter.

    Returns:
        The figures: ``writes``, ``writes_per_s``, ``reads`` (batches),
        ``reads_per_s``, ``elements_read``, ``elements_read_per_s``, ``torn``
        (torn elements seen while sampling), ``verified`` (final elements that are
        consistent and are the last write to their slot), ``ok`` and more.

    Raises:
        ServerUnreachable: ``url`` does not answer.
        DemoError: an actor failed or did not start.
    """
    _check_args(actors, count, seconds, batch, url=url, cluster=cluster, spread=spread, torchrl=torchrl, replay=replay)
    out = sys.stdout if out is None else out
    say = _Status(progress, sys.stderr)
    with contextlib.ExitStack() as stack:
        say(
            "starting an embedded Redis Cluster..."
            if url is None and cluster
            else "starting an embedded redis-server..."
            if url is None
            else f"connecting to {redact_url(url)}..."
        )
        if url is None and cluster:
            local = stack.enter_context(EmbeddedCluster())  # started here, stopped on exit whatever happens
            url = local.url
            where = f"embedded Redis Cluster of {len(local.ports)} primaries (redis-server {local.version}) at {url}"
        elif url is None:
            server = stack.enter_context(EmbeddedServer())  # a private redis-server on a unix socket
            url = server.url
            where = f"embedded redis-server {server.version} at {url}"
        else:
            where = f"redis {check_reachable(url)} at {redact_url(url)}"
        layout = {"spread": True, "segment_bytes": SPREAD_SEGMENT_BYTES} if spread else {}
        say(f"server: {where}; uploading {_plural(count, 'element')}...")
        rb = None
        if torchrl:
            from .torchrl import replay_buffer

            rb = replay_buffer(count, url=url, prefix=prefix, batch_size=batch, sampler="prioritized", alpha=0.6, beta=0.4)
            rb.extend(initial_stack(count))  # lap 0: the initial content, slot i holds element i
            uploaded = rb.storage._store
            # Reverb's SampleToInsertRatio on the server: the learner draws about SAMPLES_PER_INSERT
            # rows per row inserted; actors run at most two laps ahead of that, the learner never ahead
            uploaded.set_rate_limit(min_size=count, samples_per_insert=SAMPLES_PER_INSERT, error_buffer=SAMPLES_PER_INSERT * count)
            where += ", through a prioritized, rate-limited torchrl replay buffer (tdstore.torchrl)"
        elif replay:
            uploaded = LazyStackedTensorDictStore(count=count, url=url, prefix=prefix)
            uploaded.extend(initial_stack(count))  # lap 0: the initial content, slot i holds element i
            uploaded.enable_priorities(alpha=0.6)
            uploaded.set_rate_limit(min_size=count, samples_per_insert=SAMPLES_PER_INSERT, error_buffer=SAMPLES_PER_INSERT * count)
            rb = _RingLearner(uploaded, batch)
            where += ", as a prioritized, rate-limited replay buffer (extend, sample, update_priority)"
        else:
            uploaded = LazyStackedTensorDictStore.from_lazy_stack(initial_stack(count), url=url, prefix=prefix, **layout)
        if uploaded._engine.header.spread:
            where += f", the store spread in {uploaded._engine.header.segments.n} segments over its nodes"
        stack.callback(_quietly_clear, uploaded)
        # Attach a second handle through the constructor, as an application would: it
        # checks the layout and never overwrites the uploaded content.
        store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=count, inner_batch_size=(), td_id=uploaded.td_id)
        stack.callback(store.close)
        with _password_for_children(url):
            figures = _run(
                store,
                where=where,
                actors=actors,
                count=count,
                seconds=seconds,
                batch=batch,
                progress=progress,
                seed=seed,
                say=say,
                rb=rb,
                url=url,
                prefix=prefix,
                actor_main=_torchrl_actor_main if torchrl else _replay_actor_main,
            )
        figures["keys_deleted"] = store.clear_redis()
    _print_summary(figures, out)
    return figures


def _quietly_clear(store: LazyStackedTensorDictStore) -> None:
    """Cleanup on any exit path: delete the demo's keys if the server is still there."""
    with contextlib.suppress(Exception):
        store.clear_redis()
    with contextlib.suppress(Exception):
        store.close()


def _run(
    store: LazyStackedTensorDictStore,
    *,
    where: str,
    actors: int,
    count: int,
    seconds: float,
    batch: int,
    progress: bool,
    seed: int,
    say: Callable[[str], None] = lambda text: None,
    rb: Any = None,
    url: str = "",
    prefix: str = DEFAULT_PREFIX,
    actor_main: Callable[..., None] | None = None,
) -> dict[str, Any]:
    """Start the actors, sample as the learner, collect and verify; always stops the actors.

    With ``rb`` (a tdstore.torchrl replay buffer on ``store``, or a ``_RingLearner``), the
    actors (``actor_main``) attach to it by td_id and extend it, and the learner samples it
    with ``rb.sample()``.
    """
    placed = rb is None
    ctx = mp.get_context("spawn")
    start, stop = ctx.Event(), ctx.Event()
    results = ctx.Queue()
    counters = [ctx.RawValue("q", 0) for _ in range(actors)]
    procs = [
        ctx.Process(
            target=_actor_main if placed else (actor_main or _torchrl_actor_main),
            args=(store, a, seconds, start, stop, counters[a], results)
            if placed
            else (redact_url(url), prefix, store.td_id, a, seconds, start, stop, counters[a], results),
            name=f"tdstore-demo-actor-{a}",
            daemon=True,
        )
        for a in range(actors)
    ]
    bar: _Progress | None = None
    try:
        say(f"starting {actors} actor process{'es' if actors != 1 else ''} (each imports torch and connects: a few seconds)...")
        t_spawn = time.monotonic()
        _start_ignoring_sigint(procs)
        _await_ready(procs, results, say)
        say(f"{_plural(actors, 'actor')} ready after {time.monotonic() - t_spawn:.1f} s; writing and sampling for {seconds:g} s")
        bar = _Progress(seconds, progress, sys.stderr)
        gen = torch.Generator().manual_seed(seed)
        if rb is not None:
            rb.set_rng(gen)
        reads = torn = 0
        examples: list[str] = []
        start.set()
        t0 = time.monotonic()
        end = t0 + seconds
        next_tick = t0 + _TICK
        while (now := time.monotonic()) < end:
            if placed:
                idx = torch.randint(count, (batch,), generator=gen)
                sampled = store[idx]
            else:
                rb.sampler.timeout = max(0.0, end - now)  # the rate limiter may hold the learner: not past the run's end
                try:
                    sampled = rb.sample()  # one round trip: the server draws by priority and reads the rows
                except TimeoutError:
                    break
                idx = sampled["index"]
                # the learner's "TD error" (here: the token count) becomes the rows' priority, on the
                # server, only where an actor has not overwritten the slot since
                rb.update_tensordict_priority(sampled.set("td_error", torch.tensor([float(t.numel()) for t in _token_rows(sampled)])))
            reads += 1
            bad = check_batch(sampled, idx, count=count, actors=actors, placed=placed)
            torn += len(bad)
            for k, problems in bad.items():
                if len(examples) < MAX_EXAMPLES:
                    examples.append(f"batch {reads}, position {k}: " + "; ".join(problems))
            if now >= next_tick:
                next_tick = now + _TICK
                _raise_if_failed(procs, results)
                assert bar is not None
                bar.update(now - t0, sum(c.value for c in counters), reads, torn)
        read_time = time.monotonic() - t0
        if rb is not None:
            store.clear_rate_limit()  # actors held by the limiter go on, and see stop
        stop.set()
        done = _collect(procs, results)
        assert bar is not None
        bar.update(read_time, sum(d[0] for d in done.values()), reads, torn)
        # Verify while the actors exit (tearing down torch takes them a moment).
        final = _verify_final(store, done, count=count, actors=actors, placed=placed)
    finally:
        stop.set()
        start.set()  # release actors still waiting, so they can exit
        if bar is not None:
            bar.close()
        _reap(procs)
    writes = [done[a][0] for a in range(actors)]
    rates = [done[a][0] / done[a][1] if done[a][1] > 0 else 0.0 for a in range(actors)]
    return {
        "server": where,
        "actors": actors,
        "count": count,
        "batch": batch,
        "seconds": round(read_time, 3),
        "writes": sum(writes),
        "writes_per_actor": writes,
        "writes_per_s": round(sum(rates), 1),
        "reads": reads,
        "reads_per_s": round(reads / read_time, 1),
        "elements_read": reads * batch,
        "elements_read_per_s": round(reads * batch / read_time, 1),
        "torn": torn,
        "torn_examples": examples,
        **final,
        **({"samples_per_insert": round(reads * batch / max(1, sum(writes)), 2)} if rb is not None else {}),
        "ok": torn == 0 and final["verified"] == count,
    }


def _verify_final(
    store: LazyStackedTensorDictStore, done: dict[int, tuple[int, float, np.ndarray]], *, count: int, actors: int, placed: bool = True
) -> dict[str, Any]:
    """Read the whole store in one call and check every element, and that no write was lost.

    ``lost_writes`` also checks where each element sits: it must be the slot its
    writer recorded for that write (the hash's, or the one the ring gave it).
    """
    final = store.to_tensordict()
    bad = check_batch(final, np.arange(count), count=count, actors=actors, placed=placed)
    good = np.array([i for i in range(count) if i not in bad], dtype=np.int64)
    lost: dict[int, str] = {}
    if good.size:
        last_seq = np.stack([done[a][2] for a in range(actors)])
        lost = lost_writes(final[torch.from_numpy(good)], good, last_seq)
    examples = ["; ".join(p) for p in list(bad.values())[:MAX_EXAMPLES]] + list(lost.values())[:MAX_EXAMPLES]
    return {"verified": count - len(bad) - len(lost), "inconsistent": len(bad), "lost_writes": len(lost), "final_examples": examples}


def _start_ignoring_sigint(procs: list[Any]) -> None:
    """Start the actors with SIGINT ignored from birth.

    Ctrl-C goes to the whole process group; actors still importing torch would
    each print a KeyboardInterrupt traceback.  A spawned child inherits an
    ignored SIGINT through exec, and Python then leaves it ignored, so only the
    main process sees Ctrl-C and stops everyone through the ``stop`` event.
    """
    if threading.current_thread() is not threading.main_thread():
        for p in procs:
            p.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _await_ready(procs: list[Any], results: Any, say: Callable[[str], None] = lambda text: None) -> None:
    """Wait until every actor is connected, so spawn and import time do not eat the run; say each one."""
    waiting = set(range(len(procs)))
    deadline = time.monotonic() + ACTOR_START_TIMEOUT
    while waiting:
        msg = _next_message(results, procs, deadline, "to start")
        if msg[0] == "ready":
            waiting.discard(msg[1])
            say(f"  actor {msg[1]} connected ({len(procs) - len(waiting)}/{len(procs)})")


class _Status:
    """One line on the progress stream per step of the demo's start (nothing with ``progress=False``)."""

    def __init__(self, enabled: bool, stream: TextIO) -> None:
        self._enabled = enabled
        self._stream = stream

    def __call__(self, text: str) -> None:
        if self._enabled:
            print(f"tdstore demo: {text}", file=self._stream, flush=True)


def _collect(procs: list[Any], results: Any) -> dict[int, tuple[int, float, np.ndarray]]:
    """Each actor's (writes, seconds it wrote, last seq per slot), once they all stopped."""
    done: dict[int, tuple[int, float, np.ndarray]] = {}
    deadline = time.monotonic() + ACTOR_STOP_TIMEOUT
    while len(done) < len(procs):
        msg = _next_message(results, procs, deadline, "to finish")
        if msg[0] == "done":
            done[msg[1]] = (msg[2], msg[3], msg[4])
    return done


def _next_message(results: Any, procs: list[Any], deadline: float, what: str) -> tuple:
    """The next actor message; raises DemoError on an actor error, death or timeout."""
    import queue

    while True:
        try:
            msg = results.get(timeout=0.1)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise DemoError(f"actor process {dead[0].name} died with exit code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise DemoError(f"the actors took too long {what}") from None
            continue
        if msg[0] == "error":
            raise DemoError(f"actor {msg[1]} failed:\n{msg[2]}")
        return msg


def _raise_if_failed(procs: list[Any], results: Any) -> None:
    """Cheap mid-run check, so a crashed actor stops the demo instead of being noticed at the end."""
    import queue

    try:
        msg = results.get_nowait()
    except queue.Empty:
        pass
    else:
        if msg[0] == "error":
            raise DemoError(f"actor {msg[1]} failed:\n{msg[2]}")
        results.put(msg)  # an early "done" (an actor ended a tick early): keep it for _collect
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise DemoError(f"actor process {dead[0].name} died with exit code {dead[0].exitcode}")


def _reap(procs: list[Any]) -> None:
    """Join our actor processes; terminate (by handle) any that does not stop in time."""
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _print_summary(f: dict[str, Any], out: TextIO) -> None:
    """The human-readable result: throughput, torn count, final verification."""
    per_actor = ", ".join(str(w) for w in f["writes_per_actor"])
    lines = [
        f"tdstore demo on {f['server']}",
        f"  {_plural(f['actors'], 'actor')}, {_plural(f['count'], 'element')}, batches of {f['batch']}, {f['seconds']:.2f} s",
        f"  writes : {f['writes']} element writes, {f['writes_per_s']:.0f}/s in total (per actor: {per_actor})",
        f"  reads  : {f['reads']} batch reads, {f['reads_per_s']:.0f}/s; {f['elements_read']} elements, {f['elements_read_per_s']:.0f}/s",
        f"  torn   : {f['torn']} torn elements seen while sampling",
        *(
            [
                f"  ratio  : {f['samples_per_insert']:g} rows sampled per row written (the server's rate limiter: {SAMPLES_PER_INSERT:g}, writers at most {2 * f['count']} rows ahead)"
            ]
            if "samples_per_insert" in f
            else []
        ),
        f"  final  : {f['verified']}/{f['count']} elements verified ({f['inconsistent']} inconsistent, {f['lost_writes']} lost writes)",
        f"  cleanup: {f['keys_deleted']} keys deleted",
    ]
    lines += [f"  torn example: {e}" for e in f["torn_examples"]]
    lines += [f"  final example: {e}" for e in f["final_examples"]]
    lines.append("  OK: no torn or inconsistent element" if f["ok"] else "  FAILED: torn or inconsistent elements (see above)")
    print("\n".join(lines), file=out, flush=True)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
