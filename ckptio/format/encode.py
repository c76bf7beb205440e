"""The one encoder of ckptio 1.0's metadata: a save's records as ``Tables`` (``tables_of``), and any
``Tables`` (a save's, or a merge's) as the JSON document (``encode``). ``docs/format.md`` has the schema.

Nothing is written that can be derived: a tensor chunk's byte length (its box and dtype), the box of a
key stored as one chunk, a column whose every entry is its default, a data file's writer (its name
says it), torch's flattening path of a key (a small code per key instead of the path).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ckptio.errors import CheckpointError
from ckptio.format.columns import b64, encode_array, encode_column, encode_packed_array
from ckptio.format.fragments import FragmentInfo
from ckptio.format.names import (
    CODECS,
    FORMAT_VERSION,
    KEY_PREFIX_RULE,
    SIBLING_PREFIX,
    dtype_name,
    parse_data_file_name,
    parse_data_file_names,
    split_sibling_file_name,
)
from ckptio.format.records import VIRTUAL_PREFIX, Header, Reference, planner_data_json
from ckptio.format.tables import (
    FRAGMENT,
    INCREMENTAL,
    KEY_PREFIX,
    OBJECT,
    PER_RANK,
    TENSOR,
    Tables,
    padded_shapes,
)

_CODEC_NUMBERS = {codec.value: number for number, codec in enumerate(CODECS)}
# attribute getters: C loops over hundreds of thousands of records (a codec by its value's string: an
# Enum member's hash is a Python method)
_CODEC, _FILE, _OFFSET, _BLOCK_SIZE, _BLOCKS, _LOGICAL, _DIGESTS = map(
    operator.attrgetter,
    ("codec._value_", "file", "offset", "block_size", "blocks", "logical_bytes", "digests"),
)


def tables_of(
    metadata: Metadata,
    items: Mapping[tuple[str, Any], Any],
    per_rank: Mapping[str, Mapping[int, Any]],
    header: Header,
    fragment: FragmentInfo | None = None,
) -> Tables:
    """A save's metadata as tables: DCP's entries, the stored record of each ``(key, chunk offsets or
    None)``, objects kept per rank (key -> rank -> record), the header (its data files), and for a rank's
    fragment of a save without a coordinator, the fragment's own record."""
    state = metadata.state_dict_metadata
    names = list(state)
    paths = paths_by_key(metadata)
    kinds, counts, records, ranks = [], [], [], []
    tensors = [md for md in state.values() if not isinstance(md, BytesStorageMetadata)]
    dims = max((len(md.size) for md in tensors), default=0)
    boxes: list[tuple[int, ...]] = []
    zero = (0,) * dims
    for fqn, md in state.items():
        if isinstance(md, BytesStorageMetadata):
            copies = per_rank.get(fqn)
            if copies:
                kinds.append(PER_RANK)
                counts.append(len(copies))
                records += [copies[rank] for rank in sorted(copies)]
                ranks += sorted(copies)
            else:
                kinds.append(OBJECT)
                counts.append(1)
                records.append(_record(items, fqn, None))
                ranks.append(-1)
            boxes += [zero + zero] * counts[-1]
            continue
        kinds.append(TENSOR)
        counts.append(len(md.chunks))
        pad = (0,) * (dims - len(md.size))
        for chunk in md.chunks:
            records.append(_record(items, fqn, chunk.offsets))
            boxes.append((*chunk.offsets, *pad, *chunk.sizes, *pad))
        ranks += [-1] * len(md.chunks)
    box = np.array(boxes, dtype=np.int64).reshape(len(records), 2 * dims)
    files = tuple(sorted(header.files))
    pieces = [r for r in records if isinstance(r, Reference) and len(r.extents) > 1]
    numbers = {name: n for n, name in enumerate(files, 1)} | {"": 0}
    virtual = {}
    for k, piece in enumerate(pieces, 1):  # an item stored in pieces numbers a virtual file after the data files
        virtual[f"{VIRTUAL_PREFIX}{k}"] = piece.extents
        numbers[piece.file] = len(files) + k
    blocks = np.array(list(itertools.chain.from_iterable(map(_BLOCKS, records))), dtype=np.int64).reshape(-1, 2)
    digests = list(map(_DIGESTS, records))
    features = set()
    if any(parse_data_file_name(split_sibling_file_name(name)[1]).spread for name in files):  # type: ignore[union-attr]
        features.add(KEY_PREFIX)
    if header.chain is not None or pieces or any(name.startswith(SIBLING_PREFIX) for name in files):
        features.add(INCREMENTAL)
    has_digests = bool(digests) and None not in digests
    if has_digests:
        features.add(INCREMENTAL)
    if fragment is not None:
        features.add(FRAGMENT)
    codecs = np.array([_CODEC_NUMBERS[c] for c in map(_CODEC, records)], dtype=np.int64)
    tensor_dtypes = [dtype_name(md.properties.dtype) for md in tensors]
    dtypes = sorted(set(tensor_dtypes))
    dtype_numbers = {name: i for i, name in enumerate(dtypes)}
    return Tables(
        header=dataclasses.replace(header, format_version=FORMAT_VERSION),
        features=frozenset(features),
        files=files + tuple(virtual),
        block_size=header.config.max_block_size or (records[0].block_size if records else 64),
        planner_data=None if paths is not None else planner_data_json(metadata.planner_data),
        names=names,
        paths=None if paths is None else [paths[fqn] for fqn in names],
        kind=np.array(kinds, dtype=np.int64),
        count=np.array(counts, dtype=np.int64),
        dtypes=dtypes,
        dtype=np.array([dtype_numbers[name] for name in tensor_dtypes], dtype=np.int64),
        shapes=[tuple(md.size) for md in tensors],
        requires_grad=np.array([int(bool(md.properties.requires_grad)) for md in tensors], dtype=np.int64),
        boxed=np.array([_boxed(md) for md in tensors], dtype=bool),
        offsets=box[:, :dims],
        sizes=box[:, dims:],
        ranks=np.array(ranks, dtype=np.int64),
        length=np.array(list(map(_LOGICAL, records)), dtype=np.int64),
        file=np.array([numbers[name] for name in map(_FILE, records)], dtype=np.int64),
        at=np.array(list(map(_OFFSET, records)), dtype=np.int64),
        codec=codecs,
        item_block_size=np.array(list(map(_BLOCK_SIZE, records)), dtype=np.int64),
        inline={i: r.inline for i, r in enumerate(records) if r.file == ""},
        starts=np.concatenate(([0], np.cumsum([len(r.blocks) for r in records], dtype=np.int64))),
        crc=blocks[:, 1].astype(np.uint32),
        stored=blocks[:, 0] if codecs.any() else None,
        digests=np.frombuffer(b"".join(digests), dtype="<u4").astype(np.uint32) if has_digests else None,
        extents=virtual,
        fragment=fragment,
    )


