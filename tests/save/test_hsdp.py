"""A 4-rank 2x2 HSDP state saved in each mode, checked file by file, loaded on other meshes."""

from __future__ import annotations

import fsspec
import pytest

import ckptio
from ckptio.format.names import is_data_file_name
from ckptio.tools.cli import main as cli_main
from tests.helpers import scenarios
from tests.helpers.harness import spawn
from tests.helpers.metadata_view import readable_metadata

#: Also run against the newest torch on disk (make test-torch-newest).
pytestmark = pytest.mark.protocol

LOAD_MESHES = [(4, (2, 2)), (2, (1, 2)), (4, (4, 1)), (0, None)]  # (processes, mesh); 0 = one process, no PG


def _data_files(url: str, options: dict | None) -> dict[str, int]:
    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    return {
        e["name"].rsplit("/", 1)[-1]: e["size"]
        for e in fs.ls(root, detail=True)
        if is_data_file_name(e["name"].rsplit("/", 1)[-1])
    }


def _metadata(url: str, options: dict | None) -> dict:
    return readable_metadata(url, options)


def check_layout(base: str, options: dict | None) -> None:
    logical = scenarios.logical_tensor_bytes()
    for mode, writers in (("all_ranks", [0, 1, 2, 3]), ("replica_group", [0, 1])):
        url = f"{base}/{mode}"
        files = _data_files(url, options)
        meta = _metadata(url, options)
        assert sorted(meta["writer_ranks"].values()) == writers, (mode, meta["writer_ranks"])
        assert sorted(int(name[-10:-5]) for name in files) == writers, (mode, files)
        assert all(size > 0 for size in files.values()), files
        assert files == meta["files"]
        tensor_bytes = sum(i["logical_bytes"] for i in meta["items"] if i["kind"] == "tensor")
        assert tensor_bytes == logical  # each replicated chunk stored exactly once
        object_bytes = sum(i["logical_bytes"] for i in meta["items"] if i["kind"] == "bytes")
        assert sum(files.values()) == tensor_bytes + object_bytes  # raw bytes, no framing
        assert meta["world_size"] == 4 and meta["config"]["mode"] == mode
        assert meta["mesh"] == {"shape": [2, 2], "dims": ["replicate", "shard"]}


def roundtrip(base: str, options: dict | None, via_checkpoint_id: bool = False) -> None:
    spawn(4, scenarios.save_each_mode, base, (2, 2), options, via_checkpoint_id)
    check_layout(base, options)
    for procs, mesh in LOAD_MESHES:
        results = spawn(procs, scenarios.load_each_mode, base, mesh, options, via_checkpoint_id)
        for rank, per_mode in enumerate(results):
            assert per_mode == {"all_ranks": [], "replica_group": []}, (mesh, rank, per_mode)


def test_hsdp_local(tmp_path, capsys):
    roundtrip(str(tmp_path / "ckpt"), None)
    assert cli_main(["inspect", str(tmp_path / "ckpt" / "replica_group")]) == 0
    out = capsys.readouterr().out
    assert "saved on     4 ranks, mesh 2x2 (replicate, shard), mode replica_group" in out
    assert "2 data files" in out


def test_hsdp_file_url(tmp_path):
    spawn(2, scenarios.save, f"file://{tmp_path}/c", (1, 2), "all_ranks")
    assert spawn(0, scenarios.load, f"file://{tmp_path}/c", None) == [[]]


@pytest.mark.slow
def test_hsdp_s3(s3):
    base, options = s3
    # checkpoint_id given to dcp.save/load, not the constructor: storage_options must survive reset().
    roundtrip(f"{base}/run/step-100", options, via_checkpoint_id=True)


def test_memory_single_process():
    url = "memory://ckptio-test/single"
    scenarios.save(f"{url}/file", None, "all_ranks", tuning=ckptio.Tuning(inline_limit=0))
    scenarios.save(f"{url}/inline", None, "replica_group")  # one process: all private, small enough to inline
    for name in ("file", "inline"):
        assert scenarios.load(f"{url}/{name}", None) == []
    ((name, size),) = _data_files(f"{url}/file", None).items()
    assert name.endswith("-r00000.ckio") and size == _metadata(f"{url}/file", None)["files"][name]
    assert _data_files(f"{url}/inline", None) == {}
    inline_meta = _metadata(f"{url}/inline", None)
    assert inline_meta["files"] == {} and all(i["file"] == "" and i["inline"] for i in inline_meta["items"])


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_column_resharding_reads_strided_sub_boxes(tmp_path, compression):
    # 64-byte blocks: every chunk spans many blocks, and column slices cut through them.
    results = spawn(2, scenarios.save_and_load_columns, str(tmp_path / "c"), compression, 64)
    assert results == [[], []]
