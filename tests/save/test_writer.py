"""The DCP StorageWriter (``ckptio.saving.writer``): what it accepts and refuses, plan caching, storage_meta."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from tests.helpers import findings
from tests.helpers.harness import spawn


# --- silent data loss or wrong values -------------------------------------------------------------
def test_plan_caching_never_reuses_the_committed_checkpoints_data_files(tmp_path):
    url = str(tmp_path / "ckpt")
    results = spawn(2, findings.save_twice_with_plan_caching, url)
    first, second, wrong = results[0]
    assert first and second and not set(first) & set(second), (first, second)
    assert all(r[2] == [] for r in results), results


def test_ranks_given_different_paths_fail_before_writing_anything(tmp_path):
    for outcome in spawn(2, findings.save_to_a_per_rank_path, str(tmp_path)):
        assert outcome.startswith("CheckpointError") and "different checkpoint locations" in outcome, outcome
    assert os.listdir(tmp_path) == []


def test_storage_meta_on_save_and_load(tmp_path):
    url = str(tmp_path / "ckpt")
    metadata = dcp.save({"w": torch.ones(3)}, storage_writer=ckptio.Writer(url))
    assert metadata.storage_meta.checkpoint_id == url and metadata.storage_meta.save_id
    read = ckptio.Reader(url).read_metadata()
    assert read.storage_meta.save_id == metadata.storage_meta.save_id and read.storage_meta.load_id


def test_writer_accepts_torchs_overwrite_keyword(tmp_path):
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=ckptio.Writer(url))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3)}, storage_writer=ckptio.Writer(url))
    assert "ckptio.Writer(path, overwrite=True)" in str(ckptio.unwrap(info.value))
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=ckptio.Writer(url, overwrite=True))
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["w"], torch.full((3,), 2.0))


def test_a_mode_change_under_torchs_plan_cache_is_reported(tmp_path):
    # the cached plan is replayed as it was made (all_ranks); the save is right, and rank 0 says so
    (messages0, exact0), (messages1, exact1) = spawn(2, findings.switch_mode_under_plan_cache, str(tmp_path))
    assert exact0 and exact1
    assert len(messages0) == 1 and "mode 'all_ranks'" in messages0[0] and "'replica_group'" in messages0[0]
    assert messages1 == []
