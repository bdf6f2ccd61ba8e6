"""Turning what users write into leaves, and what the engine reads into tensordicts.

Writes: a TensorDict, lazy stack, tensorclass, dict or tensor becomes a mapping
``path -> tensor`` (dense) or ``path -> [tensor per element]`` (a lazy stack whose
elements differ), with keys present in only some elements of a lazy stack
reported instead of dropped, and non-tensor leaves refused by name.

Reads: engine results become a ``TensorDict`` when every leaf is homogeneous, or a
``LazyStackedTensorDict`` along the store's stack dim when elements differ.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from tensordict import (
    LazyStackedTensorDict,
    NestedKey,
    NonTensorData,
    TensorDict,
    TensorDictBase,
    is_non_tensor,
    is_tensorclass,
    lazy_stack,
)
from tensordict.base import _is_leaf_nontensor

from tdstore._format import tensorclass
from tdstore._format.nontensor import NonTensor
from tdstore._format.schema import RAGGED, NestedPath, SubTrees, merge_sub
from tdstore._format.tensorclass import qualified_name
from tdstore._plan.index import Plan
from tdstore._plan.read_results import DenseResult, ElementsResult


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a read or an upload makes many small objects.

    Reference counting still frees everything; the pause only spares the collector
    from walking every live object of the program several times over.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def as_path(key: Any) -> NestedPath:
    """A NestedKey as a tuple of str (``"a"`` -> ``("a",)``; nested tuples flattened)."""
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple):
        out: list[str] = []
        for k in key:
            out.extend(as_path(k))
        if not out:
            raise KeyError("an empty key is not a valid key")
        return tuple(out)
    raise TypeError(f"a key must be a str or a tuple of str, got {type(key).__name__}: {key!r}")


def display(path: NestedPath) -> str | NestedPath:
    return path[0] if len(path) == 1 else path


def exclusive_keys(stack: LazyStackedTensorDict) -> set:
    """Leaf keys present in some but not all elements of a lazy stack (recursively)."""
    members = stack.tensordicts
    sets: list[set[NestedPath]] = []
    for td in members:
        if isinstance(td, LazyStackedTensorDict):
            extra = exclusive_keys(td)
            if extra:
                return extra
        sets.append({as_path(k) for k in td.keys(include_nested=True, leaves_only=True)})
    if not sets:
        return set()
    first, *rest = sets
    return first.union(*rest) - first.intersection(*rest)


def _check_member_dtypes(stack: LazyStackedTensorDict, key: Any, path: NestedPath) -> None:
    """Stacking a lazy stack's members would silently promote mixed dtypes: refuse them by name."""
    dtypes = set()
    for member in stack.tensordicts:
        t = member.get(key)
        if isinstance(t, torch.Tensor):
            dtypes.add(t.dtype)
    if len(dtypes) > 1:
        raise TypeError(
            f"key {display(path)!r} has several dtypes across the elements ({sorted(map(str, dtypes))}); every element must use one dtype"
        )


def usable_device(device: Any) -> bool:
    """Whether tensors can be made on ``device`` on this machine (a store made on a GPU machine may be read on another)."""
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError):
        return False
    return True


def check_device(device: torch.device | None) -> torch.device | None:
    """``device``, refused when reads could not land there: ``meta`` (it would discard every byte read) or
    a device this machine does not have (found now, not at the first read)."""
    if device is None:
        return None
    if device.type == "meta":
        raise ValueError("device='meta' holds no data: every read would be discarded; pass a real device, or None for CPU tensors")
    if not usable_device(device):
        raise ValueError(f"device {str(device)!r} is not available on this machine (torch cannot make a tensor there)")
    return device


def _check_tensor(path: NestedPath, value: Any) -> torch.Tensor | NonTensor:
    if is_non_tensor(value):
        return NonTensor(value)
    if isinstance(value, str):
        return NonTensor(NonTensorData(value))
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            raise TypeError(f"key {display(path)!r}: nested (jagged) tensors are not supported; write a lazy stack of its elements")
        if value.layout != torch.strided:
            raise TypeError(f"key {display(path)!r}: a {value.layout} tensor has no dense storage to store; write value.to_dense()")
        if value.is_meta or value.device.type == "meta":
            raise TypeError(f"key {display(path)!r}: a tensor on the meta device holds no data to store")
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(
        f"key {display(path)!r}: got a {type(value).__name__}; a store holds tensors, and non-tensor values "
        "wrapped as NonTensorData / NonTensorStack (or plain str)"
    )


