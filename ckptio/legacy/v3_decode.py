"""Format version 3's ``files``, ``keys`` and ``objects`` read back (``v3.py`` has the schema): every rule
of ``rules`` applied column by column, and the schema's own checks (entry counts, widths, base64,
distinct ranks), each a ``CheckpointFormatError`` naming the field and key. No declared number leads to
an allocation larger than the document."""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.config import INT64_LIMIT, is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format.decode import decode_path
from ckptio.format.names import (
    SAVE_ID,
    dtype_from_name,
    dtype_name,
)
from ckptio.format.rules import check_chunks_tile, check_shape, decode_inline, require_counts
from ckptio.legacy import FRAGMENT_VERSION, INCREMENTAL_VERSION, NEWEST
from ckptio.legacy.rules import (
    check_block_lengths,
    check_block_sizes,
    check_codecs,
    check_file_numbers,
    check_inline_bytes,
    check_spans,
)
from ckptio.legacy.stored_items import DIGEST_ENTRIES, StoredItems, StoredKey
from ckptio.legacy.v3 import PackedBlocks, crc_column, decode_column

#: A rank number in ``ranks`` (as version 1's nine-digit limit).
_MAX_RANK = 10**9
#: Every object's entry in DCP's metadata (it has no fields: one instance serves all).
_OBJECT = BytesStorageMetadata()
#: The save id in a data file name (``records.data_file_name``).
_SAVE_ID = re.compile(SAVE_ID)


class _Context:
    """What every key's checks need: the data files, the default block size, the document's length, and
    whether each tensor's chunks must cover it (not in a fragment: ``rules.check_chunks_tile``)."""

    def __init__(
        self,
        names: tuple[str, ...],
        files: dict[str, int],
        block_size: Any,
        doc_bytes: int,
        where: str,
        cover: bool,
        version: int = NEWEST,
    ):
        self.names = names
        self.sizes = [files[name] for name in names]
        self.block_size, self.doc_bytes, self.where, self.cover = block_size, doc_bytes, where, cover
        self.digests = version >= INCREMENTAL_VERSION  # block digests (incremental saves)


def decode_keys(
    doc: dict[str, Any], names: tuple[str, ...], files: dict[str, int], doc_bytes: int, where: str, cover: bool = True
) -> tuple[dict[str, Any], StoredItems, dict[str, dict[int, Any]], Any]:
    """DCP's ``state_dict_metadata``, the item records, the per-rank copies and, when the document
    stores it as per-key paths, the planner data of a version 3 or 4 document's ``keys``, ``objects``
    and ``tensors`` (``cover``: every tensor's chunks must cover it; not in a fragment)."""
    default_block = doc.get("block_size")
    if default_block is not None and not is_block_size(default_block):
        raise CheckpointFormatError(f"{where}: 'block_size' {default_block!r:.40} is not a valid block size")
    context = _Context(names, files, default_block, doc_bytes, where, cover, doc.get("format_version", NEWEST))
    state: dict[str, Any] = {}
    keys: dict[str, StoredKey] = {}
    per_rank: dict[str, dict[int, Any]] = {}
    paths: dict[str, Any] = {}
    keys_doc = doc.get("keys")
    if not isinstance(keys_doc, dict):
        raise CheckpointFormatError(f"{where}: required field 'keys' must be a JSON object")
    for fqn, record in keys_doc.items():
        with schema(where, f"key {fqn!r:.80}"):
            md, key = _decode_key(fqn, record, context)
            paths[fqn] = record.get("path")
        state[fqn], keys[fqn] = md, key
        if key.ranks is not None:
            per_rank[fqn] = {rank: key.item(i) for i, rank in enumerate(key.ranks)}
    tables: dict[str, tuple[StoredKey, list[str]]] = {}
    for name, decode_table in (("tensors", _decode_tensors), ("objects", _decode_objects)):
        if doc.get(name) is None:
            continue
        if name == "tensors" and doc.get("format_version") == 3:
            raise CheckpointFormatError(f"{where}: a 'tensors' table is format version 4's, not 3's")
        if name == "tensors" and "boxed" in doc[name] and doc["format_version"] < FRAGMENT_VERSION:
            raise CheckpointFormatError(f"{where}: a 'boxed' column is format version {FRAGMENT_VERSION}'s")
        with schema(where, f"the {name} table"):
            table, table_names, entries = decode_table(doc[name], context)
        twice = state.keys() & set(table_names)
        if twice:
            raise CheckpointFormatError(f"{where}: key {min(twice)!r:.80} is listed twice")
        state.update(zip(table_names, entries, strict=True) if entries else dict.fromkeys(table_names, _OBJECT))
        paths.update(zip(table_names, doc[name].get("paths") or [None] * len(table_names), strict=True))
        tables[name] = (table, table_names)
    planner_data = None  # stored as it is (or absent): checked by the caller, as in every version
    if doc.get("planner_data") == "paths":
        planner_data = {fqn: decode_path(fqn, code, len(state), where) for fqn, code in paths.items()}
    return state, StoredItems(keys, tables.get("objects"), tables.get("tensors")), per_rank, planner_data


