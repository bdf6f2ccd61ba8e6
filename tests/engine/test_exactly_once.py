"""Exactly once when a reply is lost (issue #27): every ring call that changes state carries a request id.

redis-py sends a command again after a connection error or a socket timeout, also when the server
had already run it and only its reply was lost. Every call below changes the store and is not
naturally idempotent, so each carries an id its client made; the script records what it decided
under that id, and a resend of the id gets the first reply back without running again.

Each test makes two stores with the same history (twins): on one the call's reply is lost and the
call sent again (a proxy that cuts the connection right after the server answered, a client that
sends each script call twice, a server paused under the call); on the other the same call runs
once, cleanly. The caller must get the same result from both, and both stores must hold the same
state: header counters (``rw``, ``rr``, ``sn``, versions...), the priority tree and the
times-sampled counts byte for byte, and every row. No timer races a call: cuts land at a byte the
proxy picks, and the paused server is resumed on an event the proxy observes.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import torch
from conftest import Backend
from helpers import load_tool, top_level_commands
from tensordict import TensorDict

from tdstore import LazyStackedTensorDictStore, QueueOverrunError, TensorDictStore
from tdstore._engine import scripts as _scripts
from tdstore._engine import whole_store as _whole_store
from tdstore._format import codec as _codec
from tdstore._format.keys import StoreKeys
from tdstore._ring import direct_extend as _direct
from tdstore.server import EmbeddedServer, commandstats

pytestmark = pytest.mark.ring

faults = load_tool("faults")

COUNT = 8


def rows(lo: int, n: int) -> TensorDict:
    """n elements tagged lo .. lo + n - 1."""
    tags = torch.arange(lo, lo + n)
    return TensorDict({"obs": tags.to(torch.float32).unsqueeze(-1).expand(n, 3).clone(), "tag": tags.clone()}, [n])


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


# -- the calls: (how the twins are set up, the call) ---------------------------------------------
def plain(s: LazyStackedTensorDictStore) -> None:
    s.extend(rows(0, 5))


def limited(s: LazyStackedTensorDictStore) -> None:
    s.extend(rows(0, 5))
    s.set_rate_limit(min_size=2, samples_per_insert=2.0, error_buffer=100.0)
    s.sample(4, gen())


def prioritized(s: LazyStackedTensorDictStore) -> None:
    s.enable_priorities(alpha=0.7, max_times_sampled=2)
    s.extend(rows(0, 6), priority=torch.tensor([1.0, 4.0, 0.5, 2.0, 3.0, 1.5]))


def uncounted(s: LazyStackedTensorDictStore) -> None:
    s.enable_priorities(alpha=0.7)
    s.extend(rows(0, 6), priority=torch.tensor([1.0, 4.0, 0.5, 2.0, 3.0, 1.5]))


def queue(s: LazyStackedTensorDictStore) -> None:
    s.set_queue(True)
    s.extend(rows(0, 6))
    s.pop(1)


CALLS: dict[str, tuple[Callable[[LazyStackedTensorDictStore], None], Callable[[LazyStackedTensorDictStore], Any]]] = {
    "extend": (plain, lambda s: s.extend(rows(100, 3))),
    "extend-first-keys": (lambda s: None, lambda s: s.extend(rows(100, 3))),  # creates the keys: a schema change
    "extend-wrapping": (plain, lambda s: s.extend(rows(100, 6))),
    "append": (plain, lambda s: s.append(rows(100, 1)[0])),
    "update_if": (plain, lambda s: s.update_if([1, 2, 6], [1, 1, 0], rows(200, 3))),
    "sample-rate-limited": (limited, lambda s: s.sample(6, gen())),
    "sample-prioritized-counted": (prioritized, lambda s: s.sample(5, gen())),
    "sample-prioritized": (uncounted, lambda s: s.sample(5, gen())),  # counts nothing: records nothing, draws the same again
    "pop-queue": (queue, lambda s: s.pop(3)),
    "pop": (plain, lambda s: s.pop(2)),
    "update_priority": (prioritized, lambda s: s.update_priority([0, 3, 5], torch.tensor([5.0, 0.25, 2.0]))),
    "update_priority-generations": (prioritized, lambda s: s.update_priority([0, 1], [9.0, 7.0], generation=[1, 0])),
    "enable_priorities": (plain, lambda s: s.enable_priorities(alpha=0.6, max_times_sampled=3)),
    "set_rate_limit": (plain, lambda s: s.set_rate_limit(min_size=2, samples_per_insert=2.0, error_buffer=10.0)),
    "clear_rate_limit": (limited, lambda s: s.clear_rate_limit()),
    "set_queue": (plain, lambda s: s.set_queue(True)),
    "set_queue-off": (queue, lambda s: s.set_queue(False)),
}


def outcome(result: Any) -> Any:
    """What the caller got, comparable across twins."""
    if result is None:
        return None
    if isinstance(result, torch.Tensor):
        return result.tolist()
    out = {}
    for name in ("indices", "generations", "weights", "probabilities"):
        if hasattr(result, name):
            out[name] = getattr(result, name).tolist()
    if hasattr(result, "td"):
        out["tag"] = result.td["tag"].tolist()
        out["obs"] = result.td["obs"].tolist()
    return out


def effects(raw: redis.Redis, s: LazyStackedTensorDictStore) -> dict[str, Any]:
    """Everything a call may change: the header (but the epoch, which each twin has its own), the
    priority tree and times-sampled counts byte for byte, and every row."""
    keys = s._engine.keys
    header = {k.decode(): v for k, v in raw.hgetall(keys.meta).items() if k != b"epoch"}
    out: dict[str, Any] = {"header": header, "tree": raw.get(keys.priorities), "times": raw.get(keys.times_sampled)}
    if header.get("schema", b"").find(b'"tag"') >= 0:
        out["tag"] = s.get("tag").tolist()
        out["obs"] = s.get("obs").tolist()
    return out


def cache_size(raw: redis.Redis, s: LazyStackedTensorDictStore) -> int:
    """Decisions in the store's reply cache (its fields but the '#' bookkeeping)."""
    return sum(1 for k in raw.hkeys(s._engine.keys.replies) if not k.startswith(b"#"))