def _plain_leaves(td: TensorDict, prefix: NestedPath, out: dict[NestedPath, Any]) -> bool:
    """Add the checked leaves of a tree of plain TensorDicts holding plain tensors to ``out``; False
    (``out`` partly filled) at anything else, which the general walk handles."""
    for key, value in td._tensordict.items():
        if type(value) is TensorDict:
            if not _plain_leaves(value, (*prefix, key), out):
                return False
        elif type(value) is torch.Tensor:
            path = (*prefix, key)
            # a plain tensor needs only _check_tensor's layout checks (it words the error)
            out[path] = _check_tensor(path, value) if value.is_nested or value.is_meta or value.layout != torch.strided else value
        else:
            return False
    return True


def leaves_of(value: Any, stack_pos: int, prefix: NestedPath = ()) -> dict[NestedPath, Any]:
    """The leaves of a value to write, keyed by full path under ``prefix``.

    A lazy stack key whose elements differ in shape comes as a list of element
    tensors (split along ``stack_pos``); a non-tensor value (``NonTensorData``,
    ``NonTensorStack``, a str) as a :class:`~tdstore._format.nontensor.NonTensor`;
    everything else as one dense tensor.
    """
    if is_non_tensor(value) or isinstance(value, str):
        if not prefix:
            raise TypeError(f"expected a TensorDict, a dict or a tensorclass, got {type(value).__name__}")
        return {prefix: _check_tensor(prefix, value)}
    if is_tensorclass(value):
        value = value._tensordict
    if isinstance(value, Mapping) and not isinstance(value, TensorDictBase):
        out: dict[NestedPath, Any] = {}
        for k, v in value.items():
            out.update(
                leaves_of(v, stack_pos, prefix + as_path(k))
                if (isinstance(v, (Mapping, TensorDictBase)) or is_tensorclass(v)) and not is_non_tensor(v)
                else {prefix + as_path(k): _check_tensor(prefix + as_path(k), v)}
            )
        return out
    if isinstance(value, TensorDictBase):
        if getattr(value, "_tdstore_reads_remote", False):
            value = value.to_tensordict()
        lazy = isinstance(value, LazyStackedTensorDict)
        if lazy:
            extra = exclusive_keys(value)
            if extra:
                names = sorted(display(prefix + p) for p in extra)
                raise ValueError(f"keys {names} are present in only some elements of the lazy stack; every element must hold the same keys")
        if not lazy and type(value) is TensorDict:
            # the common case (store[i] = td): its key dicts read directly when the tree holds only
            # plain TensorDicts and tensors (a third of an element write's client time went to
            # tensordict's general walk), else one pass over the items
            out = {}
            if _plain_leaves(value, prefix, out):
                return out
            out = {}
            for key, leaf in value.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
                path = prefix + ((key,) if isinstance(key, str) else key)
                out[path] = _check_tensor(path, leaf)
            return out
        elements: list[TensorDictBase] | None = None
        out = {}
        for key in value.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
            path = prefix + as_path(key)
            if lazy:
                _check_member_dtypes(value, key, path)
            try:
                leaf = value.get(key)
            except RuntimeError:
                if not lazy:
                    raise
                if elements is None:
                    elements = list(value.unbind(stack_pos))
                out[path] = [_check_tensor(path, el.get(key)) for el in elements]
                continue
            out[path] = _check_tensor(path, leaf)
        return out
    if not prefix:
        raise TypeError(f"expected a TensorDict, a dict or a tensorclass, got {type(value).__name__}")
    return {prefix: _check_tensor(prefix, value)}


