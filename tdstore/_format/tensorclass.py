"""Tensorclass round trips by name, with an allow-list: nothing the server names is ever imported.

``from_tensordict(tc)`` stores ``module.QualName`` of the tensorclass in the
header (``store._tensorclass_cls``, public ``store.tensorclass_path``).  Reading it
back gives an instance of the class, wrapping the store, when the class can be had
without importing anything the server names:

* the caller passes it (``tensorclass_cls=Cls``) or its dotted path
  (``tensorclass_cls="pkg.mod.Cls"``): the caller's own choice, so that module is imported;
* the program registered it with :func:`register_tensorclass`;
* the module the stored path names is already in ``sys.modules`` (looked up, never imported).

Otherwise the plain store comes back with a warning naming the path and how to pass
it.  Importing a module because a server says so would let whoever can write to the
server run code in every reader (``tensordict.store`` does import it).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

from tensordict import is_tensorclass

# a tensorclass has no nominal type (the decorator makes plain classes): type[Any] lets its class methods be called
_REGISTRY: dict[str, type[Any]] = {}


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


def _walk(obj: Any, attrs: list[str], *, plain: bool = False) -> Any:
    """``obj.a.b...``; with ``plain``, by ``__dict__`` lookups only, so no module ``__getattr__``
    (a lazy importer) runs for a name the server gave."""
    for attr in attrs:
        if plain:
            obj = vars(obj).get(attr) if hasattr(obj, "__dict__") else None
        else:
            obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


def _from_loaded(path: str) -> type[Any] | None:
    """The class at ``path`` when its module is already imported (``sys.modules`` only; nothing is imported)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            found = _walk(module, parts[cut:], plain=True)
            if isinstance(found, type) and is_tensorclass(found) and qualified_name(found) == path:
                return found
    return None


def _import_path(path: str) -> type[Any]:
    """The class at a dotted path the caller gave: its module is imported (the caller chose it)."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ValueError(f"tensorclass_cls {path!r} is not a dotted path 'module.ClassName'")
    err: Exception | None = None
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError as e:
            err = err or e
            continue
        found = _walk(module, parts[cut:])
        if found is not None:
            if not (isinstance(found, type) and is_tensorclass(found)):
                raise TypeError(f"tensorclass_cls {path!r} names {found!r}, which is not a tensorclass")
            return found
    raise ImportError(f"tensorclass_cls {path!r}: no such class could be imported ({err})") from err


def known(stored_name: str) -> type[Any] | None:
    """The tensorclass ``stored_name`` names when the program registered it or its module is imported
    already (``sys.modules``, by ``__dict__`` lookups: no module ``__getattr__`` runs), else None;
    nothing is imported and nothing warns. What :func:`resolve` finds without a class given."""
    return _REGISTRY.get(stored_name) or _from_loaded(stored_name) if stored_name else None


def resolve(stored_name: str, cls: type | str | None) -> type[Any] | None:
    """The tensorclass to wrap a store in, or None (see the module docstring); warns when the class is unavailable."""
    if isinstance(cls, str):
        cls = _import_path(cls)
    if cls is not None:
        if not is_tensorclass(cls) or not isinstance(cls, type):
            raise TypeError(f"tensorclass_cls must be a tensorclass or its dotted path, got {cls!r}")
        if stored_name and stored_name != qualified_name(cls):
            raise TypeError(f"the store was uploaded from tensorclass {stored_name!r}, not {qualified_name(cls)!r}")
        return cls
    if not stored_name:
        return None
    found = known(stored_name)
    if found is None:
        warnings.warn(
            f"the store was uploaded from tensorclass {stored_name!r}, which was not given, not registered, and is not a "
            f"tensorclass of an imported module; returning the plain store (a module the server names is never imported). Pass "
            f"tensorclass_cls={stored_name!r} (or the class itself), or call tdstore.register_tensorclass(cls) first, "
            "to get an instance of the class",
            UserWarning,
            stacklevel=4,
        )
    return found


def wrap(store: Any, stored_name: str, cls: type | str | None) -> Any:
    """``store`` inside an instance of its tensorclass (see :func:`resolve`), else ``store`` itself."""
    found = resolve(stored_name, cls)
    return found._from_tensordict(store) if found is not None else store
