"""Format version 3: every key's stored items as a few packed columns, checked as strictly as version
1's per-item records, and an item's record built only when a load asks for it.

Version 1 wrote a JSON object per stored item (repeating its key, its chunk's offsets and shape and its
dtype) beside a second list of the same chunks under ``state``, and the data files twice (sizes, writers).
Version 3 writes, besides the header fields every version has::

    "files": {"save_ids": ["9f0c...", ...], "ranks": COL, "sizes": COL},  # data-<save_id>-r<rank>.ckio
    "block_size": 262144,                      # the default of every block_size column
    "planner_data": "paths",                   # torch's {flat key: path}, as per-key "path" codes
    "keys": {                                  # tensors, and objects saved with one copy per rank
      "model.w": {"type": "tensor", "dtype": "float32", "size": [8192, 8192], "requires_grad": false,
                  "count": 1024,                              # stored chunks, in DCP's chunk order
                  "offsets": [COL, COL], "sizes": [COL, COL],  # one column per dimension
                  "file": COL, "at": COL, "crc32c": BLOCKS, "path": [1, 1]},
      "loader": {"type": "bytes", "count": 4, "ranks": COL, "length": COL, "file": COL, ...}},
    "objects": {"keys": ["step", ...], "paths": [...], "length": COL, "file": COL, "at": COL, ...}

- COL: a JSON integer (every entry equals it) or a string: a width letter (``B`` ``H`` ``I`` ``Q``: 1, 2,
  4, 8 bytes) then the base64 of one little-endian unsigned integer of that width per entry.
- ``file``: 1 + the item's data file's position in ``files``; 0 for an item kept inline (its stored
  bytes, base64, are the next entry of the record's ``inline`` list). ``at``: its byte offset there.
- ``codec`` (default 0) indexes ``CODECS``; ``block_size`` defaults to the document's ``block_size``.
- BLOCKS: a packed string (never an integer, so a block count is bounded by the document's size) with an
  entry per block of every item in turn: ``crc32c`` always, ``stored_lengths`` when an item is compressed.
- ``objects``: every object stored once, one entry per key in each column.
- ``path``: how many dot-separated parts of the key form each element of torch's path (0: a list index);
  absent (``null`` in ``paths``): one element per part. ``planner_data`` is stored as it is when it is
  not a path for exactly each key. ``files`` has ``writers`` only when a rank wrote a file that another
  rank's name is on.

A tensor's chunk is stored in ``prod(sizes) * itemsize`` bytes, an object in ``length``: neither is written.
"""

from __future__ import annotations

import array
import base64
import binascii
import contextlib
import functools
import itertools
import math
import re
import sys
from collections.abc import Iterator, Mapping
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

from .chunks import TooIrregular, outside, overlapping_pair
from .config import MAX_BLOCK_SIZE_LIMIT
from .errors import CheckpointError, CheckpointFormatError

#: ``codec`` column values (a format constant: append only).
CODECS = ("raw", "zstd", "zstd-byteplanes")
_PLANE_CODEC = CODECS.index("zstd-byteplanes")
#: Width letter -> bytes per entry, and the ``array`` type code of that width on this platform.
_WIDTHS = {"B": 1, "H": 2, "I": 4, "Q": 8}
_TYPECODES = {
    letter: next(code for code in "BHILQ" if array.array(code).itemsize == width) for letter, width in _WIDTHS.items()
}
#: A rank number in ``ranks`` (as version 1's nine-digit limit).
_MAX_RANK = 10**9
#: Every object's entry in DCP's metadata (it has no fields: one instance serves all).
_OBJECT = BytesStorageMetadata()
#: The save id in a data file name (``layout.data_file_name``).
_SAVE_ID = re.compile("[0-9a-f]{8,32}")


# ---------------------------------------------------------------------------------------
# Columns


def encode_column(values: list[int]) -> int | str:
    """A COL: the value itself when every entry has it, else the narrowest packed string."""
    if values and values.count(values[0]) == len(values):
        return values[0]
    return encode_packed(values)


