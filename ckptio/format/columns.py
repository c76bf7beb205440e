"""Columns of integers as the metadata stores them, with no I/O.

COL: a JSON integer (every entry equals it) or a packed string: a width letter (``B`` ``H`` ``I`` ``Q``:
1, 2, 4, 8 bytes) then the base64 of one little-endian unsigned integer of that width per entry.
BLOCKS: a packed string only (never an integer), so a column of one entry per block is bounded by the
document's length. Every entry is below 2^63.
"""

from __future__ import annotations

import array
import base64
import binascii
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from ckptio.config import INT64_LIMIT
from ckptio.errors import CheckpointFormatError

#: Width letter -> bytes per entry, and the ``array`` type code of that width on this platform.
_WIDTHS = {"B": 1, "H": 2, "I": 4, "Q": 8}
_TYPECODES = {
    letter: next(code for code in "BHILQ" if array.array(code).itemsize == width) for letter, width in _WIDTHS.items()
}


def encode_column(values: list[int]) -> int | str:
    """A COL: the value itself when every entry has it, else the narrowest packed string."""
    if values and values.count(values[0]) == len(values):
        return values[0]
    return encode_packed(values)


def encode_packed(values: Iterable[int], letter: str | None = None) -> str:
    """The narrowest packed string of ``values`` (a list), or of that ``letter``'s width (any iterable:
    CRC32Cs, always 4 bytes, go from their records into the array without a list between)."""
    if letter is None:
        top = max(values, default=0)
        letter = next((letter for letter, width in _WIDTHS.items() if top < 1 << (8 * width)), "Q")
    packed = array.array(_TYPECODES[letter], values)
    if sys.byteorder != "little":
        packed.byteswap()
    return letter + base64.b64encode(packed.tobytes()).decode()


def encode_array(values: np.ndarray) -> int | str:
    """``encode_column`` of a numpy array of non-negative integers (the same COL for the same values)."""
    if len(values) and bool((values == values[0]).all()):
        return int(values[0])
    return encode_packed_array(values)


def encode_packed_array(values: np.ndarray, letter: str | None = None) -> str:
    """``encode_packed`` of a numpy array of non-negative integers."""
    if letter is None:
        top = int(values.max()) if len(values) else 0
        letter = next((letter for letter, width in _WIDTHS.items() if top < 1 << (8 * width)), "Q")
    return letter + base64.b64encode(values.astype(f"<u{_WIDTHS[letter]}").tobytes()).decode()


def decode_array(value: Any, count: int, what: str, packed_only: bool = False) -> np.ndarray:
    """``decode_column`` as a numpy array of int64 (every entry is below 2^63); a column of no entries
    may be absent (``None``)."""
    if type(value) is str and value[:1] in _WIDTHS:  # decoded whole: its length checked after (the same rule)
        width = _WIDTHS[value[0]]
        raw = _b64decode(value[1:], what)
        if len(raw) != count * width:
            raise CheckpointFormatError(
                f"{what} holds {len(raw) / width:g} entries of {width} bytes where {count} are expected"
            )
        return _checked(np.frombuffer(raw, dtype=f"<u{width}"), what).astype(np.int64)
    if value is None and count == 0:
        return np.zeros(0, dtype=np.int64)
    if _constant(value, what, packed_only):
        return np.full(count, value, dtype=np.int64)
    return PackedBlocks(value, count, what, packed_only).to_numpy()  # not a packed string: named there


def decode_column(value: Any, count: int, what: str, packed_only: bool = False) -> list[int]:
    """``count`` non-negative integers from a COL (a BLOCKS string when ``packed_only``)."""
    if _constant(value, what, packed_only):
        return [value] * count
    return decode_array(value, count, what, packed_only).tolist()


def _constant(value: Any, what: str, packed_only: bool) -> bool:
    """Whether a COL is one integer (every entry's), checked; a packed string is for ``PackedBlocks``."""
    if not isinstance(value, int) or isinstance(value, bool) or packed_only:
        return False
    if not 0 <= value < INT64_LIMIT:
        raise CheckpointFormatError(f"{what} must hold non-negative integers below 2^63, got {value}")
    return True


