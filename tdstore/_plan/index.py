"""Index planning: from a Python index over the batch size to the elements and rows it touches.

Pure Python, no I/O.  Any index a tensordict accepts on its batch dims (ints,
slices with steps, lists, index tensors, boolean masks, ``...``) is first put in a
canonical per-dim form, then split into

* ``elements``: the sorted, unique stack elements the index touches, and
* ``local``: an index that selects the same things from a local tensor or lazy
  stack holding only those elements (the stack dim shrunk to ``len(elements)``).

Applying ``local`` to a local copy of just the touched elements gives exactly what
applying the original index to the whole store would: torch does the indexing
semantics (advanced-index broadcasting, dim placement), and the server only ever
sends the touched elements, or the touched rows of them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Component = int | slice | torch.Tensor

# What torch takes as an index tensor (at::native::index and friends): int64 and int32 are
# positions, bool and uint8 are masks (uint8 with torch's deprecation warning); any other
# dtype is refused with IndexError ("tensors used as indices must be long, int, byte or bool
# tensors"). Lists and numpy arrays are read the way torch reads them (indexing_tensor_from_data):
# bool and uint8 stay masks, every other integer type becomes int64 positions.
POSITION_DTYPES = (torch.int64, torch.int32)
MASK_DTYPES = (torch.bool, torch.uint8)
_INT64_MAX = int(np.iinfo(np.int64).max)


def _from_data(i: Any) -> Any:
    """A list, tuple, range or numpy array as torch reads it as an index; anything else unchanged.

    Returns a bool or uint8 tensor (a mask), an int64 tensor (positions), or, for
    data torch would cast from floats, complex numbers, strings or objects, the numpy
    array itself, which ``normalize`` refuses naming its dtype and dim. torch truncates
    a float list or array to int64 positions (``x[[0.7]]`` reads row 0): a store
    refuses it instead, since that cast silently drops data. A uint64 value past
    int64 is refused rather than wrapped to a negative position (as torch does).
    """
    if isinstance(i, (list, tuple, range)):
        arr = np.asarray(i)
        if arr.dtype == object:
            return i
    elif isinstance(i, np.ndarray):
        arr = i
    else:
        return i
    if arr.dtype == np.bool_ or arr.dtype == np.uint8:
        return torch.from_numpy(arr.copy(order="C"))  # keeps a 0-dim array 0-dim (a 0-dim mask)
    if arr.dtype.kind in "iu":
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
            raise IndexError(f"index {int(arr.max())} is out of range for a store (a uint64 index past the int64 range)")
        return torch.from_numpy(arr.astype(np.int64, order="C"))
    if arr.size == 0 and arr.dtype.kind in "fc":
        return torch.zeros(arr.shape, dtype=torch.int64)  # [] is an empty integer index, not a float one
    return arr


def _mask_dims(i: Any) -> int:
    """How many batch dims one index component uses: a mask uses one per dim of its own."""
    if isinstance(i, torch.Tensor) and i.dtype in MASK_DTYPES:
        return max(i.ndim, 1)
    return 1


def _as_mask(i: torch.Tensor, dim: int, batch_size: torch.Size) -> tuple[torch.Tensor, ...]:
    """The positions a bool or uint8 mask over ``dims dim..`` selects, one int64 tensor per dim it covers."""
    mask = i.cpu()
    if mask.ndim == 0:
        raise IndexError(f"a 0-dim mask ({mask.dtype}) is not supported when indexing a store")
    flat: torch.Tensor | None = None
    if mask.dtype == torch.uint8:
        # torch reads a uint8 index as a mask and warns that this is deprecated: the same
        # indexing here raises torch's own warning, in its own words (and as torch does, before
        # the shape of the mask is checked)
        flat = torch.arange(mask.numel()).reshape(mask.shape)[mask]
    want = tuple(batch_size[dim : dim + mask.ndim])
    if tuple(mask.shape) != want:
        raise IndexError(
            f"{'boolean' if mask.dtype == torch.bool else 'uint8'} mask of shape {list(mask.shape)} does not match "
            f"dims {dim}..{dim + mask.ndim - 1} of batch size {list(batch_size)} (expected {list(want)})"
        )
    if flat is None:
        return mask.nonzero(as_tuple=True)
    return tuple(torch.unravel_index(flat, mask.shape))


def _as_tensor_index(t: torch.Tensor, size: int, dim: int, batch_size: torch.Size) -> torch.Tensor:
    """An int64/int32 index tensor as int64 positions in ``0..size-1``; any other dtype is refused, as torch does."""
    if t.dtype not in POSITION_DTYPES:
        raise IndexError(
            f"index tensors must be int64 or int32 (positions) or bool or uint8 (masks), as torch takes them; "
            f"got {t.dtype} for dim {dim} (batch size {list(batch_size)})"
        )
    t = t.to(torch.int64).cpu()
    if not t.numel():
        return t
    a = t.detach().numpy()  # bounds in numpy: a third of the cost of the torch reductions on a batch of indices
    lo, hi = int(a.min()), int(a.max())
    if lo < -size or hi >= size:
        bad = hi if hi >= size else lo
        raise IndexError(f"index {bad} is out of range for dim {dim} of size {size} (batch size {list(batch_size)})")
    return torch.from_numpy(np.where(a < 0, a + size, a)) if lo < 0 else t


def normalize(index: Any, batch_size: torch.Size) -> tuple[Component, ...]:
    """Canonical per-dim form of ``index``: one int, slice or int64 tensor per batch dim.

    Index tensors, lists and numpy arrays mean what they mean to torch (see
    ``POSITION_DTYPES``): a uint8 tensor is a mask, with torch's warning, and an
    index tensor of a dtype torch refuses is refused. Raises ``IndexError`` (naming
    the index or dtype, dim and size) for anything out of range or not an index of
    the batch dims, before any I/O.
    """
    if not isinstance(index, tuple):
        index = (index,)
    ndim = len(batch_size)
    n_ell = sum(1 for i in index if i is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    for i in index:
        if i is None:
            raise IndexError("None (a new axis) is not supported when indexing a store; call to_tensordict() first")
        if isinstance(i, bool):
            raise IndexError("a Python bool is not a valid store index; use a boolean mask tensor")
    given = index
    index = tuple(_from_data(i) for i in index)
    used = sum(_mask_dims(i) for i in index if i is not Ellipsis)
    if used > ndim:
        raise IndexError(f"too many indices for a store of batch size {list(batch_size)}: {given!r}")
    out: list[Component] = []
    for i in index:
        dim = len(out)
        if i is Ellipsis:
            out.extend(slice(0, batch_size[k], 1) for k in range(dim, dim + ndim - used))
            continue
        if isinstance(i, torch.Tensor) and i.dtype in MASK_DTYPES:
            out.extend(_as_mask(i, dim, batch_size))
            continue
        size = batch_size[dim]
        # a 0-dim tensor of any integer dtype is one position, for torch too (it is not an index tensor)
        if isinstance(i, (int, np.integer)) or (
            isinstance(i, torch.Tensor) and i.ndim == 0 and not (i.is_floating_point() or i.is_complex())
        ):
            v = int(i)
            if not -size <= v < size:
                raise IndexError(f"index {v} is out of range for dim {dim} of size {size} (batch size {list(batch_size)})")
            out.append(v % size)
        elif isinstance(i, slice):
            for part in (i.start, i.stop, i.step):
                if part is not None and not isinstance(part, (int, np.integer)):
                    raise IndexError(f"slice bounds must be ints, got {i!r}")
            if i.step == 0:
                raise ValueError("slice step cannot be zero")
            out.append(slice(*i.indices(size)))
        elif isinstance(i, torch.Tensor):
            out.append(_as_tensor_index(i, size, dim, batch_size))
        elif isinstance(i, np.ndarray):
            raise IndexError(
                f"index lists and arrays must hold integers or booleans; got {i.dtype} for dim {dim} (batch size {list(batch_size)})"
            )
        else:
            raise IndexError(f"unsupported index {i!r} of type {type(i).__name__} for a store")
    out.extend(slice(0, batch_size[k], 1) for k in range(len(out), ndim))
    return tuple(out)


def positions(index: Any, size: int) -> tuple[torch.Tensor, bool]:
    """The positions ``index`` selects along one dim of ``size`` (a ring's slots), as a 1-D int64
    tensor, and whether ``index`` names one position (an int: a call then takes one element).

    The one meaning of an index for every call that takes slots (``update_priority``,
    ``update_if``, torchrl's storage paths) as for indexing (``store[index]``, ``get_at``,
    ``set_at_``): :func:`normalize` over a batch of ``size``, so a bool or uint8 tensor, list or
    array is a mask (torch's meaning, with its warning for uint8), ints, lists, ranges, slices,
    int tensors and arrays are positions (negative ones counting from the end), and floats,
    0-dim masks and anything out of range raise ``IndexError``. A position tensor of several
    dims is read in order (flattened).
    """
    (c,) = normalize(index, torch.Size([size]))
    if isinstance(c, int):
        return torch.tensor([c], dtype=torch.int64), True
    if isinstance(c, slice):
        return torch.arange(c.start, c.stop, c.step, dtype=torch.int64), False
    return c.reshape(-1), False


@dataclass(frozen=True)
class Plan:
    """Where an index lands: the touched elements and the index into a local copy of them."""

    elements: torch.Tensor  # sorted unique int64 element ids
    local: tuple[Component, ...]
    stack_pos: int
    element_int: bool  # the stack dim is indexed by an int (it disappears from the result)
    inner_full: bool  # every inner dim is a full slice: whole elements are touched
    flips: tuple[int, ...] = ()  # dims of the local copy to reverse before applying ``local``

    @property
    def n(self) -> int:
        return int(self.elements.numel())


def plan(norm: tuple[Component, ...], batch_size: torch.Size, stack_pos: int) -> Plan:
    """Split a normalized index into touched elements and a local index (see the module doc).

    torch has no negative slice steps. A reversed slice keeps its meaning (a basic
    index that keeps its dim in place, whatever advanced indices stand beside it) by
    flipping that dim of the local copy first and slicing it forward: ``flips`` lists
    those dims.
    """
    s = norm[stack_pos]
    local_s: Component
    flips: list[int] = []
    if isinstance(s, int):
        elements = torch.tensor([s], dtype=torch.int64)
        local_s = 0
    elif isinstance(s, slice):
        picked = range(s.start, s.stop, s.step)
        # sorted ascending: a reversed slice's elements backwards (flipped back below)
        if not picked:
            elements = torch.zeros(0, dtype=torch.int64)
        elif s.step > 0:
            elements = torch.arange(s.start, s.stop, s.step, dtype=torch.int64)
        else:
            elements = torch.arange(picked[-1], s.start + 1, -s.step, dtype=torch.int64)
        local_s = slice(0, len(picked), 1)
        if s.step < 0:
            flips.append(stack_pos)
    else:
        elements, inverse = torch.unique(s, sorted=True, return_inverse=True)
        local_s = inverse
    local: list[Component] = []
    for k, c in enumerate(norm):
        if k == stack_pos:
            local.append(local_s)
        elif isinstance(c, slice) and c.step < 0:
            n = batch_size[k]
            flips.append(k)
            local.append(slice(n - 1 - c.start, n - 1 - c.stop, -c.step))
        else:
            local.append(c)
    inner_full = all(isinstance(c, slice) and c == slice(0, n, 1) for k, (c, n) in enumerate(zip(norm, batch_size)) if k != stack_pos)
    return Plan(elements, tuple(local), stack_pos, isinstance(s, int), inner_full, tuple(flips))


def is_full(norm: tuple[Component, ...], batch_size: torch.Size) -> bool:
    """Whether ``norm`` selects every position of every dim, in order."""
    return all(isinstance(c, slice) and c == slice(0, n, 1) for c, n in zip(norm, batch_size))


def run_bounds(sorted_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inclusive ``(lo, hi)`` bounds of the runs of consecutive values (each one more than the last), in order.

    Usually of sorted unique ids; ids in any order work too (a random batch read as asked).
    """
    if sorted_ids.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    breaks = np.nonzero(np.diff(sorted_ids) != 1)[0]
    lo = sorted_ids[np.concatenate(([0], breaks + 1))]
    hi = sorted_ids[np.concatenate((breaks, [sorted_ids.size - 1]))]
    return lo.astype(np.int64), hi.astype(np.int64)


def runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Group sorted unique ids into inclusive ``(lo, hi)`` runs of consecutive values."""
    if sorted_ids.size == 1:
        v = int(sorted_ids[0])
        return [(v, v)]
    lo, hi = run_bounds(sorted_ids)
    return list(zip(lo.tolist(), hi.tolist()))


#: One (int64, int64) pair as script arguments pack them: ``PAIR.pack(start, length)``, ``PAIR.pack(first, last)``.
PAIR = struct.Struct("<qq")


def pack_pairs(a: np.ndarray, b: np.ndarray) -> bytes:
    """Interleave two int64 arrays as little-endian (a0, b0, a1, b1, ...) for a script argument."""
    out = np.empty(2 * a.size, dtype="<i8")
    out[0::2] = a
    out[1::2] = b
    return out.tobytes()


def storage_rows(p: Plan, inner: tuple[int, ...]) -> torch.Tensor:
    """Storage row ids (element * prod(inner) + flat inner position) selected by the plan.

    The result has the shape of the indexed batch: row ``P[k]`` of the leaf feeds
    position ``k`` of the result.
    """
    inner_numel = int(np.prod(inner)) if inner else 1
    if p.element_int and p.inner_full:  # the common store[i] case: one element, all its rows
        e = int(p.elements[0])
        return torch.arange(e * inner_numel, (e + 1) * inner_numel).reshape(inner)
    grid = (p.elements[:, None] * inner_numel + torch.arange(inner_numel)).reshape(p.n, *inner)
    grid = grid.movedim(0, p.stack_pos)
    if p.flips:
        grid = grid.flip(p.flips)
    return grid[p.local]


def whole_element(index: Any, batch_size: torch.Size, stack_pos: int) -> int | None:
    """The element id when ``index`` selects exactly one whole element (``i``, or ``i`` at the stack dim and ``:`` elsewhere), else None.

    The hot path of ``store[i]``: recognised without normalising or planning.
    """
    if type(index) is int:
        if stack_pos != 0:
            return None
        comp: Any = index
    elif type(index) is tuple and len(index) == len(batch_size):
        comp = index[stack_pos]
        if type(comp) is not int:
            return None
        for d, c in enumerate(index):
            if d != stack_pos and not (
                type(c) is slice and c.step in (None, 1) and c.start in (None, 0) and (c.stop is None or c.stop >= batch_size[d])
            ):
                return None
    else:
        return None
    n = batch_size[stack_pos]
    if not -n <= comp < n:
        return None  # out of range: the general path raises the IndexError
    return comp % n
