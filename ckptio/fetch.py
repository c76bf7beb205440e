"""Reading items back: which byte ranges a load plan needs, fetched in parallel, every block checked.

Uncompressed tensor chunks whose requested part is one contiguous run are read straight into
the destination tensor (only the edges of the first and last block go to small side buffers,
so whole blocks can still be checksummed). Everything else is staged: coalesced block spans
are fetched, verified, decompressed, and the requested sub-box copied out.
"""

from __future__ import annotations

import bisect
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from .codec import checksum, decode_block
from .errors import CorruptCheckpointError
from .layout import METADATA_NAME, StoredItem, dtype_from_name
from .ranges import blocks_for_runs, box_runs, coalesce, row_major_strides
from .storage import FsspecStore, ReadInto

# Bytes fetched per round of parallel reads, bounding the reader's extra memory.
BATCH_BYTES = 512 << 20
# Longest single ranged request after coalescing, so one large item still reads in parallel.
MAX_REQUEST_BYTES = 32 << 20


def load_items(
    store: FsspecStore,
    pairs: list[tuple[ReadItem, StoredItem]],
    planner: LoadPlanner,
    verify: bool,
    recorded_sizes: dict[str, int],
    workers: int = 4,
) -> None:
    """Deliver every ``(ReadItem, StoredItem)`` to ``planner``, in batches of bounded size;
    ``workers`` threads check and decompress blocks."""
    jobs = [_Job.build(read_item, item) for read_item, item in pairs]
    batch: list[_Job] = []
    size = 0
    for job in jobs:
        if batch and size + job.fetch_bytes > BATCH_BYTES:
            _run_batch(store, batch, planner, verify, recorded_sizes, workers)
            batch, size = [], 0
        batch.append(job)
        size += job.fetch_bytes
    if batch:
        _run_batch(store, batch, planner, verify, recorded_sizes, workers)


def verify_block(item: StoredItem, block: int, pieces: list, where: str) -> None:
    """Compare the CRC32C of a block's stored bytes (given in consecutive pieces) with the record."""
    crc = 0
    for piece in pieces:
        crc = checksum(piece, crc)
    expected = item.blocks[block][1]
    if crc != expected:
        raise CorruptCheckpointError(
            f"checksum mismatch for {where}, block {block} at byte offset {item.block_offsets[block]}: crc32c "
            f"recorded {expected:08x}, read {crc:08x}. The data file is damaged; "
            "restore it or load an earlier checkpoint"
        )


def decode_verified(item: StoredItem, block: int, stored: memoryview, where: str, verify: bool = True) -> Any:
    """Check one stored block against its recorded CRC32C and return its logical bytes."""
    if verify:
        verify_block(item, block, [stored], where)
    try:
        return decode_block(stored, item.block_logical_len(block), item.codec)
    except Exception as exc:  # zstd raises its own error type
        raise CorruptCheckpointError(f"cannot decompress {where}, block {block}: {exc}") from None


@dataclass
class _Job:
    read_item: ReadItem
    item: StoredItem
    blocks: list[int]
    run: tuple[int, int] | None = None  # logical byte range, when the request is one contiguous run
    target: torch.Tensor | None = None
    dest: memoryview | None = None
    edges: dict[int, bytearray] = field(default_factory=dict)  # block -> side buffer (direct reads only)

    @classmethod
    def build(cls, read_item: ReadItem, item: StoredItem) -> "_Job":
        if read_item.type == LoadItemType.BYTE_IO or item.kind == "bytes":
            return cls(read_item, item, list(range(len(item.blocks))))
        itemsize = dtype_from_name(item.dtype).itemsize
        runs = box_runs(item.shape, read_item.storage_offsets, read_item.lengths)
        run = (runs[0][0] * itemsize, runs[0][1] * itemsize) if len(runs) == 1 else None
        return cls(read_item, item, blocks_for_runs(runs, itemsize, item.block_size), run)

    @property
    def fetch_bytes(self) -> int:
        return sum(self.item.blocks[b][0] for b in self.blocks)

    @property
    def where(self) -> str:
        return f"key {self.read_item.storage_index.fqn!r} in {self.item.file or METADATA_NAME}"

    def prepare(self, planner: LoadPlanner) -> None:
        if self.item.kind != "tensor":
            return
        self.target = planner.resolve_tensor(self.read_item).detach()
        t, item = self.target, self.item
        if (
            self.run
            and item.codec == "raw"
            and item.inline is None
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.dtype == dtype_from_name(item.dtype)
            and t.numel() * t.element_size() == self.run[1] - self.run[0]
        ):
            self.dest = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")

    # --- direct reads into the destination tensor ---------------------------------------
    def direct_reads(self) -> list[ReadInto]:
        item, (start, stop) = self.item, self.run
        first, last = self.blocks[0], self.blocks[-1]
        reads = [ReadInto(item.file, item.offset + start, self.dest)]
        head = first * item.block_size
        if head < start:
            self.edges[first] = bytearray(start - head)
            reads.append(ReadInto(item.file, item.offset + head, memoryview(self.edges[first])))
        tail = min((last + 1) * item.block_size, item.logical_bytes)
        if stop < tail:
            self.edges[-1] = bytearray(tail - stop)
            reads.append(ReadInto(item.file, item.offset + stop, memoryview(self.edges[-1])))
        return reads

    def finish_direct(self, planner: LoadPlanner, verify: bool) -> None:
        if verify:
            item, (start, stop) = self.item, self.run
            for b in self.blocks:
                lo, hi = b * item.block_size, b * item.block_size + item.block_logical_len(b)
                pieces = []
                if lo < start:
                    pieces.append(self.edges[b])
                pieces.append(self.dest[max(lo, start) - start : min(hi, stop) - start])
                if hi > stop:
                    pieces.append(self.edges[-1])
                verify_block(item, b, pieces, self.where)
        planner.commit_tensor(self.read_item, self.target)

    # --- staged reads -------------------------------------------------------------------
    def deliver(self, blocks: dict[int, Any], planner: LoadPlanner) -> None:
        if self.item.kind == "bytes":
            planner.load_bytes(self.read_item, io.BytesIO(b"".join(blocks[b] for b in self.blocks)))
            return
        if self.target.numel() > 0:
            self.target.copy_(self._source_view(blocks))
        planner.commit_tensor(self.read_item, self.target)

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


