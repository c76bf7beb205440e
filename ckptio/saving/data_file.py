"""Writing items, the write-side twin of ``loading/fetch.py``: items in, ``StoredItem`` records out.

A rank's items are cut into checksummed (optionally compressed) blocks and streamed back to
back into its one data file. Whether they land in that file or inline in ``ckptio.json`` is
decided here: with an ``inline_limit``, bytes are held in memory until they cross it, and a
rank that never crosses it creates no file at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ckptio.config import WriterConfig, cpu_threads
from ckptio.errors import CheckpointError
from ckptio.format.codec import BlockEncoder, block_size_for
from ckptio.format.names import Codec, ItemKind, dtype_from_name, dtype_name
from ckptio.format.records import VIRTUAL_PREFIX, Extent, Reference, StoredItem
from ckptio.saving.incremental import Base
from ckptio.storage import FsspecStore


@dataclasses.dataclass(frozen=True)
class ItemBytes:
    """One item's logical bytes and what they are."""

    index: MetadataIndex
    data: memoryview
    kind: ItemKind
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def item_bytes(
    items: dict[MetadataIndex, WriteItem], planner: SavePlanner, pickled: dict[MetadataIndex, memoryview]
) -> Iterator[ItemBytes]:
    """The bytes of each item (stored under its key in ``items``, resolved as the planner names
    it), objects first: small, and their pickling is the likeliest thing to fail. Tensors are
    resolved one at a time, so only one is copied to the host at once; ``pickled`` holds the
    objects already pickled."""
    for index, item in sorted(items.items(), key=lambda kv: kv[1].type != WriteItemType.BYTE_IO):
        if item.type == WriteItemType.BYTE_IO:
            data = pickled.get(index)
            yield ItemBytes(index, data if data is not None else planner.resolve_data(item).getbuffer(), ItemKind.BYTES)
        else:
            yield _tensor_bytes(index, item, planner.resolve_data(item))


def pickled_objects(items: dict[MetadataIndex, WriteItem], planner: SavePlanner) -> dict[MetadataIndex, memoryview]:
    return {idx: planner.resolve_data(it).getbuffer() for idx, it in items.items() if it.type == WriteItemType.BYTE_IO}


def encode_items(
    store: FsspecStore,
    file: str,
    items: Iterable[ItemBytes],
    config: WriterConfig,
    inline_limit: int = 0,
    base: Base | None = None,
    digested: bool | None = None,
) -> dict[MetadataIndex, StoredItem]:
    """Store ``items`` in data file ``file`` (or inline, if they all fit in ``inline_limit`` bytes). With
    ``WriterConfig.incremental_from`` set, every block's content digest is recorded, and the blocks
    ``base`` already stores are referenced there instead of written (``incremental.py``): an item of such
    blocks and changed ones is stored in pieces."""
    encoder = BlockEncoder(
        config.tuning.max_block_size,
        config.compression,
        config.tuning.compression_level,
        cpu_threads(config.storage_config.max_concurrency),
    )
    sink = _InlineOrFileSink(store, file, inline_limit)
    digested = config.incremental_from is not None if digested is None else digested
    placed: list[tuple[ItemBytes, Codec, int, int, tuple, bytes | None]] = []  # + codec, offset, block size, blocks
    referenced: dict[MetadataIndex, StoredItem] = {}
    offset = 0
    try:
        for item in items:
            block_size = block_size_for(len(item.data), encoder.max_block_size)
            itemsize = dtype_from_name(item.dtype).itemsize if item.kind == ItemKind.TENSOR else 1
            codec, planes = encoder.codec_for(item.data, itemsize)
            old = base.record(item, block_size) if base is not None else None
            blocks, digests, kept = [], [], None
            if old is not None and old.codec != codec:  # its blocks would be written in the base's codec
                kept, digests, places = base.references(item, old, [], store.request_cost_bytes)
                if not any(kept):
                    old, kept, digests = None, None, []
            if kept is None:
                crcs = [crc for _, crc in old.blocks] if old is not None and old.codec == Codec.RAW else None
                with contextlib.closing(
                    encoder.encode(item.data, block_size, codec, planes, digested, old and old.digests, crcs)
                ) as encoded:
                    for stored, crc, digest in encoded:
                        digests.append(digest)
                        if stored is None:  # the base holds this block (every one before it changed)
                            break
                        sink.write(stored, crc)
                        blocks.append((len(stored), crc))
                if old is not None and len(blocks) < len(old.blocks):
                    kept, digests, places = base.references(item, old, digests, store.request_cost_bytes)
            if kept is not None:
                mask = planes if old.codec == codec else (True,) * itemsize
                runs = _write_rest(item, old, kept, places, encoder, sink, mask, Extent(file, offset, 0), blocks)
                if len(runs) > 1 or runs[0].file != file:
                    sink.spill()  # its own blocks are named by file and offset: never inline
                    virtual = f"{VIRTUAL_PREFIX}{file}#{len(referenced)}"
                    referenced[item.index] = _reference(item, old, blocks, digests, runs, base, virtual)
                    offset += sum(run.length for run in runs if run.file == file)
                    continue
            placed.append((item, codec, offset, block_size, tuple(blocks), b"".join(digests) if digested else None))
            offset += sum(n for n, _ in blocks)
        sink.close(bool(placed) or any(r.file == file for record in referenced.values() for r in record.extents))
    except BaseException:
        sink.abort()
        raise
    finally:
        encoder.close()
    inline = sink.inline
    records = referenced
    for item, codec, at, block_size, blocks, digests in placed:
        end = at + sum(n for n, _ in blocks)
        records[item.index] = StoredItem(
            file="" if inline is not None else file,
            offset=0 if inline is not None else at,
            logical_bytes=len(item.data),
            kind=item.kind,
            dtype=item.dtype,
            shape=item.shape,
            codec=codec,
            block_size=block_size,
            blocks=blocks,
            inline=inline[at:end] if inline is not None else None,
            digests=digests,
        )
    return records


