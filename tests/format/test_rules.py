"""Every format rule (``ckptio.format.rules``) holds in every format version the decoder accepts.

Each case crafts the checkpoint's *records* (DCP's metadata and the stored items), then writes them in
each version's schema with that version's own encoder (version 3 first: what every save writes), and
expects the same named error from the decoder. The untouched records decode in every version, so a case
fails only through the rule it breaks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.errors import CheckpointFormatError
from ckptio.format.names import Codec, ItemKind, data_file_name
from ckptio.format.records import Header, Manifest, SavedConfig, StoredItem, block_logical_lengths
from ckptio.format.v1 import legacy_document
from ckptio.format.versions import decode_metadata, encode_metadata

VERSIONS = [3, 2, 1]
FILE = data_file_name("0123456789abcdef", 0)
BLOCK = 128


@dataclasses.dataclass
class Records:
    """What a checkpoint's metadata says, before any version's schema: DCP's key entries, the stored
    item of each (key, chunk offsets), the data files and the planner's paths."""

    state: dict[str, Any]
    items: dict[MetadataIndex, StoredItem]
    files: dict[str, int]
    planner_data: dict[str, tuple[Any, ...]]

    def document(self, version: int) -> bytes:
        metadata = Metadata(state_dict_metadata=self.state, planner_data=self.planner_data)
        header = Header(files=self.files, config=SavedConfig(max_block_size=BLOCK))
        if version == 3:
            items = {(index.fqn, index.offset): item for index, item in self.items.items()}
            return encode_metadata(metadata, items, header)
        manifest = Manifest(header=header, metadata=metadata, items=self.items)
        return json.dumps({**legacy_document(manifest), "format_version": version}).encode()

    def chunk(self, fqn: str, i: int) -> tuple[MetadataIndex, StoredItem]:
        md = self.state[fqn]
        index = MetadataIndex(fqn, md.chunks[i].offsets, i)
        return index, self.items[index]