@pytest.fixture
def proxied(real: Backend) -> Iterator[tuple[Backend, Any]]:
    """The real server behind a cutting proxy, every script loaded (a NOSCRIPT reply is no lost reply)."""
    assert real.server is not None
    raw = real.client()
    for name in _scripts.SCRIPT_NAMES:
        raw.execute_command("SCRIPT", "LOAD", _scripts.script_source(name)[0])
    with faults.CuttingProxy(real.server.url) as proxy:
        yield real, proxy


@pytest.mark.parametrize("name", list(CALLS))
def test_a_reply_cut_after_the_server_ran_the_call_changes_nothing_twice(proxied, name):
    real, proxy = proxied
    raw = real.client()
    setup, call = CALLS[name]
    cut_store = LazyStackedTensorDictStore(count=COUNT, url=proxy.url, prefix=real.prefix)
    clean = LazyStackedTensorDictStore(count=COUNT, url=real.server.url, prefix=real.prefix)
    for s in (cut_store, clean):
        setup(s)
    assert effects(raw, cut_store) == effects(raw, clean)
    before, tx_before = commandstats(raw).get("evalsha", 0), commandstats(raw).get("exec", 0)
    expected = outcome(call(clean))
    calls = commandstats(raw).get("evalsha", 0) - before  # one, or one per step (enable_priorities builds its tree in steps)
    # a direct ring write (rows as SETRANGEs, see _direct) is one transaction with a script at each end: resent whole
    resend = 2 if commandstats(raw).get("exec", 0) > tx_before else 1
    before = commandstats(raw).get("evalsha", 0)
    cut = proxy.arm(faults.Cut("reply", ("EVALSHA",), 0))
    got = outcome(call(cut_store))
    proxy.disarm()
    assert cut.landed.is_set(), f"{name}: the cut never landed"
    sent = commandstats(raw).get("evalsha", 0) - before
    # the calls and one resend; a step of enable_priorities resent after it switched the policy on is
    # answered STALE (the version moved) and planned again, finding priorities on: one more call, no effect
    assert sent == calls + resend or (name == "enable_priorities" and sent == calls + 2), f"{name}: {sent} calls ({cut.where})"
    assert got == expected, name
    assert effects(raw, cut_store) == effects(raw, clean), name


