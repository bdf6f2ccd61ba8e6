"""The TensorDictBase hooks a server-backed store cannot honour, each with a clear error.

A store's leaves are bytes on a server, not tensors that can share memory, so
views (``view``, ``permute``, ``transpose``, ``squeeze``, ``unsqueeze``), vmap
batching and in-place memory-mapping cannot work on them.  Each hook raises and
names the alternative, instead of silently doing something else.
"""

from __future__ import annotations

from typing import Any

from tdstore._front.common import MixinBase


def _msg(obj: Any, op: str, hint: str = "Call to_tensordict() first and work on the local copy.") -> str:
    return f"{type(obj).__name__} does not support {op}: its leaves live on a server. {hint}"


class StoreUnsupported(MixinBase):
    """Mixin listed before ``TensorDictBase`` so these bodies replace its abstract hooks."""

    def _view(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_msg(self, "view", "Call reshape() or to_tensordict() first."))

    def _transpose(self, dim0: int, dim1: int) -> Any:
        raise RuntimeError(_msg(self, "transpose"))

    def _permute(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_msg(self, "permute"))

    def _squeeze(self, dim: int | None = None) -> Any:
        raise RuntimeError(_msg(self, "squeeze"))

    def _unsqueeze(self, dim: int) -> Any:
        raise RuntimeError(_msg(self, "unsqueeze"))

    def _add_batch_dim(self, *, in_dim: int, vmap_level: int) -> Any:
        raise RuntimeError(_msg(self, "vmap"))

    def _remove_batch_dim(self, vmap_level: int, batch_size: Any, out_dim: int) -> Any:
        raise RuntimeError(_msg(self, "vmap"))

    def _maybe_remove_batch_dim(self, funcname: str, vmap_level: int, batch_size: Any, out_dim: int) -> Any:
        raise RuntimeError(_msg(self, "vmap"))

    def _select(self, *keys: Any, inplace: bool = False, strict: bool = True, set_shared: bool = True) -> Any:
        raise NotImplementedError(_msg(self, "select", "Call to_tensordict().select(...) for a local copy."))

    def _exclude(self, *keys: Any, inplace: bool = False, set_shared: bool = True) -> Any:
        raise NotImplementedError(_msg(self, "exclude", "Call to_tensordict().exclude(...) for a local copy."))

    def _rename_keys(self, pairs: Any, *, strict: bool, prune_root: bool) -> Any:
        raise NotImplementedError(_msg(self, "rename_keys", "Use rename_key_(old, new), which renames on the server."))

    def _stack_onto_(self, list_item: Any, dim: int) -> Any:
        raise RuntimeError(_msg(self, "stacking onto it", "Write with store[index] = td instead."))

    def share_memory_(self) -> Any:
        # NotImplementedError, as tensordict.store raises (ported code may catch it)
        raise NotImplementedError(_msg(self, "share_memory_", "The store is already shared through its server."))

    def _memmap_(self, *, inplace: bool = True, **kwargs: Any) -> Any:
        if inplace:
            raise RuntimeError(_msg(self, "memmap_ (in place)", "Use store.memmap(prefix) for a memory-mapped local copy."))
        return self.to_tensordict()._memmap_(inplace=False, **kwargs)