class schema:  # noqa: N801 - used as ``with schema(where, what):``
    """A record of the wrong shape (a missing field, a string for a list) is a named format error. A
    class, not a generator: a merge enters one per fragment, thousands of times (~1 us against ~18)."""

    __slots__ = ("where", "what")

    def __init__(self, where: str, what: str):
        self.where, self.what = where, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, traceback: Any) -> bool:
        if kind is None or issubclass(kind, CheckpointFormatError) or not issubclass(kind, _SCHEMA_ERRORS):
            return False
        raise CheckpointFormatError(
            f"{self.where}: {self.what} does not follow the ckptio metadata schema: {exc!r:.200}"
        ) from None


_SCHEMA_ERRORS = (KeyError, TypeError, ValueError, OverflowError, IndexError)


def table_names(table: Any, where: str) -> list[str]:
    """A table's ``keys``: distinct names (and ``paths``, when present, one per key)."""
    names = table["keys"]
    if not isinstance(names, list) or not set(map(type, names)) <= {str} or len(set(names)) != len(names):
        raise CheckpointFormatError(f"{where}: 'keys' must be a list of distinct key names")
    if "paths" in table and (not isinstance(table["paths"], list) or len(table["paths"]) != len(names)):
        raise CheckpointFormatError(f"{where}: 'paths' must have one entry per key")
    return names


def table_dtypes(table: Any, where: str) -> tuple[list[str], list[torch.dtype]]:
    """A tensors table's ``dtypes``: distinct dtype names, and the dtypes they name."""
    kinds = table["dtypes"]
    if not isinstance(kinds, list) or len(set(kinds)) != len(kinds):
        raise CheckpointFormatError(f"{where}: 'dtypes' must be a list of distinct dtype names")
    return kinds, [dtype_from_name(name, where) for name in kinds]


def _decode_objects(table: Any, context: _Context) -> tuple[StoredKey, list[str], None]:
    """The objects table: one stored item per object key, as columns (``keys`` names them)."""
    where = f"{context.where}: objects table"
    names = table_names(table, where)
    objects = StoredKey("", False, context.names)
    objects.logical = decode_column(table["length"], len(names), f"{where}: length")
    _storage_columns_of(objects, table, context, where)
    return objects, names, None


