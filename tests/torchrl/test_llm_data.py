"""LLM rollouts as a ragged store or buffer holds them, against torchrl's ``LazyStackStorage``.

Each rollout holds a chat (torchrl's ``History``, whose batch dims are its number of messages: 2, 3,
4 here), a prompt string, JSON values, ragged tokens and a reward; or torchrl's LLM tensorclasses as
its wrappers and ``ChatEnv`` write them (``Text``, ``Tokens``, ``Masks``, ``LogProbs``, ``ChatHistory``).
Every read, sample, pop, checkpoint and attach must give what the same calls give on
``ReplayBuffer(storage=LazyStackStorage(n))``, with the chats back as ``History`` instances.
"""

from __future__ import annotations

import multiprocessing as mp
import warnings
from typing import Any

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, lazy_stack

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.data.llm import History
    from torchrl.data.llm.topk import TopKRewardSelector
    from torchrl.modules.llm.policies import ChatHistory, LogProbs, Masks, Text, Tokens

from tdstore import LazyStackedTensorDictStore, export_checkpoint, import_checkpoint
from tdstore.torchrl import replay_buffer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def chat(n: int, tag: Any) -> History:
    """A chat of ``n`` messages (batch size ``[n]``), as ``History.from_chats`` makes it."""
    msgs = [{"role": ("user", "assistant")[k % 2], "content": f"{tag}: message {k}"} for k in range(n)]
    return History.from_chats([msgs])[0]


def rollout(i: int) -> TensorDict:
    """Rollout ``i``: a chat of 2, 3 or 4 messages, strings and JSON beside ragged tokens."""
    return TensorDict(
        history=chat(2 + i % 3, i),
        prompt=f"prompt {i}",
        meta=NonTensorData({"step": i, "tags": ["a", "b"][: 1 + i % 2]}),
        tokens=torch.arange(1 + i % 5) + 10 * i,
        reward=torch.tensor([float(i)]),
    )


def llm_step(i: int) -> TensorDict:
    """What an LLM env step writes with torchrl's tensorclasses (a wrapper's output in history mode)."""
    n = 1 + i % 3
    prompt, response = torch.arange(3 + i % 2), torch.arange(n) + 100
    full = torch.cat([prompt, response])
    return TensorDict(
        text=Text(prompt=f"p{i}", response=f"r{i}", full=f"p{i}r{i}"),
        tokens=Tokens(prompt=prompt, response=response, full=full, padded=False),
        masks=Masks(all_attention_mask=torch.ones(full.numel(), dtype=torch.bool), all_assistant_mask=full >= 100, padded=False),
        log_probs=LogProbs(response=-torch.rand(n), padded=False),
        history=ChatHistory(prompt=chat(1 + i % 2, i), full=chat(2 + i % 3, i)),
        reward=torch.tensor([float(i)]),
    )


def row_view(td: TensorDictBase) -> dict[str, Any]:
    """One rollout as plain values, to compare across storages."""
    out: dict[str, Any] = {}
    for key in ("history", ("history", "prompt"), ("history", "full")):
        node = td.get(key, None) if isinstance(key, tuple) and "history" in td.keys() else td.get(key, None)
        if isinstance(node, History):
            out[str(key)] = (type(node).__name__, list(node.role), list(node.content))
        elif node is not None:
            out[str(key)] = type(node).__name__
    for key in ("prompt", "meta", ("text", "full"), ("tokens", "padded")):
        if key in td.keys(include_nested=True):
            out[str(key)] = td.get(key)
    for key in ("tokens", "reward", ("tokens", "response"), ("masks", "all_assistant_mask"), ("log_probs", "response")):
        v = td.get(key, None) if key in td.keys(include_nested=True, leaves_only=True) else None
        if isinstance(v, torch.Tensor):
            out[str(key)] = v.tolist()
    for key in ("text", "tokens", "masks", "log_probs"):
        if key in td.keys():
            out[f"class:{key}"] = type(td.get(key)).__name__
    return out


