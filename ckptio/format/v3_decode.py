"""Format version 3's ``files``, ``keys`` and ``objects`` read back (``v3.py`` has the schema): every
check version 1 makes of its records, made column by column, and the column checks (entry counts,
widths, base64, distinct offsets and ranks), each a ``CheckpointFormatError`` naming the field and key.
No declared number leads to an allocation larger than the document."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.config import MAX_BLOCK_SIZE_LIMIT, is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format.chunks import outside
from ckptio.format.records import (
    SAVE_ID,
    Codec,
    check_block_lengths,
    check_shape,
    chunks_overlap,
    data_file_name,
    decode_inline,
    dtype_from_name,
    dtype_name,
    is_list_index,
    list_index_bound,
    refuse_data_file_name,
    require_counts,
)
from ckptio.format.stored_items import StoredItems, StoredKey
from ckptio.format.v3 import CODECS, PackedBlocks, decode_column

_PLANE_CODEC = CODECS.index(Codec.ZSTD_BYTEPLANES)
#: A rank number in ``ranks`` (as version 1's nine-digit limit).
_MAX_RANK = 10**9
#: Every object's entry in DCP's metadata (it has no fields: one instance serves all).
_OBJECT = BytesStorageMetadata()
#: The save id in a data file name (``records.data_file_name``).
_SAVE_ID = re.compile(SAVE_ID)


class _Context:
    """What every key's checks need: the data files, the default block size, the document's length."""

    def __init__(self, names: tuple[str, ...], files: dict[str, int], block_size: Any, doc_bytes: int, where: str):
        self.names = names
        self.sizes = [files[name] for name in names]
        self.block_size, self.doc_bytes, self.where = block_size, doc_bytes, where


def decode_files(value: Any, where: str) -> tuple[tuple[str, ...], dict[str, int], dict[str, int]]:
    """Version 3's ``files`` columns: the data file names in order, their sizes and writing ranks (the
    names and sizes are then checked as every version's are, by ``Header``)."""
    if not isinstance(value, dict) or not isinstance(value.get("save_ids"), list):
        raise CheckpointFormatError(f"{where}: 'files' must hold 'save_ids', 'ranks' and 'sizes' columns")
    save_ids = value["save_ids"]
    count = len(save_ids)
    ranks = decode_column(value.get("ranks"), count, f"{where}: files: ranks")
    sizes = decode_column(value.get("sizes"), count, f"{where}: files: sizes")
    writers = decode_column(value["writers"], count, f"{where}: files: writers") if "writers" in value else ranks
    try:
        distinct = set(save_ids)  # usually one: a save's files share its id
    except TypeError:  # a list or an object among them
        distinct = {None}
    if not all(isinstance(s, str) and _SAVE_ID.fullmatch(s) for s in distinct):
        for save_id, rank in zip(save_ids, ranks, strict=True):  # which one
            if not (isinstance(save_id, str) and _SAVE_ID.fullmatch(save_id)):
                refuse_data_file_name(data_file_name(save_id, rank), where)  # names the file and raises
    names = tuple(map(data_file_name, save_ids, ranks))
    if len(set(zip(save_ids, ranks, strict=True)) if len(distinct) > 1 else set(ranks)) != count:
        raise CheckpointFormatError(f"{where}: 'files' names a data file twice")
    return names, dict(zip(names, sizes, strict=True)), dict(zip(names, writers, strict=True))


def decode_keys(
    doc: dict[str, Any], names: tuple[str, ...], files: dict[str, int], doc_bytes: int, where: str
) -> tuple[dict[str, Any], StoredItems, dict[str, dict[int, Any]], Any]:
    """DCP's ``state_dict_metadata``, the item records, the per-rank copies and, when the document
    stores it as per-key paths, the planner data of a version 3 document's ``keys`` and ``objects``."""
    default_block = doc.get("block_size")
    if default_block is not None and not is_block_size(default_block):
        raise CheckpointFormatError(f"{where}: 'block_size' {default_block!r:.40} is not a valid block size")
    context = _Context(names, files, default_block, doc_bytes, where)
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
    planner_data = None  # stored as it is (or absent): checked by the caller, as in every version
    if doc.get("planner_data") == "paths":
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
    if not isinstance(names, list) or not set(map(type, names)) <= {str} or len(set(names)) != len(names):
        raise CheckpointFormatError(f"{where}: 'keys' must be a list of distinct key names")
    if "paths" in table and (not isinstance(table["paths"], list) or len(table["paths"]) != len(names)):
        raise CheckpointFormatError(f"{where}: 'paths' must have one entry per key")
    objects = StoredKey("", False, context.names)
    objects.logical = decode_column(table["length"], len(names), f"{where}: length")
    _storage_columns_of(objects, table, context, where)
    return objects, names


