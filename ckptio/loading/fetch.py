"""Reading items back: which byte ranges a load plan needs, fetched in parallel, every block checked.

Uncompressed tensor chunks whose requested part is one contiguous run are read straight into
the destination tensor (only the edges of the first and last block go to small side buffers,
so whole blocks can still be checksummed). Compressed ones with such a run are fetched in
windows of blocks, each block checked and decoded straight into the destination, so memory
stays bounded whatever the item's size. Everything else (sub-boxes, objects) is staged: its
blocks are fetched, verified, decoded, and the requested part copied out.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ckptio.config import DECODE_TASK_BYTES, MAX_REQUEST_BYTES, READ_BATCH_BYTES, cpu_threads
from ckptio.errors import damaged_file
from ckptio.format.codec import BlockSizeError, checksum, decode_block
from ckptio.format.names import METADATA_NAME, Codec, ItemKind, dtype_from_name
from ckptio.format.records import StoredItem
from ckptio.loading.conversion import check_conversion
from ckptio.loading.host_memory import empty_bytes
from ckptio.loading.ranges import ReadPiece, blocks_for_runs, box_runs, plan_requests, row_major_strides
from ckptio.loading.sources import ByteSource


def load_items(
    store: ByteSource,
    pairs: list[tuple[ReadItem, StoredItem]],
    planner: LoadPlanner,
    verify: bool,
    recorded_sizes: dict[str, int],
    workers: int = 4,
) -> None:
    """Deliver every ``(ReadItem, StoredItem)`` to ``planner``, in batches that stage at most
    ``READ_BATCH_BYTES`` (or one sub-box item larger than that); ``workers`` threads check and
    decode blocks. Destinations are resolved one item at a time, as the batches reach them."""
    load_jobs(store, prepared_jobs(pairs, planner), planner, verify, recorded_sizes, workers)


def prepared_jobs(
    pairs: Iterable[tuple[ReadItem, StoredItem]], planner: LoadPlanner, allow_rounding: bool = False
) -> Iterator["ReadJob"]:
    """Each pair's job, its destination resolved (``planner.resolve_tensor``, once per read item) and
    its dtype conversion checked (``conversion.check_conversion``)."""
    for read_item, item in pairs:
        job = ReadJob.build(read_item, item)
        job.prepare(planner, allow_rounding)
        yield job


def load_jobs(
    store: ByteSource,
    jobs: Iterable["ReadJob"],
    planner: LoadPlanner,
    verify: bool,
    recorded_sizes: dict[str, int],
    workers: int = 4,
) -> None:
    """``load_items`` for jobs already prepared."""
    batch: list[_Window] = []
    size = 0
    actual_sizes = _ActualSizes(store)
    staging = StagingArea()
    with ThreadPoolExecutor(cpu_threads(workers)) as pool:
        run = _BatchRun(store, planner, verify, recorded_sizes, pool, staging)
        for job in jobs:
            item = job.item
            for window in job.windows(READ_BATCH_BYTES):
                staged = 0 if window.direct else window.fetch_bytes
                if staged > MAX_REQUEST_BYTES:
                    # Large buffers are allocated only for bytes the file really holds: the sizes in
                    # the metadata are claims, not facts.
                    actual_sizes.require(item, window.blocks[-1])
                if batch and size + staged > READ_BATCH_BYTES:
                    run(batch)
                    batch, size = [], 0
                batch.append(window)
                size += staged
        if batch:
            run(batch)


def read_item_blocks(
    store: ByteSource, item: StoredItem, where: str, window_bytes: int = MAX_REQUEST_BYTES
) -> Iterator[tuple[int, Any]]:
    """Every block of ``item``, checked and decoded, in order, fetched ``window_bytes`` at a time
    (what ``ckptio verify`` reads with)."""
    first = 0
    while first < len(item.blocks):
        last, size = first, 0
        while last < len(item.blocks) and (last == first or size + item.blocks[last][0] <= window_bytes):
            size += item.blocks[last][0]
            last += 1
        stored = _fetch_blocks(store, item, range(first, last), {})
        for b in range(first, last):
            yield b, decode_verified(item, b, stored[b], where)
        first = last


def verify_block(item: StoredItem, block: int, pieces: list, where: str) -> None:
    """Compare the CRC32C of a block's stored bytes (given in consecutive pieces) with the record."""
    crc = 0
    for piece in pieces:
        crc = checksum(piece, crc)
    expected = item.blocks[block][1]
    if crc != expected:
        raise damaged_file(
            f"checksum mismatch for {where}, block {block} at byte offset {item.block_offsets[block]}: crc32c "
            f"recorded {expected:08x}, read {crc:08x}. The data file is damaged; "
            "restore it or load an earlier checkpoint",
            item.file or None,
        )


