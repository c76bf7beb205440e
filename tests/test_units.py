"""Pure pieces: codec, ranges, layout validation and config, with exact expectations."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckptio import CheckpointFormatError, WriterConfig
from ckptio.codec import BlockEncoder, block_size_for, checksum, decode_block
from ckptio.layout import FORMAT_VERSION, _pack, data_file_name, decode_metadata, is_data_file_name
from ckptio.ranges import blocks_for_runs, box_runs, coalesce


# --- codec ----------------------------------------------------------------------------
def test_blocks_raw_roundtrip_and_checksums():
    data = memoryview(bytes(range(256)) * 10)
    blocks = list(BlockEncoder(1024).encode(data, 1024))
    assert [len(b) for b, _ in blocks] == [1024, 1024, 512]
    assert [c for _, c in blocks] == [checksum(data[i : i + 1024]) for i in range(0, 2560, 1024)]
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_blocks_zstd_shrinks_compressible_and_keeps_random_raw():
    enc = BlockEncoder(4096, "zstd")
    zeros = list(enc.encode(memoryview(bytes(8192)), 4096))
    assert all(len(b) < 100 for b, _ in zeros)
    assert decode_block(zeros[0][0], 4096, "zstd") == bytes(4096)
    noise = os.urandom(4096)
    ((stored, _),) = enc.encode(memoryview(noise), 4096)
    assert bytes(stored) == noise and decode_block(stored, 4096, "zstd") == noise


def test_block_size_adapts_to_item_size():
    assert block_size_for(100, 1 << 20) == 4096  # small items: one minimum-size block
    assert block_size_for(64 * 8192, 1 << 20) == 8192  # mid-size: 64 blocks
    assert block_size_for(1 << 30, 256 << 10) == 256 << 10  # large: capped by the configured maximum


# --- ranges ---------------------------------------------------------------------------
def test_box_runs_row_slices_are_one_run():
    assert box_runs([10, 8], [2, 0], [3, 8]) == [(16, 40)]
    assert box_runs([10, 8], [0, 0], [10, 8]) == [(0, 80)]
    assert box_runs([], [], []) == [(0, 1)]
    assert box_runs([4, 4], [0, 0], [0, 4]) == []


def test_box_runs_column_slices_match_a_reference():
    shape, off, length = [5, 6, 4], [1, 2, 1], [3, 2, 2]
    ref = torch.arange(120).reshape(shape)[1:4, 2:4, 1:3].flatten().tolist()
    got = [e for start, stop in box_runs(shape, off, length) for e in range(start, stop)]
    assert got == ref


def test_blocks_for_runs_and_coalesce():
    assert blocks_for_runs([(0, 256), (250, 300), (1024, 1025)], itemsize=4, block_size=1024) == [0, 1, 4]
    assert coalesce([("f", 10, 20), ("f", 0, 10), ("g", 0, 5), ("f", 30, 40)], max_len=100) == [
        ("f", 0, 20),
        ("f", 30, 40),
        ("g", 0, 5),
    ]
    assert coalesce([("f", 0, 10), ("f", 10, 20)], max_len=15) == [("f", 0, 10), ("f", 10, 20)]


# --- layout ---------------------------------------------------------------------------
def minimal_doc(**changes) -> dict:
    doc = {
        "format": "ckptio",
        "format_version": FORMAT_VERSION,
        "written_by": "ckptio test",
        "files": {data_file_name("0123456789abcdef", 0): 16},
        "state": {
            "w": {
                "type": "tensor",
                "dtype": "float32",
                "size": [4],
                "requires_grad": False,
                "chunks": [{"offsets": [0], "sizes": [4]}],
            }
        },
        "planner_data": {"w": ["w"]},
        "items": [
            {
                "fqn": "w",
                "chunk_offset": [0],
                "index": 0,
                "file": data_file_name("0123456789abcdef", 0),
                "offset": 0,
                "logical_bytes": 16,
                "kind": "tensor",
                "dtype": "float32",
                "shape": [4],
                "codec": "raw",
                "block_size": 1024,
                "crc32c": _pack([1]),
            }
        ],
    }
    doc.update(changes)
    return doc


def decode(doc) -> object:
    return decode_metadata(json.dumps(doc).encode(), "ckpt/ckptio.json")


def test_decode_accepts_a_valid_document():
    manifest = decode(minimal_doc())
    ((index, item),) = manifest.items.items()
    assert index.fqn == "w" and item.stored_bytes == 16 and manifest.metadata.planner_data == {"w": ("w",)}


@pytest.mark.parametrize(
    "name",
    ["../data-0123456789abcdef-r00000.ckio", "/etc/passwd", "s3://b/k", "sub/data-0123456789abcdef-r00000.ckio", ".."],
)
def test_decode_rejects_unsafe_file_names(name):
    doc = minimal_doc(files={name: 16})
    doc["items"][0]["file"] = name
    with pytest.raises(CheckpointFormatError, match="plain ckptio data file name"):
        decode(doc)


def test_decode_rejects_garbage_future_versions_and_inconsistent_sizes():
    with pytest.raises(CheckpointFormatError, match="not valid JSON"):
        decode_metadata(b"\x80\x04garbage", "x")
    with pytest.raises(CheckpointFormatError, match="upgrade ckptio"):
        decode(minimal_doc(format_version=FORMAT_VERSION + 1, written_by="ckptio 9.0"))
    doc = minimal_doc()
    doc["items"][0]["offset"] = 8
    with pytest.raises(CheckpointFormatError, match="spans bytes 8..24"):
        decode(doc)
    doc = minimal_doc()
    doc["items"][0]["shape"] = [5]
    with pytest.raises(CheckpointFormatError, match="shape"):
        decode(doc)
    with pytest.raises(CheckpointFormatError, match="not a ckptio metadata document"):
        decode({"format": "other"})


def test_data_file_names():
    assert is_data_file_name(data_file_name("0123456789abcdef", 12)) and not is_data_file_name("x.ckio")


# --- config ---------------------------------------------------------------------------
def test_config_modes_and_errors(clean_env):
    assert WriterConfig().mode == "all_ranks"
    assert WriterConfig.from_dict({"mode": "replica_group"}).mode == "replica_group"
    with pytest.raises(ValueError, match=r"valid modes are \['all_ranks', 'replica_group'\]"):
        WriterConfig(mode="fast")
    with pytest.raises(ValueError, match="unknown ckptio config key"):
        WriterConfig.from_dict({"mdoe": "all_ranks"})
    with pytest.raises(ValueError, match="part_size"):
        WriterConfig(part_size=1024)


def test_environment_overrides_arguments_and_dicts(clean_env, monkeypatch):
    monkeypatch.setenv("CKPTIO_MODE", "replica_group")
    monkeypatch.setenv("CKPTIO_OVERWRITE", "true")
    monkeypatch.setenv("CKPTIO_COMPRESSION", "zstd")
    cfg = WriterConfig.from_dict({"mode": "all_ranks"})
    assert (cfg.mode, cfg.overwrite, cfg.compression) == ("replica_group", True, "zstd")
    monkeypatch.setenv("CKPTIO_MODE", "bogus")
    with pytest.raises(ValueError, match="valid modes"):
        WriterConfig()
    monkeypatch.setenv("CKPTIO_MODE", "all_ranks")
    monkeypatch.setenv("CKPTIO_MAX_BLOCK_SIZE", "lots")
    with pytest.raises(ValueError, match="CKPTIO_MAX_BLOCK_SIZE='lots' is not a valid int"):
        WriterConfig()