def send_twice(store: LazyStackedTensorDictStore, seen: list[tuple[Any, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the store's handle send every script call twice and keep the second reply (as redis-py
    resending after a lost reply would), noting both replies."""
    engine = store._engine
    plain_execute = engine.execute

    def execute(client: Any, *args: Any) -> Any:
        if args[0] != "EVALSHA":
            return plain_execute(client, *args)
        first = plain_execute(client, *args)
        second = plain_execute(client, *args)
        seen.append((first, second))
        return second

    engine.execute = execute  # type: ignore[method-assign]
    plain_send = _direct._send

    def send(engine_: Any, head: Any, writes: Any, tail: Any, load: bool = False) -> Any:
        """A direct ring write's transaction sent twice: the second is answered DONE by its opening script."""
        if engine_ is not engine:
            return plain_send(engine_, head, writes, tail, load)
        first = plain_send(engine_, head, writes, tail, load)
        second = plain_send(engine_, head, writes, tail)
        assert first[0][0] == b"GO" and first[-1] == [b"OK"], first
        assert second[0][0] == b"DONE" and second[-1] == [b"NO"], second
        seen.append(([b"OK", *first[0][1:]], [b"OK", *second[0][1:]]))
        return second

    monkeypatch.setattr(_direct, "_send", send)


@pytest.fixture
def two_engines(one_node: Backend) -> Backend:
    """The real server and fakeredis (the ring refuses a spread cluster store; the cluster is not needed here)."""
    return one_node


@pytest.mark.parametrize("kind", ["lazy", "dense"])
@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_sent_twice_with_one_request_id_runs_once(two_engines, name, kind, monkeypatch):
    """Every ring call, on a lazy store and on a dense one (whose ring is the lazy store's)."""
    backend = two_engines
    raw = backend.client()
    setup, call = CALLS[name]
    make = (
        (lambda: TensorDictStore(batch_size=[COUNT], **backend.kwargs()))
        if kind == "dense"
        else (lambda: LazyStackedTensorDictStore(count=COUNT, **backend.kwargs()))
    )
    twice, clean = make(), make()
    for s in (twice, clean):
        setup(s)
    expected = outcome(call(clean))
    seen: list[tuple[Any, Any]] = []
    send_twice(twice, seen, monkeypatch)
    assert outcome(call(twice)) == expected, name
    assert effects(raw, twice) == effects(raw, clean), name
    assert seen and all(first[0] == b"OK" for first, _ in seen), seen
    if not name.startswith(("enable", "set_", "clear")):  # a policy change answers with the header as it is now
        assert all(first == second for first, second in seen), name


def test_nothing_is_recorded_for_stale_wait_or_a_call_that_changes_nothing(two_engines):
    """A WAIT (nothing ran) and a uniform sample without a policy record nothing; a later call with the same
    history records its one decision."""
    raw = two_engines.client()
    s = LazyStackedTensorDictStore(count=COUNT, **two_engines.kwargs())
    s.set_queue(True)
    n = cache_size(raw, s)
    with pytest.raises(TimeoutError):
        s.pop(1, timeout=0)  # WAIT: nothing to pop
    assert cache_size(raw, s) == n
    s.set_queue(False)
    s.extend(rows(0, 3))
    s.sample(4, gen())  # uniform, no policy: changes nothing, so records nothing
    assert cache_size(raw, s) == n + 2


def test_a_resent_pop_whose_items_were_overwritten_raises_instead_of_returning_other_rows(two_engines):
    """A pop's reply is lost, and writers lap the ring before the resend arrives: the resend says the items
    are lost (``QueueOverrunError``), never returns the newer rows in their place; the cursor moved once."""
    raw = two_engines.client()
    s = LazyStackedTensorDictStore(count=4, **two_engines.kwargs())
    writer = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **two_engines.kwargs())
    s.extend(rows(0, 4))
    engine = s._engine
    plain_execute = engine.execute

    def lapped_before_the_resend(client: Any, *args: Any) -> Any:
        if args[0] != "EVALSHA":
            return plain_execute(client, *args)
        plain_execute(client, *args)  # the server pops (or answers NOSCRIPT, and the call loads the script); the reply is lost
        writer.extend(rows(4, 3))  # ring writes 4 .. 6 overwrite slots 0 .. 2, the popped items 0 and 1 among them
        return plain_execute(client, *args)  # redis-py's resend

    engine.execute = lapped_before_the_resend  # type: ignore[method-assign]
    with pytest.raises(QueueOverrunError, match="reply to a pop of 2 items .* was lost") as err:
        s.pop(2)
    assert err.value.lost == 2
    engine.execute = plain_execute  # type: ignore[method-assign]
    assert int(raw.hget(engine.keys.meta, "rr")) == 2  # moved once, by the pop that ran
    with pytest.raises(QueueOverrunError) as later:  # item 2 was overwritten too: the next pop says so
        s.pop(1)
    assert later.value.lost == 1
    assert s.pop(1).td["tag"].tolist() == [3]


def test_a_resent_counted_sample_reads_its_slots_as_they_are_now_with_their_true_generations(two_engines):
    """A counted sample's reply is lost and a writer overwrites the whole ring before the resend: the resend
    returns the slots the sample drew, with the bytes they hold now and the generation that wrote them (so an
    ``update_priority``/``update_if`` with it acts on what was read), and counts nothing again."""
    raw = two_engines.client()
    s = LazyStackedTensorDictStore(count=4, **two_engines.kwargs())
    writer = LazyStackedTensorDictStore.from_store(td_id=s.td_id, **two_engines.kwargs())
    s.extend(rows(0, 4))
    s.set_rate_limit(min_size=1, samples_per_insert=1.0, error_buffer=100.0)
    engine = s._engine
    plain_execute = engine.execute
    first: list[Any] = []

    def overwritten_before_the_resend(client: Any, *args: Any) -> Any:
        if args[0] != "EVALSHA":
            return plain_execute(client, *args)
        first.append(plain_execute(client, *args))  # the server draws and counts; the reply is lost
        if first[-1][0] == b"OK":
            writer.extend(rows(10, 4))  # every slot written again: generation 2
        return plain_execute(client, *args)

    engine.execute = overwritten_before_the_resend  # type: ignore[method-assign]
    got = s.sample(6, gen())
    engine.execute = plain_execute  # type: ignore[method-assign]
    assert first[-1][2] == _codec.pack_i64(got.indices.numpy())  # the slots the first attempt drew
    assert got.td["tag"].tolist() == (got.indices + 10).tolist()  # the bytes they hold now
    assert got.generations.tolist() == [2] * 6
    assert int(raw.hget(engine.keys.meta, "sn")) == 6  # counted once


def test_the_reply_cache_is_bounded_and_an_id_it_dropped_runs_again(two_engines, monkeypatch):
    """The cache keeps the last 4096 decisions (and at most 4 MiB of them): a resend of an id it dropped
    is a new call (documented in lua/README.md), which runs; ids it keeps still answer their first reply."""
    raw = two_engines.client()
    s = LazyStackedTensorDictStore(count=COUNT, **two_engines.kwargs())
    s.extend(rows(0, 1))
    monkeypatch.setattr(_direct, "usable", lambda *_: False)  # the write.lua call is the one resent by hand below
    keys = s._engine.keys
    sent: list[tuple[Any, ...]] = []
    plain_execute = s._engine.execute
    s._engine.execute = lambda client, *args: (sent.append(args), plain_execute(client, *args))[1]  # type: ignore[method-assign]
    s.extend(rows(1, 1))
    first = sent[-1]
    s._engine.execute = plain_execute  # type: ignore[method-assign]
    rw = int(raw.hget(keys.meta, "rw"))
    assert plain_execute(s._engine.client, *first)[2] == b"1" and int(raw.hget(keys.meta, "rw")) == rw  # kept: its first reply
    # fill the cache past its bound with records of other ids (a script call each, as update_priority makes)
    fill = raw.register_script(
        _scripts.script_source("priority")[0].split("local meta = KEYS[1]")[0]
        + "for i = 1, tonumber(ARGV[1]) do tds_remember(tds_request(2, string.format('%032x', i)), ARGV[2]) end return 1"
    )
    fill(keys=[keys.meta, keys.replies], args=[4096, "W0"])
    assert cache_size(raw, s) == 4096 and raw.hget(keys.replies, first[first.index("N") + 2]) is None
    assert plain_execute(s._engine.client, *first)[0] == b"OK" and int(raw.hget(keys.meta, "rw")) == rw + 1  # dropped: runs again
    fill(keys=[keys.meta, keys.replies], args=[40, "P" + "x" * (200 << 10)])  # 200 KiB decisions: the byte bound holds
    assert cache_size(raw, s) <= 21 and int(raw.hget(keys.replies, "#b")) <= 4 << 20
    assert len(raw.hkeys(keys.replies)) <= 2 * 4096 + 3


def test_the_reply_cache_expires_with_the_store_and_goes_with_it(real):
    """Created under a store with a time to live, it gets the header's deadline; expire/persist/clear
    cover it; a copy does not take it; ``tdstore check``/``info`` see nothing wrong."""
    from tdstore import inspect_store

    raw = real.client()
    s = LazyStackedTensorDictStore(count=COUNT, **real.kwargs())
    s.extend(rows(0, 2))
    s.expire(60)
    s.extend(rows(2, 1))
    keys = s._engine.keys
    assert raw.exists(keys.replies)
    pipe = raw.pipeline(transaction=True)  # one EXEC: both read within a millisecond (Redis 6 has no PEXPIRETIME)
    pipe.pttl(keys.replies)
    pipe.pttl(keys.meta)
    replies_ttl, meta_ttl = pipe.execute()
    assert meta_ttl > 0 and abs(replies_ttl - meta_ttl) <= 1
    s.persist()
    assert raw.pttl(keys.replies) == -1
    s.expire(30)
    assert 0 < raw.pttl(keys.replies) <= 30_000
    copy = StoreKeys(real.prefix, f"copy-{uuid.uuid4().hex[:6]}")
    _whole_store.copy_to(s._engine, copy)
    assert raw.exists(copy.meta) and not raw.exists(copy.replies)
    audit = inspect_store.audit(raw, real.prefix, s.td_id)
    assert audit.intact and not audit.problems, audit
    info = inspect_store.store_info(raw, real.prefix, s.td_id)
    assert info.td_id == s.td_id
    listing = inspect_store.list_stores(raw, real.prefix)
    assert s.td_id in str(listing) and "damaged" not in str(listing).lower()
    s.clear_redis()
    assert not raw.exists(keys.replies)
    other = LazyStackedTensorDictStore(count=COUNT, **real.kwargs())
    other.set_queue(True)
    assert raw.exists(other._engine.keys.replies)
    inspect_store.delete_store(raw, real.prefix, other.td_id)  # tdstore rm
    assert not raw.exists(other._engine.keys.replies)


def test_request_ids_add_no_command(real):
    """One round trip per call, request id included: one EVALSHA and nothing else."""
    s = LazyStackedTensorDictStore(count=COUNT, **real.kwargs())
    s.extend(rows(0, 4))
    s.enable_priorities(alpha=0.5, max_times_sampled=5)
    s.set_queue(True)
    for call in (
        lambda: s.extend(rows(4, 2)),
        lambda: s.pop(2),
        lambda: s.sample(3, gen()),
        lambda: s.update_priority([0, 1], 2.0),
        lambda: s.update_if([0], [1], rows(9, 1)),
        lambda: s.set_rate_limit(min_size=1),
    ):
        call()  # scripts loaded, header current
        before = real.commandstats().get("evalsha", 0)
        assert top_level_commands(real.client, call) == ["evalsha"]
        assert real.commandstats().get("evalsha", 0) - before == 1


def test_a_call_resent_while_the_server_is_paused_runs_once(tmp_path):
    """The server is stopped (SIGSTOP) under an extend: the client's socket times out and redis-py sends the
    call again on a new connection while the first is still queued at the server. Once the retry's connection
    reached the server (an event the proxy sees, no timer), the server resumes (SIGCONT) and runs the queued
    first call, then the resend: with the request id the ring moves once. The same for a pop."""
    with EmbeddedServer() as srv, faults.CuttingProxy(srv.url) as proxy:
        assert srv.pid is not None
        raw = srv.client()
        prefix = f"paused-{uuid.uuid4().hex[:6]}"
        port = int(proxy.url.rsplit(":", 1)[1].split("/")[0])
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)  # redis-py's default retries
        s = LazyStackedTensorDictStore(count=COUNT, client=client, prefix=prefix)
        clean = LazyStackedTensorDictStore(count=COUNT, url=srv.url, prefix=prefix)
        for store in (s, clean):
            queue(store)
        for call in (lambda st: st.extend(rows(100, 2)), lambda st: st.pop(2)):
            expected = outcome(call(clean))
            assert _while_paused(srv, proxy, lambda call=call: outcome(call(s))) == expected
            assert effects(raw, s) == effects(raw, clean)
        client.close()