def decode_path(fqn: str, code: Any, keys: int, where: str) -> tuple[str | int, ...]:
    """A flat key's path from its code (see ``encode_path``); list indices as ``list_index_bound`` allows."""
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
            if (
                not part.isdecimal()
                or not part.isascii()
                or str(int(part)) != part
                or not is_list_index(int(part), keys)
            ):
                raise CheckpointFormatError(
                    f"{where}: the path of key {fqn!r:.80} has a list index {part!r:.20} that is not below "
                    f"{list_index_bound(keys)}"
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
    size = tuple(require_counts(record["size"], where))
    offsets, sizes = record["offsets"], record["sizes"]
    if not isinstance(offsets, list) or not isinstance(sizes, list) or not len(offsets) == len(sizes) == len(size):
        raise CheckpointFormatError(f"{where} must have one offsets and one sizes column per dimension ({len(size)})")
    if count > 1 and all(isinstance(column, int) for column in offsets):
        raise CheckpointFormatError(f"{where}: its {count} chunks all start at the same offsets (listed twice)")
    offset_columns = [decode_column(c, count, f"{where}: offsets column {d}") for d, c in enumerate(offsets)]
    size_columns = [decode_column(c, count, f"{where}: sizes column {d}") for d, c in enumerate(sizes)]
    key.offsets = list(zip(*offset_columns, strict=True)) if size else [()] * count
    key.sizes = list(zip(*size_columns, strict=True)) if size else [()] * count
    if len(set(key.offsets)) != count:
        raise CheckpointFormatError(f"{where}: a chunk is listed twice (two chunks start at the same offsets)")
    dtype = dtype_from_name(record["dtype"])
    check_shape(size, dtype.itemsize, where)
    key.dtype = dtype_name(dtype)
    volumes = list(map(math.prod, key.sizes))
    key.logical = [n * dtype.itemsize for n in volumes]
    # column by column (entries are non-negative): a chunk ends inside its shape in every dimension
    if count and any(
        max(map(int.__add__, o, n)) > s for o, n, s in zip(offset_columns, size_columns, size, strict=True)
    ):
        off, sz = next((o, n) for o, n in zip(key.offsets, key.sizes, strict=True) if outside(size, (o, n)))
        raise CheckpointFormatError(
            f"{where} has a chunk at {list(off)} of size {list(sz)} outside its shape {list(size)}"
        )
    split = [d for d, column in enumerate(offsets) if not isinstance(column, int)]
    if len(split) == 1 and all(isinstance(column, int) for d, column in enumerate(sizes) if d != split[0]):
        # every chunk spans the same range of the other dimensions (DCP's row or column splits):
        # two overlap when their intervals along the split dimension do
        empty = any(column == 0 for d, column in enumerate(sizes) if d != split[0])
        overlap = not empty and _intervals_overlap(offset_columns[split[0]], size_columns[split[0]])
    else:
        overlap = chunks_overlap(list(zip(key.offsets, key.sizes, strict=True)), where)
    if sum(volumes) != math.prod(size) or overlap:
        raise CheckpointFormatError(
            f"{where}: its chunks hold {sum(volumes)} elements for a shape {list(size)} of {math.prod(size)}; "
            "the checkpoint does not cover the tensor"
        )
    requires_grad = record["requires_grad"]
    if not isinstance(requires_grad, bool):
        raise CheckpointFormatError(f"{where}: 'requires_grad' must be true or false")
    props = TensorProperties(dtype=dtype, requires_grad=requires_grad)
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in zip(key.offsets, key.sizes, strict=True)]
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _intervals_overlap(starts: list[int], lengths: list[int]) -> bool:
    """Whether two of the non-empty intervals ``[start, start + length)`` share a point."""
    spans = sorted((start, length) for start, length in zip(starts, lengths, strict=True) if length)
    return any(start + length > next_start for (start, length), (next_start, _) in zip(spans, spans[1:], strict=False))


