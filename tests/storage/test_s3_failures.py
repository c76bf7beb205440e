"""S3 endpoints that stall, race or lack conditional writes (``ckptio.storage.s3``)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.config import StorageConfig
from ckptio.storage import open_store
from tests.conftest import S3_SERVERS
from tests.helpers.faultproxy import Fault


def test_a_stalled_s3_endpoint_is_bounded_by_the_retry_deadline(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/stalled"
    dcp.save({"w": torch.ones(1000)}, storage_writer=ckptio.Writer(url, storage_options=options))
    proxy.faults.append(Fault(lambda r: r.operation == "GET", "stall"))
    started = time.monotonic()
    reader = ckptio.Reader(
        url, storage_options=options, storage_config=StorageConfig(retry_attempts=3, retry_deadline_s=1)
    )
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=reader)
    assert time.monotonic() - started < 20  # the deadline (1 s) bounds it, not botocore's 60 s read timeout
    assert isinstance(ckptio.unwrap(info.value), ckptio.StorageError)

    proxy.faults[:] = [Fault(lambda r: r.operation == "PUT", "stall")]
    config = ckptio.WriterConfig(storage_config=ckptio.StorageConfig(retry_attempts=3, retry_deadline_s=1))
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(1000)}, storage_writer=ckptio.Writer(f"{base}/s2", config, storage_options=options))
    assert time.monotonic() - started < 20
    assert "ckptio.json" in str(ckptio.unwrap(info.value))


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_s3_compatible_stores_without_conditional_writes_still_commit(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/no-conditional"
    proxy.faults.append(Fault(lambda r: r.operation == "PUT" and r.conditional, 501))
    dcp.save({"w": torch.ones(10)}, storage_writer=ckptio.Writer(url, storage_options=options))
    stats = proxy.reset()
    # 501 is not retried. The first upload to this endpoint carries a CRC32C header too, so the 501 may
    # be about either: the conditional PUT is tried again without the checksum (still 501), then the
    # check and a plain PUT, which carries its checksum (so the store is not taken to refuse them)
    assert stats.failed["PUT"] == 2 and stats.requests["PUT"] == 3 and stats.requests["HEAD"] == 1
    assert [r.checksum for r in stats.log if r.operation == "PUT"] == [True, False, True]
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=ckptio.Reader(url, storage_options=options))
    assert torch.equal(out["w"], torch.ones(10))


def test_every_retry_is_ckptios_botocore_sends_each_attempt_once(s3_proxy):
    """botocore's own retries are off (its ``max_attempts`` counts retries, not attempts): a request
    of one attempt that is answered 503 fails after exactly one request."""
    proxy, base, options = s3_proxy
    store = open_store(f"{base}/once", options, StorageConfig(retry_attempts=1))
    store.put_atomic("x", b"payload")
    proxy.reset()
    proxy.faults.append(Fault(lambda r: r.operation == "GET", 503, times=1))
    with pytest.raises(ckptio.StorageError, match="SlowDown"):
        store.read("x")
    assert proxy.reset().requests["GET"] == 1
    assert open_store(f"{base}/once", options, StorageConfig(retry_attempts=2)).read("x") == b"payload"
