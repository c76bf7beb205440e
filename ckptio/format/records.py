"""The on-disk format: its vocabulary, file names, the item record and the typed metadata document.

A checkpoint is a directory (or key prefix) holding::

    ckptio.json                       metadata, written last: its presence commits the save
    data-<save_id>-r<rank>.ckio       one per writing rank: items' blocks, back to back

A rank whose only items are its own small per-rank state stores them inline in ckptio.json
(base64, still checksummed per block) and creates no file.

Nothing here does I/O, and nothing is ever unpickled: the metadata is JSON, and every field is
type- and range-checked here, before any data file is opened.
"""

from __future__ import annotations

import array
import base64
import binascii
import dataclasses
import enum
import itertools
import math
import re
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.config import INT64_LIMIT, LIST_INDEX_LIMIT, ZSTD_MAX_RATIO, is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format.chunks import TooIrregular, outside, overlapping_pair

FORMAT_NAME = "ckptio"
#: The format this ckptio writes, and the newest it reads. Version 2 added the ``zstd-byteplanes``
#: codec; version 3 stores the item records as per-key columns (``v3.py``). Every version loads.
FORMAT_VERSION = 3
METADATA_NAME = "ckptio.json"
TORCH_DCP_METADATA_NAME = ".metadata"
#: The save id in a data file name: ``data-<save id>-r<rank>.ckio``.
SAVE_ID = "[0-9a-f]{8,32}"
_DATA_NAME = re.compile(rf"data-({SAVE_ID})-r([0-9]{{5,}})\.ckio")
_DATA_NAMES = re.compile(rf"^{_DATA_NAME.pattern}$", re.MULTILINE)  # one name per line


class ItemKind(str, enum.Enum):
    """What an item holds: a tensor chunk (raw row-major bytes) or a pickled object."""

    TENSOR = "tensor"
    BYTES = "bytes"


class Codec(str, enum.Enum):
    """How an item's blocks are stored."""

    RAW = "raw"
    ZSTD = "zstd"
    ZSTD_BYTEPLANES = "zstd-byteplanes"  # format version 2: see codec.py

    @property
    def format_version(self) -> int:
        """The oldest format version that has this codec."""
        return 2 if self is Codec.ZSTD_BYTEPLANES else 1


class DataFileName(NamedTuple):
    save_id: str
    rank: int


def data_file_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}.ckio"


def parse_data_file_names(names: list[str]) -> tuple[list[str], list[int]]:
    """The save ids and ranks of plain data-file names (one pattern search over all of them: 8,192
    names in ~2 ms rather than ~10 ms name by name); ``ValueError`` if one is not such a name."""
    if not names:
        return [], []
    joined = "\n".join(names)
    found = _DATA_NAMES.findall(joined)
    if len(found) != len(names) or joined.count("\n") != len(names) - 1:  # a name per line, each whole
        bad = next(name for name in names if parse_data_file_name(name) is None)
        raise ValueError(f"{bad!r} is not a ckptio data file name")
    return [save_id for save_id, _ in found], [int(rank) for _, rank in found]


def parse_data_file_name(name: str) -> DataFileName | None:
    """``(save_id, rank)`` of a plain data-file name; ``None`` for anything else (paths, '..', newlines)."""
    match = _DATA_NAME.fullmatch(name) if isinstance(name, str) else None
    return DataFileName(match.group(1), int(match.group(2))) if match else None


def is_data_file_name(name: str) -> bool:
    return parse_data_file_name(name) is not None


def list_index_bound(keys: int) -> int:
    """List indices in a key's path must be below this (``LIST_INDEX_LIMIT``): the one rule every
    version's decoder applies, and what a save checks before it commits."""
    return max(keys, LIST_INDEX_LIMIT)


def is_list_index(part: Any, keys: int) -> bool:
    return isinstance(part, int) and not isinstance(part, bool) and 0 <= part < list_index_bound(keys)


def check_shape(shape: Any, itemsize: int, where: str) -> None:
    """The one rule on a tensor shape read from a header (every dimension is already within int64):
    its non-zero dimensions alone must fit 2^63-1 bytes (torch refuses a larger size even beside a 0,
    as an overflow naming nothing)."""
    if math.prod(n for n in shape if n) * itemsize >= INT64_LIMIT:
        raise CheckpointFormatError(f"{where}: shape {list(shape)!r:.200} has more elements than a tensor can hold")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r} in ckptio metadata")
    return value


