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
            if parts[-1] == "__main__":
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


def test_dcp_load_still_calls_read_metadata_with_its_dist_wrapper_in_reach(tmp_path):
    """The frame walk ``read_once`` relies on: ``_load_state_dict``'s ``distW``, found from inside
    ``read_metadata``; a torch that renames either fails here, not by reading on every rank silently."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp

    import ckptio

    url = str(tmp_path / "ck")
    ckptio.save({"w": torch.ones(2)}, url)
    found = []

    class Watching(ckptio.Reader):
        def read_metadata(self, *args):
            found.append(seam.enclosing_load_wrapper(sys._getframe()))
            return super().read_metadata(*args)

    dcp.load({"w": torch.zeros(2)}, storage_reader=Watching(url))
    assert found and found[0] is not None and hasattr(found[0], "use_dist") and hasattr(found[0], "group")


def test_dcp_save_still_sets_the_writer_up_with_its_dist_wrapper_in_reach(tmp_path):
    """The frame walk a save without collectives over a process group relies on: ``_save_state_dict``'s
    ``distW`` (its ``group``), found from inside ``set_up_storage_writer``, in dcp.save and async_save."""
    import sys

    import torch
    import torch.distributed.checkpoint as dcp

    import ckptio

    found = []

    class Watching(ckptio.Writer):
        def set_up_storage_writer(self, *args, **kwargs):
            found.append(seam.enclosing_save_wrapper(sys._getframe()))
            return super().set_up_storage_writer(*args, **kwargs)

    dcp.save({"w": torch.ones(2)}, storage_writer=Watching(str(tmp_path / "a")))
    dcp.async_save({"w": torch.ones(2)}, storage_writer=Watching(str(tmp_path / "b"))).result()
    assert len(found) == 2 and all(w is not None and hasattr(w, "group") for w in found), found


def test_the_plan_cache_ckptio_reads_is_where_torch_keeps_it(tmp_path):
    """``cached_save_plan_items``: DefaultSavePlanner(enable_plan_caching=True) keeps each rank's plan in
    ``_cached_save_plan[_cached_plans_key]``; a second save with the cache loads exact."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import ckptio

    planner = DefaultSavePlanner(enable_plan_caching=True)
    for step in range(2):
        dcp.save(
            {"w": torch.full((4,), float(step))},
            storage_writer=ckptio.Writer(str(tmp_path / f"s{step}")),
            planner=planner,
        )
    assert [item.index.fqn for item in seam.cached_save_plan_items(planner)] == ["w"]
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, storage_reader=ckptio.Reader(str(tmp_path / "s1")))
    assert torch.equal(loaded["w"], torch.ones(4))
    assert seam.process_executor_running() in (True, False)
