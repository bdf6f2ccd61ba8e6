"""The demo's actor processes: what each one runs, and the pool the learner starts, watches and stops.

Each actor is a spawned process that writes elements encoded by :mod:`tdstore.demo.torn_check`
until told to stop, then reports the last sequence number it wrote to each slot.  The
learner talks to the actors through two events (``start``, ``stop``), a result queue and one
shared write counter per actor, all held by :class:`ActorPool`.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from tensordict import lazy_stack

from tdstore import ShardedRing, ShardedRingIdError
from tdstore.demo.torn_check import make_element, slot_of
from tdstore.lazy import LazyStackedTensorDictStore

__all__ = [
    "ACTOR_START_TIMEOUT",
    "ACTOR_STOP_TIMEOUT",
    "ActorPool",
    "DemoError",
    "hash_actor_main",
    "replay_actor_main",
    "torchrl_actor_main",
]

#: Seconds a spawned actor may take to import torch and connect before the demo gives up.
ACTOR_START_TIMEOUT = 120.0
#: Seconds an actor may take to report after the run ends (one write is milliseconds).
ACTOR_STOP_TIMEOUT = 30.0

#: Seconds between an actor's looks at ``stop`` while it waits for the start (an aborted run).
START_POLL = 0.1

#: Each actor's report once it stopped: (writes, seconds it wrote, last seq written to each slot).
ActorReport = tuple[int, float, np.ndarray]


class DemoError(RuntimeError):
    """The demo could not run (an actor failed, or the server went away)."""


# -- what an actor process runs ----------------------------------------------------------------


def hash_actor_main(
    store: LazyStackedTensorDictStore,
    actor: int,
    seconds: float,
    start: Any,
    stop: Any,
    counter: Any,
    results: Any,
) -> None:
    """One actor process: overwrite elements for ``seconds``, then report what it wrote where.

    It ignores SIGINT (see :meth:`ActorPool.launch`): Ctrl-C reaches only
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
    clock; reports ready, then done with the last sequence number written to each slot.

    Once released by ``start``, an actor writes at least once, however late its process wakes (on
    a busy machine that can be after the learner set ``stop``): a run's figures always show each
    actor's writes. ``stop`` before ``start`` (the run was aborted) ends it without a write.
    """
    last_seq = np.full(count, -1, dtype=np.int64)
    results.put(("ready", actor))
    while not start.wait(START_POLL):  # returns at once on ``go``
        if stop.is_set() and not start.is_set():
            results.put(("done", actor, 0, 0.0, last_seq))
            return
    t0 = time.monotonic()
    end = t0 + seconds
    seq = 0
    while True:
        last_seq[write(seq)] = seq
        seq += 1
        counter.value = seq
        if stop.is_set() or time.monotonic() >= end:
            break
    results.put(("done", actor, seq, time.monotonic() - t0, last_seq))


def replay_actor_main(
    url: str, prefix: str, td_id: str, actor: int, seconds: float, start: Any, stop: Any, counter: Any, results: Any
) -> None:
    """One actor of the replay demo: attach to the ring by ``td_id`` and ``extend`` it with a priority.

    As in the torchrl demo, the server picks each write's slot and the actor records it. The
    rate limiter may hold an ``extend`` until the learner has sampled enough.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        try:
            store: Any = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
        except ShardedRingIdError:  # the demo's buffer is a sharded ring (--sharded)
            store = ShardedRing.from_store(url=url, prefix=prefix, td_id=td_id)

        def write(seq: int) -> int:
            return int(store.extend(lazy_stack([make_element(actor, seq)]), priority=1.0 + seq % 3).indices[0])

        _write_until_stopped(write, len(store), actor, seconds, start, stop, counter, results)
    except BaseException:
        results.put(("error", actor, traceback.format_exc()))


