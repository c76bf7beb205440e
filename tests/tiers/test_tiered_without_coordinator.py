"""Tiered saves without a coordinator (``dcp.save(..., use_collectives=False)`` with ``local_tier``) on
spawned gloo ranks, two "nodes" of two ranks: each rank commits its fragment on its node at once and on S3
after its upload, where rank 0 merges the set; a restart reads each node's copy, or, when the drains were
cut off, merges the fragments the nodes hold between them and finishes the drain behind the load."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import STORES_SLOW_BEYOND_MOTO, store_objects
from tests.helpers import tiered
from tests.helpers.harness import spawn


def _names(options, url):
    return sorted(key.rsplit("/", 1)[-1] for key in store_objects(url, options))


@pytest.mark.parametrize("store", STORES_SLOW_BEYOND_MOTO, indirect=True)
def test_fragments_drain_merge_once_and_each_node_restarts_from_its_own_copy(store, tmp_path):
    base, options = store
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    config = {"mode": "replica_group", "tuning": {"inline_limit": 0}}  # a fragment keeps small items inline by default
    spawn(4, tiered.save_steps, run, tiers, (2, 2), [1], options, config, False)
    durable = _names(options, f"{run}/step-1/")
    assert "ckptio.json" in durable and sum(n.startswith("ckptio.rank-") for n in durable) == 4

    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4
    assert [r[2]["durable"] for r in restarted] == [0, 0, 0, 0]
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4
    assert [(r[2]["durable"], r[2]["peer"] > 0) for r in restarted] == [(0, False)] * 2 + [(0, True)] * 2


def test_drains_cut_off_restart_from_the_nodes_fragments_and_finish_behind_the_load(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    outcomes = spawn(4, tiered.save_with_a_stalled_drain, run, tiers, (2, 2), options, False)
    assert all("cannot finish within drain_timeout_s" in text for text in outcomes), outcomes
    assert "ckptio.json" not in _names(options, f"{run}/step-2/")

    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)  # the nodes' fragments make step 2
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [r[2]["durable"] for r in restarted] == [0, 0, 0, 0]
    assert "ckptio.json" in _names(options, f"{run}/step-2/")  # the drain finished behind the load
    assert spawn(4, tiered.load_durable, f"{run}/step-2", (2, 2), options, 2) == [[]] * 4
