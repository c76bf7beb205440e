"""Settings (``ckptio.config``): modes, environment overrides, the nested storage and tuning configs, the
pre-1.0 names."""

from __future__ import annotations

import dataclasses

import pytest

import ckptio
from ckptio import StorageConfig, Tuning, WriterConfig


def test_config_modes_and_errors(clean_env):
    assert WriterConfig().mode == "all_ranks"
    assert WriterConfig.from_dict({"mode": "replica_group"}).mode == "replica_group"
    with pytest.raises(ValueError, match=r"valid modes are \['all_ranks', 'replica_group'\]"):
        WriterConfig(mode="fast")
    with pytest.raises(ValueError, match="unknown ckptio config key"):
        WriterConfig.from_dict({"mdoe": "all_ranks"})
    with pytest.raises(ValueError, match="part_size"):
        WriterConfig(storage_config=StorageConfig(part_size=1024))
    with pytest.raises(ValueError, match="part_size"):
        WriterConfig.from_dict({"storage_config": {"part_size": 1024}})
    with pytest.raises(ValueError, match=r"unknown tuning key\(s\) \['inline'\]"):
        WriterConfig.from_dict({"tuning": {"inline": 0}})
    with pytest.raises(ValueError, match="storage_config must be a StorageConfig or a mapping"):
        WriterConfig(storage_config=4)


def test_environment_overrides_arguments_and_dicts(clean_env, monkeypatch):
    monkeypatch.setenv("CKPTIO_MODE", "replica_group")
    monkeypatch.setenv("CKPTIO_OVERWRITE", "true")
    monkeypatch.setenv("CKPTIO_COMPRESSION", "zstd")
    cfg = WriterConfig.from_dict({"mode": "all_ranks"})
    assert (cfg.mode, cfg.overwrite, cfg.compression) == ("replica_group", True, "zstd")
    monkeypatch.setenv("CKPTIO_MODE", "bogus")
    with pytest.raises(ValueError, match="valid modes"):
        WriterConfig()
    monkeypatch.setenv("CKPTIO_MODE", "all_ranks")
    monkeypatch.setenv("CKPTIO_MAX_BLOCK_SIZE", "lots")
    with pytest.raises(ValueError, match="CKPTIO_MAX_BLOCK_SIZE='lots' is not a valid int"):
        WriterConfig()


def test_the_read_gap_is_the_backends_unless_configured(clean_env, monkeypatch, tmp_path):
    from ckptio.config import LOCAL_READ_GAP_BYTES, REMOTE_READ_GAP_BYTES
    from ckptio.storage import open_store

    assert open_store(str(tmp_path)).read_gap_bytes == LOCAL_READ_GAP_BYTES == 0
    assert open_store("memory://gap").read_gap_bytes == REMOTE_READ_GAP_BYTES
    assert open_store("memory://gap", config=StorageConfig(read_gap_bytes=4096)).read_gap_bytes == 4096
    monkeypatch.setenv("CKPTIO_READ_GAP_BYTES", "65536")
    assert open_store(str(tmp_path), config=WriterConfig().storage_config).read_gap_bytes == 65536
    monkeypatch.setenv("CKPTIO_READ_GAP_BYTES", "none")
    assert WriterConfig().storage_config.read_gap_bytes is None
    monkeypatch.delenv("CKPTIO_READ_GAP_BYTES")
    with pytest.raises(ValueError, match="read_gap_bytes must be None or 0"):
        StorageConfig(read_gap_bytes=-1)
    with pytest.raises(ValueError, match="read_gap_bytes must be None or 0"):
        ckptio.HFReader(str(tmp_path), storage_config={"read_gap_bytes": 1 << 40})


def test_a_reader_is_configured_by_storage_config_with_the_same_rules_and_environment(monkeypatch, tmp_path):
    import ckptio
    from ckptio.config import MAX_REQUEST_BYTES, StorageConfig

    assert ckptio.Reader(str(tmp_path)).storage_config == StorageConfig()
    monkeypatch.setenv("CKPTIO_READ_GAP_BYTES", "4096")
    monkeypatch.setenv("CKPTIO_MAX_CONCURRENCY", "3")
    assert ckptio.Reader(str(tmp_path)).storage_config == StorageConfig(read_gap_bytes=4096, max_concurrency=3)
    given = ckptio.Reader(str(tmp_path), storage_config=StorageConfig(retry_attempts=2)).storage_config
    assert given == StorageConfig(read_gap_bytes=4096, max_concurrency=3, retry_attempts=2)  # the environment wins
    assert StorageConfig.from_environment(retry_attempts=2).retry_attempts == 2
    assert WriterConfig().storage_config == StorageConfig.from_environment()  # one set of storage fields
    monkeypatch.delenv("CKPTIO_READ_GAP_BYTES")
    monkeypatch.delenv("CKPTIO_MAX_CONCURRENCY")
    for bad, message in [
        ({"read_gap_bytes": MAX_REQUEST_BYTES + 1}, "read_gap_bytes"),
        ({"part_size": 1 << 20}, "part_size"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"retry_attempts": 0}, "retry_attempts"),
    ]:
        with pytest.raises(ValueError, match=message):
            StorageConfig(**bad)
        with pytest.raises(ValueError, match=message):
            WriterConfig(storage_config=bad)  # the same rule, stated once


