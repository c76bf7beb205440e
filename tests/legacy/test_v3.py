"""Format version 3 (``ckptio.legacy.v3``, ``v3_decode``, ``stored_items``): per-key columns, the
same checks as version 1's records, item records built on demand, and crafted documents refused with
named errors before large allocations."""

from __future__ import annotations

import itertools
import json
import math
import resource

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.errors import CheckpointFormatError
from ckptio.format.columns import encode_column, encode_packed
from ckptio.format.document import decode_metadata
from ckptio.format.names import data_file_name
from ckptio.legacy.v1 import legacy_document

FILE = data_file_name("0123456789abcdef", 0)


def compact_doc(shape: list[int], chunks: list[tuple[list[int], list[int]]], **record) -> dict:
    """A version 3 document: float32 ``w`` of ``shape`` stored as ``chunks`` back to back in one file."""
    lengths = [4 * math.prod(sizes) for _, sizes in chunks]
    ats = list(itertools.accumulate(lengths, initial=0))
    key = {
        "type": "tensor",
        "dtype": "float32",
        "size": shape,
        "requires_grad": False,
        "count": len(chunks),
        "offsets": [encode_column([o[d] for o, _ in chunks]) for d in range(len(shape))],
        "sizes": [encode_column([s[d] for _, s in chunks]) for d in range(len(shape))],
        "file": 1,
        "at": encode_column(ats[:-1]),
    }
    key.update(record)
    if "crc32c" not in key:
        key["crc32c"] = encode_packed([7] * sum(-(-n // 1024) for n in lengths))
    return {
        "format": "ckptio",
        "format_version": 3,
        "files": {"save_ids": ["0123456789abcdef"], "ranks": 0, "sizes": ats[-1]},
        "block_size": 1024,
        "planner_data": {"w": ["w"]},
        "keys": {"w": key},
    }


def decode(doc: dict):
    return decode_metadata(json.dumps(doc).encode(), "ckpt/ckptio.json")


def refused(doc: dict, match: str) -> str:
    with pytest.raises(CheckpointFormatError, match=match) as info:
        decode(doc)
    return str(info.value)


ROWS = [([r * 4, 0], [4, 300]) for r in range(64)]  # 64 row chunks of 4,800 bytes (5 blocks each)


def test_columns_take_the_narrowest_width_or_a_constant():
    assert encode_column([5, 5, 5]) == 5 and encode_column([]) == encode_packed([]) == "B"
    assert [encode_column(v)[0] for v in ([0, 255], [0, 256], [0, 1 << 32 - 1], [0, 1 << 32])] == list("BHIQ")
    assert encode_packed([1, 2]) == "BAQI=" and encode_packed([0x01020304]) == "IBAMCAQ=="  # little-endian


def test_item_records_are_built_only_for_the_chunks_a_load_asks_for():
    manifest = decode(compact_doc([256, 300], ROWS))
    items = manifest.items
    assert len(items) == 64 and not items._keys["w"]._built  # decoding built no item record
    chunks = manifest.metadata.state_dict_metadata["w"].chunks
    assert [tuple(c.offsets) for c in chunks] == [tuple(o) for o, _ in ROWS]
    item = items[MetadataIndex("w", torch.Size([40, 0]), 10)]  # DCP's index: the hint is the chunk's position
    assert (item.offset, item.shape, item.logical_bytes) == (10 * 4800, (4, 300), 4800)
    assert [b for b, _ in item.blocks] == [1024] * 4 + [704] and item.stored_bytes == 4800
    assert items[MetadataIndex("w", torch.Size([8, 0]), 63)].offset == 2 * 4800  # a wrong hint still finds it
    assert MetadataIndex("w", torch.Size([1, 0])) not in items and MetadataIndex("v", torch.Size([0, 0])) not in items
    assert sorted(items._keys["w"]._built) == [2, 10]
    assert [i.offset for i in items] == [torch.Size([r * 4, 0]) for r in range(64)]


@pytest.mark.parametrize(
    "chunks",
    [
        [([i], [1]) for i in range(200) if i != 199],  # one element short
        [([i], [2 if i == 6 else 1]) for i in range(199)],  # #6 grown onto #7, #199 dropped: count still right
    ],
    ids=["uncovered", "overlap"],
)
def test_chunks_must_tile_the_tensor(chunks):
    assert len(decode(compact_doc([200], [([i], [1]) for i in range(200)])).items) == 200
    refused(compact_doc([200], chunks), "does not cover")


@pytest.mark.parametrize("grown", [6, 0, 61], ids=["middle", "first", "near-the-end"])
def test_row_chunks_that_overlap_are_refused(grown):
    # rows of a 2-D tensor: the other dimension's columns are constants (the split-dimension check)
    assert len(decode(compact_doc([256, 300], ROWS)).items) == 64
    rows = [([r * 4, 0], [8 if r == grown else 4, 300]) for r in range(63)]  # one row grown, the last dropped
    refused(compact_doc([256, 300], rows), "does not cover")
    shuffled = rows[32:] + rows[:32]  # DCP's chunk order is not the row order
    refused(compact_doc([256, 300], shuffled), "does not cover")


def test_empty_chunks_never_overlap():
    empty_rows = [([r, 0], [1, 0]) for r in range(4)]  # a [4, 0] tensor
    assert len(decode(compact_doc([4, 0], empty_rows)).items) == 4
    empty_tail = [([0], [5]), ([5], [0]), ([2], [0])]  # torch.chunk's empty trailing shards
    assert len(decode(compact_doc([5], empty_tail)).items) == 3


def test_per_block_columns_decode_any_slice_on_use_and_check_their_length_first():
    from ckptio.format.columns import PackedBlocks

    for values in ([], [3], [1, 2], [0, 1 << 16], [7, 1 << 31, 5], list(range(0, 1 << 40, 1 << 33))):
        column = PackedBlocks(encode_packed(values), len(values), "col")
        for start in range(len(values) + 1):
            for stop in range(start, len(values) + 1):
                assert column[start:stop].tolist() == values[start:stop]
    with pytest.raises(CheckpointFormatError, match="holds 2 entries of 4 bytes where 3"):
        PackedBlocks(encode_packed([1 << 31, 2]), 3, "col")
    bad = PackedBlocks("I" + "!" * 16, 3, "key 'w': crc32c")  # the right length, not base64
    with pytest.raises(CheckpointFormatError, match="key 'w': crc32c is not valid base64"):
        bad[1:2]


def test_a_damaged_checksum_column_is_a_named_error_when_its_item_is_read():
    doc = compact_doc([256, 300], ROWS)
    crcs = doc["keys"]["w"]["crc32c"]
    doc["keys"]["w"]["crc32c"] = crcs[:41] + "*" + crcs[42:]  # block 30 of 320: item 6's
    items = decode(doc).items
    assert items[MetadataIndex("w", torch.Size([0, 0]), 0)].blocks[0][1] == 7
    with pytest.raises(CheckpointFormatError, match="crc32c .* is not valid base64"):
        items[MetadataIndex("w", torch.Size([24, 0]), 6)]


@pytest.mark.parametrize("chunk", [([4], [1]), ([3], [2])], ids=["past-end", "overrun"])
def test_a_chunk_outside_its_shape_is_refused(chunk):
    refused(compact_doc([4], [([0], [4]), chunk]), "outside its shape")


def test_chunks_too_irregular_to_check_are_refused(monkeypatch):
    from ckptio.format import chunks

    grid = [([r, c], [1, 1]) for r in range(8) for c in range(8)]
    assert len(decode(compact_doc([8, 8], grid)).items) == 64
    monkeypatch.setattr(chunks, "COMPARISONS_PER_CHUNK", 0)
    monkeypatch.setattr(chunks, "COMPARISONS_BASE", 10)
    monkeypatch.setattr(chunks, "GRID_CELLS_BASE", 0)  # 9 x 9 boundaries: past the grid check's budget too
    refused(compact_doc([8, 8], grid), "too far from a grid")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"at": encode_packed([0] * 63)}, r"'w': at holds 63 entries of 1 bytes where 64 are expected"),
        ({"offsets": [encode_packed(list(range(65))), 0]}, "offsets column 0 holds 65 entries"),
        ({"crc32c": encode_packed([7] * 319)}, r"crc32c \(one per block\) holds 319 entries"),
        ({"crc32c": 7}, "must be a packed string"),
        ({"at": "Xabc"}, "width letter"),
        ({"at": "I!!!"}, "not valid base64"),
        ({"at": -4800}, "non-negative"),
        ({"count": -1}, "has -1 items"),
        ({"count": True}, "has True items"),
        ({"count": 10**12}, "more than its metadata could describe"),
        ({"offsets": [0, 0]}, "two chunks start at the same offsets"),
        ({"offsets": [encode_packed([0, 0] + [4 * r for r in range(2, 64)]), 0]}, "listed twice"),
        ({"offsets": [0]}, "one offsets and one sizes column per dimension"),
        ({"at": encode_packed([4800 * r + 1 for r in range(64)])}, r"item 63 spans bytes 302401..307201 of data-"),
        ({"file": 2}, "data file number 2"),
        ({"file": 0}, "at offset 0"),
        ({"codec": 3}, "unknown codec number 3"),
        ({"codec": 1}, "'stored_lengths' must be present exactly when an item is compressed"),
        ({"stored_lengths": encode_packed([1] * 320)}, "'stored_lengths' must be present exactly"),
        ({"block_size": 100}, "invalid block_size 100"),
        ({"block_size": 0}, "invalid block_size 0"),
        ({"dtype": "evil"}, "unknown dtype 'evil'"),
        ({"requires_grad": "yes"}, "'requires_grad' must be true or false"),
        ({"type": "pickle"}, "unknown type 'pickle'"),
        ({"size": [256, -300]}, "non-negative integer"),
    ],
)
def test_crafted_columns_get_named_errors(change, match):
    message = refused(compact_doc([256, 300], ROWS, **change), match)
    assert "ckpt/ckptio.json" in message or "ckptio metadata" in message