def decode_verified(
    item: StoredItem, block: int, stored: memoryview, where: str, verify: bool = True, out: memoryview | None = None
) -> Any:
    """Check one stored block against its recorded CRC32C and return its logical bytes (``out``
    itself, when the codec could decode into it)."""
    if verify:
        verify_block(item, block, [stored], where)
    try:
        return decode_block(stored, item.block_logical_len(block), item.codec, item.itemsize, out)
    except BlockSizeError as exc:
        raise damaged_file(f"{where}, block {block}: {exc}; the checkpoint is damaged", item.file or None) from None
    except Exception as exc:  # zstd raises its own error type
        raise damaged_file(f"cannot decompress {where}, block {block}: {exc}", item.file or None) from None


@dataclass
class ReadJob:
    """One read item: where its bytes are stored and where they go."""

    read_item: ReadItem
    item: StoredItem
    blocks: list[int]
    run: tuple[int, int] | None = None  # logical byte range, when the request is one contiguous run
    target: torch.Tensor | None = None
    dest: memoryview | None = None  # the target's bytes, when they are exactly ``run``

    @classmethod
    def build(cls, read_item: ReadItem, item: StoredItem) -> "ReadJob":
        if read_item.type == LoadItemType.BYTE_IO or item.kind == ItemKind.BYTES:
            return cls(read_item, item, list(range(len(item.blocks))))
        itemsize = dtype_from_name(item.dtype).itemsize
        runs = box_runs(item.shape, read_item.storage_offsets, read_item.lengths)
        run = (runs[0][0] * itemsize, runs[0][1] * itemsize) if len(runs) == 1 else None
        return cls(read_item, item, blocks_for_runs(runs, itemsize, item.block_size), run)

    @property
    def where(self) -> str:
        return f"key {self.read_item.storage_index.fqn!r} in {self.item.file or METADATA_NAME}"

    def prepare(self, planner: LoadPlanner, allow_rounding: bool = False) -> None:
        if self.item.kind != ItemKind.TENSOR:
            return
        self.target = planner.resolve_tensor(self.read_item).detach()
        t = self.target
        check_conversion(dtype_from_name(self.item.dtype), t.dtype, self.where, allow_rounding)
        if (
            self.run
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.dtype == dtype_from_name(self.item.dtype)
            and t.numel() * t.element_size() == self.run[1] - self.run[0]
        ):
            self.dest = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")

    @property
    def direct(self) -> bool:
        """Whether the stored bytes of ``run`` are read straight into ``dest`` (raw, in a data file)."""
        return self.dest is not None and self.item.codec == Codec.RAW and self.item.inline is None

    def placement(self) -> tuple[str, int, memoryview] | None:
        """``(file, offset, dest)``: where a direct job's stored bytes lie, and the memory they go to."""
        return (self.item.file, self.item.offset + self.run[0], self.dest) if self.direct else None

    def windows(self, max_bytes: int) -> Iterator["_Window"]:
        """The job in windows of blocks: only jobs that decode straight into ``dest`` are split."""
        if self.dest is None or self.direct or not self.blocks:
            yield _Window(self, self.blocks, last=True, direct=self.direct)
            return
        start, size = 0, 0
        for i, b in enumerate(self.blocks):
            stored = self.item.blocks[b][0]
            if i > start and size + stored > max_bytes:
                yield _Window(self, self.blocks[start:i], last=False)
                start, size = i, 0
            size += stored
        yield _Window(self, self.blocks[start:], last=True)

    def commit(self, planner: LoadPlanner) -> None:
        planner.commit_tensor(self.read_item, self.target)