def test_key_prefix_from_the_environment_and_unknown_rules_refused(monkeypatch, clean_env):
    monkeypatch.setenv("CKPTIO_KEY_PREFIX", "hash")
    assert ckptio.WriterConfig().key_prefix == "hash"
    assert ckptio.WriterConfig.from_dict({"key_prefix": None}).key_prefix == "hash"  # the environment wins
    monkeypatch.setenv("CKPTIO_KEY_PREFIX", "none")
    assert ckptio.WriterConfig(key_prefix="hash").key_prefix is None
    monkeypatch.delenv("CKPTIO_KEY_PREFIX")
    with pytest.raises(ValueError, match=r"unknown key_prefix 'rank'; valid values are \[None, 'hash'\]"):
        ckptio.WriterConfig(key_prefix="rank")


def test_incremental_saves_from_a_dict_or_the_environment_and_their_bounds_checked(monkeypatch, clean_env, tmp_path):
    assert ckptio.WriterConfig.from_dict({"incremental_from": "previous"}).incremental_from == "previous"
    monkeypatch.setenv("CKPTIO_INCREMENTAL_FROM", "previous")
    monkeypatch.setenv("CKPTIO_INCREMENTAL_MAX_DEPTH", "3")
    config = ckptio.WriterConfig(tuning=Tuning(incremental_max_depth=5))
    assert (config.incremental_from, config.tuning.incremental_max_depth) == ("previous", 3)
    monkeypatch.setenv("CKPTIO_INCREMENTAL_FROM", "none")
    assert ckptio.WriterConfig(incremental_from="previous").incremental_from is None
    monkeypatch.delenv("CKPTIO_INCREMENTAL_FROM")
    monkeypatch.delenv("CKPTIO_INCREMENTAL_MAX_DEPTH")
    assert ckptio.WriterConfig(incremental_from=tmp_path / "step-1").incremental_from == str(tmp_path / "step-1")
    for wrong, match in [
        ({"incremental_from": ""}, "incremental_from must be"),
        ({"tuning": {"incremental_max_depth": 0}}, "incremental_max_depth"),
        ({"tuning": {"incremental_min_fraction": 1.0}}, "incremental_min_fraction"),
    ]:
        with pytest.raises(ValueError, match=match):
            ckptio.WriterConfig(**wrong)


def test_the_pre_1_0_names_still_work_and_say_where_they_went(clean_env):
    with pytest.warns(DeprecationWarning, match=r"WriterConfig.part_size is now WriterConfig.storage_config.part_size"):
        config = WriterConfig(part_size=64 << 20, mode="replica_group")
    assert config.storage_config == StorageConfig(part_size=64 << 20) and config.mode == "replica_group"
    with pytest.warns(
        DeprecationWarning, match=r"WriterConfig.(inline_limit|max_block_size) is now WriterConfig.tuning"
    ):
        config = WriterConfig.from_dict({"inline_limit": 0, "max_block_size": 4096, "tuning": {"compression_level": 3}})
    assert config.tuning == Tuning(inline_limit=0, max_block_size=4096, compression_level=3)
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(config, read_gap_bytes=0).storage_config.read_gap_bytes == 0
    with pytest.warns(DeprecationWarning):
        assert config.max_block_size == 4096  # read
    with pytest.warns(DeprecationWarning):
        config.max_block_size = 100  # set afterwards: checked when the save starts, as any field
    with pytest.raises(ValueError, match="max_block_size must be a positive"):
        config.validate()
    with pytest.warns(DeprecationWarning):
        config.max_block_size = 1024
    assert config.tuning.max_block_size == 1024
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="read_gap_bytes must be None or 0"):
        WriterConfig(read_gap_bytes=-1)
    with pytest.warns(DeprecationWarning, match=r"Reader\(tuning=ckptio.Tuning\(dedup_round_bytes"):
        assert ckptio.Reader("memory://r", dedup_round_bytes=4096).tuning.dedup_round_bytes == 4096
    with pytest.warns(DeprecationWarning, match=r"storage_config=ckptio.StorageConfig\(read_gap_bytes"):
        assert ckptio.HFReader("memory://r", read_gap_bytes=0).storage_config.read_gap_bytes == 0
    with pytest.warns(DeprecationWarning, match=r"WriterConfig.storage\(\) is now WriterConfig.storage_config"):
        assert config.storage() is config.storage_config
    assert WriterConfig.from_dict(config.to_dict()) == config  # nested mappings round-trip
    with pytest.raises(AttributeError, match="no attribute 'mdoe'"):
        getattr(config, "mdoe")  # noqa: B009 - an attribute that is not there
