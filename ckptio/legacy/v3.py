"""Format versions 3 to 5: every key's stored items as a few packed columns, checked as strictly as
version 1's per-item records, and an item's record built only when a load asks for it.

Version 1 wrote a JSON object per stored item (repeating its key, its chunk's offsets and shape and its
dtype) beside a second list of the same chunks under ``state``, and the data files twice (sizes, writers).
Version 3 writes, besides the header fields every version has::

    "files": {"save_ids": ["9f0c...", ...], "ranks": COL, "sizes": COL},  # data-<save_id>-r<rank>.ckio
              # version 5 may add "key_prefix": "sha256-2": every name under its key prefix (names.key_prefix)
    "block_size": 262144,                      # the default of every block_size column
    "planner_data": "paths",                   # torch's {flat key: path}, as per-key "path" codes
    "keys": {                                  # tensors, and objects saved with one copy per rank
      "model.w": {"type": "tensor", "dtype": "float32", "size": [8192, 8192], "requires_grad": false,
                  "count": 1024,                              # stored chunks, in DCP's chunk order
                  "offsets": [COL, COL], "sizes": [COL, COL],  # one column per dimension
                  "file": COL, "at": COL, "crc32c": BLOCKS, "path": [1, 1]},
      "loader": {"type": "bytes", "count": 4, "ranks": COL, "length": COL, "file": COL, ...}},
    "objects": {"keys": ["step", ...], "paths": [...], "length": COL, "file": COL, "at": COL, ...},
    "tensors": {"keys": ["norm.w", ...], "paths": [...], "dtypes": ["bfloat16", "float32"],  # version 4
                "dtype": COL, "ndim": COL, "size": COL, "requires_grad": COL, "file": COL, "at": COL, ...}

- COL: a JSON integer (every entry equals it) or a string: a width letter (``B`` ``H`` ``I`` ``Q``: 1, 2,
  4, 8 bytes) then the base64 of one little-endian unsigned integer of that width per entry.
- ``file``: 1 + the item's data file's position in ``files``; 0 for an item kept inline (its stored
  bytes, base64, are the next entry of the record's ``inline`` list). ``at``: its byte offset there.
- ``codec`` (default 0) indexes ``CODECS``; ``block_size`` defaults to the document's ``block_size``.
- BLOCKS: a packed string (never an integer, so a block count is bounded by the document's size) with an
  entry per block of every item in turn: ``crc32c`` always, ``stored_lengths`` when an item is compressed.
- ``objects``: every object stored once, one entry per key in each column.
- ``tensors`` (version 4): every tensor key, one entry per key in each key column: ``dtype`` indexes
  ``dtypes``, ``size`` holds each key's ``ndim`` dimensions in turn, ``requires_grad`` is 0 or 1,
  ``count`` (default 1) its chunks; ``offsets`` and ``sizes`` hold the boxes of the chunks of keys of
  several chunks, dimension by dimension, in turn (a key of one chunk is stored whole); the storage
  columns hold one entry per chunk. Version 3 kept each key as a ``keys`` record of its own: a state of
  many small tensors (norms, biases, step counters) paid ~200 bytes and ~20 us of decoding per key.
  In version 4, ``keys`` holds objects kept with one copy per rank, keys of more than
  ``TABLE_MAX_CHUNKS`` chunks (where per-key columns are smaller), and tensors that are not tiled.
- ``path``: how many dot-separated parts of the key form each element of torch's path (0: a list index);
  absent (``null`` in ``paths``): one element per part. ``planner_data`` is stored as it is when it is
  not a path for exactly each key. ``files`` has ``writers`` only when a rank wrote a file that another
  rank's name is on.

A tensor's chunk is stored in ``prod(sizes) * itemsize`` bytes, an object in ``length``: neither is written.

Version 7 (incremental saves, ``saving/incremental.py``) adds ``digests`` to the storage columns (a BLOCKS
string of 16 bytes per block: xxh3-128 of its logical bytes, or 16 zero bytes for a block the save did not
hash, equal to no other digest), ``bases`` and ``base`` to ``files`` (data
files of sibling checkpoints, named ``../<sibling>/data-....ckio``), a ``chain`` record, and::

    "extents": {"items": 2, "count": COL, "file": COL, "at": COL, "length": COL}

for items stored in pieces (some blocks in the base's file, the changed ones in its own): such an item's
``file`` numbers a virtual file after the data files, its blocks back to back, made of ``count`` runs
``(file, at, length)`` of data files.
"""

