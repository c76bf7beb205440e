"""The on-disk format: file names, the item record, and the JSON metadata document.

A checkpoint is a directory (or key prefix) holding::

    ckptio.json                       metadata, written last: its presence commits the save
    data-<save_id>-r<rank>.ckio       one per writing rank: items' blocks, back to back

A rank whose only items are its own small per-rank state stores them inline in ckptio.json
(base64, still checksummed per block) and creates no file.

Nothing here does I/O, and nothing is ever unpickled: the metadata is JSON, validated
before any data file is opened.
"""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import json
import re
import sys
from functools import cached_property
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

from .errors import CheckpointFormatError

FORMAT_NAME = "ckptio"
FORMAT_VERSION = 1
METADATA_NAME = "ckptio.json"
TORCH_DCP_METADATA_NAME = ".metadata"
_DATA_NAME = re.compile(r"^data-[0-9a-f]{8,32}-r[0-9]{5,}\.ckio$")


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}.ckio"


def is_data_file_name(name: str) -> bool:
    return bool(_DATA_NAME.match(name))


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one saved item (a tensor chunk or a bytes object) lives and how to check it."""

    file: str
    offset: int
    logical_bytes: int
    kind: str  # "tensor" or "bytes"
    dtype: str | None
    shape: tuple[int, ...] | None
    codec: str
    block_size: int
    blocks: tuple[tuple[int, int], ...]  # (stored length, crc32c) per block
    inline: bytes | None = None  # stored bytes kept inside ckptio.json (file == "")

    @cached_property
    def block_offsets(self) -> list[int]:
        """Absolute file offset of each block, plus the end offset as a last entry."""
        offsets = [self.offset]
        for stored_len, _ in self.blocks:
            offsets.append(offsets[-1] + stored_len)
        return offsets

    @property
    def stored_bytes(self) -> int:
        return self.block_offsets[-1] - self.offset

    def block_logical_len(self, index: int) -> int:
        return min(self.block_size, self.logical_bytes - index * self.block_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "offset": self.offset,
            "logical_bytes": self.logical_bytes,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "codec": self.codec,
            "block_size": self.block_size,
            # Packed little-endian uint32 arrays: 4 bytes per block instead of a JSON list.
            "crc32c": _pack([crc for _, crc in self.blocks]),
            **({"stored_lengths": _pack([n for n, _ in self.blocks])} if self.codec != "raw" else {}),
            **({"inline": base64.b64encode(self.inline).decode()} if self.inline is not None else {}),
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in ckptio metadata")
    return value


def _torch_attr(name: str, kind: type, what: str) -> Any:
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise CheckpointFormatError(f"unknown {what} {name!r} in ckptio metadata")
    return value


# ---------------------------------------------------------------------------------------
# Encoding


def encode_metadata(metadata: Metadata, items: dict[MetadataIndex, StoredItem], header: dict[str, Any]) -> bytes:
    """Serialize DCP metadata plus ckptio's item records into the JSON document."""
    state: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            state[fqn] = {"type": "bytes"}
        else:
            props = md.properties
            state[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(props.dtype),
                "size": list(md.size),
                "requires_grad": bool(props.requires_grad),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **header,
        "dcp_version": getattr(metadata, "version", None),
        "state": state,
        "planner_data": _encode_planner_data(metadata.planner_data),
        "items": [
            {
                "fqn": idx.fqn,
                "chunk_offset": list(idx.offset) if idx.offset is not None else None,
                "index": idx.index,
                **item.to_json(),
            }
            for idx, item in items.items()
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _encode_planner_data(planner_data: Any) -> Any:
    """torch's default planner stores ``{fqn: (path, elements...)}``; keep it as JSON lists."""
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict) or not all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(isinstance(p, (str, int)) for p in v)
        for k, v in planner_data.items()
    ):
        raise CheckpointFormatError(
            "the save planner's planner_data is not {str: tuple of str/int}; ckptio stores metadata as "
            "JSON and cannot keep arbitrary objects there. Use torch's DefaultSavePlanner or a planner "
            "whose planner_data is a flat-key mapping."
        )
    return {k: list(v) for k, v in planner_data.items()}


