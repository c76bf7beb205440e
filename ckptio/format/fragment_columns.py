"""The merge of a complete fragment set column by column: ``fragments.merge``'s rule at thousands of ranks.

``fragments.merge`` joins decoded item records, ~20 us per item in Python (6.6 s for the 231,366
items of 1,024 ranks x 8 layers of FSDP, where torch unpickles its metadata in 2.8 s). Here each
fragment's tables become numpy arrays, the arrays of all fragments are joined, and the merged document
is encoded from them. What the merged document shows (every box, span, codec, block length and path)
is checked once, when it is decoded like any ``ckptio.json``; what it cannot show is checked here, as
``fragments.merge`` checks it: one save, every rank once, a key stored alike by every rank, a data file
named once, copies of an item equal (objects that differ kept per rank), every replica stored by its
writer; and what the columns must satisfy to be joined (entry counts, file numbers, boxes inside their
tensors). For the same fragments both merges write the same document.

It takes fragments of the shape a save of one chunk per key writes (``columnar``): tables only (no
``keys`` record), no block digests or references of incremental saves, planner data as paths. A set
with any other fragment is merged by ``fragments.merge``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ckptio.config import is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format import fragments
from ckptio.format.names import FRAGMENT_VERSION, SPREAD_KEYS_VERSION, dtype_from_name, dtype_name
from ckptio.format.records import Header
from ckptio.format.rules import check_shape
from ckptio.format.v3 import (
    TABLE_MAX_CHUNKS,
    crc_column,
    decode_array,
    encode_array,
    encode_files,
    encode_packed_array,
    table_of,
)
from ckptio.format.v3_decode import decode_files, decode_path, schema, table_names

#: A float64 product of a shape's dimensions below this proves its int64 product cannot overflow.
_SAFE_VOLUME = float(1 << 62)


def columnar(doc: Any) -> bool:
    """Whether a parsed fragment is of the shape this merge takes (else ``fragments.merge`` takes the set)."""
    if not isinstance(doc, dict) or doc.get("format_version") != FRAGMENT_VERSION or doc.get("keys") != {}:
        return False
    if "extents" in doc or "chain" in doc or doc.get("planner_data") != "paths":
        return False
    files, config = doc.get("files"), doc.get("config")
    if not isinstance(files, dict) or "bases" in files or not isinstance(config, dict):
        return False
    if not is_block_size(config.get("max_block_size")):
        return False
    tables = [doc[name] for name in ("tensors", "objects") if doc.get(name) is not None]
    if not all(isinstance(t, dict) and "digests" not in t for t in tables):
        return False
    count = (doc.get("tensors") or {}).get("count", 1)
    return type(count) is int and count == 1


@dataclasses.dataclass
class _Rows:
    """Stored items as columns: one entry per item, its blocks' CRC32Cs and stored lengths flat (item
    after item), and each tensor chunk's box as a row of a matrix as wide as the widest key."""

    key: np.ndarray  # the key's number (``_Keys``)
    rank: np.ndarray
    file: np.ndarray  # 1 + the data file's position (in the fragment, then in the merged document)
    at: np.ndarray
    codec: np.ndarray
    block_size: np.ndarray
    logical: np.ndarray
    blocks: np.ndarray  # blocks per item
    offsets: np.ndarray  # (items, width), zeros past an item's dimensions
    sizes: np.ndarray
    crc: np.ndarray
    lengths: np.ndarray | None  # present where some item is compressed
    inline: np.ndarray  # (objects) the base64 of each item kept inline (``file`` 0), else None

    def __post_init__(self) -> None:
        self.first_block = np.cumsum(self.blocks) - self.blocks  # each item's first in ``crc``

    def block_indices(self, rows: np.ndarray) -> np.ndarray:
        """The positions in ``crc`` and ``lengths`` of the blocks of ``rows``, in turn."""
        counts = self.blocks[rows]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(self.first_block[rows], counts) + within