def subtree_dims(td: Any, n_batch: int, prefix: NestedPath = ()) -> dict[NestedPath, tuple[int, ...]]:
    """The nested sub-trees of ``td`` whose batch size has dims beyond its first ``n_batch``:
    ``{path: extra dims}`` (what :attr:`Header.sub` records, e.g. a chat ``("chat", "prompt")`` of ``[5, 1]``).
    Of a lazy stack, its members' merged: a dim they disagree on is ``RAGGED`` (chats of several lengths)."""
    out: dict[NestedPath, tuple[int, ...]] = {}
    if is_tensorclass(td):
        td = td._tensordict
    if isinstance(td, LazyStackedTensorDict) and td.tensordicts:
        # the members hold the sub-trees (items() would stack leaves that differ in shape)
        if n_batch <= 0:
            return out  # stacked along a sub-tree's own dims (a chat History): its dims are recorded above
        for member in td.tensordicts:
            out = merge_sub(out, subtree_dims(member, n_batch - 1, prefix))
        return out
    for key, value in td.items():
        if is_tensorclass(value):
            value = value._tensordict
        if not isinstance(value, TensorDictBase) or is_non_tensor(value):
            continue
        path = (*prefix, key)
        if len(value.batch_size) > n_batch:
            out[path] = tuple(value.batch_size[n_batch:])
        out.update(subtree_dims(value, n_batch, path))
    return out


def subtree_layout(td: Any, n_batch: int, prefix: NestedPath = (), *, vary: bool = False) -> SubTrees:
    """What a write of ``td`` tells of its nested sub-trees (:class:`SubTrees`): their extra batch dims
    (:func:`subtree_dims`) and tensorclasses (:func:`subtree_classes`). With ``vary`` (a lazy ring's
    first write: later rows may hold chats of other lengths), the dims of every sub-tree that holds a
    leaf showing them (a tensor or a non-tensor stack) are recorded as ``RAGGED``."""
    dims = subtree_dims(td, n_batch, prefix)
    if vary and dims:
        carriers = _dim_carriers(td, prefix)
        dims = {p: (RAGGED,) * len(d) if p in carriers else d for p, d in dims.items()}
    return SubTrees(dims, subtree_classes(td, prefix))


def _dim_carriers(td: Any, prefix: NestedPath) -> set[NestedPath]:
    """The sub-trees of ``td`` (of its first member, for a lazy stack) holding a tensor or a non-tensor stack."""
    if is_tensorclass(td):
        td = td._tensordict
    if isinstance(td, LazyStackedTensorDict) and not is_non_tensor(td) and td.tensordicts:
        td = td.tensordicts[0]
    out: set[NestedPath] = set()
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        if isinstance(value, NonTensorData):
            continue
        path = (*prefix, *as_path(key))
        out.update(path[:k] for k in range(len(prefix) + 1, len(path)))
    return out


def refuse_unshown(td: Any, paths: Any, prefix: NestedPath = ()) -> None:
    """Refuse (``ValueError``, before anything is written) sub-trees ``paths`` whose batch dims vary
    between elements when ``td`` holds no leaf under one of them that shows its dims (only
    ``NonTensorData``, which covers the whole sub-tree): a read could not tell their dims."""
    carriers = _dim_carriers(td, prefix)
    for path in paths:
        if path not in carriers:
            raise ValueError(
                f"sub-tree {display(path)!r} has batch dims that differ between elements but holds no tensor or non-tensor "
                "stack to show them (only values covering it whole); add one, or keep its batch dims the same in every element"
            )


def subtree_conflicts(
    h_sub: Mapping[NestedPath, tuple[int, ...]], sub: Mapping[NestedPath, tuple[int, ...]]
) -> dict[NestedPath, tuple[int, ...]]:
    """The sub-trees a write's dims ``sub`` disagree on with the store's (``Header.sub``), merged
    (the dims that differ become ``RAGGED``): what the write turns into sub-trees of varying dims.
    A number of dims that differs raises ``ValueError`` (before anything is written)."""
    out = {}
    for path, dims in sub.items():
        have = h_sub.get(path)
        if have is not None and have != dims:
            merged = merge_sub({path: have}, {path: dims})[path]
            if merged != have:
                out[path] = merged
    return out


