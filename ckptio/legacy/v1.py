"""Format versions 1 and 2 (ckptio 0.1 and 0.2): a JSON object per stored item beside DCP's chunk list.

No ckptio writes them any more; every one still loads, and ``legacy_document`` shows any checkpoint
in this schema (``ckptio inspect --json``), a document every ckptio 0.1 can read (version 1 unless an
item uses byte planes, which version 2 added). Every check is a rule of ``rules``.
"""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import math
import sys
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.errors import CheckpointFormatError
from ckptio.format import rules
from ckptio.format.names import CODECS, Codec, ItemKind, dtype_from_name, dtype_name
from ckptio.format.records import (
    FieldReader,
    Header,
    Manifest,
    StoredItem,
    block_logical_lengths,
    manifest_of,
    planner_data_json,
)
from ckptio.legacy import rules as legacy_rules

_CODEC_NUMBERS = {codec: number for number, codec in enumerate(CODECS)}


def legacy_document(manifest: Manifest) -> dict[str, Any]:
    """The metadata in version 2's schema (version 1 when no item uses byte planes)."""
    metadata, per_rank = manifest.metadata, manifest.per_rank
    version = max((i.codec.format_version for i in manifest.items.values()), default=1)
    version = max([version] + [i.codec.format_version for copies in per_rank.values() for i in copies.values()])
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": ItemKind.BYTES.value}
        else:
            props = md.properties
            state[fqn] = {
                "type": ItemKind.TENSOR.value,
                "dtype": dtype_name(props.dtype),
                "size": list(md.size),
                "requires_grad": bool(props.requires_grad),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
    return {
        **dataclasses.replace(manifest.header, format_version=version).to_json(),
        "per_rank_objects": {
            key: {str(rank): item_json(item) for rank, item in copies.items()} for key, copies in per_rank.items()
        },
        "state": state,
        "planner_data": planner_data_json(metadata.planner_data),
        "items": [
            {
                "fqn": idx.fqn,
                "chunk_offset": list(idx.offset) if idx.offset is not None else None,
                "index": idx.index,
                **item_json(item),
            }
            for idx, item in manifest.items.items()
        ],
    }


def item_json(item: StoredItem) -> dict[str, Any]:
    """One stored item's record in this schema."""
    return {
        "file": item.file,
        "offset": item.offset,
        "logical_bytes": item.logical_bytes,
        "kind": item.kind._value_,
        "dtype": item.dtype,
        "shape": list(item.shape) if item.shape is not None else None,
        "codec": item.codec._value_,
        "block_size": item.block_size,
        # Packed little-endian uint32 arrays: 4 bytes per block instead of a JSON list.
        "crc32c": pack_counts([crc for _, crc in item.blocks]),
        **({"stored_lengths": pack_counts([n for n, _ in item.blocks])} if item.codec != Codec.RAW else {}),
        **({"inline": base64.b64encode(item.inline).decode()} if item.inline is not None else {}),
    }


def decode_version_1(doc: dict[str, Any], where: str) -> Manifest:
    """A version 1 or 2 document, checked."""
    field = FieldReader(doc, where)
    header = Header.from_json(doc, where, checked_files=_data_files(field, where))
    files = _DataFiles.of(header)
    state = {
        fqn: _decode_state_entry(entry, fqn, where)
        for fqn, entry in FieldReader(doc, where).mapping("state", required=True).items()
    }
    items_doc = doc["items"]
    if not isinstance(items_doc, list):
        raise CheckpointFormatError(f"{where}: 'items' must be a list")
    items: dict[MetadataIndex, StoredItem] = {}
    for raw in items_doc:
        offset = raw["chunk_offset"]
        index = MetadataIndex(
            raw["fqn"], torch.Size(rules.require_counts(offset)) if offset is not None else None, raw["index"]
        )
        if not isinstance(index.fqn, str) or index in items:
            raise CheckpointFormatError(f"{where}: item {index.fqn!r:.80} at {offset} is listed twice or unnamed")
        items[index] = _decode_item(raw, index.fqn, header, files, where)
    per_rank = {
        fqn: {_rank_of(rank, where): _decode_item(raw, fqn, header, files, where) for rank, raw in copies.items()}
        for fqn, copies in (FieldReader(doc, where).mapping("per_rank_objects", nullable=True) or {}).items()
    }
    _check_items_match(state, items, per_rank, where)
    planner_data = rules.check_planner_paths(doc.get("planner_data"), len(state), where)
    return manifest_of(header, state, items, per_rank, planner_data)


def _decode_state_entry(entry: Any, fqn: str, where: str) -> Any:
    where = f"{where}: key {fqn!r:.80}"
    if not isinstance(entry, dict):
        raise CheckpointFormatError(f"{where} has a malformed entry")
    if entry.get("type") == ItemKind.BYTES.value:
        return BytesStorageMetadata()
    if entry.get("type") != ItemKind.TENSOR.value:
        raise CheckpointFormatError(f"{where} has unknown type {entry.get('type')!r:.40}")
    size = torch.Size(rules.require_counts(entry["size"], where))
    chunks = [
        (rules.require_counts(c["offsets"], where), rules.require_counts(c["sizes"], where)) for c in entry["chunks"]
    ]
    for o, n in chunks:
        if len(o) != len(size) or len(n) != len(size):  # the rank; the rest is check_chunks_tile's
            raise CheckpointFormatError(f"{where} has a chunk at {o} of size {n} outside its shape {list(size)}")
    offset_columns = [[o[d] for o, _ in chunks] for d in range(len(size))]
    size_columns = [[n[d] for _, n in chunks] for d in range(len(size))]
    rules.check_chunks_tile(size, len(chunks), offset_columns, size_columns, where)
    props = TensorProperties(dtype=dtype_from_name(entry["dtype"]), requires_grad=bool(entry["requires_grad"]))
    rules.check_shape(size, props.dtype.itemsize, where)
    return TensorStorageMetadata(
        properties=props,
        size=size,
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in chunks],
    )