# ---------------------------------------------------------------------------------------
# Records


class _cached:
    """``functools.cached_property`` without the lock it takes on every first use before Python 3.12:
    a save's coordinator reads the stored size of hundreds of thousands of records once each."""

    def __init__(self, compute: Any):
        self.compute, self.name = compute, compute.__name__

    def __get__(self, record: Any, owner: Any = None) -> Any:
        if record is None:
            return self
        value = record.__dict__[self.name] = self.compute(record)
        return value


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one saved item (a tensor chunk or a bytes object) lives and how to check it."""

    file: str
    offset: int
    logical_bytes: int
    kind: ItemKind
    dtype: str | None
    shape: tuple[int, ...] | None
    codec: Codec
    block_size: int
    blocks: tuple[tuple[int, int], ...]  # (stored length, crc32c) per block
    inline: bytes | None = None  # stored bytes kept inside ckptio.json (file == "")

    @_cached
    def block_offsets(self) -> list[int]:
        """Absolute file offset of each block, plus the end offset as a last entry."""
        return list(itertools.accumulate((stored_len for stored_len, _ in self.blocks), initial=self.offset))

    @_cached
    def stored_bytes(self) -> int:
        return sum(stored_len for stored_len, _ in self.blocks)

    @property
    def itemsize(self) -> int:
        """Bytes per element (1 for objects)."""
        return dtype_from_name(self.dtype).itemsize if self.kind == ItemKind.TENSOR else 1

    def block_logical_len(self, index: int) -> int:
        return min(self.block_size, self.logical_bytes - index * self.block_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "offset": self.offset,
            "logical_bytes": self.logical_bytes,
            "kind": self.kind._value_,  # .value is a slow descriptor: millions of items at scale
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "codec": self.codec._value_,
            "block_size": self.block_size,
            # Packed little-endian uint32 arrays: 4 bytes per block instead of a JSON list.
            "crc32c": pack_counts([crc for _, crc in self.blocks]),
            **({"stored_lengths": pack_counts([n for n, _ in self.blocks])} if self.codec != Codec.RAW else {}),
            **({"inline": base64.b64encode(self.inline).decode()} if self.inline is not None else {}),
        }


@dataclasses.dataclass(frozen=True)
class MeshRecord:
    """The device mesh a checkpoint was saved on (shown by ``ckptio inspect``)."""

    shape: tuple[int, ...]
    dims: tuple[str, ...] = ()

    @classmethod
    def of(cls, state_dict: Any) -> "MeshRecord | None":
        """The mesh of the first DTensor in a (nested) state dict, or ``None``."""
        from torch.distributed.tensor import DTensor

        stack = [state_dict] if isinstance(state_dict, dict) else []
        while stack:
            for value in stack.pop().values():
                if isinstance(value, DTensor):
                    mesh = value.device_mesh
                    return cls(tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()))
                if isinstance(value, dict):
                    stack.append(value)
        return None

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dims": list(self.dims)}


@dataclasses.dataclass(frozen=True)
class SavedConfig:
    """The writer settings recorded with a checkpoint."""

    mode: str | None = None
    compression: str | None = None
    max_block_size: int | None = None


@dataclasses.dataclass(frozen=True)
class Header:
    """Everything in ``ckptio.json`` besides the keys and item records: the schema's one owner."""

    files: dict[str, int]  # data file -> size in bytes
    format_version: int = FORMAT_VERSION
    written_by: str | None = None
    torch_version: str | None = None
    created_unix: float = 0.0
    save_id: str | None = None
    world_size: int | None = None
    mesh: MeshRecord | None = None
    config: SavedConfig = SavedConfig()
    writer_ranks: dict[str, int] = dataclasses.field(default_factory=dict)  # data file -> rank that wrote it
    dcp_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "written_by": self.written_by,
            "torch_version": self.torch_version,
            "created_unix": self.created_unix,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "mesh": self.mesh.to_json() if self.mesh else None,
            "config": dataclasses.asdict(self.config),
            "files": dict(self.files),
            "writer_ranks": dict(self.writer_ranks),
            "dcp_version": self.dcp_version,
        }

    @classmethod
    def from_json(
        cls, doc: dict[str, Any], where: str, checked_files: tuple[dict[str, int], dict[str, int]] | None = None
    ) -> "Header":
        """Validate the header fields of a decoded document; missing optional fields get defaults.
        ``checked_files``: the data files and their writers, already validated (format version 3)."""
        field = _FieldReader(doc, where)
        if checked_files is not None:
            files, writer_ranks = checked_files
        else:
            files, writer_ranks = _data_files(field, where)
        config = _FieldReader(field.mapping("config"), f"{where}: config")
        mesh = field.mapping("mesh", nullable=True)
        created = field.value("created_unix", (int, float), 0.0)
        if isinstance(created, bool) or not math.isfinite(created) or not 0 <= created < 1e11:
            raise CheckpointFormatError(f"{where}: 'created_unix' must be a plausible Unix time, got {created!r}")
        return cls(
            files=files,
            format_version=field.value("format_version", int, None),
            written_by=field.value("written_by", str, None),
            torch_version=field.value("torch_version", str, None),
            created_unix=float(created),
            save_id=field.value("save_id", str, None),
            world_size=field.count("world_size"),
            mesh=_mesh_from_json(mesh, where) if mesh is not None else None,
            config=SavedConfig(
                mode=config.value("mode", str, None),
                compression=config.value("compression", str, None),
                max_block_size=config.count("max_block_size"),
            ),
            writer_ranks=writer_ranks,
            dcp_version=field.value("dcp_version", str, None),
        )


