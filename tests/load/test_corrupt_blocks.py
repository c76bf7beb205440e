"""Stored blocks that do not decode to what their records say are named corrupt, before any large allocation."""

from __future__ import annotations

import os
import resource
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard

import ckptio
from ckptio.format.codec import checksum
from ckptio.legacy.v1 import pack_counts, unpack_counts
from tests.helpers.documents import load_error, read_doc, write_doc


def _frame_declaring(size: int) -> bytes:
    """A small zstd frame whose header claims ``size`` content bytes (a 4-byte content-size field)."""
    frame = zstandard.ZstdCompressor().compress(bytes(70000))
    descriptor = frame[4]
    assert descriptor >> 6 == 2 and descriptor & 3 == 0  # 4-byte content size, no dictionary id
    at = 5 if descriptor & 0x20 else 6  # single-segment frames have no window descriptor
    return frame[:at] + size.to_bytes(4, "little") + frame[at + 4 :]


def _replace_first_block(url: str, key: str, stored: bytes) -> None:
    """Put other stored bytes in block 0 of ``key`` and re-sign the metadata, as a crafted (or
    buggy) checkpoint would: the checksums match, only what the block decodes to is wrong."""
    doc = read_doc(url)
    item = next(i for i in doc["items"] if i["fqn"] == key)
    path = os.path.join(url, item["file"])
    data = open(path, "rb").read()
    lengths, crcs = unpack_counts(item["stored_lengths"], "x"), unpack_counts(item["crc32c"], "x")
    start = item["offset"]
    data = data[:start] + stored + data[start + lengths[0] :]
    lengths[0], crcs[0] = len(stored), checksum(stored)
    item["stored_lengths"], item["crc32c"] = pack_counts(lengths), pack_counts(crcs)
    doc["files"][item["file"]] = len(data)
    open(path, "wb").write(data)
    write_doc(url, doc)


def _saved_zeros(tmp_path, codec: str) -> tuple[str, torch.Tensor, int]:
    """A compressed checkpoint of one tensor stored with ``codec`` (zeros for zstd; fp32 values
    for byte planes: on zeros whole-block zstd is smaller and chosen); the tensor, its block size."""
    url = str(tmp_path / "ckpt")
    if codec == "zstd":
        zeros = torch.zeros(256, 1024, dtype=torch.uint8)
    else:
        zeros = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    config = ckptio.WriterConfig(compression="zstd", tuning=ckptio.Tuning(inline_limit=0))
    dcp.save({"w": zeros}, storage_writer=ckptio.Writer(url, config))
    (item,) = read_doc(url)["items"]
    assert item["codec"] == codec
    return url, zeros, item["block_size"]


def _block_around(codec: str, block: int, frame: bytes) -> bytes:
    """A stored block for ``codec`` whose (last) zstd frame is ``frame``."""
    if codec == "zstd":
        return frame
    plane = block // 4  # three raw planes, then the compressed one
    return bytes([4]) + struct.pack("<4I", plane, plane, plane, len(frame)) + bytes(3 * plane) + frame


@pytest.mark.parametrize("codec", ["zstd", "zstd-byteplanes"])
@pytest.mark.parametrize("content_size", [True, False])
def test_a_compressed_block_that_decodes_to_another_length_is_corrupt(tmp_path, codec, content_size):
    url, zeros, block = _saved_zeros(tmp_path, codec)
    logical = block if codec == "zstd" else block // 4
    frame = zstandard.ZstdCompressor(write_content_size=content_size).compress(bytes(logical - 4))
    _replace_first_block(url, "w", _block_around(codec, block, frame))
    error = load_error(url, {"w": torch.full_like(zeros, 7)})
    assert isinstance(error, ckptio.CorruptCheckpointError) and "'w'" in str(error) and "block 0" in str(error)
    assert f"{logical - 4} bytes where the metadata records {logical}" in str(error) or (
        content_size and f"declares {logical - 4} bytes" in str(error)
    ), str(error)


@pytest.mark.parametrize("codec", ["zstd", "zstd-byteplanes"])
def test_a_frame_that_declares_a_huge_size_fails_before_allocating(tmp_path, codec):
    url, zeros, block = _saved_zeros(tmp_path, codec)
    _replace_first_block(url, "w", _block_around(codec, block, _frame_declaring(3 << 30)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = load_error(url, {"w": torch.zeros_like(zeros)})
    assert isinstance(error, ckptio.CorruptCheckpointError) and "declares 3221225472 bytes" in str(error)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1 << 30) // 1024  # KiB
