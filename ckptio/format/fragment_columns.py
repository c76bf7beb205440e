"""The merge of a complete fragment set column by column: ``fragments.merge``'s rule at thousands of ranks.

``fragments.merge`` joins decoded item records, ~20 us per item in Python (6.6 s for the 231,366
items of 1,024 ranks x 8 layers of FSDP, where torch unpickles its metadata in 2.8 s). Here each
fragment's tables become numpy arrays (``fragment_rows``, which checks what joining them needs), the
arrays of all fragments are joined, and the merged document is encoded from them. What the merged
document shows (every box, span, codec, block length and path) is checked once, when it is decoded
like any ``ckptio.json``; what it cannot show is checked here, as ``fragments.merge`` checks it: one
save, every rank once, a key stored alike by every rank, a data file named once, copies of an item
equal (objects that differ kept per rank), every replica stored by its writer. For the same fragments
both merges write the same document.

It takes fragments of the shape a save of one chunk per key writes (``columnar``): tables only (no
``keys`` record), no block digests or references of incremental saves, planner data as paths. A set
with any other fragment is merged by ``fragments.merge``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from ckptio.config import is_block_size
from ckptio.format import fragments
from ckptio.format.fragment_rows import FragmentRows, Repeats, Rows, TableKeys, join_rows, read_fragment
from ckptio.format.names import FRAGMENT_VERSION, SPREAD_KEYS_VERSION
from ckptio.format.rules import check_inline_bytes, check_spans, decode_inline
from ckptio.format.v3 import TABLE_MAX_CHUNKS, encode_array, encode_files, encode_packed_array, table_of
from ckptio.format.v3_decode import decode_path


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
        self.signature: list[tuple] = []  # (tensor, dtype, shape, path) as first met

    def numbers(self, table: TableKeys, where: str) -> np.ndarray:
        """The numbers of a table's keys, each checked against (or added as) the key met first."""
        count = len(table.names)
        paths = table.paths or [None] * count
        dtypes = table.dtypes or [None] * count
        shapes = table.shapes or [None] * count
        grads = table.requires_grad.tolist() if table.tensor else [None] * count
        out = []
        for fqn, dtype, shape, grad, path in zip(table.names, dtypes, shapes, grads, paths, strict=True):
            number = self.number.get(fqn)
            if number is None or self.signature[number] != (table.tensor, dtype, shape, path):
                number = self._number(fqn, table.tensor, dtype, shape, grad, path, where)
            out.append(number)
        return np.array(out, dtype=np.int64)

    def _number(self, fqn: str, tensor: bool, dtype: Any, size: Any, grad: Any, path: Any, where: str) -> int:
        number = self.number.get(fqn)
        if number is None:
            self.signature.append((tensor, dtype, size, path))
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


def merge_columns(parsed: Iterable[tuple[str, str, dict]], where: str) -> dict[str, Any] | None:
    """The merged metadata document (ready for ``json.dumps``) of a complete set of fragments, each as
    ``(name, where it was read, its parsed document)``: the document ``versions.encode_metadata`` makes
    of ``fragments.merge``'s result; ``None`` as soon as a fragment is not ``columnar`` (the record
    merge takes the set). Only each fragment's rows are kept, not its document."""
    columns = Repeats()
    parts = []
    for name, read_from, doc in parsed:
        if not columnar(doc):
            return None
        parts.append(read_fragment(name, read_from, doc, columns))
    parts.sort(key=lambda p: p.info.rank)
    fragments.check_one_save([(p.name, p.where, p.info) for p in parts], where)
    names, file_sizes, writers = _data_files(parts)
    keys = _Keys()
    joined = []
    numbered: dict[int, tuple[TableKeys, np.ndarray]] = {}  # a table the cache gave several fragments
    position = {name: i + 1 for i, name in enumerate(names)}
    for part in parts:
        remap = np.array([0] + [position[name] for name in part.files], dtype=np.int64)
        for rows, table in part.tables:
            known = numbered.get(id(table))
            if known is None or known[0] is not table:
                known = numbered[id(table)] = (table, keys.numbers(table, part.where))
            rows.key = known[1]
            rows.file = remap[rows.file]
            joined.append(rows)
        part.tables = []  # joined below: each fragment's own arrays are not needed after
    rows = join_rows(joined)
    del joined
    wheres = [p.where for p in parts]
    kept, per_rank = _one_copy_each(rows, keys, wheres, where)
    _check_dropped_copies(rows, kept, per_rank, names, file_sizes, wheres)
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


def _data_files(parts: list[FragmentRows]) -> tuple[list[str], dict[str, int], dict[str, int]]:
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
# Across fragments


def _one_copy_each(rows: Rows, keys: _Keys, wheres: list[str], where: str) -> tuple[np.ndarray, dict[int, np.ndarray]]:
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


def _check_dropped_copies(
    rows: Rows,
    kept: np.ndarray,
    per_rank: dict[int, np.ndarray],
    names: list[str],
    sizes: dict[str, int],
    wheres: list[str],
) -> None:
    """The copies the merge drops lie inside their data files or hold their bytes inline, as the record
    merge checks every fragment's items: the merged document shows only the kept ones."""
    dropped = np.ones(len(rows.key), dtype=bool)
    dropped[kept] = False
    for group in per_rank.values():
        dropped[group] = False
    dropped = np.flatnonzero(dropped)
    if not len(dropped):
        return
    if rows.lengths is None:
        stored = rows.logical[dropped]
    else:
        ends = np.concatenate([[0], np.cumsum(rows.lengths)])
        first = rows.first_block[dropped]
        stored = ends[first + rows.blocks[dropped]] - ends[first]
    file, at = rows.file[dropped], rows.at[dropped]
    capacity = np.array([0] + [sizes[name] for name in names], dtype=np.int64)[file]
    outside = (file > 0) & ((stored > capacity) | (at > capacity - stored))
    for i in np.flatnonzero(outside)[:1].tolist():
        where = wheres[int(rows.rank[dropped[i]])]
        check_spans([int(file[i])], [int(at[i])], [int(stored[i])], names, [sizes[name] for name in names], where)
    for i in np.flatnonzero(file == 0).tolist():
        where = wheres[int(rows.rank[dropped[i]])]
        check_inline_bytes(decode_inline(rows.inline[dropped[i]], where), int(stored[i]), where)


def _differs(rows: Rows, copies: np.ndarray, originals: np.ndarray) -> np.ndarray:
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


def _value(rows: Rows, row: int) -> tuple:
    """What decides that two copies of an item hold the same value."""
    blocks = rows.block_indices(np.array([row]))
    lengths = tuple(rows.lengths[blocks].tolist()) if rows.lengths is not None else None
    crcs = tuple(rows.crc[blocks].tolist())
    return (int(rows.codec[row]), int(rows.block_size[row]), int(rows.logical[row]), crcs, lengths)


def _check_replicas(parts: list[FragmentRows], rows: Rows, kept: np.ndarray, keys: _Keys, where: str) -> None:
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
    rows: Rows,
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
    numbers: np.ndarray, table_rows: np.ndarray, count: np.ndarray, keys: _Keys, rows: Rows, paths: dict, encode: Any
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

    def __init__(self, rows: Rows, block_size: int):
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
        if rows.inline is not None:
            inline = rows.inline[selected[rows.file[selected] == 0]]
            if len(inline):
                columns["inline"] = inline.tolist()
        return columns
