"""Saves without a coordinator (``dcp.save(..., use_collectives=False)``, ``WriterConfig(use_collectives=
False)``): no rank exchanges anything before the closing barrier; each commits a fragment; the set loads
like any checkpoint, resharded, by every reader and tool; incomplete, mixed or duplicated sets are
refused by name."""

from __future__ import annotations

import json
import os
import shutil

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load_file

import ckptio
from ckptio.format.names import METADATA_NAME, fragment_name, parse_data_file_name
from ckptio.storage import open_store
from ckptio.tools.cleanup import find_garbage
from ckptio.tools.cli import main as cli_main
from tests.conftest import cli_storage_options, object_store
from tests.helpers import fragment_ranks
from tests.helpers.fragment_ranks import only_fragments
from tests.helpers.harness import run_ranks, spawn

HSDP = {"model.w": [("R",), ("S", 0)], "model.e": [("S", 1), ("S", 0)]}
CASE = {"save_world": 4, "save_mesh": [2, 2], "save_placements": HSDP, "seed": 11, "max_block_size": 1024}
LOADS = {
    "1x4": (4, [1, 4], {"model.w": [("R",), ("S", 1)], "model.e": [("S", 0), ("S", 2)]}),
    "4x1": (4, [4, 1], {"model.w": [("S", 0), ("R",)], "model.e": [("R",), ("S", 1)]}),
    "one process": (1, [1], {"model.w": [("R",)], "model.e": [("R",)]}),
}


def _files(url: str) -> list[str]:
    return sorted(open_store(url).list_sizes())


def _load_everywhere(url: str, case: dict, through: str = "dcp") -> None:
    for name, (world, mesh, placements) in LOADS.items():
        loading = {**case, "load_mesh": mesh, "load_placements": placements}
        assert spawn(world, fragment_ranks.load_and_compare, url, loading, through) == [[]] * world, name


@pytest.mark.parametrize("mode", ["replica_group", "all_ranks"])
def test_saved_on_2x2_without_collectives_loads_on_1x4_4x1_and_one_process(tmp_path, mode):
    url = str(tmp_path / "ckpt")
    case = {**CASE, "mode": mode, "compression": "zstd", "dedup": mode == "all_ranks"}
    exchanges = spawn(4, fragment_ranks.save, url, case)
    assert exchanges == [{}] * 4  # nothing but the closing barrier
    files = _files(url)  # rank 0 merged the fragments once every rank's was there
    assert [f for f in files if f.startswith("ckptio.")] == ["ckptio.json"] + [fragment_name(r, 4) for r in range(4)]
    writers = sorted(parse_data_file_name(f).rank for f in files if parse_data_file_name(f))
    # model.w (640x64 fp32, 80 KiB per shard) replicated across the 2 groups: written once; model.e sharded
    # 4 ways (420 B per rank) and every rank's small objects go inline into its fragment
    assert writers == [0, 1], files
    for rank in range(4):  # 1.0 documents with the fragment feature
        with open(os.path.join(url, fragment_name(rank, 4)), "rb") as f:
            assert json.load(f)["features"] == ["fragment"]
    if mode == "replica_group":  # and as a job that died right after its save leaves them: merged by the loads
        only_fragments(url)
    _load_everywhere(url, case, through="dcp" if mode == "all_ranks" else "ckptio")


def test_dcp_async_save_without_collectives_loads_resharded(tmp_path):
    url = str(tmp_path / "ckpt")
    case = {**CASE, "async": True, "mode": "replica_group"}
    assert spawn(4, fragment_ranks.save, url, case) == [{}] * 4
    writers = sorted(parse_data_file_name(f).rank for f in _files(url) if parse_data_file_name(f))
    assert writers == [0, 1]  # the staged copy keeps the placements: replicas still written once
    world, mesh, placements = LOADS["1x4"]
    assert (
        spawn(world, fragment_ranks.load_and_compare, url, {**case, "load_mesh": mesh, "load_placements": placements})
        == [[]] * 4
    )