def encode_packed(values: list[int]) -> str:
    top = max(values, default=0)
    letter = next((letter for letter, width in _WIDTHS.items() if top < 1 << (8 * width)), "Q")
    packed = array.array(_TYPECODES[letter], values)
    if sys.byteorder != "little":
        packed.byteswap()
    return letter + base64.b64encode(packed.tobytes()).decode()


def _decode_column(value: Any, count: int, what: str, packed_only: bool = False) -> list[int]:
    """``count`` non-negative integers from a COL (a BLOCKS string when ``packed_only``)."""
    if isinstance(value, int) and not isinstance(value, bool) and not packed_only:
        if value < 0:
            raise CheckpointFormatError(f"{what} must hold non-negative integers, got {value}")
        return [value] * count
    letter = value[:1] if isinstance(value, str) else None
    if letter not in _WIDTHS:
        kind = "a packed string" if packed_only else "an integer or a packed string"
        raise CheckpointFormatError(f"{what} must be {kind} (a width letter B, H, I or Q, then base64): {value!r:.40}")
    try:
        raw = base64.b64decode(value[1:], validate=True)
    except (binascii.Error, ValueError):
        raise CheckpointFormatError(f"{what} is not valid base64") from None
    width = _WIDTHS[letter]
    if len(raw) != count * width:
        raise CheckpointFormatError(
            f"{what} holds {len(raw) / width:g} entries of {width} bytes where {count} are expected"
        )
    packed = array.array(_TYPECODES[letter], raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------
# Encoding (the writer's side: records it made itself)


def encode_document(
    metadata: Metadata,
    items: Mapping[MetadataIndex, Any],
    per_rank: dict[str, dict[int, Any]],
    files: dict[str, int],
    writer_ranks: dict[str, int],
    block_size: int,
) -> dict[str, Any]:
    """The version 3 fields (``files``, ``block_size``, ``planner_data``, ``keys``, ``objects``) from DCP's
    metadata, the stored item records and the data files."""
    names = sorted(files)
    file_numbers = {"": 0, **{name: n for n, name in enumerate(names, 1)}}
    paths = _paths_by_key(metadata)
    keys: dict[str, Any] = {}
    objects: list[tuple[str, Any]] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            copies = per_rank.get(fqn)
            if not copies:
                objects.append((fqn, _stored(items, MetadataIndex(fqn), fqn)))
                continue
            ranks = sorted(copies)
            stored = [copies[rank] for rank in ranks]
            record: dict[str, Any] = {"type": "bytes", "count": len(ranks), "ranks": encode_column(ranks)}
            record["length"] = encode_column([item.logical_bytes for item in stored])
        else:
            chunks = md.chunks
            stored = [_stored(items, MetadataIndex(fqn, chunk.offsets), fqn) for chunk in chunks]
            ndim = len(md.size)
            offsets, sizes = zip(*((c.offsets, c.sizes) for c in chunks), strict=True) if chunks else ((), ())
            record = {
                "type": "tensor",
                "dtype": str(md.properties.dtype).removeprefix("torch."),
                "size": list(md.size),
                "requires_grad": bool(md.properties.requires_grad),
                "count": len(chunks),
                "offsets": _dimension_columns(offsets, ndim),
                "sizes": _dimension_columns(sizes, ndim),
            }
        record.update(_storage_columns(stored, file_numbers, block_size))
        if paths and paths[fqn] is not None:
            record["path"] = paths[fqn]
        keys[fqn] = record
    doc: dict[str, Any] = {
        "files": _encode_files(names, files, writer_ranks),
        "block_size": block_size,
        "planner_data": "paths" if paths is not None else planner_data_json(metadata.planner_data),
        "keys": keys,
    }
    if objects:
        table: dict[str, Any] = {"keys": [fqn for fqn, _ in objects]}
        if paths and any(paths[fqn] is not None for fqn, _ in objects):
            table["paths"] = [paths[fqn] for fqn, _ in objects]
        table["length"] = encode_column([item.logical_bytes for _, item in objects])
        table.update(_storage_columns([item for _, item in objects], file_numbers, block_size))
        doc["objects"] = table
    return doc


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


def _encode_files(names: list[str], files: dict[str, int], writer_ranks: dict[str, int]) -> dict[str, Any]:
    from .layout import parse_data_file_name

    parsed = [parse_data_file_name(name) for name in names]
    columns: dict[str, Any] = {
        "save_ids": [p.save_id for p in parsed],
        "ranks": encode_column([p.rank for p in parsed]),
        "sizes": encode_column([files[name] for name in names]),
    }
    if any(writer_ranks.get(name, p.rank) != p.rank for name, p in zip(names, parsed, strict=True)):
        columns["writers"] = encode_column(
            [writer_ranks.get(name, p.rank) for name, p in zip(names, parsed, strict=True)]
        )
    return columns


def _paths_by_key(metadata: Metadata) -> dict[str, list[int] | None] | None:
    """torch's planner data ``{flat key: path}`` as a per-key code (``None``: the key split at every dot);
    ``None`` when it is not such a map of exactly the saved keys (it is then stored as it is)."""
    planner_data = metadata.planner_data
    if not isinstance(planner_data, dict) or planner_data.keys() != metadata.state_dict_metadata.keys():
        return None
    paths = {}
    for fqn, path in planner_data.items():
        code = encode_path(path)
        if code is False or ".".join(map(str, path)) != fqn:
            return None
        paths[fqn] = code
    return paths


def encode_path(path: Any) -> list[int] | None | bool:
    """A flat key's path as a count of its dot-separated parts per path element (0: a list index);
    ``None`` when every part is its own string element; ``False`` when it is not such a path."""
    if not isinstance(path, (tuple, list)):
        return False
    code = []
    for part in path:
        if isinstance(part, bool) or not isinstance(part, (str, int)) or isinstance(part, int) and part < 0:
            return False
        code.append(0 if isinstance(part, int) else part.count(".") + 1)
    return None if all(n == 1 for n in code) else code


def _dimension_columns(boxes: tuple[tuple[int, ...], ...], ndim: int) -> list[int | str]:
    """One COL per dimension from each chunk's offsets (or sizes)."""
    return [encode_column([box[d] for box in boxes]) for d in range(ndim)]


def _stored(items: Mapping[MetadataIndex, Any], index: MetadataIndex, fqn: str) -> Any:
    try:
        return items[index]
    except KeyError:
        raise CheckpointError(
            f"no rank reported writing key {fqn!r} (chunk at {list(index.offset or ())}); the save cannot commit"
        ) from None


def _storage_columns(stored: list[Any], file_numbers: dict[str, int], block_size: int) -> dict[str, Any]:
    codecs = [CODECS.index(item.codec._value_) for item in stored]
    columns: dict[str, Any] = {
        "file": encode_column([file_numbers[item.file] for item in stored]),
        "at": encode_column([item.offset for item in stored]),
    }
    if any(codecs):
        columns["codec"] = encode_column(codecs)
    sizes = [item.block_size for item in stored]
    if sizes.count(block_size) != len(sizes):
        columns["block_size"] = encode_column(sizes)
    columns["crc32c"] = encode_packed([crc for item in stored for _, crc in item.blocks])
    if any(codecs):
        columns["stored_lengths"] = encode_packed([n for item in stored for n, _ in item.blocks])
    inline = [_b64(item.inline) for item in stored if item.file == ""]
    if inline:
        columns["inline"] = inline
    return columns


# ---------------------------------------------------------------------------------------
# Decoding (untrusted input)


@functools.cache
def _layout() -> Any:
    """layout.py, which imports this module: its records are built here, on first use."""
    from . import layout

    return layout


class StoredKey:
    """The stored items of one key, as decoded and checked columns; ``item(i)`` builds one record."""

    __slots__ = (
        "fqn", "tensor", "dtype", "offsets", "sizes", "logical", "file", "at", "codec", "block_size",
        "starts", "crcs", "lengths", "inline", "ranks", "_files", "_built", "_by_offset",
    )  # fmt: skip

    def __init__(self, fqn: str, tensor: bool, files: tuple[str, ...]):
        self.fqn, self.tensor, self._files = fqn, tensor, files
        self.dtype: str | None = None
        self.offsets: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        self.logical: list[int] = []
        self.ranks: list[int] | None = None
        self.inline: dict[int, bytes] = {}
        self.lengths: list[int] | None = None
        self._built: dict[int, Any] = {}
        self._by_offset: dict[tuple[int, ...], int] | None = None

    @property
    def count(self) -> int:
        return len(self.logical)

    def item(self, i: int) -> Any:
        built = self._built.get(i)
        if built is None:
            built = self._built[i] = self._build(i)
        return built

    def _build(self, i: int) -> Any:
        layout = _layout()
        start, end = self.starts[i], self.starts[i + 1]
        logical, block_size = self.logical[i], self.block_size[i]
        lengths = self.lengths[start:end] if self.lengths else layout._block_logical_lengths(logical, block_size)
        file = self.file[i]
        return layout.StoredItem(
            file=self._files[file - 1] if file else "",
            offset=self.at[i],
            logical_bytes=logical,
            kind=layout.ItemKind.TENSOR if self.tensor else layout.ItemKind.BYTES,
            dtype=self.dtype,
            shape=self.sizes[i] if self.tensor else None,
            codec=layout.Codec(CODECS[self.codec[i]]),
            block_size=block_size,
            blocks=tuple(zip(lengths, self.crcs[start:end], strict=True)),
            inline=self.inline.get(i),
        )

    def position(self, offset: Any, hint: int | None) -> int | None:
        """The item stored for DCP's index ``(offset, hint)``: the hint is the chunk's position."""
        if not self.tensor:
            return 0 if offset is None and self.ranks is None else None
        if offset is None:
            return None
        offset = tuple(offset)
        if hint is not None and 0 <= hint < len(self.offsets) and self.offsets[hint] == offset:
            return hint
        if self._by_offset is None:
            self._by_offset = {o: i for i, o in enumerate(self.offsets)}
        return self._by_offset.get(offset)


class StoredItems(Mapping):
    """``MetadataIndex -> StoredItem`` over the decoded keys and objects table, building each record on
    first use: a rank resolves the items its load plan reads, not every item of the checkpoint."""

    def __init__(self, keys: dict[str, StoredKey], objects: StoredKey | None, object_names: list[str]):
        self._keys, self._objects = keys, objects
        self._object_at = {name: i for i, name in enumerate(object_names)}

    def _locate(self, index: Any) -> tuple[StoredKey, int] | None:
        fqn = getattr(index, "fqn", None)
        key = self._keys.get(fqn)
        if key is None:
            at = self._object_at.get(fqn) if index.offset is None else None
            return None if at is None else (self._objects, at)
        at = key.position(index.offset, index.index)
        return None if at is None else (key, at)

    def __getitem__(self, index: Any) -> Any:
        located = self._locate(index)
        if located is None:
            raise KeyError(index)
        return located[0].item(located[1])

    def __contains__(self, index: object) -> bool:
        return self._locate(index) is not None

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, key in self._keys.items():
            if not key.tensor:
                if key.ranks is None:
                    yield MetadataIndex(fqn)
                continue
            for i, offset in enumerate(key.offsets):
                yield MetadataIndex(fqn, torch.Size(offset), i)
        for name in self._object_at:
            yield MetadataIndex(name)

    def __len__(self) -> int:
        return sum(key.count if key.tensor else key.ranks is None for key in self._keys.values()) + len(self._object_at)


class _Context:
    """What every key's checks need: the data files, the default block size, the document's length."""

    def __init__(self, names: tuple[str, ...], files: dict[str, int], block_size: Any, doc_bytes: int, where: str):
        self.names = names
        self.sizes = [files[name] for name in names]
        self.block_size, self.doc_bytes, self.where = block_size, doc_bytes, where


def decode_files(value: Any, where: str) -> tuple[tuple[str, ...], dict[str, int], dict[str, int]]:
    """Version 3's ``files`` columns: the data file names in order, their sizes and writing ranks (the
    names and sizes are then checked as every version's are, by ``Header``)."""
    from .layout import data_file_name, refuse_data_file_name

    if not isinstance(value, dict) or not isinstance(value.get("save_ids"), list):
        raise CheckpointFormatError(f"{where}: 'files' must hold 'save_ids', 'ranks' and 'sizes' columns")
    save_ids = value["save_ids"]
    count = len(save_ids)
    ranks = _decode_column(value.get("ranks"), count, f"{where}: files: ranks")
    sizes = _decode_column(value.get("sizes"), count, f"{where}: files: sizes")
    writers = _decode_column(value["writers"], count, f"{where}: files: writers") if "writers" in value else ranks
    names = tuple(data_file_name(s, r) for s, r in zip(save_ids, ranks, strict=True))
    for save_id, name in zip(save_ids, names, strict=True):
        if not (isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id)):
            refuse_data_file_name(name, where)  # names the file and raises
    if len(set(names)) != count:
        raise CheckpointFormatError(f"{where}: 'files' names a data file twice")
    return names, dict(zip(names, sizes, strict=True)), dict(zip(names, writers, strict=True))


