"""One fragment of a save without a coordinator as rows of numpy columns, for the column merge
(``fragment_columns``): an entry per stored item (its key, rank, file, offset, codec, block size,
length and block count), its blocks' CRC32Cs and stored lengths flat, and each chunk's box.

Reading checks what joining the rows of many fragments needs (entry counts, file numbers within the
fragment's own files, boxes inside their tensors, volumes within int64); the values the merged
document shows are checked when it is decoded. The ranks of one mesh write the same key columns in
every fragment: ``Repeats`` decodes a repeated column once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio.config import is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format import fragments
from ckptio.format.names import FRAGMENT_VERSION, dtype_name
from ckptio.format.records import Header, created_unix
from ckptio.format.rules import check_shape
from ckptio.format.v3 import crc_column, decode_array
from ckptio.format.v3_decode import decode_files, schema, table_dtypes, table_names

#: A fragment's fields that are not its header's.
_NOT_HEADER = frozenset({"files", "block_size", "planner_data", "keys", "tensors", "objects", "fragment"})
#: A float64 product of a shape's dimensions below this proves its int64 product cannot overflow.
_SAFE_VOLUME = float(1 << 62)


@dataclasses.dataclass
class Rows:
    """Stored items as columns: one entry per item, its blocks' CRC32Cs and stored lengths flat (item
    after item), and each tensor chunk's box as a row of a matrix as wide as the widest key."""

    key: np.ndarray  # the key's number, across fragments (numbered by the merge)
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
    inline: np.ndarray | None  # the base64 of each item kept inline (``file`` 0); None where none is

    @functools.cached_property
    def first_block(self) -> np.ndarray:
        """Each item's first block's position in ``crc`` (a fragment's own rows rarely need it)."""
        return np.cumsum(self.blocks) - self.blocks

    def block_indices(self, rows: np.ndarray) -> np.ndarray:
        """The positions in ``crc`` and ``lengths`` of the blocks of ``rows``, in turn."""
        counts = self.blocks[rows]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(self.first_block[rows], counts) + within


@dataclasses.dataclass
class TableKeys:
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
    shapes: list[tuple[int, ...]] | None = None  # per key


class Repeats:
    """What the fragments of one save repeat, decoded once: a column's array where its text repeats
    the last one of that field (the ranks of one mesh write the same key columns, often the same
    offsets, sizes and file positions), a tensors table's keys, a header's fields."""

    #: Distinct tensors tables kept (fragments of a mesh repeat a few: with tensor parallelism, a key
    #: replicated across its group is written by one rank of it, so neighbours list different keys).
    KEPT_TABLES = 256

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, int, np.ndarray]] = {}
        self._tables: dict[tuple, TableKeys] = {}
        self._header: tuple[dict, Header] | None = None

    def __call__(
        self, field: str, value: Any, count: int, what: str, decode: Callable[..., np.ndarray] = decode_array
    ) -> np.ndarray:
        last = self._last.get(field)
        if last is not None and last[1] == count and type(last[0]) is type(value) and last[0] == value:
            return last[2]
        values = decode(value, count, what)
        values.flags.writeable = False  # shared by every fragment that repeats the text
        self._last[field] = (value, count, values)
        return values

    def header(self, doc: dict, files: dict[str, int], writers: dict[str, int], where: str) -> Header:
        """The fragment's header (``Header.from_json``), the last one's with this one's files and time
        where every other field repeats it."""
        fields = {name: value for name, value in doc.items() if name not in _NOT_HEADER}
        created = fields.pop("created_unix", 0.0)
        fields = _typed(fields)
        if self._header is not None and self._header[0] == fields:
            time = created_unix(created, where)
            return dataclasses.replace(self._header[1], files=files, writer_ranks=writers, created_unix=time)
        header = Header.from_json(doc, where, checked_files=(files, writers))
        self._header = (fields, header)
        return header

    def shapes(self, table: dict, where: str) -> TableKeys:
        """A tensors table's keys (``_tensor_keys``): the same object for every fragment whose key
        columns repeat an earlier one's."""
        raw = _typed([table.get(field) for field in ("dtype", "ndim", "size", "requires_grad", "boxed")])
        try:
            found = (tuple(table["keys"]), tuple(table["dtypes"]), raw)
            keys = self._tables.get(found)
        except (KeyError, TypeError):  # a table not of the schema (unhashable): decoded (and refused) below
            return _tensor_keys(table, self, where)
        if keys is not None and keys.paths == table.get("paths"):
            return keys
        keys = _tensor_keys(table, self, where)
        if len(self._tables) >= self.KEPT_TABLES:
            self._tables.clear()
        self._tables[found] = keys
        return keys