from __future__ import annotations

import array
import itertools
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ckptio.errors import CheckpointError
from ckptio.format.columns import (  # noqa: F401 - the legacy decoder's columns
    _TYPECODES,
    PackedBlocks,
    b64,
    crc_column,
    decode_array,
    decode_column,
    encode_array,
    encode_column,
    encode_packed,
    encode_packed_array,
)
from ckptio.format.encode import encode_files
from ckptio.format.encode import paths_by_key as _paths_by_key
from ckptio.format.names import (
    CODECS,
    SIBLING_PREFIX,
    dtype_name,
)
from ckptio.format.records import Reference, planner_data_json

#: Keys of at most this many chunks go to the ``tensors`` table. A ``keys`` record costs ~200 bytes and
#: ~20 us of decoding of its own, and saves ~8 bytes per chunk of a 2-D key split along one dimension
#: (its other dimension's offsets and sizes are one number each): it pays from ~25 chunks on. At 1,024
#: ranks x 8 layers of FSDP, all keys in the table took 6.3 MiB, per-key records 4.9 MiB.
TABLE_MAX_CHUNKS = 16

# ---------------------------------------------------------------------------------------
# Encoding (the writer's side: records it made itself)


def encode_document(
    metadata: Metadata,
    items: Mapping[tuple[str, torch.Size | None], Any],
    per_rank: dict[str, dict[int, Any]],
    files: dict[str, int],
    writer_ranks: dict[str, int],
    block_size: int,
    tensor_table: bool = True,
    boxed_chunks: bool = False,
) -> dict[str, Any]:
    """The version 3 fields (``files``, ``block_size``, ``planner_data``, ``keys``, ``objects``) from DCP's
    metadata, the stored item records by ``(key, chunk offsets or None)`` and the data files; with
    ``tensor_table`` (version 4), whole tensors stored as one chunk go to the ``tensors`` table; with
    ``boxed_chunks`` (version 6: fragments), so do keys of one chunk that is part of its tensor."""
    names = sorted(files)
    file_numbers = dict(zip(names, range(1, len(names) + 1), strict=True))
    file_numbers[""] = 0
    pieces = _stored_in_pieces(items, per_rank) if names and names[0].startswith(SIBLING_PREFIX) else []
    for k, item in enumerate(pieces):  # virtual files, numbered after the data files
        file_numbers[item.file] = len(names) + 1 + k
    paths = _paths_by_key(metadata)
    state = metadata.state_dict_metadata
    # objects stored once go to one table (at thousands of ranks, mostly each rank's own data-loader key);
    # so do whole tensors (a state of many small tensors: norms, biases, step counters)
    objects = [fqn for fqn, md in state.items() if isinstance(md, BytesStorageMetadata) and not per_rank.get(fqn)]
    tensors = [fqn for fqn, md in state.items() if tensor_table and _tabled(md, boxed_chunks)]
    in_table = set(objects).union(tensors)
    keys: dict[str, Any] = {}
    for fqn, md in state.items():
        if fqn not in in_table:
            keys[fqn] = _key_record(fqn, md, items, per_rank, file_numbers, block_size)
            if paths and paths[fqn] is not None:
                keys[fqn]["path"] = paths[fqn]
    doc: dict[str, Any] = {
        "files": encode_files(names, files, writer_ranks),
        "block_size": block_size,
        "planner_data": "paths" if paths is not None else planner_data_json(metadata.planner_data),
        "keys": keys,
    }
    if pieces:
        doc["extents"] = _extents_table(pieces, file_numbers)
    if tensors:
        doc["tensors"] = _tensor_table(tensors, state, items, paths, file_numbers, block_size)
    if objects:
        stored = _records(items, [(fqn, None) for fqn in objects])
        table = table_of(objects, paths)
        table["length"] = encode_column(list(map(_LOGICAL_BYTES, stored)))
        table.update(_storage_columns(stored, file_numbers, block_size))
        doc["objects"] = table
    return doc