@dataclass
class _Window:
    """Some of a job's blocks, fetched in one batch."""

    job: ReadJob
    blocks: list[int]
    last: bool  # commit the job once this window is done
    direct: bool = False  # raw bytes read straight into the destination
    stored: dict[int, memoryview] = field(default_factory=dict)  # block -> stored bytes (staged)
    edges: dict[int, bytearray] = field(default_factory=dict)  # block -> side buffer (direct)

    @property
    def fetch_bytes(self) -> int:
        return sum(self.job.item.blocks[b][0] for b in self.blocks)

    def pieces(self, staging: "StagingArea") -> list[ReadPiece]:
        item = self.job.item
        if self.direct:
            return self._direct_pieces()
        if item.inline is not None:
            self.stored = {b: memoryview(item.inline)[_span(item, b)] for b in self.blocks}
            return []
        # The blocks a sub-box needs need not be consecutive (a column slice of a row-major chunk
        # skips whole blocks between rows): they are packed one after another in the staging area.
        area = staging.take(self.fetch_bytes)
        pieces, at = [], 0
        for b in self.blocks:
            pieces.append(self.piece(b, area[at : at + item.blocks[b][0]]))
            at += item.blocks[b][0]
        return pieces

    @property
    def reads_per_block(self) -> bool:
        """Whether the window's stored blocks may be read one task at a time (``piece``): each is
        decoded into the destination, so its stored bytes are dead once decoded."""
        return not self.direct and self.job.dest is not None and self.job.item.inline is None

    def piece(self, b: int, memory: memoryview) -> ReadPiece:
        """The read that puts block ``b``'s stored bytes into ``memory``, where ``decode`` finds them."""
        self.stored[b] = memory
        return ReadPiece(self.job.item.file, self.job.item.block_offsets[b], memory)

    def _direct_pieces(self) -> list[ReadPiece]:
        item, (start, stop) = self.job.item, self.job.run
        first, last = self.blocks[0], self.blocks[-1]
        pieces = [ReadPiece(item.file, item.offset + start, self.job.dest)]
        head = first * item.block_size
        if head < start:
            self.edges[first] = bytearray(start - head)
            pieces.append(ReadPiece(item.file, item.offset + head, memoryview(self.edges[first])))
        tail = min((last + 1) * item.block_size, item.logical_bytes)
        if stop < tail:
            self.edges[-1] = bytearray(tail - stop)
            pieces.append(ReadPiece(item.file, item.offset + stop, memoryview(self.edges[-1])))
        return pieces

    def verify_direct(self) -> None:
        item, (start, stop), dest = self.job.item, self.job.run, self.job.dest
        for b in self.blocks:
            lo, hi = b * item.block_size, b * item.block_size + item.block_logical_len(b)
            pieces = []
            if lo < start:
                pieces.append(self.edges[b])
            pieces.append(dest[max(lo, start) - start : min(hi, stop) - start])
            if hi > stop:
                pieces.append(self.edges[-1])
            verify_block(item, b, pieces, self.job.where)

    def decode(self, b: int, verify: bool) -> Any:
        """Check and decode block ``b``; when the job has a destination, write its part there
        (straight into it, when the block lies wholly inside)."""
        job = self.job
        if job.dest is None:
            return decode_verified(job.item, b, self.stored.pop(b), job.where, verify)
        lo, n = b * job.item.block_size, job.item.block_logical_len(b)
        start, stop = job.run
        inside = job.dest[lo - start : lo + n - start] if start <= lo and lo + n <= stop else None
        data = decode_verified(job.item, b, self.stored.pop(b), job.where, verify, out=inside)
        if data is not inside:
            a, z = max(lo, start), min(lo + n, stop)
            job.dest[a - start : z - start] = memoryview(data)[a - lo : z - lo]
        return None

    def deliver(self, blocks: dict[int, Any], planner: LoadPlanner) -> None:
        """Hand a staged job's decoded blocks to the planner."""
        job = self.job
        if job.item.kind == ItemKind.BYTES:
            planner.load_bytes(job.read_item, io.BytesIO(b"".join(blocks[b] for b in self.blocks)))
            return
        if job.target.numel() > 0:
            job.target.copy_(self._source_view(blocks))
        job.commit(planner)

    def _source_view(self, blocks: dict[int, Any]) -> torch.Tensor:
        """The requested sub-box, as a strided view over the decoded blocks of the chunk."""
        item, read_item = self.job.item, self.job.read_item
        dtype = dtype_from_name(item.dtype)
        first, last = self.blocks[0], self.blocks[-1]
        # Only the needed blocks are filled, and the view reads only their bytes: no zeroing needed.
        span = empty_bytes(sum(item.block_logical_len(b) for b in range(first, last + 1)))
        for b in self.blocks:
            at = (b - first) * item.block_size
            span[at : at + item.block_logical_len(b)] = np.frombuffer(blocks[b], dtype=np.uint8)
        flat = torch.from_numpy(span).view(dtype)
        strides = row_major_strides(item.shape)
        start = sum(o * s for o, s in zip(read_item.storage_offsets, strides, strict=True))
        start -= first * item.block_size // dtype.itemsize
        return flat.as_strided(tuple(read_item.lengths), strides, start)