def _check_items_match(
    state: dict[str, Any], items: dict[MetadataIndex, StoredItem], per_rank: dict[str, Any], where: str
) -> None:
    """Every declared chunk and object has a stored item of the right kind, shape and dtype (that the
    chunks tile their tensor is ``rules.check_chunks_tile``'s, in ``_decode_state_entry``)."""
    by_key: dict[str, dict[tuple[int, ...] | None, StoredItem]] = {}
    for index, item in items.items():
        if index.fqn not in state:
            raise CheckpointFormatError(f"{where}: item {index.fqn!r:.80} is stored but not declared in 'state'")
        by_key.setdefault(index.fqn, {})[tuple(index.offset) if index.offset is not None else None] = item
    for fqn, md in state.items():
        stored = by_key.get(fqn, {})
        if isinstance(md, BytesStorageMetadata):
            if fqn not in per_rank and (len(stored) != 1 or next(iter(stored.values())).kind != ItemKind.BYTES):
                raise CheckpointFormatError(f"{where}: object {fqn!r:.80} has no stored object record")
            continue
        for chunk in md.chunks:
            item = stored.get(tuple(chunk.offsets))
            expected = tuple(chunk.sizes)
            if item is None or item.kind != ItemKind.TENSOR or item.shape != expected:
                raise CheckpointFormatError(
                    f"{where}: key {fqn!r:.80} declares a chunk at {list(chunk.offsets)} of size {list(expected)} "
                    f"but the stored record is {'missing' if item is None else f'{item.kind.value} {item.shape}'}"
                )
            if item.dtype != dtype_name(md.properties.dtype):
                raise CheckpointFormatError(
                    f"{where}: key {fqn!r:.80} is {dtype_name(md.properties.dtype)} but a chunk is stored "
                    f"as {item.dtype}"
                )


def _rank_of(text: Any, where: str) -> int:
    if not isinstance(text, str) or not text.isdigit() or len(text) > 9:
        raise CheckpointFormatError(f"{where}: per-rank object copies are keyed by rank numbers, got {text!r:.40}")
    return int(text)


class _DataFiles(NamedTuple):
    """The header's data files as the rules take them (built once per document, not per item)."""

    names: list[str]
    numbers: dict[str, int]  # name -> 1-based number
    sizes: list[int]

    @classmethod
    def of(cls, header: Header) -> "_DataFiles":
        names = list(header.files)
        return cls(names, {name: n for n, name in enumerate(names, 1)}, list(header.files.values()))


