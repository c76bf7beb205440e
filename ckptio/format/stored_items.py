"""The item records of a format version 3 checkpoint, built from its checked columns on first use:
a rank resolves the items its load plan reads, not every item of the checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptio.format.names import CODECS, ItemKind
from ckptio.format.records import StoredItem, block_logical_lengths


class StoredKey:
    """The stored items of one key, as decoded and checked columns; ``item(i)`` builds one record."""

    __slots__ = (
        "fqn", "tensor", "dtype", "offsets", "sizes", "logical", "file", "at", "codec", "block_size",
        "starts", "crcs", "lengths", "inline", "ranks", "_files", "_built", "_by_offset",
    )  # fmt: skip

    def __init__(self, fqn: str, tensor: bool, files: tuple[str, ...]):
        self.fqn, self.tensor, self._files = fqn, tensor, files
        self.dtype: str | None = None
        self.offsets: list[tuple[int, ...]] = []
        self.sizes: list[tuple[int, ...]] = []
        self.logical: list[int] = []
        self.ranks: list[int] | None = None
        self.inline: dict[int, bytes] = {}
        self.lengths: list[int] | None = None
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
        return StoredItem(
            file=self._files[file - 1] if file else "",
            offset=self.at[i],
            logical_bytes=logical,
            kind=ItemKind.TENSOR if self.tensor else ItemKind.BYTES,
            dtype=self.dtype,
            shape=self.sizes[i] if self.tensor else None,
            codec=CODECS[self.codec[i]],
            block_size=block_size,
            blocks=tuple(zip(lengths, self.crcs[start:end], strict=True)),
            inline=self.inline.get(i),
        )

    def position(self, offset: Any, hint: int | None) -> int | None:
        """The item stored for DCP's index ``(offset, hint)``: the hint is the chunk's position."""
        if not self.tensor:
            return 0 if offset is None and self.ranks is None else None
        if offset is None:
            return None
        offset = tuple(offset)
        if hint is not None and 0 <= hint < len(self.offsets) and self.offsets[hint] == offset:
            return hint
        if self._by_offset is None:
            self._by_offset = {o: i for i, o in enumerate(self.offsets)}
        return self._by_offset.get(offset)


class StoredItems(Mapping):
    """``MetadataIndex -> StoredItem`` over the decoded keys and objects table, building each record on
    first use: a rank resolves the items its load plan reads, not every item of the checkpoint."""

    def __init__(self, keys: dict[str, StoredKey], objects: StoredKey | None, object_names: list[str]):
        self._keys, self._objects = keys, objects
        self._object_at = {name: i for i, name in enumerate(object_names)}

    def _locate(self, index: Any) -> tuple[StoredKey, int] | None:
        fqn = getattr(index, "fqn", None)
        key = self._keys.get(fqn)
        if key is None:
            at = self._object_at.get(fqn) if index.offset is None else None
            return None if at is None else (self._objects, at)
        at = key.position(index.offset, index.index)
        return None if at is None else (key, at)

    def __getitem__(self, index: Any) -> Any:
        located = self._locate(index)
        if located is None:
            raise KeyError(index)
        return located[0].item(located[1])

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
        for name in self._object_at:
            yield MetadataIndex(name)

    def __len__(self) -> int:
        return sum(key.count if key.tensor else key.ranks is None for key in self._keys.values()) + len(self._object_at)
