"""Where a checkpoint's fast-tier copy lives: one folder per run and endpoint, steps ordered by number."""

from __future__ import annotations

import pytest

from ckptio.tiers.paths import local_run_path, local_step_path, run_key, split_step, step_order


def test_the_same_bucket_and_key_on_two_endpoints_are_two_runs():
    one = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    other = {"endpoint_url": "http://127.0.0.1:9001/"}
    keys = {run_key("s3://bucket/run", options) for options in (None, one, other)}
    assert len(keys) == 3
    assert run_key("s3://bucket/run/", {"endpoint_url": "http://127.0.0.1:9000/"}) == run_key("s3://bucket/run", one)
    assert all(key.startswith("s3_bucket_run-") for key in keys)  # readable, then the hash


def test_step_paths_sit_in_their_run_folder(tmp_path):
    run = local_run_path(tmp_path, "s3://bucket/run")
    assert local_step_path(tmp_path, "s3://bucket/run/step-7") == f"{run}/step-7"
    assert split_step("/data/run/step-7/") == ("/data/run", "step-7")
    with pytest.raises(ValueError, match="must name a step inside a run folder"):
        split_step("s3://bucket")


def test_steps_order_by_their_last_number():
    names = ["step-100", "step-99", "final", "epoch-2-step-10", "step-9"]
    assert sorted(names, key=step_order) == ["final", "step-9", "epoch-2-step-10", "step-99", "step-100"]
