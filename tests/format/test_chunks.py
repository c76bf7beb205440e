"""Whether saved chunks overlap (``format/chunks.py``): the vectorised grid check against the sweep, over
any boxes inside a small shape (empty boxes, shared edges, grids and irregular layouts)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.format.chunks import GRID_MAX_DIMS, grid_overlap, overlapping_pair


@st.composite
def boxes_in_a_shape(draw) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=GRID_MAX_DIMS))
    boxes = []
    for _ in range(draw(st.integers(2, 12))):
        offsets = tuple(draw(st.integers(0, n)) for n in shape)
        sizes = tuple(draw(st.integers(0, n - o)) for n, o in zip(shape, offsets, strict=True))
        boxes.append((offsets, sizes))
    return boxes


@settings(max_examples=300, deadline=None)
@given(boxes_in_a_shape())
def test_the_grid_check_finds_an_overlap_exactly_when_the_sweep_does(boxes):
    offsets = np.array([o for o, _ in boxes], dtype=np.int64)
    sizes = np.array([n for _, n in boxes], dtype=np.int64)
    assert grid_overlap(offsets, sizes) == (overlapping_pair(boxes, bounded=False) is not None)


def test_a_grid_past_the_budget_or_of_many_dimensions_is_left_to_the_sweep():
    far_apart = np.array([[i * 3, j * 3] for i in range(1100) for j in range(2)], dtype=np.int64)
    irregular = np.column_stack([np.arange(2200) * 7, np.arange(2200)[::-1] * 5])  # 2,200^2 cells
    assert grid_overlap(irregular, np.ones_like(irregular)) is None
    assert grid_overlap(far_apart, np.ones_like(far_apart)) is False
    five = np.zeros((2, GRID_MAX_DIMS + 1), dtype=np.int64)
    assert grid_overlap(five, np.ones_like(five)) is None
