"""The package tree is the architecture: no import circles, no import from a lower layer up to a
higher one, and the 0.2 module paths still import (with a DeprecationWarning) for one release; the
modules the rank servers preload exist."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ckptio"

#: Lowest first: a module may import its own layer and those below it, never one above.
LAYERS = [
    (
        "ckptio.version",
        "ckptio.config",
        "ckptio.errors",
        "ckptio.gc_pause",
        "ckptio.process_exit",
        "ckptio.torch_seam",
    ),
    ("ckptio.format", "ckptio.legacy", "ckptio.storage", "ckptio.state"),
    ("ckptio.loading",),  # a save reads its incremental base and fragment sets through it
    ("ckptio.saving",),
    ("ckptio.tiers",),  # wraps both: registers its landing and its reads with them
    ("ckptio.hf",),
    ("ckptio.api",),
    ("ckptio.tools", "ckptio.integrations"),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _layer(name: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return level
    return None  # the package's __init__: re-exports only


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                found.add(f"<relative import in {name}>")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ckptio"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    found.add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ckptio"))
        edges[name] = found
    return edges


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_ones():
    modules = _modules()
    assert [m for m in modules if m != "ckptio" and _layer(m) is None] == []
    edges = _imports(modules)
    upward = [
        (a, b)
        for a, targets in edges.items()
        for b in targets
        if a != "ckptio" and b in modules and b != "ckptio" and _layer(b) > _layer(a)
    ]
    assert upward == []
    assert [b for targets in edges.values() for b in targets if b.startswith("<relative")] == []


def test_the_0x_reader_is_kept_apart():
    """Checkpoints of ckptio 0.x reach ``ckptio.legacy`` through the document's one way in and nothing
    else: no 1.0 module builds on it, so it can go without touching them."""
    importers = sorted(
        a
        for a, targets in _imports(_modules()).items()
        if not a.startswith("ckptio.legacy") and any(b.startswith("ckptio.legacy") for b in targets)
    )
    assert importers == ["ckptio.format.document"]


def test_saving_and_loading_import_nothing_of_tiers():
    """Tiers wrap the durable save and load (``tiers/landing.py`` and ``tiers/nearest.py`` register with
    ``saving/landing.py`` and ``loading/read_tier.py``): the Writer and Reader never branch on tiers."""
    importers = sorted(
        a
        for a, targets in _imports(_modules()).items()
        if a.startswith(("ckptio.saving", "ckptio.loading")) and any(b.startswith("ckptio.tiers") for b in targets)
    )
    assert importers == []


def test_no_import_circles():
    modules = _modules()
    edges = {a: {b for b in targets if b in modules and b != "ckptio"} for a, targets in _imports(modules).items()}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif not state.get(nxt):
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(modules):
        if not state.get(name):
            visit(name, [name])
    assert circles == []


def test_0_2_module_paths_are_gone():
    """0.2's flat module paths (``ckptio.convert``, ``ckptio.layout``, ...) were kept importable with a
    warning through 0.x; 1.0 has one path per module."""
    import ckptio

    for old in ("ckptio.convert", "ckptio.layout", "ckptio.report", "ckptio.compact", "ckptio.stored_items"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    with pytest.raises(AttributeError, match="no attribute 'convert'"):
        ckptio.convert  # noqa: B018


def test_every_module_the_rank_servers_preload_imports():
    """The bench's and the tests' forkservers import these once for every rank; the forkserver skips a
    name that does not import without a word (``tests.scenarios`` stayed listed after the module moved
    to ``tests/helpers``), and each rank then imports it itself."""
    from tests.helpers.harness import PRELOAD

    for name in PRELOAD:
        importlib.import_module(name)


def test_only_the_torch_seam_imports_torch_s_private_modules():
    """Every private torch name ckptio uses goes through ckptio/torch_seam.py, which names the releases
    it was checked on: a new one elsewhere would break silently on the next torch."""
    offenders = []
    for name, path in _modules().items():
        if name == "ckptio.torch_seam":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                private = [part for part in node.module.split(".") if part.startswith("_")]
                private += [alias.name for alias in node.names if alias.name.startswith("_")]
                if private:
                    offenders.append(f"{name}: from {node.module} import {[a.name for a in node.names]}")
    assert not offenders, offenders