def _record(items: Mapping[tuple[str, Any], Any], fqn: str, offsets: Any) -> Any:
    record = items.get((fqn, offsets))
    if record is None:
        where = "" if offsets is None else f" (chunk at {list(offsets)})"
        raise CheckpointError(f"no rank reported writing key {fqn!r}{where}; the save cannot commit")
    return record


def _boxed(md: Any) -> bool:
    """Whether a tensor's items need their boxes: several chunks, or one that is not all of it."""
    if len(md.chunks) != 1:
        return True
    chunk = md.chunks[0]
    return chunk.sizes != md.size or any(chunk.offsets)


# ---------------------------------------------------------------------------------------
# The document


def encode(tables: Tables) -> bytes:
    """The JSON document of ``tables``."""
    doc = tables.header.to_json()
    del doc["writer_ranks"]  # in 'files'
    doc["format_version"] = FORMAT_VERSION
    doc.pop("features", None)  # the tables' own
    for field in [name for name, value in doc.items() if value is None]:  # an absent field reads as null
        del doc[field]
    if tables.features:
        doc["features"] = sorted(tables.features)
    data_files = tables.files[: len(tables.files) - len(tables.extents)]
    doc["files"] = encode_files(list(data_files), tables.header.files, tables.header.writer_ranks)
    doc["block_size"] = tables.block_size
    doc["planner_data"] = "paths" if tables.paths is not None else tables.planner_data
    doc["keys"] = _keys_table(tables)
    tensor = tables.kind == TENSOR
    if tensor.any():
        doc["tensors"] = _tensors_table(tables)
    doc["items"] = _items_table(tables)
    doc["blocks"] = _blocks_table(tables)
    if tables.extents:
        runs = [run for runs in tables.extents.values() for run in runs]
        numbers = {name: n for n, name in enumerate(tables.files, 1)}
        doc["extents"] = {
            "items": len(tables.extents),
            "count": encode_column([len(runs) for runs in tables.extents.values()]),
            "file": encode_column([numbers[run.file] for run in runs]),
            "at": encode_column([run.offset for run in runs]),
            "length": encode_column([run.length for run in runs]),
        }
    if tables.fragment is not None:
        doc["fragment"] = tables.fragment.to_json()
    return json.dumps(doc, separators=(",", ":"), check_circular=False).encode()