def test_a_load_with_collectives_lists_and_reads_each_fragment_once_for_all_ranks(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/run/step-1"
    case = {**CASE, "storage_options": options, "mode": "replica_group"}
    assert spawn(4, fragment_ranks.save, url, case) == [{}] * 4
    saved = proxy.reset()
    merged = [r for r in saved.log if r.operation == "PUT" and r.key.endswith("/ckptio.json")]
    assert len(merged) == 1 and saved.requests["HEAD"] <= 2, saved.requests  # rank 0's merge, once
    assert saved.requests["LIST"] <= 8, saved.requests  # rank 0 alone lists, until every fragment is there
    world, mesh, placements = LOADS["4x1"]
    loading = {**case, "load_mesh": mesh, "load_placements": placements}
    assert spawn(world, fragment_ranks.load_and_compare, url, loading) == [[]] * 4
    loaded = proxy.reset()  # the merged document: no listing, no fragment read
    assert loaded.requests["LIST"] == 0 and not any("ckptio.rank-" in r.key for r in loaded.log), loaded.requests
    open_store(url, options).remove(METADATA_NAME)  # a job that died right after its save: loads merge
    proxy.reset()
    assert spawn(world, fragment_ranks.load_and_compare, url, loading) == [[]] * 4
    loaded = proxy.reset()
    fragment_gets = sorted(
        r.key.rsplit("/", 1)[1] for r in loaded.log if r.operation == "GET" and "ckptio.rank-" in r.key
    )
    assert fragment_gets == [fragment_name(r, 4) for r in range(4)], fragment_gets  # once each, not once per rank
    assert loaded.requests["LIST"] == 1, loaded.requests


@pytest.mark.slow
def test_saved_on_4x2_without_collectives_loads_on_1x4_4x1_and_one_process(tmp_path):
    url = str(tmp_path / "ckpt")
    case = {**CASE, "save_world": 8, "save_mesh": [4, 2], "mode": "all_ranks"}
    assert spawn(8, fragment_ranks.save, url, case) == [{}] * 8
    _load_everywhere(url, case)


def test_objects_saved_per_rank_under_one_key_are_kept_per_rank(tmp_path):
    url = str(tmp_path / "ckpt")
    spawn(4, fragment_ranks.save, url, CASE)
    manifest = ckptio.Reader(url).prefetch_metadata()
    assert sorted(manifest.per_rank) == ["rng.seed"] and sorted(manifest.per_rank["rng.seed"]) == [0, 1, 2, 3]
    assert "lr" not in manifest.per_rank and "optim.step" not in manifest.per_rank  # equal: kept once
    with pytest.raises(ckptio.PerRankStateError, match="'rng.seed' was saved with one value per rank by 4 ranks"):
        ckptio.load({"rng": {"seed": 0}}, url)


def _copy(src: str, dst: str, name: str) -> None:
    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def test_incomplete_mixed_and_duplicated_fragment_sets_are_refused_by_name(tmp_path):
    a, b, two = (str(tmp_path / name) for name in ("a", "b", "two"))
    spawn(4, fragment_ranks.save, a, CASE)
    spawn(4, fragment_ranks.save, b, CASE)
    spawn(2, fragment_ranks.save, two, {**CASE, "save_world": 2, "save_mesh": [1, 2]})
    for url in (a, b, two):  # the sets as untrusted input: merged by the loads
        only_fragments(url)

    probe = str(tmp_path / "probe")
    shutil.copytree(a, probe)
    os.remove(os.path.join(probe, fragment_name(2, 4)))
    with pytest.raises(ckptio.IncompleteCheckpointError, match=r"ranks \[2\] never committed theirs"):
        ckptio.Reader(probe).prefetch_metadata()
    assert ckptio.latest(str(tmp_path)) != f"{tmp_path}/probe"

    _copy(a, probe, fragment_name(3, 4))  # rank 3's fragment under rank 2's name
    os.rename(os.path.join(probe, fragment_name(3, 4)), os.path.join(probe, fragment_name(2, 4)))
    _copy(a, probe, fragment_name(3, 4))
    with pytest.raises(ckptio.MixedFragmentsError, match="says it is rank 3's of 4"):
        ckptio.Reader(probe).prefetch_metadata()

    shutil.rmtree(probe)
    shutil.copytree(a, probe)
    for name in os.listdir(b):  # rank 0's fragment (and its files) from another save
        if name == fragment_name(0, 4) or parse_data_file_name(name):
            _copy(b, probe, name)
    with pytest.raises(ckptio.MixedFragmentsError, match="fragments of 2 different saves"):
        ckptio.Reader(probe).prefetch_metadata()

    shutil.rmtree(probe)
    shutil.copytree(a, probe)
    _copy(two, probe, fragment_name(0, 2))
    with pytest.raises(ckptio.MixedFragmentsError, match=r"different numbers of ranks \(2 ranks: .*4 ranks"):
        ckptio.Reader(probe).prefetch_metadata()


def test_a_save_killed_on_one_rank_stays_incomplete_and_the_previous_step_loads(tmp_path):
    run = str(tmp_path / "run")
    # the survivors' closing barrier waits for the dead rank until the group's timeout
    outcomes = run_ranks(4, fragment_ranks.save_then_die_on_rank, run, CASE, 1, env={"CKPTIO_TEST_PG_TIMEOUT": "6"})
    assert outcomes[1][0] == "died" and all(status == "ok" for status, _ in outcomes[:1] + outcomes[2:]), outcomes
    fragments = [n for n in os.listdir(f"{run}/step-2") if n.startswith("ckptio.")]
    assert sorted(fragments) == [fragment_name(r, 4) for r in (0, 2, 3)]
    with pytest.raises(ckptio.IncompleteCheckpointError, match=r"ranks \[1\] never committed"):
        ckptio.load({"lr": 0.0}, f"{run}/step-2")
    assert ckptio.latest(run) == f"{run}/step-1"
    loaded = {"lr": 0.0, "optim.step": torch.tensor(0.0)}
    ckptio.load(loaded, f"{run}/step-1")
    assert loaded == {"lr": 0.5, "optim.step": torch.tensor(11.0)}
    assert cli_main(["gc", f"{run}/step-2", "--delete"]) == 0
    assert os.listdir(f"{run}/step-2") == []


def test_an_overwrite_whose_ranks_replace_their_fragments_in_turn_is_merged_once_all_have(tmp_path):
    """Rank 0's merge found a set complete by name that mixed the overwritten save's fragments with the
    new one's (a rank slower to replace its own) and gave the merge up to the loads; it asks again."""
    url = str(tmp_path / "ckpt")
    spawn(4, fragment_ranks.save, url, CASE)
    first = open_store(url).read(METADATA_NAME)
    merged = spawn(4, fragment_ranks.save_late, url, {**CASE, "overwrite": True, "seed": 12}, 3, 1.0)
    assert len(set(merged)) == 1 and merged[0] not in first.decode()  # the new save's, merged
    _load_everywhere(url, {**CASE, "seed": 12})


def test_saving_again_without_overwrite_is_refused_on_every_rank_and_with_it_replaces(tmp_path):
    url = str(tmp_path / "ckpt")
    outcomes = spawn(4, fragment_ranks.save_twice, url, CASE)
    assert all(o[0].startswith("CheckpointExistsError") for o in outcomes), outcomes
    before = _files(url)
    spawn(4, fragment_ranks.save, url, {**CASE, "overwrite": True, "seed": 12})
    after = _files(url)  # merged again by its rank 0
    assert [f for f in after if f.startswith("ckptio.")] == [METADATA_NAME] + [fragment_name(r, 4) for r in range(4)]
    assert not {f for f in before if parse_data_file_name(f)} & set(after)  # the old data files went
    _load_everywhere(url, {**CASE, "seed": 12})
    with pytest.raises(ckptio.CheckpointExistsError):  # the merged checkpoint is committed there
        ckptio.save({"x": torch.ones(3)}, url)
    # a save with a coordinator does not list the location for fragments (no save pays a LIST): its
    # ckptio.json replaces the merged one (whose data files go); the fragments stay, and gc names them
    ckptio.save({"x": torch.ones(3)}, url, ckptio.WriterConfig(overwrite=True))
    loaded = {"x": torch.zeros(3)}
    ckptio.load(loaded, url)
    assert torch.equal(loaded["x"], torch.ones(3))
    assert sorted(find_garbage(open_store(url)).files) == [fragment_name(r, 4) for r in range(4)]


@pytest.mark.parametrize("where", ["local", "s3", "gcs", "azure"])
def test_a_fragment_checkpoint_through_every_reader_and_cli_verb(where, tmp_path, request, capsys):
    if where == "local":
        url, options, cli = str(tmp_path / "ckpt"), None, []
    else:
        base, options = object_store(request, where)
        url, cli = f"{base}/ckpt", cli_storage_options(options)
    case = {**CASE, "save_world": 2, "save_mesh": [1, 2], "key_prefix": "hash", "storage_options": options}
    case["per_rank"] = False  # convert and export take one value per key
    case["save_placements"] = {"model.w": [("R",), ("S", 1)], "model.e": [("R",), ("S", 0)]}
    spawn(2, fragment_ranks.save, url, case)
    store = open_store(url, options)
    assert store.exists(METADATA_NAME)  # merged by rank 0; here as a job that died right after its save
    only_fragments(url, options)
    assert spawn(1, fragment_ranks.load_and_compare, url, {**case, **_one_process()}, "ckptio") == [[]]
    assert cli_main(["verify", "-q", url, *cli]) == 0 and "every checksum matches" in capsys.readouterr().out
    out = cli_main(["inspect", url, *cli]) == 0 and capsys.readouterr().out
    assert "model.e" in out and "without a coordinator (one fragment per rank, merged on load)" in out
    assert cli_main(["convert", url, str(tmp_path / "plain.pt"), *cli]) == 0
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert torch.equal(plain["model.w"], fragment_ranks.full(11)["model.w"])
    assert cli_main(["convert", url, str(tmp_path / "hf"), "--format", "safetensors", "--keys", "model.", *cli]) == 0
    (shard,) = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    assert torch.equal(load_file(str(tmp_path / "hf" / shard))["e"], fragment_ranks.full(11)["model.e"])
    assert cli_main(["gc", url, *cli]) == 0 and "nothing left over" in capsys.readouterr().out

    assert cli_main(["merge", url, *cli]) == 0 and "merged its fragments" in capsys.readouterr().out
    doc = json.loads(store.read(METADATA_NAME))
    assert doc["world_size"] == 2 and doc["files"]["key_prefix"] == "sha256-2"
    assert cli_main(["merge", url, *cli]) == 0 and "already has its ckptio.json" in capsys.readouterr().out
    assert spawn(1, fragment_ranks.load_and_compare, url, {**case, **_one_process()}, "dcp") == [[]]


def _one_process() -> dict:
    world, mesh, placements = LOADS["one process"]
    return {"load_mesh": mesh, "load_placements": placements}


def test_overwriting_a_merged_save_keeps_the_set_loadable_until_the_new_fragments_replace_it(tmp_path):
    """Rank 0 of the next save without a coordinator removes the merged ckptio.json (it would hide the new
    fragments) but not the data files: they are the fragments', which still load until each rank's new
    fragment replaces its own; the files of a checkpoint saved with a coordinator go with its ckptio.json."""
    from ckptio.saving.commit import clear_for_fragments

    url = str(tmp_path / "ckpt")
    ckptio.save({"w": torch.arange(70000.0)}, url, ckptio.WriterConfig(use_collectives=False))
    ckptio.wait_for_uploads()  # rank 0's merge
    before = _files(url)
    assert METADATA_NAME in before and any(parse_data_file_name(f) for f in before)
    clear_for_fragments(open_store(url), overwrite=True)
    assert _files(url) == sorted(set(before) - {METADATA_NAME})
    loaded = {"w": torch.zeros(70000)}
    ckptio.load(loaded, url)  # merged by the load
    assert torch.equal(loaded["w"], torch.arange(70000.0))
    other = str(tmp_path / "coordinated")
    ckptio.save({"w": torch.arange(70000.0)}, other)
    clear_for_fragments(open_store(other), overwrite=True)
    assert _files(other) == []


def test_a_large_set_is_merged_in_a_process_of_its_own_and_a_merge_called_off_commits_nothing(
    tmp_path, monkeypatch, caplog
):
    """Past ``IN_PROCESS_FRAGMENTS`` (here every set) the merge runs in a child process, so that it holds
    no lock of the training's; ``memory://``, which no other process sees, is merged in the thread, and so
    is a set whose process could not run; a merge called off (``settle``: another save or a delete there)
    ends its process and commits nothing."""
    import logging
    import sys

    from ckptio.config import StorageConfig
    from ckptio.format.document import decode_fragment
    from ckptio.saving import merge_once

    monkeypatch.setattr(merge_once, "IN_PROCESS_FRAGMENTS", 0)
    state = {"w": torch.arange(64 * 1024.0), "meta": {"x": 1}}
    caplog.set_level(logging.DEBUG, logger="ckptio.saving.merge_once")
    for url in (str(tmp_path / "ck"), f"memory://{tmp_path.name}/ck"):
        ckptio.save(state, url, ckptio.WriterConfig(use_collectives=False))
        ckptio.wait_for_uploads()
        assert open_store(url).exists(METADATA_NAME), url
        loaded = {"w": torch.zeros(64 * 1024), "meta": {"x": 0}}
        ckptio.load(loaded, url)
        assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"x": 1}
    in_process = [r.getMessage() for r in caplog.records if "in process" in r.getMessage()]
    assert len(in_process) == 1 and str(tmp_path / "ck") in in_process[0], in_process
    url = only_fragments(str(tmp_path / "ck"))
    save_id = decode_fragment(open_store(url).read(fragment_name(0, 1)), url)[1].save_id
    broken = tmp_path / "python"  # an interpreter where no merge runs (a frozen executable, say)
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    with monkeypatch.context() as patched:
        patched.setattr(sys, "executable", str(broken))
        merge_once.merge_when_complete(url, {}, StorageConfig(), save_id, 1)
        merge_once.wait_for_merges()
    assert open_store(url).exists(METADATA_NAME)  # merged in the thread instead
    assert any("exited with status 1; merging here" in r.getMessage() for r in caplog.records)
    open_store(url).remove(METADATA_NAME)
    fsspec.register_implementation("parentonly", _ParentOnly, clobber=True)  # no merge process knows it
    ckptio.save(state, f"parentonly://{tmp_path}/elsewhere", ckptio.WriterConfig(use_collectives=False))
    ckptio.wait_for_uploads()
    assert os.path.exists(tmp_path / "elsewhere" / METADATA_NAME)
    assert any("exited with status 5; merging here" in r.getMessage() for r in caplog.records)
    merge_once.merge_when_complete(url, {}, StorageConfig(), save_id, 1)
    merge_once.settle(url)  # its process is ended before it could import torch, let alone commit
    assert not merge_once._running and not open_store(url).exists(METADATA_NAME)