def _typed(value: Any) -> Any:
    """A parsed JSON value as a key that tells its types apart (``False == 0`` and ``1.0 == 1`` in
    Python; a field the decoder refuses as a bool or a float must not match a cached valid one)."""
    if isinstance(value, dict):
        return (dict, tuple((name, _typed(item)) for name, item in value.items()))
    if isinstance(value, list):
        return (list, tuple(map(_typed, value)))
    return (type(value), value)


def _check_path_codes(table: dict, where: str) -> None:
    """A table's ``paths`` codes are null or lists of integers (their values are checked when the merged
    document is decoded): fragments' codes are compared with ``==``, where ``True`` would pass for 1."""
    codes = [code for code in table.get("paths") or () if code is not None]
    if not set(map(type, codes)) <= {list} or not set(map(type, itertools.chain.from_iterable(codes))) <= {int}:
        raise CheckpointFormatError(f"{where}: 'paths' must hold, per key, null or a list of part counts")


# ---------------------------------------------------------------------------------------
# One fragment's columns


@dataclasses.dataclass
class FragmentRows:
    """One fragment: its record, header and data files, and its tables' rows and keys."""

    name: str
    where: str
    info: fragments.FragmentInfo
    header: Header
    files: tuple[str, ...]
    tables: list[tuple[Rows, TableKeys]]


def read_fragment(name: str, where: str, doc: dict, columns: Repeats) -> FragmentRows:
    with schema(where, "the fragment"):
        info = fragments.FragmentInfo.from_json(doc.get(fragments.FRAGMENT_FIELD), where)
        files, sizes, writers = decode_files(doc["files"], FRAGMENT_VERSION, where)
        header = columns.header(doc, sizes, writers, where)
        default_block = doc.get("block_size")
        if default_block is not None and not is_block_size(default_block):
            raise CheckpointFormatError(f"{where}: 'block_size' {default_block!r:.40} is not a valid block size")
        tables = []
        for name_of, read_table in (("tensors", _tensor_rows), ("objects", _object_rows)):
            if doc.get(name_of) is not None:
                at = f"{where}: {name_of} table"
                tables.append(read_table(doc[name_of], name_of, info.rank, len(files), default_block, columns, at))
    return FragmentRows(name, where, info, header, files, tables)


def _tensor_keys(table: dict, columns: Repeats, where: str) -> TableKeys:
    """A fragment's tensors table's keys: names, dtypes, shapes, paths, checked."""
    names = table_names(table, where)
    count = len(names)
    kinds, dtypes = table_dtypes(table, where)
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
    flat, ends = size.tolist(), np.cumsum(ndim).tolist()
    shapes = [tuple(flat[end - n : end]) for n, end in zip(ndim.tolist(), ends, strict=True)]
    paths = table.get("paths")
    return TableKeys(names, paths, True, key_dtypes, size, ndim, grads, itemsize, in_box, starts, shapes)


def _tensor_rows(
    table: dict, table_name: str, rank: int, files: int, default_block: Any, columns: Repeats, where: str
) -> tuple[Rows, TableKeys]:
    """A fragment's tensors table (one chunk per key: ``columnar``) as rows, a chunk each."""
    keys = columns.shapes(table, where)
    _check_path_codes(table, where)
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
    rows = _storage_rows(table, table_name, rank, volume * keys.itemsize, default_block, files, columns, where)
    rows.offsets, rows.sizes = _padded(offsets, ndim), _padded(sizes, ndim)
    return rows, keys