def decode_keys(
    doc: dict[str, Any], names: tuple[str, ...], files: dict[str, int], doc_bytes: int, where: str
) -> tuple[dict[str, Any], StoredItems, dict[str, dict[int, Any]], Any]:
    """DCP's ``state_dict_metadata``, the item records, the per-rank copies and the planner data of a
    version 3 document's ``keys`` and ``objects``."""
    context = _Context(names, files, doc.get("block_size"), doc_bytes, where)
    state: dict[str, Any] = {}
    keys: dict[str, StoredKey] = {}
    per_rank: dict[str, dict[int, Any]] = {}
    paths: dict[str, Any] = {}
    keys_doc = doc.get("keys")
    if not isinstance(keys_doc, dict):
        raise CheckpointFormatError(f"{where}: required field 'keys' must be a JSON object")
    for fqn, record in keys_doc.items():
        with _schema(where, f"key {fqn!r:.80}"):
            md, key = _decode_key(fqn, record, context)
            paths[fqn] = record.get("path")
        state[fqn], keys[fqn] = md, key
        if key.ranks is not None:
            per_rank[fqn] = {rank: key.item(i) for i, rank in enumerate(key.ranks)}
    objects, object_names = None, []
    if doc.get("objects") is not None:
        with _schema(where, "the objects table"):
            objects, object_names = _decode_objects(doc["objects"], context)
        twice = state.keys() & set(object_names)
        if twice:
            raise CheckpointFormatError(f"{where}: key {min(twice)!r:.80} is listed twice")
        state.update(dict.fromkeys(object_names, _OBJECT))
        paths.update(zip(object_names, doc["objects"].get("paths") or [None] * len(object_names), strict=True))
    planner_data = doc.get("planner_data")
    if planner_data == "paths":
        planner_data = {fqn: decode_path(fqn, code, len(state), where) for fqn, code in paths.items()}
    return state, StoredItems(keys, objects, object_names), per_rank, planner_data


