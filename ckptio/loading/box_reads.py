"""Reading sub-boxes of tensors stored whole and raw, without blocks or checksums (safetensors
files): each rank reads the bytes of its own boxes and nothing else the store does not ask for.

A box is a set of element runs of one length (``ranges.exact_box_runs``). When no gap between
them is longer than the store's ``read_gap_bytes`` (where one more request costs more than
reading the gap: object stores), the box's whole span is read in one piece and the box copied out
of it; otherwise each run is a piece of its own (local files: a pread per run, nothing extra read),
landing straight in the destination when that is a contiguous CPU tensor of the stored dtype.
Staged bytes are bounded by ``READ_BATCH_BYTES``: a larger box is cut along its first dimension.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ckptio.config import MAX_REQUEST_BYTES, READ_BATCH_BYTES
from ckptio.errors import CorruptCheckpointError, StorageError
from ckptio.loading.conversion import check_conversion
from ckptio.loading.fetch import StagingArea
from ckptio.loading.ranges import ReadPiece, exact_box_runs, plan_requests, row_major_strides
from ckptio.loading.sources import ByteSource
from ckptio.storage import LocalStore, ReadRequest


class RawTensor(Protocol):
    """Where a tensor's raw row-major bytes lie."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int


def load_boxes(
    store: ByteSource,
    pairs: list[tuple[ReadItem, RawTensor]],
    planner: LoadPlanner,
    gap_bytes: int,
    allow_rounding: bool = False,
) -> None:
    """Deliver every read item's box of its raw tensor to ``planner``, batch by batch (dtypes
    converted as ``conversion.check_conversion`` allows)."""
    staging = StagingArea()
    batch: list[_BoxJob] = []
    staged = 0
    for read_item, tensor in pairs:
        where = f"key {read_item.storage_index.fqn!r} ({tensor.file})"
        target = planner.resolve_tensor(read_item).detach()
        check_conversion(tensor.dtype, target.dtype, where, allow_rounding)
        for job in _jobs(read_item, tensor, target, gap_bytes):
            if batch and staged + job.staged_bytes > READ_BATCH_BYTES:
                _run(store, batch, planner, staging)
                batch, staged = [], 0
            batch.append(job)
            staged += job.staged_bytes
    if batch:
        _run(store, batch, planner, staging)


@dataclasses.dataclass
class _BoxJob:
    """One box (or a slab of one along its first dimension) of one read item."""

    read_item: ReadItem
    tensor: RawTensor
    whole_target: torch.Tensor  # the read item's destination
    target: torch.Tensor  # this job's part of it
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    gap_bytes: int
    last: bool  # the read item is complete once this job is done

    def __post_init__(self) -> None:
        itemsize = self.tensor.dtype.itemsize
        self.starts, run_len = exact_box_runs(self.tensor.shape, self.offsets, self.lengths)
        self.run_bytes = run_len * itemsize
        gaps = np.diff(self.starts) * itemsize - self.run_bytes if len(self.starts) > 1 else np.zeros(0)
        self.span = len(self.starts) > 1 and int(gaps.max()) <= self.gap_bytes
        t = self.target
        self.direct = (
            not self.span
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.dtype == self.tensor.dtype
            and t.numel() * itemsize == len(self.starts) * self.run_bytes
        )
        self.area: memoryview | None = None

    @property
    def staged_bytes(self) -> int:
        if self.direct or not len(self.starts):
            return 0
        if self.span:
            return int(self.starts[-1] - self.starts[0]) * self.tensor.dtype.itemsize + self.run_bytes
        return len(self.starts) * self.run_bytes

    @property
    def many_runs(self) -> bool:
        """Read run by run (not as one span), in runs no longer than one request."""
        return not self.span and len(self.starts) > 1 and self.run_bytes <= MAX_REQUEST_BYTES

    def output(self, staging: StagingArea) -> memoryview:
        """Where the runs land, one after the other: the destination itself, or staging."""
        if self.direct:
            return memoryview(self.target.reshape(-1).view(torch.uint8).numpy()).cast("B")
        self.area = staging.take(self.staged_bytes)
        return self.area

    def file_offsets(self) -> list[int]:
        return (self.starts * self.tensor.dtype.itemsize + self.tensor.start).tolist()

    def pieces(self, staging: StagingArea) -> list[ReadPiece]:
        if not len(self.starts):
            return []
        if self.span:
            out = self.output(staging)
            return [
                ReadPiece(self.tensor.file, self.tensor.start + int(self.starts[0]) * self.tensor.dtype.itemsize, out)
            ]
        out, n = self.output(staging), self.run_bytes
        return [ReadPiece(self.tensor.file, at, out[k * n : (k + 1) * n]) for k, at in enumerate(self.file_offsets())]

    def finish(self, planner: LoadPlanner) -> None:
        if self.area is not None and self.target.numel():
            flat = torch.frombuffer(self.area, dtype=torch.uint8).view(self.tensor.dtype)
            if self.span:
                source = flat.as_strided(self.lengths, row_major_strides(self.tensor.shape), 0)
            else:
                source = flat.view(self.lengths)
            self.target.copy_(source)
        self.area = None
        if self.last:
            planner.commit_tensor(self.read_item, self.whole_target)