def _data_files(field: "_FieldReader", where: str) -> tuple[dict[str, int], dict[str, int]]:
    """Versions 1 and 2: ``files`` (name -> size) and ``writer_ranks`` (name -> rank), checked."""
    files = field.mapping("files", required=True)
    for name, size in files.items():
        refuse_data_file_name(name, where)
        require_count(size, f"{where}: size of {name}")
    writer_ranks = field.mapping("writer_ranks")
    for name, rank in writer_ranks.items():
        if name not in files:
            raise CheckpointFormatError(f"{where}: 'writer_ranks' names {name!r}, which is not in 'files'")
        require_count(rank, f"{where}: writer_ranks[{name!r}]")
    return files, writer_ranks


def refuse_data_file_name(name: Any, where: str) -> None:
    """Raise unless ``name`` is a plain ckptio data file name."""
    if not is_data_file_name(name):
        raise CheckpointFormatError(
            f"{where} names data file {name!r}, which is not a plain ckptio data file name "
            "inside the checkpoint (paths, '..' and URLs are refused)"
        )


def _mesh_from_json(mesh: dict[str, Any], where: str) -> MeshRecord:
    shape, dims = mesh.get("shape"), mesh.get("dims", [])
    if not isinstance(shape, list) or not isinstance(dims, list) or not all(isinstance(d, str) for d in dims):
        raise CheckpointFormatError(f"{where}: 'mesh' must be {{'shape': [ints], 'dims': [names]}}, got {mesh!r}")
    return MeshRecord(tuple(require_counts(shape, f"{where}: mesh")), tuple(dims))


class _FieldReader:
    """Typed access to one JSON object's fields; a wrong type is a ``CheckpointFormatError`` naming the field."""

    def __init__(self, doc: dict[str, Any], where: str):
        self.doc, self.where = doc, where

    def value(self, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = self.doc.get(name)
        if value is None:
            return default
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise CheckpointFormatError(f"{self.where}: field {name!r} has the wrong type: {value!r}")
        return value

    def count(self, name: str) -> int | None:
        value = self.doc.get(name)
        return None if value is None else require_count(value, f"{self.where}: field {name!r}")

    def mapping(self, name: str, *, required: bool = False, nullable: bool = False) -> Any:
        if name not in self.doc and required:
            raise CheckpointFormatError(f"{self.where}: required field {name!r} is missing")
        value = self.doc.get(name, None if nullable else {})
        if value is None and nullable:
            return None
        if not isinstance(value, dict):
            raise CheckpointFormatError(f"{self.where}: field {name!r} must be a JSON object, got {value!r:.80}")
        return value


# ---------------------------------------------------------------------------------------
# The document


@dataclasses.dataclass
class Manifest:
    """A decoded, validated ckptio metadata document."""

    header: Header
    metadata: Metadata
    items: Mapping[MetadataIndex, StoredItem]  # version 3: records built on first use (stored_items.py)
    per_rank: dict[str, dict[int, StoredItem]] = dataclasses.field(default_factory=dict)  # kept per-rank objects

    @property
    def files(self) -> dict[str, int]:
        return dict(self.header.files)


def planner_data_json(planner_data: Any) -> Any:
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


def legacy_document(manifest: Manifest) -> dict[str, Any]:
    """The metadata in version 2's schema, a JSON object per item: what ``ckptio inspect --json`` shows,
    and a document every ckptio 0.1 can read (version 1 unless an item uses byte planes)."""
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
            key: {str(rank): item.to_json() for rank, item in copies.items()} for key, copies in per_rank.items()
        },
        "state": state,
        "planner_data": planner_data_json(metadata.planner_data),
        "items": [
            {
                "fqn": idx.fqn,
                "chunk_offset": list(idx.offset) if idx.offset is not None else None,
                "index": idx.index,
                **item.to_json(),
            }
            for idx, item in manifest.items.items()
        ],
    }