@contextlib.contextmanager
def _schema(where: str, what: str) -> Iterator[None]:
    """A record of the wrong shape (a missing field, a string for a list) is a named format error."""
    try:
        yield
    except CheckpointFormatError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError, IndexError) as exc:
        raise CheckpointFormatError(
            f"{where}: {what} does not follow the ckptio metadata schema: {exc!r:.200}"
        ) from None


def _decode_objects(table: Any, context: _Context) -> tuple[StoredKey, list[str]]:
    """The objects table: one stored item per object key, as columns (``keys`` names them)."""
    where = f"{context.where}: objects table"
    names = table["keys"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise CheckpointFormatError(f"{where}: 'keys' must be a list of distinct key names")
    if "paths" in table and (not isinstance(table["paths"], list) or len(table["paths"]) != len(names)):
        raise CheckpointFormatError(f"{where}: 'paths' must have one entry per key")
    objects = StoredKey("", False, context.names)
    objects.logical = _decode_column(table["length"], len(names), f"{where}: length")
    _storage_columns_of(objects, table, context, where)
    return objects, names


def decode_path(fqn: str, code: Any, keys: int, where: str) -> tuple[str | int, ...]:
    """A flat key's path from its code (see ``encode_path``); list indices below ``keys``, as version 1 checks."""
    if code is None:
        return tuple(fqn.split("."))
    parts = fqn.split(".")
    if not isinstance(code, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in code):
        raise CheckpointFormatError(f"{where}: the path of key {fqn!r:.80} must be a list of part counts")
    path: list[str | int] = []
    at = 0
    for n in code:
        if n == 0:
            part = parts[at] if at < len(parts) else ""
            if not part.isdecimal() or not part.isascii() or str(int(part)) != part or int(part) >= keys:
                raise CheckpointFormatError(
                    f"{where}: the path of key {fqn!r:.80} has a list index {part!r:.20} that is not below {keys}"
                )
            path.append(int(part))
            at += 1
        else:
            path.append(".".join(parts[at : at + n]))
            at += n
    if at != len(parts):
        raise CheckpointFormatError(f"{where}: the path of key {fqn!r:.80} does not cover the key's parts")
    return tuple(path)


def _decode_key(fqn: str, record: Any, context: _Context) -> tuple[Any, StoredKey]:
    """One ``keys`` record: a tensor's chunks, or an object saved with one copy per rank."""
    where = f"{context.where}: key {fqn!r:.80}"
    if not isinstance(record, dict):
        raise CheckpointFormatError(f"{where} has a malformed record")
    kind = record.get("type")
    if kind not in ("tensor", "bytes"):
        raise CheckpointFormatError(f"{where} has unknown type {kind!r:.40}")
    count = record["count"]
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= context.doc_bytes:
        raise CheckpointFormatError(f"{where} has {count!r:.40} items, more than its metadata could describe")
    key = StoredKey(fqn, kind == "tensor", context.names)
    if key.tensor:
        md = _tensor_columns(key, record, count, where)
    else:
        md = BytesStorageMetadata()
        _object_columns(key, record, count, where)
    _storage_columns_of(key, record, context, where)
    return md, key


def _tensor_columns(key: StoredKey, record: dict[str, Any], count: int, where: str) -> TensorStorageMetadata:
    from .layout import _ints, dtype_from_name

    size = tuple(_ints(record["size"]))
    offsets, sizes = record["offsets"], record["sizes"]
    if not isinstance(offsets, list) or not isinstance(sizes, list) or not len(offsets) == len(sizes) == len(size):
        raise CheckpointFormatError(f"{where} must have one offsets and one sizes column per dimension ({len(size)})")
    if count > 1 and all(isinstance(column, int) for column in offsets):
        raise CheckpointFormatError(f"{where}: its {count} chunks all start at the same offsets (listed twice)")
    key.offsets = _boxes(offsets, count, f"{where}: offsets")
    key.sizes = _boxes(sizes, count, f"{where}: sizes")
    if len(set(key.offsets)) != count:
        raise CheckpointFormatError(f"{where}: a chunk is listed twice (two chunks start at the same offsets)")
    dtype = dtype_from_name(record["dtype"])
    key.dtype = str(dtype).removeprefix("torch.")
    volumes = [math.prod(sz) for sz in key.sizes]
    key.logical = [n * dtype.itemsize for n in volumes]
    # column by column (entries are non-negative): a chunk ends inside its shape in every dimension
    ends = [max(map(int.__add__, o, n), default=0) for o, n in zip(*_columns(key, len(size)), strict=True)]
    if any(map(int.__gt__, ends, size)):
        off, sz = next((o, n) for o, n in zip(key.offsets, key.sizes, strict=True) if outside(size, (o, n)))
        raise CheckpointFormatError(
            f"{where} has a chunk at {list(off)} of size {list(sz)} outside its shape {list(size)}"
        )
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in zip(key.offsets, key.sizes, strict=True)]
    if sum(volumes) != math.prod(size) or _overlap(key, where):
        raise CheckpointFormatError(
            f"{where}: its chunks hold {sum(volumes)} elements for a shape {list(size)} of {math.prod(size)}; "
            "the checkpoint does not cover the tensor"
        )
    requires_grad = record["requires_grad"]
    if not isinstance(requires_grad, bool):
        raise CheckpointFormatError(f"{where}: 'requires_grad' must be true or false")
    props = TensorProperties(dtype=dtype, requires_grad=requires_grad)
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _columns(key: StoredKey, ndim: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The offsets and the sizes of every chunk, per dimension."""
    if not key.offsets:
        return [()] * ndim, [()] * ndim
    return list(zip(*key.offsets, strict=True)), list(zip(*key.sizes, strict=True))


def _boxes(columns: list[Any], count: int, what: str) -> list[tuple[int, ...]]:
    if not columns:
        return [()] * count
    decoded = [_decode_column(c, count, f"{what} column {d}") for d, c in enumerate(columns)]
    return list(zip(*decoded, strict=True))


def _overlap(key: StoredKey, where: str) -> bool:
    try:
        return overlapping_pair(list(zip(key.offsets, key.sizes, strict=True))) is not None
    except TooIrregular:
        raise CheckpointFormatError(
            f"{where}: its {key.count} chunks are too far from a grid to check for overlaps; "
            "DCP never writes such a layout, so the metadata is damaged or crafted"
        ) from None


def _object_columns(key: StoredKey, record: dict[str, Any], count: int, where: str) -> None:
    if "ranks" in record:
        if count > 1 and not isinstance(record["ranks"], str):
            raise CheckpointFormatError(f"{where}: its {count} per-rank copies all name the same rank")
        key.ranks = _decode_column(record["ranks"], count, f"{where}: ranks")
        if len(set(key.ranks)) != count or max(key.ranks, default=0) >= _MAX_RANK:
            raise CheckpointFormatError(f"{where}: per-rank copies must name distinct ranks below {_MAX_RANK}")
    else:
        raise CheckpointFormatError(f"{where}: an object in 'keys' has one copy per rank ('ranks')")
    key.logical = _decode_column(record["length"], count, f"{where}: length")


def _storage_columns_of(key: StoredKey, record: dict[str, Any], context: _Context, where: str) -> None:
    """Files, offsets, codecs, block sizes and blocks, each item checked as version 1 checks a record."""
    count = key.count
    key.file = _decode_column(record["file"], count, f"{where}: file")
    key.at = _decode_column(record["at"], count, f"{where}: at")
    key.codec = _decode_column(record.get("codec", 0), count, f"{where}: codec")
    default_block = record.get("block_size", context.block_size)
    if default_block is None:
        raise CheckpointFormatError(f"{where} has no 'block_size' and the document gives no default")
    key.block_size = _decode_column(default_block, count, f"{where}: block_size")
    files = len(context.names)
    blocks = key.block_size
    if count and (
        max(key.codec) >= len(CODECS)
        or _PLANE_CODEC in key.codec
        and (getattr(torch, key.dtype).itemsize if key.tensor else 0) not in (2, 4, 8)
        or min(blocks) <= 0
        or max(blocks) > MAX_BLOCK_SIZE_LIMIT
        or any(b % 64 for b in (set(blocks) if len(blocks) > 64 else blocks))
        or max(key.file) > files
        or 0 in key.file
        and any(at for file, at in zip(key.file, key.at, strict=True) if file == 0)
    ):
        _name_bad_item(key, files, where)
    key.starts = list(itertools.accumulate((-(-n // b) for n, b in zip(key.logical, blocks, strict=True)), initial=0))
    total = key.starts[-1]
    key.crcs = _decode_column(record["crc32c"], total, f"{where}: crc32c (one per block)", packed_only=True)
    compressed = any(key.codec)
    if compressed != ("stored_lengths" in record):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    if compressed:
        key.lengths = _decode_column(record["stored_lengths"], total, f"{where}: stored_lengths", packed_only=True)
    _check_stored_bytes(key, record.get("inline", []), context, where)


def _name_bad_item(key: StoredKey, files: int, where: str) -> None:
    """Raise the error of the first item whose codec, block size or file is wrong."""
    itemsize = getattr(torch, key.dtype).itemsize if key.tensor else 0
    for i, (file, at, codec, block) in enumerate(zip(key.file, key.at, key.codec, key.block_size, strict=True)):
        if codec >= len(CODECS):
            raise CheckpointFormatError(f"{where}: item {i} has unknown codec number {codec}")
        if codec == _PLANE_CODEC and itemsize not in (2, 4, 8):
            raise CheckpointFormatError(f"{where} uses byte planes but is not a tensor of 2-, 4- or 8-byte elements")
        if not 0 < block <= MAX_BLOCK_SIZE_LIMIT or block % 64:
            raise CheckpointFormatError(f"{where}: item {i} has invalid block_size {block}")
        if file > files or (file == 0 and at != 0):
            raise CheckpointFormatError(
                f"{where}: item {i} points at data file number {file} (offset {at}); the checkpoint has {files} "
                "(0 = inline, at offset 0)"
            )


def _check_stored_bytes(key: StoredKey, inline: Any, context: _Context, where: str) -> None:
    """Every block's stored length fits its logical length; every item lies inside its file or inline bytes."""
    if not isinstance(inline, list) or len(inline) != key.file.count(0):
        raise CheckpointFormatError(f"{where}: 'inline' must hold one base64 string per inline item")
    if key.lengths is None and not inline:  # raw items in files: the common case, checked in bulk
        sizes = context.sizes
        if not any(at + n > sizes[f - 1] for f, at, n in zip(key.file, key.at, key.logical, strict=True)):
            return
    inline_values = iter(inline)
    lengths = key.lengths
    for i, (file, at, block, logical) in enumerate(zip(key.file, key.at, key.block_size, key.logical, strict=True)):
        start, end = key.starts[i], key.starts[i + 1]
        if lengths is None:
            stored = logical
        else:
            stored = _checked_block_lengths(lengths[start:end], logical, block, key.codec[i] == 0, f"{where}: item {i}")
        if file == 0:
            data = _inline_bytes(next(inline_values), where)
            if len(data) != stored:
                raise CheckpointFormatError(f"{where}: item {i} is stored inline but its bytes do not match its blocks")
            key.inline[i] = data
        elif at + stored > context.sizes[file - 1]:
            name = context.names[file - 1]
            raise CheckpointFormatError(
                f"{where}: item {i} spans bytes {at}..{at + stored} of {name}, which the metadata says holds "
                f"{context.sizes[file - 1]} bytes"
            )


def _checked_block_lengths(lengths: list[int], logical: int, block: int, raw: bool, where: str) -> int:
    if not lengths:
        return 0
    last = logical - (len(lengths) - 1) * block
    full = lengths[:-1]
    fits = min(lengths) > 0 and max(full, default=block) <= block and lengths[-1] <= last
    if raw:
        fits = fits and full.count(block) == len(full) and lengths[-1] == last
    if not fits:
        expected = [block] * len(full) + [last]
        i = next(i for i, (n, m) in enumerate(zip(lengths, expected, strict=True)) if n <= 0 or n > m or raw and n != m)
        raise CheckpointFormatError(f"{where} block {i} has stored length {lengths[i]} for {expected[i]} logical bytes")
    return sum(lengths)


def _inline_bytes(value: Any, where: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise CheckpointFormatError(f"{where}: an inline item is not valid base64") from None