def _tensor(dtype: torch.dtype, size: list[int], chunks: list[tuple[list[int], list[int]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks],
    )


def _item(at: int, logical: int, kind: ItemKind = ItemKind.TENSOR, dtype: str | None = None, shape=None, **more):
    blocks = tuple((n, 0) for n in block_logical_lengths(logical, BLOCK))
    fields = dict(file=FILE, offset=at, logical_bytes=logical, kind=kind, dtype=dtype, shape=shape)
    return StoredItem(**{**fields, "codec": Codec.RAW, "block_size": BLOCK, "blocks": blocks, **more})


def records() -> Records:
    """Valid records: a float32 tensor in two row chunks, a bf16 and an int8 tensor, an object in the
    data file, an object inline, and a key whose path holds a list index."""
    w = _tensor(torch.float32, [8, 16], [([0, 0], [4, 16]), ([4, 0], [4, 16])])
    h = _tensor(torch.bfloat16, [64], [([0], [64])])
    q = _tensor(torch.int8, [64], [([0], [64])])
    state = {"w": w, "h": h, "q": q, "l.3": BytesStorageMetadata(), "o": BytesStorageMetadata()}
    items = {
        MetadataIndex("w", torch.Size([0, 0]), 0): _item(0, 256, dtype="float32", shape=(4, 16)),
        MetadataIndex("w", torch.Size([4, 0]), 1): _item(256, 256, dtype="float32", shape=(4, 16)),
        MetadataIndex("h", torch.Size([0]), 0): _item(512, 128, dtype="bfloat16", shape=(64,)),
        MetadataIndex("q", torch.Size([0]), 0): _item(640, 64, dtype="int8", shape=(64,)),
        MetadataIndex("l.3"): _item(704, 10, ItemKind.BYTES),
        MetadataIndex("o"): _item(0, 6, ItemKind.BYTES, file="", inline=b"inline"),
    }
    paths = {"w": ("w",), "h": ("h",), "q": ("q",), "l.3": ("l", 3), "o": ("o",)}
    return Records(state, items, {FILE: 714}, paths)


def _replace(r: Records, fqn: str, i: int = 0, **fields) -> None:
    """The stored item of object ``fqn``, or of chunk ``i`` of tensor ``fqn``, with other ``fields``."""
    index = MetadataIndex(fqn) if isinstance(r.state[fqn], BytesStorageMetadata) else r.chunk(fqn, i)[0]
    r.items[index] = dataclasses.replace(r.items[index], **fields)


def _move_chunk(r: Records, fqn: str, i: int, offsets: list[int], sizes: list[int] | None = None) -> None:
    """Chunk ``i`` of ``fqn`` declared (and stored) at other offsets and sizes."""
    md = r.state[fqn]
    index, item = r.chunk(fqn, i)
    sizes = sizes or list(md.chunks[i].sizes)
    md.chunks[i] = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    del r.items[index]
    r.items[MetadataIndex(fqn, torch.Size(offsets), i)] = dataclasses.replace(item, shape=tuple(sizes))


def _drop_chunk(r: Records, fqn: str, i: int) -> None:
    index, _ = r.chunk(fqn, i)
    del r.items[index]
    del r.state[fqn].chunks[i]


def _huge_shape(r: Records) -> None:
    r.state["z"] = _tensor(torch.float32, [2**62, 0], [([0, 0], [2**62, 0])])
    r.items[MetadataIndex("z", torch.Size([0, 0]), 0)] = _item(0, 0, dtype="float32", shape=(2**62, 0))
    r.planner_data["z"] = ("z",)


#: rule -> (what breaks it, the error every version gives; a dict where an older version's rule fires first)
CASES: dict[str, tuple[Callable[[Records], None], str | dict[int, str]]] = {
    "byte planes need 2/4/8-byte elements": (
        lambda r: _replace(r, "q", codec=Codec.ZSTD_BYTEPLANES, blocks=((64, 0),)),
        {3: "byte planes but is not a tensor of 2-, 4- or 8-byte elements", 2: "byte planes but", 1: "version 1 lacks"},
    ),
    "byte planes are version 2's": (
        lambda r: _replace(r, "h", codec=Codec.ZSTD_BYTEPLANES, blocks=((100, 0),)),
        {3: None, 2: None, 1: "uses codec 'zstd-byteplanes', which format version 1 lacks"},
    ),
    "block size": (lambda r: _replace(r, "h", block_size=100, blocks=((100, 0), (28, 0))), "invalid block_size 100"),
    "item inside its file": (
        lambda r: r.files.update({FILE: 710}),
        r"spans bytes 704\.\.714 of data-.*holds 710 bytes",
    ),
    "compressed blocks are no longer than logical": (
        lambda r: _replace(r, "w", 1, codec=Codec.ZSTD, blocks=((120, 0), (129, 0))),
        "block 1 has stored length 129 for 128 logical bytes",
    ),
    "compressed blocks within the ratio": (
        lambda r: _replace(r, "w", 1, codec=Codec.ZSTD, blocks=((120, 0), (0, 0))),
        "block 1 has stored length 0",
    ),
    "inline bytes match the blocks": (
        lambda r: _replace(r, "o", inline=b"short"),
        "stored inline but its bytes do not match its blocks",
    ),
    "chunks inside the shape": (lambda r: _move_chunk(r, "w", 1, [6, 0]), r"chunk at \[6, 0\] .* outside its shape"),
    "chunks cover the tensor": (lambda r: _drop_chunk(r, "w", 1), "hold 64 elements for a shape .* of 128"),
    "chunks do not overlap": (lambda r: _move_chunk(r, "w", 1, [2, 0]), "128 elements .* does not cover the tensor"),
    "chunks start at distinct offsets": (
        lambda r: _move_chunk(r, "w", 1, [0, 0], [4, 16]),
        "two chunks start at the same offsets",
    ),
    "shape within int64": (_huge_shape, "more elements than a tensor can hold"),
    "list indices bounded": (
        lambda r: _rename(r, "l.3", "l.2000000", ("l", 2_000_000)),
        "key 'l.2000000' has a list index 2000000 that is not below 1048576",
    ),
}


def _rename(r: Records, old: str, new: str, path: tuple[Any, ...]) -> None:
    r.state[new] = r.state.pop(old)
    r.items[MetadataIndex(new)] = r.items.pop(MetadataIndex(old))
    del r.planner_data[old]
    r.planner_data[new] = path


@pytest.mark.parametrize("version", VERSIONS)
def test_the_valid_records_decode_in_every_version(version):
    manifest = decode_metadata(records().document(version), "ckpt/ckptio.json")
    assert dict(manifest.items) == records().items
    assert manifest.metadata.planner_data == records().planner_data


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("rule", list(CASES))
def test_every_rule_refuses_its_crafted_records_in_every_version(rule, version):
    craft, expected = CASES[rule]
    r = records()
    craft(r)
    match = expected.get(version) if isinstance(expected, dict) else expected
    if match is None:  # the records are valid in this version
        manifest = decode_metadata(r.document(version), "ckpt/ckptio.json")
        assert dict(manifest.items) == r.items
        return
    with pytest.raises(CheckpointFormatError, match=match) as info:
        decode_metadata(r.document(version), "ckpt/ckptio.json")
    assert "ckpt/ckptio.json" in str(info.value)