def subtree_classes(td: Any, prefix: NestedPath = ()) -> dict[NestedPath, str]:
    """The nested sub-trees of ``td`` that are tensorclass instances: ``{path: "module.QualName"}``
    (what :attr:`Header.classes` records). Of a lazy stack, the classes all its members agree on."""
    if is_tensorclass(td):
        td = td._tensordict
    if isinstance(td, LazyStackedTensorDict) and not is_non_tensor(td):
        if not td.tensordicts:
            return {}
        found = [subtree_classes(m, prefix) for m in td.tensordicts]
        return {p: name for p, name in found[0].items() if all(f.get(p) == name for f in found[1:])}
    out: dict[NestedPath, str] = {}
    for key, value in td.items():
        if is_non_tensor(value):  # NonTensorData/NonTensorStack are leaves
            continue
        path = (*prefix, key)
        if is_tensorclass(value):
            out[path] = qualified_name(type(value))
            value = value._tensordict
        if isinstance(value, TensorDictBase):
            out.update(subtree_classes(value, path))
    return out


def build_td(
    leaves: dict[NestedPath, torch.Tensor],
    batch_size: torch.Size | tuple[int, ...],
    device: torch.device | None,
    under: NestedPath = (),
    sub: dict[NestedPath, tuple[int, ...]] | None = None,
) -> TensorDict:
    """A TensorDict of ``leaves`` (the part below ``under``), on ``device``.

    The tensors were just made from server bytes with the right batch dims, so the
    TensorDict is built without re-validating them (``_new_unsafe``).  ``sub`` gives
    the extra batch dims of nested sub-trees (``Header.sub_dims``).
    """
    if device is not None and device.type != "cpu":
        leaves = {path: t.to(device, non_blocking=True) for path, t in leaves.items()}
    cut = len(under)
    return _element_maker([path for path in leaves if path[:cut] == under], cut, torch.Size(batch_size), device, sub)(leaves)


def _subtree_bs(base: torch.Size, path: NestedPath, sub: dict[NestedPath, tuple[int, ...]] | None) -> torch.Size:
    """The batch size of the sub-tree at ``path`` in a read of batch size ``base``: ``base`` and the
    extra dims of the deepest recorded sub-tree holding it."""
    if sub:
        for k in range(len(path), 0, -1):
            dims = sub.get(path[:k])
            if dims is not None:
                return torch.Size((*base, *dims))
    return base


def _element_maker(
    paths: list[NestedPath], cut: int, base: torch.Size, device: torch.device | None, sub: dict[NestedPath, tuple[int, ...]] | None = None
) -> Callable[[dict[NestedPath, torch.Tensor]], TensorDict]:
    """A function building one TensorDict from a ``{path: tensor}`` holding ``paths`` (each keyed by
    what follows its first ``cut`` parts): the key tree is worked out once, so the elements of one
    read share it instead of walking their paths one by one.  ``base`` is the read's batch size;
    each sub-tree adds its extra dims from ``sub``."""
    entries = _key_tree(paths, cut)
    parts = [
        (key, _element_maker(target, cut + 1, base, device, sub) if isinstance(target, list) else None, target) for key, target in entries
    ]
    new = _level_factory(paths, cut, base, device, sub)

    def make(el: dict[NestedPath, torch.Tensor]) -> TensorDict:
        return new({key: el[target] if below is None else below(el) for key, below, target in parts})

    return make


def _level_factory(
    paths: list[NestedPath], cut: int, base: torch.Size, device: torch.device | None, sub: dict[NestedPath, tuple[int, ...]] | None
) -> Callable[[dict[NestedKey, Any]], Any]:
    """The maker of one level of a read's key tree (the sub-tree at ``paths[0][:cut]``): a TensorDict of
    the sub-tree's batch size (of each element's own when it varies, :data:`RAGGED`), in the tensorclass
    it was written as when the program knows that class (:class:`SubTrees`)."""
    bs = _subtree_bs(base, paths[0][:cut], sub) if paths and cut else base
    new = _ragged_factory(bs, device) if RAGGED in bs else _td_factory(bs, device)
    classes = getattr(sub, "classes", None)
    if not (classes and paths and cut):
        return new
    cls = tensorclass.known(classes.get(paths[0][:cut], ""))
    if cls is None:
        return new
    wrap = cls._from_tensordict
    return lambda source: wrap(new(source))


