"""Tiered checkpoints in one process: faults, queued saves, retention, config, and the durable copy
as an ordinary checkpoint. The durable tier is a moto S3 server (through the fault proxy where a
fault is injected) or a local path."""

from __future__ import annotations

import glob
import logging
import os
import resource
import signal
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.format.names import parse_data_file_name
from ckptio.tiers.background import DRAIN_NICE
from ckptio.tiers.drain import drain_queue
from tests.conftest import s3_objects
from tests.helpers.faultproxy import Fault
from tests.helpers.harness import spawn
from tests.helpers.tiered import flip_a_byte


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 128, generator=gen), "b": torch.arange(64) * step, "meta": {"step": step}}


def _empty() -> dict:
    return {"w": torch.zeros(256, 128), "b": torch.zeros(64, dtype=torch.int64), "meta": {"step": None}}


def _same(loaded: dict, step: int) -> bool:
    want = _state(step)
    return (
        torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"]) and loaded["meta"] == want["meta"]
    )


def _save(url: str, tier, options=None, drain_timeout_s: float = 3600.0, retry_attempts: int = 8, **config) -> None:
    tuning = ckptio.Tuning(max_block_size=16 << 10, drain_timeout_s=drain_timeout_s)
    storage = ckptio.StorageConfig(retry_attempts=retry_attempts)
    config = ckptio.WriterConfig(local_tier=str(tier), tuning=tuning, storage_config=storage, **config)
    writer = ckptio.Writer(url, config, storage_options=options)
    dcp.save(_state(int(url.rsplit("-", 1)[1])), storage_writer=writer)


def _load(url: str, options=None, tier=None) -> tuple[dict, ckptio.Reader]:
    value = _empty()
    reader = ckptio.Reader(url, storage_options=options, local_tier=str(tier) if tier else None)
    dcp.load(value, storage_reader=reader)
    return value, reader


def test_a_flipped_byte_in_a_fast_tier_file_is_read_from_the_durable_tier(tmp_path, caplog):
    url = str(tmp_path / "durable" / "run" / "step-1")
    _save(url, tmp_path / "fast")
    ckptio.wait_for_uploads()
    (data,) = glob.glob(str(tmp_path / "fast" / "*" / "step-1" / "*.ckio"))
    flip_a_byte(data)
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        loaded, reader = _load(url, tier=tmp_path / "fast")
    assert _same(loaded, 1)
    assert reader.bytes_read["durable"] > 0 and "failed its check" in caplog.text
    os.remove(data)  # a missing fast-tier file: the durable tier serves it all
    loaded, reader = _load(url, tier=tmp_path / "fast")
    assert _same(loaded, 1) and reader.bytes_read["local"] == 0


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_byte_flipped_before_the_upload_fails_that_drain_and_never_commits(tmp_path, s3, compression):
    base, options = s3
    run = f"{base}/run-{compression}"
    _save(f"{run}/step-1", tmp_path / "fast", options, drain_bandwidth=50_000, compression=compression)
    _save(f"{run}/step-2", tmp_path / "fast", options, compression=compression)  # queued behind step 1's drain
    (data,) = glob.glob(str(tmp_path / "fast" / "*" / "step-2" / "*.ckio"))
    flip_a_byte(data)
    with pytest.raises(ckptio.DrainError, match="changed after the save: the block at byte .* fails its CRC32C"):
        ckptio.wait_for_uploads()
    assert ckptio.latest(run, storage_options=options) == f"{run}/step-1"  # step 2 never committed on S3
    loaded, _ = _load(f"{run}/step-1", options)
    assert _same(loaded, 1)