def _jobs(read_item: ReadItem, tensor: RawTensor, target: torch.Tensor, gap_bytes: int) -> list[_BoxJob]:
    """The read item's box as one job, or as slabs along its first dimension when it would stage
    more than ``READ_BATCH_BYTES``."""
    offsets, lengths = tuple(read_item.storage_offsets), tuple(read_item.lengths)
    whole = _BoxJob(read_item, tensor, target, target, offsets, lengths, gap_bytes, last=True)
    if whole.staged_bytes <= READ_BATCH_BYTES or not lengths or lengths[0] < 2:
        return [whole]
    slabs = min(lengths[0], math.ceil(whole.staged_bytes / READ_BATCH_BYTES))
    step = math.ceil(lengths[0] / slabs)
    jobs = []
    for at in range(0, lengths[0], step):
        n = min(step, lengths[0] - at)
        slab = (offsets[0] + at, *offsets[1:]), (n, *lengths[1:])
        jobs.append(_BoxJob(read_item, tensor, target, target.narrow(0, at, n), *slab, gap_bytes, at + n == lengths[0]))
    return jobs


def _run(store: ByteSource, jobs: list[_BoxJob], planner: LoadPlanner, staging: StagingArea) -> None:
    pieces = []
    try:
        for job in jobs:
            if isinstance(store, LocalStore) and job.many_runs:  # a pread per run, without a request object each
                offsets = job.file_offsets()
                got = store.read_runs(job.tensor.file, offsets, job.run_bytes, job.output(staging))
                if got != len(offsets) * job.run_bytes:
                    raise _cut_short(store, job.tensor.file, offsets[0], offsets[-1] + job.run_bytes)
            else:
                pieces += job.pieces(staging)
        _read_pieces(store, pieces)
    except FileNotFoundError as exc:
        raise StorageError(f"a file of {store.url} disappeared while it was read: {exc}") from None
    for job in jobs:
        job.finish(planner)
    staging.release()


def _read_pieces(store: ByteSource, pieces: list[ReadPiece]) -> None:
    """Fill every piece, or raise naming the file that is shorter than it should be."""
    if not pieces:
        return
    # A box's runs never touch: only pieces that touch another one, or are too long, need planning.
    starts = {(p.name, p.offset) for p in pieces}
    ends = {(p.name, p.offset + len(p.buffer)) for p in pieces}
    planned, alone = [], []
    for p in pieces:
        touches = (p.name, p.offset) in ends or (p.name, p.offset + len(p.buffer)) in starts
        (planned if touches or len(p.buffer) > MAX_REQUEST_BYTES else alone).append(p)
    requests = [ReadRequest(p.name, p.offset, (p.buffer,)) for p in alone] + plan_requests(planned, MAX_REQUEST_BYTES)
    for request, count in zip(requests, store.read_into(requests), strict=True):
        if count != request.length:
            raise _cut_short(store, request.name, request.offset, request.offset + request.length)


def _cut_short(store: ByteSource, name: str, start: int, end: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{store.describe(name)} is shorter than its header says: bytes {start}..{end} were needed but could not "
        "all be read (the file was truncated or replaced while loading)"
    )