def _stored_in_pieces(items: Mapping[Any, Any], per_rank: dict[str, dict[int, Any]]) -> list[Any]:
    """The items an incremental save stored in pieces (``records.Reference`` of several extents)."""
    every = itertools.chain(items.values(), *(copies.values() for copies in per_rank.values()))
    return [item for item in every if isinstance(item, Reference) and len(item.extents) > 1]


def _extents_table(pieces: list[Any], file_numbers: dict[str, int]) -> dict[str, Any]:
    """Version 7's ``extents``: per virtual file (an item stored in pieces) its ``count`` of runs, and per
    run its data file's number, offset and length."""
    runs = [extent for item in pieces for extent in item.extents]
    return {
        "items": len(pieces),
        "count": encode_column([len(item.extents) for item in pieces]),
        "file": encode_column([file_numbers[run.file] for run in runs]),
        "at": encode_column([run.offset for run in runs]),
        "length": encode_column([run.length for run in runs]),
    }


def _tabled(md: Any, boxed_chunks: bool = False) -> bool:
    """A tensor kept in the ``tensors`` table: of a few chunks, or of one that is all of it (the table
    stores no box for such a chunk). A key of many chunks keeps a ``keys`` record: its per-key columns
    store a dimension that every chunk spans whole as one number, where the table's flat boxes repeat it
    per chunk (see ``TABLE_MAX_CHUNKS``); so does a single chunk that is not all of its tensor, which the
    decoder then refuses as not covering it."""
    if isinstance(md, BytesStorageMetadata) or not md.chunks:
        return False
    chunk = md.chunks[0]
    if boxed_chunks:
        return len(md.chunks) <= TABLE_MAX_CHUNKS
    return 1 < len(md.chunks) <= TABLE_MAX_CHUNKS or (chunk.sizes == md.size and not any(chunk.offsets))


def _boxed(md: Any) -> bool:
    """Whether a key's chunks need their boxes: several, or one that is not all of the tensor."""
    chunk = md.chunks[0]
    return len(md.chunks) > 1 or chunk.sizes != md.size or any(chunk.offsets)


def table_of(names: list[str], paths: dict[str, Any] | None) -> dict[str, Any]:
    """A table's ``keys`` and, unless every key's path code is ``None``, their ``paths``."""
    table: dict[str, Any] = {"keys": names}
    codes = [paths[fqn] for fqn in names] if paths else []
    if codes.count(None) != len(codes):
        table["paths"] = codes
    return table


def _tensor_table(
    names: list[str],
    state: Mapping[str, Any],
    items: Mapping[tuple[str, torch.Size | None], Any],
    paths: dict[str, Any] | None,
    file_numbers: dict[str, int],
    block_size: int,
) -> dict[str, Any]:
    """The ``tensors`` table: one entry per key in each key column (its shape flat in ``size``), the
    boxes of keys of several chunks flat in ``offsets`` and ``sizes``, one entry per chunk in each
    storage column."""
    entries = [state[fqn] for fqn in names]
    dtypes = [dtype_name(md.properties.dtype) for md in entries]
    kinds = sorted(set(dtypes))
    number = {name: i for i, name in enumerate(kinds)}
    boxed = [int(_boxed(md)) for md in entries]
    split = [md.chunks for md, box in zip(entries, boxed, strict=True) if box]
    table = table_of(names, paths)
    table.update(
        dtypes=kinds,
        dtype=encode_column([number[name] for name in dtypes]),
        ndim=encode_column([len(md.size) for md in entries]),
        size=encode_column([n for md in entries for n in md.size]),
        requires_grad=encode_column([int(bool(md.properties.requires_grad)) for md in entries]),
    )
    if split:
        table["count"] = encode_column([len(md.chunks) for md in entries])
        table["offsets"] = encode_column([n for chunks in split for chunk in chunks for n in chunk.offsets])
        table["sizes"] = encode_column([n for chunks in split for chunk in chunks for n in chunk.sizes])
    if any(box and len(md.chunks) == 1 for md, box in zip(entries, boxed, strict=True)):
        table["boxed"] = encode_column(boxed)  # version 6
    indices = [(fqn, chunk.offsets) for fqn, md in zip(names, entries, strict=True) for chunk in md.chunks]
    table.update(_storage_columns(_records(items, indices), file_numbers, block_size))
    return table


