"""The 0.x decoders' rules about stored items, over columns (one entry per item of a key): version 3
stores them so and checks a column at C speed, version 1 passes columns of one entry. The 1.0 decoder
applies the same rules to whole tables (``ckptio.format.decode``)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ckptio.config import MAX_BLOCK_SIZE_LIMIT, ZSTD_MAX_RATIO, is_block_size
from ckptio.errors import CheckpointFormatError
from ckptio.format.names import CODECS, PLANE_ITEMSIZES, Codec

_PLANE_CODEC = CODECS.index(Codec.ZSTD_BYTEPLANES)


def _item(where: str, i: int, count: int) -> str:
    """``where``, and which item when a key has more than one."""
    return f"{where}: item {i}" if count > 1 else where


# ---------------------------------------------------------------------------------------
# Stored items (columns: one entry per item of a key)


def check_codecs(codecs: Sequence[int], itemsize: int | Sequence[int], version: int, where: str) -> None:
    """Each codec number is in the codec table and in format ``version``; byte planes only for tensors
    of 2-, 4- or 8-byte elements (``itemsize``: of every item, or of each; 0 for objects)."""
    if not codecs:
        return
    planes = version >= Codec.ZSTD_BYTEPLANES.format_version
    if isinstance(itemsize, int):
        planes_fit = planes and itemsize in PLANE_ITEMSIZES
    else:
        planes_fit = planes and all(
            n in PLANE_ITEMSIZES for n, c in zip(itemsize, codecs, strict=True) if c == _PLANE_CODEC
        )
    if max(codecs) < len(CODECS) and (planes_fit or _PLANE_CODEC not in codecs):
        return
    for i, number in enumerate(codecs):
        item_size = itemsize if isinstance(itemsize, int) else itemsize[i]
        if number >= len(CODECS):
            raise CheckpointFormatError(f"{_item(where, i, len(codecs))} has unknown codec number {number}")
        codec = CODECS[number]
        if codec.format_version > version:
            raise CheckpointFormatError(f"{where} uses codec {codec.value!r}, which format version {version} lacks")
        if codec is Codec.ZSTD_BYTEPLANES and item_size not in PLANE_ITEMSIZES:
            raise CheckpointFormatError(
                f"{_item(where, i, len(codecs))} uses byte planes but is not a tensor of 2-, 4- or 8-byte elements"
            )


def check_block_sizes(blocks: Sequence[int], where: str) -> None:
    """Each item's block size is one ckptio writes (``config.is_block_size``)."""
    if not blocks or (
        min(blocks) > 0
        and max(blocks) <= MAX_BLOCK_SIZE_LIMIT
        and not any(b % 64 for b in (set(blocks) if len(blocks) > 64 else blocks))
    ):
        return
    i, block = next((i, b) for i, b in enumerate(blocks) if not is_block_size(b))
    raise CheckpointFormatError(f"{_item(where, i, len(blocks))} has invalid block_size {block}")


def check_file_numbers(files: Sequence[int], ats: Sequence[int], file_count: int, where: str) -> None:
    """Each item names one of the checkpoint's data files (1-based), or 0: kept inline, at offset 0."""
    inline_elsewhere = 0 in files and any(a for f, a in zip(files, ats, strict=True) if not f)
    if not files or (max(files) <= file_count and not inline_elsewhere):
        return
    for i, (file, at) in enumerate(zip(files, ats, strict=True)):
        if file > file_count or (file == 0 and at != 0):
            raise CheckpointFormatError(
                f"{_item(where, i, len(files))} points at data file number {file} (offset {at}); the checkpoint "
                f"has {file_count} (0 = inline, at offset 0)"
            )


def check_block_lengths(lengths: Sequence[int], logical: int, block: int, raw: bool, where: str) -> int:
    """The stored bytes of one item's blocks, each checked against its logical length: equal when
    ``raw``; compressed, no longer and no more than ``ZSTD_MAX_RATIO`` times shorter."""
    if not lengths:
        return 0
    last = logical - (len(lengths) - 1) * block
    full = lengths[:-1]
    fits = min(lengths) > 0 and max(full, default=block) <= block and lengths[-1] <= last
    if raw:
        fits = fits and full.count(block) == len(full) and lengths[-1] == last
    else:
        fits = fits and min(full, default=block) * ZSTD_MAX_RATIO >= block and lengths[-1] * ZSTD_MAX_RATIO >= last
    if not fits:
        expected = [block] * len(full) + [last]
        i = next(
            i
            for i, (n, m) in enumerate(zip(lengths, expected, strict=True))
            if n <= 0 or n > m or (n != m if raw else n * ZSTD_MAX_RATIO < m)
        )
        raise CheckpointFormatError(f"{where} block {i} has stored length {lengths[i]} for {expected[i]} logical bytes")
    return sum(lengths)


def check_inline_bytes(data: bytes | None, stored: int, where: str) -> None:
    """An item kept inline holds exactly its blocks' stored bytes."""
    if data is None or len(data) != stored:
        raise CheckpointFormatError(f"{where} is stored inline but its bytes do not match its blocks")


def check_spans(
    files: Sequence[int], ats: Sequence[int], stored: Sequence[int], names: Sequence[str], sizes: Sequence[int],
    where: str,
) -> None:  # fmt: skip
    """Each item in a data file (number ``f``: ``names[f - 1]`` of ``sizes[f - 1]`` bytes) lies inside it."""
    ends = list(map(operator.add, ats, stored))
    distinct = set(files)
    if len(distinct) == 1 and (0 in distinct or max(ends, default=0) <= sizes[files[0] - 1]):
        return  # every item in one file (a rank's own keys), or all inline: checked at C speed
    if not any(f and end > sizes[f - 1] for f, end in zip(files, ends, strict=True)):
        return
    i = next(i for i, (f, at, n) in enumerate(zip(files, ats, stored, strict=True)) if f and at + n > sizes[f - 1])
    file, at, n = files[i], ats[i], stored[i]
    raise CheckpointFormatError(
        f"{_item(where, i, len(files))} spans bytes {at}..{at + n} of {names[file - 1]}, which the metadata says "
        f"holds {sizes[file - 1]} bytes"
    )