def _ragged_factory(batch_size: torch.Size | tuple[int, ...], device: torch.device | None) -> Callable[[dict[NestedKey, Any]], TensorDict]:
    """A function making a sub-tree whose batch dims vary between elements (``RAGGED`` in ``batch_size``):
    each element's come from its own leaves (a tensor's leading dims, a non-tensor stack's or a nested
    sub-tree's batch size); a non-tensor value covering the whole sub-tree (``NonTensorData``) takes them."""
    n = len(batch_size)

    def make(source: dict[NestedKey, Any]) -> TensorDict:
        got: tuple[int, ...] | None = None
        for v in source.values():
            dims = tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v.batch_size)
            if len(dims) >= n:  # (a NonTensorData of a varying sub-tree holds fewer: it takes them below)
                got = dims[:n]
                break
        if got is None or any(d != RAGGED and d != g for d, g in zip(batch_size, got)):
            raise ValueError(
                f"a stored element's sub-tree of keys {sorted(map(str, source))} does not show its batch dims {list(batch_size)} "
                "(-1: varying) in any of its leaves"
            )
        for k, v in source.items():
            if isinstance(v, NonTensorData) and tuple(v.batch_size) != got:
                source[k] = NonTensorData(v.data, batch_size=list(got))
        return TensorDict._new_unsafe(source=source, batch_size=torch.Size(got), device=device)

    return make


def _key_tree(paths: list[NestedPath], cut: int) -> list[tuple[str, Any]]:
    """The keys of one level (what follows the first ``cut`` parts of ``paths``), in first-seen order:
    ``(key, full path)`` for a leaf, ``(key, [paths below it])`` for a sub-tree."""
    entries: list[tuple[str, Any]] = []
    subtrees: dict[str, list[NestedPath]] = {}
    for path in paths:
        rel = path[cut:]
        if len(rel) <= 1:
            entries.append((path[-1], path))
        elif rel[0] not in subtrees:
            subtrees[rel[0]] = [path]
            entries.append((rel[0], subtrees[rel[0]]))
        else:
            subtrees[rel[0]].append(path)
    return entries


def columns_maker(
    paths: list[NestedPath], cut: int, base: torch.Size, device: torch.device | None, sub: dict[NestedPath, tuple[int, ...]] | None = None
) -> Callable[[Mapping[NestedPath, Any], int], list[TensorDict]]:
    """A function building the ``n`` TensorDicts of a read from its columns (``{path: one tensor per
    element}``), level by level: each sub-tree's members are built once for all the elements, and each
    member from ``zip``ped columns, without a ``{path: tensor}`` dict per element (see ``_element_maker``)."""
    entries = _key_tree(paths, cut)
    keys = [key for key, _ in entries]
    below = [columns_maker(target, cut + 1, base, device, sub) if isinstance(target, list) else None for _, target in entries]
    new = _level_factory(paths, cut, base, device, sub)

    def make(columns: Mapping[NestedPath, Any], n: int) -> list[TensorDict]:
        if not entries:
            return [new({}) for _ in range(n)]
        cols = [columns[target] if sub_make is None else sub_make(columns, n) for (_, target), sub_make in zip(entries, below)]
        return [new(dict(zip(keys, values))) for values in zip(*cols)]

    return make


#: The attributes a TensorDict that ``_new_unsafe`` builds from tensors has, in tensordict 0.15.
_TD_STATE = frozenset({"_device", "_tensordict", "_batch_size", "_td_dim_names"})