def test_compressed_block_lengths_are_checked_against_their_logical_lengths():
    compressed = {"codec": 1, "stored_lengths": encode_packed([100] * 320)}
    doc = compact_doc([256, 300], ROWS, **compressed)
    assert decode(doc).items[MetadataIndex("w", torch.Size([0, 0]), 0)].stored_bytes == 500
    lengths = [100] * 320
    lengths[4] = 705  # the last block of item 0 holds 704 logical bytes
    refused(
        compact_doc([256, 300], ROWS, codec=1, stored_lengths=encode_packed(lengths)),
        "block 4 has stored length 705 for 704",
    )
    lengths[4] = 0
    refused(
        compact_doc([256, 300], ROWS, codec=1, stored_lengths=encode_packed(lengths)), "block 4 has stored length 0"
    )
    mixed = {"codec": encode_packed([0] + [1] * 63), "stored_lengths": encode_packed([100] * 320)}
    refused(compact_doc([256, 300], ROWS, **mixed), "item 0 block 0 has stored length 100 for 1024")  # raw: exact
    planes = {"codec": 2, "stored_lengths": encode_packed([100] * 320)}
    assert decode(compact_doc([256, 300], ROWS, **planes))
    refused(compact_doc([256, 300], ROWS, dtype="uint8", **planes), "byte planes")


