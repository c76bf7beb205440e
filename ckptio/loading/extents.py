"""Reading the items an incremental save stored in pieces: some blocks in a sibling checkpoint's data
file (unchanged since the base), the others in its own (format version 7's ``extents``).

The metadata decoder gives each such item a *virtual file* of its own (``~<n>``): its blocks back to
back, as an item is stored in a data file, and the runs of real files that hold them. Every read path
(plain and shared reads, ``verify``, export) then treats the item as any other, through a byte source
that turns each read of a virtual file into reads of the real ones (``ExtentSource``).
"""

from __future__ import annotations

import bisect
from typing import Any

from ckptio.config import MAX_REQUEST_BYTES
from ckptio.format.records import Extent, Manifest, virtual_file_sizes
from ckptio.loading.ranges import ReadPiece, plan_requests
from ckptio.storage import ReadRequest


def byte_source(source: Any, manifest: Manifest | None) -> Any:
    """``source``, reading the virtual files of ``manifest`` too where it has any."""
    extents = manifest.extents if manifest is not None else {}
    return ExtentSource(source, extents) if extents else source


def recorded_sizes(manifest: Manifest) -> dict[str, int]:
    """The size of every file the items of ``manifest`` name, virtual ones included."""
    return {**manifest.files, **virtual_file_sizes(manifest.extents)}


class ExtentSource:
    """A byte source (``sources.ByteSource``) over ``inner`` that also reads virtual files, run by run."""

    def __init__(self, inner: Any, extents: dict[str, tuple[Extent, ...]]):
        self.inner, self.extents = inner, extents
        self._starts = {name: _starts(runs) for name, runs in extents.items()}

    def __getattr__(self, name: str) -> Any:  # url, read_gap_bytes, remote, bytes_read, ...
        return getattr(self.inner, name)

    def read_into(self, requests: list[ReadRequest]) -> list[int]:
        real: list[ReadRequest] = []
        owner: list[int] = []
        for i, request in enumerate(requests):
            pieces = self._split(request) if request.name in self.extents else [request]
            real += pieces
            owner += [i] * len(pieces)
        counts = [0] * len(requests)
        if len(real) > len(requests):  # runs of one file a few blocks apart: read together, as the caller plans
            planned = plan_requests(_pieces(real), MAX_REQUEST_BYTES, self.inner.read_gap_bytes)
            got = self.inner.read_into(planned)
            if all(n == request.length for n, request in zip(got, planned, strict=True)):
                for i, request in zip(owner, real, strict=True):
                    counts[i] += request.length
                return counts
        for i, got in zip(owner, self.inner.read_into(real), strict=True):  # exact counts of a short read
            counts[i] += got
        return counts

    def size(self, name: str) -> int:
        """A virtual file's length, up to the first of its runs its real file does not hold whole."""
        if name not in self.extents:
            return self.inner.size(name)
        at = 0
        for run in self.extents[name]:
            if self.inner.size(run.file) < run.offset + run.length:
                return at
            at += run.length
        return at

    def exists(self, name: str) -> bool:
        if name not in self.extents:
            return self.inner.exists(name)
        return all(self.inner.exists(run.file) for run in self.extents[name])

    def describe(self, name: str) -> str:
        if name not in self.extents:
            return self.inner.describe(name)
        files = dict.fromkeys(run.file for run in self.extents[name])
        return "the blocks of an item in " + ", ".join(self.inner.describe(file) for file in files)

    def _split(self, request: ReadRequest) -> list[ReadRequest]:
        """The reads of the real files that fill ``request``'s buffers (a read past the virtual file's
        end is left out: the caller sees it short, as at a real file's end)."""
        runs, starts = self.extents[request.name], self._starts[request.name]
        buffers = [memoryview(b).cast("B") for b in request.buffers]
        out: list[ReadRequest] = []
        at = request.offset
        k = max(0, bisect.bisect_right(starts, at) - 1)
        while buffers and k < len(runs):
            run, start = runs[k], starts[k]
            if at >= start + run.length:
                k += 1
                continue
            room = start + run.length - at
            taken, kept = _take(buffers, room)
            if not taken:
                break
            out.append(ReadRequest(run.file, run.offset + at - start, tuple(taken)))
            at += sum(len(b) for b in taken)
            buffers = kept
            k += 1
        return out


def _pieces(requests: list[ReadRequest]) -> list[ReadPiece]:
    out, at = [], 0
    for request in requests:
        at = request.offset
        for buffer in request.buffers:
            out.append(ReadPiece(request.name, at, buffer))
            at += len(buffer)
    return out


def _starts(runs: tuple[Extent, ...]) -> list[int]:
    starts, at = [], 0
    for run in runs:
        starts.append(at)
        at += run.length
    return starts


def _take(buffers: list[memoryview], n: int) -> tuple[list[memoryview], list[memoryview]]:
    """The first ``n`` bytes of ``buffers`` (as views), and the rest."""
    taken: list[memoryview] = []
    for i, buffer in enumerate(buffers):
        if n <= 0:
            return taken, buffers[i:]
        if len(buffer) <= n:
            taken.append(buffer)
            n -= len(buffer)
        else:
            return taken + [buffer[:n]], [buffer[n:], *buffers[i + 1 :]]
    return taken, []