# ---------------------------------------------------------------------------------------
# Decoding (everything checked before use)


@dataclasses.dataclass
class Manifest:
    """A decoded, validated ckptio metadata document."""

    header: dict[str, Any]
    metadata: Metadata
    items: dict[MetadataIndex, StoredItem]
    per_rank: dict[str, dict[int, StoredItem]] = dataclasses.field(default_factory=dict)  # kept per-rank objects

    @property
    def files(self) -> dict[str, int]:
        return dict(self.header.get("files", {}))


def decode_metadata(raw: bytes, where: str) -> Manifest:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(
            f"{where} is not valid JSON ({exc}); the metadata is damaged or not a ckptio checkpoint"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointFormatError(f"{where} is not a ckptio metadata document (no 'format': 'ckptio')")
    version = doc.get("format_version")
    if not isinstance(version, int):
        raise CheckpointFormatError(f"{where} has no integer format_version")
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{where} was written by {doc.get('written_by', 'a newer ckptio')} in format version {version}; "
            f"this ckptio reads format versions up to {FORMAT_VERSION}: upgrade ckptio to load it"
        )
    try:
        return _decode_v1(doc, where)
    except CheckpointFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"{where} does not follow the ckptio metadata schema: {exc!r}") from None


def _decode_v1(doc: dict[str, Any], where: str) -> Manifest:
    files = doc["files"]
    if not isinstance(files, dict):
        raise CheckpointFormatError(f"{where}: 'files' must be a mapping of name to size")
    for name, size in files.items():
        if not is_data_file_name(name):
            raise CheckpointFormatError(
                f"{where} names data file {name!r}, which is not a plain ckptio data file name "
                "inside the checkpoint (paths, '..' and URLs are refused)"
            )
        _require_int(size, f"{where}: size of {name}")

    state: dict[str, Any] = {}
    for fqn, entry in doc["state"].items():
        if entry["type"] == "bytes":
            state[fqn] = BytesStorageMetadata()
        elif entry["type"] == "tensor":
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(_ints(c["offsets"])), sizes=torch.Size(_ints(c["sizes"])))
                for c in entry["chunks"]
            ]
            props = TensorProperties(dtype=dtype_from_name(entry["dtype"]), requires_grad=bool(entry["requires_grad"]))
            state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(_ints(entry["size"])), chunks=chunks)
        else:
            raise CheckpointFormatError(f"{where}: key {fqn!r} has unknown type {entry['type']!r}")

    items: dict[MetadataIndex, StoredItem] = {}
    for raw in doc["items"]:
        offset = raw["chunk_offset"]
        index = MetadataIndex(raw["fqn"], torch.Size(_ints(offset)) if offset is not None else None, raw["index"])
        items[index] = _decode_item(raw, index.fqn, files, where)
    per_rank = {
        fqn: {_require_int(int(rank), "rank"): _decode_item(raw, fqn, files, where) for rank, raw in copies.items()}
        for fqn, copies in (doc.get("per_rank_objects") or {}).items()
    }

    planner_data = doc.get("planner_data")
    if planner_data is not None:
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=items)
    if doc.get("dcp_version") is not None:
        metadata.version = doc["dcp_version"]
    header = {k: v for k, v in doc.items() if k not in ("state", "items", "planner_data", "per_rank_objects")}
    return Manifest(header=header, metadata=metadata, items=items, per_rank=per_rank)