def _decode_tensors(table: Any, context: _Context) -> tuple[StoredKey, list[str], list[TensorStorageMetadata]]:
    """The tensors table (version 4): every tensor key's shape and chunks, and each chunk's stored item,
    as columns. A key of one chunk is stored whole (no offsets or sizes entries)."""
    where = f"{context.where}: tensors table"
    names = table_names(table, where)
    count = len(names)
    kinds, dtypes = table_dtypes(table, where)
    numbers = decode_column(table["dtype"], count, f"{where}: dtype")
    ndims = decode_column(table["ndim"], count, f"{where}: ndim")
    grads = decode_column(table["requires_grad"], count, f"{where}: requires_grad")
    chunks = decode_column(table.get("count", 1), count, f"{where}: count")
    boxed = decode_column(table.get("boxed", 0), count, f"{where}: boxed")
    bound = context.doc_bytes  # no column may declare more entries than the document could hold
    if count and (
        max(numbers) >= len(dtypes) or max(grads) > 1 or min(chunks) < 1 or sum(ndims) > bound or max(boxed) > 1
    ):
        raise CheckpointFormatError(
            f"{where}: 'dtype' must index 'dtypes', 'requires_grad' hold 0 or 1 (as must 'boxed'), 'count' be "
            "positive, and 'ndim' fit the document"
        )
    flat = decode_column(table["size"], sum(ndims), f"{where}: size")
    ends = list(itertools.accumulate(ndims))
    sizes = [tuple(flat[end - n : end]) for n, end in zip(ndims, ends, strict=True)]
    itemsizes = [dtypes[number].itemsize for number in numbers]
    volumes = list(map(math.prod, sizes))
    for i in (i for i, n in enumerate(volumes) if n * itemsizes[i] >= INT64_LIMIT or not n and sizes[i]):
        check_shape(sizes[i], itemsizes[i], f"{where}: key {names[i]!r:.80}")  # else within int64
    split = [i for i, n in enumerate(chunks) if n != 1 or boxed[i]]
    box_entries = sum(chunks[i] * ndims[i] for i in split)
    if sum(chunks) > bound or box_entries > bound:  # before any list of that length is made
        raise CheckpointFormatError(f"{where}: 'count' declares more chunks than the document could describe")
    offsets_flat = decode_column(table.get("offsets", 0), box_entries, f"{where}: offsets")
    sizes_flat = decode_column(table.get("sizes", 0), box_entries, f"{where}: sizes")
    zeros = {n: torch.Size((0,) * n) for n in set(ndims)}
    props = {
        (number, grad): TensorProperties(dtype=dtypes[number], requires_grad=bool(grad))
        for number, grad in set(zip(numbers, grads, strict=True))
    }
    entries: list[TensorStorageMetadata] = []
    key = StoredKey("", True, context.names)
    key.dtypes, key.offsets, key.sizes, key.logical = [], [], [], []
    item_sizes: list[int] = []
    at = 0  # in the flat offsets and sizes columns
    for i, (size, n, number, grad, itemsize) in enumerate(zip(sizes, ndims, numbers, grads, itemsizes, strict=True)):
        shape = torch.Size(size)
        if chunks[i] == 1 and not boxed[i]:
            boxes = [ChunkStorageMetadata(zeros[n], shape)]
            key.offsets.append(zeros[n])
            key.sizes.append(size)
            key.logical.append(volumes[i] * itemsize)
        else:
            c = chunks[i]
            key_offsets, key_sizes = offsets_flat[at : at + c * n], sizes_flat[at : at + c * n]
            offset_columns = [key_offsets[d::n] for d in range(n)]
            size_columns = [key_sizes[d::n] for d in range(n)]
            at += c * n
            starts, lengths, parts = check_chunks_tile(
                size, c, offset_columns, size_columns, f"{where}: key {names[i]!r:.80}", context.cover
            )
            boxes = [ChunkStorageMetadata(torch.Size(o), torch.Size(m)) for o, m in zip(starts, lengths, strict=True)]
            key.offsets += starts
            key.sizes += lengths
            key.logical += [part * itemsize for part in parts]
        entries.append(TensorStorageMetadata(props[number, grad], shape, boxes))
        key.dtypes += [kinds[number]] * chunks[i]
        item_sizes += [itemsize] * chunks[i]
    _storage_columns_of(key, table, context, where, item_sizes)
    key.firsts = list(itertools.accumulate(chunks, initial=0))
    return key, names, entries


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
        md = _tensor_columns(key, record, count, where, context.cover)
    else:
        md = BytesStorageMetadata()
        _object_columns(key, record, count, where)
    _storage_columns_of(key, record, context, where)
    return md, key


