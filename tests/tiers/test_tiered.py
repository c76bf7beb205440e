"""Tiered checkpoints on spawned gloo ranks: two "nodes" of two ranks, each with its own fast tier,
the durable tier on a moto S3 server. Saves drain and commit; restarts read each node's own copy,
fall back per node to the durable tier, finish a drain a crash cut off, or fall back a step."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import s3_objects
from tests.helpers import tiered
from tests.helpers.harness import run_ranks, spawn


def _names(options, url):
    return sorted(key.rsplit("/", 1)[1] for key in s3_objects(options, url))


def _held(tier_base, node, step):
    root = os.path.join(tier_base, f"node{node}")
    (run,) = os.listdir(root)
    return sorted(n for n in os.listdir(os.path.join(root, run, step)) if n.endswith(".held.json"))


@pytest.mark.parametrize("mode", [pytest.param("replica_group", marks=pytest.mark.slow), "all_ranks"])
def test_tiered_save_drains_then_each_node_restarts_from_its_own_copy(s3, tmp_path, mode):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    spawn(4, tiered.save_steps, run, tiers, (2, 2), [1, 2], options, {"mode": mode})

    durable = _names(options, f"{run}/step-2/")
    data = [n for n in durable if n.endswith(".ckio")]
    assert "ckptio.json" in durable and len(durable) == len(data) + 1
    # replicas upload once: replica_group's second group writes nothing durable
    assert sorted(int(n[-10:-5]) for n in data) == ([0, 1] if mode == "replica_group" else [0, 1, 2, 3])
    assert len(_held(tiers, 0, "step-2")) == 2 and len(_held(tiers, 1, "step-2")) == 2  # every rank keeps its own

    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [r[2]["durable"] for r in restarted] == [0, 0, 0, 0]

    # Node 1 replaced: its ranks fetch from node 0 what it holds (in HSDP, every item: node 0's ranks
    # hold the replicas of node 1's shards), and read nothing from S3.
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    read = [r[2] for r in restarted]
    assert [r["durable"] for r in read] == [0, 0, 0, 0] and [r["local"] for r in read[2:]] == [0, 0]
    assert all(r["peer"] > 0 for r in read[2:]) and [r["peer"] for r in read[:2]] == [0, 0]

    resharded = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    assert [r[:2] for r in resharded] == [(f"{run}/step-2", [])] * 4
    # the durable copy alone is an ordinary ckptio checkpoint
    assert spawn(4, tiered.load_durable, f"{run}/step-2", (2, 2), options, 2) == [[]] * 4


@pytest.mark.slow
def test_a_rank_killed_mid_drain_restarts_locally_or_finishes_the_drain_or_falls_back(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    config = {"mode": "all_ranks", "tuning": {"drain_timeout_s": 3}, "drain_bandwidth": 20_000}
    outcomes = run_ranks(4, tiered.save_then_die, run, tiers, (2, 2), options, 1, config)
    assert outcomes[1] == ("died", -9)
    assert "did not reach the durable tier in time" in outcomes[0][1] and "(rank 1)" in outcomes[0][1]
    ended = ("was not committed in time", "gave up committing")  # at their deadline, or told by the coordinator
    assert all(status == "ok" and any(e in text for e in ended) for status, text in outcomes[2:]), outcomes
    uploaded = [name for name in _names(options, f"{run}/step-2/") if name.endswith(".ckio")]
    assert "ckptio.json" not in _names(options, f"{run}/step-2/") and len(uploaded) == 3  # rank 1's never arrived
    assert spawn(4, tiered.load_durable, f"{run}/step-1", (2, 2), options, 1) == [[]] * 4  # the previous one stands
    snapshot = str(tmp_path / "snapshot")
    shutil.copytree(tiers, snapshot)

    # Same nodes: every rank loads its own copy now; the cut-off drain finishes behind the load.
    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [r[2]["durable"] for r in restarted] == [0, 0, 0, 0]
    assert "ckptio.json" in _names(options, f"{run}/step-2/")
    assert spawn(4, tiered.load_durable, f"{run}/step-2", (2, 2), options, 2) == [[]] * 4

    def undo_drain():
        from tests.conftest import s3_client

        bucket, _, _ = run.removeprefix("s3://").partition("/")
        for name in _names(options, f"{run}/step-2/"):
            if name == "ckptio.json" or name.endswith("-r00001.ckio"):
                s3_client(options).delete_object(Bucket=bucket, Key=f"run/step-2/{name}")
        shutil.rmtree(tiers)
        shutil.copytree(snapshot, tiers)

    # Node 1 replaced: rank 1's file survives on node 0 only, so the drain finishes first, then all load,
    # node 1's ranks from node 0 (which holds the replicas of their shards).
    undo_drain()
    shutil.rmtree(os.path.join(tiers, "node1"))
    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [(r[2]["durable"], r[2]["peer"] > 0) for r in restarted] == [(0, False)] * 2 + [(0, True)] * 2

    # Node 0 replaced: rank 1's file and the step's metadata are gone everywhere: step 1 it is.
    undo_drain()
    shutil.rmtree(os.path.join(tiers, "node0"))
    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4