class _ActualSizes:
    """Data-file sizes as the store reports them, asked once per file per load."""

    def __init__(self, store: ByteSource):
        self.store, self.sizes = store, {}

    def require(self, item: StoredItem, last_block: int) -> None:
        if item.inline is not None:
            return
        if item.file not in self.sizes:
            try:
                self.sizes[item.file] = self.store.size(item.file)
            except FileNotFoundError:
                self.sizes[item.file] = -1
        end = item.block_offsets[last_block + 1]
        if self.sizes[item.file] < end:
            held = "is missing" if self.sizes[item.file] < 0 else f"holds {self.sizes[item.file]} bytes"
            raise damaged_file(
                f"{self.store.describe(item.file)} {held}, but the metadata places stored bytes up to offset {end} "
                "in it (truncated, or the metadata is not trustworthy). Restore the file or load an earlier checkpoint",
                item.file,
            )


class StagingArea:
    """Memory for stored bytes on their way to being checked and decoded: one buffer of
    ``READ_BATCH_BYTES``, allocated on first use and reused by every batch of a load (fresh
    memory costs a page fault per page; a window larger than it gets a buffer of its own)."""

    def __init__(self) -> None:
        self.buffer: memoryview | None = None
        self.used = 0

    def take(self, n: int) -> memoryview:
        if n > READ_BATCH_BYTES - self.used:
            return memoryview(empty_bytes(n))
        if self.buffer is None:
            self.buffer = memoryview(empty_bytes(READ_BATCH_BYTES))
        self.used += n
        return self.buffer[self.used - n : self.used]

    def release(self) -> None:
        self.used = 0


def _span(item: StoredItem, block: int) -> slice:
    return slice(item.block_offsets[block], item.block_offsets[block + 1])