def rows(td: TensorDictBase) -> list[dict[str, Any]]:
    return [row_view(td[i]) for i in range(td.batch_size[0])]


def reference(items: list[TensorDict], size: int = 16) -> ReplayBuffer:
    ref = ReplayBuffer(storage=LazyStackStorage(size), batch_size=4)
    ref.extend(items)
    return ref


# -- lazy stores -------------------------------------------------------------------------------


def test_from_lazy_stack_keeps_chats_of_any_length_and_reads_them_back_as_history(one_node):
    items = [rollout(i) for i in range(6)]
    local = lazy_stack(items)
    store = LazyStackedTensorDictStore.from_lazy_stack(local, **one_node.kwargs())
    ref = reference(items)
    assert rows(store[:]) == rows(ref[:]) == rows(local)
    assert isinstance(store[:]["history"], History)
    one = store[4].to_tensordict()
    assert isinstance(one["history"], History) and one["history"].batch_size == (3,)
    assert row_view(one) == row_view(ref[4])
    assert rows(store[[5, 1, 1]]) == rows(ref[[5, 1, 1]])
    assert rows(store[torch.tensor([2, 0])]) == rows(ref[torch.tensor([2, 0])])
    assert rows(store[1:5:2]) == rows(ref[1:5:2])
    assert list(store[3]["history"].role) == ["user", "assistant"]
    again = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs())
    assert rows(again[:]) == rows(local)


def test_a_chat_of_another_length_written_into_a_store_of_one_length_stays_readable(one_node):
    items = [rollout(3 * i) for i in range(4)]  # every chat of 2 messages: the upload records [2]
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(items), **one_node.kwargs())
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs())
    assert rows(other[:]) == rows(lazy_stack(items))  # a handle that cached the [2] header
    store[1] = rollout(2)  # 4 messages
    items[1] = rollout(2)
    assert rows(store[:]) == rows(lazy_stack(items))
    assert rows(other[:]) == rows(lazy_stack(items))  # the stale handle is refused, refreshes, reads right
    assert row_view(other[1].to_tensordict()) == row_view(rollout(2))


def test_a_sub_tree_with_another_number_of_batch_dims_is_refused_before_anything_is_written(one_node):
    def el(n: int, dims: list[int]) -> TensorDict:
        return TensorDict(x=TensorDict(a=torch.zeros(n, 3), batch_size=dims), batch_size=[])

    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([el(2, [2]), el(3, [3])]), **one_node.kwargs())
    before = store[:].get(("x", "a"), as_list=True)
    with pytest.raises(ValueError, match="'x' has 1 batch dims beyond the element's in some elements but 2"):
        store[0] = el(2, [2, 3])
    assert [t.shape for t in store[:].get(("x", "a"), as_list=True)] == [t.shape for t in before]
    store[0] = el(4, [4])  # another length: fine
    assert store[0].to_tensordict()["x"].batch_size == (4,)


def test_llm_tensorclasses_come_back_as_their_classes(one_node):
    items = [llm_step(i) for i in range(5)]
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(items), **one_node.kwargs())
    ref = reference(items)
    got = store[:]
    assert rows(got) == rows(ref[:])
    for key, cls in (("text", Text), ("tokens", Tokens), ("masks", Masks), ("log_probs", LogProbs), ("history", ChatHistory)):
        assert isinstance(store[2].to_tensordict()[key], cls), key
    assert isinstance(store[2].to_tensordict()["history"].full, History)
    assert list(store[4].to_tensordict()["history"].full.content) == [f"4: message {k}" for k in range(3)]


# -- ragged torchrl buffers ----------------------------------------------------------------------


