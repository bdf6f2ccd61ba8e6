"""Reading ring rows: the ``read.lua`` call that reads every selected leaf at the rows one op picks, and
the batch its reply makes.

A uniform or prioritized sample ('U', 'P'), a pop ('F', ``_ring.sample_pop``) and a leased pop ('L',
``_ring.leases``) differ only in that op; the leaves they read, and how the reply becomes a ``Sample``
(the row block's columns split out, heterogeneous rows joined or padded), are the same, and are here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import lazy_stack

from tdstore._engine import held
from tdstore._engine.engine import Engine
from tdstore._format import codec, ragged, row_block
from tdstore._format.keys import KeyTable
from tdstore._format.op_kinds import Read
from tdstore._format.schema import Header, Leaf, NestedPath
from tdstore._plan import padded_batch
from tdstore._plan.call import Call, leaf_checks
from tdstore._plan.read_plan import leaf_read_ops
from tdstore._plan.read_results import het_rows
from tdstore._plan.ring_plan import Sample, generations
from tdstore._plan.values import build_td, columns_maker, display, stack_members


def selected_leaves(h: Header, keys: list[NestedPath] | None) -> list[Leaf]:
    """The leaves a sample reads: every one, or those at or below ``keys`` (``KeyError`` naming a key that matches none)."""
    if keys is None:
        return list(h.leaves.values())
    out = []
    for key in keys:
        found = [leaf for path, leaf in h.leaves.items() if path[: len(key)] == key]
        if not found:
            raise KeyError(f"key {display(key)!r} is not in the store")
        out += [leaf for leaf in found if leaf not in out]
    return out


class RolloutsOn(Exception):
    """A plain sample or pop planned on a ring whose rollout index is on (header field ``ro``): it goes
    through ``_ring.rollouts`` instead, which hides incomplete groups."""


class RowRead(NamedTuple):
    """What a row read reads: its units (leaves, with the row block standing for its columns) and which keys were asked for."""

    leaves: list[Leaf]
    block: Leaf | None
    grouped: list[Leaf]
    wanted: set[NestedPath] | None


def counted_op(engine: Engine, kt: KeyTable) -> list[Any]:
    """The 'A' op counting the rows a sample or pop takes in the store's stats (``lua/_lib.lua`` ``tds_stat``);
    none for a read-only handle, which writes nothing."""
    return [] if engine.readonly else Read.A(kt.block([engine.keys.stats, engine.keys.sampled_rows]), held.held_ms())


def row_read_call(
    engine: Engine, h: Header, keys: list[NestedPath] | None, rows: int, head: Any, parse: Any, request: str | None = None
) -> Call:
    """A ``read.lua`` call whose rows one op picks (``head(kt)``: 'U', 'P' or 'F') and whose other ops read
    every selected leaf at those rows; ``parse(reply, RowRead)`` makes the result. ``request`` (a 'P' or 'F'
    op: a request id) goes before it as an 'N' op, so that a resend reads the rows the first attempt took."""
    if h.rollouts:
        raise RolloutsOn
    selected = selected_leaves(h, keys)
    wanted = None if keys is None else {leaf.path for leaf in selected}
    kt = engine.key_table(h)
    checks = leaf_checks(selected)
    leaves, block, grouped = row_block.units(h, selected)
    named = Read.N(kt.ref(engine.keys.replies), request) if request is not None else []
    # the rows it samples or pops are counted in the store's stats (lua/_lib.lua tds_stat); a read-only handle writes nothing
    counted = counted_op(engine, kt)
    ops = 1 + len(leaves) + bool(named) + bool(counted)
    args: list[Any] = [f"{h.epoch}:K{h.keyset_version}", checks, ops, *named, *counted, *head(kt)]
    args += leaf_read_ops(engine.keys, h, kt, leaves, rows)
    unit = RowRead(leaves, block, grouped, wanted)
    return Call("read", kt.keys, args, lambda reply: parse(reply, unit))


def with_masks(h: Header, dense: dict[NestedPath, torch.Tensor], masks: dict[NestedPath, torch.Tensor], as_tensor: dict[str, Any]) -> None:
    """Add to a sample's ``dense`` leaves the masks ``return_mask`` asks for, where ``tensordict.pad_sequence``
    puts them (under ``"masks"`` or the key it names): a padded key's own, every other key's all True
    along its first dim (a key whose elements all have one length so far is masked like the others)."""
    where = ragged.mask_root(as_tensor, h.leaves)
    for path, t in list(dense.items()):
        m = masks.get(path)
        dense[(*where, *path)] = m if m is not None else torch.ones(t.shape[: min(2, t.ndim)], dtype=torch.bool, device=t.device)


def decode_sample(
    h: Header,
    leaves: list[Leaf],
    reply: list,
    first: int,
    device: torch.device | None,
    block: Leaf | None,
    grouped: list[Leaf],
    as_tensor: dict[str, Any] | None = None,
    wanted: set[NestedPath] | None = None,
) -> Sample:
    """The batch a 'U', 'P' or 'F' op read: slots in ``reply[2]``, rw in ``reply[3]``, the leaves' pieces from ``reply[first]``."""
    slots = torch.from_numpy(codec.unpack_i64(reply[2]).astype(np.int64))
    n = int(slots.numel())
    rw = int(reply[3])
    pieces = reply[first:]
    pos = 0
    dense: dict[NestedPath, torch.Tensor] = {}
    masks: dict[NestedPath, torch.Tensor] = {}
    per_el: dict[NestedPath, list[torch.Tensor]] = {}
    for leaf in leaves:
        if not leaf.het:
            assert leaf.shape is not None
            rows = codec.from_bytes(pieces[pos], leaf.dtype, (n, *leaf.shape))
            if leaf is block:
                dense.update(row_block.split(rows, grouped))
            else:
                dense[leaf.path] = rows
            pos += 1
            continue
        one = None
        kept = leaf.json or padded_batch.varying_root(h, leaf.path) is not None  # never padded (_plan.padded_batch)
        if as_tensor and not kept and not h.inner and h.stack_pos == 0:
            # the rows' shape records and bytes, joined: one padded or jagged tensor, no tensor per row
            one = ragged.build(leaf, codec.unpack_i64(pieces[pos + 1]).reshape(n, leaf.ndim), pieces[pos + 2], as_tensor)
        elif as_tensor and not kept:
            ragged.check_mask(as_tensor, display(leaf.path))
        if isinstance(one, tuple):
            dense[leaf.path], masks[leaf.path] = one
        elif one is not None:
            dense[leaf.path] = one
        else:
            per_el[leaf.path] = het_rows(leaf, h.leaf_inner(leaf.path), n, pieces[pos], pieces[pos + 1], pieces[pos + 2])
        pos += 3
    if block is not None or as_tensor or wanted is not None:  # the store's key order (and only the keys asked for)
        dense = {path: dense[path] for path in h.leaves if path in dense and (wanted is None or path in wanted)}
    others = padded_batch.rest(h, per_el, n, device) if as_tensor and per_el and not h.inner and h.stack_pos == 0 else None
    if others is not None:  # non-tensor keys and sub-trees of varying dims beside the padded keys
        per_el = {}
        if as_tensor and as_tensor.get("return_mask"):
            with_masks(h, dense, masks, as_tensor)
        dense.update(others)
    elif as_tensor and as_tensor.get("return_mask"):
        if per_el:
            ragged.check_mask(as_tensor, display(next(iter(per_el))))
        with_masks(h, dense, masks, as_tensor)
    sp = h.stack_pos
    if not per_el:
        bs = (*h.inner[:sp], n, *h.inner[sp:])
        td = build_td({p: t.movedim(0, sp) if sp else t for p, t in dense.items()}, bs, device, sub=h.sub_dims)
    else:
        rows_of: dict[NestedPath, Any] = {p: t.unbind(0) for p, t in dense.items()}  # one view per row, made in one call
        rows_of.update(per_el)
        if device is None or device.type == "cpu":
            td = stack_members(columns_maker(list(rows_of), 0, torch.Size(h.inner), device, h.sub_dims)(rows_of, n), sp)
        else:  # build_td moves each element to the device
            td = lazy_stack(
                [build_td({p: rows[k] for p, rows in rows_of.items()}, h.inner, device, sub=h.sub_dims) for k in range(n)], dim=sp
            )
    return Sample(td, slots, generations(slots, rw, h.count))