@dataclasses.dataclass
class _TableKeys:
    """A fragment table's keys and what each must share with every other fragment's; for tensors, also
    what their chunks' rows are computed from (per key: bytes per element; per dimension: where each
    key's start in ``size``, and whether its chunk is boxed)."""

    names: list[str]
    paths: list[Any] | None
    tensor: bool
    dtypes: list[str] | None = None  # per key, tensors only
    size: np.ndarray | None = None  # every key's dimensions in turn
    ndim: np.ndarray | None = None
    requires_grad: np.ndarray | None = None
    itemsize: np.ndarray | None = None
    in_box: np.ndarray | None = None  # per entry of ``size``: its key's chunk is boxed
    starts: np.ndarray | None = None

    def same_as(self, other: _TableKeys | None) -> bool:
        """Whether every key, dtype, shape and path is the other table's (so numbered as it was)."""
        if other is None or self is other:
            return other is not None
        if self.names != other.names or self.paths != other.paths or self.dtypes != other.dtypes:
            return False
        return not self.tensor or (np.array_equal(self.size, other.size) and np.array_equal(self.ndim, other.ndim))


class _Columns:
    """Decodes a merge's columns, reusing the array decoded last for the same field where its text
    repeats: the ranks of one mesh write the same key columns (and often the same offsets, sizes and
    file positions) in every fragment."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, int, np.ndarray]] = {}
        self._shapes: tuple[tuple, _TableKeys] | None = None

    def __call__(self, field: str, value: Any, count: int, what: str, packed_only: bool = False) -> np.ndarray:
        last = self._last.get(field)
        if last is not None and last[1] == count and type(last[0]) is type(value) and last[0] == value:
            return last[2]
        if field.endswith("crc32c"):
            values = crc_column(value, count, what).to_numpy()
        else:
            values = decode_array(value, count, what, packed_only)
        values.flags.writeable = False  # shared by every fragment that repeats the text
        self._last[field] = (value, count, values)
        return values

    def shapes(self, table: dict, where: str) -> _TableKeys:
        """A tensors table's keys (``_tensor_keys``), the previous fragment's where their columns repeat."""
        fields = ("keys", "paths", "dtypes", "dtype", "ndim", "size", "requires_grad", "boxed")
        raw = tuple(table.get(field) for field in fields)
        if self._shapes is not None and self._shapes[0] == raw:
            return self._shapes[1]
        keys = _tensor_keys(table, self, where)
        self._shapes = (raw, keys)
        return keys


class _Keys:
    """Every key, numbered in the order the record merge meets them (rank by rank: tensors, then
    objects), with what every fragment must store alike: tensor or object, dtype and shape, path."""

    def __init__(self) -> None:
        self.number: dict[str, int] = {}
        self.names: list[str] = []
        self.tensor: list[bool] = []
        self.dtype: list[str | None] = []
        self.size: list[tuple[int, ...]] = []
        self.requires_grad: list[int] = []
        self.path: list[Any] = []

    def numbers(self, table: _TableKeys, where: str) -> np.ndarray:
        out = np.empty(len(table.names), dtype=np.int64)
        paths = table.paths or [None] * len(table.names)
        ends = np.cumsum(table.ndim).tolist() if table.tensor else None
        for i, fqn in enumerate(table.names):
            size = dtype = grad = None
            if table.tensor:
                size = tuple(table.size[ends[i] - int(table.ndim[i]) : ends[i]].tolist())
                dtype, grad = table.dtypes[i], int(table.requires_grad[i])
            out[i] = self._number(fqn, table.tensor, dtype, size, grad, paths[i], where)
        return out

    def _number(self, fqn: str, tensor: bool, dtype: Any, size: Any, grad: Any, path: Any, where: str) -> int:
        number = self.number.get(fqn)
        if number is None:
            number = self.number[fqn] = len(self.names)
            self.names.append(fqn)
            self.tensor.append(tensor)
            self.dtype.append(dtype)
            self.size.append(size)
            self.requires_grad.append(grad)
            self.path.append(None if isinstance(path, list) and path.count(1) == len(path) else path)
            return number
        if self.tensor[number] != tensor:
            fragments.refuse_kinds(fqn, tensor, self.tensor[number], where)
        if tensor and (self.size[number] != size or self.dtype[number] != dtype):
            fragments.refuse_shapes(fqn, (dtype, size), (self.dtype[number], self.size[number]), where)
        known = self.path[number]
        if path != known and not (known is None and isinstance(path, list) and path.count(1) == len(path)):
            keys = len(self.names)
            first, other = decode_path(fqn, known, keys, where), decode_path(fqn, path, keys, where)
            if first != other:
                fragments.refuse_paths(fqn, other, first, where)
        return number


@dataclasses.dataclass
class _Part:
    """One fragment: its record, header and data files, and its tables' rows and keys."""

    name: str
    where: str
    info: fragments.FragmentInfo
    header: Header
    files: tuple[str, ...]
    tables: list[tuple[_Rows, _TableKeys]]