def _keys_table(tables: Tables) -> dict[str, Any]:
    table: dict[str, Any] = {"names": tables.names}
    if tables.paths is not None and tables.paths.count(None) != len(tables.paths):
        table["paths"] = tables.paths
    if tables.kind.any():
        table["kind"] = encode_array(tables.kind)
    if len(tables.count) and not (tables.count == 1).all():
        table["count"] = encode_array(tables.count)
    return table


def _tensors_table(tables: Tables) -> dict[str, Any]:
    counts = tables.count[tables.kind == TENSOR]
    table: dict[str, Any] = {
        "dtypes": tables.dtypes,
        "dtype": encode_array(tables.dtype),
        "ndim": encode_column([len(shape) for shape in tables.shapes]),
        "size": encode_column([n for shape in tables.shapes for n in shape]),
        "requires_grad": encode_array(tables.requires_grad),
    }
    if (tables.boxed != (counts != 1)).any():
        table["boxed"] = encode_array(tables.boxed.astype(np.int64))
    return table


def _items_table(tables: Tables) -> dict[str, Any]:
    table: dict[str, Any] = {}
    rows = tables.tensor_rows()
    item_rows = np.repeat(rows, tables.count)
    ndims = np.array([len(shape) for shape in tables.shapes], dtype=np.int64)
    boxed_items = item_rows >= 0
    boxed_items[boxed_items] = tables.boxed[item_rows[boxed_items]]
    if boxed_items.any():  # a box as its offsets and how much shorter than its tensor it is: 0 where whole
        item_ndim = ndims[item_rows[boxed_items]]
        shapes = padded_shapes(tables.shapes, tables.sizes.shape[1])
        offsets = tables.offsets[boxed_items]
        short = shapes[item_rows[boxed_items]] - tables.sizes[boxed_items]
        dims = int(item_ndim.max())
        table["offsets"] = [encode_array(offsets[item_ndim > d, d]) for d in range(dims)]
        table["short"] = [encode_array(short[item_ndim > d, d]) for d in range(dims)]
    item_kind = np.repeat(tables.kind, tables.count)
    if (item_kind == PER_RANK).any():
        table["ranks"] = encode_array(tables.ranks[item_kind == PER_RANK])
    if (item_kind != TENSOR).any():
        table["length"] = encode_array(tables.length[item_kind != TENSOR])
    table["file"] = encode_array(tables.file)
    table["at"] = encode_array(tables.at)
    if tables.codec.any():
        table["codec"] = encode_array(tables.codec)
    if len(tables.item_block_size) and not (tables.item_block_size == tables.block_size).all():
        table["block_size"] = encode_array(tables.item_block_size)
    if tables.inline:
        table["inline"] = [b64(tables.inline[i]) for i in sorted(tables.inline)]
    return table


