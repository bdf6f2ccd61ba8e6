"""Tensorclass round trips by name, with an allow-list: nothing the server names is ever imported.

``from_tensordict(tc)`` stores ``module.QualName`` of the tensorclass in the
header.  Reading it back gives an instance only for a class the caller passes
(``tensorclass_cls=``) or that the program registered with
:func:`register_tensorclass`; any other name is left unused, since importing a
module because a server says so would let whoever can write to the server run
code in every reader.
"""

from __future__ import annotations

from typing import Any

from tensordict import is_tensorclass

_REGISTRY: dict[str, type] = {}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_tensorclass(cls: type) -> type:
    """Allow stores uploaded from ``cls`` to come back as ``cls`` instances (usable as a class decorator)."""
    if not is_tensorclass(cls):
        raise TypeError(f"{cls!r} is not a tensorclass")
    _REGISTRY[qualified_name(cls)] = cls
    return cls


def name_of(value: Any) -> str:
    """The name stored for ``value``: its class's, when it is a tensorclass instance, else ''."""
    if is_tensorclass(value) and not isinstance(value, type):
        return qualified_name(type(value))
    return ""


def wrap(store: Any, stored_name: str, cls: type | None) -> Any:
    """``store`` inside an instance of ``cls`` (or of the registered class of ``stored_name``), else ``store`` itself."""
    if cls is not None:
        if not is_tensorclass(cls):
            raise TypeError(f"tensorclass_cls must be a tensorclass, got {cls!r}")
        if stored_name and stored_name != qualified_name(cls):
            raise TypeError(f"the store was uploaded from tensorclass {stored_name!r}, not {qualified_name(cls)!r}")
        return cls._from_tensordict(store)
    registered = _REGISTRY.get(stored_name) if stored_name else None
    return registered._from_tensordict(store) if registered is not None else store
