"""An upload's body (``ckptio.storage.request_body``) sends its pieces back to back."""

from __future__ import annotations

import torch


def test_a_request_body_sends_and_reads_its_pieces_back_to_back_without_joining_large_ones():
    import asyncio
    import io

    from ckptio.storage.request_body import SEND_SLICE_BYTES, RequestBody
    from ckptio.storage.s3_checksums import crc32c_header

    big = torch.arange(SEND_SLICE_BYTES // 2, dtype=torch.int32).view(torch.uint8).numpy()  # 2 slices
    pieces = [b"head", memoryview(big), b"", b"x" * 10, bytearray(b"tail")]
    whole = b"".join(bytes(p) for p in pieces)

    class Writer:  # aiohttp's StreamWriter interface: what the body hands to the socket
        def __init__(self):
            self.chunks = []

        async def write(self, chunk):
            self.chunks.append(bytes(chunk))

    for limit in (None, len(whole), 7, SEND_SLICE_BYTES + 3):
        writer = Writer()
        asyncio.run(RequestBody(pieces).write_with_length(writer, limit))
        assert b"".join(writer.chunks) == whole[:limit]
        assert max(len(c) for c in writer.chunks) <= SEND_SLICE_BYTES
    body = RequestBody(pieces)
    assert len(body) == len(whole) and body.read(2) == b"he" and body.tell() == 2
    assert body.read(1000) == b"ad"  # a short read: to the piece's end, never a joined copy
    assert bytes(body.read(1000)) == whole[4:1004]  # within the large piece: a view
    rest = body.read(SEND_SLICE_BYTES * 2)
    assert isinstance(rest, memoryview) and bytes(rest) == whole[1004 : 4 + len(big)]
    body.seek(0, io.SEEK_END)
    assert body.read() == b"" and body.seek(-4, io.SEEK_END) == len(whole) - 4 and body.read() == b"tail"
    body.seek(0)  # as botocore hashes a payload: reads until an empty one
    assert b"".join(bytes(c) for c in iter(lambda: body.read(1 << 20), b"")) == whole
    assert crc32c_header([(p, None) for p in pieces]) == crc32c_header([(whole, None)])
