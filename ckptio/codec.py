"""Bytes in, bytes out: block checksums (CRC32C) and per-block zstd compression.

Every item is cut into fixed-size blocks. Each block is compressed on its own (so a ranged
read never needs its neighbours) and kept raw when compression does not shrink it; the
CRC32C of the stored bytes is recorded per block. CRC32C is hardware-accelerated (SSE4.2 /
ARMv8), runs at >10 GiB/s here, and is the checksum S3 itself offers.
"""

from __future__ import annotations

from typing import Iterator

import crc32c
import zstandard

RAW = "raw"
ZSTD = "zstd"


def checksum(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC32C of ``data``; pass the CRC of the preceding bytes as ``crc`` to continue it."""
    return crc32c.crc32c(data, crc)


class BlockEncoder:
    """Turns an item's logical bytes into stored blocks with their checksums."""

    def __init__(self, block_size: int, compression: str | None = None, level: int = 3):
        self.block_size = block_size
        self.codec = ZSTD if compression == ZSTD else RAW
        self._compressor = zstandard.ZstdCompressor(level=level) if self.codec == ZSTD else None

    def encode(self, data: memoryview) -> Iterator[tuple[bytes | memoryview, int]]:
        """Yield ``(stored_bytes, crc32c)`` for each block of ``data``."""
        for start in range(0, len(data), self.block_size):
            block = data[start : start + self.block_size]
            if self._compressor is not None:
                packed = self._compressor.compress(block)
                if len(packed) < len(block):
                    block = packed
            yield block, checksum(block)


def decode_block(stored: bytes | memoryview, logical_len: int, codec: str) -> bytes | memoryview:
    """Return the logical bytes of one block (its checksum must already be verified)."""
    if codec == RAW or len(stored) == logical_len:
        return stored
    return zstandard.ZstdDecompressor().decompress(stored, max_output_size=logical_len)