def _tensor_columns(
    key: StoredKey, record: dict[str, Any], count: int, where: str, cover: bool
) -> TensorStorageMetadata:
    size = tuple(require_counts(record["size"], where))
    offsets, sizes = record["offsets"], record["sizes"]
    if not isinstance(offsets, list) or not isinstance(sizes, list) or not len(offsets) == len(sizes) == len(size):
        raise CheckpointFormatError(f"{where} must have one offsets and one sizes column per dimension ({len(size)})")
    offset_columns = [decode_column(c, count, f"{where}: offsets column {d}") for d, c in enumerate(offsets)]
    size_columns = [decode_column(c, count, f"{where}: sizes column {d}") for d, c in enumerate(sizes)]
    dtype = dtype_from_name(record["dtype"], where)
    check_shape(size, dtype.itemsize, where)
    key.dtype = dtype_name(dtype)
    key.offsets, key.sizes, volumes = check_chunks_tile(size, count, offset_columns, size_columns, where, cover)
    key.logical = [n * dtype.itemsize for n in volumes]
    requires_grad = record["requires_grad"]
    if not isinstance(requires_grad, bool):
        raise CheckpointFormatError(f"{where}: 'requires_grad' must be true or false")
    props = TensorProperties(dtype=dtype, requires_grad=requires_grad)
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in zip(key.offsets, key.sizes, strict=True)]
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


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


def _storage_columns_of(
    key: StoredKey, record: dict[str, Any], context: _Context, where: str, itemsizes: list[int] | None = None
) -> None:
    """Files, offsets, codecs, block sizes and blocks, each item checked as version 1 checks a record."""
    count = key.count
    key.file = decode_column(record["file"], count, f"{where}: file")
    key.at = decode_column(record["at"], count, f"{where}: at")
    key.codec = decode_column(record.get("codec", 0), count, f"{where}: codec")
    default_block = record.get("block_size", context.block_size)
    if default_block is None:
        raise CheckpointFormatError(f"{where} has no 'block_size' and the document gives no default")
    key.block_size = decode_column(default_block, count, f"{where}: block_size")
    if itemsizes is None:
        itemsizes = dtype_from_name(key.dtype).itemsize if key.tensor else 0
    check_codecs(key.codec, itemsizes, NEWEST, where)
    check_block_sizes(key.block_size, where)
    check_file_numbers(key.file, key.at, len(context.names), where)
    blocks = key.block_size
    if count and 0 < min(key.logical) and max(key.logical) <= min(blocks):  # one block each (small objects)
        key.starts = range(count + 1)
    else:
        per_item = (-(-n // b) for n, b in zip(key.logical, blocks, strict=True))
        key.starts = list(itertools.accumulate(per_item, initial=0))
    total = key.starts[-1]
    key.crcs = crc_column(record["crc32c"], total, f"{where}: crc32c (one per block)")  # decoded on use
    compressed = any(key.codec)
    if compressed != ("stored_lengths" in record):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    if compressed:
        key.lengths = decode_column(record["stored_lengths"], total, f"{where}: stored_lengths", packed_only=True)
    if "digests" in record:
        if not context.digests:
            raise CheckpointFormatError(f"{where}: a 'digests' column is format version {INCREMENTAL_VERSION}'s")
        key.digests = PackedBlocks(record["digests"], DIGEST_ENTRIES * total, f"{where}: digests (16 bytes per block)")
        if key.digests.width != 4:  # sliced as 4-byte entries: wider ones would shift every block's digest
            raise CheckpointFormatError(f"{where}: digests holds {key.digests.width}-byte entries, not 4")
    _check_stored_bytes(key, record.get("inline", []), context, where)


def _check_stored_bytes(key: StoredKey, inline: Any, context: _Context, where: str) -> None:
    """Every block's stored length fits its logical length; every item lies inside its file or inline bytes."""
    if not isinstance(inline, list) or len(inline) != key.file.count(0):
        raise CheckpointFormatError(f"{where}: 'inline' must hold one base64 string per inline item")
    if key.lengths is None and not inline:  # raw items in files: the common case, checked in bulk
        check_spans(key.file, key.at, key.logical, context.names, context.sizes, where)
        return
    lengths, inline_values = key.lengths, iter(inline)
    stored = key.logical
    if lengths is not None:
        stored = [
            check_block_lengths(lengths[key.starts[i] : key.starts[i + 1]], n, b, codec == 0, f"{where}: item {i}")
            for i, (n, b, codec) in enumerate(zip(key.logical, key.block_size, key.codec, strict=True))
        ]
    check_spans(key.file, key.at, stored, context.names, context.sizes, where)
    for i in (i for i, file in enumerate(key.file) if file == 0):
        data = decode_inline(next(inline_values), where)
        check_inline_bytes(data, stored[i], f"{where}: item {i}")
        key.inline[i] = data
