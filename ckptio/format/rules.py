"""Rules of ckptio's metadata that take single values (counts, names, paths, shapes, one tensor's
chunks), each stated once; the decoder (``decode``) applies the rules over whole columns itself. A
failure is a ``CheckpointFormatError`` that says where."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptio.config import INT64_LIMIT, LIST_INDEX_LIMIT
from ckptio.errors import CheckpointFormatError
from ckptio.format.chunks import TooIrregular, grid_overlap, outside, overlapping_pair
from ckptio.format.names import is_data_file_name

# ---------------------------------------------------------------------------------------
# Numbers and names


def require_count(value: Any, what: str, where: str = "ckptio metadata") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < INT64_LIMIT:
        raise CheckpointFormatError(f"{where}: {what} must be a non-negative integer below 2^63, got {value!r:.40}")
    return value


def require_counts(values: Any, where: str = "ckptio metadata") -> list[int]:
    if not isinstance(values, list):
        raise CheckpointFormatError(f"{where}: a shape or offset must be a list, got {values!r:.40}")
    return [require_count(v, "a shape or offset entry", where) for v in values]


def refuse_data_file_name(name: Any, where: str) -> None:
    """Raise unless ``name`` is a ckptio data file name: plain, or under its own key prefix."""
    if not is_data_file_name(name):
        raise CheckpointFormatError(
            f"{where} names data file {name!r}, which is not a plain ckptio data file name inside the checkpoint "
            "nor one under its own key prefix (paths, '..' and URLs are refused)"
        )


def list_index_bound(keys: int) -> int:
    """List indices in a key's path must be below this (``LIST_INDEX_LIMIT``), so that a crafted index
    cannot make a loader build a huge list; a save checks its own paths against it before it commits."""
    return max(keys, LIST_INDEX_LIMIT)


def is_list_index(part: Any, keys: int) -> bool:
    return isinstance(part, int) and not isinstance(part, bool) and 0 <= part < list_index_bound(keys)


def check_planner_paths(planner_data: Any, keys: int, where: str) -> dict[str, tuple[Any, ...]] | None:
    """torch's planner data as stored (``{flat key: path}``), each path names and list indices."""
    if planner_data is None:
        return None
    if not isinstance(planner_data, dict) or not all(isinstance(v, (list, tuple)) for v in planner_data.values()):
        raise CheckpointFormatError(f"{where}: 'planner_data' must map keys to paths (lists of names and indices)")
    for fqn, path in planner_data.items():
        for part in path:
            if not isinstance(part, str):
                check_list_index(part, keys, fqn, where)
    return {k: tuple(v) for k, v in planner_data.items()}


def check_list_index(part: Any, keys: int, fqn: str, where: str) -> None:
    """A list index in key ``fqn``'s path is an integer below ``list_index_bound``."""
    if not is_list_index(part, keys):
        raise CheckpointFormatError(
            f"{where}: the path of key {fqn!r:.80} has a list index {part!r:.20} that is not below "
            f"{list_index_bound(keys)}"
        )


# ---------------------------------------------------------------------------------------
# Tensors and their chunks


def check_shape(shape: Any, itemsize: int, where: str) -> None:
    """A tensor shape read from a header (every dimension already within int64): its non-zero
    dimensions alone must fit 2^63-1 bytes (torch refuses a larger size even beside a 0, as an
    overflow naming nothing)."""
    if math.prod(n for n in shape if n) * itemsize >= INT64_LIMIT:
        raise CheckpointFormatError(f"{where}: shape {list(shape)!r:.200} has more elements than a tensor can hold")


def check_chunks_tile(
    size: Sequence[int],
    count: int,
    offset_columns: Sequence[Sequence[int]],
    size_columns: Sequence[Sequence[int]],
    where: str,
    cover: bool = True,
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[int]]:
    """A tensor's ``count`` chunks (a column per dimension) start at distinct offsets, lie inside its
    shape and cover each element exactly once (at most once without ``cover``: a rank's fragment of a
    save without a coordinator holds the chunks that rank wrote; the merged set must cover).
    Returns each chunk's offsets, sizes and element count."""
    offsets = list(zip(*offset_columns, strict=True)) if size else [()] * count
    sizes = list(zip(*size_columns, strict=True)) if size else [()] * count
    if len(set(offsets)) != count:
        raise CheckpointFormatError(f"{where}: a chunk is listed twice (two chunks start at the same offsets)")
    if (
        count
        and size
        and any(max(map(int.__add__, o, n)) > s for o, n, s in zip(offset_columns, size_columns, size, strict=True))
    ):
        off, sz = next((o, n) for o, n in zip(offsets, sizes, strict=True) if outside(size, (o, n)))
        raise CheckpointFormatError(
            f"{where} has a chunk at {list(off)} of size {list(sz)} outside its shape {list(size)}"
        )
    volumes = list(map(math.prod, sizes))
    short = sum(volumes) < math.prod(size) and cover
    if short or sum(volumes) > math.prod(size) or (count > 1 and _chunks_overlap(offset_columns, size_columns, where)):
        raise CheckpointFormatError(
            f"{where}: its chunks hold {sum(volumes)} elements for a shape {list(size)} of {math.prod(size)}; "
            "the checkpoint does not cover the tensor"
        )
    return offsets, sizes, volumes


def _chunks_overlap(offset_columns: Sequence[Sequence[int]], size_columns: Sequence[Sequence[int]], where: str) -> bool:
    split = [d for d, column in enumerate(offset_columns) if min(column) != max(column)]
    if len(split) == 1 and all(min(c) == max(c) for d, c in enumerate(size_columns) if d != split[0]):
        # every chunk spans the same range of the other dimensions (DCP's row or column splits):
        # two overlap when their intervals along the split dimension do
        if any(c[0] == 0 for d, c in enumerate(size_columns) if d != split[0]):
            return False  # every chunk is empty
        return _intervals_overlap(offset_columns[split[0]], size_columns[split[0]])
    painted = grid_overlap(np.array(offset_columns, dtype=np.int64).T, np.array(size_columns, dtype=np.int64).T)
    if painted is not None:
        return painted
    boxes = list(zip(zip(*offset_columns, strict=True), zip(*size_columns, strict=True), strict=True))
    try:
        return overlapping_pair(boxes) is not None
    except TooIrregular:
        raise CheckpointFormatError(
            f"{where}: its {len(boxes)} chunks are too far from a grid to check for overlaps; "
            "DCP never writes such a layout, so the metadata is damaged or crafted"
        ) from None


def _intervals_overlap(starts: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether two of the non-empty intervals ``[start, start + length)`` share a point."""
    spans = sorted((start, length) for start, length in zip(starts, lengths, strict=True) if length)
    return any(start + length > next_start for (start, length), (next_start, _) in zip(spans, spans[1:], strict=False))


def decode_inline(value: Any, where: str) -> bytes | None:
    """An inline item's stored bytes from base64 (``None`` stays ``None``)."""
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise CheckpointFormatError(f"{where}: an inline item is not valid base64") from None
