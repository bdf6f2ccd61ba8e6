"""A ring's sampling policy on the server: priorities, rate limiter, queue; one script call each.

The policy (``_format.sampling_policy.SamplingPolicy``) is set by ``lua/sampling.lua`` and enforced by
the scripts every actor and learner calls, so it holds across processes and machines:

* **priorities**: a sum tree of the slots' weights (priority ** alpha) in one key beside
  the store (``lua/_tree.lua``), updated by the same atomic call that writes a slot
  (``extend(td, priority=...)``) or by ``update_priority``; a prioritized ``sample`` walks
  it on the server, O(log capacity) per row, and returns each row's probability, from
  which the importance weights follow;
* **max_times_sampled**: a slot drawn that many times weighs 0 until it is written again;
* **rate limiter** (Reverb's ``SampleToInsertRatio`` and ``MinSize``): samples and inserts
  counted in the header; a call the limiter holds back waits (``_ring.waiting``);
* **queue**: ``pop`` hands each written item to exactly one reader, in write order, with
  a read cursor in the header; in queue mode writers wait instead of overwriting
  unread items, otherwise an overwrite is reported (``QueueOverrunError``).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from tdstore._engine import deadline, scripts
from tdstore._engine.engine import Engine, request_id
from tdstore._errors import MustWait
from tdstore._format import codec, wire
from tdstore._format.sampling_policy import UNBOUNDED, WEIGHT_SUM, RateLimit, SamplingPolicy, format_priorities, tree_bytes
from tdstore._format.schema import Header
from tdstore._plan.call import Call
from tdstore._plan.index import positions
from tdstore._ring import waiting
from tdstore._ring.args import generations_arg, refuse_spread


class PrioritizedSample(NamedTuple):
    """A batch drawn by priority: the data, each row's slot and generation, its importance weight
    ``(P(i) / min_j P(j)) ** -beta`` (float32, at most 1) and its sampling probability ``P(i)``."""

    td: TensorDictBase
    indices: torch.Tensor
    generations: torch.Tensor
    weights: torch.Tensor
    probabilities: torch.Tensor


PrioritizedSample.__module__ = "tdstore.ring_interface"  # its public home: pickles name it there


def policy_of(engine: Engine, fresh: bool = False) -> SamplingPolicy:
    """The store's policy (empty when it has none); ``fresh`` reads the header again first."""
    if fresh:
        engine.set_header(engine.fetch_header())
    return engine.header.sampling or SamplingPolicy()


def _change(engine: Engine, build: Any, needs: str) -> None:
    """Set the policy ``build(current policy)`` returns, in one call checked against the header it was built from."""
    engine.refuse_if_readonly()
    refuse_spread(engine)
    keys = engine.keys
    request = request_id()  # one per change, sent with every try: a resend (same id) is not applied again

    def plan_call(h: Header) -> Call:
        deadline.arm()  # sent next: from now on the change may have been made
        new = build(h.sampling or SamplingPolicy())
        text = new.to_json() if new != SamplingPolicy() else ""
        # the reply carries the header as the change left it: adopted at once, no second round trip
        return Call(
            "sampling",
            [keys.meta, *keys.sampling_keys, keys.replies],
            [f"{h.epoch}:V{h.version}", text, needs, keys.events, request],
            engine.adopt_stale,
        )

    with deadline.resolvable(request, None):  # a timeout says whether the change may have been made
        engine.run(plan_call)


#: Bytes of tree one step of ``lua/tree_build.lua`` writes at most (3 to 30 ms of server time here, busy or idle).
BUILD_STEP_BYTES = 1 << 19

#: A build nobody resumes expires this long after its last step (``lua/tree_build.lua``).
BUILD_LEASE_MS = 60_000

#: Above this many bytes, the tree's (and counts') zeros are sent by the client as plain ``SET``s to
#: staging keys, which the server reads in pieces between other clients' commands, instead of being
#: zero-filled by the script (~0.4 ms per MB of page faults: 37 ms for a ring of 10^7 slots, idle).
BUILD_STAGE_BYTES = 4 << 20


