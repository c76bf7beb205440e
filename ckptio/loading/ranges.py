"""Which stored bytes a read needs, and how they are requested: sub-box arithmetic over
row-major chunks, and the one policy that merges and splits ranged reads. Pure."""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from ckptio.loading.host_memory import empty_bytes
from ckptio.storage.base import ReadRequest

# Past this many separate row runs, a sub-box touches (nearly) every block in its span anyway.
_MAX_RUNS = 4096


def row_major_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def box_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous element runs ``(start, stop)`` covering a sub-box, or ``[(first, last+1)]``
    when there would be more than ``_MAX_RUNS`` of them."""
    if not shape:
        return [(0, 1)]
    if any(n == 0 for n in lengths):
        return []
    strides = row_major_strides(shape)
    # The innermost dims a run spans: trailing full dims plus the last partial one.
    split = len(shape) - 1
    while split > 0 and offsets[split] == 0 and lengths[split] == shape[split]:
        split -= 1
    run_len = lengths[split] * strides[split]
    base = sum(o * s for o, s in zip(offsets, strides, strict=True))
    outer = lengths[:split]
    if math.prod(outer) > _MAX_RUNS:
        last = base + sum((n - 1) * s for n, s in zip(lengths, strides, strict=True))
        return [(base, last + 1)]
    runs = []
    for idx in _product(outer):
        start = base + sum(i * s for i, s in zip(idx, strides, strict=False))
        runs.append((start, start + run_len))
    return runs


def exact_box_runs(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[np.ndarray, int]:
    """The sub-box as ascending element runs of one common length: ``(starts, run length)``,
    with no cap on their number (for files without blocks, read run by run)."""
    if not shape:
        return np.zeros(1, dtype=np.int64), 1
    if any(n == 0 for n in lengths):
        return np.zeros(0, dtype=np.int64), 0
    strides = row_major_strides(shape)
    split = len(shape) - 1
    while split > 0 and offsets[split] == 0 and lengths[split] == shape[split]:
        split -= 1
    starts = np.array([sum(o * s for o, s in zip(offsets, strides, strict=True))], dtype=np.int64)
    for dim in range(split):  # outer to inner, so the starts come out in ascending order
        steps = np.arange(lengths[dim], dtype=np.int64) * strides[dim]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts, lengths[split] * strides[split]


def _product(lengths: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not lengths:
        yield ()
        return
    for head in range(lengths[0]):
        for tail in _product(lengths[1:]):
            yield (head, *tail)


def blocks_for_runs(runs: Iterable[tuple[int, int]], itemsize: int, block_size: int) -> list[int]:
    """Sorted indices of the blocks that hold any byte of the element runs."""
    needed: set[int] = set()
    for start, stop in runs:
        first = start * itemsize // block_size
        last = (stop * itemsize - 1) // block_size
        needed.update(range(first, last + 1))
    return sorted(needed)


class ReadPiece(NamedTuple):
    """Bytes of file ``name`` from ``offset`` on, to land in ``buffer``."""

    name: str
    offset: int
    buffer: memoryview


def plan_requests(pieces: Iterable[ReadPiece], max_len: int, gap: int = 0) -> list[ReadRequest]:
    """The ranged requests that fill ``pieces``: a piece longer than ``max_len`` is split, and
    pieces that touch in one file are merged, so every request is at most ``max_len`` bytes
    (remote stores charge per request; one huge request would read with no parallelism).
    Pieces at most ``gap`` bytes apart are merged too, the bytes between them read and dropped
    (the store's ``read_gap_bytes``: where another request costs more than reading the gap)."""
    split = [
        (name, offset + at, offset + at + len(buffer[at : at + max_len]), buffer[at : at + max_len])
        for name, offset, buffer in pieces
        for at in range(0, len(buffer), max_len)
    ]
    if gap > 0:
        split = _bridge_gaps(split, gap, max_len)
    return [ReadRequest(name, start, tuple(buffers)) for name, start, _, buffers in _merge_touching(split, max_len)]


def _bridge_gaps(spans: list[tuple[str, int, int, memoryview]], gap: int, max_len: int) -> list:
    """``spans`` plus, between two of one file at most ``gap`` bytes apart, a span for the bytes
    between them into a throwaway buffer, wherever the merged request stays within ``max_len``."""
    scratch = memoryview(empty_bytes(gap))  # shared by every bridge: never read
    out: list[tuple[str, int, int, memoryview]] = []
    run_start = 0
    for span in sorted(spans, key=lambda s: (s[0], s[1], s[2])):
        name, start, end, _ = span
        last = out[-1] if out else None
        if last and last[0] == name and last[2] <= start and end - run_start <= max_len:
            if start - last[2] > gap:
                run_start = start
            elif start > last[2]:
                out.append((name, last[2], start, scratch[: start - last[2]]))
        else:
            run_start = start
        out.append(span)
    return out


def _merge_touching(spans: list[tuple[str, int, int, object]], max_len: int) -> list[tuple[str, int, int, list]]:
    """Sort ``(name, start, end, payload)`` spans and merge those that touch, up to ``max_len`` bytes each."""
    merged: list[list] = []
    for name, start, end, payload in sorted(spans, key=lambda s: (s[0], s[1], s[2])):
        last = merged[-1] if merged else None
        if last and last[0] == name and last[2] == start and end - last[1] <= max_len:
            last[2] = end
            last[3].append(payload)
        else:
            merged.append([name, start, end, [payload]])
    return [tuple(m) for m in merged]