def test_a_ragged_buffer_gives_what_lazy_stack_storage_gives(one_node):
    rb = replay_buffer(16, ragged=True, batch_size=4, **one_node.kwargs())
    ref = ReplayBuffer(storage=LazyStackStorage(16), batch_size=4)
    for i in range(3):  # one rollout at a time, as a group transform releases them: the first fixes nothing
        rb.add(rollout(i))
        ref.add(rollout(i))
    for b in (rb, ref):
        b.extend(lazy_stack([rollout(3), rollout(4)]))
        b.extend([rollout(5), rollout(6), rollout(7)])  # a list of tensordicts, as LazyStackStorage takes it
    assert len(rb) == len(ref) == 8
    assert rows(rb[:]) == rows(ref[:])
    assert row_view(rb[6]) == row_view(ref[6])
    assert rows(rb[[7, 0]]) == rows(ref[[7, 0]])
    assert isinstance(rb[:]["history"], History)
    got, info = rb.sample(return_info=True)
    assert rows(got) == rows(ref[info["index"]])
    for i in range(8, 20):  # past the capacity: the ring overwrites, as LazyStackStorage's does
        rb.add(rollout(i))
        ref.add(rollout(i))
    assert rows(rb[:]) == rows(ref[:])


def test_padded_nested_and_masked_samples_beside_strings_and_chats(one_node):
    items = [rollout(i) for i in range(7)]
    ring = LazyStackedTensorDictStore(count=8, **one_node.kwargs())
    ring.extend(lazy_stack(items))
    rb = replay_buffer(8, ragged=True, batch_size=5, **one_node.kwargs())
    rb.extend(items)
    for kw in (
        dict(as_padded_tensor=True),
        dict(as_padded_tensor=True, return_mask=True, padding_side="left", padding_value=-1),
        dict(as_nested_tensor=True),
    ):
        for how in ("store", "buffer"):
            if how == "store":
                s = ring.sample(5, **kw)
                got, index = s.td, s.indices
            else:
                got, info = rb.sample(return_info=True, **kw)
                index = info["index"]
            assert type(got) is TensorDict and got.batch_size == (5,), (how, kw)
            want = [items[int(i)] for i in index]
            assert list(got["prompt"]) == [w["prompt"] for w in want]
            assert [list(got["history"][k].content) for k in range(5)] == [list(w["history"].content) for w in want]
            assert isinstance(got["history"], History)
            tokens = got["tokens"]
            if kw.get("as_nested_tensor"):
                assert [t.tolist() for t in tokens.unbind(0)] == [w["tokens"].tolist() for w in want]
                continue
            longest = max(len(w["tokens"]) for w in want)
            assert tokens.shape == (5, longest)
            pad = kw.get("padding_value", 0)
            for k, w in enumerate(want):
                n = len(w["tokens"])
                if kw.get("padding_side", "right") == "right":
                    data, fill = tokens[k, :n], tokens[k, n:]
                else:
                    data, fill = tokens[k, longest - n :], tokens[k, : longest - n]
                assert data.tolist() == w["tokens"].tolist() and (fill == pad).all()
            if kw.get("return_mask"):
                mask = got["masks", "tokens"]
                assert mask.sum(1).tolist() == [len(w["tokens"]) for w in want]
                assert "prompt" not in got["masks"].keys()


def test_a_ragged_lazy_ring_pops_rollouts_in_write_order(one_node):
    items = [rollout(i) for i in range(6)]
    ring = LazyStackedTensorDictStore(count=8, **one_node.kwargs())
    for i in range(6):  # one rollout a call, as a lazy stack or a list (LazyStackStorage takes both)
        ring.extend(lazy_stack([items[i]]) if i % 2 else [items[i]])
    first = ring.pop(4)
    assert rows(first.td) == rows(lazy_stack(items[:4]))
    assert first.indices.tolist() == [0, 1, 2, 3]
    rest = ring.pop(4)
    assert rows(rest.td) == rows(lazy_stack(items[4:]))