def _run_batch(
    store: FsspecStore,
    jobs: list[_Job],
    planner: LoadPlanner,
    verify: bool,
    recorded_sizes: dict[str, int],
    workers: int,
) -> None:
    for job in jobs:
        job.prepare(planner)
    direct = [j for j in jobs if j.dest is not None]
    staged = [j for j in jobs if j.dest is None]
    wanted = {
        (j.item.file, j.item.block_offsets[b], j.item.block_offsets[b + 1])
        for j in staged
        if j.item.inline is None
        for b in j.blocks
    }
    spans = [(name, start, bytearray(end - start)) for name, start, end in coalesce(wanted, MAX_REQUEST_BYTES)]
    reads = [ReadInto(name, start, memoryview(buf)) for name, start, buf in spans]
    for job in direct:
        reads += job.direct_reads()
    _read_all(store, reads, recorded_sizes)

    by_file: dict[str, list[tuple[int, bytearray]]] = {}
    for name, start, buf in spans:  # coalesce() emits them sorted by (name, start)
        by_file.setdefault(name, []).append((start, buf))
    # Checksums and zstd release the GIL: decode all staged blocks on a few threads.
    tasks = [(job, b) for job in staged for b in job.blocks]

    def decode(task: tuple[_Job, int]) -> Any:
        job, b = task
        return decode_verified(job.item, b, _stored_block(by_file, job.item, b), job.where, verify)

    with ThreadPoolExecutor(max(1, min(workers, len(tasks)))) as pool:
        decoded = dict(zip(((id(job), b) for job, b in tasks), pool.map(decode, tasks)))
    for job in staged:
        job.deliver({b: decoded[(id(job), b)] for b in job.blocks}, planner)
    for job in direct:
        job.finish_direct(planner, verify)


def _read_all(store: FsspecStore, reads: list[ReadInto], recorded_sizes: dict[str, int]) -> None:
    try:
        counts = store.read_into(reads)
    except FileNotFoundError as exc:
        missing = sorted({r.name for r in reads if not store.exists(r.name)}) or [str(exc)]
        raise CorruptCheckpointError(
            f"data file(s) {missing} listed in {store.describe(METADATA_NAME)} are missing; the checkpoint was "
            "damaged after it was written: restore the files or load an earlier checkpoint"
        ) from None
    for read, count in zip(reads, counts):
        if count != len(read.buffer):
            raise CorruptCheckpointError(
                f"{store.describe(read.name)} is truncated: bytes {read.offset}..{read.offset + len(read.buffer)} "
                f"were needed but only {count} could be read "
                f"(the metadata records a {recorded_sizes.get(read.name, '?')}-"
                "byte file). Restore the file or load an earlier checkpoint"
            )


def _stored_block(by_file: dict[str, list[tuple[int, bytearray]]], item: StoredItem, block: int) -> memoryview:
    start, end = item.block_offsets[block], item.block_offsets[block + 1]
    if item.inline is not None:
        return memoryview(item.inline)[start:end]
    file_spans = by_file[item.file]
    span_start, buf = file_spans[bisect.bisect_right(file_spans, start, key=lambda s: s[0]) - 1]
    assert span_start <= start and end <= span_start + len(buf), f"block {item.file}[{start}:{end}] was not fetched"
    return memoryview(buf)[start - span_start : end - span_start]
