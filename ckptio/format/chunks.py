"""Whether a tensor's saved chunks tile it: inside its shape, no element twice. Pure.

A sweep along the dimension where the chunks have the most distinct starts compares each chunk only
with those it meets there: about one for FSDP's row slices, the other shards of its row for 2-D
layouts. (torch's plan validation sweeps the *largest* dimension: for FSDP rows of a tensor wider
than tall, every chunk meets every other, O(ranks^2) per key.) Layouts far from a grid, which DCP
never makes, stop the sweep at a budget instead of costing billions of comparisons.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Sequence

import numpy as np

#: Comparisons the sweep may make: a 2-D grid of C chunks costs about C x (chunks per row).
COMPARISONS_PER_CHUNK = 512
COMPARISONS_BASE = 1_000_000

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


class TooIrregular(Exception):
    """The chunks are too far from a grid to check within the budget."""


def overlapping_pair(boxes: Sequence[Box], bounded: bool = True) -> tuple[int, int] | None:
    """Indices of two non-empty boxes that share an element, or None. Raises ``TooIrregular`` past
    the budget, unless not ``bounded`` (boxes from this process's own plans, not from a file)."""
    live = [i for i, (_, size) in enumerate(boxes) if all(size)]
    if len(live) < 2:
        return None
    ndim = len(boxes[live[0]][0])
    sweep = max(range(ndim), key=lambda d: len({boxes[i][0][d] for i in live}), default=0)
    live.sort(key=lambda i: boxes[i][0][sweep])
    budget = COMPARISONS_PER_CHUNK * len(live) + COMPARISONS_BASE
    active: list[tuple[int, int]] = []  # heap of (end along the sweep dimension, box index)
    for i in live:
        off, size = boxes[i]
        while active and active[0][0] <= off[sweep]:
            heapq.heappop(active)
        budget -= len(active)
        if budget < 0 and bounded:
            raise TooIrregular(f"{len(live)} chunks")
        for _, j in active:
            other_off, other_size = boxes[j]
            if all(a < b + m and b < a + n for a, n, b, m in zip(off, size, other_off, other_size, strict=True)):
                return j, i
        heapq.heappush(active, (off[sweep] + size[sweep], i))
    return None


#: Cells the grid check may paint, beyond one per chunk (4 bytes each).
GRID_CELLS_BASE = 1 << 20
#: Dimensions the grid check takes (it adds 2^ndim corners per chunk).
GRID_MAX_DIMS = 4


def grid_overlap(offsets: np.ndarray, sizes: np.ndarray) -> bool | None:
    """Whether two non-empty boxes (rows of ``offsets`` and ``sizes``, every end within int64) share
    an element, found by painting each box onto the grid of all boxes' boundaries (a difference array:
    +1/-1 at its corners, then a running sum along each dimension counts the boxes over each cell).
    ``None`` where that grid is past the budget or the boxes have too many dimensions: ``overlapping_pair``
    then decides. Vectorised: a 2-D layout of 8,192 chunks (FSDP inside tensor parallelism) takes
    milliseconds where the sweep takes ~60 ms in Python."""
    live = (sizes > 0).all(axis=1)
    offsets, ends = offsets[live], offsets[live] + sizes[live]
    count, ndim = offsets.shape
    if count < 2:
        return False
    if ndim > GRID_MAX_DIMS:
        return None
    lows, highs, cells = [], [], []
    for d in range(ndim):
        bounds = np.unique(np.concatenate([offsets[:, d], ends[:, d]]))
        lows.append(np.searchsorted(bounds, offsets[:, d]))
        highs.append(np.searchsorted(bounds, ends[:, d]))
        cells.append(len(bounds))
    if math.prod(cells) > count + GRID_CELLS_BASE:
        return None
    painted = np.zeros(cells, dtype=np.int32)
    for corner in itertools.product((0, 1), repeat=ndim):
        index = tuple(highs[d] if up else lows[d] for d, up in enumerate(corner))
        np.add.at(painted, index, -1 if sum(corner) % 2 else 1)
    for d in range(ndim):
        painted = np.cumsum(painted, axis=d, dtype=np.int32)
    return bool((painted > 1).any())


def outside(shape: Sequence[int], box: Box) -> bool:
    """Whether ``box`` reaches outside a tensor of ``shape``: another number of dimensions,
    negative offsets or sizes, or an end past the shape."""
    off, size = box
    return (
        len(off) != len(shape)
        or len(size) != len(shape)
        or any(o < 0 or n < 0 or o + n > s for o, n, s in zip(off, size, shape, strict=True))
    )


def tiling_errors(fqn: str, shape: Sequence[int], boxes: Sequence[Box], check_volume: bool) -> list[str]:
    """What is wrong with ``boxes`` as the saved chunks of tensor ``fqn``: chunks outside the shape,
    two chunks sharing elements, and (``check_volume``) a total that is not the tensor's."""
    errors = [
        f"key:{fqn} has an out of bounds chunk {list(off)}+{list(size)} for size {list(shape)}"
        for off, size in boxes
        if outside(shape, (off, size))
    ]
    pair = overlapping_pair(boxes, bounded=False)
    if pair is not None:
        (a_off, a_size), (b_off, b_size) = boxes[pair[0]], boxes[pair[1]]
        errors.append(f"key:{fqn} has overlapping chunks {list(a_off)}+{list(a_size)} and {list(b_off)}+{list(b_size)}")
    volume = sum(math.prod(size) for _, size in boxes)
    if check_volume and volume != math.prod(shape):
        errors.append(f"key:{fqn} chunks hold {volume} elements for a tensor of {math.prod(shape)}")
    return errors
