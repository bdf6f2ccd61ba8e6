"""``tdstore demo --llm``: an async GRPO-shaped loop with no model, on a ring with rollouts.

Actor processes play a toy policy: for each prompt it answers with a group of ``group_size``
completions (a prompt string, ragged ``tokens`` and ``logp``, a ``reward``), stamped with the
policy version the actor last synced (``extend(version=v, group=g, group_size=n)``; each group
goes in two calls, so a reader could only see it whole if the server holds it back until it is).
Actors sync their version every ``sync_every`` groups, so their rollouts lag the learner as real
ones do. The learner ``pop``s by a token budget with ``max_staleness=k``, checks every batch,
computes group-relative advantages (GRPO's ``(r - mean) / std`` per group), and publishes the next
version with ``set_version``.

What is checked, and makes the exit code 1 when it fails: every popped or sampled item is a whole
group (all its rows, from one actor's one group); no row is more than ``k`` versions behind the
version published when it was read; a batch's tokens fit the budget; each row's data is the one
its writer wrote (tokens, log-probs and prompt derive from ``(actor, group, row, version)``);
each group's advantages sum to zero.

The encoding of row ``r`` of group ``g`` of actor ``a`` written at version ``v``:

=========  ==================================================================
``meta``   i64[4], ``[a, g, r, v]``
``prompt`` str, :func:`prompt_of` ``(a, g)``
``tokens`` i64[L], ``arange(L) + 1000 * a + g`` with ``L = completion_length(a, g, r)``
``logp``   f32[L], ``-(arange(L) + 1) / L``
``reward`` f32[1], :func:`reward_of` ``(a, g, r)``
=========  ==================================================================
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import traceback
from typing import Any, TextIO

import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase

from tdstore.demo.actors import START_POLL, ActorPool, DemoError
from tdstore.demo.report import Status, plural
from tdstore.demo.server_url import check_reachable, password_for_children, redact_url
from tdstore.lazy import LazyStackedTensorDictStore
from tdstore.ring_interface import RolloutSample
from tdstore.server import EmbeddedServer

__all__ = ["check_items", "completion_length", "llm_actor_main", "make_rollout", "prompt_of", "reward_of", "run_llm_demo"]

DEFAULT_PREFIX = "tdstore-demo-llm"
#: The learner's own "actor" id: it writes one group before the actors start, so the store has its keys.
PRIMER = 99


def prompt_of(actor: int, group: int) -> str:
    """The prompt string of ``actor``'s ``group``-th group (a chat turn, as text)."""
    return f"user: what is {actor} + {group}? (actor {actor}, prompt {group})"


def completion_length(actor: int, group: int, row: int) -> int:
    """The toy policy's completion length: 4 to 36 tokens, varying with every argument."""
    return 4 + (actor * 7 + group * 3 + row * 5) % 33


def reward_of(actor: int, group: int, row: int) -> float:
    """The toy reward of a completion (varies within a group, so advantages are not all zero)."""
    return float((actor + group + row * row) % 5)


def make_rollout(actor: int, group: int, row: int, version: int) -> TensorDict:
    """One completion of the toy policy (see the module docstring for its encoding)."""
    n = completion_length(actor, group, row)
    return TensorDict(
        meta=torch.tensor([actor, group, row, version], dtype=torch.int64),
        prompt=NonTensorData(prompt_of(actor, group)),
        tokens=torch.arange(n, dtype=torch.int64) + 1000 * actor + group,
        logp=-(torch.arange(n, dtype=torch.float32) + 1) / n,
        reward=torch.tensor([reward_of(actor, group, row)]),
    )