def _key_record(
    fqn: str,
    md: Any,
    items: Mapping[tuple[str, torch.Size | None], Any],
    per_rank: dict[str, dict[int, Any]],
    file_numbers: dict[str, int],
    block_size: int,
) -> dict[str, Any]:
    """A ``keys`` record: a tensor's chunks, or an object kept with one copy per rank."""
    if isinstance(md, BytesStorageMetadata):
        copies = per_rank[fqn]
        ranks = sorted(copies)
        stored = [copies[rank] for rank in ranks]
        record: dict[str, Any] = {"type": "bytes", "count": len(ranks), "ranks": encode_column(ranks)}
        record["length"] = encode_column(list(map(_LOGICAL_BYTES, stored)))
    else:
        chunks = md.chunks
        stored = _records(items, [(fqn, chunk.offsets) for chunk in chunks])
        ndim = len(md.size)
        offsets, sizes = zip(*((c.offsets, c.sizes) for c in chunks), strict=True) if chunks else ((), ())
        record = {
            "type": "tensor",
            "dtype": dtype_name(md.properties.dtype),
            "size": list(md.size),
            "requires_grad": bool(md.properties.requires_grad),
            "count": len(chunks),
            "offsets": _dimension_columns(offsets, ndim),
            "sizes": _dimension_columns(sizes, ndim),
        }
    record.update(_storage_columns(stored, file_numbers, block_size))
    return record


def _dimension_columns(boxes: tuple[tuple[int, ...], ...], ndim: int) -> list[int | str]:
    """One COL per dimension from each chunk's offsets (or sizes)."""
    return [encode_column([box[d] for box in boxes]) for d in range(ndim)]


def _records(items: Mapping[tuple[str, torch.Size | None], Any], indices: list[tuple[str, Any]]) -> list[Any]:
    """The stored record of each ``(key, chunk offsets or None)``: a tuple's hash, not MetadataIndex's
    (a Python method), for 12k+ lookups."""
    try:
        return list(map(items.__getitem__, indices))
    except KeyError as missing:
        fqn, offsets = missing.args[0]
        raise CheckpointError(
            f"no rank reported writing key {fqn!r} (chunk at {list(offsets or ())}); the save cannot commit"
        ) from None


# attribute getters (C loops over the objects table's thousands of records); a codec by its value's
# string: an Enum member's hash is a Python method
_CODEC, _FILE, _OFFSET, _BLOCK_SIZE, _BLOCKS = map(
    operator.attrgetter, ("codec._value_", "file", "offset", "block_size", "blocks")
)
_LOGICAL_BYTES = operator.attrgetter("logical_bytes")
_DIGESTS = operator.attrgetter("digests")
_SECOND = operator.itemgetter(1)
_CODEC_NUMBERS = {name: number for number, name in enumerate(CODECS)}


def _storage_columns(stored: list[Any], file_numbers: dict[str, int], block_size: int) -> dict[str, Any]:
    codecs = list(map(_CODEC_NUMBERS.__getitem__, map(_CODEC, stored)))
    item_files = list(map(_FILE, stored))
    columns: dict[str, Any] = {
        "file": encode_column(list(map(file_numbers.__getitem__, item_files))),
        "at": encode_column(list(map(_OFFSET, stored))),
    }
    if any(codecs):
        columns["codec"] = encode_column(codecs)
    sizes = list(map(_BLOCK_SIZE, stored))
    if sizes.count(block_size) != len(sizes):
        columns["block_size"] = encode_column(sizes)
    # (stored length, crc) of every block in turn
    columns["crc32c"] = encode_packed(map(_SECOND, itertools.chain.from_iterable(map(_BLOCKS, stored))), "I")
    if any(codecs):
        columns["stored_lengths"] = encode_packed([n for item in stored for n, _ in item.blocks])
    digests = list(map(_DIGESTS, stored))
    if digests and None not in digests:  # version 7: every block's content digest, as 4 entries of 4 bytes
        columns["digests"] = encode_packed(array.array(_TYPECODES["I"], b"".join(digests)), "I")
    inline = [b64(item.inline) for item, file in zip(stored, item_files, strict=True) if file == ""]
    if inline:
        columns["inline"] = inline
    return columns