def test_the_durable_tier_failing_during_a_drain_is_retried_then_raised_and_nothing_is_lost(s3_proxy, tmp_path):
    proxy, base, options = s3_proxy
    options = {**options, "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    puts = Fault(lambda r: r.operation in ("PUT", "PutObject", "UploadPart") or r.method == "PUT", 503, times=3)
    proxy.faults.append(puts)
    _save(f"{base}/run/step-1", tmp_path / "fast", options, retry_attempts=1)
    ckptio.wait_for_uploads()  # three 503s, retried with backoff
    assert puts.hits == 3
    loaded, _ = _load(f"{base}/run/step-1", options)
    assert _same(loaded, 1)

    proxy.faults[:] = [Fault(lambda r: r.method == "PUT", 503)]  # unreachable for good
    _save(f"{base}/run/step-2", tmp_path / "fast", options, retry_attempts=1, drain_timeout_s=2)
    with pytest.raises(ckptio.DrainError, match="step-2"):
        ckptio.wait_for_uploads()
    assert "run/step-2/ckptio.json" not in {k.split("/", 1)[1] for k in s3_objects(options, f"{base}/run/")}
    proxy.faults.clear()
    # the fast-tier copy is whole, and the next start finishes its drain
    assert ckptio.latest(f"{base}/run", local_tier=str(tmp_path / "fast"), storage_options=options).endswith("step-2")
    ckptio.wait_for_uploads()
    loaded, _ = _load(f"{base}/run/step-2", options)
    assert _same(loaded, 2)


def test_a_failed_drain_is_raised_by_the_next_tiered_save(tmp_path):
    blocked = tmp_path / "durable-file"
    blocked.write_text("not a folder")  # the durable tier cannot be created
    _save(str(blocked / "run" / "step-1"), tmp_path / "fast", drain_timeout_s=1)
    while drain_queue().pending:  # the drain gives up after its timeout
        time.sleep(0.05)
    with pytest.raises(CheckpointException) as raised:  # plain dcp.save wraps what a rank raised
        _save(str(tmp_path / "ok" / "run" / "step-2"), tmp_path / "fast")
    assert isinstance(ckptio.unwrap(raised.value), ckptio.DrainError) and "step-1" in str(raised.value)
    assert glob.glob(str(tmp_path / "fast" / "*" / "step-1" / "ckptio.json"))  # kept


def test_saves_faster_than_the_drain_queue_in_order_and_all_commit(s3, tmp_path):
    base, options = s3
    for step in (1, 2, 3):
        _save(f"{base}/run/step-{step}", tmp_path / "fast", options, drain_bandwidth=400_000)
    assert "run/step-3/ckptio.json" not in {k.split("/", 1)[1] for k in s3_objects(options, f"{base}/run/")}
    ckptio.wait_for_uploads()
    for step in (1, 2, 3):
        loaded, _ = _load(f"{base}/run/step-{step}", options)
        assert _same(loaded, step)
    assert ckptio.latest(f"{base}/run", storage_options=options) == f"{base}/run/step-3"


def test_spread_key_prefixes_on_both_tiers_drain_commit_and_load_from_the_fast_tier(s3, tmp_path):
    base, options = s3
    run = f"{base}/run"
    _save(f"{run}/step-1", tmp_path / "fast", options, key_prefix="hash")
    ckptio.wait_for_uploads()
    (durable,) = [k for k in s3_objects(options, f"{run}/step-1") if k.endswith(".ckio")]
    assert parse_data_file_name(durable.split("/", 2)[-1]).spread  # run/step-1/<xx>/data-...
    assert ckptio.latest(run, local_tier=str(tmp_path / "fast"), storage_options=options) == f"{run}/step-1"
    loaded, reader = _load(f"{run}/step-1", options, tier=tmp_path / "fast")
    assert _same(loaded, 1) and reader.bytes_read["durable"] == 0 and reader.bytes_read["local"] > 0
    loaded, reader = _load(f"{run}/step-1", options)
    assert _same(loaded, 1)  # the durable copy alone, as a plain checkpoint


def test_the_drain_runs_below_the_training_threads_priority(s3, tmp_path):
    base, options = s3
    _save(f"{base}/run/step-1", tmp_path / "fast", options)
    ckptio.wait_for_uploads()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    drain = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threading.enumerate()}
    assert drain["ckptio-drain"] == drain["ckptio-drain-io"] == min(19, mine + DRAIN_NICE)
    loaded, _ = _load(f"{base}/run/step-1", options)  # foreground reads keep fsspec's own loop
    assert _same(loaded, 1) and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_the_fast_tier_keeps_the_newest_k_and_only_what_has_drained(tmp_path):
    durable = tmp_path / "durable" / "run"
    for step in (8, 9, 10):
        _save(str(durable / f"step-{step}"), tmp_path / "fast", local_tier_keep=2)
    ckptio.wait_for_uploads()
    (run,) = os.listdir(tmp_path / "fast")
    assert sorted(os.listdir(tmp_path / "fast" / run)) == ["step-10", "step-9"]
    os.remove(durable / "step-9" / "ckptio.json")  # as if step 9 had never drained: it is kept
    _save(str(durable / "step-11"), tmp_path / "fast", local_tier_keep=1)
    ckptio.wait_for_uploads()
    assert sorted(os.listdir(tmp_path / "fast" / run)) == ["step-11", "step-9"]
    assert ckptio.latest(str(durable)) == str(durable / "step-11")


def test_a_full_fast_tier_sends_that_save_straight_to_the_durable_tier(tmp_path, s3):
    base, options = s3
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    url = f"{base}/run/step-1"
    (records,) = spawn(0, _save_with_a_full_fast_tier_s3, url, str(tmp_path / "fast"), options)
    assert sum("is full" in message for message in records) == 1
    assert not glob.glob(str(tmp_path / "fast" / "*" / "step-1" / "*.ckio"))
    loaded, _ = _load(url, options)
    assert _same(loaded, 1)


def _save_with_a_full_fast_tier_s3(url: str, fast: str, options: dict) -> list[str]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ckptio").addHandler(handler)
    _save(url, fast, options)
    ckptio.wait_for_uploads()
    return records


def test_async_save_to_a_tier_and_the_settings_from_the_environment(tmp_path, monkeypatch, clean_env):
    with pytest.raises(ValueError, match="node-local path"):
        ckptio.WriterConfig(local_tier="s3://bucket/fast")
    monkeypatch.setenv("CKPTIO_LOCAL_TIER", str(tmp_path / "fast"))
    monkeypatch.setenv("CKPTIO_DRAIN_BANDWIDTH", "none")
    config = ckptio.WriterConfig.from_dict({"mode": "all_ranks"})
    assert config.local_tier == str(tmp_path / "fast") and config.drain_bandwidth is None
    url = str(tmp_path / "durable" / "run" / "step-4")
    dcp.async_save(_state(4), storage_writer=ckptio.Writer(url, config)).result()
    ckptio.wait_for_uploads()
    loaded, reader = _load(url)  # the Reader takes CKPTIO_LOCAL_TIER too
    assert _same(loaded, 4) and reader.bytes_read == {"local": reader.bytes_read["local"], "peer": 0, "durable": 0}
