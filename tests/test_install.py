"""What ``pip install`` puts on a machine: the wheel and the sdist hold every module of the source tree.
(``make test-installed`` installs that wheel into a clean venv and runs what a user runs first.)"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import ckptio

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _source_modules() -> set[str]:
    """Every module as the wheel places it: ckptio/... as it is, benchmarks/... as ckptio/bench/..."""
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "ckptio").rglob("*.py")}
    found |= {"ckptio/bench/" + str(p.relative_to(ROOT / "benchmarks")) for p in (ROOT / "benchmarks").rglob("*.py")}
    return found


def _build(kind: str, out: pathlib.Path) -> pathlib.Path:
    """The wheel as pip builds it, or the sdist through setuptools' PEP 517 hook (what ``python -m build``
    calls), from the checkout. setuptools copies modules into ``build/lib`` and keeps what an earlier
    build left there (a module since deleted would ship again): every build starts without it."""
    shutil.rmtree(ROOT / "build" / "lib", ignore_errors=True)
    if kind == "wheel":
        command = ["-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    else:
        command = ["-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"]
    subprocess.run([sys.executable, *command], cwd=ROOT, check=True, capture_output=True)
    (built,) = [out / p for p in os.listdir(out) if p.endswith(".whl" if kind == "wheel" else ".tar.gz")]
    return built


def test_the_wheel_holds_every_module_of_the_source_tree_and_nothing_named_benchmarks(tmp_path):
    wheel = zipfile.ZipFile(_build("wheel", tmp_path))
    names = set(wheel.namelist())
    modules = {n for n in names if n.endswith(".py")}
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert f"\nVersion: {ckptio.__version__}\n" in wheel.read(metadata).decode(), "the wheel's version is not ckptio's"
    assert modules == _source_modules(), (
        f"missing from the wheel: {sorted(_source_modules() - modules)}; extra: {sorted(modules - _source_modules())}"
    )
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/"))]


def test_the_sdist_holds_every_module_and_builds_the_same_packages(tmp_path):
    with tarfile.open(_build("sdist", tmp_path)) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    expected = {
        str(p.relative_to(ROOT)) for p in (*(ROOT / "ckptio").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"))
    }
    assert expected <= names, f"missing from the sdist: {sorted(expected - names)}"
    assert {"setup.py", "pyproject.toml", "README.md"} <= names