def _object_columns(key: StoredKey, record: dict[str, Any], count: int, where: str) -> None:
    if "ranks" in record:
        if count > 1 and not isinstance(record["ranks"], str):
            raise CheckpointFormatError(f"{where}: its {count} per-rank copies all name the same rank")
        key.ranks = decode_column(record["ranks"], count, f"{where}: ranks")
        if len(set(key.ranks)) != count or max(key.ranks, default=0) >= _MAX_RANK:
            raise CheckpointFormatError(f"{where}: per-rank copies must name distinct ranks below {_MAX_RANK}")
    else:
        raise CheckpointFormatError(f"{where}: an object in 'keys' has one copy per rank ('ranks')")
    key.logical = decode_column(record["length"], count, f"{where}: length")


def _storage_columns_of(key: StoredKey, record: dict[str, Any], context: _Context, where: str) -> None:
    """Files, offsets, codecs, block sizes and blocks, each item checked as version 1 checks a record."""
    count = key.count
    key.file = decode_column(record["file"], count, f"{where}: file")
    key.at = decode_column(record["at"], count, f"{where}: at")
    key.codec = decode_column(record.get("codec", 0), count, f"{where}: codec")
    default_block = record.get("block_size", context.block_size)
    if default_block is None:
        raise CheckpointFormatError(f"{where} has no 'block_size' and the document gives no default")
    key.block_size = decode_column(default_block, count, f"{where}: block_size")
    files = len(context.names)
    blocks = key.block_size
    if count and (
        max(key.codec) >= len(CODECS)
        or _PLANE_CODEC in key.codec
        and (dtype_from_name(key.dtype).itemsize if key.tensor else 0) not in (2, 4, 8)
        # is_block_size over a column at C speed; _name_bad_item then names the item with the rule itself
        or min(blocks) <= 0
        or max(blocks) > MAX_BLOCK_SIZE_LIMIT
        or any(b % 64 for b in (set(blocks) if len(blocks) > 64 else blocks))
        or max(key.file) > files
        or 0 in key.file
        and any(at for file, at in zip(key.file, key.at, strict=True) if file == 0)
    ):
        _name_bad_item(key, files, where)
    if count and 0 < min(key.logical) and max(key.logical) <= min(blocks):  # one block each (small objects)
        key.starts = range(count + 1)
    else:
        per_item = (-(-n // b) for n, b in zip(key.logical, blocks, strict=True))
        key.starts = list(itertools.accumulate(per_item, initial=0))
    total = key.starts[-1]
    key.crcs = PackedBlocks(record["crc32c"], total, f"{where}: crc32c (one per block)")  # decoded on use
    compressed = any(key.codec)
    if compressed != ("stored_lengths" in record):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    if compressed:
        key.lengths = decode_column(record["stored_lengths"], total, f"{where}: stored_lengths", packed_only=True)
    _check_stored_bytes(key, record.get("inline", []), context, where)


def _name_bad_item(key: StoredKey, files: int, where: str) -> None:
    """Raise the error of the first item whose codec, block size or file is wrong."""
    itemsize = dtype_from_name(key.dtype).itemsize if key.tensor else 0
    for i, (file, at, codec, block) in enumerate(zip(key.file, key.at, key.codec, key.block_size, strict=True)):
        if codec >= len(CODECS):
            raise CheckpointFormatError(f"{where}: item {i} has unknown codec number {codec}")
        if codec == _PLANE_CODEC and itemsize not in (2, 4, 8):
            raise CheckpointFormatError(f"{where} uses byte planes but is not a tensor of 2-, 4- or 8-byte elements")
        if not is_block_size(block):
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
            stored = check_block_lengths(lengths[start:end], logical, block, key.codec[i] == 0, f"{where}: item {i}")
        if file == 0:
            data = decode_inline(next(inline_values), where)
            if data is None or len(data) != stored:
                raise CheckpointFormatError(f"{where}: item {i} is stored inline but its bytes do not match its blocks")
            key.inline[i] = data
        elif at + stored > context.sizes[file - 1]:
            name = context.names[file - 1]
            raise CheckpointFormatError(
                f"{where}: item {i} spans bytes {at}..{at + stored} of {name}, which the metadata says holds "
                f"{context.sizes[file - 1]} bytes"
            )