def _object_rows(
    table: dict, table_name: str, rank: int, files: int, default_block: Any, columns: Repeats, where: str
) -> tuple[Rows, TableKeys]:
    names = table_names(table, where)
    _check_path_codes(table, where)
    logical = columns(f"{table_name} length", table["length"], len(names), f"{where}: length")
    rows = _storage_rows(table, table_name, rank, logical, default_block, files, columns, where)
    return rows, TableKeys(names, table.get("paths"), False)


def _storage_rows(
    table: dict,
    table_name: str,
    rank: int,
    logical: np.ndarray,
    default_block: Any,
    files: int,
    columns: Repeats,
    where: str,
) -> Rows:
    """The storage columns of a table's ``len(logical)`` items (``v3_decode._storage_columns_of``'s
    schema; their values are checked when the merged document is decoded)."""
    count = len(logical)
    kind = f"{table_name} "  # each table's columns repeat those of the same table in the last fragment
    file = columns(kind + "file", table["file"], count, f"{where}: file")
    if count and file.max() > files:
        raise CheckpointFormatError(f"{where}: 'file' must number one of the fragment's {files} data files")
    inline = None
    strings = table.get("inline", [])
    if strings or (count and file.min() == 0):
        in_document = file == 0
        if not isinstance(strings, list) or len(strings) != int(in_document.sum()):
            raise CheckpointFormatError(f"{where}: 'inline' must hold one base64 string per inline item")
        inline = np.full(count, None, dtype=object)
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
    crc = columns(kind + "crc32c", table["crc32c"], total, f"{where}: crc32c (one per block)", _crcs)
    compressed = bool(codec.any())
    if compressed != ("stored_lengths" in table):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    lengths = None
    if compressed:
        what = f"{where}: stored_lengths"
        lengths = columns(kind + "stored_lengths", table["stored_lengths"], total, what, _packed)
    boxes = np.zeros((count, 0), dtype=np.int64)
    unnumbered = np.zeros(count, dtype=np.int64)  # the keys are numbered across fragments (_Keys)
    ranks = np.full(count, rank, dtype=np.int64)
    return Rows(unnumbered, ranks, file, at, codec, block_size, logical, blocks, boxes, boxes, crc, lengths, inline)


def _crcs(value: Any, count: int, what: str) -> np.ndarray:
    return crc_column(value, count, what).to_numpy()


def _packed(value: Any, count: int, what: str) -> np.ndarray:
    return decode_array(value, count, what, packed_only=True)


def _padded(flat: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Each row's ``ndim`` entries of ``flat`` (rows in turn) as a row of a matrix, zeros after them."""
    width = int(ndim.max()) if len(ndim) else 0
    out = np.zeros((len(ndim), width), dtype=np.int64)
    out[np.arange(width) < ndim[:, None]] = flat
    return out


def join_rows(parts: list[Rows]) -> Rows:
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
    inline = None
    if any(p.inline is not None for p in parts):
        inline = np.concatenate([p.inline if p.inline is not None else np.full(len(p.key), None) for p in parts])
    columns = ("key", "rank", "file", "at", "codec", "block_size", "logical", "blocks", "crc")
    joined = {name: np.concatenate([getattr(p, name) for p in parts] or [np.zeros(0, np.int64)]) for name in columns}
    return Rows(**joined, offsets=offsets, sizes=sizes, lengths=lengths, inline=inline)


def _raw_lengths(rows: Rows) -> np.ndarray:
    """Every block's length where items are stored raw: whole blocks, then the item's rest."""
    item = np.repeat(np.arange(len(rows.blocks)), rows.blocks)
    index = np.arange(len(item)) - np.repeat(rows.first_block, rows.blocks)
    return np.minimum(rows.block_size[item], rows.logical[item] - index * rows.block_size[item])