def _while_paused(srv: EmbeddedServer, proxy: Any, run: Callable[[], Any]) -> Any:
    """``run()`` in a thread while the server is stopped, resumed once the client's retry reached the proxy
    on a new connection (the client's first try is then queued at the server, unanswered)."""
    assert srv.pid is not None
    links = len(proxy.links)
    new_link = threading.Event()
    proxy.on_command = lambda name: new_link.set() if len(proxy.links) > links else None
    got: list[Any] = []
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        worker = threading.Thread(target=lambda: got.append(run()), daemon=True)
        worker.start()
        assert new_link.wait(60), "redis-py never retried on a new connection"
    finally:
        os.kill(srv.pid, signal.SIGCONT)
        proxy.on_command = None
    worker.join(60)
    assert len(got) == 1, "the call did not return"
    return got[0]


def test_a_counted_in_place_write_sent_twice_writes_its_rows_once(two_engines, monkeypatch):
    """torchrl's in-place writes move the header's ``tr`` in the write's own call (``Engine.counting_in_place``).
    An element write has no request id: sent twice, its rows are what one write leaves, and ``tr`` moves
    twice, which is harmless (a revision only has to change). An ``update_if`` (a request id) runs once: ``tr`` + 1."""
    raw = two_engines.client()
    twice, clean = (LazyStackedTensorDictStore(count=COUNT, **two_engines.kwargs()) for _ in range(2))
    for s in (twice, clean):
        s.extend(rows(0, COUNT))
        with s._engine.counting_in_place():
            s[torch.tensor([1, 3])] = rows(50, 2)
    seen: list[tuple[Any, Any]] = []
    send_twice(twice, seen, monkeypatch)
    with twice._engine.counting_in_place():
        twice[torch.tensor([2, 4])] = rows(60, 2)
    with clean._engine.counting_in_place():
        clean[torch.tensor([2, 4])] = rows(60, 2)
    got, want = effects(raw, twice), effects(raw, clean)
    assert got["header"].pop("tr") == b"3" and want["header"].pop("tr") == b"2"
    assert got == want
    assert twice.get("tag").tolist() == [0, 50, 60, 51, 61, 5, 6, 7]
    with twice._engine.counting_in_place():
        applied = twice.update_if(torch.tensor([0, 5]), torch.tensor([1, 1]), rows(70, 2))
    assert applied.tolist() == [True, True] and twice.get("tag").tolist()[::5] == [70, 71]
    assert int(raw.hget(twice._engine.keys.meta, "tr")) == 4  # the resend was answered from the reply cache