@lru_cache(maxsize=256)
def _td_factory(batch_size: torch.Size, device: torch.device | None) -> Callable[[dict[NestedKey, Any]], TensorDict]:
    """A function making a TensorDict of batch size ``batch_size`` from a dict of ready tensors and
    sub-TensorDicts: what ``TensorDict._new_unsafe`` makes, in a fifth of its time.

    A heterogeneous batch is one TensorDict per element (and per nested sub-tree), and
    ``_new_unsafe`` walks its arguments for each (about 4 us an element here); these
    elements come from server bytes with the right shapes, so the factory fills the four
    attributes ``_new_unsafe`` would set. It checks once that ``_new_unsafe`` still makes
    exactly those (a tensordict release that adds state gets ``_new_unsafe`` itself).
    """
    probe = TensorDict._new_unsafe(source={"x": torch.zeros(*batch_size, 1)}, batch_size=batch_size, device=device)
    state = vars(probe)
    if set(state) != _TD_STATE or state["_td_dim_names"] is not None:
        return lambda source: TensorDict._new_unsafe(source=source, batch_size=batch_size, device=device)
    stored_bs, stored_device = state["_batch_size"], state["_device"]
    blank = object.__new__

    def make(source: dict[NestedKey, Any]) -> TensorDict:
        td = blank(TensorDict)
        d = td.__dict__
        d["_tensordict"] = source
        d["_batch_size"] = stored_bs
        d["_device"] = stored_device
        d["_td_dim_names"] = None
        return td

    return make


def stack_members(tds: list[TensorDict], dim: int) -> LazyStackedTensorDict:
    """The lazy stack of ``tds``, TensorDicts one maker made (``columns_maker``: one batch size, one device):
    tensordict's unchecked constructor, a fifth of ``lazy_stack``'s time for 256 members, whose
    checks (each member a tensordict on the stack's device) these members pass by construction."""
    unchecked = getattr(LazyStackedTensorDict, "_new_lazy_unsafe", None)
    if unchecked is None or not tds:
        return lazy_stack(tds, dim=dim)
    return unchecked(*tds, stack_dim=dim)


def assemble(
    plan: Plan | None,
    result: DenseResult | ElementsResult,
    inner: tuple[int, ...],
    device: torch.device | None,
    under: NestedPath = (),
    sub: dict[NestedPath, tuple[int, ...]] | None = None,
) -> TensorDictBase:
    """Turn an engine read into the tensordict the index asked for (``sub``: ``Header.sub_dims``)."""
    if isinstance(result, DenseResult):
        return build_td(result.leaves, result.batch_size, device, under, sub)
    n = len(result.ids)
    if device is None or device.type == "cpu":
        paths = [p for p in result.paths if p[: len(under)] == under]
        return _stacked(plan, columns_maker(paths, len(under), torch.Size(inner), device, sub)(result.columns, n), True)
    # another device: build_td moves each element there
    return _stacked(plan, [build_td({p: c[k] for p, c in result.columns.items()}, inner, device, under, sub) for k in range(n)], False)


def _flipped(td: TensorDict, dim: int) -> TensorDict:
    """``td`` with every tensor flipped along ``dim`` (``apply`` returns None only for a function returning None)."""
    out = td.apply(lambda t: t.flip(dim))
    assert out is not None
    return out


def _stacked(plan: Plan | None, tds: list[TensorDict], uniform: bool) -> TensorDictBase:
    """The elements read (``tds``, in id order) as the index asked for them: one element, or a lazy
    stack, reversed, repeated or sliced as the plan says (``uniform``: one factory made them all)."""
    assert plan is not None
    if plan.element_int and plan.inner_full:
        return tds[0]
    if not tds:
        raise IndexError("the index selects no element of a store with heterogeneous keys")
    sp = plan.stack_pos
    for d in plan.flips:  # reversed slices: flip the local copy, then slice forward
        if d == sp:
            tds = tds[::-1]
        else:
            el_dim = d if d < sp else d - 1
            tds = [_flipped(td, el_dim) for td in tds]
    local = plan.local
    if sp == 0 and len(local) == 1 and isinstance(local[0], torch.Tensor) and local[0].ndim == 1 and local[0].dtype == torch.int64:
        # a batch of elements read once each, in another order or repeated: pick the members as
        # LazyStackedTensorDict indexing does (a repeated element is the same member), without its machinery
        members = [tds[i] for i in local[0].tolist()]
        return stack_members(members, 0) if uniform else lazy_stack(members, dim=0)
    stacked = stack_members(tds, sp) if uniform else lazy_stack(tds, dim=sp)
    if all(isinstance(c, slice) and c == slice(0, n, 1) for c, n in zip(local, stacked.batch_size)):
        return stacked
    return stacked[local]