def _decode_item(raw: dict[str, Any], fqn: str, header: Header, files: _DataFiles, where: str) -> StoredItem:
    key = f"{where}: item {fqn!r:.80}"
    try:
        kind, codec = ItemKind(raw["kind"]), Codec(raw["codec"])
    except (ValueError, TypeError):
        raise CheckpointFormatError(
            f"{key} has unknown kind {raw['kind']!r:.40} or codec {raw['codec']!r:.40}"
        ) from None
    file = raw["file"]
    if not isinstance(file, str) or (file and file not in files.numbers):
        raise CheckpointFormatError(f"{key} points at {file!r:.80}, which is not a data file of this checkpoint")
    offset = rules.require_count(raw["offset"], "offset", key)
    logical = rules.require_count(raw["logical_bytes"], "logical_bytes", key)
    block_size = rules.require_count(raw["block_size"], "block_size", key)
    dtype = raw["dtype"] if kind == ItemKind.TENSOR else None
    itemsize = dtype_from_name(dtype).itemsize if kind == ItemKind.TENSOR else 0
    legacy_rules.check_codecs([_CODEC_NUMBERS[codec]], itemsize, header.format_version, key)
    legacy_rules.check_block_sizes([block_size], key)
    file_number = files.numbers[file] if file else 0
    legacy_rules.check_file_numbers([file_number], [offset], len(files.names), key)
    blocks = _decode_blocks(raw, logical, block_size, key)
    stored = legacy_rules.check_block_lengths([n for n, _ in blocks], logical, block_size, codec == Codec.RAW, key)
    legacy_rules.check_spans([file_number], [offset], [stored], files.names, files.sizes, key)
    inline = rules.decode_inline(raw.get("inline"), key)
    if file_number == 0:
        legacy_rules.check_inline_bytes(inline, stored, key)
    elif inline is not None:
        raise CheckpointFormatError(f"{key} is in {file} and inline at once")
    shape = tuple(rules.require_counts(raw["shape"], key)) if kind == ItemKind.TENSOR else None
    if kind == ItemKind.TENSOR and math.prod(shape) * itemsize != logical:
        raise CheckpointFormatError(f"{key} has shape {shape} of {dtype} but {logical} bytes")
    return StoredItem(file, offset, logical, kind, dtype, shape, codec, block_size, blocks, inline)


def _decode_blocks(raw: dict[str, Any], logical: int, block_size: int, where: str) -> tuple[tuple[int, int], ...]:
    """(stored length, crc32c) per block; a raw item's lengths are its blocks' logical lengths."""
    crcs = unpack_counts(raw["crc32c"], where)
    expected = -(-logical // block_size)
    if len(crcs) != expected:
        raise CheckpointFormatError(f"{where} lists {len(crcs)} blocks, expected {expected}")
    if "stored_lengths" in raw:
        lengths = unpack_counts(raw["stored_lengths"], where)
        if len(lengths) != len(crcs):
            raise CheckpointFormatError(f"{where} has {len(crcs)} checksums but {len(lengths)} lengths")
    else:
        lengths = block_logical_lengths(logical, block_size)
    return tuple(zip(lengths, crcs, strict=True))


def pack_counts(values: list[int]) -> str:
    """Little-endian uint32s as base64: this schema's per-block checksums and lengths."""
    packed = array.array("I", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


def unpack_counts(text: Any, where: str) -> list[int]:
    try:
        packed = array.array("I", base64.b64decode(text, validate=True))
    except (binascii.Error, TypeError, ValueError):
        raise CheckpointFormatError(
            f"{where}: a packed checksum or length list is not valid base64 uint32 data"
        ) from None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def _data_files(field: FieldReader, where: str) -> tuple[dict[str, int], dict[str, int]]:
    """Versions 1 and 2: ``files`` (name -> size) and ``writer_ranks`` (name -> rank), checked."""
    files = field.mapping("files", required=True)
    for name, size in files.items():
        rules.refuse_data_file_name(name, where)
        rules.require_count(size, f"{where}: size of {name}")
    writer_ranks = field.mapping("writer_ranks")
    for name, rank in writer_ranks.items():
        if name not in files:
            raise CheckpointFormatError(f"{where}: 'writer_ranks' names {name!r}, which is not in 'files'")
        rules.require_count(rank, f"{where}: writer_ranks[{name!r}]")
    return files, writer_ranks
