"""Tiered incremental saves (``local_tier`` with ``incremental_from``): the drain uploads only the blocks
that changed against the base on the durable tier, the node keeps a full copy (a restart from it reads no
chain), "previous" is the newest save committed on the durable tier, and a drain a crash cut off resumes
and commits its references, even after the base was deleted."""

from __future__ import annotations

import glob
import json
import os
import shutil

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format.document import decode_metadata
from ckptio.format.names import METADATA_NAME, reference_marker_name
from ckptio.storage import open_store
from ckptio.tools.cli import main as cli_main
from tests.conftest import STORES_SLOW_BEYOND_MOTO, s3_objects, store_objects
from tests.helpers import tiered
from tests.helpers.harness import run_ranks, spawn

FROZEN = 1 << 20  # fp32 elements: 4 MiB that never change
ADAPTER = 1 << 14  # fp32 elements: 64 KiB that change every step, with two moments


def _lora(step: int) -> dict:
    frozen = torch.randn(FROZEN, generator=torch.Generator().manual_seed(0))
    changing = torch.Generator().manual_seed(step)
    adapter = {name: torch.randn(ADAPTER, generator=changing) for name in ("lora", "exp_avg", "exp_avg_sq")}
    return {"frozen": frozen, **adapter, "step": step}


def _changed_bytes() -> int:
    return 3 * ADAPTER * 4


def _blank() -> dict:
    return {"frozen": torch.zeros(FROZEN), **{n: torch.zeros(ADAPTER) for n in ("lora", "exp_avg", "exp_avg_sq")}}


def _config(tier, drain_timeout_s: float = 3600.0, **more) -> ckptio.WriterConfig:
    tuning = ckptio.Tuning(max_block_size=64 << 10, drain_timeout_s=drain_timeout_s)
    return ckptio.WriterConfig(local_tier=str(tier), incremental_from="previous", tuning=tuning, **more)


def _save(url: str, tier, step: int, **more) -> None:
    dcp.save(_lora(step), storage_writer=ckptio.Writer(url, _config(tier, **more)))


def _load(url: str, tier=None) -> tuple[dict, dict]:
    value = {**_blank(), "step": -1}
    reader = ckptio.Reader(url, local_tier=str(tier) if tier else None)
    dcp.load(value, storage_reader=reader)
    return value, reader.bytes_read


def _exact(value: dict, step: int) -> bool:
    want = _lora(step)
    return value["step"] == step and all(torch.equal(value[k], want[k]) for k in want if k != "step")


def _base_of(url: str) -> str | None:
    with open(os.path.join(url, METADATA_NAME), "rb") as f:
        chain = json.loads(f.read()).get("chain")
    return chain and chain["base"]


def _data_bytes(url: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(url, "**", "*.ckio"), recursive=True))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_tiered_chain_uploads_what_changed_and_restarts_from_the_node_alone(tmp_path, compression):
    run, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    for step in (1, 2, 3):
        _save(str(run / f"step-{step}"), fast, step, compression=compression)
        ckptio.wait_for_uploads()
    for step in (2, 3):
        url = str(run / f"step-{step}")
        assert _base_of(url) == f"step-{step - 1}"
        assert _data_bytes(url) <= 1.05 * _changed_bytes() + (1 << 20), _data_bytes(url)
        value, read = _load(url, fast)  # the node's full copy: nothing from the durable tier, no chain
        assert _exact(value, step) and read["durable"] == 0 and read["local"] > FROZEN * 4 * 0.5
        value, _ = _load(url)  # the durable chain alone
        assert _exact(value, step)
    assert cli_main(["verify", str(run / "step-3")]) == 0
    shutil.rmtree(fast)  # a replaced node: everything from the durable chain
    value, read = _load(str(run / "step-3"), fast)
    assert _exact(value, 3) and read["local"] == 0


def test_previous_is_the_newest_save_the_durable_tier_committed(tmp_path):
    run, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    _save(str(run / "step-1"), fast, 1)
    ckptio.wait_for_uploads()
    _save(str(run / "step-2"), fast, 2, drain_bandwidth=1, drain_timeout_s=0.5)  # its drain never finishes
    with pytest.raises(ckptio.DrainError):
        ckptio.wait_for_uploads()
    _save(str(run / "step-3"), fast, 3)
    ckptio.wait_for_uploads()
    assert not os.path.exists(run / "step-2" / METADATA_NAME)
    assert _base_of(str(run / "step-3")) == "step-1"
    assert _exact(_load(str(run / "step-3"))[0], 3) and _exact(_load(str(run / "step-2"), fast)[0], 2)


