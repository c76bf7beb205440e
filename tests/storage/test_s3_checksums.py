"""End-to-end checks of S3 uploads (``ckptio/storage/s3_checksums.py``): every PUT and part carries
its CRC32C; the payload goes unsigned only where a store is seen to check that CRC32C; a store that
refuses the header still gets every upload; a byte damaged in flight is refused by the store and the
part sent again, or the save fails naming the object, and nothing damaged is committed."""

from __future__ import annotations

import logging

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from tests.helpers.faultproxy import Fault

PART = 5 << 20
STATE_ELEMENTS = 4 << 20  # 16 MiB of fp32: a multipart upload of 3 parts plus a small PUT


def _state() -> dict:
    return {"w": torch.randn(STATE_ELEMENTS, generator=torch.Generator().manual_seed(3)), "step": 11}


def _save(url: str, options: dict, tuning: dict | None = None, **storage) -> None:
    cfg = ckptio.WriterConfig(storage_config={"part_size": PART, **storage}, tuning=tuning)
    dcp.save(_state(), storage_writer=ckptio.Writer(url, cfg, storage_options=options))


def _loads_bit_exact(url: str, options: dict) -> bool:
    out = {"w": torch.zeros(STATE_ELEMENTS), "step": 0}
    dcp.load(out, storage_reader=ckptio.Reader(url, storage_options=options))
    return torch.equal(out["w"], _state()["w"]) and out["step"] == 11


def _uploads(stats) -> list:
    return [r for r in stats.log if r.operation in ("PUT", "MPU_PART")]


def test_a_store_that_checks_crc32c_gets_them_on_every_upload_and_unsigned_payloads(s3_proxy):
    proxy, base, options = s3_proxy
    proxy.check_crc32c = True  # what AWS S3 does: verify, and echo the CRC32C in the answer
    url = f"{base}/checked"
    _save(url, options)
    first = _uploads(proxy.reset())
    _save(f"{url}-again", options)
    stats = proxy.reset()
    uploads = _uploads(stats)
    assert stats.requests["MPU_PART"] >= 3 and all(r.checksum for r in first + uploads), uploads
    # signed until the store has echoed a CRC32C (the parts sent before the first answer), unsigned after
    assert first[0].signed_payload and not first[-1].signed_payload  # the commit, after the parts
    assert not any(r.signed_payload for r in uploads), uploads
    assert [r.checksum for r in stats.log if r.operation == "MPU_CREATE"] == [True]  # x-amz-checksum-algorithm
    assert _loads_bit_exact(url, options) and _loads_bit_exact(f"{url}-again", options)


def test_parts_that_split_blocks_carry_the_crc32c_of_their_bytes(s3_proxy):
    """A part's CRC32C is combined from the blocks' own; parts that begin or end inside a block read
    those pieces again. Blocks of 192,000 bytes never line up with 5 MiB parts."""
    proxy, base, options = s3_proxy
    proxy.check_crc32c = True
    url = f"{base}/unaligned"
    _save(url, options, tuning={"max_block_size": 192_000})
    stats = proxy.reset()
    # each part accepted at once: a wrong CRC32C would be a BadDigest and the part sent again
    assert stats.requests["MPU_PART"] == stats.answers["MPU_PART", 200] >= 3, (stats.requests, stats.answers)
    assert all(r.checksum for r in _uploads(stats))
    assert _loads_bit_exact(url, options)


def test_a_byte_flipped_in_a_part_is_refused_by_the_store_and_the_part_sent_again(s3_proxy):
    proxy, base, options = s3_proxy
    proxy.check_crc32c = True
    url = f"{base}/flipped"
    flip = Fault(lambda r: r.operation == "MPU_PART", "flip", times=1)
    proxy.faults.append(flip)
    _save(url, options)
    stats = proxy.reset()
    assert flip.hits == 1 and stats.answers["MPU_PART", 400] == 0  # refused by the proxy as the store
    assert stats.requests["MPU_PART"] == stats.answers["MPU_PART", 200] + 1
    assert _loads_bit_exact(url, options)


def test_parts_damaged_on_every_attempt_fail_the_save_naming_the_object_and_commit_nothing(s3_proxy, moto_server):
    proxy, base, options = s3_proxy
    proxy.check_crc32c = True
    url = f"{base}/doomed"
    proxy.faults.append(Fault(lambda r: r.operation == "MPU_PART", "flip"))
    with pytest.raises(CheckpointException) as failed:
        _save(url, options, retry_attempts=3, retry_deadline_s=5)
    error = ckptio.unwrap(failed.value)
    assert isinstance(error, ckptio.StorageError) and "BadDigest" in str(error) and ".ckio" in str(error), error
    bucket = base.removeprefix("s3://")
    client = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_store_that_refuses_checksum_headers_gets_uploads_without_them(s3_proxy, caplog):
    proxy, base, options = s3_proxy
    refuse = Fault(lambda r: r.checksum, 400)  # 400 InvalidArgument: "Unsupported header x-amz-checksum-crc32c"
    proxy.faults.append(refuse)
    url = f"{base}/refused"
    with caplog.at_level(logging.WARNING, logger="ckptio.storage.s3_checksums"):
        _save(url, options)
        _save(f"{base}/refused-again", options)
    stats = proxy.reset()
    assert refuse.hits == 1  # learned once for the endpoint
    warnings = [r for r in caplog.records if "refused CRC32C request checksums" in r.getMessage()]
    assert len(warnings) == 1 and "InvalidArgument" in warnings[0].getMessage()
    later = [r for r in stats.log if r.operation in ("PUT", "MPU_PART", "MPU_CREATE")][1:]
    assert later and not any(r.checksum for r in later)
    assert all(r.signed_payload for r in later if r.operation != "MPU_CREATE")  # the SHA-256 the store checks
    assert _loads_bit_exact(url, options) and _loads_bit_exact(f"{base}/refused-again", options)


@pytest.mark.parametrize("s3", ["radosgw"], indirect=True)
def test_radosgw_refuses_a_part_damaged_in_flight_and_the_part_is_sent_again(s3_proxy):
    """radosgw 16 ignores x-amz-checksum-crc32c: over plain HTTP the payload stays SHA-256 signed, and
    radosgw refuses a damaged part for that (XAmzContentSHA256Mismatch)."""
    proxy, base, options = s3_proxy
    flip = Fault(lambda r: r.operation == "MPU_PART", "flip", times=1)
    proxy.faults.append(flip)
    url = f"{base}/ckpt"
    _save(url, options)
    stats = proxy.reset()
    assert flip.hits == 1 and stats.answers["MPU_PART", 400] == 1, stats.answers
    uploads = _uploads(stats)
    assert all(r.checksum and r.signed_payload for r in uploads), uploads  # never echoed: stays signed
    assert _loads_bit_exact(url, options)