def _decode_item(raw: dict[str, Any], fqn: str, files: dict[str, int], where: str) -> StoredItem:
    item = StoredItem(
        file=raw["file"],
        offset=_require_int(raw["offset"], "offset"),
        logical_bytes=_require_int(raw["logical_bytes"], "logical_bytes"),
        kind=raw["kind"],
        dtype=raw["dtype"],
        shape=tuple(_ints(raw["shape"])) if raw["shape"] is not None else None,
        codec=raw["codec"],
        block_size=_require_int(raw["block_size"], "block_size"),
        blocks=_decode_blocks(raw, where),
        inline=_decode_inline(raw.get("inline"), where),
    )
    _check_item(item, fqn, files, where)
    return item


def _check_item(item: StoredItem, fqn: str, files: dict[str, int], where: str) -> None:
    key = f"{where}: item {fqn!r}"
    if item.file == "":
        if item.inline is None or item.offset != 0 or len(item.inline) != item.stored_bytes:
            raise CheckpointFormatError(f"{key} is stored inline but its inline bytes do not match its blocks")
    elif item.inline is not None or item.file not in files:
        raise CheckpointFormatError(f"{key} points at {item.file!r}, which is not a data file of this checkpoint")
    if item.kind not in ("tensor", "bytes") or item.codec not in ("raw", "zstd"):
        raise CheckpointFormatError(f"{key} has unknown kind {item.kind!r} or codec {item.codec!r}")
    if item.block_size <= 0 or item.block_size % 64:
        raise CheckpointFormatError(f"{key} has invalid block_size {item.block_size}")
    expected_blocks = -(-item.logical_bytes // item.block_size)
    if len(item.blocks) != expected_blocks:
        raise CheckpointFormatError(f"{key} lists {len(item.blocks)} blocks, expected {expected_blocks}")
    if item.file and item.offset + item.stored_bytes > files[item.file]:
        raise CheckpointFormatError(
            f"{key} spans bytes {item.offset}..{item.offset + item.stored_bytes} of {item.file}, "
            f"which the metadata says holds {files[item.file]} bytes"
        )
    for i, (stored_len, _) in enumerate(item.blocks):
        logical = item.block_logical_len(i)
        if stored_len <= 0 or stored_len > logical or (item.codec == "raw" and stored_len != logical):
            raise CheckpointFormatError(f"{key} block {i} has stored length {stored_len} for {logical} logical bytes")
    if item.kind == "tensor":
        dtype = dtype_from_name(item.dtype)
        numel = 1
        for dim in item.shape or ():
            numel *= dim
        if numel * dtype.itemsize != item.logical_bytes:
            raise CheckpointFormatError(f"{key} has shape {item.shape} of {item.dtype} but {item.logical_bytes} bytes")


def _pack(values: list[int]) -> str:
    packed = array.array("I", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


def _unpack(text: Any, where: str) -> list[int]:
    try:
        packed = array.array("I", base64.b64decode(text, validate=True))
    except (binascii.Error, TypeError, ValueError):
        raise CheckpointFormatError(
            f"{where}: a packed checksum or length list is not valid base64 uint32 data"
        ) from None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def _decode_blocks(raw: dict[str, Any], where: str) -> tuple[tuple[int, int], ...]:
    crcs = _unpack(raw["crc32c"], where)
    size, block = _require_int(raw["logical_bytes"], "logical_bytes"), _require_int(raw["block_size"], "block_size")
    if "stored_lengths" in raw:
        lengths = _unpack(raw["stored_lengths"], where)
    else:
        lengths = [min(block, size - i * block) for i in range(len(crcs))] if block else []
    if len(lengths) != len(crcs):
        raise CheckpointFormatError(
            f"{where}: item {raw.get('fqn')!r} has {len(crcs)} checksums but {len(lengths)} lengths"
        )
    return tuple(zip(lengths, crcs))


def _decode_inline(value: Any, where: str) -> bytes | None:
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise CheckpointFormatError(f"{where}: an inline item is not valid base64") from None


def _require_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointFormatError(f"ckptio metadata: {what} must be a non-negative integer, got {value!r}")
    return value


def _ints(values: Any) -> list[int]:
    return [_require_int(v, "a shape or offset entry") for v in values]