def test_a_cut_off_drain_resumes_and_commits_its_references_after_the_base_was_deleted(tmp_path):
    run, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    _save(str(run / "step-1"), fast, 1)
    ckptio.wait_for_uploads()
    _save(str(run / "step-2"), fast, 2, drain_bandwidth=1, drain_timeout_s=0.5)
    with pytest.raises(ckptio.DrainError):
        ckptio.wait_for_uploads()
    assert os.path.exists(run / "step-1" / reference_marker_name("step-2"))  # marked before the save returned
    assert cli_main(["delete", "--force", str(run / "step-1")]) == 0  # keeps what step 2 references

    url = ckptio.latest(str(run), local_tier=str(fast))
    assert url == str(run / "step-2")
    value, read = _load(url, fast)
    assert _exact(value, 2) and read["durable"] == 0
    ckptio.wait_for_uploads()  # the resumed drain: step 2's changed blocks, then its commit
    assert _base_of(url) == "step-1" and _exact(_load(url)[0], 2)
    assert _data_bytes(url) <= 1.05 * _changed_bytes() + (1 << 20)


def test_tiered_incremental_saves_on_two_nodes_restart_from_each_nodes_copy(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    config = {
        "mode": "replica_group",
        "compression": "zstd",
        "incremental_from": "previous",
        "tuning": {"inline_limit": 0},
    }
    spawn(4, tiered.save_steps, run, tiers, (2, 2), [1], options, config)  # drained before step 2 starts
    spawn(4, tiered.save_steps, run, tiers, (2, 2), [2], options, {**config, "incremental_from": f"{run}/step-1"})
    full, incremental = (
        sum(size for key, size in s3_objects(options, f"{run}/step-{step}/").items() if key.endswith(".ckio"))
        for step in (1, 2)
    )
    assert incremental < 0.05 * full, (full, incremental)  # the marker changed, the model did not

    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [r[2]["durable"] for r in restarted] == [0, 0, 0, 0]
    shutil.rmtree(os.path.join(tiers, "node1"))  # node 1 replaced: node 0's full copies serve its ranks
    restarted = spawn(4, tiered.restart, run, tiers, (1, 4), options)
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [(r[2]["durable"], r[2]["peer"] > 0) for r in restarted] == [(0, False)] * 2 + [(0, True)] * 2


@pytest.mark.slow
def test_a_rank_killed_during_a_tiered_incremental_drain_leaves_the_previous_step_and_restarts_exact(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    outcomes = run_ranks(4, tiered.save_incremental_then_die, run, tiers, options, 1)
    assert outcomes[1] == ("died", -9) and all(status == "ok" for status, _ in outcomes[:1] + outcomes[2:])
    assert "ckptio.json" not in [key.rsplit("/", 1)[1] for key in s3_objects(options, f"{run}/step-2/")]
    assert spawn(4, tiered.load_durable, f"{run}/step-1", (2, 2), options, 1, True) == [[]] * 4  # it stands

    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options, True, True)  # same nodes: step 2 from them
    assert [r[:2] for r in restarted] == [(f"{run}/step-2", [])] * 4
    assert [r[2]["durable"] for r in restarted] == [0, 0, 0, 0]
    objects = s3_objects(options, f"{run}/step-2/")
    assert "ckptio.json" in [key.rsplit("/", 1)[1] for key in objects]  # the drain finished behind the load


@pytest.mark.slow
def test_a_rank_killed_while_it_writes_a_tiered_incremental_save_leaves_the_previous_step(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    outcomes = run_ranks(4, tiered.killed_during_incremental_save, run, tiers, options, 2, timeout=120)
    assert outcomes[2] == ("died", -9), outcomes
    assert all(status in ("ok", "error") and value != "saved" for status, value in outcomes[:2] + outcomes[3:])
    restarted = spawn(4, tiered.restart, run, tiers, (2, 2), options, True, True)  # step 2 never committed
    assert [r[:2] for r in restarted] == [(f"{run}/step-1", [])] * 4


def test_a_save_made_while_its_previous_drains_references_it_and_commits_after_it(tmp_path):
    run, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    for step in (1, 2, 3):  # ~4 MiB at 4 MiB/s: each save is made while the one before it drains
        _save(str(run / f"step-{step}"), fast, step, drain_bandwidth=4 << 20)
    assert ckptio.uploads_pending() > 0
    ckptio.wait_for_uploads()
    for step in (2, 3):
        url = str(run / f"step-{step}")
        assert _base_of(url) == f"step-{step - 1}"
        assert _data_bytes(url) <= 1.05 * _changed_bytes() + (1 << 20), _data_bytes(url)
        assert _exact(_load(url)[0], step)


def _settling(step: int) -> dict:
    """A state that gains ``settled`` at step 2, which then stays: step 3 references step 2's own bytes."""
    value = _lora(step)
    if step >= 2:
        value["settled"] = torch.randn(FROZEN // 2, generator=torch.Generator().manual_seed(2))
    return value


def test_a_save_whose_draining_base_never_arrives_is_committed_full_from_the_nodes_copy(tmp_path):
    from ckptio.tiers.paths import local_step_path

    run, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    dcp.save(_settling(1), storage_writer=ckptio.Writer(str(run / "step-1"), _config(fast, drain_bandwidth=2 << 20)))
    for step in (2, 3):  # both saved while step 1 drains (~2 s): step 3 against step 2, step 2 against step 1
        dcp.save(_settling(step), storage_writer=ckptio.Writer(str(run / f"step-{step}"), _config(fast)))
        if step == 2:  # damaged on the node before its upload: its drain refuses it, step 2 never commits
            folder = local_step_path(str(fast), str(run / "step-2"), None)
            (durable,) = [p for p in glob.glob(f"{folder}/data-*.ckio") if not tiered.is_full_copy(p)]
            tiered.flip_a_byte(durable)
    with pytest.raises(ckptio.DrainError, match="changed after the save"):
        ckptio.wait_for_uploads()
    assert not os.path.exists(run / "step-2" / METADATA_NAME)
    url = str(run / "step-3")
    assert _base_of(url) is None  # committed full, from its node's full copy: it references nothing missing
    assert not glob.glob(str(run / "step-*" / "ckptio.referenced-by-step-3*"))
    assert not os.path.exists(run / "step-3" / "ckptio.rebase")
    shutil.rmtree(fast)
    value = {**_blank(), "settled": torch.zeros(FROZEN // 2), "step": -1}
    dcp.load(value, storage_reader=ckptio.Reader(url))
    want = _settling(3)
    assert value["step"] == 3 and all(torch.equal(value[k], want[k]) for k in want if k != "step")


def _chain(options, url: str):
    return json.loads(open_store(url, options).read(METADATA_NAME)).get("chain")


@pytest.mark.parametrize("store", STORES_SLOW_BEYOND_MOTO, indirect=True)
def test_saves_on_two_nodes_made_while_the_drain_lags_stay_incremental_and_load_exactly(store, tmp_path):
    base, options = store
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    outcomes = spawn(4, tiered.save_while_draining, run, tiers, options, 3)
    assert all(o.endswith(" drained") and int(o.split()[0]) > 0 for o in outcomes), outcomes  # it did lag
    sizes = {
        step: sum(n for key, n in store_objects(f"{run}/step-{step}", options).items() if key.endswith(".ckio"))
        for step in (1, 2, 3)
    }
    changed = 64 * 1024 * 4  # ``moving``: every other byte is referenced
    assert sizes[2] <= 1.05 * (changed + 512 * 1024 * 4) + (1 << 20) and sizes[3] <= 1.05 * changed + (1 << 20), sizes
    for step in (2, 3):
        assert _chain(options, f"{run}/step-{step}")["base"] == f"step-{step - 1}"
    assert spawn(4, tiered.load_settling, f"{run}/step-3", options, 3) == [True] * 4


@pytest.mark.slow
def test_saves_on_two_nodes_whose_draining_base_is_refused_are_rebased_full_and_load_exactly(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    outcomes = spawn(4, tiered.save_while_draining, run, tiers, options, 3, 1)
    assert all("refused" in o or "changed after the save" in o for o in outcomes), outcomes  # step 2, on every rank
    names = [key.rsplit("/", 1)[1] for key in s3_objects(options, f"{run}/")]
    assert METADATA_NAME not in [k.rsplit("/", 1)[1] for k in s3_objects(options, f"{run}/step-2/")]
    with fsspec.open(f"{run}/step-3/{METADATA_NAME}", "rb", **options) as f:
        files = decode_metadata(f.read(), "step-3").files
    assert not [name for name in files if name.startswith("../step-2/")], files  # nothing of step 2, which failed
    assert "ckptio.rebase" not in names
    assert "ckptio.referenced-by-step-3.json" not in [
        k.rsplit("/", 1)[1] for k in s3_objects(options, f"{run}/step-2/")
    ]
    shutil.rmtree(tiers)
    assert spawn(4, tiered.load_settling, f"{run}/step-3", options, 3) == [True] * 4


def test_a_job_killed_while_its_saves_wait_to_upload_restarts_from_the_newest_and_commits_it(s3, tmp_path):
    base, options = s3
    run, tiers = f"{base}/run", str(tmp_path / "tiers")
    outcomes = run_ranks(4, tiered.save_while_draining_then_die, run, tiers, options, 3)
    assert [status for status, _ in outcomes] == ["died"] * 4, outcomes
    assert not [k for k in s3_objects(options, f"{run}/") if k.endswith(METADATA_NAME)]  # nothing committed

    restarted = spawn(4, tiered.restart_settling, run, tiers, options)
    assert restarted == [(f"{run}/step-3", True, 0)] * 4  # the newest, from the nodes alone
    assert _chain(options, f"{run}/step-3")["base"] == "step-2"  # committed as saved: its bases' files uploaded
    shutil.rmtree(tiers)
    assert spawn(4, tiered.load_settling, f"{run}/step-3", options, 3) == [True] * 4
