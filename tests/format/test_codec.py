"""Checksums and block codecs (``ckptio.format.codec``): round trips, the compression choice, CRC32C combination."""

from __future__ import annotations

import os

import pytest
import torch

from ckptio.format.codec import BlockEncoder, block_size_for, checksum, decode_block


def test_blocks_raw_roundtrip_and_checksums():
    data = memoryview(bytes(range(256)) * 10)
    blocks = [(stored, crc) for stored, crc, _ in BlockEncoder(1024).encode(data, 1024)]
    assert [len(b) for b, _ in blocks] == [1024, 1024, 512]
    assert [c for _, c in blocks] == [checksum(data[i : i + 1024]) for i in range(0, 2560, 1024)]
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_blocks_zstd_shrinks_compressible_and_keeps_random_raw():
    enc = BlockEncoder(4096, "zstd")
    zeros = list(enc.encode(memoryview(bytes(8192)), 4096))
    assert all(len(b) < 100 for b, _, _ in zeros)
    assert decode_block(zeros[0][0], 4096, "zstd") == bytes(4096)
    noise = os.urandom(4096)
    ((stored, _, _),) = enc.encode(memoryview(noise), 4096)
    assert bytes(stored) == noise and decode_block(stored, 4096, "zstd") == noise


def test_digests_come_with_the_blocks_only_when_asked_and_are_of_the_logical_bytes():
    from ckptio.format.codec import block_digest

    data = memoryview(bytes(4096) + os.urandom(4096))
    assert all(d is None for _, _, d in BlockEncoder(4096, "zstd").encode(data, 4096))
    blocks = list(BlockEncoder(4096, "zstd").encode(data, 4096, digests=True))
    assert len(blocks[0][0]) < 100  # stored compressed, digested as logical bytes
    assert [d for _, _, d in blocks] == [block_digest(data[:4096]), block_digest(data[4096:])]
    assert len(blocks[0][2]) == 16 and blocks[0][2] != blocks[1][2]


def test_raw_blocks_against_a_raw_base_are_hashed_where_their_digest_can_matter():
    """A block whose CRC32C differs from its base block's changed: hashed only while among the first
    HASHED_CHANGED_IN_ROW changed ones in a row and not changed before (its base block hashed); a block
    whose CRC32C is the base's is hashed and compared; one whose base block was not hashed is never
    taken as unchanged."""
    from ckptio.format.codec import HASHED_CHANGED_IN_ROW, block_digest
    from ckptio.format.names import Codec
    from ckptio.format.records import NO_DIGEST

    n, size = 12, 1024
    base = bytearray(os.urandom(n * size))
    blocks = [memoryview(base)[k * size : (k + 1) * size] for k in range(n)]
    digests = [block_digest(b) for b in blocks]
    crcs = [checksum(b) for b in blocks]
    digests[11] = NO_DIGEST  # the base did not hash its last block
    new = bytearray(base)
    for k in (0, 1, 2, 3, 4, 5, 6, 9):  # a row of 7 changed blocks, then 2 unchanged, 1 changed, 2 unchanged
        new[k * size] ^= 1
    out = list(BlockEncoder(size).encode(memoryview(new), size, Codec.RAW, (), True, b"".join(digests), crcs))
    referenced = [k for k, (stored, _, _) in enumerate(out) if stored is None]
    assert referenced == [7, 8, 10]  # 11 is unchanged, but its base block was never hashed: written
    hashed = [k for k, (_, _, digest) in enumerate(out) if digest != NO_DIGEST]
    assert hashed == [*range(HASHED_CHANGED_IN_ROW), 7, 8, 9, 10, 11]
    assert all(out[k][2] == block_digest(memoryview(new)[k * size : (k + 1) * size]) for k in hashed)
    assert all(stored is None or (bytes(stored), crc) == (bytes(new[k * size : (k + 1) * size]), checksum(stored))
               for k, (stored, crc, _) in enumerate(out))  # fmt: skip
    digests[9] = NO_DIGEST  # block 9 changed before: not hashed when it changes again
    out = list(BlockEncoder(size).encode(memoryview(new), size, Codec.RAW, (), True, b"".join(digests), crcs))
    assert out[9][2] == NO_DIGEST and out[9][0] is not None