class _ParentOnly(LocalFileSystem):
    """A local filesystem registered under a protocol of this process alone."""

    protocol = ("parentonly",)

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("parentonly://"))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_process_group_saves_without_collectives_to_its_own_checkpoint(tmp_path, asynchronous):
    """Two groups of a 2x2 mesh save apart, each over its own group: a fragment per group rank, merged by
    the group's rank 0; a chunk replicated beyond the group (all four ranks) is written by one of the
    group's ranks; each checkpoint loads exact in one process."""
    root = str(tmp_path)
    listed = spawn(4, fragment_ranks.save_in_groups, root, asynchronous)
    for g, names in enumerate([listed[0], listed[2]]):
        assert [n for n in names if n.startswith("ckptio.")] == [
            METADATA_NAME,
            fragment_name(0, 2),
            fragment_name(1, 2),
        ], names
        loaded = {
            "model.w": torch.zeros(fragment_ranks.SHAPES["model.w"][0]),
            "model.e": torch.zeros(fragment_ranks.SHAPES["model.e"][0], dtype=torch.bfloat16),
            "step": torch.tensor(-1.0),
            **{f"loader.rank{r}": {"position": -1} for r in (2 * g, 2 * g + 1)},
        }
        ckptio.load(loaded, f"{root}/group-{g}")
        assert torch.equal(loaded["model.w"], fragment_ranks.full(g)["model.w"])
        assert torch.equal(loaded["model.e"], fragment_ranks.full(0)["model.e"]) and loaded["step"] == g
        assert [loaded[f"loader.rank{r}"]["position"] for r in (2 * g, 2 * g + 1)] == [100 + 2 * g, 101 + 2 * g]


def test_a_merge_process_commits_on_s3(s3, monkeypatch, caplog):
    """The merge process reaches the object store with the saving process's storage options (pickled to
    it), and commits there create-only."""
    import logging

    from ckptio.saving import merge_once

    monkeypatch.setattr(merge_once, "IN_PROCESS_FRAGMENTS", 0)
    caplog.set_level(logging.DEBUG, logger="ckptio.saving.merge_once")
    base_url, options = s3
    url = f"{base_url}/ck"
    state = {"w": torch.arange(64 * 1024.0), "meta": {"x": 1}}
    ckptio.save(state, url, ckptio.WriterConfig(use_collectives=False), storage_options=options)
    ckptio.wait_for_uploads()
    messages = [r.getMessage() for r in caplog.records]
    assert any("in process" in m for m in messages) and not any("merging here" in m for m in messages), messages
    assert open_store(url, options).exists(METADATA_NAME)
    loaded = {"w": torch.zeros(64 * 1024), "meta": {"x": 0}}
    ckptio.load(loaded, url, storage_options=options)
    assert torch.equal(loaded["w"], state["w"]) and loaded["meta"] == {"x": 1}