def test_checkpoints_keep_chats_and_their_class(one_node, tmp_path):
    items = [rollout(i) for i in range(5)] + [llm_step(i) for i in range(0)]
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack(items), **one_node.kwargs())
    export_checkpoint(store, tmp_path / "ck")
    back = import_checkpoint(tmp_path / "ck", td_id="chats-back", **one_node.kwargs())
    assert rows(back[:]) == rows(lazy_stack(items))
    assert isinstance(back[:]["history"], History)

    rb = replay_buffer(8, ragged=True, **one_node.kwargs())
    rb.extend(items)
    rb.dumps(tmp_path / "rb")
    rb2 = replay_buffer(8, ragged=True, **one_node.kwargs())
    rb2.loads(tmp_path / "rb")
    ref = reference(items, 8)
    assert rows(rb2[:]) == rows(ref[:])


def test_steps_with_llm_tensorclasses_through_a_ragged_buffer(one_node):
    items = [llm_step(i) for i in range(6)]
    rb = replay_buffer(8, ragged=True, batch_size=3, **one_node.kwargs())
    rb.extend(items[:2])
    for step in items[2:]:
        rb.add(step)
    ref = reference(items, 8)
    assert rows(rb[:]) == rows(ref[:])
    with pytest.raises(ValueError, match="return_mask would put the masks under"):
        rb.sample(as_padded_tensor=True, return_mask=True)  # "masks" is a key of these steps
    got = rb.sample(as_padded_tensor=True, return_mask="pad_masks")
    assert isinstance(got["tokens"], Tokens) and isinstance(got["history"], ChatHistory) and isinstance(got["text"], Text)
    assert got["tokens", "response"].shape[0] == 3 and got["pad_masks", "tokens", "response"].dtype == torch.bool
    assert isinstance(got["history"].full, History)


def test_topk_reward_selector_on_a_ragged_buffer_matches_memory(one_node):
    def groups() -> list[LazyStackedTensorDict]:
        steps = [
            TensorDict(
                {
                    ("next", "done"): torch.full((1, 1), True),
                    ("next", "reward"): torch.full((i % 7 + 2, 1), float(i % 5)),
                    ("text", "prompt"): f"Prompt {i // 5}",
                    "history": chat(2 + i % 3, i),
                }
            )
            for i in range(30)
        ]
        return list(lazy_stack(steps).chunk(15))

    mem = ReplayBuffer(storage=LazyStackStorage(40), batch_size=4)
    rb = replay_buffer(40, ragged=True, batch_size=4, tensordict=False, **one_node.kwargs())
    for b in (mem, rb):
        b.append_transform(TopKRewardSelector(total_dialog_turns=5, topk_size=3, verbose=False))
        for g in groups():
            b.extend(g)
    assert len(rb) == len(mem) > 0
    want, got = mem[:], rb[:]
    assert got.get(("next", "reward"), as_list=True) is not None
    rewards = [[t.tolist() for t in x.get(("next", "reward"), as_list=True)] for x in (got, want)]
    assert rewards[0] == rewards[1]
    assert [list(got[i]["history"].content) for i in range(len(rb))] == [list(want[i]["history"].content) for i in range(len(mem))]


# -- another process ----------------------------------------------------------------------------


def _attached_rows(url: str, prefix: str, td_id: str, out: Any) -> None:
    import warnings as _w

    _w.simplefilter("ignore")
    from torchrl.data.llm import History as _History  # noqa: F401  (the class a reader knows)

    from tdstore.torchrl import attach

    rb = attach(td_id, url=url, prefix=prefix)
    got = rb[:]
    out.put((type(got["history"]).__name__, rows(got), list(rb.sample(3, as_padded_tensor=True)["prompt"])))


def test_another_process_attaches_and_reads_the_chats(real):
    items = [rollout(i) for i in range(5)]
    kw = real.kwargs()
    rb = replay_buffer(8, ragged=True, **kw)
    rb.extend(items)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_attached_rows, args=(kw["url"], kw["prefix"], rb.storage.td_id, out))
    p.start()
    cls_name, got_rows, prompts = out.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert cls_name == "History"
    assert got_rows == rows(reference(items, 8)[:])
    assert set(prompts) <= {f"prompt {i}" for i in range(5)}