def test_inline_items_must_match_their_blocks():
    doc = compact_doc([4], [([0], [4])], file=0, at=0, inline=["AAAAAAAAAAAAAAAAAAAAAA=="])
    assert decode(doc).items[MetadataIndex("w", torch.Size([0]), 0)].inline == bytes(16)
    refused(compact_doc([4], [([0], [4])], file=0, at=0, inline=["AAAA"]), "do not match its blocks")
    refused(compact_doc([4], [([0], [4])], file=0, at=0), "one base64 string per inline item")
    refused(compact_doc([4], [([0], [4])], file=0, at=0, inline=["!"]), "not valid base64")


def test_objects_have_one_record_or_one_per_distinct_rank():
    doc = compact_doc([4], [([0], [4])])
    doc["files"]["sizes"] += 30
    obj = {"type": "bytes", "count": 2, "ranks": encode_packed([0, 3]), "length": 10, "file": 1, "at": 16}
    doc["keys"]["loader"] = dict(obj, at=encode_packed([16, 26]), crc32c=encode_packed([1, 2]))
    manifest = decode(doc)
    assert {r: i.offset for r, i in manifest.per_rank["loader"].items()} == {0: 16, 3: 26}
    assert MetadataIndex("loader") not in manifest.items and len(manifest.items) == 1
    doc["keys"]["loader"]["ranks"] = encode_packed([3, 3])
    refused(doc, "distinct ranks")
    doc["keys"]["loader"]["ranks"] = 3
    refused(doc, "all name the same rank")
    del doc["keys"]["loader"]["ranks"]
    refused(doc, "one copy per rank")


