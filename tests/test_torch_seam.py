"""torch's private names that ckptio uses (``ckptio/torch_seam.py``) are where the seam expects them, and
no module of ckptio or its bench warns of a deprecation on import, on every torch the suite runs on
(``make test`` runs the ``protocol`` tests on the newest release too)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import ckptio.torch_seam as seam

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.protocol


def _module_names() -> list[str]:
    names = []
    for package, folder in (("ckptio", ROOT / "ckptio"), ("ckptio.bench", ROOT / "benchmarks")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__main__" or "deprecated_paths" in parts:
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.append(".".join((package, *parts)))
    return names


def test_every_module_imports_without_a_deprecation_or_future_warning(tmp_path):
    """In a fresh interpreter, with those warnings as errors: a private torch module that became a
    deprecated shim (``_fsspec_filesystem`` in 2.15) fails here, naming the module that imports it. Run
    outside the checkout, so ckptio is the installed one (the bench is ckptio.bench only when installed)."""
    names = [n for n in _module_names() if n != "ckptio.integrations.torchtitan"]  # an optional extra
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except (DeprecationWarning, FutureWarning) as exc:\n"
        "        sys.exit(f'{name}: {type(exc).__name__}: {exc}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_fsspec_reader_and_writer_are_torch_s():
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

    assert issubclass(seam.FsspecReader, StorageReader) and issubclass(seam.FsspecWriter, StorageWriter)


def test_read_metadata_records_no_strides_and_a_strided_tensor_loads_exact(tmp_path):
    """torch 2.15 added ``TensorProperties.strides`` (the saving rank's local strides). ckptio stores each
    chunk contiguous and loads into the destination's layout: ``strides`` is ``None`` where torch has the
    field, and a transposed (non-contiguous) tensor saves and loads bit-exact, into either layout."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptio

    source = torch.arange(12.0).reshape(3, 4).t()  # strides (1, 4)
    url = str(tmp_path / "ck")
    dcp.save({"t": source}, storage_writer=ckptio.Writer(url))
    properties = ckptio.Reader(url).read_metadata().state_dict_metadata["t"].properties
    assert getattr(properties, "strides", None) is None
    for target in (torch.zeros(4, 3), torch.zeros(3, 4).t()):
        dcp.load({"t": target}, storage_reader=ckptio.Reader(url))
        assert torch.equal(target, source)


def test_every_private_name_the_seam_takes_from_torch_is_there():
    """One assertion per name: a torch release that moves one fails here, naming it (ckptio's modules
    take these from the seam only; the package-structure test keeps other modules off torch's privates)."""
    missing = [name for name in seam.__all__ if getattr(seam, name, None) is None and name != "CheckpointableTensor"]
    assert not missing, f"torch {__import__('torch').__version__} moved: {missing}"
    assert callable(seam.default_store) and seam.default_store.__doc__
