"""Every format rule (``ckptio.format.rules``) holds in every format version the decoder accepts.

Each case crafts the checkpoint's *records* (DCP's metadata and the stored items), then writes them in
each version's schema with that version's own encoder (version 8 first: ckptio 1.0's, what every save
writes; then 0.x's, read by ``format/legacy.py``), and
expects the same named error from the decoder. The untouched records decode in every version, so a case
fails only through the rule it breaks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
)

from ckptio.errors import CheckpointFormatError
from ckptio.format.document import decode_metadata
from ckptio.format.names import Codec
from tests.helpers.crafted import FILE, Records, sample_records, stored_item, tensor_entry

VERSIONS = [8, 4, 3, 2, 1]


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
    r.state["z"] = tensor_entry(torch.float32, [2**62, 0], [([0, 0], [2**62, 0])])
    r.items[MetadataIndex("z", torch.Size([0, 0]), 0)] = stored_item(0, 0, dtype="float32", shape=(2**62, 0))
    r.planner_data["z"] = ("z",)


#: rule -> (what breaks it, the error every version gives; a dict where an older version's rule fires first)
CASES: dict[str, tuple[Callable[[Records], None], str | dict[int, str]]] = {
    "byte planes need 2/4/8-byte elements": (
        lambda r: _replace(r, "q", codec=Codec.ZSTD_BYTEPLANES, blocks=((64, 0),)),
        {
            8: "byte planes but is not a tensor",
            4: "byte planes but is not a tensor",
            3: "byte planes but",
            2: "byte planes but",
            1: "version 1 lacks",
        },
    ),
    "byte planes are version 2's": (
        lambda r: _replace(r, "h", codec=Codec.ZSTD_BYTEPLANES, blocks=((100, 0),)),
        {8: None, 4: None, 3: None, 2: None, 1: "uses codec 'zstd-byteplanes', which format version 1 lacks"},
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
    manifest = decode_metadata(sample_records().document(version), "ckpt/ckptio.json")
    assert dict(manifest.items) == sample_records().items
    assert manifest.metadata.planner_data == sample_records().planner_data


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("rule", list(CASES))
def test_every_rule_refuses_its_crafted_records_in_every_version(rule, version):
    craft, expected = CASES[rule]
    r = sample_records()
    craft(r)
    match = expected.get(version) if isinstance(expected, dict) else expected
    if match is None:  # the records are valid in this version
        manifest = decode_metadata(r.document(version), "ckpt/ckptio.json")
        assert dict(manifest.items) == r.items
        return
    with pytest.raises(CheckpointFormatError, match=match) as info:
        decode_metadata(r.document(version), "ckpt/ckptio.json")
    assert "ckpt/ckptio.json" in str(info.value)
