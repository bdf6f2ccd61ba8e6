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
:func:`run_demo`.  This module sets a run up and tears it down; the parts are
:mod:`tdstore.demo.torn_check` (the encoding and the checks), :mod:`tdstore.demo.actors`
(the writer processes), :mod:`tdstore.demo.learner` (sampling and the final check),
:mod:`tdstore.demo.server_url` (the ``url`` and its password) and :mod:`tdstore.demo.report`
(what a person sees).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch

from tdstore import ShardedRing
from tdstore.cluster_server import EmbeddedCluster
from tdstore.demo.actors import ActorPool, DemoError, hash_actor_main, replay_actor_main, torchrl_actor_main
from tdstore.demo.learner import RingLearner, figures, sample_until, verify_final
from tdstore.demo.llm import run_llm_demo
from tdstore.demo.report import Progress, Status, plural, print_summary
from tdstore.demo.server_url import ServerUnreachable, check_reachable, password_for_children, redact_url
from tdstore.demo.torn_check import check_batch, check_value, initial_stack, lost_writes, make_element, obs_value, slot_of, token_length
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.server import EmbeddedServer

__all__ = [
    "DemoError",
    "ServerUnreachable",
    "check_batch",
    "check_reachable",
    "check_value",
    "initial_stack",
    "lost_writes",
    "make_element",
    "obs_value",
    "redact_url",
    "run_demo",
    "run_llm_demo",
    "slot_of",
    "token_length",
]

DEFAULT_PREFIX = "tdstore-demo"
#: Segment size of the demo's spread store (``spread="segments"``): a few elements per segment, so that a
#: store of a few hundred elements has its segments on every node of the cluster.
SPREAD_SEGMENT_BYTES = 2048
#: The replay demos' rate limiter: the learner's samples per row the actors insert (Reverb's ratio).
SAMPLES_PER_INSERT = 4.0


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
    sharded: bool = False,
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
    if sharded and not cluster and not (url or "").lower().startswith(("redis+cluster://", "rediss+cluster://")):
        raise ValueError(
            "--sharded makes a sharded ring over a Redis Cluster's primaries: add --cluster (an embedded cluster), or give --url redis+cluster://HOST:PORT"
        )
    if sharded and not replay:
        raise ValueError("--sharded runs the replay demo on a sharded ring (tdstore.ShardedRing): add --replay")
    if torchrl and replay:
        raise ValueError("--torchrl and --replay are two ways to run the replay demo: pick one")
    if torchrl and spread:
        raise ValueError("--torchrl with --spread is not offered by the demo: --replay --spread runs it on a sharded ring")
    if torchrl:
        try:
            import tdstore.torchrl  # noqa: F401  (torchrl, and everything torchrl imports)
        except ImportError as err:
            raise ValueError(torchrl_missing(err)) from None


TORCHRL_INSTALL = 'pip install "torch==2.13.0" ".[torchrl]" && pip install --no-deps torchrl-nightly==2026.10.27'


