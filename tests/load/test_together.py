"""``together.fail_together``: a failure on any rank fails every rank, with the failing rank's class."""

from __future__ import annotations

import ckptio
from ckptio.loading.together import fail_together
from tests.helpers import scenarios
from tests.helpers.harness import spawn


def _fail_on(failing: dict[int, BaseException | None]) -> tuple[str, str]:
    import torch.distributed as dist

    try:
        fail_together(failing.get(dist.get_rank()), None, "failed testing")
    except ckptio.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "none", ""


def test_every_rank_raises_the_lowest_failing_ranks_error_and_a_failing_rank_its_own():
    failing = {1: ckptio.CorruptCheckpointError("block 3 is damaged"), 2: ValueError("boom")}
    got = spawn(3, _fail_on, failing)
    assert got[0] == ("CorruptCheckpointError", "rank 1 failed testing: block 3 is damaged (ranks that failed: [1, 2])")
    assert got[1] == ("CorruptCheckpointError", "block 3 is damaged")
    assert got[2] == ("CheckpointError", "rank 2 failed testing: ValueError: boom")


def test_nothing_is_raised_when_no_rank_failed():
    assert spawn(2, _fail_on, {}) == [("none", ""), ("none", "")]


def test_a_metadata_failure_on_one_rank_fails_every_rank_promptly(tmp_path):
    url = str(tmp_path / "ok")
    spawn(2, scenarios.save, url, (1, 2), "all_ranks")
    outcomes = spawn(2, scenarios.load_where_only_rank_1_is_wrong, url, env={"CKPTIO_TEST_PG_TIMEOUT": "60"})
    for elapsed, message in outcomes:
        assert elapsed < 20 and message.startswith("CheckpointNotFoundError") and "-typo" in message, message