def enable_priorities(engine: Engine, alpha: float, max_times_sampled: int | None) -> None:
    """Turn priorities on (see ``LazyStackedTensorDictStore.enable_priorities``).

    The tree is built in steps of bounded server work, one call each (``lua/tree_build.lua``), so a
    ring of 10^7 slots never blocks other clients for long; meanwhile the ring works as without
    priorities, and the last step switches them on atomically. A builder that dies is resumed by
    the next call with the same parameters.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    if max_times_sampled is not None and (
        isinstance(max_times_sampled, bool) or not isinstance(max_times_sampled, int) or max_times_sampled < 1
    ):
        raise ValueError(f"max_times_sampled must be None or an int >= 1, got {max_times_sampled!r}")
    engine.refuse_if_readonly()
    refuse_spread(engine)
    if not policy_of(engine).prioritized:
        token = secrets.token_hex(8)
        while not build_step(engine, alpha, max_times_sampled, token):
            pass
    have = policy_of(engine)
    if (have.alpha, have.max_times) != (float(alpha), max_times_sampled):
        raise ValueError(
            f"the store with {engine.where()} has priorities with alpha={have.alpha:g} and max_times_sampled={have.max_times}; "
            f"a store keeps the ones it was given (asked for alpha={alpha:g}, max_times_sampled={max_times_sampled})"
        )


def no_priorities(engine: Engine) -> ValueError:
    """The error of a prioritized call on a store without priorities: it says when they are being
    built (another client's ``enable_priorities`` is under way: they are on when it returns)."""
    if engine.command("EXISTS", engine.keys.build_keys[2]):
        return ValueError(
            f"the store with {engine.where()} has no priorities yet: they are being built (another client's "
            "enable_priorities is under way; the ring samples uniformly until it returns)"
        )
    return ValueError(f"the store with {engine.where()} has no priorities: call enable_priorities(alpha=...) first")


def build_step(engine: Engine, alpha: float, max_times_sampled: int | None, token: str) -> bool:
    """One step of the tree's build (``lua/tree_build.lua``): True once the priorities are on (the
    reply then carries the header, adopted at once), False after a step of bounded work. ``token``
    names the builder's staging keys (the same for all its steps)."""
    h = engine.header
    size = tree_bytes(h.count)
    limit = min(engine.limits.value_bytes, engine.limits.query_bytes // 2)
    if size > limit:
        raise ValueError(
            f"the store with {engine.where()} has {h.count} slots: their priority tree ({size} bytes) would be larger than "
            f"one value the server takes ({limit} bytes: proto-max-bulk-len, half of client-query-buffer-limit)"
        )
    engine.check_room(h, 0, declared=size + (4 * h.count if max_times_sampled else 0))
    keys = engine.keys
    staged = [keys.staging(keys.build_keys[0], token), keys.staging(keys.build_keys[1], token)]
    mt = str(max_times_sampled) if max_times_sampled else "-"
    args = [f"{float(alpha)!r}", mt, keys.events, BUILD_STEP_BYTES, BUILD_LEASE_MS, BUILD_STAGE_BYTES]

    def plan_call(h: Header) -> Call:
        new = replace(h.sampling or SamplingPolicy(), alpha=float(alpha), max_times=max_times_sampled)
        script_keys = [keys.meta, *keys.sampling_keys, *keys.build_keys, *staged]
        return Call("tree_build", script_keys, [f"{h.epoch}:V{h.version}", new.to_json(), *args], done)

    def done(reply: list) -> bool:
        if reply[1] == b"STAGE":
            # the zeros travel as plain SETs: the server reads them between other clients' commands
            for key, n in zip(staged, (int(reply[2]), int(reply[3])), strict=True):
                if n:
                    _stage_zeros(engine, key, n)
            return False
        if reply[1] != b"ON":
            return False  # 'MORE': a step was made
        engine.adopt_stale(reply[1:])
        return True

    return engine.run(plan_call)


def _stage_zeros(engine: Engine, key: str, n: int) -> None:
    """``SET key <n zero bytes> PX lease`` as a plain command. The zeros are sent as they are, never
    packed into one buffer (redis-py's packer copies 90 MB in ~0.5 s holding the GIL, stalling
    the caller's other threads), from a page-less ``bytes(n)``; the server reads them in pieces."""
    client: Any = engine.client
    if engine.spec.cluster:
        client = client.get_node_from_key(key).redis_connection
    if type(client).__module__.startswith("fakeredis") or not hasattr(client, "connection_pool"):
        client.execute_command("SET", key, bytes(n), "PX", BUILD_LEASE_MS)
        return
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        head = b"*5\r\n" + wire.pack("SET", key)[4:] + b"$%d\r\n" % n
        conn.send_packed_command([head, bytes(n), b"\r\n" + wire.pack("PX", BUILD_LEASE_MS)[4:]], check_health=False)
        conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def set_rate_limit(engine: Engine, min_size: int, samples_per_insert: float | None, error_buffer: float | None) -> None:
    """Set the rate limiter (see ``LazyStackedTensorDictStore.set_rate_limit``)."""
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
    count = engine.header.count
    if min_size > count:
        raise ValueError(f"min_size={min_size} can never be reached by a ring of {count} slots")
    if samples_per_insert is None:
        if error_buffer is not None:
            raise ValueError("error_buffer needs samples_per_insert")
        limit = RateLimit(1.0, min_size, -UNBOUNDED, UNBOUNDED)
    else:
        if (
            isinstance(samples_per_insert, bool)
            or not isinstance(samples_per_insert, (int, float))
            or not math.isfinite(samples_per_insert)
            or samples_per_insert <= 0
        ):
            raise ValueError(f"samples_per_insert must be a finite number > 0, got {samples_per_insert!r}")
        if error_buffer is None:
            raise ValueError("samples_per_insert needs error_buffer (how far samples may run ahead of or behind the ratio)")
        if (
            isinstance(error_buffer, bool)
            or not isinstance(error_buffer, (int, float))
            or not math.isfinite(error_buffer)
            or error_buffer < max(1.0, samples_per_insert)
        ):
            # Reverb's rule: below max(1, samples_per_insert) some insert or sample could never go through
            raise ValueError(
                f"error_buffer must be at least max(1, samples_per_insert) = {max(1.0, samples_per_insert):g}, got {error_buffer!r}"
            )
        offset = samples_per_insert * min_size
        limit = RateLimit(float(samples_per_insert), min_size, offset - error_buffer, offset + error_buffer)
    _change(engine, lambda p: replace(p, limit=limit), "limit")


def restore_policy(engine: Engine, policy: SamplingPolicy) -> None:
    """Give the ring ``policy`` exactly as another store held it (torchrl's ``empty()`` makes the store
    again, and the buffer keeps its priorities, limiter and queue): priorities built as
    ``enable_priorities`` builds them, then the limiter (its counts start now) and the queue in one call."""
    if policy.alpha is not None:
        enable_priorities(engine, policy.alpha, policy.max_times)
    if policy.limit is not None or policy.queue:
        needs = " ".join(word for word, on in (("limit", policy.limit is not None), ("queue", policy.queue)) if on)
        _change(engine, lambda p: replace(p, limit=policy.limit, queue=policy.queue), needs)


def clear_rate_limit(engine: Engine) -> None:
    _change(engine, lambda p: replace(p, limit=None), "")


def set_queue(engine: Engine, on: bool) -> None:
    if not isinstance(on, bool):
        raise TypeError(f"set_queue takes True or False, got {on!r}")
    _change(engine, lambda p: replace(p, queue=on), "queue" if on else "")


def track_distinct(engine: Engine, on: bool) -> None:
    """Turn the ring's distinct-row tracking on or off (``lua/distinct.lua``: header field ``sd``, see
    ``tdstore.Ring.track_distinct``); the reply's header is adopted, no second round trip."""
    if not isinstance(on, bool):
        raise TypeError(f"track_distinct takes True or False, got {on!r}")
    engine.refuse_if_readonly()
    refuse_spread(engine)
    keys = engine.keys

    def plan_call(h: Header) -> Call:
        return Call("distinct", [keys.meta, keys.stats, keys.sampled_rows], [f"{h.epoch}:*", "1" if on else "0"], engine.adopt_stale)

    engine.run(plan_call)


def priority_tensor(priority: Any, what: str = "priority") -> torch.Tensor:
    """``priority`` (a number, a sequence, an array or a tensor) as a float64 tensor on the CPU, its dtype
    checked before any cast: integers and every float dtype are numbers, but a complex value would lose its
    imaginary part and a bool is no priority (``TypeError`` naming the dtype)."""
    if isinstance(priority, torch.Tensor):
        kind, dtype = ("c" if priority.is_complex() else "b" if priority.dtype == torch.bool else "f"), priority.dtype
    else:  # numpy keeps a Python float's 64 bits (torch would make it float32: 1e200 would turn inf)
        priority = np.asarray(priority)
        kind, dtype = priority.dtype.kind, priority.dtype
    if kind in "cb":
        raise TypeError(f"{what} must be real numbers (an integer or floating dtype), got {dtype}")
    return torch.as_tensor(priority).detach().to("cpu", torch.float64)


def priority_values(priority: Any, n: int, what: str = "priority", *, policy: SamplingPolicy | None = None, slots: int = 0) -> list[float]:
    """``priority`` (a number, or one per row) as n floats, each finite and >= 0 (``ValueError`` otherwise).

    Under ``policy`` (priorities on) a tree of ``slots`` slots is given no priority whose weight
    ``priority ** alpha`` could make the sum of every weight overflow float64: a sum of ``inf``
    would draw one slot with probability 0 and give NaN weights (see :func:`max_priority`)."""
    t = priority_tensor(priority, what)
    if t.ndim == 0:
        t = t.expand(n)
    t = t.reshape(-1)
    if t.numel() != n:
        raise ValueError(f"got {t.numel()} {what} values for {n} rows")
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise ValueError(f"{what} of row {k} is {t[k].item()!r}: priorities are finite numbers >= 0")
    if policy is not None and policy.alpha is not None:
        top = max_priority(policy.alpha, slots)
        over = t > top
        if bool(over.any()):
            k = int(over.nonzero()[0])
            raise ValueError(
                f"{what} of row {k} is {t[k].item()!r}: with alpha={policy.alpha:g} and {slots} slots the sum of the weights "
                f"(priority ** alpha) could overflow float64; the largest allowed priority is {top:.6g}"
            )
    return t.tolist()


def max_priority(alpha: float, slots: int) -> float:
    """The largest priority a tree of ``slots`` slots takes under ``alpha``: its weight times the slots
    stays within ``WEIGHT_SUM`` (``tds_max_priority`` in ``lua/_tree.lua``, which refuses the rest)."""
    if alpha <= 0:
        return UNBOUNDED
    try:
        return min(UNBOUNDED, (WEIGHT_SUM / max(slots, 1)) ** (1 / alpha) * (1 - 1e-12))
    except OverflowError:
        return UNBOUNDED


def update_priority(engine: Engine, index: Any, priority: Any, generation: Any | None) -> torch.Tensor:
    """Set the priorities of slots ``index`` (see ``LazyStackedTensorDictStore.update_priority``)."""
    engine.refuse_if_readonly()
    refuse_spread(engine)
    count = engine.header.count
    slots, _ = positions(index, count)
    n = int(slots.numel())
    values = priority_values(priority, n, policy=policy_of(engine), slots=count)
    if generation is None:
        gens = torch.zeros(n, dtype=torch.int64)
    else:
        gens = generations_arg(generation, n, "update_priority")
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    if not policy_of(engine).prioritized and not policy_of(engine, fresh=True).prioritized:
        raise no_priorities(engine)
    pairs = codec.pack_i64(torch.stack([slots, gens], 1).reshape(-1).numpy())
    request = request_id()
    args = [n, pairs, "0" if generation is None else "1", format_priorities(values), engine.keys.events, request]
    keys = engine.keys

    def plan_call(h: Header) -> Call:
        deadline.arm()  # sent next: from now on the priorities may be set
        return Call(
            "priority",
            [keys.meta, *keys.sampling_keys, keys.replies],
            [f"{h.epoch}:*", *args],
            lambda r: torch.tensor([c == ord("1") for c in r[1]], dtype=torch.bool),
        )

    with deadline.resolvable(request, None):  # a timeout says whether the priorities may be set
        return engine.run(plan_call)


def weights_of(probs: torch.Tensor, low: float, beta: float) -> torch.Tensor:
    """Importance weights ``(P(i) / P_min) ** -beta`` (torchrl's ``PrioritizedSampler``): at most 1."""
    return torch.pow(probs / low, -beta).to(torch.float32)


def wait_or_raise(engine: Engine, attempt: Any, timeout: float | None, may_wait: bool, what: str) -> Any:
    """``attempt()``, waiting through ``WAIT`` replies when ``may_wait``; otherwise a ``WAIT`` for want of
    data is the ``ValueError`` a sample of an empty ring has always raised (an empty ring is such a
    ``WAIT``, whether the server said ``WAIT`` or ``read.lua`` found no written slot)."""
    attempt = _empty_waits(attempt)
    if may_wait:
        return waiting.until_ready(engine, attempt, timeout, what)
    try:
        return attempt()
    except MustWait as err:
        if err.reason in ("empty", "weight"):
            raise ValueError(f"cannot sample: {err.message} (pass min_size= or timeout= to wait for data)") from None
        return waiting.until_ready(engine, attempt, timeout, what)


def _empty_waits(attempt: Any) -> Any:
    def run() -> Any:
        try:
            return attempt()
        except scripts.EmptyRingError as err:
            raise MustWait("empty", err.detail) from None

    return run


def probabilities(reply: list) -> tuple[torch.Tensor, float]:
    """The rows' probabilities and the smallest probability, from a 'P' op's reply pieces (float64)."""
    probs = torch.from_numpy(np.frombuffer(reply[4], dtype="<f8").astype(np.float64))
    low = float(np.frombuffer(reply[5], dtype="<f8")[0]) if reply[5] else 0.0
    return probs, low