def decode_version_1(doc: dict[str, Any], where: str) -> Manifest:
    header = Header.from_json(doc, where)
    files = header.files
    state_doc = _FieldReader(doc, where).mapping("state", required=True)
    state: dict[str, Any] = {}
    for fqn, entry in state_doc.items():
        state[fqn] = _decode_state_entry(entry, fqn, where)

    items_doc = doc["items"]
    if not isinstance(items_doc, list):
        raise CheckpointFormatError(f"{where}: 'items' must be a list")
    items: dict[MetadataIndex, StoredItem] = {}
    for raw in items_doc:
        offset = raw["chunk_offset"]
        index = MetadataIndex(
            raw["fqn"], torch.Size(require_counts(offset)) if offset is not None else None, raw["index"]
        )
        if not isinstance(index.fqn, str) or index in items:
            raise CheckpointFormatError(f"{where}: item {index.fqn!r:.80} at {offset} is listed twice or unnamed")
        items[index] = _decode_item(raw, index.fqn, files, where, header.format_version)
    per_rank = {
        fqn: {
            _rank_of(rank, where): _decode_item(raw, fqn, files, where, header.format_version)
            for rank, raw in copies.items()
        }
        for fqn, copies in (_FieldReader(doc, where).mapping("per_rank_objects", nullable=True) or {}).items()
    }
    _check_coverage(state, items, per_rank, where)

    return manifest_of(doc, header, state, items, per_rank, where)


UNCHECKED = object()


def manifest_of(
    doc: dict[str, Any],
    header: Header,
    state: dict[str, Any],
    items: Any,
    per_rank: dict[str, Any],
    where: str,
    checked_planner_data: Any = UNCHECKED,
) -> Manifest:
    """The manifest, with the document's ``planner_data`` checked (unless given already checked)."""
    unchecked = checked_planner_data is UNCHECKED
    planner_data = doc.get("planner_data") if unchecked else checked_planner_data
    if planner_data is not None and unchecked:
        # A huge list index would make a loader build a huge list (``list_index_bound``).
        if not isinstance(planner_data, dict) or not all(
            isinstance(v, (list, tuple)) and all(isinstance(p, str) or is_list_index(p, len(state)) for p in v)
            for v in planner_data.values()
        ):
            raise CheckpointFormatError(
                f"{where}: 'planner_data' must map keys to paths of names and list indices below "
                f"{list_index_bound(len(state))}"
            )
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    metadata = Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=items)
    if header.dcp_version is not None:
        metadata.version = header.dcp_version
    return Manifest(header=header, metadata=metadata, items=items, per_rank=per_rank)


def _decode_state_entry(entry: Any, fqn: str, where: str) -> Any:
    if not isinstance(entry, dict):
        raise CheckpointFormatError(f"{where}: key {fqn!r:.80} has a malformed entry")
    if entry.get("type") == ItemKind.BYTES.value:
        return BytesStorageMetadata()
    if entry.get("type") != ItemKind.TENSOR.value:
        raise CheckpointFormatError(f"{where}: key {fqn!r:.80} has unknown type {entry.get('type')!r:.40}")
    size = torch.Size(require_counts(entry["size"], f"{where}: key {fqn!r:.80}"))
    chunks = []
    for c in entry["chunks"]:
        offsets, sizes = require_counts(c["offsets"]), require_counts(c["sizes"])
        if outside(size, (offsets, sizes)):
            raise CheckpointFormatError(
                f"{where}: key {fqn!r:.80} has a chunk at {offsets} of size {sizes} outside its shape {list(size)}"
            )
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    props = TensorProperties(dtype=dtype_from_name(entry["dtype"]), requires_grad=bool(entry["requires_grad"]))
    check_shape(size, props.dtype.itemsize, f"{where}: key {fqn!r:.80}")
    return TensorStorageMetadata(properties=props, size=size, chunks=chunks)