def torchrl_actor_main(
    url: str, prefix: str, td_id: str, actor: int, seconds: float, start: Any, stop: Any, counter: Any, results: Any
) -> None:
    """One actor of the torchrl demo: attach to the replay buffer by ``td_id`` and extend it.

    The server picks the slot of each write (its ring cursor); the actor records the
    slot each of its writes got, for the final check.  The URL has no password (the
    actor gets it from the environment, as in :func:`tdstore.demo.server_url.password_for_children`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from tdstore.torchrl import attach

        rb = attach(td_id, url=url, prefix=prefix)
        _write_until_stopped(
            lambda seq: int(rb.extend(lazy_stack([make_element(actor, seq)]))[0]), len(rb), actor, seconds, start, stop, counter, results
        )
    except BaseException:
        results.put(("error", actor, traceback.format_exc()))


# -- the pool the learner runs -------------------------------------------------------------------


class ActorPool:
    """The actor processes of one run, and what they share with the learner.

    ``target`` is one of the ``*_actor_main`` functions and ``head`` its arguments before the
    actor's id: the pickled store for :func:`hash_actor_main`, ``(url, prefix, td_id)`` for
    the others.  The processes are spawned (a fresh interpreter each, as on every platform).
    """

    def __init__(self, target: Callable[..., None], head: tuple[Any, ...], actors: int, seconds: float) -> None:
        ctx = mp.get_context("spawn")
        self._start, self._stop = ctx.Event(), ctx.Event()
        self._results = ctx.Queue()
        self._counters = [ctx.RawValue("q", 0) for _ in range(actors)]
        self.procs = [
            ctx.Process(
                target=target,
                args=(*head, a, seconds, self._start, self._stop, self._counters[a], self._results),
                name=f"tdstore-demo-actor-{a}",
                daemon=True,
            )
            for a in range(actors)
        ]

    def launch(self, say: Callable[[str], None] = lambda text: None) -> None:
        """Start the actors and wait until every one is connected, so spawn and import time do not eat the run."""
        self._start_ignoring_sigint()
        self._await_ready(say)

    def go(self) -> None:
        """Release the actors: their clock starts now."""
        self._start.set()

    def writes(self) -> int:
        """Element writes so far, from the shared counters (for live progress)."""
        return sum(c.value for c in self._counters)

    def finish(self) -> dict[int, ActorReport]:
        """Tell the actors to stop and return each one's report."""
        self._stop.set()
        return self._collect()

    def release(self) -> None:
        """On any exit path: tell the actors to stop; those still waiting for the start see it and exit without a write."""
        self._stop.set()

    def _start_ignoring_sigint(self) -> None:
        """Start the actors with SIGINT ignored from birth.

        Ctrl-C goes to the whole process group; actors still importing torch would
        each print a KeyboardInterrupt traceback.  A spawned child inherits an
        ignored SIGINT through exec, and Python then leaves it ignored, so only the
        main process sees Ctrl-C and stops everyone through the ``stop`` event.
        """
        if threading.current_thread() is not threading.main_thread():
            for p in self.procs:
                p.start()
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for p in self.procs:
                p.start()
        finally:
            signal.signal(signal.SIGINT, previous)

    def _await_ready(self, say: Callable[[str], None]) -> None:
        """Wait for every actor's "ready"; say each one."""
        procs = self.procs
        waiting = set(range(len(procs)))
        deadline = time.monotonic() + ACTOR_START_TIMEOUT
        while waiting:
            msg = self._next_message(deadline, "to start")
            if msg[0] == "ready":
                waiting.discard(msg[1])
                say(f"  actor {msg[1]} connected ({len(procs) - len(waiting)}/{len(procs)})")

    def _collect(self) -> dict[int, ActorReport]:
        """Each actor's (writes, seconds it wrote, last seq per slot), once they all stopped."""
        done: dict[int, ActorReport] = {}
        deadline = time.monotonic() + ACTOR_STOP_TIMEOUT
        while len(done) < len(self.procs):
            msg = self._next_message(deadline, "to finish")
            if msg[0] == "done":
                done[msg[1]] = (msg[2], msg[3], msg[4])
        return done

    def _next_message(self, deadline: float, what: str) -> tuple[Any, ...]:
        """The next actor message; raises DemoError on an actor error, death or timeout."""
        while True:
            try:
                msg: tuple[Any, ...] = self._results.get(timeout=0.1)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise DemoError(f"actor process {dead[0].name} died with exit code {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise DemoError(f"the actors took too long {what}") from None
                continue
            if msg[0] == "error":
                raise DemoError(f"actor {msg[1]} failed:\n{msg[2]}")
            return msg

    def raise_if_failed(self) -> None:
        """Cheap mid-run check, so a crashed actor stops the demo instead of being noticed at the end."""
        try:
            msg = self._results.get_nowait()
        except queue.Empty:
            pass
        else:
            if msg[0] == "error":
                raise DemoError(f"actor {msg[1]} failed:\n{msg[2]}")
            self._results.put(msg)  # an early "done" (an actor ended a tick early): keep it for _collect
        dead = [p for p in self.procs if p.exitcode not in (None, 0)]
        if dead:
            raise DemoError(f"actor process {dead[0].name} died with exit code {dead[0].exitcode}")

    def reap(self) -> None:
        """Join our actor processes; terminate (by handle) any that does not stop in time."""
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
