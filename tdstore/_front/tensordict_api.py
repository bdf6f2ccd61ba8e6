"""How the store classes answer the rest of the ``TensorDictBase`` surface.

``TensorDictBase`` builds most of its methods out of ``get``/``set`` of single
keys and ``empty()`` copies; on a server that would mean one round trip per key,
and for heterogeneous keys a stack that cannot be formed.  Instead, each method
here is answered in one of three ways, chosen per method (the README's surface
table lists them all):

* **local copy**: out-of-place methods (arithmetic, comparisons, reductions, casts,
  shape ops, ``apply``...) read the store once, in one atomic call, and return the
  method's result on that in-memory copy (a ``TensorDict``, or a lazy stack when
  keys are heterogeneous).  The store is not changed.
* **through a copy, written back**: the same methods called with ``inplace=True``
  read once, compute locally, and write the result back in one more atomic call
  (two calls, not atomic together, like ``add_``).
* **clear error**: what cannot mean anything for bytes on a server (gradients,
  data pointers) raises, naming the alternative.

``torch`` functions (``torch.stack``, ``torch.cat``, ``torch.testing``...) given a
store or an element view work on their local copies the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdstore._front.common import MixinBase

#: Out-of-place methods answered on a local copy.
LOCAL_METHODS: tuple[str, ...] = (
    # arithmetic and maths
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "sigmoid", "sign", "sin", "sinh",
    "sqrt", "tan", "tanh", "trunc", "add", "sub", "mul", "div", "pow", "mod", "rsub", "clamp", "clamp_max",
    "clamp_min", "maximum", "minimum", "lerp", "addcdiv", "addcmul", "softmax", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "isfinite", "isnan", "isneginf", "isposinf",
    "isreal", "masked_fill", "where",
    # reductions
    "sum", "mean", "nanmean", "nansum", "prod", "std", "var", "max", "min", "amax", "amin", "cummax", "cummin",
    "logsumexp", "norm", "quantile", "all", "any",
    # dtype casts and detaching
    "type", "double", "float", "half", "bfloat16", "int", "bool", "float16", "float32", "float64", "int8",
    "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "complex32", "complex64", "complex128",
    "detach", "as_tensor",
    # shape ops (each returns new tensors)
    "reshape", "flatten", "unflatten", "expand", "expand_as", "repeat", "repeat_interleave", "broadcast_to",
    "flip", "flipud", "fliplr", "roll", "tile", "narrow", "split", "chunk", "tensor_split", "to_padded_tensor",
    "densify", "to_lazystack", "pad",
    # function application
    "apply", "named_apply", "map", "map_iter",
    # new tensordicts shaped like the store
    "empty", "new_empty", "new_full", "new_ones", "new_zeros", "new_tensor", "memmap_like",
    # export and metadata computed from the data
    "tolist", "to_dict", "numpy", "bytes", "param_count", "get_item_shape", "non_tensor_items",
    "filter_non_tensor_data", "split_keys", "consolidate", "replace", "attrs", "to_namedtuple",
    "to_struct_array", "masked_select", "gather", "to", "cpu", "cuda",
)  # fmt: skip

#: Methods that write the store in place when given ``inplace=True`` (else local copies).
INPLACE_KWARG = {"apply", "named_apply", "roll", "flip"}

#: In-place methods answered as one read, a local update and one write back.
THROUGH_COPY: tuple[str, ...] = ("masked_fill_", "load_", "load_memmap_")

#: Binary and unary operators: local copies, as ``TensorDict`` operators return new tensordicts.
OPERATORS: tuple[str, ...] = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__pow__", "__rpow__", "__mod__", "__neg__", "__abs__", "__and__", "__or__", "__xor__", "__invert__",
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
)  # fmt: skip

#: What cannot apply to bytes on a server: raise and name the alternative.
REFUSED: dict[str, str] = {
    "data_ptr": "a store's leaves have no local memory; to_tensordict().data_ptr() gives a local copy's",
    "requires_grad_": "a store holds no gradients; call to_tensordict().requires_grad_() on a local copy",
    "zero_grad": "a store holds no gradients",
    "create_nested": "a store cannot hold an empty sub-tree; set a leaf under the nested key instead",
    "auto_device_": "the device of reads is set with store.device = ... (or device= at creation)",
    "pin_memory": "a store's leaves live on a server; pin a local copy: to_tensordict().pin_memory()",
}


def materialize(obj: Any) -> Any:
    """``obj`` with every store or element view (in lists, tuples and dicts too) replaced by its local copy."""
    if getattr(obj, "_tdstore_reads_remote", False):
        return obj.to_tensordict()
    if isinstance(obj, list):
        return [materialize(o) for o in obj]
    if isinstance(obj, tuple):
        out = [materialize(o) for o in obj]
        return type(obj)(*out) if hasattr(obj, "_fields") else tuple(out)  # namedtuples take fields
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    return obj


def _path(key: Any) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _local(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = materialize(args), materialize(kwargs)
        if name in INPLACE_KWARG and kwargs.get("inplace"):
            return self._inplace_on_copies(lambda local: getattr(local, name)(*args, **kwargs))
        return getattr(self.to_tensordict(), name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (
        f"On a local copy: reads the store in one atomic call and returns ``TensorDict.{name}`` of that copy; "
        "the store is not changed"
        + (" (with ``inplace=True``: computed on a copy, then written back in one more call)." if name in INPLACE_KWARG else ".")
    )
    return method


def _through_copy(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = materialize(args), materialize(kwargs)
        local = self.to_tensordict()
        getattr(local, name)(*args, **kwargs)
        self._write_local(local)
        return self

    method.__name__ = method.__qualname__ = name
    method.__doc__ = (
        f"Through a copy: reads the store, applies ``TensorDict.{name}`` locally and writes the result back "
        "(two atomic calls, not atomic together)."
    )
    return method


def _operator(name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any) -> Any:
        return getattr(self.to_tensordict(), name)(*materialize(args))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"On a local copy: ``TensorDict.{name}`` of the store's data (one read)."
    return method


def _refused(name: str, why: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{type(self).__name__}.{name} is not supported: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not supported: {why}."
    return method


class SurfaceMixin(MixinBase):
    """Listed before ``TensorDictBase`` in a store class's bases, so these answers replace its defaults."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """torch functions (``torch.stack``, ``torch.cat``...) run on local copies of the stores they are given."""
        return func(*materialize(args), **materialize(kwargs or {}))

    @property  # type: ignore[misc]  # read-only: a store holds no gradients to set
    def grad(self) -> Any:
        raise RuntimeError(f"{type(self).__name__} holds no gradients; a local copy (to_tensordict()) can")

    @property  # type: ignore[misc]  # read-only: the data lives on the server, set by writes
    def data(self) -> Any:
        """A local copy of the data (``TensorDict.data`` detaches; a store holds no autograd graph)."""
        return self.to_tensordict()

    def select(self, *keys: Any, inplace: bool = False, strict: bool = True) -> Any:  # type: ignore[override]  # no as_tensordict: a copy is one
        """A local copy of ``keys``; ``inplace=True`` deletes every other key on the server instead."""
        if not inplace:
            return self.to_tensordict().select(*keys, strict=strict)
        keep = {_path(k) for k in keys}
        doomed = [k for k in self.keys(include_nested=True, leaves_only=True) if not any(_path(k)[: len(p)] == p for p in keep)]
        return self._delete_keys(doomed)

    def exclude(self, *keys: Any, inplace: bool = False) -> Any:
        """A local copy without ``keys``; ``inplace=True`` deletes them on the server (one atomic call)."""
        if not inplace:
            return self.to_tensordict().exclude(*keys)
        present = [k for k in keys if k in self.keys(include_nested=True)]
        return self._delete_keys(present)

    def separates(self, *keys: Any, default: Any = None, strict: bool = True, filter_empty: bool = True) -> Any:
        """Local copies of ``keys``, which are deleted from the store (two atomic calls: read, then delete)."""
        out = self.to_tensordict().select(*keys, strict=strict)
        self.exclude(*keys, inplace=True)
        return out

    def filter_empty_(self) -> Any:
        """A store holds no empty sub-trees (a nested key exists only through its leaves): nothing to remove."""
        return self

    def clear_device_(self) -> Any:
        """Reads land on the CPU with no device from now on (the data on the server is not touched)."""
        self.device = None  # type: ignore[assignment]  # a store's device setter takes None: reads land on the CPU
        return self


for _name in LOCAL_METHODS:
    setattr(SurfaceMixin, _name, _local(_name))
for _name in THROUGH_COPY:
    setattr(SurfaceMixin, _name, _through_copy(_name))
for _name in OPERATORS:
    setattr(SurfaceMixin, _name, _operator(_name))
for _name, _why in REFUSED.items():
    setattr(SurfaceMixin, _name, _refused(_name, _why))
del _name, _why


def surface_table() -> list[tuple[str, str]]:
    """``(method, how it is answered)`` for the generated rows of the README's table."""
    rows = [(n, "local copy" + (" (inplace=True: through a copy)" if n in INPLACE_KWARG else "")) for n in LOCAL_METHODS]
    rows += [(n, "through a copy") for n in THROUGH_COPY]
    rows += [(n, "local copy (operator)") for n in OPERATORS]
    rows += [(n, "clear error") for n in REFUSED]
    return rows


__all__ = ["SurfaceMixin", "materialize", "surface_table", "torch"]
