"""The DCP StorageReader: validated JSON metadata, ranged block reads, checksums on every read."""

from __future__ import annotations

import bisect
import io
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, LoadItemType, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .codec import checksum, decode_block
from .config import WriterConfig
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotCkptioCheckpointError,
)
from .layout import METADATA_NAME, TORCH_DCP_METADATA_NAME, Manifest, StoredItem, decode_metadata, dtype_from_name, is_data_file_name
from .ranges import blocks_for_runs, box_runs, coalesce, row_major_strides
from .storage import FsspecStore, RangeRequest, open_store

# Bytes fetched per round of parallel reads, bounding the reader's memory.
_BATCH_BYTES = 512 << 20
# Longest single ranged request after coalescing, so one large item still reads in parallel.
_MAX_REQUEST_BYTES = 32 << 20


class Reader(StorageReader):
    """Load a checkpoint written by ``ckptio.Writer`` on any world size and mesh.

    Every block read is checked against its CRC32C unless ``verify=False``.
    """

    def __init__(
        self,
        checkpoint_id: str | os.PathLike | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        verify: bool = True,
        config: WriterConfig | None = None,
    ):
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.verify = verify
        self.config = config if config is not None else WriterConfig()
        self.checkpoint_id: str | None = None
        self.manifest: Manifest | None = None
        self.reset(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = os.fspath(checkpoint_id)
        self._store: FsspecStore | None = None
        self.manifest = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.manifest = read_manifest(self._open_store())
        return self.manifest.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._items: dict[MetadataIndex, StoredItem] = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        jobs = [_ReadJob.build(ri, self._item_for(ri)) for ri in plan.items]
        batch: list[_ReadJob] = []
        batch_bytes = 0
        for job in jobs:
            if batch and batch_bytes + job.fetch_bytes > _BATCH_BYTES:
                self._run_batch(batch, planner)
                batch, batch_bytes = [], 0
            batch.append(job)
            batch_bytes += job.fetch_bytes
        self._run_batch(batch, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # --- helpers ----------------------------------------------------------------------
    def _open_store(self) -> FsspecStore:
        if self._store is None:
            if self.checkpoint_id is None:
                raise CheckpointError(
                    "ckptio.Reader has no checkpoint location: pass it to Reader(...) or to dcp.load(checkpoint_id=...)"
                )
            self._store = open_store(self.checkpoint_id, self.storage_options, self.config)
        return self._store

    def _item_for(self, read_item: ReadItem) -> StoredItem:
        try:
            return self._items[read_item.storage_index]
        except KeyError:
            raise CheckpointError(
                f"key {read_item.storage_index.fqn!r} (chunk at {tuple(read_item.storage_index.offset or ())}) "
                f"is not stored in {self.checkpoint_id}"
            ) from None

    def _run_batch(self, jobs: list["_ReadJob"], planner: LoadPlanner) -> None:
        if not jobs:
            return
        store = self._open_store()
        wanted = {(job.item.file, *job.item_block_span(b)) for job in jobs if job.item.inline is None for b in job.blocks}
        requests = [RangeRequest(*r) for r in coalesce(wanted, _MAX_REQUEST_BYTES)]
        try:
            fetched = store.read_ranges(requests)
        except FileNotFoundError as exc:
            missing = sorted({r[0] for r in requests if not _exists(store, r[0])}) or [str(exc)]
            raise CorruptCheckpointError(
                f"data file(s) {missing} listed in {store.describe(METADATA_NAME)} are missing; the checkpoint was "
                "damaged after it was written: restore the files or load an earlier checkpoint"
            ) from None
        spans: dict[str, list[tuple[int, int, memoryview]]] = {}
        for (name, start, end), data in zip(requests, fetched):
            if len(data) != end - start:
                raise CorruptCheckpointError(
                    f"{store.describe(name)} is truncated: reading bytes {start}..{end} returned {len(data)} bytes "
                    f"(the metadata says the file holds {self.manifest.files.get(name) if self.manifest else '?'} bytes)"
                )
            spans.setdefault(name, []).append((start, end, memoryview(data)))
        for job in jobs:
            where = f"key {job.read_item.storage_index.fqn!r} in {store.describe(job.item.file)}"
            blocks = {b: decode_verified(job.item, b, _stored_block(spans, job.item, b), where, self.verify)
                      for b in job.blocks}
            job.deliver(blocks, planner)

def decode_verified(item: StoredItem, block: int, stored: memoryview, where: str, verify: bool = True) -> Any:
    """Check one stored block against its recorded CRC32C and return its logical bytes."""
    where = f"{where}, block {block} at byte offset {item.block_offsets[block]}"
    expected = item.blocks[block][1]
    if verify:
        actual = checksum(stored)
        if actual != expected:
            raise CorruptCheckpointError(
                f"checksum mismatch for {where}: crc32c recorded {expected:08x}, read {actual:08x}. "
                "The data file is damaged; restore it or load an earlier checkpoint"
            )
    try:
        return decode_block(stored, item.block_logical_len(block), item.codec)
    except Exception as exc:  # zstd raises its own error type
        raise CorruptCheckpointError(f"cannot decompress {where}: {exc}") from None


def _stored_block(spans: dict[str, list[tuple[int, int, memoryview]]], item: StoredItem, block: int) -> memoryview:
    """The stored bytes of one block: inline in the metadata, or out of the fetched spans
    (sorted by start, as coalesce emits them)."""
    start, end = item.block_offsets[block], item.block_offsets[block + 1]
    if item.inline is not None:
        return memoryview(item.inline)[start:end]
    name = item.file
    file_spans = spans[name]
    at = bisect.bisect_right(file_spans, start, key=lambda s: s[0]) - 1
    span_start, span_end, data = file_spans[at]
    assert span_start <= start and end <= span_end, f"block {name}[{start}:{end}] was not fetched"
    return data[start - span_start : end - span_start]


def _exists(store: FsspecStore, name: str) -> bool:
    try:
        return store.exists(name)
    except CheckpointError:
        return False


@dataclass
class _ReadJob:
    """One ReadItem: which blocks of which stored item it needs, and how to hand them over."""

    read_item: ReadItem
    item: StoredItem
    blocks: list[int]

    @classmethod
    def build(cls, read_item: ReadItem, item: StoredItem) -> "_ReadJob":
        if read_item.type == LoadItemType.BYTE_IO or item.kind == "bytes":
            return cls(read_item, item, list(range(len(item.blocks))))
        itemsize = dtype_from_name(item.dtype).itemsize
        runs = box_runs(item.shape, read_item.storage_offsets, read_item.lengths)
        return cls(read_item, item, blocks_for_runs(runs, itemsize, item.block_size))

    @property
    def fetch_bytes(self) -> int:
        return sum(self.item.blocks[b][0] for b in self.blocks)

    def item_block_span(self, block: int) -> tuple[int, int]:
        return self.item.block_offsets[block], self.item.block_offsets[block + 1]

    def deliver(self, blocks: dict[int, Any], planner: LoadPlanner) -> None:
        if self.item.kind == "bytes":
            planner.load_bytes(self.read_item, io.BytesIO(b"".join(blocks[b] for b in self.blocks)))
            return
        target = planner.resolve_tensor(self.read_item).detach()
        if target.numel() > 0:
            target.copy_(self._source_view(blocks))
        planner.commit_tensor(self.read_item, target)

    def _source_view(self, blocks: dict[int, Any]) -> torch.Tensor:
        """The requested sub-box, as a strided view over the decoded blocks of the chunk."""
        item = self.item
        dtype = dtype_from_name(item.dtype)
        first, last = self.blocks[0], self.blocks[-1]
        span = bytearray(sum(item.block_logical_len(b) for b in range(first, last + 1)))
        for b in self.blocks:
            at = (b - first) * item.block_size
            span[at : at + item.block_logical_len(b)] = blocks[b]
        flat = torch.frombuffer(span, dtype=torch.uint8).view(dtype)
        strides = row_major_strides(item.shape)
        start = sum(o * s for o, s in zip(self.read_item.storage_offsets, strides))
        start -= first * item.block_size // dtype.itemsize
        return flat.as_strided(tuple(self.read_item.lengths), strides, start)


def read_manifest(store: FsspecStore) -> Manifest:
    """Read and validate ``ckptio.json``, explaining precisely why a checkpoint cannot be opened."""
    try:
        raw = store.read(METADATA_NAME)
    except FileNotFoundError:
        raise _missing_metadata_error(store) from None
    return decode_metadata(raw, store.describe(METADATA_NAME))


def _missing_metadata_error(store: FsspecStore) -> CheckpointError:
    names = store.list_names()
    if names is None:
        return CheckpointNotFoundError(f"no checkpoint at {store.url}: the path does not exist (check the URL and bucket)")
    if TORCH_DCP_METADATA_NAME in names:
        return NotCkptioCheckpointError(
            f"{store.url} holds a torch DCP checkpoint (it has '.metadata', not '{METADATA_NAME}'); load it with "
            "torch.distributed.checkpoint.FileSystemReader / FsspecReader, then save it again with ckptio.Writer"
        )
    partial = [n for n in names if is_data_file_name(n)]
    if partial:
        saves = sorted({n.split("-")[1] for n in partial})
        return IncompleteCheckpointError(
            f"{store.url} is incomplete: it holds {len(partial)} data file(s) of save(s) {saves} but no "
            f"'{METADATA_NAME}', so the save never committed (a rank failed or was killed first). Load an earlier "
            "checkpoint. Saving again to this path succeeds; the orphaned files are never read and may be deleted"
        )
    shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") if names else "nothing"
    return CheckpointNotFoundError(f"no ckptio checkpoint at {store.url}: '{METADATA_NAME}' is missing (it holds {shown})")