def _write_rest(
    item: ItemBytes,
    old: StoredItem,
    kept: list[bool],
    places: list[Extent],
    encoder: BlockEncoder,
    sink: "_InlineOrFileSink",
    planes: tuple[bool, ...],
    at: Extent,
    blocks: list[tuple[int, int]],
) -> list[Extent]:
    """Write the blocks of ``item`` after those in ``blocks`` (already written at ``at``) that are not
    ``kept`` where the base's ``old`` stores them (``places``), encoded as ``old`` is, adding each block
    to ``blocks``; the runs of files, in block order, that hold the item's blocks."""
    size, n = old.block_size, len(old.blocks)
    written = sum(length for length, _ in blocks)
    runs = [Extent(at.file, at.offset, written)] if blocks else []
    k = len(blocks)
    while k < n:
        if kept[k]:
            blocks.append(old.blocks[k])
            _extend(runs, places[k])
            k += 1
            continue
        end = next((j for j in range(k, n) if kept[j]), n)
        for stored, crc, _ in encoder.encode(item.data[k * size : end * size], size, old.codec, planes):
            sink.write(stored, crc)
            blocks.append((len(stored), crc))
            _extend(runs, Extent(at.file, at.offset + written, len(stored)))
            written += len(stored)
        k = end
    return runs


def _extend(runs: list[Extent], place: Extent) -> None:
    last = runs[-1] if runs else None
    if last is not None and last.precedes(place):
        runs[-1] = Extent(place.file, last.offset, last.length + place.length)
    else:
        runs.append(place)


def _reference(
    item: ItemBytes, old: StoredItem, blocks: list, digests: list[bytes], runs: list[Extent], base: Base, virtual: str
) -> Reference:
    """The record of ``item`` whose ``blocks`` lie in ``runs``: in one run of a base's file, an ordinary
    record there; else stored in pieces (``virtual`` names it)."""
    whole = len(runs) == 1
    return Reference(
        file=runs[0].file if whole else virtual,
        offset=runs[0].offset if whole else 0,
        logical_bytes=len(item.data),
        kind=item.kind,
        dtype=item.dtype,
        shape=item.shape,
        codec=old.codec,
        block_size=old.block_size,
        blocks=tuple(blocks),
        digests=b"".join(digests),
        extents=tuple(runs),
        sibling_sizes=base.sizes_of(run.file for run in runs),
    )


class _InlineOrFileSink:
    """Holds up to ``limit`` bytes in memory; past that, streams to the real data file.
    If the limit is never crossed, ``inline`` holds everything and no file is created."""

    def __init__(self, store: FsspecStore, name: str, limit: int):
        self.store, self.name, self.limit = store, name, limit
        self.buffer: bytearray | None = bytearray() if limit > 0 else None
        self.sink = None  # opened on the first byte past the limit: a rank whose items are all referenced has none
        self.inline: bytes | None = None

    def write(self, data: Any, crc: int | None = None) -> None:
        if self.buffer is not None and len(self.buffer) + len(data) <= self.limit:
            self.buffer += data
            return
        self.spill()
        self.sink.write(data, crc)

    def spill(self) -> None:
        """From now on into the data file (what was held so far first)."""
        if self.sink is None:
            self.sink = self.store.open_sink(self.name)
            if self.buffer:
                self.sink.write(self.buffer)
            self.buffer = None

    def close(self, placed: bool) -> None:
        """Finish the file; ``placed``: items were stored here (if only empty ones, the file is empty)."""
        if self.buffer is not None:
            self.inline = bytes(self.buffer)
            return
        if self.sink is None and placed:
            self.sink = self.store.open_sink(self.name)
        if self.sink is not None:
            self.sink.close()

    def abort(self) -> None:
        if self.sink is not None:
            self.sink.abort()


def _tensor_bytes(index: MetadataIndex, item: WriteItem, data: Any) -> ItemBytes:
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # Conjugate and negative-bit views are lazy flags: resolve them, or the bytes are the unflagged values.
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    expected = tuple(item.tensor_data.chunk.sizes)
    if tuple(tensor.shape) != expected:
        raise CheckpointError(
            f"key {item.index.fqn!r}: the planner resolved a tensor of shape {tuple(tensor.shape)} "
            f"for a chunk of shape {expected}"
        )
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return ItemBytes(index, memoryview(raw).cast("B"), ItemKind.TENSOR, dtype_name(tensor.dtype), expected)