def test_block_size_adapts_to_item_size():
    assert block_size_for(100, 1 << 20) == 4096  # small items: one minimum-size block
    assert block_size_for(64 * 8192, 1 << 20) == 8192  # mid-size: 64 blocks
    assert block_size_for(1 << 30, 256 << 10) == 256 << 10  # large: capped by the configured maximum


# --- byte planes (format version 2) ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int16])
def test_byte_planes_round_trip_and_beat_whole_block_zstd(dtype):
    from ckptio.format.names import Codec

    values = (torch.randn(30_001) * 100).to(dtype)  # an odd count: the last block is partial
    data = memoryview(values.view(torch.uint8).numpy()).cast("B")
    enc = BlockEncoder(16384, "zstd")
    codec, planes = enc.codec_for(data, values.element_size())
    assert codec == Codec.ZSTD_BYTEPLANES and len(planes) == values.element_size() and any(planes)
    blocks = list(enc.encode(data, 16384, codec, planes))
    decoded = b"".join(
        bytes(decode_block(stored, min(16384, len(data) - i * 16384), codec, values.element_size()))
        for i, (stored, _, _) in enumerate(blocks)
    )
    assert decoded == bytes(data)
    # against a simple reference (plain slicing), decoded into a fresh buffer and into a destination
    k = values.element_size()
    for i, (stored, _, _) in enumerate(blocks):
        logical = bytes(data[i * 16384 : (i + 1) * 16384])
        into = memoryview(bytearray(len(logical)))
        for out in (None, into):
            joined = bytes(decode_block(stored, len(logical), codec, k, out))
            assert [joined[p::k] for p in range(k)] == [logical[p::k] for p in range(k)]
    whole = sum(len(b) for b, _, _ in BlockEncoder(16384, "zstd").encode(data, 16384, Codec.ZSTD))
    assert sum(len(b) for b, _, _ in blocks) < whole


def test_small_integers_take_whole_block_zstd_where_it_is_smaller():
    from ckptio.format.names import Codec

    values = (torch.randn(30_001) * 100).to(torch.int64)  # 6 of 8 bytes are sign extension
    data = memoryview(values.view(torch.uint8).numpy()).cast("B")
    enc = BlockEncoder(16384, "zstd")
    codec, planes = enc.codec_for(data, 8)
    assert codec == Codec.ZSTD and planes == ()
    chosen = sum(len(b) for b, _, _ in enc.encode(data, 16384, codec, planes))
    mask = (True,) * 8
    by_planes = sum(len(b) for b, _, _ in enc.encode(data, 16384, Codec.ZSTD_BYTEPLANES, mask))
    assert chosen < by_planes
    decoded = b"".join(
        bytes(decode_block(b, min(16384, len(data) - i * 16384), codec, 8))
        for i, (b, _, _) in enumerate(enc.encode(data, 16384, codec, planes))
    )
    assert decoded == bytes(data)


def test_incompressible_items_are_stored_raw_from_a_sample():
    from ckptio.format.names import Codec

    enc = BlockEncoder(16384, "zstd")
    noise = memoryview(os.urandom(1 << 20))
    assert enc.codec_for(noise, 4) == (Codec.RAW, ()) and enc.codec_for(noise, 1) == (Codec.RAW, ())
    assert enc.codec_for(memoryview(bytes(1 << 16)), 1)[0] == Codec.ZSTD
    assert BlockEncoder(16384, None).codec_for(memoryview(bytes(1 << 16)), 4) == (Codec.RAW, ())


def test_crc32c_of_pieces_combines_known_crcs_exactly():
    import random

    from ckptio.format.codec import checksum, checksum_concat, checksum_of_pieces

    rng = random.Random(7)
    data = rng.randbytes(3 << 20)
    for _ in range(200):
        a, b = sorted(rng.sample(range(len(data) + 1), 2))
        head, tail = data[:a], data[a:b]
        assert checksum_concat(checksum(head), checksum(tail), len(tail)) == checksum(data[:b])
    cuts = sorted(rng.sample(range(1, len(data)), 40)) + [len(data)]
    pieces, start = [], 0
    for i, end in enumerate(cuts):  # every other piece with its CRC, the rest to be read; one empty piece
        piece = memoryview(data)[start:end] if i != 5 else memoryview(b"")
        pieces.append((piece, checksum(piece) if i % 2 else None))
        start = end if i != 5 else start
    assert checksum_of_pieces(pieces) == checksum(b"".join(bytes(p) for p, _ in pieces))
    assert checksum_of_pieces([]) == checksum(b"") == 0
