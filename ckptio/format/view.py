"""A decoded document's ``Manifest``: DCP's metadata for every key (its planner needs every chunk), and
the item records over the tables, each built when a load asks for it: a rank resolves the items its
load plan reads, not every item of the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptio.format.decode import DIGEST_ENTRIES
from ckptio.format.names import CODECS, ItemKind, dtype_from_name
from ckptio.format.records import Manifest, StoredItem, block_logical_lengths, manifest_of
from ckptio.format.tables import PER_RANK, TENSOR, Tables

#: Every object's entry in DCP's metadata (it has no fields: one instance serves all).
_OBJECT = BytesStorageMetadata()


def manifest_of_tables(tables: Tables) -> Manifest:
    items = ItemTable(tables)
    state: dict[str, Any] = {}
    rows = tables.tensor_rows().tolist()
    firsts = tables.firsts.tolist()
    props = {
        (number, grad): TensorProperties(dtype=dtype_from_name(tables.dtypes[number]), requires_grad=bool(grad))
        for number, grad in set(zip(tables.dtype.tolist(), tables.requires_grad.tolist(), strict=True))
    }
    dtype, grad = tables.dtype.tolist(), tables.requires_grad.tolist()
    offsets, sizes = tables.offsets.tolist(), tables.sizes.tolist()
    per_rank: dict[str, dict[int, StoredItem]] = {}
    for k, (fqn, kind) in enumerate(zip(tables.names, tables.kind.tolist(), strict=True)):
        first, end = firsts[k], firsts[k + 1]
        if kind != TENSOR:
            state[fqn] = _OBJECT
            if kind == PER_RANK:
                per_rank[fqn] = {int(tables.ranks[i]): items.item(i) for i in range(first, end)}
            continue
        row = rows[k]
        shape = tables.shapes[row]
        n = len(shape)
        chunks = [ChunkStorageMetadata(torch.Size(offsets[i][:n]), torch.Size(sizes[i][:n])) for i in range(first, end)]
        state[fqn] = TensorStorageMetadata(props[dtype[row], grad[row]], torch.Size(shape), chunks)
    return manifest_of(tables.header, state, items, per_rank, tables.planner_data, tables.extents)


class ItemTable(Mapping):
    """``MetadataIndex -> StoredItem`` over the tables (objects kept per rank are the manifest's
    ``per_rank``, not here), each record built on first use."""

    def __init__(self, tables: Tables):
        self._tables = tables
        kinds = tables.kind.tolist()
        self._key_at = {name: k for k, name in enumerate(tables.names) if kinds[k] != PER_RANK}
        self._kinds = kinds
        self._firsts = tables.firsts.tolist()
        rows = tables.tensor_rows().tolist()
        self._ndim = [len(tables.shapes[row]) if row >= 0 else 0 for row in rows]
        self._dtype = [tables.dtypes[tables.dtype[row]] if row >= 0 else None for row in rows]
        self._file, self._at = tables.file.tolist(), tables.at.tolist()
        self._length, self._codec = tables.length.tolist(), tables.codec.tolist()
        self._block_size, self._starts = tables.item_block_size.tolist(), tables.starts.tolist()
        self._item_keys: list[int] | None = None
        self._built: dict[int, StoredItem] = {}
        self._by_offset: dict[tuple, int] | None = None

    def _offsets(self, i: int, k: int) -> tuple[int, ...]:
        return tuple(self._tables.offsets[i, : self._ndim[k]].tolist())

    def _locate(self, index: Any) -> int | None:
        k = self._key_at.get(getattr(index, "fqn", None))
        if k is None:
            return None
        first, end = self._firsts[k], self._firsts[k + 1]
        if self._kinds[k] != TENSOR:
            return first if index.offset is None else None
        if index.offset is None:
            return None
        offset = tuple(index.offset)
        hint = index.index
        if hint is not None and 0 <= hint < end - first and self._offsets(first + hint, k) == offset:
            return first + hint
        if self._by_offset is None:
            self._by_offset = {
                (k, self._offsets(i, k)): i
                for k, kind in enumerate(self._kinds)
                if kind == TENSOR
                for i in range(self._firsts[k], self._firsts[k + 1])
            }
        return self._by_offset.get((k, offset))

    def item(self, i: int) -> StoredItem:
        built = self._built.get(i)
        if built is None:
            built = self._built[i] = self._build(i)
        return built

    def _key_of(self, i: int) -> int:
        if self._item_keys is None:
            self._item_keys = self._tables.item_keys.tolist()
        return self._item_keys[i]

    def _build(self, i: int) -> StoredItem:
        tables = self._tables
        k = self._key_of(i)
        start, end = self._starts[i], self._starts[i + 1]
        logical, block_size = self._length[i], self._block_size[i]
        if tables.stored is not None:
            lengths = tables.stored[start:end].tolist()
        else:
            lengths = block_logical_lengths(logical, block_size)
        crcs = tables.crc[start:end]
        crcs = crcs.tolist() if isinstance(crcs, np.ndarray) else crcs
        digests = tables.digests
        if digests is not None:
            digests = digests[start * DIGEST_ENTRIES : end * DIGEST_ENTRIES]
            digests = digests.astype("<u4").tobytes() if isinstance(digests, np.ndarray) else digests.tobytes()
        file = self._file[i]
        tensor = self._kinds[k] == TENSOR
        return StoredItem(
            file=tables.files[file - 1] if file else "",
            offset=self._at[i],
            logical_bytes=logical,
            kind=ItemKind.TENSOR if tensor else ItemKind.BYTES,
            dtype=self._dtype[k],
            shape=tuple(tables.sizes[i, : self._ndim[k]].tolist()) if tensor else None,
            codec=CODECS[self._codec[i]],
            block_size=block_size,
            blocks=tuple(zip(lengths, crcs, strict=True)),
            inline=tables.inline.get(i),
            digests=digests,
        )

    def __getitem__(self, index: Any) -> StoredItem:
        i = self._locate(index)
        if i is None:
            raise KeyError(index)
        return self.item(i)

    def peek(self, index: Any) -> StoredItem | None:
        """The record of ``index`` (``None`` if there is none), built for the caller and not kept: an
        incremental save reads each of its base's records once, and records kept alive through the save
        would be walked by every full collection of the garbage collector meanwhile."""
        i = self._locate(index)
        if i is None:
            return None
        return self._built.get(i) or self._build(i)

    def __contains__(self, index: object) -> bool:
        return self._locate(index) is not None

    def __iter__(self) -> Iterator[MetadataIndex]:
        for (fqn, offset, position), _ in self._indices():
            yield MetadataIndex(fqn) if offset is None else MetadataIndex(fqn, torch.Size(offset), position)

    def _indices(self) -> Iterator[tuple[tuple[str, Any, int], int]]:
        for k, (fqn, kind) in enumerate(zip(self._tables.names, self._kinds, strict=True)):
            if kind == PER_RANK:
                continue
            first, end = self._firsts[k], self._firsts[k + 1]
            for i in range(first, end):
                yield (fqn, self._offsets(i, k) if kind == TENSOR else None, i - first), i

    def records(self) -> Iterator[tuple[tuple[str, Any], StoredItem]]:
        """Every ``((key, chunk offsets or None), record)``."""
        for (fqn, offset, _), i in self._indices():
            yield (fqn, offset), self.item(i)

    def __len__(self) -> int:
        per_rank = sum(n for kind, n in zip(self._kinds, self._tables.count.tolist(), strict=True) if kind == PER_RANK)
        return int(self._tables.count.sum()) - per_rank if self._kinds else 0
