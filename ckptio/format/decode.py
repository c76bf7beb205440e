"""The one decoder of ckptio 1.0's metadata: a parsed JSON document into checked ``Tables``.

Each rule is applied once, to whole columns (numpy): entry counts, widths and base64 (``columns``),
kinds, dtypes and shapes, boxes inside their tensors and tiling them (``rules.check_chunks_tile``),
codecs, block sizes and lengths, spans inside data files, inline bytes, paths. A failure is a
``CheckpointFormatError`` naming the field and the first key (and item) that breaks the rule. No
declared number leads to an allocation larger than the document.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from ckptio.config import INT64_LIMIT, MAX_BLOCK_SIZE_LIMIT, ZSTD_MAX_RATIO, is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format.columns import PackedBlocks, crc_column, decode_array, decode_column
from ckptio.format.fragments import FragmentInfo
from ckptio.format.names import (
    CODECS,
    KEY_PREFIX_RULE,
    PLANE_ITEMSIZES,
    SAVE_ID,
    Codec,
    data_file_name,
    dtype_from_name,
    is_sibling_name,
    sibling_file_name,
)
from ckptio.format.records import VIRTUAL_PREFIX, Extent, Header
from ckptio.format.rules import (
    check_chunks_tile,
    check_list_index,
    check_planner_paths,
    check_shape,
    decode_inline,
    refuse_data_file_name,
)
from ckptio.format.tables import (
    FEATURES,
    FRAGMENT,
    INCREMENTAL,
    KEY_PREFIX,
    MAX_DIMS,
    MAX_RANK,
    OBJECT,
    PER_RANK,
    TENSOR,
    Tables,
    block_counts,
    logical_blocks,
    padded_shapes,
)

_SAVE_ID = re.compile(SAVE_ID)
_PLANES = CODECS.index(Codec.ZSTD_BYTEPLANES)
#: Entries of the ``digests`` column (4 bytes each) per block: 16 bytes.
DIGEST_ENTRIES = 4
_NONE, _NONE_2D = np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
_NONE.flags.writeable = _NONE_2D.flags.writeable = False


def decode_tables(
    doc: dict[str, Any], where: str, doc_bytes: int, cover: bool = True, decode_paths: bool = True
) -> Tables:
    """The checked tables of a version 8 document (``doc_bytes`` long). ``cover``: every tensor's items
    must cover it (not in a rank's fragment, which holds the chunks that rank wrote). Without
    ``decode_paths`` (a fragment to merge) path codes are only checked to be lists of integers: the merge
    compares them between fragments and the merged document's decode decodes each key's once (decoding
    them in each of 8,192 fragments took a sixth of their decode)."""
    return decode_documents([(doc, where, doc_bytes)], cover, decode_paths)[0]


def decode_documents(
    documents: list[tuple[dict[str, Any], str, int]], cover: bool = True, decode_paths: bool = True
) -> list[Tables]:
    """``decode_tables`` of each (document, where, bytes). Documents that repeat a layout of keys and
    tensors (the fragments of a save) have their item columns checked together, one array per column and a
    row per document: a fragment of a few dozen items spent most of its decode in ~40 numpy operations of
    its own. A document that breaks a rule is named, with the error its own decode raises (of documents
    of one layout, the first that breaks one)."""
    heads = []
    for doc, where, doc_bytes in documents:
        with schema_errors_named(where):
            heads.append(_head(doc, where, doc_bytes, decode_paths))
    groups: dict[int, list[_Head]] = {}
    for head in heads:
        groups.setdefault(id(head.layout), []).append(head)
    for group in groups.values():
        try:
            _items(group, cover)
        except Exception:
            for head in group:  # which document, and its error as its own decode words it: each alone
                with schema_errors_named(head.where):
                    _items([head], cover)
            raise
    for head in heads:
        with schema_errors_named(head.where):
            _blocks(head.tables, _table(head.doc, "blocks", head.where), head.file_sizes, head.doc_bytes,
                    f"{head.where}: blocks")  # fmt: skip
            if FRAGMENT in head.tables.features:
                head.tables.fragment = FragmentInfo.from_json(head.doc.get("fragment"), head.where)
    return [head.tables for head in heads]


class _Head(NamedTuple):
    """A document decoded up to its item columns."""

    doc: dict[str, Any]
    where: str
    doc_bytes: int
    tables: Tables
    layout: _Layout
    items: dict[str, Any]  # the document's items table
    file_sizes: np.ndarray


@contextlib.contextmanager
def schema_errors_named(where: str) -> Iterator[None]:
    """A document of the wrong shape (a string for a list, a missing field) a ``CheckpointFormatError``
    naming it."""
    try:
        yield
    except CheckpointFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError) as exc:
        raise CheckpointFormatError(f"{where} does not follow the ckptio metadata schema: {exc!r:.300}") from None


def _head(doc: dict[str, Any], where: str, doc_bytes: int, decode_paths: bool) -> _Head:
    features = _features(doc.get("features", []), where)
    for field, feature in (("fragment", FRAGMENT), ("chain", INCREMENTAL), ("extents", INCREMENTAL)):
        if doc.get(field) is not None and feature not in features:
            raise CheckpointFormatError(f"{where}: '{field}' belongs to feature {feature!r}, which it does not declare")
    names, sizes, writers = decode_files(doc.get("files"), features, where)
    files = dict(zip(names, sizes, strict=True))
    header = Header.from_json(doc, where, checked_files=(files, writers), features=tuple(sorted(features)))
    extents = decode_extents(doc.get("extents"), names, sizes, doc_bytes, where)
    all_files = names + tuple(extents)
    file_sizes = np.array(sizes + [sum(run.length for run in runs) for runs in extents.values()], dtype=np.int64)
    block_size = doc.get("block_size")
    if not is_block_size(block_size):
        raise CheckpointFormatError(f"{where}: 'block_size' {block_size!r:.40} is not a valid block size")
    keys = _table(doc, "keys", where)
    key_names, paths, kind, count = _keys(keys, doc_bytes, f"{where}: keys")
    tensors, layout = _described(doc.get("tensors"), kind, count, where)
    if doc.get("planner_data") == "paths":
        paths = paths or [None] * len(key_names)
        planner_data = _planner_paths(key_names, paths, where) if decode_paths else _path_codes(paths, where)
    else:
        if paths is not None:
            raise CheckpointFormatError(f"{where}: keys: 'paths' is only for 'planner_data': 'paths'")
        planner_data = check_planner_paths(doc.get("planner_data"), len(key_names), where)
    tables = Tables(
        header=header,
        features=features,
        files=all_files,
        block_size=block_size,
        planner_data=planner_data,
        names=key_names,
        paths=paths if doc.get("planner_data") == "paths" else None,
        kind=kind,
        count=count,
        **tensors,
        offsets=_NONE_2D,  # the item and block columns: set by _items and _blocks
        sizes=_NONE_2D,
        ranks=_NONE,
        length=_NONE,
        file=_NONE,
        at=_NONE,
        codec=_NONE,
        item_block_size=_NONE,
        inline={},
        starts=_NONE,
        crc=_NONE,
        stored=None,
        digests=None,
        extents=extents,
    )
    return _Head(doc, where, doc_bytes, tables, layout, _table(doc, "items", where), file_sizes)


def _planner_paths(names: list[str], paths: list[Any], where: str) -> dict[str, tuple[str | int, ...]]:
    return {fqn: decode_path(fqn, code, len(names), where) for fqn, code in zip(names, paths, strict=True)}


def _path_codes(paths: list[Any], where: str) -> None:
    """Path codes left to the merge (it compares them; the merged document's decode decodes them): lists
    of integers, or null."""
    codes = [code for code in paths if code is not None]
    if not set(map(type, codes)) <= {list} or not set(map(type, itertools.chain.from_iterable(codes))) <= {int}:
        raise CheckpointFormatError(f"{where}: keys: each of 'paths' must be null or a list of part counts")


def _features(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or not set(map(type, value)) <= {str} or len(set(value)) != len(value):
        raise CheckpointFormatError(f"{where}: 'features' must be a list of distinct feature names")
    unknown = sorted(set(value) - FEATURES)
    if unknown:
        raise CheckpointFormatError(
            f"{where} uses feature {unknown[0]!r:.60}, which this ckptio does not know (it reads "
            f"{sorted(FEATURES)}): upgrade ckptio to load it"
        )
    return frozenset(value)


def _table(doc: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    table = doc.get(name)
    if not isinstance(table, dict):
        raise CheckpointFormatError(f"{where}: required table {name!r} must be a JSON object")
    return table


# ---------------------------------------------------------------------------------------
# Files and extents


def decode_files(value: Any, features: frozenset[str], where: str) -> tuple[tuple[str, ...], list[int], dict]:
    """The ``files`` columns: the data file names in file-number order, their sizes and writers."""
    if not isinstance(value, dict) or not isinstance(value.get("save_ids"), list):
        raise CheckpointFormatError(f"{where}: 'files' must hold 'save_ids', 'ranks' and 'sizes' columns")
    spread = "key_prefix" in value
    if spread and (KEY_PREFIX not in features or value["key_prefix"] != KEY_PREFIX_RULE):
        raise CheckpointFormatError(
            f"{where}: 'files' has key_prefix {value['key_prefix']!r:.40}; only feature {KEY_PREFIX!r} has one, "
            f"{KEY_PREFIX_RULE!r}"
        )
    save_ids = value["save_ids"]
    count = len(save_ids)
    ranks = decode_column(value.get("ranks"), count, f"{where}: files: ranks")
    sizes = decode_column(value.get("sizes"), count, f"{where}: files: sizes")
    writers = decode_column(value["writers"], count, f"{where}: files: writers") if "writers" in value else ranks
    if not all(isinstance(s, str) and _SAVE_ID.fullmatch(s) for s in save_ids):
        for save_id, rank in zip(save_ids, ranks, strict=True):  # which one
            if not isinstance(save_id, str):  # a number would spell a valid name: refused by type
                raise CheckpointFormatError(f"{where}: files: save_ids holds {save_id!r:.40}, not a string")
            if not _SAVE_ID.fullmatch(save_id):
                refuse_data_file_name(data_file_name(save_id, rank), where)  # names the file and raises
    if "bases" in value:
        names = _names_with_siblings(value, save_ids, ranks, spread, features, where)
    else:
        names = tuple(data_file_name(s, rank, spread) for s, rank in zip(save_ids, ranks, strict=True))
    if len(set(names)) != count:
        raise CheckpointFormatError(f"{where}: 'files' names a data file twice")
    return names, sizes, dict(zip(names, writers, strict=True))


def _names_with_siblings(
    value: dict[str, Any], save_ids: list[str], ranks: list[int], spread: bool, features: frozenset[str], where: str
) -> tuple[str, ...]:
    """Data files of sibling checkpoints (``bases``, numbered by ``base``) and of its own. A sibling is
    one folder name beside the checkpoint's, never a path."""
    bases = value["bases"]
    if INCREMENTAL not in features or not isinstance(bases, list) or not bases:
        raise CheckpointFormatError(
            f"{where}: 'files.bases' (data files of other checkpoints) belongs to feature {INCREMENTAL!r}, as a "
            "non-empty list"
        )
    siblings: list[tuple[str, bool]] = []
    for base in bases:
        if not isinstance(base, dict) or set(base) - {"name", "key_prefix"} or not is_sibling_name(base.get("name")):
            raise CheckpointFormatError(
                f"{where}: each of 'files.bases' must be {{'name': a sibling folder's name, 'key_prefix'?}}, got "
                f"{base!r:.80}"
            )
        if base.get("key_prefix", KEY_PREFIX_RULE) != KEY_PREFIX_RULE:
            raise CheckpointFormatError(
                f"{where}: base {base['name']!r} has unknown key_prefix {base['key_prefix']!r:.40}"
            )
        siblings.append((base["name"], "key_prefix" in base))
    if len({name for name, _ in siblings}) != len(siblings):
        raise CheckpointFormatError(f"{where}: 'files.bases' names a sibling twice")
    numbers = decode_column(value.get("base", 0), len(save_ids), f"{where}: files: base")
    if numbers and max(numbers) > len(siblings):
        raise CheckpointFormatError(f"{where}: 'files.base' numbers a base past the {len(siblings)} of 'bases'")
    names = []
    for save_id, rank, number in zip(save_ids, ranks, numbers, strict=True):
        if number:
            sibling, sibling_spread = siblings[number - 1]
            names.append(sibling_file_name(sibling, data_file_name(save_id, rank, sibling_spread)))
        else:
            names.append(data_file_name(save_id, rank, spread))
    return tuple(names)


def decode_extents(
    value: Any, names: tuple[str, ...], sizes: list[int], doc_bytes: int, where: str
) -> dict[str, tuple[Extent, ...]]:
    """The runs of data files that hold each item an incremental save stored in pieces, by the virtual
    file name (``~<n>``) its items number after the data files. Every run lies inside its data file
    (never a virtual one) and holds at least a byte."""
    if value is None:
        return {}
    what = f"{where}: extents"
    count = value.get("items") if isinstance(value, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= doc_bytes:
        raise CheckpointFormatError(f"{what}: 'items' must count the items stored in pieces, got {count!r:.40}")
    runs_per_item = decode_array(value.get("count"), count, f"{what}: count")
    total = int(runs_per_item.sum())
    if runs_per_item.min() < 1 or total > doc_bytes:
        raise CheckpointFormatError(f"{what}: each item is stored in at least one run, all within the document")
    file, at, length = (decode_array(value.get(k), total, f"{what}: {k}") for k in ("file", "at", "length"))
    if file.min() < 1 or file.max() > len(names) or length.min() < 1:
        raise CheckpointFormatError(f"{what}: every run names one of the {len(names)} data files and holds a byte")
    _check_spans(file, at, length, names, np.array(sizes, dtype=np.int64), what)
    out: dict[str, tuple[Extent, ...]] = {}
    ends = np.cumsum(runs_per_item).tolist()
    file_list, at_list, length_list = file.tolist(), at.tolist(), length.tolist()
    first = 0
    for k, end in enumerate(ends, 1):
        out[f"{VIRTUAL_PREFIX}{k}"] = tuple(
            Extent(names[file_list[i] - 1], at_list[i], length_list[i]) for i in range(first, end)
        )
        first = end
    return out


# ---------------------------------------------------------------------------------------
# Keys and tensors


def _keys(table: dict[str, Any], doc_bytes: int, where: str) -> tuple[list[str], Any, np.ndarray, np.ndarray]:
    names = table.get("names")
    if not isinstance(names, list) or not set(map(type, names)) <= {str} or len(set(names)) != len(names):
        raise CheckpointFormatError(f"{where}: 'names' must be a list of distinct key names")
    paths = table.get("paths")
    if paths is not None and (not isinstance(paths, list) or len(paths) != len(names)):
        raise CheckpointFormatError(f"{where}: 'paths' must have one entry per key")
    kind = decode_array(table.get("kind", TENSOR), len(names), f"{where}: kind")
    count = decode_array(table.get("count", 1), len(names), f"{where}: count")
    if len(names) and kind.max() > PER_RANK:
        raise CheckpointFormatError(f"{where}: key {names[int(np.argmax(kind > PER_RANK))]!r:.80} has unknown kind")
    wrong = ((kind == OBJECT) & (count != 1)) | ((kind == PER_RANK) & (count < 1)) | (count > doc_bytes)
    if wrong.any():
        fqn = names[int(np.argmax(wrong))]
        raise CheckpointFormatError(
            f"{where}: key {fqn!r:.80} has {int(count[np.argmax(wrong)])} items: an object has one, a per-rank "
            "object at least one, and no key more than its metadata could describe"
        )
    if float(count.sum(dtype=np.float64)) > doc_bytes:
        raise CheckpointFormatError(f"{where}: 'count' declares more items than the document could describe")
    return names, paths, kind, count


class _Layout(NamedTuple):
    """What the keys and tensors tables say of each item (read-only arrays: shared by the documents that
    repeat those tables)."""

    item_keys: np.ndarray
    rows: np.ndarray  # each item's tensor row (-1: an object)
    tensor: np.ndarray  # whether the item is a tensor's
    per_rank: np.ndarray  # whether the item is a copy of an object kept per rank
    item_ndim: np.ndarray
    item_shape: np.ndarray  # (items, dims): its tensor's shape, zeros past its dimensions
    in_shape: np.ndarray  # (items, dims): whether the dimension is one of its tensor's
    item_itemsize: np.ndarray  # 1 for an object
    boxed: np.ndarray  # whether the item's box is stored
    # per stored box dimension: the items whose box has it, and how many
    box_columns: tuple[tuple[np.ndarray, int], ...]


#: Documents of the tables of a key and tensor layout already decoded (the fragments of a save repeat
#: theirs: 8,192 of them decoded it 8,192 times, a fifth of their decode), for layouts of at most
#: ``_LAYOUT_ITEMS`` items (a larger document's decode is not in its per-key steps).
_LAYOUTS: dict[tuple, tuple[dict[str, Any], _Layout]] = {}
_LAYOUTS_KEPT, _LAYOUT_ITEMS = 64, 1 << 12


def _described(table: Any, kind: np.ndarray, count: np.ndarray, where: str) -> tuple[dict[str, Any], _Layout]:
    """The tensor columns and the items' layout, from the ``tensors`` table and the keys' kinds and counts."""
    small = len(kind) and count.sum() <= _LAYOUT_ITEMS and _flat(table)
    memo = (kind.tobytes(), count.tobytes(), repr(table)) if small else None
    found = _LAYOUTS.get(memo) if memo else None
    if found is None:
        tensors = _tensor_columns(table, kind, count, where)
        found = tensors, _layout(kind, count, tensors)
        if memo:
            if len(_LAYOUTS) >= _LAYOUTS_KEPT:
                _LAYOUTS.clear()
            _LAYOUTS[memo] = found
    tensors, layout = found
    return {**tensors, "shapes": list(tensors["shapes"])}, layout


def _flat(table: Any) -> bool:
    """A table of the schema's shape: integers, strings and lists of strings (its ``repr`` is its memo key)."""
    return isinstance(table, dict) and all(
        type(value) in (int, str) or (type(value) is list and set(map(type, value)) <= {str})
        for value in table.values()
    )


def _layout(kind: np.ndarray, count: np.ndarray, tensors: dict[str, Any]) -> _Layout:
    item_keys = np.repeat(np.arange(len(kind)), count)
    is_tensor = kind == TENSOR
    rows = np.where(is_tensor, np.cumsum(is_tensor) - 1, -1)[item_keys]
    shapes = tensors["shapes"]
    ndims = np.array([len(shape) for shape in shapes] + [0], dtype=np.int64)
    item_ndim = ndims[rows]  # -1 picks the 0 after the tensors
    dims = int(item_ndim.max()) if len(item_ndim) else 0
    item_shape = padded_shapes(shapes, dims, len(shapes) + 1)[rows]  # the last row: objects'
    itemsize = np.array([dtype_from_name(name).itemsize for name in tensors["dtypes"]] + [1], dtype=np.int64)
    item_itemsize = itemsize[np.append(tensors["dtype"], len(tensors["dtypes"]))[rows]]
    boxed = (rows >= 0) & np.append(tensors["boxed"], False)[rows]
    box_dims = int(item_ndim[boxed].max()) if boxed.any() else 0
    layout = _Layout(
        item_keys,
        rows,
        rows >= 0,
        kind[item_keys] == PER_RANK,
        item_ndim,
        item_shape,
        np.arange(dims) < item_ndim[:, None],
        item_itemsize,
        boxed,
        tuple(_counted(boxed & (item_ndim > d)) for d in range(box_dims)),
    )
    shared = (*layout[:-1], *(at for at, _ in layout.box_columns), tensors["dtype"], tensors["requires_grad"])
    for array in (*shared, tensors["boxed"]):
        array.flags.writeable = False
    return layout


def _counted(mask: np.ndarray) -> tuple[np.ndarray, int]:
    return mask, int(mask.sum())


def _tensor_columns(table: Any, kind: np.ndarray, count: np.ndarray, where: str) -> dict[str, Any]:
    """The tensor columns (one row per tensor key): dtypes, shapes, requires_grad, boxed."""
    rows = int((kind == TENSOR).sum())
    if table is None and not rows:
        table = {"dtypes": [], "dtype": 0, "ndim": 0, "size": 0, "requires_grad": 0}
    what = f"{where}: tensors"
    if not isinstance(table, dict):
        raise CheckpointFormatError(f"{what}: the tensors table must be a JSON object")
    kinds = table.get("dtypes")
    if not isinstance(kinds, list) or len(set(map(str, kinds))) != len(kinds):
        raise CheckpointFormatError(f"{what}: 'dtypes' must be a list of distinct dtype names")
    dtypes = [dtype_from_name(name, what) for name in kinds]
    number = decode_array(table.get("dtype"), rows, f"{what}: dtype")
    ndim = decode_array(table.get("ndim"), rows, f"{what}: ndim")
    grad = decode_array(table.get("requires_grad"), rows, f"{what}: requires_grad")
    tensor_counts = count[kind == TENSOR]
    boxed = decode_array(table.get("boxed", 0), rows, f"{what}: boxed") if "boxed" in table else tensor_counts != 1
    if rows and (number.max() >= len(dtypes) or ndim.max() > MAX_DIMS or grad.max() > 1 or np.max(boxed) > 1):
        raise CheckpointFormatError(
            f"{what}: 'dtype' must index 'dtypes', 'ndim' be at most {MAX_DIMS}, 'requires_grad' and 'boxed' 0 or 1"
        )
    boxed = boxed.astype(bool)
    if (~boxed & (tensor_counts != 1)).any():
        raise CheckpointFormatError(f"{what}: a key of other than one item must be 'boxed'")
    size = decode_array(table.get("size"), int(ndim.sum()), f"{what}: size")
    flat, ends = size.tolist(), np.cumsum(ndim).tolist()
    shapes = [tuple(flat[end - n : end]) for n, end in zip(ndim.tolist(), ends, strict=True)]
    # the bytes of each shape's non-zero dimensions, estimated in bits; exact where near the limit
    itemsizes = np.array([dtype.itemsize for dtype in dtypes] + [1], dtype=np.float64)
    logs = np.log2(np.maximum(size, 1))
    bits = np.bincount(np.repeat(np.arange(rows), ndim), logs, rows) + np.log2(itemsizes[number])
    for row in np.flatnonzero(bits >= math.log2(INT64_LIMIT) - 1).tolist():
        check_shape(shapes[row], dtypes[number[row]].itemsize, what)
    return {"dtypes": kinds, "dtype": number, "shapes": shapes, "requires_grad": grad, "boxed": boxed}


# ---------------------------------------------------------------------------------------
# Items


def _items(group: list[_Head], cover: bool) -> None:
    """The item columns of documents of one layout, checked: boxes, ranks, lengths, files, offsets, codecs,
    block sizes, inline bytes. Each column is an array of a row per document."""
    layout = group[0].layout
    item_keys, rows, tensor, per_rank, item_ndim, item_shape, in_shape, item_itemsize, boxed, box_columns = layout
    count, dims = item_shape.shape
    wheres = [f"{head.where}: items" for head in group]
    for head, where in zip(group, wheres, strict=True):
        columns = (head.items.get("offsets", []), head.items.get("short", []))
        if not all(isinstance(c, list) and len(c) == len(box_columns) for c in columns):
            raise CheckpointFormatError(
                f"{where}: 'offsets' and 'short' must hold a column per dimension ({len(box_columns)})"
            )
    offsets = np.zeros((len(group), count, dims), dtype=np.int64)
    sizes = np.repeat(item_shape[None], len(group), axis=0)  # an object's row is zeros
    for d, (at, n) in enumerate(box_columns):  # a box: its offsets, and how much shorter than its tensor it is
        offsets[:, at, d] = _stacked([h.items["offsets"][d] for h in group], n, wheres, f"offsets column {d}")
        sizes[:, at, d] -= _stacked([h.items["short"][d] for h in group], n, wheres, f"short column {d}")
    outside = ((sizes < 0) | (offsets > item_shape - sizes)) & boxed[:, None]
    if outside.any():
        b, i = _first(outside.any(axis=2))
        raise CheckpointFormatError(
            f"{_key(group[b].tables, item_keys, i, wheres[b])} has a chunk at {offsets[b, i, : item_ndim[i]].tolist()} "
            f"of size {sizes[b, i, : item_ndim[i]].tolist()} outside its shape {list(group[b].tables.shapes[rows[i]])}"
        )
    for head, where, box, size in zip(group, wheres, offsets, sizes, strict=True):
        if not _check_tiling(head.tables, box, size, item_shape, cover, where):
            break  # no key of the layout needs it
    ranks = np.full((len(group), count), -1, dtype=np.int64)
    if per_rank.any():  # objects kept per rank: a merged checkpoint's, each document alone
        for head, where, mine in zip(group, wheres, ranks, strict=True):
            mine[per_rank] = decode_array(head.items.get("ranks"), int(per_rank.sum()), f"{where}: ranks")
            pairs = np.unique(np.stack([item_keys[per_rank], mine[per_rank]]), axis=1)
            if pairs.shape[1] != per_rank.sum() or mine.max() >= MAX_RANK:
                raise CheckpointFormatError(
                    f"{where}: a per-rank object's copies must name distinct ranks below {MAX_RANK}"
                )
    # a tensor item's bytes follow from its box (1 element for a scalar); an object's are stored
    length = np.where(tensor, np.prod(np.where(in_shape, sizes, 1), axis=2) * item_itemsize, 0)
    objects = count - int(tensor.sum())
    length[:, ~tensor] = _stacked([h.items.get("length") for h in group], objects, wheres, "length")
    file = _stacked([h.items.get("file") for h in group], count, wheres, "file")
    at = _stacked([h.items.get("at") for h in group], count, wheres, "at")
    codec = _stacked([h.items.get("codec", 0) for h in group], count, wheres, "codec")
    block_size = _stacked([h.items.get("block_size", h.tables.block_size) for h in group], count, wheres, "block_size")
    files = np.array([len(head.tables.files) for head in group])
    bad_file = (file > files[:, None]) | ((file == 0) & (at != 0))
    bad_block_size = (block_size <= 0) | (block_size > MAX_BLOCK_SIZE_LIMIT) | (block_size % 64 != 0)
    planes = codec == _PLANES
    if (bad_file | bad_block_size | (codec >= _PLANES)).any():  # which, in turn (byte planes: the last codec)
        _refuse(bad_file, group, item_keys, wheres, lambda b, i: f"points at data file number {file[b, i]} (offset "
                f"{at[b, i]}); the checkpoint has {files[b]} (0 = inline, at offset 0)")  # fmt: skip
        bad = codec >= len(CODECS)
        _refuse(bad, group, item_keys, wheres, lambda b, i: f"has unknown codec number {codec[b, i]}")
        bad = planes & ~(tensor & np.isin(item_itemsize, PLANE_ITEMSIZES))
        why = "uses byte planes but is not a tensor of 2-, 4- or 8-byte elements"
        _refuse(bad, group, item_keys, wheres, lambda b, i: why)
        _refuse(bad_block_size, group, item_keys, wheres, lambda b, i: f"has invalid block_size {block_size[b, i]}")
    blocks = block_counts(length, block_size)
    bound = np.array([head.doc_bytes for head in group])[:, None]
    _refuse(blocks > bound, group, item_keys, wheres, lambda b, i: f"has {blocks[b, i]} blocks, past what its "
            "metadata describes")  # fmt: skip
    held_inline = (file == 0).sum(axis=1).tolist()
    starts = np.zeros((len(group), count + 1), dtype=np.int64)
    np.cumsum(blocks, axis=1, out=starts[:, 1:])
    for b, (head, where) in enumerate(zip(group, wheres, strict=True)):
        inline = head.items.get("inline", [])
        if not isinstance(inline, list) or len(inline) != held_inline[b]:
            raise CheckpointFormatError(f"{where}: 'inline' must hold one base64 string per inline item")
        tables = head.tables
        tables.offsets, tables.sizes, tables.ranks, tables.length = offsets[b], sizes[b], ranks[b], length[b]
        tables.file, tables.at, tables.codec, tables.item_block_size = file[b], at[b], codec[b], block_size[b]
        tables.starts = starts[b]
        tables.inline = dict(zip(np.flatnonzero(file[b] == 0).tolist(), inline, strict=True)) if inline else {}


def _stacked(values: list[Any], count: int, wheres: list[str], column: str) -> np.ndarray:
    """Each document's value of an item column, decoded: a row each."""
    return np.stack([decode_array(v, count, f"{where}: {column}") for v, where in zip(values, wheres, strict=True)])


def _first(bad: np.ndarray) -> tuple[int, int]:
    """(document, item) of the first true entry: the first document's first."""
    return divmod(int(np.argmax(bad)), bad.shape[1])


def _check_tiling(
    tables: Tables, offsets: np.ndarray, sizes: np.ndarray, item_shape: np.ndarray, cover: bool, where: str
) -> bool:
    """The chunks of each key of several start at distinct offsets and cover each element once (at most
    once without ``cover``: a fragment); a key's one chunk (already inside its shape) is all of it. False
    where no key needs checking (a fragment's of one chunk each: so are those of its layout)."""
    tensor_keys = np.flatnonzero(tables.kind == TENSOR)
    counts = tables.count[tensor_keys]
    several = tensor_keys[counts != 1]
    if not (cover or len(several)):  # a fragment's keys of one chunk each
        return False
    firsts = tables.firsts
    if cover:  # a key of one chunk: the whole tensor
        single = tensor_keys[counts == 1]
        items = firsts[single]
        short = (offsets[items] != 0).any(axis=1) | (sizes[items] != item_shape[items]).any(axis=1)
        several = np.concatenate([several, single[short][:1]])  # the first that is not: named below
    rows = tables.tensor_rows()
    for k in several.tolist():
        shape = tables.shapes[rows[k]]
        n = len(shape)
        first, end = int(firsts[k]), int(firsts[k + 1])
        check_chunks_tile(
            shape, end - first, offsets[first:end, :n].T.tolist(), sizes[first:end, :n].T.tolist(),
            f"{where}: key {tables.names[k]!r:.80}", cover,
        )  # fmt: skip
    return True


def _key(tables: Tables, item_keys: np.ndarray, i: int, where: str) -> str:
    """Where item ``i`` is: its key, and which of its items."""
    k = int(item_keys[i])
    first = int(tables.firsts[k])
    more = f" item {i - first}" if tables.count[k] > 1 else ""
    return f"{where}: key {tables.names[k]!r:.80}{more}"


def _refuse(bad: np.ndarray, group: list[_Head], item_keys: np.ndarray, wheres: list[str], why: Any) -> None:
    """``bad``: a row per document of ``group``; the first document's first bad item refused, ``why(b, i)``."""
    if bad.any():
        b, i = _first(bad)
        raise CheckpointFormatError(f"{_key(group[b].tables, item_keys, i, wheres[b])} {why(b, i)}")


# ---------------------------------------------------------------------------------------
# Blocks


def _blocks(tables: Tables, table: dict[str, Any], file_sizes: np.ndarray, doc_bytes: int, where: str) -> None:
    """Each item's blocks: a CRC32C each, stored lengths that fit the logical ones, spans inside files."""
    total = int(tables.starts[-1])
    if total > doc_bytes:
        raise CheckpointFormatError(f"{where}: the items declare more blocks than the document could describe")
    tables.crc = crc_column(table.get("crc32c"), total, f"{where}: crc32c (one per block)")  # decoded on use
    item_keys = tables.item_keys
    compressed = bool(tables.codec.any())
    if compressed != ("stored_lengths" in table):
        raise CheckpointFormatError(f"{where}: 'stored_lengths' must be present exactly when an item is compressed")
    stored_items = tables.length
    if compressed:
        stored = decode_array(table["stored_lengths"], total, f"{where}: stored_lengths", packed_only=True)
        block_item, position, logical = logical_blocks(tables)
        raw = tables.codec[block_item] == 0
        bad = (stored <= 0) | (stored > logical) | (raw & (stored != logical)) | (stored * ZSTD_MAX_RATIO < logical)
        if bad.any():
            b = int(np.argmax(bad))
            i = int(block_item[b])
            raise CheckpointFormatError(
                f"{_key(tables, item_keys, i, where)} block {int(position[b])} has stored length {int(stored[b])} for "
                f"{int(logical[b])} logical bytes"
            )
        tables.stored = stored
        sums = np.concatenate(([0], np.cumsum(stored)))
        stored_items = sums[tables.starts[1:]] - sums[tables.starts[:-1]]
    in_file = tables.file > 0
    _check_spans(tables.file[in_file], tables.at[in_file], stored_items[in_file], tables.files, file_sizes, where)
    for i, text in list(tables.inline.items()):
        data = decode_inline(text, where)
        if data is None or len(data) != stored_items[i]:
            raise CheckpointFormatError(
                f"{_key(tables, item_keys, i, where)} is stored inline but its bytes do not match its blocks"
            )
        tables.inline[i] = data
    if "digests" in table:
        if INCREMENTAL not in tables.features:
            raise CheckpointFormatError(
                f"{where}: 'digests' belongs to feature {INCREMENTAL!r}, which it does not declare"
            )
        digests = PackedBlocks(table["digests"], DIGEST_ENTRIES * total, f"{where}: digests (16 bytes per block)")
        if digests.width != 4:  # sliced as 4-byte entries: wider ones would shift every block's digest
            raise CheckpointFormatError(f"{where}: digests holds {digests.width}-byte entries, not 4")
        tables.digests = digests


def _check_spans(
    file: np.ndarray, at: np.ndarray, length: np.ndarray, names: tuple[str, ...], sizes: np.ndarray, where: str
) -> None:
    """Each span (data file number ``file``, 1-based, from ``at`` for ``length`` bytes) lies inside it."""
    size = sizes[file - 1] if len(file) else file
    bad = (at > size) | (length > size - at)
    if bad.any():
        i = int(np.argmax(bad))
        raise CheckpointFormatError(
            f"{where}: item spans bytes {at[i]}..{int(at[i]) + int(length[i])} of {names[file[i] - 1]}, which the "
            f"metadata says holds {size[i]} bytes"
        )


# ---------------------------------------------------------------------------------------
# Paths


def decode_path(fqn: str, code: Any, keys: int, where: str) -> tuple[str | int, ...]:
    """A flat key's path from its code (``encode.path_code``); list indices as ``rules.check_list_index``
    allows. Valid answers are remembered (fragments of one save repeat each key's path)."""
    if code is None:
        return tuple(fqn.split("."))
    if isinstance(code, list) and all(type(n) is int for n in code):
        memo = (fqn, tuple(code), keys)
        path = _PATHS.get(memo)
        if path is None:
            path = _PATHS[memo] = _decode_path(fqn, code, keys, where)
            if len(_PATHS) > _PATHS_KEPT:
                _PATHS.clear()
        return path
    return _decode_path(fqn, code, keys, where)


_PATHS: dict[tuple, tuple] = {}
_PATHS_KEPT = 1 << 16


def _decode_path(fqn: str, code: Any, keys: int, where: str) -> tuple[str | int, ...]:
    parts = fqn.split(".")
    if not isinstance(code, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in code):
        raise CheckpointFormatError(f"{where}: the path of key {fqn!r:.80} must be a list of part counts")
    if code == [len(parts)]:  # the key is one element of its path (a flat state's dotted names)
        return (fqn,)
    path: list[str | int] = []
    at = 0
    for n in code:
        if n == 0:
            part = parts[at] if at < len(parts) else ""
            number = int(part) if part.isdecimal() and part.isascii() and str(int(part)) == part else part
            check_list_index(number, keys, fqn, where)
            path.append(number)
            at += 1
        else:
            path.append(".".join(parts[at : at + n]))
            at += n
    if at != len(parts):
        raise CheckpointFormatError(f"{where}: the path of key {fqn!r:.80} does not cover the key's parts")
    return tuple(path)