def test_objects_stored_once_share_one_table_and_paths_rebuild_the_planner_data():
    doc = compact_doc([4], [([0], [4])], path=[1])
    doc["files"]["sizes"] += 30
    doc["planner_data"] = "paths"
    table = {"keys": ["opt.groups.0.lr", "step"], "paths": [[1, 1, 0, 1], None], "length": 15}
    doc["objects"] = dict(table, file=1, at=encode_packed([16, 31]), crc32c=encode_packed([1, 2]))
    manifest = decode(doc)
    assert manifest.metadata.planner_data == {
        "w": ("w",),
        "opt.groups.0.lr": ("opt", "groups", 0, "lr"),
        "step": ("step",),
    }
    assert [i.offset for i in (manifest.items[MetadataIndex(k)] for k in ("opt.groups.0.lr", "step"))] == [16, 31]
    assert len(manifest.items) == 3 and MetadataIndex("opt.groups.0.lr", torch.Size([0])) not in manifest.items
    for paths, match in [
        ([[1, 1, 0, 1]], "one entry per key"),
        ([[1, 1, 0, 2], None], "does not cover the key's parts"),
        ([[1, 0, 1, 1], None], "list index 'groups'"),
        ([[1, 1, 0, 1], "x"], "list of part counts"),
    ]:
        refused(dict(doc, objects=dict(doc["objects"], paths=paths)), match)
    refused(dict(doc, objects=dict(doc["objects"], keys=["w", "step"])), "'w' is listed twice")
    stored_as_is = {"w": ["w"], "opt.groups.0.lr": ["opt", "groups", 10**9, "lr"], "step": ["step"]}
    refused(dict(doc, planner_data=stored_as_is), "list index 1000000000 that is not below 1048576")
    refused(dict(doc, objects=dict(doc["objects"], keys=["step", "step"])), "distinct key names")
    refused(dict(doc, objects=dict(doc["objects"], at=encode_packed([16, 32]))), "item 1 spans bytes 32..47")
    refused(dict(doc, files=dict(doc["files"], save_ids=["../../etc"])), "plain ckptio data file name")
    refused(dict(doc, files=dict(doc["files"], save_ids=["0123456789abcdef"] * 2)), "names a data file twice")
    refused(dict(doc, files={"names": [FILE]}), "'save_ids', 'ranks' and 'sizes' columns")


def test_declared_sizes_and_counts_fail_before_a_large_allocation():
    huge = [([0], [1 << 40])]  # a 4 TiB chunk: 4 billion blocks declared, one checksum stored
    doc = compact_doc([1 << 40], huge, crc32c=encode_packed([7]))
    doc["files"]["sizes"] = 1 << 42
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused(doc, r"crc32c \(one per block\) holds 1 entries of 1 bytes where 4294967296 are expected")
    doc = compact_doc([4], [([0], [4])], count=10**6)  # more items than a small document can describe
    refused(doc, "more than its metadata could describe")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB


def test_the_readable_view_is_the_same_metadata_in_version_2s_schema():
    doc = compact_doc([256, 300], ROWS, codec=encode_packed([1, 0] * 32), stored_lengths=encode_packed([5] * 320))
    doc["keys"]["w"]["stored_lengths"] = encode_packed(
        [n for r in range(64) for n in ([5] * 5 if r % 2 == 0 else [1024] * 4 + [704])]
    )
    manifest = decode(doc)
    view = legacy_document(manifest)
    assert view["format_version"] == 1 and len(view["items"]) == 64 and "keys" not in view
    again = decode_metadata(json.dumps(view).encode(), "view")
    assert dict(again.items) == dict(manifest.items)
    assert again.metadata.state_dict_metadata == manifest.metadata.state_dict_metadata