def merge_columns(parsed: list[tuple[str, str, dict]], where: str) -> dict[str, Any]:
    """The merged metadata document (ready for ``json.dumps``) of a complete set of ``columnar``
    fragments, each as ``(name, where it was read, its parsed document)``: the document
    ``versions.encode_metadata`` makes of ``fragments.merge``'s result."""
    columns = _Columns()
    parts = sorted((_read(*fragment, columns) for fragment in parsed), key=lambda p: p.info.rank)
    fragments.check_one_save([(p.name, p.where, p.info) for p in parts], where)
    names, file_sizes, writers = _data_files(parts)
    keys = _Keys()
    joined, before = [], {}
    position = {name: i + 1 for i, name in enumerate(names)}
    for part in parts:
        remap = np.array([0] + [position[name] for name in part.files], dtype=np.int64)
        for rows, table in part.tables:
            previous = before.get(table.tensor)
            rows.key = previous[1] if table.same_as(previous and previous[0]) else keys.numbers(table, part.where)
            before[table.tensor] = (table, rows.key)
            rows.file = remap[rows.file]
            joined.append(rows)
    rows = _join(joined)
    kept, per_rank = _one_copy_each(rows, keys, [p.where for p in parts], where)
    if any(p.info.replicas for p in parts):
        _check_replicas(parts, rows, kept, keys, where)
    first = parts[0].header
    header = dataclasses.replace(
        first,
        files=file_sizes,
        writer_ranks=writers,
        world_size=len(parts),
        created_unix=max(p.header.created_unix for p in parts),
        mesh=next((p.header.mesh for p in parts if p.header.mesh), None),
        format_version=SPREAD_KEYS_VERSION if any("/" in name for name in names) else 4,
    )
    doc = header.to_json()
    doc.update(_document(rows, kept, per_rank, keys, names, file_sizes, writers, first.config.max_block_size))
    del doc["writer_ranks"]  # in 'files'
    return doc


def _data_files(parts: list[_Part]) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """Every fragment's data files, sorted by name (the merged document's numbering), with their sizes
    and writers; a file two fragments name is refused."""
    sizes: dict[str, int] = {}
    writers: dict[str, int] = {}
    for part in parts:
        for name in part.files:
            if name in sizes:
                fragments.refuse_file_twice(name, writers[name], part.where)
            sizes[name] = part.header.files[name]
            writers[name] = part.header.writer_ranks.get(name, part.info.rank)
    return sorted(sizes), sizes, writers


# ---------------------------------------------------------------------------------------
# One fragment's columns