def write_group(store: LazyStackedTensorDictStore, actor: int, group: int, group_size: int, version: int) -> None:
    """Write one whole group in two ``extend`` calls (the first half stays invisible until the second lands)."""
    rows = [make_rollout(actor, group, r, version) for r in range(group_size)]
    half = max(1, group_size // 2)
    for part in (rows[:half], rows[half:]):
        if part:
            store.extend(part, version=version, group=f"a{actor}-g{group}", group_size=group_size)


def llm_actor_main(
    url: str,
    prefix: str,
    td_id: str,
    group_size: int,
    sync_every: int,
    actor: int,
    seconds: float,
    start: Any,
    stop: Any,
    counter: Any,
    results: Any,
) -> None:
    """One actor: attach by ``td_id``, then write whole groups stamped with its (lagging) policy version
    until told to stop; reports ``("done", actor, rows, seconds, groups)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = LazyStackedTensorDictStore.from_store(url=url, prefix=prefix, td_id=td_id)
        results.put(("ready", actor))
        while not start.wait(START_POLL):
            if stop.is_set() and not start.is_set():
                results.put(("done", actor, 0, 0.0, 0))
                return
        t0 = time.monotonic()
        end = t0 + seconds
        group = rows = version = 0
        while True:
            if group % sync_every == 0:
                version = store.policy_version  # "load the learner's weights"
            write_group(store, actor, group, group_size, version)
            group += 1
            rows += group_size
            counter.value = rows
            if stop.is_set() or time.monotonic() >= end:
                break
        results.put(("done", actor, rows, time.monotonic() - t0, group))
    except BaseException:
        results.put(("error", actor, traceback.format_exc()))


def check_items(
    td: TensorDictBase, versions: torch.Tensor, group_sizes: torch.Tensor, *, group_size: int, current: int, max_staleness: int
) -> list[str]:
    """What is wrong with a popped or sampled batch of whole groups (an empty list when nothing is);
    ``current`` is the version published when the batch was read."""
    errors: list[str] = []
    meta = td["meta"]
    if int(group_sizes.sum()) != meta.shape[0] or bool((group_sizes != group_size).any()):
        return [f"items of {group_sizes.tolist()} rows, not whole groups of {group_size}"]
    if not torch.equal(meta[:, 3], versions):
        errors.append(f"versions {versions.tolist()} are not the ones written {meta[:, 3].tolist()}")
    behind = current - int(versions.min())
    if behind > max_staleness:
        errors.append(f"a row {behind} versions behind {current}, more than max_staleness={max_staleness}")
    prompts = td["prompt"]
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    for i in range(0, meta.shape[0], group_size):
        rows = meta[i : i + group_size]
        a, g = int(rows[0, 0]), int(rows[0, 1])
        if not (bool((rows[:, 0] == a).all()) and bool((rows[:, 1] == g).all()) and sorted(rows[:, 2].tolist()) == list(range(group_size))):
            errors.append(f"item at row {i} mixes groups: {rows.tolist()}")
            continue
        for j in range(i, i + group_size):
            r = int(meta[j, 2])
            n = completion_length(a, g, r)
            tokens, logp = td[j]["tokens"], td[j]["logp"]
            if (
                tokens.shape != (n,)
                or logp.shape != (n,)
                or not torch.equal(tokens, torch.arange(n) + 1000 * a + g)
                or prompts[j] != prompt_of(a, g)
                or float(td[j]["reward"][0]) != reward_of(a, g, r)
            ):
                errors.append(f"row {j} (actor {a}, group {g}, row {r}) is not what its writer wrote")
    return errors


def advantages(td: TensorDictBase, group_size: int) -> torch.Tensor:
    """GRPO's group-relative advantages: each reward minus its group's mean, over the group's std (+eps)."""
    r = td["reward"].reshape(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)


def _quietly_clear(store: LazyStackedTensorDictStore) -> None:
    """Cleanup on any exit path: delete the demo's keys if the server is still there."""
    with contextlib.suppress(Exception):
        store.clear_redis()


class _Figures:
    """What the learner counts while it runs."""

    def __init__(self) -> None:
        self.batches = self.rows = self.groups = self.tokens = self.max_tokens = 0
        self.stale = self.lost = self.samples = 0
        self.max_behind = 0
        self.errors: list[str] = []


def _learn(
    store: LazyStackedTensorDictStore,
    pool: ActorPool,
    f: _Figures,
    *,
    seconds: float,
    group_size: int,
    max_staleness: int,
    token_budget: int,
    progress: TextIO | None,
) -> float:
    """The learner's loop until ``seconds`` pass; returns the seconds it ran."""
    version = store.policy_version
    t0 = time.monotonic()
    next_line = 1.0
    while (elapsed := time.monotonic() - t0) < seconds:
        pool.raise_if_failed()
        if progress is not None and elapsed >= next_line:
            next_line += 1.0
            print(
                f"[{elapsed:5.1f}s] rollouts written {pool.writes()} ({pool.writes() / elapsed:.0f}/s)  batches {f.batches}  "
                f"version {version}  max staleness {f.max_behind}/{max_staleness}  stale rows skipped {f.stale}  "
                f"tokens/batch {f.tokens / max(f.batches, 1):.0f}",
                file=progress,
                flush=True,
            )
        try:
            got = store.pop(token_budget=token_budget, length_key="tokens", max_staleness=max_staleness, timeout=0.5)
        except TimeoutError:
            continue
        f.stale += got.stale
        f.lost += got.lost
        n = got.td.shape[0]
        if n == 0:
            continue
        f.errors += check_items(got.td, got.versions, got.group_sizes, group_size=group_size, current=version, max_staleness=max_staleness)
        tokens = sum(int(got.td[j]["tokens"].shape[0]) for j in range(n))
        if tokens > token_budget:
            f.errors.append(f"a batch of {tokens} tokens, over the budget of {token_budget}")
        adv = advantages(got.td, group_size).reshape(-1, group_size).sum(1)
        if bool((adv.abs() > 1e-3).any()):
            f.errors.append(f"group advantages do not sum to zero: {adv.tolist()}")
        f.batches += 1
        f.rows += n
        f.groups += len(got.group_sizes)
        f.tokens += tokens
        f.max_tokens = max(f.max_tokens, tokens)
        f.max_behind = max(f.max_behind, version - int(got.versions.min()))
        if f.batches % 4 == 0:  # a sample of whole fresh groups, checked the same way
            with contextlib.suppress(ValueError):  # none qualifies right now
                s = store.sample(1, groups=2, max_staleness=max_staleness)
                assert isinstance(s, RolloutSample)  # a ring with rollouts samples as one
                f.errors += check_items(
                    s.td, s.versions, s.group_sizes, group_size=group_size, current=version, max_staleness=max_staleness
                )
                f.samples += 1
        version += 1
        store.set_version(version)  # "an optimizer step": the next policy version
    return time.monotonic() - t0


def run_llm_demo(
    url: str | None = None,
    actors: int = 4,
    count: int = 1024,
    seconds: float = 5.0,
    *,
    group_size: int = 4,
    max_staleness: int = 2,
    token_budget: int = 512,
    sync_every: int = 3,
    prefix: str = DEFAULT_PREFIX,
    progress: bool = True,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Run the GRPO-shaped loop (see the module docstring) and return its figures (``ok``: every check held).

    ``count`` is the ring's capacity in rows; ``url=None`` starts a private embedded redis-server.
    """
    for name, value in (
        ("actors", actors),
        ("count", count),
        ("group_size", group_size),
        ("token_budget", token_budget),
        ("sync_every", sync_every),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds!r}")
    longest = group_size * max(completion_length(a, g, r) for a in range(33) for g in range(33) for r in range(group_size))
    if token_budget < longest:
        raise ValueError(f"token_budget={token_budget} cannot hold a whole group (up to {longest} tokens with group_size={group_size})")
    if count < 2 * group_size * actors:
        raise ValueError(
            f"count={count} rows is too small for {actors} actors writing groups of {group_size}: give at least {2 * group_size * actors}"
        )
    out = sys.stdout if out is None else out
    say = Status(progress, sys.stderr)
    f = _Figures()
    with contextlib.ExitStack() as stack:
        if url is None:
            say("starting an embedded redis-server...")
            server = stack.enter_context(EmbeddedServer())
            url, where = server.url, f"embedded redis-server {server.version} at {server.url}"
        else:
            where = f"redis {check_reachable(url)} at {redact_url(url)}"
        store = LazyStackedTensorDictStore(url=url, prefix=prefix, count=count)
        stack.callback(store.close)
        stack.callback(_quietly_clear, store)
        store.set_version(0)
        write_group(store, PRIMER, 0, group_size, 0)  # the store's keys exist before the actors attach
        say(f"server: {where}; a ring of {count} rows with rollouts; starting {plural(actors, 'actor')}...")
        pool = ActorPool(llm_actor_main, (redact_url(url), prefix, store.td_id, group_size, sync_every), actors, seconds)
        try:
            with password_for_children(url):
                pool.launch(say)
            pool.go()
            ran = _learn(
                store, pool, f, seconds=seconds, group_size=group_size, max_staleness=max_staleness,
                token_budget=token_budget, progress=sys.stderr if progress else None,
            )  # fmt: skip
            reports = pool.finish()
        except BaseException:
            pool.release()
            raise
        finally:
            pool.reap()
        final_version = store.policy_version
        keys = store.clear_redis()
    written = sum(r[0] for r in reports.values())
    groups_written = sum(r[2] for r in reports.values())
    fig: dict[str, Any] = {
        "server": where,
        "actors": actors,
        "count": count,
        "seconds": ran,
        "group_size": group_size,
        "max_staleness": max_staleness,
        "token_budget": token_budget,
        "rollouts_written": written,
        "groups_written": groups_written,
        "rollouts_per_s": written / ran if ran > 0 else 0.0,
        "batches": f.batches,
        "rows_popped": f.rows,
        "groups_popped": f.groups,
        "rollouts_popped_per_s": f.rows / ran if ran > 0 else 0.0,
        "samples_checked": f.samples,
        "tokens_per_batch": f.tokens / f.batches if f.batches else 0.0,
        "max_tokens_per_batch": f.max_tokens,
        "max_staleness_seen": f.max_behind,
        "stale_rows_skipped": f.stale,
        "lost_rows": f.lost,
        "final_version": final_version,
        "keys_deleted": keys,
        "errors": f.errors[:5],
        "ok": not f.errors and f.batches > 0 and written > 0 and f.max_behind <= max_staleness,
    }
    if f.batches == 0:
        fig["errors"].append("the learner popped no batch")
    print_llm_summary(fig, out)
    if not written:
        raise DemoError("the actors wrote no rollout")
    return fig


def print_llm_summary(f: dict[str, Any], out: TextIO) -> None:
    """The human-readable result of :func:`run_llm_demo`."""
    lines = [
        f"tdstore demo --llm on {f['server']}",
        f"  {plural(f['actors'], 'actor')}, a ring of {f['count']} rows, groups of {f['group_size']}, "
        f"max_staleness={f['max_staleness']}, token budget {f['token_budget']}, {f['seconds']:.2f} s",
        f"  written  : {f['rollouts_written']} rollouts in {f['groups_written']} groups, {f['rollouts_per_s']:.0f} rollouts/s",
        f"  learner  : {f['batches']} batches, {f['rows_popped']} rollouts in {f['groups_popped']} whole groups "
        f"({f['rollouts_popped_per_s']:.0f}/s), {f['samples_checked']} group samples checked; version now {f['final_version']}",
        f"  tokens   : {f['tokens_per_batch']:.0f} per batch on average, at most {f['max_tokens_per_batch']} (budget {f['token_budget']})",
        f"  staleness: at most {f['max_staleness_seen']} versions behind (bound {f['max_staleness']}); "
        f"{f['stale_rows_skipped']} stale rows skipped, {f['lost_rows']} rows overwritten unread",
        f"  cleanup  : {f['keys_deleted']} keys deleted",
    ]
    lines += [f"  error: {e}" for e in f["errors"]]
    lines.append(
        "  OK: the staleness bound held, every group came whole, every batch fit its budget"
        if f["ok"]
        else "  FAILED: see the errors above"
    )
    print("\n".join(lines), file=out, flush=True)