class PackedBlocks:
    """A packed column whose entries are decoded when a slice of them is asked for: checked on
    construction for its width letter and its length (no allocation), an entry range's base64 on use.
    A load needs the per-block CRC32C of the items it reads, not of all: decoding every block's CRC was
    most of a large checkpoint's decode time (base64 in CPython runs at ~0.4 GB/s)."""

    __slots__ = ("_text", "_width", "_typecode", "_count", "_what")

    def __init__(self, value: Any, count: int, what: str, packed_only: bool = True):
        letter = value[:1] if isinstance(value, str) else None
        if letter not in _WIDTHS:
            kind = "a packed string" if packed_only else "an integer or a packed string"
            raise CheckpointFormatError(
                f"{what} must be {kind} (a width letter B, H, I or Q, then base64): {value!r:.40}"
            )
        width = _WIDTHS[letter]
        text = value[1:]
        nbytes = count * width
        padding = (3 - nbytes % 3) % 3
        if len(text) % 4:
            raise CheckpointFormatError(f"{what} is not valid base64")
        padded = len(text) - len(text.rstrip("="))
        if len(text) != 4 * -(-nbytes // 3) or padded != padding:
            held = len(text) // 4 * 3 - padded
            raise CheckpointFormatError(
                f"{what} holds {held / width:g} entries of {width} bytes where {count} are expected"
            )
        self._text, self._width, self._typecode, self._count, self._what = text, width, _TYPECODES[letter], count, what

    def __len__(self) -> int:
        return self._count

    @property
    def width(self) -> int:
        """Bytes per entry."""
        return self._width

    def __getitem__(self, entries: slice) -> array.array:
        """The entries of a slice (step 1), as an ``array`` of the column's width."""
        start, stop, _ = entries.indices(self._count)
        stop = max(start, stop)
        first, end = start * self._width, stop * self._width  # bytes wanted
        skip = first % 3  # base64 decodes in groups of 4 characters = 3 bytes
        raw = _b64decode(self._text[(first - skip) // 3 * 4 : -(-end // 3) * 4], self._what)
        packed = array.array(self._typecode, raw[skip : skip + end - first])
        if sys.byteorder != "little":
            packed.byteswap()
        if self._width == 8 and packed and max(packed) >= INT64_LIMIT:
            raise CheckpointFormatError(f"{self._what} holds {max(packed)}, past the largest count or offset (2^63-1)")
        return packed

    def to_numpy(self) -> np.ndarray:
        """Every entry, as a numpy array of int64."""
        values = np.frombuffer(_b64decode(self._text, self._what), dtype=f"<u{self._width}")
        return _checked(values, self._what).astype(np.int64)


def _checked(values: np.ndarray, what: str) -> np.ndarray:
    """Unsigned entries, each below 2^63 (only 8-byte ones can reach it)."""
    if values.itemsize == 8 and len(values) and values.max() >= INT64_LIMIT:
        raise CheckpointFormatError(f"{what} holds {values.max()}, past the largest count or offset (2^63-1)")
    return values


def crc_column(value: Any, count: int, what: str) -> PackedBlocks:
    """A ``crc32c`` column (BLOCKS): entries of at most 4 bytes (a CRC32C has 32 bits; version 3 wrote
    the narrowest width, later versions 4 bytes)."""
    column = PackedBlocks(value, count, what)
    if column.width > 4:
        raise CheckpointFormatError(f"{what} holds {column.width}-byte entries; a CRC32C has 4 bytes")
    return column


def _b64decode(text: str, what: str) -> bytes:
    try:
        return _strict_b64decode(text)
    except (binascii.Error, ValueError):
        raise CheckpointFormatError(f"{what} is not valid base64") from None


if sys.version_info >= (3, 11):

    def _strict_b64decode(text: str) -> bytes:
        return binascii.a2b_base64(text, strict_mode=True)

else:

    def _strict_b64decode(text: str) -> bytes:
        return base64.b64decode(text, validate=True)


def b64(data: bytes) -> str:
    """Bytes as base64 text (an inline item's stored bytes)."""
    return base64.b64encode(data).decode()