# -- hostile server content ---------------------------------------------------------------------


def test_a_tensorclass_the_server_names_is_never_imported(one_node):
    import json
    import sys

    from tdstore import StoreFormatError

    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([rollout(i) for i in range(3)]), **one_node.kwargs())
    client, meta = one_node.client(), store.stack_ops.engine.keys.meta
    raw = client.hget(meta, "schema")
    schema = json.loads(raw)
    assert schema["tc"] == [[["history"], "torchrl.data.llm.history.History"]]
    schema["tc"] = [[["history"], "tdstore_evil_module_xyz.Chat"]]
    client.hset(meta, "schema", json.dumps(schema))
    got = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs())[:]
    assert "tdstore_evil_module_xyz" not in sys.modules
    assert not isinstance(got["history"], History)  # the plain sub-tree: nothing imported, the data all there
    assert [list(got[i]["history", "content"]) for i in range(3)] == [list(rollout(i)["history"].content) for i in range(3)]
    schema["tc"] = [[["history"], "os.system('x')"]]
    client.hset(meta, "schema", json.dumps(schema))
    with pytest.raises(StoreFormatError):
        LazyStackedTensorDictStore.from_store(td_id=store.td_id, **one_node.kwargs())
    client.hset(meta, "schema", raw)


def test_a_padded_sample_beside_strings_and_chats_is_one_round_trip(real):
    from helpers import round_trips, top_level_commands

    ring = LazyStackedTensorDictStore(count=8, **real.kwargs())
    ring.extend(lazy_stack([rollout(i) for i in range(6)]))
    ring.sample(2, as_padded_tensor=True)  # the header cached, the scripts loaded
    got: list[Any] = []
    sent = round_trips(top_level_commands(real.client, lambda: got.append(ring.sample(4, as_padded_tensor=True, return_mask=True))))
    assert len(sent) == 1, sent
    assert isinstance(got[0].td["history"], History) and got[0].td["tokens"].shape[0] == 4


def test_a_varying_sub_tree_that_cannot_show_its_dims_is_refused_before_anything_is_written(one_node):
    def el(n: int) -> TensorDict:  # a sub-tree holding one value covering it whole: its dims show nowhere
        return TensorDict(x=TensorDict(note=NonTensorData("same", batch_size=[n]), batch_size=[n]), batch_size=[])

    with pytest.raises(ValueError, match="'x' has batch dims that differ between elements but holds no tensor"):
        LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([el(2), el(3)]), **one_node.kwargs())
    store = LazyStackedTensorDictStore.from_lazy_stack(lazy_stack([el(2), el(2)]), **one_node.kwargs())
    with pytest.raises(ValueError, match="holds no tensor or non-tensor stack"):
        store[1] = el(3)
    assert store[1].to_tensordict()["x"].batch_size == (2,)


def test_a_sharded_ragged_buffer_keeps_chats_and_pads_across_shards(redis_cluster):
    items = [rollout(i) for i in range(9)]
    rb = replay_buffer(12, ragged=True, batch_size=4, url=redis_cluster.url, spread=True, prefix="llm-sharded")
    rb.extend(items[:1])
    rb.extend(items[1:4])
    rb.extend(items[4:])
    assert sorted(map(str, rows(rb[:]))) == sorted(map(str, rows(lazy_stack(items))))
    by_prompt = {it["prompt"]: row_view(it) for it in items}
    for _ in range(3):  # rows of several shards, each padded to its own longest: joined, then padded once
        got = rb.storage._store.sample(6, as_padded_tensor=True, return_mask=True).td
        assert isinstance(got["history"], History) and got["tokens"].shape[0] == 6
        want = [by_prompt[p] for p in got["prompt"]]
        assert got["masks", "tokens"].sum(1).tolist() == [len(w["tokens"]) for w in want]
        assert [list(got["history"][k].content) for k in range(6)] == [w["history"][2] for w in want]
    rb.storage.delete()
