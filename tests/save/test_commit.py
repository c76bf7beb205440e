"""Commit (``ckptio.saving.commit``): create-only, exactly once when saves race."""

from __future__ import annotations

import os

import pytest
import torch

import ckptio
from ckptio.format.names import METADATA_NAME
from ckptio.tools.cli import main as cli_main
from tests.helpers import findings, scenarios
from tests.helpers.documents import STATE, fresh, saved
from tests.helpers.harness import run_ranks


def test_two_saves_racing_to_one_path_commit_exactly_once_locally(tmp_path):
    url = str(tmp_path / "ckpt")
    findings.race_two_saves(url)
    assert len([n for n in os.listdir(url) if n.endswith(".ckio")]) == 0  # everything inline, loser cleaned up


def test_two_saves_racing_to_one_path_commit_exactly_once_on_s3(s3):
    base, options = s3
    findings.race_two_saves(f"{base}/race", options)


def test_existing_checkpoint_is_never_overwritten_by_accident(tmp_path):
    url = saved(tmp_path)
    with pytest.raises(ckptio.CheckpointExistsError, match="overwrite=True"):
        ckptio.save(STATE, url)
    old_files = set(os.listdir(url))

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this on purpose")

    with pytest.raises(ckptio.CheckpointError, match="cannot pickle this on purpose"):
        ckptio.save({**STATE, "bad": Unpicklable()}, url, ckptio.WriterConfig(overwrite=True))
    assert set(os.listdir(url)) == old_files  # the failed overwrite left the old checkpoint as it was
    loaded = fresh()
    ckptio.load(loaded, url)
    assert torch.equal(loaded["w"], STATE["w"])

    newer = {**STATE, "w": STATE["w"] + 1}
    ckptio.save(newer, url, ckptio.WriterConfig(overwrite=True, tuning=ckptio.Tuning(inline_limit=0)))
    loaded = fresh()
    ckptio.load(loaded, url)
    assert torch.equal(loaded["w"], newer["w"])
    new_files = set(os.listdir(url))
    assert len(new_files) == 2 and not (new_files - {METADATA_NAME}) & old_files  # superseded files removed


def test_rank_killed_mid_save_leaves_an_incomplete_checkpoint_and_the_previous_one_intact(tmp_path, capsys):
    previous, url = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    outcomes = run_ranks(2, scenarios.save_then_die_mid_save, previous, url, env={"CKPTIO_TEST_PG_TIMEOUT": "30"})
    assert outcomes[1][0] == "died"
    status, (elapsed, message) = outcomes[0]
    assert status == "ok" and elapsed < 30, outcomes[0]
    assert message.startswith("ckptio.errors.CheckpointError") and "another rank died" in message, message
    assert not os.path.exists(os.path.join(url, METADATA_NAME))
    with pytest.raises(ckptio.IncompleteCheckpointError, match=r"holds \d data file\(s\) of save\(s\)"):
        ckptio.load(scenarios.make_state(None, empty=True), url)
    assert scenarios.load(previous, None) == []
    assert cli_main(["verify", "-q", previous]) == 0
    orphans = sorted(os.listdir(url))
    scenarios.save(url, None, "all_ranks")  # saving again to the same path succeeds
    assert scenarios.load(url, None) == []
    capsys.readouterr()
    assert cli_main(["verify", "-q", url]) == 0
    assert f"belong to saves that never committed and are never read; safe to delete: {', '.join(orphans)}" in (
        capsys.readouterr().out
    )
