"""Module paths of earlier releases, still importable, so that pickles made by them load.

A pickle names the module of each class it holds (``tdstore._torchrl_storage.StoreStorage``, say).
When a module moved into a subpackage, importing its old path gives the module at its new path
(the same module object, not a copy), through a finder at the end of ``sys.meta_path``: it is asked
only for names no other finder knows, and it imports nothing until such a name is asked for.

Three old modules have the path of a package now (``tdstore._engine``, ``tdstore._ring``,
``tdstore._checkpoint``): the package answers for the old module's names (:func:`shadowed_attribute`,
called by the package's ``__getattr__``), importing that module only when such a name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "tdstore._batches": "tdstore._engine.batches",
    "tdstore._call": "tdstore._plan.call",
    "tdstore._checkpoint": "tdstore._checkpoint.export_import",
    "tdstore._checkpoint_format": "tdstore._checkpoint.disk_format",
    "tdstore._cli_checkpoint": "tdstore.cli.checkpoint_commands",
    "tdstore._cli_output": "tdstore.cli.output",
    "tdstore._cli_stores": "tdstore.cli.stores",
    "tdstore._codec": "tdstore._format.codec",
    "tdstore._common": "tdstore._front.common",
    "tdstore._connection": "tdstore._engine.connection",
    "tdstore._deadline": "tdstore._engine.deadline",
    "tdstore._demo_actors": "tdstore.demo.actors",
    "tdstore._demo_check": "tdstore.demo.torn_check",
    "tdstore._demo_learner": "tdstore.demo.learner",
    "tdstore._demo_report": "tdstore.demo.report",
    "tdstore._demo_server": "tdstore.demo.server_url",
    "tdstore._dense_ring": "tdstore._ring.dense_methods",
    "tdstore._direct": "tdstore._ring.direct_extend",
    "tdstore._engine": "tdstore._engine.engine",
    "tdstore._headerinfo": "tdstore._format.header_info",
    "tdstore._identity": "tdstore._front.identity",
    "tdstore._index": "tdstore._plan.index",
    "tdstore._inspect_audit": "tdstore._inspect.audit",
    "tdstore._inspect_connect": "tdstore._inspect.connect",
    "tdstore._inspect_read": "tdstore._inspect.headers",
    "tdstore._inspect_results": "tdstore._inspect.results",
    "tdstore._integrity": "tdstore._format.integrity",
    "tdstore._keys": "tdstore._format.keys",
    "tdstore._lazy_element": "tdstore._front.element",
    "tdstore._lazy_keys": "tdstore._front.key_changes",
    "tdstore._lazy_lifecycle": "tdstore._front.lifecycle",
    "tdstore._lazy_reads": "tdstore._front.reading",
    "tdstore._lazy_state": "tdstore._front.state",
    "tdstore._leaf_ops": "tdstore._plan.leaf_writes",
    "tdstore._leases": "tdstore._ring.leases",
    "tdstore._limits": "tdstore._engine.limits",
    "tdstore._nontensor": "tdstore._format.nontensor",
    "tdstore._offsets": "tdstore._format.offsets",
    "tdstore._ops": "tdstore._format.op_kinds",
    "tdstore._policy": "tdstore._format.sampling_policy",
    "tdstore._progress": "tdstore._front.progress",
    "tdstore._ragged": "tdstore._format.ragged",
    "tdstore._reads": "tdstore._plan.read_plan",
    "tdstore._reference": "tdstore._checkpoint.reference",
    "tdstore._replay": "tdstore._ring.lazy_methods",
    "tdstore._ring": "tdstore._ring.extend",
    "tdstore._ring_args": "tdstore._ring.args",
    "tdstore._ring_reads": "tdstore._ring.sample_pop",
    "tdstore._rows": "tdstore._format.row_block",
    "tdstore._sampling": "tdstore._ring.policy_calls",
    "tdstore._schema": "tdstore._format.schema",
    "tdstore._scripts": "tdstore._engine.scripts",
    "tdstore._segments": "tdstore._format.segments",
    "tdstore._server_binary": "tdstore._servers.binary",
    "tdstore._server_tools": "tdstore._servers.probes",
    "tdstore._sharded": "tdstore._shards.ring",
    "tdstore._spread": "tdstore._engine.spread",
    "tdstore._spread_change": "tdstore._engine.spread_change",
    "tdstore._store_base": "tdstore._front.store_base",
    "tdstore._surface": "tdstore._front.tensordict_api",
    "tdstore._tensorclass": "tdstore._format.tensorclass",
    "tdstore._torchrl_checkpoint": "tdstore.torchrl.dumps_loads",
    "tdstore._torchrl_marks": "tdstore._ring.marks",
    "tdstore.torchrl.marks": "tdstore._ring.marks",
    "tdstore._torchrl_rows": "tdstore.torchrl.row_copy",
    "tdstore._torchrl_samplers": "tdstore.torchrl.samplers",
    "tdstore._torchrl_storage": "tdstore.torchrl.storage",
    "tdstore._torchrl_writer": "tdstore.torchrl.writer",
    "tdstore._transport": "tdstore._engine.transport",
    "tdstore._unsupported": "tdstore._front.unsupported",
    "tdstore._upload": "tdstore._front.upload",
    "tdstore._upload_scan": "tdstore._front.upload_scan",
    "tdstore._values": "tdstore._plan.values",
    "tdstore._view": "tdstore._front.stack_view",
    "tdstore._waiting": "tdstore._ring.waiting",
    "tdstore._whole_store": "tdstore._engine.whole_store",
    "tdstore._wire": "tdstore._format.wire",
    "tdstore._write_surface": "tdstore._front.write_surface",
    "tdstore._writes": "tdstore._plan.write_plan",
}


#: Old modules whose path is a package's now -> the module that holds their names.
SHADOWED: dict[str, str] = {name: MOVED[name] for name in ("tdstore._checkpoint", "tdstore._engine", "tdstore._ring")}


def shadowed_attribute(package: str, name: str) -> Any:
    """``package.name`` of an old pickle (``tdstore._ring.Sample``, say): the name of the module that
    the package replaced. A submodule's name is left to the import system (nothing heavy is imported)."""
    here = Path(sys.modules[package].__file__ or "").parent
    if package not in SHADOWED or name.startswith("__") or (here / f"{name}.py").exists() or (here / name).is_dir():
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        return getattr(_new_module(package), name)
    except AttributeError:
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


def _new_module(old: str) -> ModuleType:
    """The module at the new path of the old module ``old`` (a name of the table above, never another)."""
    return importlib.import_module(MOVED[old])


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return _new_module(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path has run already."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader())


def install() -> None:
    """Add the finder once (``import tdstore`` calls this)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
