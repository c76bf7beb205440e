"""Format version 3: every key's stored items as a few packed columns, checked as strictly as version
1's per-item records, and an item's record built only when a load asks for it.

Version 1 wrote a JSON object per stored item (repeating its key, its chunk's offsets and shape and its
dtype) beside a second list of the same chunks under ``state``. Version 3 writes one record per key::

    "keys": {
      "model.w": {"type": "tensor", "dtype": "float32", "size": [8192, 8192], "requires_grad": false,
                  "count": 1024,                          # stored chunks, in DCP's chunk order
                  "offsets": [COL, COL], "sizes": [COL, COL],  # one column per dimension
                  "file": COL, "at": COL, "crc32c": BLOCKS},
      "step": {"type": "bytes", "count": 1, "length": COL, "file": COL, "at": COL, "crc32c": BLOCKS},
      "loader": {"type": "bytes", "count": 4, "ranks": COL, ...}}  # keep_per_rank: one copy per rank

- COL: a JSON integer (every entry equals it) or a string: a width letter (``B`` ``H`` ``I`` ``Q``: 1, 2,
  4, 8 bytes) then the base64 of ``count`` little-endian unsigned integers of that width.
- ``file``: 1 + the index of the item's data file in the sorted names of the header's ``files``; 0 for
  an item kept inline (its stored bytes, base64, are the next entry of the key's ``inline`` list).
  ``at``: its byte offset in that file.
- ``codec`` (default 0) indexes ``CODECS``; ``block_size`` defaults to the document's ``block_size``.
- BLOCKS: a packed string (never an integer, so a block count is bounded by the document's size) with an
  entry per block of every item in turn: ``crc32c`` always, ``stored_lengths`` when an item is compressed.

A tensor's chunk is stored in ``prod(sizes) * itemsize`` bytes, an object in ``length``: neither is written.
"""

from __future__ import annotations

import array
import base64
import binascii
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
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


def encode_keys(
    metadata: Metadata,
    items: Mapping[MetadataIndex, Any],
    per_rank: dict[str, dict[int, Any]],
    files: Iterable[str],
    block_size: int,
) -> dict[str, Any]:
    """The ``keys`` object of a version 3 document, from DCP's metadata and the stored item records."""
    file_numbers = {"": 0, **{name: n for n, name in enumerate(sorted(files), 1)}}
    keys: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            copies = per_rank.get(fqn)
            if copies:
                ranks = sorted(copies)
                stored = [copies[rank] for rank in ranks]
                record: dict[str, Any] = {"type": "bytes", "count": len(ranks), "ranks": encode_column(ranks)}
            else:
                stored = [_stored(items, MetadataIndex(fqn), fqn)]
                record = {"type": "bytes", "count": 1}
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
        keys[fqn] = record
    return keys


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
        from .layout import Codec, ItemKind, StoredItem, _block_logical_lengths

        start, end = self.starts[i], self.starts[i + 1]
        logical, block_size = self.logical[i], self.block_size[i]
        lengths = self.lengths[start:end] if self.lengths else _block_logical_lengths(logical, block_size)
        file = self.file[i]
        return StoredItem(
            file=self._files[file - 1] if file else "",
            offset=self.at[i],
            logical_bytes=logical,
            kind=ItemKind.TENSOR if self.tensor else ItemKind.BYTES,
            dtype=self.dtype,
            shape=self.sizes[i] if self.tensor else None,
            codec=Codec(CODECS[self.codec[i]]),
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
    """``MetadataIndex -> StoredItem`` over the decoded keys, building each record on first use: a
    rank resolves the items its load plan reads, not every item of the checkpoint."""

    def __init__(self, keys: dict[str, StoredKey]):
        self._keys = keys

    def _locate(self, index: Any) -> tuple[StoredKey, int] | None:
        key = self._keys.get(getattr(index, "fqn", None))
        at = key.position(index.offset, index.index) if key is not None else None
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

    def __len__(self) -> int:
        return sum(key.count if key.tensor else key.ranks is None for key in self._keys.values())


class _Context:
    """What every key's checks need: the data files, the default block size, the document's length."""

    def __init__(self, files: dict[str, int], block_size: Any, doc_bytes: int, where: str):
        self.names = tuple(sorted(files))
        self.sizes = [files[name] for name in self.names]
        self.block_size, self.doc_bytes, self.where = block_size, doc_bytes, where


def decode_keys(
    keys_doc: dict[str, Any], files: dict[str, int], block_size: Any, doc_bytes: int, where: str
) -> tuple[dict[str, Any], StoredItems, dict[str, dict[int, Any]]]:
    """DCP's ``state_dict_metadata``, the item records and the per-rank copies of a version 3 ``keys``."""
    context = _Context(files, block_size, doc_bytes, where)
    state: dict[str, Any] = {}
    keys: dict[str, StoredKey] = {}
    per_rank: dict[str, dict[int, Any]] = {}
    for fqn, record in keys_doc.items():
        try:
            md, key = _decode_key(fqn, record, context)
        except CheckpointFormatError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointFormatError(
                f"{where}: key {fqn!r:.80} does not follow the ckptio metadata schema: {exc!r:.200}"
            ) from None
        state[fqn], keys[fqn] = md, key
        if key.ranks is not None:
            per_rank[fqn] = {rank: key.item(i) for i, rank in enumerate(key.ranks)}
    return state, StoredItems(keys), per_rank


def _decode_key(fqn: str, record: Any, context: _Context) -> tuple[Any, StoredKey]:
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
    chunks = []
    for off, sz in zip(key.offsets, key.sizes, strict=True):
        if outside(size, (off, sz)):
            raise CheckpointFormatError(
                f"{where} has a chunk at {list(off)} of size {list(sz)} outside its shape {list(size)}"
            )
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
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
    elif count != 1:
        raise CheckpointFormatError(f"{where}: an object has one stored item (or one per rank, with 'ranks')")
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
    starts, total = [], 0
    files = len(context.names)
    itemsize = getattr(torch, key.dtype).itemsize if key.tensor else 0
    for i, (file, at, codec, block, logical) in enumerate(
        zip(key.file, key.at, key.codec, key.block_size, key.logical, strict=True)
    ):
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
        starts.append(total)
        total += -(-logical // block)
    starts.append(total)
    key.starts = starts
    key.crcs = _decode_column(record["crc32c"], total, f"{where}: crc32c (one per block)", packed_only=True)
    compressed = any(key.codec)
    if compressed != ("stored_lengths" in record):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    if compressed:
        key.lengths = _decode_column(record["stored_lengths"], total, f"{where}: stored_lengths", packed_only=True)
    _check_stored_bytes(key, record.get("inline", []), context, where)


def _check_stored_bytes(key: StoredKey, inline: Any, context: _Context, where: str) -> None:
    """Every block's stored length fits its logical length; every item lies inside its file or inline bytes."""
    if not isinstance(inline, list) or len(inline) != key.file.count(0):
        raise CheckpointFormatError(f"{where}: 'inline' must hold one base64 string per inline item")
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
