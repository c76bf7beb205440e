"""A request body made of memory the caller already holds: S3 parts and objects, GCS parts and Azure
blocks are sent from the encoded blocks (views of the staged tensors, or compressed blocks) without
joining them first.

The body is an aiohttp ``Payload``, so aiohttp sends it slice by slice straight from that memory, and
a file-like object, which is what botocore accepts as a body (it reads it only to hash the payload
when the request is signed that way, a piece at a time). ``len`` is its size for ``Content-Length``.
"""

from __future__ import annotations

import bisect
import io
import itertools
from typing import Any, Sequence

from aiohttp import payload

#: Bytes per socket write: small enough that the socket usually takes a whole slice at once (what
#: it does not take, Python 3.11's asyncio copies into its buffer; 3.12+ queues the slice itself).
SEND_SLICE_BYTES = 256 << 10


class RequestBody(payload.Payload):
    """The bytes of ``pieces`` back to back. The pieces must stay unchanged until the request is
    answered. Make one per request attempt (aiohttp may mark a sent payload consumed)."""

    def __init__(self, pieces: Sequence[Any]):
        views = tuple(memoryview(p).cast("B") for p in pieces)
        super().__init__(views, content_type="application/octet-stream")
        self._pieces = views
        self._starts = list(itertools.accumulate((len(v) for v in views), initial=0))
        self._size = self._starts[-1]
        self._position = 0

    def __len__(self) -> int:
        return self._size

    # --- aiohttp: the body on the wire ---------------------------------------------------
    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a binary request body has no text form")

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        left = self._size if content_length is None else min(content_length, self._size)
        small = bytearray()  # pieces far below a slice go out together, not a socket write each
        for piece in self._pieces:
            if left <= 0:
                break
            piece = piece[:left]
            left -= len(piece)
            if len(piece) < SEND_SLICE_BYTES // 4:
                small += piece
                if len(small) < SEND_SLICE_BYTES:
                    continue
            if small:
                await writer.write(small)
                small = bytearray()
            if len(piece) >= SEND_SLICE_BYTES // 4:
                for start in range(0, len(piece), SEND_SLICE_BYTES):
                    await writer.write(piece[start : start + SEND_SLICE_BYTES])
        if small:
            await writer.write(small)

    # --- botocore: a seekable file ------------------------------------------------------
    def read(self, size: int | None = -1) -> memoryview:
        """The next bytes, at most ``size``, as a view of one piece: a short read, as a raw stream
        may return (botocore reads until an empty one to hash the payload), so nothing is copied."""
        index = bisect.bisect_right(self._starts, self._position) - 1
        if index >= len(self._pieces):
            return memoryview(b"")
        at = self._position - self._starts[index]
        want = len(self._pieces[index]) - at if size is None or size < 0 else size
        chunk = self._pieces[index][at : at + want]
        self._position += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position