def _blocks_table(tables: Tables) -> dict[str, Any]:
    table: dict[str, Any] = {"crc32c": encode_packed_array(tables.crc_array(), "I")}
    if tables.stored is not None:
        table["stored_lengths"] = encode_packed_array(tables.stored)
    digests = tables.digest_array()
    if digests is not None:
        table["digests"] = encode_packed_array(digests, "I")
    return table


# ---------------------------------------------------------------------------------------
# Data files and paths


def encode_files(names: list[str], files: Mapping[str, int], writer_ranks: Mapping[str, int]) -> dict[str, Any]:
    """The ``files`` columns of the data files ``names`` (in file-number order), their sizes and writers."""
    if any(name.startswith(SIBLING_PREFIX) for name in names):
        columns = _files_with_siblings(names)
        ranks = columns["ranks"]
    else:
        save_ids, ranks, spread = parse_data_file_names(names)
        columns = {"save_ids": save_ids, "ranks": ranks}
        if spread:
            columns["key_prefix"] = KEY_PREFIX_RULE
    writers = [writer_ranks.get(name, rank) for name, rank in zip(names, ranks, strict=True)]
    columns["ranks"] = encode_column(ranks)
    columns["sizes"] = encode_column([files[name] for name in names])
    if writers != ranks:
        columns["writers"] = encode_column(writers)
    return columns


def _files_with_siblings(names: list[str]) -> dict[str, Any]:
    """Data files of sibling checkpoints (an incremental save's references) beside its own: ``bases``
    names each sibling (and its key-prefix rule), ``base`` numbers each file's (0: its own)."""
    save_ids, ranks, base_numbers = [], [], []
    bases: dict[str | None, int] = {None: 0}
    spread_of: dict[str | None, bool] = {}
    for name in names:
        sibling, own = split_sibling_file_name(name)
        parsed = parse_data_file_name(own)
        if parsed is None or spread_of.setdefault(sibling, parsed.spread) != parsed.spread:
            raise ValueError(f"{name!r} is not a ckptio data file name, or its folder mixes key-prefix rules")
        save_ids.append(parsed.save_id)
        ranks.append(parsed.rank)
        base_numbers.append(bases.setdefault(sibling, len(bases)))
    columns: dict[str, Any] = {"save_ids": save_ids, "ranks": ranks, "base": encode_column(base_numbers)}
    columns["bases"] = [
        {"name": sibling, **({"key_prefix": KEY_PREFIX_RULE} if spread_of[sibling] else {})}
        for sibling in bases
        if sibling is not None
    ]
    if spread_of.get(None):
        columns["key_prefix"] = KEY_PREFIX_RULE
    return columns


def paths_by_key(metadata: Metadata) -> dict[str, list[int] | None] | None:
    """torch's planner data ``{flat key: path}`` as a per-key code (``None``: the key split at every dot);
    ``None`` when it is not such a map of exactly the saved keys (it is then stored as it is)."""
    planner_data = metadata.planner_data
    if not isinstance(planner_data, dict) or planner_data.keys() != metadata.state_dict_metadata.keys():
        return None
    paths = {}
    for fqn, path in planner_data.items():
        try:  # a path of names only (most keys): its parts' dots are the key's, less the joins
            if not isinstance(path, (tuple, list)) or ".".join(path) != fqn:
                return None
            code = None if fqn.count(".") == len(path) - 1 else [part.count(".") + 1 for part in path]
        except TypeError:  # list indices (or what is not a path)
            code = path_code(path)
            if code is False or ".".join(map(str, path)) != fqn:
                return None
        paths[fqn] = code
    return paths


def path_code(path: Any) -> list[int] | None | bool:
    """A flat key's path as a count of its dot-separated parts per path element (0: a list index);
    ``None`` when every part is its own string element; ``False`` when it is not such a path."""
    if not isinstance(path, (tuple, list)):
        return False
    code = []
    for part in path:
        if type(part) is str:
            code.append(part.count(".") + 1)
        elif isinstance(part, int) and not isinstance(part, bool) and part >= 0:
            code.append(0)
        else:
            return False
    return None if code.count(1) == len(code) else code