def _check_coverage(
    state: dict[str, Any], items: dict[MetadataIndex, StoredItem], per_rank: dict[str, Any], where: str
) -> None:
    """Every declared chunk and object has a stored item of the right kind and size, and together
    a tensor's chunks cover its every element exactly once (counted: chunks lie inside the shape)."""
    by_key: dict[str, dict[tuple[int, ...] | None, StoredItem]] = {}
    for index, item in items.items():
        if index.fqn not in state:
            raise CheckpointFormatError(f"{where}: item {index.fqn!r:.80} is stored but not declared in 'state'")
        by_key.setdefault(index.fqn, {})[tuple(index.offset) if index.offset is not None else None] = item
    for fqn, md in state.items():
        stored = by_key.get(fqn, {})
        if isinstance(md, BytesStorageMetadata):
            if fqn in per_rank:
                continue
            if len(stored) != 1 or next(iter(stored.values())).kind != ItemKind.BYTES:
                raise CheckpointFormatError(f"{where}: object {fqn!r:.80} has no stored object record")
            continue
        covered = 0
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
            covered += math.prod(expected)
        boxes = [(c.offsets, c.sizes) for c in md.chunks]
        if covered != math.prod(md.size) or chunks_overlap(boxes, f"{where}: key {fqn!r:.80}"):
            raise CheckpointFormatError(
                f"{where}: the chunks of key {fqn!r:.80} hold {covered} elements for a shape {list(md.size)} of "
                f"{math.prod(md.size)}; the checkpoint does not cover the tensor"
            )


def chunks_overlap(boxes: list[tuple[Any, Any]], where: str) -> bool:
    """Whether two of a key's saved chunks ``(offsets, sizes)`` share an element (``where`` names the key)."""
    try:
        return overlapping_pair(boxes) is not None
    except TooIrregular:
        raise CheckpointFormatError(
            f"{where}: its {len(boxes)} chunks are too far from a grid to check for overlaps; "
            "DCP never writes such a layout, so the metadata is damaged or crafted"
        ) from None


def check_block_lengths(lengths: list[int], logical: int, block: int, raw: bool, where: str) -> int:
    """The stored bytes of an item's blocks, each checked against its logical length: equal when
    ``raw``; compressed, no longer and no more than ``ZSTD_MAX_RATIO`` times shorter."""
    if not lengths:
        return 0
    last = logical - (len(lengths) - 1) * block
    full = lengths[:-1]
    fits = min(lengths) > 0 and max(full, default=block) <= block and lengths[-1] <= last
    if raw:
        fits = fits and full.count(block) == len(full) and lengths[-1] == last
    else:
        fits = fits and min(full, default=block) * ZSTD_MAX_RATIO >= block and lengths[-1] * ZSTD_MAX_RATIO >= last
    if not fits:
        expected = [block] * len(full) + [last]
        i = next(
            i
            for i, (n, m) in enumerate(zip(lengths, expected, strict=True))
            if n <= 0 or n > m or (n != m if raw else n * ZSTD_MAX_RATIO < m)
        )
        raise CheckpointFormatError(f"{where} block {i} has stored length {lengths[i]} for {expected[i]} logical bytes")
    return sum(lengths)


def _rank_of(text: Any, where: str) -> int:
    if not isinstance(text, str) or not text.isdigit() or len(text) > 9:
        raise CheckpointFormatError(f"{where}: per-rank object copies are keyed by rank numbers, got {text!r:.40}")
    return int(text)


def _decode_item(raw: dict[str, Any], fqn: str, files: dict[str, int], where: str, version: int) -> StoredItem:
    key = f"{where}: item {fqn!r:.80}"
    try:
        kind, codec = ItemKind(raw["kind"]), Codec(raw["codec"])
    except (ValueError, TypeError):
        raise CheckpointFormatError(
            f"{key} has unknown kind {raw['kind']!r:.40} or codec {raw['codec']!r:.40}"
        ) from None
    if not isinstance(raw["file"], str):
        raise CheckpointFormatError(f"{key}: 'file' must be a string")
    item = StoredItem(
        file=raw["file"],
        offset=require_count(raw["offset"], "offset"),
        logical_bytes=require_count(raw["logical_bytes"], "logical_bytes"),
        kind=kind,
        dtype=raw["dtype"] if kind == ItemKind.TENSOR else None,
        shape=tuple(require_counts(raw["shape"])) if kind == ItemKind.TENSOR else None,
        codec=codec,
        block_size=require_count(raw["block_size"], "block_size"),
        blocks=_decode_blocks(raw, where),
        inline=decode_inline(raw.get("inline"), where),
    )
    _check_item(item, key, files, version)
    return item


