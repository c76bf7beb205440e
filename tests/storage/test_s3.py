"""S3 through a counting, fault-injecting proxy: request budget, retries, clean failure, read amplification."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from s3fs import S3FileSystem
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.config import REMOTE_READ_GAP_BYTES
from ckptio.storage import open_store
from tests.conftest import S3_SERVERS, STORES, s3_client, s3_objects, store_objects
from tests.helpers import scenarios
from tests.helpers.faultproxy import Fault
from tests.helpers.harness import spawn

SIZE = 32 << 20
PART = 5 << 20
MESH = (2, 2)


def _open_uploads(options: dict, base: str) -> list:
    bucket = base.removeprefix("s3://").split("/")[0]
    return s3_client(options).list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def expected_parts(size: int) -> int:
    """Parts of one object: a full part leaves whenever 1.25 parts are buffered; the rest is the last part."""
    if size < PART * 5 // 4:
        return 0  # a single PUT
    full = (size - PART * 5 // 4) // PART + 1
    return full + 1


def expected_save_requests(data_sizes: list[int]) -> int:
    per_object = [expected_parts(size) + 2 if expected_parts(size) else 1 for size in data_sizes]
    return sum(per_object) + 2  # + the metadata PUT + the existing-checkpoint GET


@pytest.mark.slow
@pytest.mark.parametrize(
    ("s3", "mode"), [("moto", "all_ranks"), ("moto", "replica_group"), ("radosgw", "replica_group")], indirect=["s3"]
)
def test_request_budget_and_read_amplification(s3_proxy, s3, mode):
    proxy, base, options = s3_proxy
    url = f"{base}/{mode}"
    spawn(4, partial(scenarios.bench_save, storage_config={"part_size": PART}), url, SIZE, MESH, mode, options)
    stats = proxy.reset()
    objects = s3_objects(s3[1], url)
    data = [size for key, size in objects.items() if key.endswith(".ckio")]
    assert len(data) == (4 if mode == "all_ranks" else 2)
    assert any(expected_parts(size) for size in data)  # multipart really happened
    req = stats.requests
    assert req["COPY"] == req["DELETE"] == req["LIST"] == 0 and req["HEAD"] <= 1, req
    assert sum(req.values()) == expected_save_requests(data), req
    assert req["MPU_PART"] == sum(expected_parts(s) for s in data) > 0

    fetched, gets = {}, {}
    # exact reads on the saved mesh and two others (all_ranks), then the store's default gap on a resharded load
    loads = [(4, MESH, "0"), (2, (1, 2), "0")] if mode == "all_ranks" else []
    for procs, mesh, gap in loads + [(4, (1, 4), "0"), (4, (1, 4), None)]:
        env = {"CKPTIO_READ_GAP_BYTES": gap} if gap else {}
        results = spawn(procs, partial(scenarios.bench_load, dedup_reads=False), url, SIZE, mesh, options, env=env)
        stats = proxy.reset()
        assert all(bad == [] for bad, _ in results), results
        needed = sum(n for _, n in results)
        fetched[gap] = sum(v for key, v in stats.get_bytes.items() if key.endswith(".ckio"))
        gets[gap] = sum(1 for r in stats.log if r.operation == "GET" and r.key.endswith(".ckio"))
        assert stats.requests["HEAD"] == stats.requests["LIST"] == 0
        if gap == "0":
            assert needed <= fetched["0"] <= 1.05 * needed, (mesh, fetched["0"] / needed)
    # every request saved costs at most one gap's worth of bytes read and dropped
    assert gets[None] <= gets["0"], gets
    assert fetched[None] <= fetched["0"] + REMOTE_READ_GAP_BYTES * (gets["0"] - gets[None]), (fetched, gets)


def _is_part_upload(r) -> bool:
    """A data object's part on its way: S3's UploadPart, Azure's Put Block, a GCS upload."""
    return r.operation == "MPU_PART" or r.query.get("comp") == ["block"] or r.query.get("uploadType") == ["multipart"]