@dataclass
class _BatchRun:
    """Reads, checks, decodes and delivers batches of windows, on one thread pool for the whole load.

    From a remote source a batch's reads go out together (the store spreads them over its
    connections), then its blocks are checked and decoded. From a local one, a window decoded
    straight into its destination is read by the thread that decodes it, a task's blocks at a time,
    into memory that thread reuses: the bytes are checked and decoded while still in its cache, reads
    overlap decodes, and no batch-sized buffer is touched (fresh memory costs a page fault per page).
    """

    store: ByteSource
    planner: LoadPlanner
    verify: bool
    recorded_sizes: dict[str, int]
    pool: ThreadPoolExecutor
    staging: "StagingArea"

    def __call__(self, windows: list[_Window]) -> None:
        in_task = not self.store.remote
        pieces = [p for w in windows if not (in_task and w.reads_per_block) for p in w.pieces(self.staging)]
        read_pieces(self.store, pieces, self.recorded_sizes)
        # Checksums and zstd release the GIL: check and decode all staged blocks on a few threads,
        # in tasks of about DECODE_TASK_BYTES (one future per small block costs more than its decode).
        tasks: list[list[tuple[_Window, int]]] = [[]]
        size = 0
        for w in windows:
            for b in [] if w.direct else w.blocks:
                if size >= DECODE_TASK_BYTES:
                    tasks.append([])
                    size = 0
                tasks[-1].append((w, b))
                size += w.job.item.blocks[b][0]
        decoded = self.pool.map(lambda task: self._decode(task, in_task), tasks)
        by_window: dict[int, dict[int, Any]] = {}
        for task, results in zip(tasks, decoded, strict=True):
            for (w, b), data in zip(task, results, strict=True):
                by_window.setdefault(id(w), {})[b] = data
        for w in windows:
            if w.direct:
                if self.verify:
                    w.verify_direct()
                w.job.commit(self.planner)
            elif w.job.dest is None:
                w.deliver(by_window.get(id(w), {}), self.planner)
            elif w.last:
                w.job.commit(self.planner)
        self.staging.release()

    def _decode(self, task: list[tuple[_Window, int]], in_task: bool) -> list[Any]:
        if in_task:
            reads = [(w, b) for w, b in task if w.reads_per_block]
            memory = _task_memory(sum(w.job.item.blocks[b][0] for w, b in reads))
            pieces, at = [], 0
            for w, b in reads:
                pieces.append(w.piece(b, memory[at : at + w.job.item.blocks[b][0]]))
                at += len(pieces[-1].buffer)
            read_pieces(self.store, pieces, self.recorded_sizes)
        return [w.decode(b, self.verify) for w, b in task]


_thread_memory = threading.local()


def _task_memory(n: int) -> memoryview:
    """``n`` bytes this thread reuses for each task's stored blocks (decoded before the next task)."""
    held = getattr(_thread_memory, "buffer", None)
    if held is None or len(held) < n:
        held = _thread_memory.buffer = memoryview(empty_bytes(max(n, DECODE_TASK_BYTES * 2)))
    return held[:n]


def _fetch_blocks(
    store: ByteSource, item: StoredItem, blocks: range, recorded_sizes: dict[str, int]
) -> dict[int, memoryview]:
    if item.inline is not None:
        return {b: memoryview(item.inline)[_span(item, b)] for b in blocks}
    stored = {b: memoryview(empty_bytes(item.blocks[b][0])) for b in blocks}
    read_pieces(store, [ReadPiece(item.file, item.block_offsets[b], stored[b]) for b in blocks], recorded_sizes)
    return stored


def read_pieces(
    store: ByteSource, pieces: list[ReadPiece], recorded_sizes: dict[str, int], gap: int | None = None
) -> None:
    """Fill ``pieces``, merging reads up to ``gap`` bytes apart (default: the store's ``read_gap_bytes``)."""
    if not pieces:
        return
    requests = plan_requests(pieces, MAX_REQUEST_BYTES, store.read_gap_bytes if gap is None else gap)
    try:
        counts = store.read_into(requests)
    except FileNotFoundError as exc:
        missing = sorted({r.name for r in requests if not store.exists(r.name)}) or [str(exc)]
        raise damaged_file(
            f"data file(s) {missing} listed in {store.describe(METADATA_NAME)} are missing; the checkpoint was "
            "damaged after it was written: restore the files or load an earlier checkpoint",
            missing[0],
        ) from None
    for request, count in zip(requests, counts, strict=True):
        if count != request.length:
            raise damaged_file(
                f"{store.describe(request.name)} is truncated: bytes "
                f"{request.offset}..{request.offset + request.length} were needed but only {count} could be read "
                f"(the metadata records a {recorded_sizes.get(request.name, '?')}-"
                "byte file). Restore the file or load an earlier checkpoint",
                request.name,
            )