def _check_item(item: StoredItem, key: str, files: dict[str, int], version: int) -> None:
    if item.codec.format_version > version:
        raise CheckpointFormatError(f"{key} uses codec {item.codec.value!r}, which format version {version} lacks")
    if item.codec == Codec.ZSTD_BYTEPLANES and (item.kind != ItemKind.TENSOR or item.itemsize not in (2, 4, 8)):
        raise CheckpointFormatError(f"{key} uses byte planes but is not a tensor of 2-, 4- or 8-byte elements")
    if item.file == "":
        if item.inline is None or item.offset != 0 or len(item.inline) != item.stored_bytes:
            raise CheckpointFormatError(f"{key} is stored inline but its inline bytes do not match its blocks")
    elif item.inline is not None or item.file not in files:
        raise CheckpointFormatError(f"{key} points at {item.file!r:.80}, which is not a data file of this checkpoint")
    if not is_block_size(item.block_size):
        raise CheckpointFormatError(f"{key} has invalid block_size {item.block_size}")
    expected_blocks = -(-item.logical_bytes // item.block_size)
    if len(item.blocks) != expected_blocks:
        raise CheckpointFormatError(f"{key} lists {len(item.blocks)} blocks, expected {expected_blocks}")
    if item.file and item.offset + item.stored_bytes > files[item.file]:
        raise CheckpointFormatError(
            f"{key} spans bytes {item.offset}..{item.offset + item.stored_bytes} of {item.file}, "
            f"which the metadata says holds {files[item.file]} bytes"
        )
    check_block_lengths([n for n, _ in item.blocks], item.logical_bytes, item.block_size, item.codec == Codec.RAW, key)
    if item.kind == ItemKind.TENSOR:
        dtype = dtype_from_name(item.dtype)
        if math.prod(item.shape) * dtype.itemsize != item.logical_bytes:
            raise CheckpointFormatError(f"{key} has shape {item.shape} of {item.dtype} but {item.logical_bytes} bytes")


def pack_counts(values: list[int]) -> str:
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


def _decode_blocks(raw: dict[str, Any], where: str) -> tuple[tuple[int, int], ...]:
    crcs = unpack_counts(raw["crc32c"], where)
    size, block = require_count(raw["logical_bytes"], "logical_bytes"), require_count(raw["block_size"], "block_size")
    if "stored_lengths" in raw:
        lengths = unpack_counts(raw["stored_lengths"], where)
    elif block and len(crcs) == -(-size // block):
        lengths = block_logical_lengths(size, block)
    else:  # the block count is wrong: _check_item says so
        lengths = [min(block, size - i * block) for i in range(len(crcs))] if block else []
    if len(lengths) != len(crcs):
        raise CheckpointFormatError(
            f"{where}: item {raw.get('fqn')!r:.80} has {len(crcs)} checksums but {len(lengths)} lengths"
        )
    return tuple(zip(lengths, crcs, strict=True))


def block_logical_lengths(logical_bytes: int, block_size: int) -> list[int]:
    """The logical length of each block of an item: full blocks, then the remainder."""
    full, rest = divmod(logical_bytes, block_size)
    return [block_size] * full + ([rest] if rest else [])


def decode_inline(value: Any, where: str) -> bytes | None:
    """An inline item's stored bytes from base64 (``None`` stays ``None``)."""
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise CheckpointFormatError(f"{where}: an inline item is not valid base64") from None


def require_count(value: Any, what: str, where: str = "ckptio metadata") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < INT64_LIMIT:
        raise CheckpointFormatError(f"{where}: {what} must be a non-negative integer below 2^63, got {value!r:.40}")
    return value


def require_counts(values: Any, where: str = "ckptio metadata") -> list[int]:
    if not isinstance(values, list):
        raise CheckpointFormatError(f"{where}: a shape or offset must be a list, got {values!r:.40}")
    return [require_count(v, "a shape or offset entry", where) for v in values]