def _read(name: str, where: str, doc: dict, columns: _Columns) -> _Part:
    with schema(where, "the fragment"):
        info = fragments.FragmentInfo.from_json(doc.get(fragments.FRAGMENT_FIELD), where)
        files, sizes, writers = decode_files(doc["files"], FRAGMENT_VERSION, where)
        header = Header.from_json(doc, where, checked_files=(sizes, writers))
        default_block = doc.get("block_size")
        if default_block is not None and not is_block_size(default_block):
            raise CheckpointFormatError(f"{where}: 'block_size' {default_block!r:.40} is not a valid block size")
        tables = []
        for name_of, read_table in (("tensors", _tensor_rows), ("objects", _object_rows)):
            if doc.get(name_of) is not None:
                at = f"{where}: {name_of} table"
                tables.append(read_table(doc[name_of], info.rank, len(files), default_block, columns, at))
    return _Part(name, where, info, header, files, tables)


def _tensor_keys(table: dict, columns: _Columns, where: str) -> _TableKeys:
    """A fragment's tensors table's keys: names, dtypes, shapes, paths, checked."""
    names = table_names(table, where)
    count = len(names)
    kinds = table["dtypes"]
    if not isinstance(kinds, list) or len(set(kinds)) != len(kinds):
        raise CheckpointFormatError(f"{where}: 'dtypes' must be a list of distinct dtype names")
    dtypes = [dtype_from_name(kind, where) for kind in kinds]
    number = columns("dtype", table["dtype"], count, f"{where}: dtype")
    ndim = columns("ndim", table["ndim"], count, f"{where}: ndim")
    grads = columns("requires_grad", table["requires_grad"], count, f"{where}: requires_grad")
    boxed = columns("boxed", table.get("boxed", 0), count, f"{where}: boxed")
    if count and (number.max() >= len(kinds) or grads.max() > 1 or boxed.max() > 1 or ndim.max() > 64):
        raise CheckpointFormatError(
            f"{where}: 'dtype' must index 'dtypes', 'requires_grad' and 'boxed' hold 0 or 1, 'ndim' be at most 64"
        )
    size = columns("size", table["size"], int(ndim.sum()), f"{where}: size")
    itemsize = np.array([d.itemsize for d in dtypes] or [0], dtype=np.int64)[number]
    starts = np.cumsum(ndim) - ndim
    shaped = ndim > 0
    # a key's volume must fit int64 (rules.check_shape) before a chunk's is computed in int64
    rough = np.ones(count)
    if shaped.any():
        rough[shaped] = np.multiply.reduceat(np.where(size > 0, size, 1).astype(np.float64), starts[shaped])
    for i in np.flatnonzero(rough * itemsize >= _SAFE_VOLUME).tolist():
        check_shape(size[starts[i] : starts[i] + ndim[i]].tolist(), int(itemsize[i]), f"{where}: key {names[i]!r:.80}")
    names_of = [dtype_name(d) for d in dtypes]
    key_dtypes = [names_of[n] for n in number.tolist()]
    in_box = np.repeat(boxed.astype(bool), ndim)
    paths = table.get("paths")
    return _TableKeys(names, paths, True, key_dtypes, size, ndim, grads, itemsize, in_box, starts)


def _tensor_rows(
    table: dict, rank: int, files: int, default_block: Any, columns: _Columns, where: str
) -> tuple[_Rows, _TableKeys]:
    """A fragment's tensors table (one chunk per key: ``columnar``) as rows, a chunk each."""
    keys = columns.shapes(table, where)
    size, ndim, in_box = keys.size, keys.ndim, keys.in_box
    box_entries = int(in_box.sum())
    offsets = np.zeros_like(size)
    offsets[in_box] = columns("offsets", table.get("offsets", 0), box_entries, f"{where}: offsets")
    sizes = size.copy()
    sizes[in_box] = columns("sizes", table.get("sizes", 0), box_entries, f"{where}: sizes")
    if bool((sizes > size).any() or (offsets > size - sizes).any()):
        raise CheckpointFormatError(f"{where}: a chunk lies outside its tensor's shape")
    shaped = ndim > 0
    volume = np.ones(len(ndim), dtype=np.int64)
    if shaped.any():
        volume[shaped] = np.multiply.reduceat(sizes, keys.starts[shaped])
    rows = _storage_rows(table, rank, volume * keys.itemsize, default_block, files, columns, where)
    rows.offsets, rows.sizes = _padded(offsets, ndim), _padded(sizes, ndim)
    return rows, keys