@pytest.mark.slow
@pytest.mark.parametrize("store", STORES, indirect=True)
def test_twenty_percent_failures_still_save_and_load_bit_exact(store_proxy, store):
    proxy, base, options = store_proxy
    proxy.check_crc32c = True  # S3: what AWS does with a part's CRC32C (moto does not check it)
    url = f"{base}/flaky"
    flip = Fault(_is_part_upload, "flip", times=2)  # a byte flipped in flight: the store's checksum refuses it
    proxy.faults += [
        Fault(_is_part_upload, "drop", times=1),  # a part dies mid-upload
        flip,
        Fault(lambda r: r.method == "GET" and r.path.endswith(".ckio"), 503, times=1),
        Fault(lambda r: True, [503, 429, 500, "drop"], fraction=0.2),
    ]
    spawn(4, partial(scenarios.bench_save, storage_config={"part_size": PART}), url, SIZE, MESH, "all_ranks", options)
    results = spawn(4, scenarios.bench_load, url, SIZE, MESH, options)
    stats = proxy.reset()
    assert all(bad == [] for bad, _ in results)
    assert sum(stats.failed.values()) >= 0.2 * sum(stats.requests.values()), stats  # faults really were injected
    assert flip.hits == 2 and stats.failed["GET"] > 0
    assert open_store(base, store[1]).open_uploads() == []
    assert not [name for name in store_objects(base, store[1]) if ".ckptio-part." in name]


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_permanent_failure_is_clean_on_every_rank(s3_proxy, s3):
    proxy, base, options = s3_proxy
    url = f"{base}/doomed"
    proxy.faults.append(Fault(lambda r: r.operation == "MPU_PART" and r.key.endswith("-r00001.ckio"), 503))
    doomed = partial(
        scenarios.expect_save_failure, storage_config={"part_size": PART, "retry_attempts": 3, "retry_deadline_s": 5}
    )
    messages = spawn(4, doomed, url, SIZE, MESH, options)
    for message in messages:
        assert message.startswith("StorageError") and "-r00001.ckio" in message and "SlowDown" in message, message
    objects = s3_objects(s3[1], base)
    assert not any(key.endswith("ckptio.json") for key in objects), objects
    assert _open_uploads(s3[1], base) == []


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_credentials_from_storage_options_or_environment(s3, monkeypatch):
    base, options = s3
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    scenarios.save(f"{base}/opts", None, "all_ranks", options)
    assert scenarios.load(f"{base}/opts", None, options) == []

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["client_kwargs"]["endpoint_url"])
    S3FileSystem.clear_instance_cache()  # s3fs keeps one instance per options: one made for another server
    scenarios.save(f"{base}/env", None, "all_ranks", None)
    assert scenarios.load(f"{base}/env", None, None) == []
    meta = json.loads(
        s3_client(options).get_object(Bucket=base.removeprefix("s3://"), Key="env/ckptio.json")["Body"].read()
    )
    assert meta["format"] == "ckptio"


def test_a_store_that_ignores_range_requests_fails_the_load_naming_the_object(s3_proxy):
    """On moto only: the proxy plays the store that ignores Range by dropping the header, which a
    server that checks signatures (radosgw) refuses, since the header was signed."""
    proxy, base, options = s3_proxy
    url = f"{base}/ranges"
    state = {"a": torch.arange(300_000.0), "b": torch.arange(300_000.0) * 2}
    dcp.save(state, storage_writer=ckptio.Writer(url, storage_options=options))
    proxy.faults.append(Fault(lambda r: r.operation == "GET" and r.key.endswith(".ckio"), "ignore_range"))
    with pytest.raises(CheckpointException) as failed:  # only "b": a range that does not start at 0
        dcp.load({"b": torch.zeros(300_000)}, storage_reader=ckptio.Reader(url, storage_options=options))
    error = ckptio.unwrap(failed.value)
    assert isinstance(error, ckptio.StorageError) and "more bytes than the range asked for" in str(error), error
    assert ".ckio" in str(error)
