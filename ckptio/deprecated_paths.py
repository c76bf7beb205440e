"""Module paths of ckptio 0.2's flat layout, which moved into packages: ``import ckptio.convert`` (and
every other old path below) still works for this release, giving the module at its new path with a
``DeprecationWarning`` that names it. The next release removes these aliases."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

#: old path -> new path, or the modules an old one was split into (their public names together)
MOVED: dict[str, str | tuple[str, ...]] = {
    "ckptio.layout": ("ckptio.format.names", "ckptio.format.rules", "ckptio.format.records", "ckptio.format.v1"),
    "ckptio.compact": "ckptio.format.v3",
    "ckptio.compact_decode": "ckptio.format.v3_decode",
    "ckptio.stored_items": "ckptio.format.stored_items",
    "ckptio.codec": "ckptio.format.codec",
    "ckptio.chunks": "ckptio.format.chunks",
    "ckptio.writer": "ckptio.saving.writer",
    "ckptio.planning": "ckptio.saving.planning",
    "ckptio.encode": "ckptio.saving.data_file",
    "ckptio.objects": "ckptio.saving.consistency",
    "ckptio.commit": "ckptio.saving.commit",
    "ckptio.staging": "ckptio.saving.staging",
    "ckptio.ordering": "ckptio.saving.ordering",
    "ckptio.save_planner": "ckptio.saving.planner",
    "ckptio.reader": "ckptio.loading.reader",
    "ckptio.fetch": "ckptio.loading.fetch",
    "ckptio.ranges": "ckptio.loading.ranges",
    "ckptio.box_reads": "ckptio.loading.box_reads",
    "ckptio.shared_reads": "ckptio.loading.shared_reads",
    "ckptio.read_once": "ckptio.loading.read_once",
    "ckptio.safe_load": "ckptio.loading.safe_load",
    "ckptio.host_memory": "ckptio.loading.host_memory",
    "ckptio.location": "ckptio.storage.location",
    "ckptio.hf_reader": "ckptio.hf.reader",
    "ckptio.safetensors_format": "ckptio.hf.format",
    "ckptio.export": "ckptio.hf.export",
    "ckptio.cli": "ckptio.tools.cli",
    "ckptio.report": ("ckptio.tools.inspection", "ckptio.tools.verify", "ckptio.tools.cleanup"),
    "ckptio.convert": "ckptio.tools.convert",
    "ckptio.keys": "ckptio.state.keys",
    "ckptio.per_rank": "ckptio.state.per_rank",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path with the module at its new one."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED[spec.name]
        shown = new if isinstance(new, str) else " and ".join(new)
        warnings.warn(
            f"{spec.name} moved to {shown}; the old path goes away in the next ckptio release", DeprecationWarning, 3
        )
        if isinstance(new, str):
            return importlib.import_module(new)
        merged = ModuleType(spec.name, f"Deprecated: the public names of {shown}.")
        for name in new:
            module = importlib.import_module(name)
            merged.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
        return merged

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new path is already executed


def install() -> None:
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def moved_attribute(name: str) -> ModuleType:
    """``ckptio.<old module>`` as an attribute (``ckptio.convert.load_full(url)``)."""
    if f"ckptio.{name}" not in MOVED:
        raise AttributeError(f"module 'ckptio' has no attribute {name!r}")
    return importlib.import_module(f"ckptio.{name}")
