"""The lifetime of a lazy store and of its handles: closing, time to live, deletion, pickling."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tdstore._engine import whole_store
from tdstore._engine.connection import ConnectionSpec
from tdstore._engine.engine import Engine
from tdstore._format.keys import StoreKeys
from tdstore._format.schema import Header
from tdstore._front.common import ttl_to_ms
from tdstore._front.state import LazyState


class LazyLifecycle(LazyState):
    """Close a handle, expire or delete the store on the server, and carry a handle to another process."""

    def close(self) -> None:
        """Close this handle's connection; the data stays on the server (see :meth:`clear_redis`).

        A client passed in with ``client=`` is left open (it is the caller's).
        Using the handle again opens a new connection.  ``with store: ...``
        closes it at the end of the block.
        """
        self._engine.close()

    def expire(self, seconds: float) -> None:
        """Make the whole store expire in ``seconds``: every key gets the same deadline, in one call (a
        store of more than ~1,000 keys: in batches, the header outliving every key meanwhile, so the
        store never reads in part; see ``lua/README.md``, Whole-store calls in batches).

        Keys added later (new keys, a key that becomes heterogeneous) take the same
        deadline, so the store never expires in part.
        """
        ms = ttl_to_ms(seconds)
        if ms == 0:
            raise ValueError(f"expire needs a positive number of seconds, got {seconds!r}; use persist() to remove the time to live")
        whole_store.expire(self._engine, ms)

    def persist(self) -> None:
        """Remove the store's time to live (every key), in one call (in batches, as :meth:`expire`)."""
        whole_store.expire(self._engine, 0)

    def ttl(self) -> float | None:
        """Seconds left before the store expires, or ``None`` when it has no time to live."""
        ms = self._engine.ttl_ms()
        return None if ms is None else ms / 1000

    def clear_redis(self) -> int:
        """Delete every key of this store, and nothing else. Returns the count deleted.

        One call; a store of more than ~1,000 keys goes in batches under a tombstone header that
        every other call reads as a deleted store (a client dying half-way leaves what the next
        ``clear_redis``, ``tdstore rm`` or creation of the same id deletes). The handle gives its connection
        back to the process's shared pool, where the next store opened takes it (using the handle again
        takes one)."""
        deleted = whole_store.clear(self._engine)
        self._engine.idle()
        return deleted

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Any:
        last = self._last_op_queue[-1] if getattr(self, "_last_op_queue", None) else None
        result = super().__exit__(exc_type, exc_val, exc_tb)
        if last is None:
            self.close()
        return result

    def __getstate__(self) -> dict[str, Any]:
        spec = self._engine.spec
        return {
            # the connection spec's fields, not the object: a pickle names no private class (issue 39)
            "spec": {f.name: getattr(spec, f.name) for f in fields(spec)},
            "prefix": self._engine.keys.prefix,
            "td_id": self._engine.keys.td_id,
            "header": self._engine.header.fields(),
            "backend": self._backend,
            "device": self._device,
            "cache_metadata": self._cache_metadata,
            "is_locked": self._is_locked,
            "readonly": self._engine.readonly,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        spec = state["spec"]  # a ConnectionSpec in pickles made before its fields were pickled
        engine = Engine(
            ConnectionSpec(**spec) if isinstance(spec, dict) else spec,
            StoreKeys(state["prefix"], state["td_id"]),
            readonly=state.get("readonly", False),
        )
        engine.set_header(Header.from_fields(state["header"]))
        self._init_handle(engine, backend=state["backend"], device=state["device"], cache_metadata=state["cache_metadata"])
        if state.get("is_locked"):
            self.lock_()