# -- the other calls that change state: sent twice, as redis-py resends after a lost reply ----------------
def resent(monkeypatch: pytest.MonkeyPatch, names: set[str], seen: list[str]) -> None:
    """Every call of the scripts ``names`` runs twice with the same KEYS and ARGV, the caller getting the
    second reply: the server ran the first and its reply was lost (a resend). A refused first attempt
    (an error reply) is raised as it is."""
    plain = _scripts.call

    def call(client: Any, name: str, keys: list[str], args: list[Any], execute: Any = None) -> list:
        first = plain(client, name, keys, args, execute)
        if name not in names:
            return first
        seen.append(name)
        return plain(client, name, keys, args, execute)

    monkeypatch.setattr(_scripts, "call", call)


def test_a_resent_rename_or_delete_of_a_key_is_applied_once_and_answers_ok(two_engines, monkeypatch):
    """The first attempt renamed (deleted) the key; its resend used to meet a newer schema, plan again,
    not find the key and raise KeyError for a call that had succeeded. Now it carries a request id."""
    backend = two_engines
    for make in (
        lambda: LazyStackedTensorDictStore.from_lazy_stack(rows(0, 4), **backend.kwargs()),
        lambda: TensorDictStore.from_tensordict(rows(0, 4), **backend.kwargs()),
    ):
        s = make()
        seen: list[str] = []
        with monkeypatch.context() as m:
            resent(m, {"write"}, seen)
            s.rename_key_("obs", "y")
            del s["tag"]
        assert seen == ["write", "write"]
        assert sorted(s.keys()) == ["y"]
        other = type(s).from_store(td_id=s.td_id, **backend.kwargs())
        assert sorted(other.keys()) == ["y"] and torch.equal(other["y"], s["y"])
        s.clear_redis()


