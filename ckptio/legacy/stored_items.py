"""The item records of a format version 3 checkpoint, built from its checked columns on first use:
a rank resolves the items its load plan reads, not every item of the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.format.names import CODECS, ItemKind
from ckptio.format.records import DIGEST_BYTES, StoredItem, block_logical_lengths

#: Entries of a packed ``digests`` column (4 bytes each) per block.
DIGEST_ENTRIES = DIGEST_BYTES // 4


class StoredKey:
    """The stored items of one key, as decoded and checked columns; ``item(i)`` builds one record."""

    __slots__ = (
        "fqn", "tensor", "dtype", "dtypes", "offsets", "sizes", "logical", "file", "at", "codec", "block_size",
        "starts", "crcs", "lengths", "inline", "ranks", "firsts", "digests", "_files", "_built", "_by_offset",
    )  # fmt: skip

    def __init__(self, fqn: str, tensor: bool, files: tuple[str, ...]):
        self.fqn, self.tensor, self._files = fqn, tensor, files
        self.dtype: str | None = None
        self.dtypes: list[str] | None = None  # each item's, in the tensors table (items of many keys)
        self.firsts: list[int] | None = None  # the tensors table: each key's first item, then the end
        self.offsets: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        self.logical: list[int] = []
        self.ranks: list[int] | None = None
        self.inline: dict[int, bytes] = {}
        self.lengths: list[int] | None = None
        self.digests: Any = None  # PackedBlocks of DIGEST_ENTRIES per block (format version 7)
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
        start, end = self.starts[i], self.starts[i + 1]
        logical, block_size = self.logical[i], self.block_size[i]
        lengths = self.lengths[start:end] if self.lengths else block_logical_lengths(logical, block_size)
        file = self.file[i]
        digests = self.digests
        return StoredItem(
            file=self._files[file - 1] if file else "",
            offset=self.at[i],
            logical_bytes=logical,
            kind=ItemKind.TENSOR if self.tensor else ItemKind.BYTES,
            dtype=self.dtype if self.dtypes is None else self.dtypes[i],
            shape=self.sizes[i] if self.tensor else None,
            codec=CODECS[self.codec[i]],
            block_size=block_size,
            blocks=tuple(zip(lengths, self.crcs[start:end], strict=True)),
            inline=self.inline.get(i),
            digests=None if digests is None else digests[start * DIGEST_ENTRIES : end * DIGEST_ENTRIES].tobytes(),
        )

    def position(self, offset: Any, hint: int | None, key: int = 0) -> int | None:
        """The item stored for DCP's index ``(offset, hint)``: the hint is the chunk's position (among
        the chunks of the ``key``-th key, in the tensors table)."""
        if not self.tensor:
            return 0 if offset is None and self.ranks is None else None
        if offset is None:
            return None
        offset = tuple(offset)
        first, end = (0, len(self.offsets)) if self.firsts is None else (self.firsts[key], self.firsts[key + 1])
        if hint is not None and 0 <= hint < end - first and self.offsets[first + hint] == offset:
            return first + hint
        if self._by_offset is None:
            if self.firsts is None:
                self._by_offset = {o: i for i, o in enumerate(self.offsets)}
            else:
                self._by_offset = {(k, tuple(self.offsets[i])): i for k in range(len(self.firsts) - 1)
                                   for i in range(self.firsts[k], self.firsts[k + 1])}  # fmt: skip
        return self._by_offset.get(offset if self.firsts is None else (key, offset))


class StoredItems(Mapping):
    """``MetadataIndex -> StoredItem`` over the decoded keys and the objects and tensors tables, building
    each record on first use: a rank resolves the items its load plan reads, not every item of the
    checkpoint."""

    def __init__(
        self,
        keys: dict[str, StoredKey],
        objects: tuple[StoredKey, list[str]] | None = None,
        tensors: tuple[StoredKey, list[str]] | None = None,
    ):
        self._keys = keys
        self._objects, object_names = objects or (None, [])
        self._tensors, tensor_names = tensors or (None, [])
        self._object_at = {name: i for i, name in enumerate(object_names)}
        self._tensor_at = {name: i for i, name in enumerate(tensor_names)}

    def _locate(self, index: Any) -> tuple[StoredKey, int] | None:
        fqn = getattr(index, "fqn", None)
        key = self._keys.get(fqn)
        if key is not None:
            at = key.position(index.offset, index.index)
            return None if at is None else (key, at)
        if index.offset is None:
            at = self._object_at.get(fqn)
            return None if at is None else (self._objects, at)
        at = self._tensor_at.get(fqn)
        position = None if at is None else self._tensors.position(index.offset, index.index, at)
        return None if position is None else (self._tensors, position)

    def __getitem__(self, index: Any) -> Any:
        located = self._locate(index)
        if located is None:
            raise KeyError(index)
        return located[0].item(located[1])

    def peek(self, index: Any) -> Any:
        """The record of ``index`` (``None`` if there is none), built for the caller and not kept: an
        incremental save reads each of its base's records once, and records kept alive through the save
        would be walked by every full collection of the garbage collector meanwhile."""
        located = self._locate(index)
        if located is None:
            return None
        key, i = located
        built = key._built.get(i)
        return built if built is not None else key._build(i)

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
        for name, k in self._tensor_at.items():
            first, end = self._tensors.firsts[k], self._tensors.firsts[k + 1]
            for i in range(first, end):
                yield MetadataIndex(name, torch.Size(self._tensors.offsets[i]), i - first)
        for name in self._object_at:
            yield MetadataIndex(name)

    def records(self) -> Iterator[tuple[tuple[str, Any], StoredItem]]:
        """Every ``((key, chunk offsets or None), record)``, as the iteration of ``items()`` but without
        building an index per item and looking it up again (merging thousands of fragments visits each)."""
        for fqn, key in self._keys.items():
            if not key.tensor:
                if key.ranks is None:
                    yield (fqn, None), key.item(0)
                continue
            for i, offset in enumerate(key.offsets):
                yield (fqn, offset), key.item(i)
        tensors = self._tensors
        for name, k in self._tensor_at.items():
            for i in range(tensors.firsts[k], tensors.firsts[k + 1]):
                yield (name, tensors.offsets[i]), tensors.item(i)
        for name, i in self._object_at.items():
            yield (name, None), self._objects.item(i)

    def __len__(self) -> int:
        in_keys = sum(key.count if key.tensor else key.ranks is None for key in self._keys.values())
        return in_keys + (self._tensors.count if self._tensors else 0) + len(self._object_at)