def test_a_plain_dcp_load_decodes_the_checksums_of_what_it_reads_only(tmp_path):
    """Every key's checksums share one column; a load decodes the entries of the items it reads, so
    damage elsewhere in the column is found by the load that reads it, naming the column."""
    import torch.distributed.checkpoint as dcp

    import ckptio

    url = str(tmp_path / "ckpt")
    dcp.save({f"t{i}": torch.full((8,), float(i)) for i in range(50)}, storage_writer=ckptio.Writer(url))
    doc = json.load(open(f"{url}/ckptio.json"))
    crcs = doc["blocks"]["crc32c"]
    at = 1 + 30 * 4 // 3 * 4  # the base64 of t30's checksum (one block each)
    doc["blocks"]["crc32c"] = crcs[:at] + "*" + crcs[at + 1 :]
    json.dump(doc, open(f"{url}/ckptio.json", "w"))
    out = {"t7": torch.zeros(8)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["t7"], torch.full((8,), 7.0))
    with pytest.raises(ckptio.CheckpointFormatError, match=r"blocks: crc32c .* not valid base64"):
        ckptio.load({"t30": torch.zeros(8)}, url)


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON document."""
    yield prefix, value
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


def test_any_field_replaced_by_a_hostile_value_is_a_named_error_or_loads_the_original_values(tmp_path):
    """A mutated document is refused by name (at decode, or by the load's checksums), or what it
    loads is exactly what was saved: an accepted mutation never loads other values."""
    import random

    import torch.distributed.checkpoint as dcp

    import ckptio
    from tests.helpers.random_states import blank, differences

    url = str(tmp_path / "ckpt")
    state = {"w": torch.randn(64, 8), "b": torch.arange(5), "opt": {"lr": 0.1, "groups": [1, 2]}, "e": torch.ones(0)}
    dcp.save(
        state,
        storage_writer=ckptio.Writer(
            url, ckptio.WriterConfig(compression="zstd", tuning=ckptio.Tuning(inline_limit=0))
        ),
    )
    good = json.load(open(f"{url}/ckptio.json"))
    accepted = 0
    places = [path for path, _ in _paths(good) if path]
    hostile = [-1, 0, 2**64, 2**70, 1.5, True, None, "", "Q", "I////", "x" * 300, [], [0] * 3, {}, {"a": 1}]
    rng = random.Random(0)
    for _ in range(600):
        doc = json.loads(json.dumps(good))
        for _ in range(rng.choice((1, 1, 2))):
            path = rng.choice(places)
            parent = doc
            try:
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = rng.choice(hostile)
            except (KeyError, IndexError, TypeError):
                pass  # an earlier change removed the place
        try:
            decode(doc)
        except CheckpointFormatError:
            continue  # anything else (TypeError, MemoryError, ...) fails the test
        accepted += 1
        with open(f"{url}/ckptio.json", "w") as f:
            json.dump(doc, f)
        target = blank(state)
        try:
            ckptio.load(target, url)
        except ckptio.CheckpointError:
            continue  # named: a checksum, a size, a key the document no longer holds
        assert differences(state, target) == [], doc
    assert accepted > 10  # the sweep reaches loads, not only the decoder


def test_a_key_no_rank_reported_writing_fails_the_commit_naming_it():
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from ckptio.errors import CheckpointError
    from ckptio.legacy.v3 import encode_document

    metadata = Metadata(state_dict_metadata={"step": BytesStorageMetadata(), "loader": BytesStorageMetadata()})
    with pytest.raises(CheckpointError, match="no rank reported writing key 'loader'"):
        encode_document(metadata, {("step", None): object()}, {}, {}, {}, 64)


def test_codec_numbers_are_a_format_constant():
    """Version 3 stores a codec as its position in ``records.Codec``: members may only be appended."""
    from ckptio.format.names import CODECS

    assert [c.value for c in CODECS] == ["raw", "zstd", "zstd-byteplanes"]