def torchrl_missing(err: ImportError) -> str:
    """What to install when ``import tdstore.torchrl`` failed: the module actually missing, then the README's line."""
    missing = err.name or str(err)
    if missing.split(".")[0] == "torchrl":
        return f"--torchrl needs torchrl, which is not installed: {TORCHRL_INSTALL}"
    return f"--torchrl needs torchrl, which cannot be imported: the module {missing!r} is missing ({TORCHRL_INSTALL} installs it)"


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
    sharded: bool = False,
) -> dict[str, Any]:
    """Run the concurrent write/sample demo and return its figures.

    Args:
        url: a ``redis://``, ``rediss://``, ``unix://`` or ``redis+cluster://`` URL;
            ``None`` starts a private embedded redis-server for the run (and stops it
            afterwards).
        cluster: with no ``url``, start a private three-primary Redis Cluster instead.
        spread: on a cluster, spread the store's segments over every node (``spread="segments"``,
            with segments of ``SPREAD_SEGMENT_BYTES`` so that a small demo store has many); with
            ``replay``, the same as ``sharded`` (what it always meant there).
        sharded: with ``replay``, on a cluster: the buffer is a ``tdstore.ShardedRing`` (one ring per primary).
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
    _check_args(actors, count, seconds, batch, url=url, cluster=cluster, spread=spread, torchrl=torchrl, replay=replay, sharded=sharded)
    sharded = sharded or (spread and replay)
    spread = spread and not sharded
    out = sys.stdout if out is None else out
    say = Status(progress, sys.stderr)
    with contextlib.ExitStack() as stack:
        url, where = _open_server(stack, url, cluster=cluster, say=say)
        say(f"server: {where}; uploading {plural(count, 'element')}...")
        uploaded, rb, where = _upload(
            url, where, count=count, batch=batch, prefix=prefix, spread=spread, torchrl=torchrl, replay=replay, sharded=sharded
        )
        stack.callback(_quietly_clear, uploaded)
        # Attach a second handle through the constructor, as an application would: it
        # checks the layout and never overwrites the uploaded content.
        store: Any = (ShardedRing if sharded else LazyStackedTensorDictStore)(
            url=url, prefix=prefix, count=count, inner_batch_size=(), td_id=uploaded.td_id
        )
        stack.callback(store.close)
        if rb is None:
            pool = ActorPool(hash_actor_main, (store,), actors, seconds)
        else:
            actor_main = torchrl_actor_main if torchrl else replay_actor_main
            pool = ActorPool(actor_main, (redact_url(url), prefix, store.td_id), actors, seconds)
        with password_for_children(url):
            result = _run(store, pool, rb, where=where, count=count, seconds=seconds, batch=batch, progress=progress, seed=seed, say=say)
        result["keys_deleted"] = store.clear_redis()
    print_summary(result, out, SAMPLES_PER_INSERT)
    return result


def _open_server(stack: contextlib.ExitStack, url: str | None, *, cluster: bool, say: Callable[[str], None]) -> tuple[str, str]:
    """The URL of the server the demo runs on and its description: ``url`` checked, else an embedded
    server (or cluster) started on ``stack``, so that it stops on exit whatever happens."""
    say(
        "starting an embedded Redis Cluster..."
        if url is None and cluster
        else "starting an embedded redis-server..."
        if url is None
        else f"connecting to {redact_url(url)}..."
    )
    if url is None and cluster:
        local = stack.enter_context(EmbeddedCluster())
        return local.url, f"embedded Redis Cluster of {len(local.ports)} primaries (redis-server {local.version}) at {local.url}"
    if url is None:
        server = stack.enter_context(EmbeddedServer())  # a private redis-server on a unix socket
        return server.url, f"embedded redis-server {server.version} at {server.url}"
    return url, f"redis {check_reachable(url)} at {redact_url(url)}"


def _upload(
    url: str, where: str, *, count: int, batch: int, prefix: str, spread: bool, torchrl: bool, replay: bool, sharded: bool
) -> tuple[Any, Any, str]:
    """Upload the initial content; return the store, the replay buffer the learner samples (``None``
    when it samples the store directly), and ``where`` completed with how the store is used."""
    rb: Any = None
    uploaded: Any
    if torchrl:
        from tdstore.torchrl import replay_buffer

        rb = replay_buffer(  # ragged: the demo's elements carry token sequences of varying length
            count, url=url, prefix=prefix, batch_size=batch, sampler="prioritized", alpha=0.6, beta=0.4, ragged=True
        )
        rb.extend(initial_stack(count))  # lap 0: the initial content, slot i holds element i
        uploaded = rb.storage.with_store(lambda ring: ring)  # the ring store under the buffer
        # Reverb's SampleToInsertRatio on the server: the learner draws about SAMPLES_PER_INSERT
        # rows per row inserted; actors run at most two laps ahead of that, the learner never ahead
        uploaded.set_rate_limit(min_size=count, samples_per_insert=SAMPLES_PER_INSERT, error_buffer=SAMPLES_PER_INSERT * count)
        where += ", through a prioritized, rate-limited torchrl replay buffer (tdstore.torchrl)"
    elif replay:
        uploaded = (ShardedRing if sharded else LazyStackedTensorDictStore)(count=count, url=url, prefix=prefix)
        initial = initial_stack(count)
        if isinstance(uploaded, ShardedRing):  # a sharded ring (one ring per primary): each shard gets its slots' initial elements
            for shard, off, n in zip(uploaded.shards, uploaded.shard_offsets, uploaded.shard_counts):
                shard.extend(initial[off : off + n])
            where += f", sharded over {len(uploaded.shards)} primaries"
        else:
            uploaded.extend(initial)  # lap 0: the initial content, slot i holds element i
        uploaded.enable_priorities(alpha=0.6)
        uploaded.set_rate_limit(min_size=count, samples_per_insert=SAMPLES_PER_INSERT, error_buffer=SAMPLES_PER_INSERT * count)
        rb = RingLearner(uploaded, batch)
        where += ", as a prioritized, rate-limited replay buffer (extend, sample, update_priority)"
    else:
        segment_bytes = SPREAD_SEGMENT_BYTES if spread else None
        uploaded = LazyStackedTensorDictStore.from_lazy_stack(
            initial_stack(count), url=url, prefix=prefix, spread="segments" if spread else False, segment_bytes=segment_bytes
        )
        header = uploaded.stack_ops.engine.header
        if header.spread:
            where += f", the store spread in {header.segments.n} segments over its nodes"
    return uploaded, rb, where


def _quietly_clear(store: LazyStackedTensorDictStore) -> None:
    """Cleanup on any exit path: delete the demo's keys if the server is still there."""
    with contextlib.suppress(Exception):
        store.clear_redis()
    with contextlib.suppress(Exception):
        store.close()


def _run(
    store: LazyStackedTensorDictStore,
    pool: ActorPool,
    rb: Any,
    *,
    where: str,
    count: int,
    seconds: float,
    batch: int,
    progress: bool,
    seed: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Start the actors, sample as the learner, collect and verify; always stops the actors.

    With ``rb`` (a tdstore.torchrl replay buffer on ``store``, or a ``RingLearner``), the
    actors attach to the store by td_id and extend it, and the learner samples it with
    ``rb.sample()``.
    """
    actors = len(pool.procs)
    bar: Progress | None = None
    try:
        say(f"starting {actors} actor process{'es' if actors != 1 else ''} (each imports torch and connects: a few seconds)...")
        t_spawn = time.monotonic()
        pool.launch(say)
        say(f"{plural(actors, 'actor')} ready after {time.monotonic() - t_spawn:.1f} s; writing and sampling for {seconds:g} s")
        bar = Progress(seconds, progress, sys.stderr)
        gen = torch.Generator().manual_seed(seed)
        if rb is not None:
            rb.set_rng(gen)
        tally = sample_until(store, rb, pool, bar, gen, seconds=seconds, count=count, actors=actors, batch=batch)
        if rb is not None:
            store.clear_rate_limit()  # actors held by the limiter go on, and see stop
        done = pool.finish()
        bar.update(tally.seconds, sum(d[0] for d in done.values()), tally.reads, tally.torn)
        # Verify while the actors exit (tearing down torch takes them a moment).
        final = verify_final(store, done, count=count, actors=actors, placed=rb is None)
    finally:
        pool.release()
        if bar is not None:
            bar.close()
        pool.reap()
    return figures(tally, done, final, where=where, count=count, batch=batch, ring=rb is not None)
