"""Issue 65: one answer per checkpoint. Each finding as a fixed example: every rank takes a shared decision
the same way (which document a load reads, whether a save is refused, which step ``latest`` names, whether a
node copy stands in for its URL)."""

from __future__ import annotations

import glob
import os

import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.helpers import one_answer_ranks
from tests.helpers.harness import spawn
from tests.helpers.tiered import flip_a_byte

#: A hang shows as the harness's timeout, not torch's default 30 minutes.
QUICK_HANG = {"CKPTIO_TEST_PG_TIMEOUT": "60"}


def test_ranks_that_read_a_fragment_set_and_its_merged_document_load_the_same_values(tmp_path):
    """Finding 5: rank 0 read the committed merge, rank 1 the fragments before it; both went their own way
    and waited for each other until the process group's timeout."""
    url = str(tmp_path / "run" / "step-1")
    assert spawn(2, one_answer_ranks.load_while_the_merge_commits, url, timeout=90, env=QUICK_HANG) == [True, True]


def test_a_partner_node_never_serves_a_save_that_was_deleted_and_saved_again(s3, tmp_path):
    """Finding 2 (silent wrong values): node B's partner copy of the deleted save was served after a new
    save to the URL had begun there and node A, which held the new save's document, was lost."""
    base, options = s3
    run = f"{base}/run"
    got = spawn(
        2, one_answer_ranks.partner_copy_after_delete_and_save_again, run, str(tmp_path), options, env=QUICK_HANG
    )
    for url, at_latest, step_5 in got:
        assert url == f"{run}/step-4" and at_latest == 40.0, got
        assert step_5 == "CheckpointNotFoundError", got  # nothing loadable there: never the deleted values


def test_a_job_resumed_from_the_step_latest_named_saves_the_step_it_passed_over_without_overwrite(s3, tmp_path):
    """Finding 3: step-11 was cut off and lost with node B; the job resumes from step-10 and saves step-11
    again on every rank (it was refused by node A's partial step-11), which gc would have removed."""
    base, options = s3
    run = f"{base}/run"
    got = spawn(
        2, one_answer_ranks.restart_saves_the_step_latest_passed_over, run, str(tmp_path), options, env=QUICK_HANG
    )
    for rank, (url, resumed, removable, saved) in enumerate(got):
        assert url == f"{run}/step-10" and resumed == 10.0 and saved == 111.0, got
        assert removable == (["step-11"] if rank == 0 else None), got


def _tiered(tier, **config) -> ckptio.WriterConfig:
    return ckptio.WriterConfig(local_tier=str(tier), **config)


def _save(url: str, value: float, config: ckptio.WriterConfig, options: dict | None = None) -> None:
    dcp.save(one_answer_ranks._state(value), storage_writer=ckptio.Writer(url, config, storage_options=options))
    try:
        ckptio.wait_for_uploads()
    except ckptio.DrainError:
        assert config.drain_bandwidth == 1, "a drain failed"


def _loaded(url: str, tier=None, options: dict | None = None) -> float:
    state = one_answer_ranks._blank()
    dcp.load(state, storage_reader=ckptio.Reader(url, local_tier=str(tier) if tier else None, storage_options=options))
    value = float(state["a"][0])
    assert one_answer_ranks._exact(state, value)
    return value


def test_a_tiered_save_after_a_delete_of_its_drained_copy_is_not_refused(tmp_path):
    """Finding 3, first part: the node's copy had reached the durable tier (then ``ckptio delete``); the
    refusal said it had not."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    _save(f"{run}/step-1", 1.0, _tiered(tier))
    assert cli_main(["delete", "--force", f"{run}/step-1"]) == 0
    assert ckptio.latest(run, local_tier=str(tier)) is None  # deleted on the durable tier: passed over
    _save(f"{run}/step-1", 2.0, _tiered(tier))
    assert _loaded(f"{run}/step-1", tier) == 2.0 == _loaded(f"{run}/step-1")


def test_latest_passes_over_a_damaged_node_document_for_the_durable_step(tmp_path, caplog):
    """Finding 4: a flipped byte in a node's ``ckptio.json`` made ``latest`` raise; it passes the copy over
    with one warning naming the file, and the durable step loads."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    _save(f"{run}/step-1", 1.0, _tiered(tier))
    _save(f"{run}/step-2", 2.0, _tiered(tier, **one_answer_ranks.STALLED))
    for step in ("step-1", "step-2"):
        (document,) = glob.glob(str(tier / "*" / step / "ckptio.json"))
        flip_a_byte(document)
    assert ckptio.latest(run, local_tier=str(tier)) == f"{run}/step-1"
    named = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "pass" in r.getMessage()]
    assert [m for m in named if "step-2" in m], named
    assert _loaded(f"{run}/step-1", tier) == 1.0
    _save(f"{run}/step-2", 3.0, _tiered(tier))  # passed over: saved again without overwrite
    assert _loaded(f"{run}/step-2") == 3.0


def test_latest_on_the_command_line_answers_without_uploading(tmp_path, capsys):
    """Item 7: ``ckptio latest --local-tier`` committed a cut-off step on the durable tier as a side effect."""
    run, tier = str(tmp_path / "run"), tmp_path / "tier"
    _save(f"{run}/step-1", 1.0, _tiered(tier, **one_answer_ranks.STALLED))
    assert cli_main(["latest", run, "--local-tier", str(tier)]) == 0
    assert capsys.readouterr().out.strip() == f"{run}/step-1"
    assert not os.path.exists(f"{run}/step-1/ckptio.json")
    assert ckptio.latest(run, local_tier=str(tier)) == f"{run}/step-1"  # a restarting job resumes the drain
    ckptio.wait_for_uploads()
    assert _loaded(f"{run}/step-1") == 1.0


def test_a_requeued_job_saves_again_the_step_an_earlier_attempt_left_incomplete(s3, tmp_path):
    """Finding 6: ranks 0-2 refused (their fragments of attempt 1 were on the nodes and on S3), rank 3 wrote
    and committed, then failed because its peers left."""
    base, options = s3
    run = f"{base}/run"
    env = {**QUICK_HANG, "CKPTIO_JOB_ID": "job-42"}
    spawn(4, one_answer_ranks.requeue_attempt, run, str(tmp_path), options, 1, env=env)
    got = spawn(4, one_answer_ranks.requeue_attempt, run, str(tmp_path), options, 2, env=env)
    assert got == [(f"{run}/step-1", 1.0, 22.0, f"{run}/step-2")] * 4, got
