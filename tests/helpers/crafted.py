"""Checkpoint metadata as records (DCP's entries and ckptio's stored items), written in any format
version by that version's own encoder: the input of tests that craft documents."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.format.document import encode_metadata
from ckptio.format.names import FORMAT_VERSION, Codec, ItemKind, data_file_name
from ckptio.format.records import Header, Manifest, SavedConfig, StoredItem, block_logical_lengths
from ckptio.legacy.reader import encode_legacy
from ckptio.legacy.v1 import legacy_document

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
        items = {(index.fqn, index.offset): item for index, item in self.items.items()}
        if version == FORMAT_VERSION:
            return encode_metadata(metadata, items, header)
        if version >= 3:
            return encode_legacy(metadata, items, header, format_version=version)
        manifest = Manifest(header=header, metadata=metadata, items=self.items)
        return json.dumps({**legacy_document(manifest), "format_version": version}).encode()

    def chunk(self, fqn: str, i: int) -> tuple[MetadataIndex, StoredItem]:
        md = self.state[fqn]
        index = MetadataIndex(fqn, md.chunks[i].offsets, i)
        return index, self.items[index]


def tensor_entry(
    dtype: torch.dtype, size: list[int], chunks: list[tuple[list[int], list[int]]]
) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks],
    )


def stored_item(at: int, logical: int, kind: ItemKind = ItemKind.TENSOR, dtype: str | None = None, shape=None, **more):
    blocks = tuple((n, 0) for n in block_logical_lengths(logical, BLOCK))
    fields = dict(file=FILE, offset=at, logical_bytes=logical, kind=kind, dtype=dtype, shape=shape)
    return StoredItem(**{**fields, "codec": Codec.RAW, "block_size": BLOCK, "blocks": blocks, **more})


def sample_records() -> Records:
    """Valid records: a float32 tensor in two row chunks, a bf16 and an int8 tensor, an object in the
    data file, an object inline, and a key whose path holds a list index."""
    w = tensor_entry(torch.float32, [8, 16], [([0, 0], [4, 16]), ([4, 0], [4, 16])])
    h = tensor_entry(torch.bfloat16, [64], [([0], [64])])
    q = tensor_entry(torch.int8, [64], [([0], [64])])
    state = {"w": w, "h": h, "q": q, "l.3": BytesStorageMetadata(), "o": BytesStorageMetadata()}
    items = {
        MetadataIndex("w", torch.Size([0, 0]), 0): stored_item(0, 256, dtype="float32", shape=(4, 16)),
        MetadataIndex("w", torch.Size([4, 0]), 1): stored_item(256, 256, dtype="float32", shape=(4, 16)),
        MetadataIndex("h", torch.Size([0]), 0): stored_item(512, 128, dtype="bfloat16", shape=(64,)),
        MetadataIndex("q", torch.Size([0]), 0): stored_item(640, 64, dtype="int8", shape=(64,)),
        MetadataIndex("l.3"): stored_item(704, 10, ItemKind.BYTES),
        MetadataIndex("o"): stored_item(0, 6, ItemKind.BYTES, file="", inline=b"inline"),
    }
    paths = {"w": ("w",), "h": ("h",), "q": ("q",), "l.3": ("l", 3), "o": ("o",)}
    return Records(state, items, {FILE: 714}, paths)