def _object_rows(
    table: dict, rank: int, files: int, default_block: Any, columns: _Columns, where: str
) -> tuple[_Rows, _TableKeys]:
    names = table_names(table, where)
    logical = columns("object length", table["length"], len(names), f"{where}: length")
    rows = _storage_rows(table, rank, logical, default_block, files, columns, where)
    return rows, _TableKeys(names, table.get("paths"), False)


def _storage_rows(
    table: dict, rank: int, logical: np.ndarray, default_block: Any, files: int, columns: _Columns, where: str
) -> _Rows:
    """The storage columns of a table's ``len(logical)`` items (``v3_decode._storage_columns_of``'s
    schema; their values are checked when the merged document is decoded)."""
    count = len(logical)
    kind = "tensor " if table.get("dtypes") is not None else "object "
    file = columns(kind + "file", table["file"], count, f"{where}: file")
    if count and file.max() > files:
        raise CheckpointFormatError(f"{where}: 'file' must number one of the fragment's {files} data files")
    inline = np.full(count, None, dtype=object)
    in_document = file == 0
    strings = table.get("inline", [])
    if not isinstance(strings, list) or len(strings) != int(in_document.sum()):
        raise CheckpointFormatError(f"{where}: 'inline' must hold one base64 string per inline item")
    if strings:
        inline[in_document] = strings
    at = columns(kind + "at", table["at"], count, f"{where}: at")
    codec = columns(kind + "codec", table.get("codec", 0), count, f"{where}: codec")
    block_value = table.get("block_size", default_block)
    if block_value is None:
        raise CheckpointFormatError(f"{where} has no 'block_size' and the document gives no default")
    block_size = columns(kind + "block_size", block_value, count, f"{where}: block_size")
    if count and block_size.min() < 1:
        raise CheckpointFormatError(f"{where}: 'block_size' holds 0, which is not a valid block size")
    blocks = -(-logical // block_size)
    total = int(blocks.sum())
    crc = columns(kind + "crc32c", table["crc32c"], total, f"{where}: crc32c (one per block)")
    compressed = bool(codec.any())
    if compressed != ("stored_lengths" in table):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    lengths = None
    if compressed:
        what = f"{where}: stored_lengths"
        lengths = columns(kind + "stored_lengths", table["stored_lengths"], total, what, packed_only=True)
    boxes = np.zeros((count, 0), dtype=np.int64)
    unnumbered = np.zeros(count, dtype=np.int64)  # the keys are numbered across fragments (_Keys)
    ranks = np.full(count, rank, dtype=np.int64)
    return _Rows(unnumbered, ranks, file, at, codec, block_size, logical, blocks, boxes, boxes, crc, lengths, inline)


def _padded(flat: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Each row's ``ndim`` entries of ``flat`` (rows in turn) as a row of a matrix, zeros after them."""
    width = int(ndim.max()) if len(ndim) else 0
    out = np.zeros((len(ndim), width), dtype=np.int64)
    out[np.arange(width) < ndim[:, None]] = flat
    return out


def _join(parts: list[_Rows]) -> _Rows:
    """The rows of ``parts`` in turn (boxes widened to the widest; stored lengths of raw blocks made
    explicit where some part has compressed items)."""
    width = max((p.offsets.shape[1] for p in parts), default=0)
    count = sum(len(p.key) for p in parts)
    offsets, sizes = np.zeros((count, width), dtype=np.int64), np.zeros((count, width), dtype=np.int64)
    at = 0
    for part in parts:
        n, w = part.offsets.shape
        offsets[at : at + n, :w], sizes[at : at + n, :w] = part.offsets, part.sizes
        at += n
    lengths = None
    if any(p.lengths is not None for p in parts):
        lengths = np.concatenate([p.lengths if p.lengths is not None else _raw_lengths(p) for p in parts])
    columns = ("key", "rank", "file", "at", "codec", "block_size", "logical", "blocks", "crc", "inline")
    joined = {name: np.concatenate([getattr(p, name) for p in parts] or [np.zeros(0, np.int64)]) for name in columns}
    return _Rows(**joined, offsets=offsets, sizes=sizes, lengths=lengths)


def _raw_lengths(rows: _Rows) -> np.ndarray:
    """Every block's length where items are stored raw: whole blocks, then the item's rest."""
    item = np.repeat(np.arange(len(rows.blocks)), rows.blocks)
    index = np.arange(len(item)) - np.repeat(rows.first_block, rows.blocks)
    return np.minimum(rows.block_size[item], rows.logical[item] - index * rows.block_size[item])


# ---------------------------------------------------------------------------------------
# Across fragments


def _one_copy_each(rows: _Rows, keys: _Keys, wheres: list[str], where: str) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Of items several ranks stored (same key, same offsets), keep the lowest rank's where every copy
    is equal; keep objects whose copies differ per rank (``fragments._one_copy_each``'s rule). Returns
    the kept rows and, by key number, the rows of each object kept per rank."""
    count = len(rows.key)
    if not count:
        return np.arange(0), {}
    order = np.lexsort([rows.offsets[:, d] for d in reversed(range(rows.offsets.shape[1]))] + [rows.key])
    ordered_key, ordered_box = rows.key[order], rows.offsets[order]
    same = (ordered_key[1:] == ordered_key[:-1]) & (ordered_box[1:] == ordered_box[:-1]).all(axis=1)
    starts = np.concatenate([[True], ~same])
    first = np.empty(count, dtype=np.int64)
    first[order] = order[starts][np.cumsum(starts) - 1]  # each row's first copy (lexsort is stable)
    copies = np.flatnonzero(first != np.arange(count))
    if not len(copies):
        return np.arange(count), {}
    originals = first[copies]
    unequal_sizes = np.flatnonzero((rows.sizes[copies] != rows.sizes[originals]).any(axis=1))
    if len(unequal_sizes):
        copy, original = copies[unequal_sizes[0]], originals[unequal_sizes[0]]
        fqn, rank = keys.names[rows.key[copy]], rows.rank[copy]
        ndim = len(keys.size[rows.key[copy]])
        offsets, sizes = rows.offsets[copy, :ndim].tolist(), rows.sizes[copy, :ndim].tolist()
        fragments.refuse_sizes(fqn, offsets, sizes, rows.sizes[original, :ndim].tolist(), wheres[rank])
    differs = _differs(rows, copies, originals)
    per_rank: dict[int, np.ndarray] = {}
    for original in np.unique(originals[differs]).tolist():
        group = np.concatenate([[original], copies[originals == original]])
        number = int(rows.key[original])
        if keys.tensor[number]:
            values: dict[Any, list[int]] = {}
            for row in group.tolist():
                values.setdefault(_value(rows, row), []).append(int(rows.rank[row]))
            fragments.refuse_differing_tensor(keys.names[number], list(values.values()), where)
        per_rank[number] = group
    kept = first == np.arange(count)
    if per_rank:
        kept[np.concatenate(list(per_rank.values()))] = False
    return np.flatnonzero(kept), per_rank


def _differs(rows: _Rows, copies: np.ndarray, originals: np.ndarray) -> np.ndarray:
    """Whether each copy's stored value differs from its original's (``fragments._value_of``: codec,
    block size, length and every block's CRC32C and stored length)."""
    differs = (
        (rows.codec[copies] != rows.codec[originals])
        | (rows.block_size[copies] != rows.block_size[originals])
        | (rows.logical[copies] != rows.logical[originals])
    )
    one_block = ~differs & (rows.blocks[copies] == 1)
    a, b = rows.first_block[copies[one_block]], rows.first_block[originals[one_block]]
    unequal = rows.crc[a] != rows.crc[b]
    if rows.lengths is not None:
        unequal |= rows.lengths[a] != rows.lengths[b]
    differs[one_block] = unequal
    for i in np.flatnonzero(~differs & (rows.blocks[copies] > 1)).tolist():
        differs[i] = _value(rows, int(copies[i])) != _value(rows, int(originals[i]))
    return differs


def _value(rows: _Rows, row: int) -> tuple:
    """What decides that two copies of an item hold the same value."""
    blocks = rows.block_indices(np.array([row]))
    lengths = tuple(rows.lengths[blocks].tolist()) if rows.lengths is not None else None
    crcs = tuple(rows.crc[blocks].tolist())
    return (int(rows.codec[row]), int(rows.block_size[row]), int(rows.logical[row]), crcs, lengths)


def _check_replicas(parts: list[_Part], rows: _Rows, kept: np.ndarray, keys: _Keys, where: str) -> None:
    named = {replica.fqn for part in parts for replica in part.info.replicas}
    wanted = np.array([keys.number.get(fqn, -1) for fqn in named], dtype=np.int64)
    stored = set()
    for row in kept[np.isin(rows.key[kept], wanted)].tolist():
        number = int(rows.key[row])
        stored.add((keys.names[number], tuple(rows.offsets[row, : len(keys.size[number])].tolist())))
    fragments.check_replicas(parts, stored, where)


# ---------------------------------------------------------------------------------------
# The merged document


def _document(
    rows: _Rows,
    kept: np.ndarray,
    per_rank: dict[int, np.ndarray],
    keys: _Keys,
    names: list[str],
    file_sizes: dict[str, int],
    writers: dict[str, int],
    block_size: int,
) -> dict[str, Any]:
    """``v3.encode_document``'s fields for the merged keys: objects stored once and tensors of a few
    chunks (or one whole) in the tables, the other keys in ``keys`` records."""
    by_key = kept[np.argsort(rows.key[kept], kind="stable")]  # each key's chunks in rank order
    key_of = rows.key[by_key]
    count = np.bincount(key_of, minlength=len(keys.names))
    ends = np.cumsum(count)
    tensor = np.array(keys.tensor, dtype=bool)
    width = rows.offsets.shape[1]
    shape = np.zeros((len(keys.names), width), dtype=np.int64)
    for number in np.flatnonzero(tensor).tolist():
        shape[number, : len(keys.size[number])] = keys.size[number]
    whole = np.zeros(len(keys.names), dtype=bool)
    single = np.flatnonzero(count == 1)
    row = by_key[ends[single] - 1]
    whole[single] = (rows.offsets[row] == 0).all(axis=1) & (rows.sizes[row] == shape[single]).all(axis=1)
    tabled = tensor & (((count > 1) & (count <= TABLE_MAX_CHUNKS)) | whole)
    stored_once = ~tensor & (count == 1)
    paths = dict(zip(keys.names, keys.path, strict=True))
    encode = _StorageColumns(rows, block_size)

    records: dict[str, Any] = {}
    for number in np.flatnonzero(~tabled & ~stored_once).tolist():
        fqn = keys.names[number]
        if number in per_rank:
            group = per_rank[number]
            record: dict[str, Any] = {"type": "bytes", "count": len(group), "ranks": encode_array(rows.rank[group])}
            record["length"] = encode_array(rows.logical[group])
        else:
            group = by_key[ends[number] - count[number] : ends[number]]
            ndim = len(keys.size[number])
            record = {
                "type": "tensor",
                "dtype": keys.dtype[number],
                "size": list(keys.size[number]),
                "requires_grad": bool(keys.requires_grad[number]),
                "count": len(group),
                "offsets": [encode_array(rows.offsets[group, d]) for d in range(ndim)],
                "sizes": [encode_array(rows.sizes[group, d]) for d in range(ndim)],
            }
        record.update(encode(group))
        if paths[fqn] is not None:
            record["path"] = paths[fqn]
        records[fqn] = record
    doc: dict[str, Any] = {
        "files": encode_files(names, file_sizes, writers),
        "block_size": block_size,
        "planner_data": "paths" if keys.names else None,  # no keys: no planner data (as fragments.merge)
        "keys": records,
    }
    in_table = tabled[key_of]
    if tabled.any():
        doc["tensors"] = _tensor_table(np.flatnonzero(tabled), by_key[in_table], count, keys, rows, paths, encode)
    if stored_once.any():
        numbers = np.flatnonzero(stored_once)
        table = table_of([keys.names[n] for n in numbers.tolist()], paths)
        group = by_key[stored_once[key_of]]
        table["length"] = encode_array(rows.logical[group])
        table.update(encode(group))
        doc["objects"] = table
    return doc


def _tensor_table(
    numbers: np.ndarray, table_rows: np.ndarray, count: np.ndarray, keys: _Keys, rows: _Rows, paths: dict, encode: Any
) -> dict[str, Any]:
    """``v3._tensor_table`` of the keys ``numbers`` (whole, or of a few chunks) and their rows."""
    numbers_list = numbers.tolist()
    table = table_of([keys.names[n] for n in numbers_list], paths)
    dtypes = [keys.dtype[n] for n in numbers_list]
    kinds = sorted(set(dtypes))
    position = {name: i for i, name in enumerate(kinds)}
    table.update(
        dtypes=kinds,
        dtype=encode_array(np.array([position[name] for name in dtypes], dtype=np.int64)),
        ndim=encode_array(np.array([len(keys.size[n]) for n in numbers_list], dtype=np.int64)),
        size=encode_array(np.array([d for n in numbers_list for d in keys.size[n]], dtype=np.int64)),
        requires_grad=encode_array(np.array([keys.requires_grad[n] for n in numbers_list], dtype=np.int64)),
    )
    split = count[rows.key[table_rows]] > 1
    if split.any():
        boxed = table_rows[split]
        ndim = np.array([len(keys.size[n]) for n in rows.key[boxed].tolist()], dtype=np.int64)
        in_box = np.arange(rows.offsets.shape[1]) < ndim[:, None]
        table["count"] = encode_array(count[numbers])
        table["offsets"] = encode_array(rows.offsets[boxed][in_box])
        table["sizes"] = encode_array(rows.sizes[boxed][in_box])
    table.update(encode(table_rows))
    return table


class _StorageColumns:
    """``v3._storage_columns`` of a selection of rows."""

    def __init__(self, rows: _Rows, block_size: int):
        self.rows, self.block_size = rows, block_size

    def __call__(self, selected: np.ndarray) -> dict[str, Any]:
        rows = self.rows
        codecs = rows.codec[selected]
        columns: dict[str, Any] = {"file": encode_array(rows.file[selected]), "at": encode_array(rows.at[selected])}
        if codecs.any():
            columns["codec"] = encode_array(codecs)
        sizes = rows.block_size[selected]
        if not (sizes == self.block_size).all():
            columns["block_size"] = encode_array(sizes)
        blocks = rows.block_indices(selected)
        columns["crc32c"] = encode_packed_array(rows.crc[blocks], "I")
        if codecs.any():
            columns["stored_lengths"] = encode_packed_array(rows.lengths[blocks])
        inline = rows.inline[selected[rows.file[selected] == 0]]
        if len(inline):
            columns["inline"] = inline.tolist()
        return columns
