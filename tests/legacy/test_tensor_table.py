"""Format version 4's ``tensors`` table (``ckptio.legacy.v3``, ``v3_decode``): any set of tensor keys,
of one chunk or a tiling of many, decodes to exactly the records it was written from (as version 3's
per-key records do), and crafted columns are refused by name."""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.errors import CheckpointFormatError
from ckptio.format.document import decode_metadata
from ckptio.format.names import dtype_name
from ckptio.legacy.v3 import TABLE_MAX_CHUNKS, encode_column, encode_packed
from tests.helpers.crafted import FILE, Records, stored_item, tensor_entry

EXAMPLES = int(os.environ.get("CKPTIO_PROPERTY_EXAMPLES", "100"))
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


@st.composite
def tensor_keys(draw) -> Records:
    """Tensor keys of 0-3 dimensions (empty ones too), each stored whole or as a grid of up to 27 chunks."""
    r = Records({}, {}, {FILE: 0}, {})
    at = 0
    for k in range(draw(st.integers(0, 12))):
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        cuts = [sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2)))) if n > 1 else [] for n in shape]
        edges = [[0, *(c for c in cut if c < n), n] for cut, n in zip(cuts, shape, strict=True)]
        boxes = [
            ([lo for lo, _ in cell], [hi - lo for lo, hi in cell])
            for cell in itertools.product(*[list(zip(e, e[1:], strict=False)) for e in edges])
        ]
        fqn = f"layers.{k}.w"
        r.state[fqn] = tensor_entry(dtype, shape, boxes)
        r.state[fqn].properties.requires_grad = draw(st.booleans())
        for i, (offsets, sizes) in enumerate(boxes):
            logical = math.prod(sizes) * dtype.itemsize
            item = stored_item(at, logical, dtype=dtype_name(dtype), shape=tuple(sizes))
            r.items[MetadataIndex(fqn, torch.Size(offsets), i)] = item
            at += logical
        r.planner_data[fqn] = tuple(fqn.split("."))
    r.files[FILE] = at
    return r


@settings(max_examples=EXAMPLES, deadline=None)
@given(tensor_keys())
def test_any_tensor_keys_decode_to_their_records_in_versions_4_and_3(r):
    for version in (4, 3):
        manifest = decode_metadata(r.document(version), "ckpt/ckptio.json")
        assert manifest.metadata.state_dict_metadata == r.state
        assert dict(manifest.items) == r.items and len(manifest.items) == len(r.items)
        assert manifest.metadata.planner_data == r.planner_data
        for index, item in r.items.items():  # each found by its chunk's position, and by offsets alone
            assert manifest.items[index] == item
            assert manifest.items[MetadataIndex(index.fqn, index.offset)] == item
    doc = json.loads(r.document(4))
    tabled = [fqn for fqn, md in r.state.items() if len(md.chunks) <= TABLE_MAX_CHUNKS]
    assert doc.get("tensors", {"keys": []})["keys"] == tabled  # keys of many chunks keep a record each
    assert list(doc["keys"]) == [fqn for fqn in r.state if fqn not in tabled]


def _doc() -> dict:
    """Version 4: ``w`` (float32 8x16 in two row chunks) and ``h`` (bfloat16, whole) in the table."""
    r = Records({}, {}, {FILE: 640}, {"w": ("w",), "h": ("h",)})
    r.state["w"] = tensor_entry(torch.float32, [8, 16], [([0, 0], [4, 16]), ([4, 0], [4, 16])])
    r.state["h"] = tensor_entry(torch.bfloat16, [64], [([0], [64])])
    r.items[MetadataIndex("w", torch.Size([0, 0]), 0)] = stored_item(0, 256, dtype="float32", shape=(4, 16))
    r.items[MetadataIndex("w", torch.Size([4, 0]), 1)] = stored_item(256, 256, dtype="float32", shape=(4, 16))
    r.items[MetadataIndex("h", torch.Size([0]), 0)] = stored_item(512, 128, dtype="bfloat16", shape=(64,))
    doc = json.loads(r.document(4))
    assert doc["tensors"]["keys"] == ["w", "h"] and doc["keys"] == {}
    return doc


def _refused(doc: dict, match: str) -> None:
    with pytest.raises(CheckpointFormatError, match=match) as info:
        decode_metadata(json.dumps(doc).encode(), "ckpt/ckptio.json")
    assert "ckpt/ckptio.json" in str(info.value)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dtype": 2}, "'dtype' must index 'dtypes'"),
        ({"requires_grad": 2}, "'requires_grad' hold 0 or 1"),
        ({"count": encode_column([0, 1])}, "'count' be positive"),
        ({"ndim": 10**9}, "'ndim' fit the document"),
        ({"count": encode_column([10**9, 1])}, "more chunks than the document could describe"),
        ({"dtypes": ["bfloat16", "bfloat16"]}, "distinct dtype names"),
        ({"dtypes": ["bfloat16", "evil"]}, "unknown dtype 'evil'"),
        ({"keys": ["w", "w"]}, "distinct key names"),
        ({"size": encode_packed([8, 16])}, "size holds 2 entries of 1 bytes where 3 are expected"),
        ({"offsets": encode_packed([0, 0, 5, 0])}, r"key 'w' has a chunk at \[5, 0\] of size \[4, 16\] outside"),
        ({"offsets": encode_packed([0, 0, 3, 0])}, "key 'w': its chunks hold 128 elements .* does not cover"),
        ({"offsets": encode_packed([0, 0, 0, 0])}, "key 'w': a chunk is listed twice"),
        ({"sizes": encode_packed([4, 16, 3, 16])}, "key 'w': its chunks hold 112 elements"),
        ({"offsets": encode_packed([0, 0, 4])}, "offsets holds 3 entries"),
        ({"at": encode_packed([0, 256, 600])}, r"item 2 spans bytes 600\.\.728"),
        ({"codec": encode_packed([0, 0, 2])}, "stored_lengths"),
        ({"crc32c": encode_packed([7] * 4, "I")}, r"crc32c \(one per block\) holds 4 entries .* where 5"),
    ],
)
def test_crafted_table_columns_get_named_errors(change, match):
    doc = _doc()
    doc["tensors"].update(change)
    _refused(doc, match)


def test_chunk_counts_are_bounded_before_anything_is_allocated():
    """A scalar key has no box entries: its declared chunk count is bounded by itself."""
    doc = _doc()
    doc["tensors"].update(ndim=encode_column([2, 0]), size=encode_column([8, 16]), count=encode_column([2, 10**15]))
    _refused(doc, "'count' declares more chunks than the document could describe")


def test_byte_planes_in_the_table_need_2_4_or_8_byte_elements():
    doc = _doc()
    doc["tensors"].update(codec=2, stored_lengths=encode_packed([128, 128, 128, 128, 128]))
    assert decode_metadata(json.dumps(doc).encode(), "x").items[MetadataIndex("h", torch.Size([0]))].codec.value
    doc["tensors"]["dtypes"] = ["bool", "float32"]  # h: bool, 1-byte elements
    _refused(doc, "tensors table: item 2 uses byte planes but is not a tensor of 2-, 4- or 8-byte elements")


def test_a_table_is_version_4s_and_a_key_is_listed_once():
    doc = _doc()
    _refused(dict(doc, format_version=3), "a 'tensors' table is format version 4's, not 3's")
    doc["objects"] = {"keys": ["h"], "length": 4, "file": 0, "at": 0, "crc32c": encode_packed([1], "I")}
    doc["objects"]["inline"] = ["AAAAAA=="]
    _refused(doc, "key 'h' is listed twice")
