"""The cross-rank value check (``ckptio.saving.consistency``): values that differ between ranks are found and named."""

from __future__ import annotations

import os

import pytest

from tests.helpers import findings
from tests.helpers.documents import meta_path
from tests.helpers.harness import spawn


def test_object_reports_find_every_key_whose_value_differs_between_ranks():
    from ckptio.saving.consistency import ObjectReport, differing_keys

    # each rank also holds a key of its own (a data loader's): one holder never differs
    reports = [ObjectReport(r, {"lr": ("object", 1, 8), f"loader.{r}": ("object", r, 8)}) for r in range(6)]
    assert differing_keys(reports) == {}
    reports[4].digests["lr"] = ("object", 2, 8)
    reports[1].digests["lr"] = ("object", 2, 8)
    reports[5].digests["step"] = ("object", 0, 8)  # a key only the last rank holds
    assert differing_keys(reports) == {"lr": [[0, 2, 3, 5], [1, 4]]}
    reports[5].digests["lr"] = ("object", 3, 8)  # the last rank's value is not everyone's
    assert differing_keys(reports) == {"lr": [[0, 2, 3], [1, 4], [5]]}


@pytest.mark.parametrize("which", ["rng", "counter", "sampled"])
def test_plain_tensors_that_differ_between_ranks_fail_the_save(tmp_path, which):
    url = str(tmp_path / which)
    key = {"rng": "rng", "counter": "samples_seen", "sampled": "noise"}[which]
    for outcome in spawn(2, findings.save_per_rank_tensor, url, which):
        assert outcome.startswith("PerRankStateError") and f"tensor key '{key}'" in outcome, outcome
        assert "ranks [0]; ranks [1]" in outcome and "ckptio.PerRank" in outcome
    assert not os.path.exists(meta_path(url))


def test_equal_objects_whose_pickles_differ_are_not_per_rank_state(tmp_path):
    url = str(tmp_path / "ckpt")
    for outcome, config, tags in spawn(2, findings.save_equal_objects_with_different_pickles, url):
        assert outcome == "ok"
        assert config == {"lr": 0.1, "warmup": 100, "betas": (0.9, 0.95), "name": "run"}
        assert tags == {f"tag-{i}" for i in range(32)}
