"""Pure pieces: codec, ranges, layout validation and config, with exact expectations."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import ckptio
from ckptio import CheckpointFormatError, WriterConfig
from ckptio.config import MiB
from ckptio.format.codec import BlockEncoder, block_size_for, checksum, decode_block
from ckptio.format.records import FORMAT_VERSION, data_file_name, is_data_file_name, pack_counts
from ckptio.format.versions import decode_metadata
from ckptio.loading.ranges import ReadPiece, blocks_for_runs, box_runs, plan_requests


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


def test_blocks_for_runs_and_request_merging():
    assert blocks_for_runs([(0, 256), (250, 300), (1024, 1025)], itemsize=4, block_size=1024) == [0, 1, 4]

    def spans(pieces, max_len, gap=0):
        pieces = [ReadPiece(name, start, memoryview(bytearray(end - start))) for name, start, end in pieces]
        return [(r.name, r.offset, r.offset + r.length) for r in plan_requests(pieces, max_len, gap)]

    assert spans([("f", 10, 20), ("f", 0, 10), ("g", 0, 5), ("f", 30, 40)], max_len=100) == [
        ("f", 0, 20),
        ("f", 30, 40),
        ("g", 0, 5),
    ]
    assert spans([("f", 0, 10), ("f", 10, 20)], max_len=15) == [("f", 0, 10), ("f", 10, 20)]
    assert spans([("f", 0, 10), ("f", 30, 40)], max_len=100, gap=20) == [("f", 0, 40)]  # the gap read and dropped
    assert spans([("f", 0, 40)], max_len=15) == [("f", 0, 15), ("f", 15, 30), ("f", 30, 40)]  # split


# --- layout ---------------------------------------------------------------------------
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


def test_data_file_names():
    assert is_data_file_name(data_file_name("0123456789abcdef", 12)) and not is_data_file_name("x.ckio")
    from ckptio.format.records import parse_data_file_names

    names = [data_file_name("0123456789abcdef", 7), data_file_name("fedcba9876543210", 100000)]
    assert parse_data_file_names(names) == (["0123456789abcdef", "fedcba9876543210"], [7, 100000])
    assert parse_data_file_names([]) == ([], [])
    for bad in ("x.ckio", names[0] + "\n", names[0] + "\n" + names[1], "/" + names[0]):
        with pytest.raises(ValueError, match="not a ckptio data file name"):
            parse_data_file_names([names[1], bad])  # each name whole: none hides in a joined line


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


def test_the_read_gap_is_the_backends_unless_configured(clean_env, monkeypatch, tmp_path):
    from ckptio.config import LOCAL_READ_GAP_BYTES, REMOTE_READ_GAP_BYTES
    from ckptio.storage import open_store

    assert open_store(str(tmp_path)).read_gap_bytes == LOCAL_READ_GAP_BYTES == 0
    assert open_store("memory://gap").read_gap_bytes == REMOTE_READ_GAP_BYTES
    assert open_store("memory://gap", config=WriterConfig(read_gap_bytes=4096).storage()).read_gap_bytes == 4096
    monkeypatch.setenv("CKPTIO_READ_GAP_BYTES", "65536")
    assert open_store(str(tmp_path), config=WriterConfig().storage()).read_gap_bytes == 65536
    monkeypatch.setenv("CKPTIO_READ_GAP_BYTES", "none")
    assert WriterConfig().read_gap_bytes is None
    monkeypatch.delenv("CKPTIO_READ_GAP_BYTES")
    with pytest.raises(ValueError, match="read_gap_bytes must be None or 0"):
        WriterConfig(read_gap_bytes=-1)
    with pytest.raises(ValueError, match="read_gap_bytes must be None or 0"):
        ckptio.HFReader(str(tmp_path), read_gap_bytes=1 << 40)


# --- byte planes (format version 2) ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int16])
def test_byte_planes_round_trip_and_beat_whole_block_zstd(dtype):
    from ckptio.format.records import Codec

    values = (torch.randn(30_001) * 100).to(dtype)  # an odd count: the last block is partial
    data = memoryview(values.view(torch.uint8).numpy()).cast("B")
    enc = BlockEncoder(16384, "zstd")
    codec, planes = enc.codec_for(data, values.element_size())
    assert codec == Codec.ZSTD_BYTEPLANES and len(planes) == values.element_size() and any(planes)
    blocks = list(enc.encode(data, 16384, codec, planes))
    decoded = b"".join(
        bytes(decode_block(stored, min(16384, len(data) - i * 16384), codec, values.element_size()))
        for i, (stored, _) in enumerate(blocks)
    )
    assert decoded == bytes(data)
    # against a simple reference (plain slicing), decoded into a fresh buffer and into a destination
    k = values.element_size()
    for i, (stored, _) in enumerate(blocks):
        logical = bytes(data[i * 16384 : (i + 1) * 16384])
        into = memoryview(bytearray(len(logical)))
        for out in (None, into):
            joined = bytes(decode_block(stored, len(logical), codec, k, out))
            assert [joined[p::k] for p in range(k)] == [logical[p::k] for p in range(k)]
    whole = sum(len(b) for b, _ in BlockEncoder(16384, "zstd").encode(data, 16384, Codec.ZSTD))
    assert sum(len(b) for b, _ in blocks) < whole


def test_small_integers_take_whole_block_zstd_where_it_is_smaller():
    from ckptio.format.records import Codec

    values = (torch.randn(30_001) * 100).to(torch.int64)  # 6 of 8 bytes are sign extension
    data = memoryview(values.view(torch.uint8).numpy()).cast("B")
    enc = BlockEncoder(16384, "zstd")
    codec, planes = enc.codec_for(data, 8)
    assert codec == Codec.ZSTD and planes == ()
    chosen = sum(len(b) for b, _ in enc.encode(data, 16384, codec, planes))
    mask = (True,) * 8
    by_planes = sum(len(b) for b, _ in enc.encode(data, 16384, Codec.ZSTD_BYTEPLANES, mask))
    assert chosen < by_planes
    decoded = b"".join(
        bytes(decode_block(b, min(16384, len(data) - i * 16384), codec, 8))
        for i, (b, _) in enumerate(enc.encode(data, 16384, codec, planes))
    )
    assert decoded == bytes(data)


def test_incompressible_items_are_stored_raw_from_a_sample():
    from ckptio.format.records import Codec

    enc = BlockEncoder(16384, "zstd")
    noise = memoryview(os.urandom(1 << 20))
    assert enc.codec_for(noise, 4) == (Codec.RAW, ()) and enc.codec_for(noise, 1) == (Codec.RAW, ())
    assert enc.codec_for(memoryview(bytes(1 << 16)), 1)[0] == Codec.ZSTD
    assert BlockEncoder(16384, None).codec_for(memoryview(bytes(1 << 16)), 4) == (Codec.RAW, ())


def test_saves_write_version_3_and_the_readable_view_keeps_each_codecs_oldest_version(tmp_path):
    import torch.distributed.checkpoint as dcp

    import ckptio
    from ckptio.format.records import legacy_document

    cases = {"raw": (None, torch.float32), "zstd-bytes": ("zstd", torch.uint8), "planes": ("zstd", torch.bfloat16)}
    for name, (compression, dtype) in cases.items():
        url = str(tmp_path / name)
        # randn for planes: on constant data whole-block zstd is smaller and chosen instead
        value = torch.randn(100_000).to(dtype) if name == "planes" else torch.zeros(100_000, dtype=dtype)
        dcp.save({"t": value}, storage_writer=ckptio.Writer(url, ckptio.WriterConfig(compression=compression)))
        raw = open(os.path.join(url, "ckptio.json"), "rb").read()
        assert json.loads(raw)["format_version"] == FORMAT_VERSION == 3
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
    with pytest.raises(CheckpointFormatError, match="too far from a grid"):
        decode(chunked_doc([8, 8], grid))


def test_paused_gc_restores_the_collector_as_it_was():
    import gc

    from ckptio.gc_pause import paused_gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "chunk", [([4], [1]), ([3], [2]), ([0, 0], [4, 1]), ([0], [2, 2])], ids=["past-end", "overrun", "rank", "sizes"]
)
def test_decode_refuses_a_chunk_outside_its_shape(chunk):
    doc = chunked_doc([4], [([0], [4])])
    doc["state"]["w"]["chunks"].append({"offsets": chunk[0], "sizes": chunk[1]})
    with pytest.raises(CheckpointFormatError, match="outside its shape"):
        decode(doc)


def test_s3_part_sizes_stay_within_the_part_count_and_size_limits():
    from ckptio.storage.s3 import MAX_PART_BYTES, MAX_PARTS, part_size_for

    TiB = 1 << 40
    for base in (5 * MiB, 32 * MiB, 4 << 30):
        sizes = [part_size_for(n, base) for n in range(1, MAX_PARTS + 1)]
        assert sizes[0] == base and sizes == sorted(sizes) and max(sizes) <= MAX_PART_BYTES
        assert sum(sizes) >= 4.8 * TiB  # S3's largest object is 5 TiB
    assert [part_size_for(n, 32 * MiB) for n in (1000, 1001, 2001)] == [32 * MiB, 64 * MiB, 128 * MiB]


def test_part_size_is_bounded_by_s3s_limits(clean_env):
    for bad in (5 * MiB - 1, (4 << 30) + 1):
        with pytest.raises(ValueError, match="part_size"):
            WriterConfig(part_size=bad)
    assert WriterConfig(part_size=4 << 30).part_size == 4 << 30


def test_object_reports_find_every_key_whose_value_differs_between_ranks():
    from ckptio.saving.consistency import ObjectReport, differing_keys

    # each rank also holds a key of its own (a data loader's): one holder never differs
    reports = [ObjectReport(r, {"lr": ("object", 1, 8), f"loader.{r}": ("object", r, 8)}) for r in range(6)]
    assert differing_keys(reports) == {}
    reports[4].digests["lr"] = ("object", 2, 8)
    reports[1].digests["lr"] = ("object", 2, 8)
    reports[5].digests["step"] = ("object", 0, 8)  # a key only the last rank holds
    assert differing_keys(reports) == {"lr": [[0, 2, 3, 5], [1, 4]]}
    reports[5].digests["lr"] = ("object", 3, 8)  # the last rank's value is not everyone's
    assert differing_keys(reports) == {"lr": [[0, 2, 3], [1, 4], [5]]}


def test_a_request_body_sends_and_reads_its_pieces_back_to_back_without_joining_large_ones():
    import asyncio
    import io

    from ckptio.storage.request_body import SEND_SLICE_BYTES, RequestBody
    from ckptio.storage.s3_checksums import crc32c_header

    big = torch.arange(SEND_SLICE_BYTES // 2, dtype=torch.int32).view(torch.uint8).numpy()  # 2 slices
    pieces = [b"head", memoryview(big), b"", b"x" * 10, bytearray(b"tail")]
    whole = b"".join(bytes(p) for p in pieces)

    class Writer:  # aiohttp's StreamWriter interface: what the body hands to the socket
        def __init__(self):
            self.chunks = []

        async def write(self, chunk):
            self.chunks.append(bytes(chunk))

    for limit in (None, len(whole), 7, SEND_SLICE_BYTES + 3):
        writer = Writer()
        asyncio.run(RequestBody(pieces).write_with_length(writer, limit))
        assert b"".join(writer.chunks) == whole[:limit]
        assert max(len(c) for c in writer.chunks) <= SEND_SLICE_BYTES
    body = RequestBody(pieces)
    assert len(body) == len(whole) and body.read(2) == b"he" and body.tell() == 2
    assert body.read(1000) == b"ad"  # a short read: to the piece's end, never a joined copy
    assert bytes(body.read(1000)) == whole[4:1004]  # within the large piece: a view
    rest = body.read(SEND_SLICE_BYTES * 2)
    assert isinstance(rest, memoryview) and bytes(rest) == whole[1004 : 4 + len(big)]
    body.seek(0, io.SEEK_END)
    assert body.read() == b"" and body.seek(-4, io.SEEK_END) == len(whole) - 4 and body.read() == b"tail"
    body.seek(0)  # as botocore hashes a payload: reads until an empty one
    assert b"".join(bytes(c) for c in iter(lambda: body.read(1 << 20), b"")) == whole
    assert crc32c_header([(p, None) for p in pieces]) == crc32c_header([(whole, None)])


def test_crc32c_of_pieces_combines_known_crcs_exactly():
    import random

    from ckptio.format.codec import checksum, checksum_concat, checksum_of_pieces

    rng = random.Random(7)
    data = rng.randbytes(3 << 20)
    for _ in range(200):
        a, b = sorted(rng.sample(range(len(data) + 1), 2))
        head, tail = data[:a], data[a:b]
        assert checksum_concat(checksum(head), checksum(tail), len(tail)) == checksum(data[:b])
    cuts = sorted(rng.sample(range(1, len(data)), 40)) + [len(data)]
    pieces, start = [], 0
    for i, end in enumerate(cuts):  # every other piece with its CRC, the rest to be read; one empty piece
        piece = memoryview(data)[start:end] if i != 5 else memoryview(b"")
        pieces.append((piece, checksum(piece) if i % 2 else None))
        start = end if i != 5 else start
    assert checksum_of_pieces(pieces) == checksum(b"".join(bytes(p) for p, _ in pieces))
    assert checksum_of_pieces([]) == checksum(b"") == 0


def test_a_reader_is_configured_by_storage_config_with_the_same_rules_and_environment(monkeypatch, tmp_path):
    import ckptio
    from ckptio.config import MAX_REQUEST_BYTES, StorageConfig

    assert ckptio.Reader(str(tmp_path)).storage_config == StorageConfig()
    monkeypatch.setenv("CKPTIO_READ_GAP_BYTES", "4096")
    monkeypatch.setenv("CKPTIO_MAX_CONCURRENCY", "3")
    assert ckptio.Reader(str(tmp_path)).storage_config == StorageConfig(read_gap_bytes=4096, max_concurrency=3)
    assert StorageConfig.from_environment(retry_attempts=2).retry_attempts == 2
    assert WriterConfig().storage() == StorageConfig.from_environment()  # one set of storage fields
    monkeypatch.delenv("CKPTIO_READ_GAP_BYTES")
    monkeypatch.delenv("CKPTIO_MAX_CONCURRENCY")
    for bad, message in [
        ({"read_gap_bytes": MAX_REQUEST_BYTES + 1}, "read_gap_bytes"),
        ({"part_size": 1 << 20}, "part_size"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"retry_attempts": 0}, "retry_attempts"),
    ]:
        with pytest.raises(ValueError, match=message):
            StorageConfig(**bad)
        with pytest.raises(ValueError, match=message):
            WriterConfig(**bad)  # the same rule, stated once