@pytest.mark.parametrize("lost", ["create", "commit"])
def test_a_resent_upload_create_or_commit_keeps_the_store(two_engines, monkeypatch, lost):
    """A lost reply to the upload's create used to fail it ("already exists", the id held for two
    minutes); to its commit, to delete the store just published (the resend found it ready and the
    upload's clean-up deleted every key). Now each recognises its own creation by its epoch."""
    backend = two_engines
    data = rows(0, 6)
    seen: list[str] = []
    with monkeypatch.context() as m:
        resent(m, {lost}, seen)
        s = TensorDictStore.from_tensordict(data, **backend.kwargs())
    assert seen == [lost]
    again = TensorDictStore.from_store(td_id=s.td_id, **backend.kwargs())
    assert torch.equal(again["obs"], data["obs"]) and torch.equal(again["tag"], data["tag"])
    s.clear_redis()


def test_a_resent_clone_answers_with_its_own_copy(two_engines, monkeypatch):
    """A lost reply to a server-side clone used to raise "exists" and leave the copy behind, listed but
    with no handle; the resend now sees the copy carries its own epoch and answers OK."""
    backend = two_engines
    s = TensorDictStore.from_tensordict(rows(0, 5), **backend.kwargs())
    seen: list[str] = []
    with monkeypatch.context() as m:
        resent(m, {"copy"}, seen)
        c = s.clone()
    assert seen == ["copy"] and c.td_id != s.td_id
    assert torch.equal(c["obs"], s["obs"])
    c[0] = rows(100, 1)[0]
    assert s["tag"][0].item() == 0 and c["tag"][0].item() == 100
    s.clear_redis()
    c.clear_redis()
