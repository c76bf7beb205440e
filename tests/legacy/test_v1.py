"""Format versions 1 and 2 (``ckptio.legacy.v1``): documents decoded and checked, the readable view."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import ckptio
from ckptio import CheckpointFormatError
from ckptio.format.document import decode_metadata
from ckptio.format.names import FORMAT_VERSION, data_file_name
from ckptio.legacy.v1 import pack_counts


def minimal_doc(**changes) -> dict:
    """A version 2 document (one JSON object per item), as ckptio 0.1 wrote them."""
    doc = {
        "format": "ckptio",
        "format_version": 2,
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
                "crc32c": pack_counts([1]),
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


def test_saves_write_version_8_and_the_readable_view_keeps_each_codecs_oldest_version(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptio.legacy.v1 import legacy_document

    cases = {"raw": (None, torch.float32), "zstd-bytes": ("zstd", torch.uint8), "planes": ("zstd", torch.bfloat16)}
    for name, (compression, dtype) in cases.items():
        url = str(tmp_path / name)
        # randn for planes: on constant data whole-block zstd is smaller and chosen instead
        value = torch.randn(100_000).to(dtype) if name == "planes" else torch.zeros(100_000, dtype=dtype)
        dcp.save({"t": value}, storage_writer=ckptio.Writer(url, ckptio.WriterConfig(compression=compression)))
        raw = open(os.path.join(url, "ckptio.json"), "rb").read()
        assert json.loads(raw)["format_version"] == FORMAT_VERSION == 8
        view = legacy_document(decode_metadata(raw, "x"))
        assert view["format_version"] == (2 if name == "planes" else 1), name
        for document in (raw, json.dumps(view).encode()):  # the view is itself a loadable document
            open(os.path.join(url, "ckptio.json"), "wb").write(document)
            out = {"t": torch.ones_like(value)}
            dcp.load(out, storage_reader=ckptio.Reader(url))
            assert torch.equal(out["t"], value)
    view["format_version"] = 1  # byte planes claimed by a version-1 document
    with pytest.raises(CheckpointFormatError, match="format version 1 lacks"):
        decode_metadata(json.dumps(view).encode(), "x")


def chunked_doc(shape: list[int], chunks: list[tuple[list[int], list[int]]]) -> dict:
    """A float32 tensor ``w`` of ``shape`` stored as ``chunks`` (offsets, sizes), one data file."""
    file = data_file_name("0123456789abcdef", 0)
    items, at = [], 0
    for offsets, sizes in chunks:
        n = 4 * math.prod(sizes)
        items.append(
            dict(
                minimal_doc()["items"][0],
                chunk_offset=offsets,
                offset=at,
                logical_bytes=n,
                shape=sizes,
                crc32c=pack_counts([1]),
            )
        )
        at += n
    doc = minimal_doc(files={file: at}, items=items)
    doc["state"]["w"].update(size=shape, chunks=[{"offsets": o, "sizes": s} for o, s in chunks])
    return doc


def test_decode_finds_overlapping_chunks_among_many():
    # 200 one-element chunks; #6 grown onto #7 and #199 dropped: the element count is still right
    chunks = [([i], [1]) for i in range(200)]
    assert len(decode(chunked_doc([200], chunks)).items) == 200
    chunks = chunks[:199]
    chunks[6] = ([6], [2])
    with pytest.raises(CheckpointFormatError, match="does not cover"):
        decode(chunked_doc([200], chunks))
    grid = [([r * 2, c * 3], [2, 3]) for r in range(16) for c in range(8)]  # 128 chunks of a 2-D layout
    grid[5] = ([0, 1], [2, 3])  # shifted onto its neighbours; one column of cells uncovered elsewhere
    grid[6] = ([0, 20], [2, 3])
    with pytest.raises(CheckpointFormatError, match="does not cover"):
        decode(chunked_doc([32, 24], grid))


def test_decode_refuses_chunks_too_irregular_to_check(monkeypatch):
    from ckptio.format import chunks

    grid = [([r, c], [1, 1]) for r in range(8) for c in range(8)]
    assert len(decode(chunked_doc([8, 8], grid)).items) == 64
    monkeypatch.setattr(chunks, "COMPARISONS_PER_CHUNK", 0)
    monkeypatch.setattr(chunks, "COMPARISONS_BASE", 10)
    monkeypatch.setattr(chunks, "GRID_CELLS_BASE", 0)  # 9 x 9 boundaries: past the grid check's budget too
    with pytest.raises(CheckpointFormatError, match="too far from a grid"):
        decode(chunked_doc([8, 8], grid))


@pytest.mark.parametrize(
    "chunk", [([4], [1]), ([3], [2]), ([0, 0], [4, 1]), ([0], [2, 2])], ids=["past-end", "overrun", "rank", "sizes"]
)
def test_decode_refuses_a_chunk_outside_its_shape(chunk):
    doc = chunked_doc([4], [([0], [4])])
    doc["state"]["w"]["chunks"].append({"offsets": chunk[0], "sizes": chunk[1]})
    with pytest.raises(CheckpointFormatError, match="outside its shape"):
        decode(doc)
