"""ckptio.integrations.torchtitan against the real torchtitan package: a small training loop with
torchtitan's own optimizer, LR scheduler and data loader containers, on spawned CPU ranks."""

from __future__ import annotations

import dataclasses
import os

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'ckptio[torchtitan]')")

import torch  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: E402
from torchtitan.components.checkpointer import BaseCheckpointManager  # noqa: E402

import ckptio  # noqa: E402
from ckptio.integrations.torchtitan import CheckpointManager  # noqa: E402
from ckptio.tools import cli  # noqa: E402
from tests.helpers import titan  # noqa: E402
from tests.helpers.fragment_ranks import only_fragments
from tests.helpers.harness import spawn
from tests.helpers.models import differences  # noqa: E402
from tests.helpers.tiered import as_if_cut_off  # noqa: E402


def committed(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if os.path.exists(os.path.join(folder, n, "ckptio.json")))


def data_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".ckio"))


def torch_dcp_full(path: str) -> dict:
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def test_config_parses_from_the_command_line_and_rejects_bad_options():
    import tyro
    from torchtitan.config.manager import custom_registry

    @dataclasses.dataclass(kw_only=True)
    class Job:  # the shape of torchtitan's Trainer.Config, whose registry needs a GPU stack to import
        checkpoint: BaseCheckpointManager.Config = dataclasses.field(default_factory=BaseCheckpointManager.Config)

    job = Job(checkpoint=CheckpointManager.Config(enable=True, save_mode="replica_group"))
    args = ["--checkpoint.compression", "zstd", "--checkpoint.dataloader-on-resize", "skip"]
    parsed = tyro.cli(Job, args=args, default=job, registry=custom_registry).checkpoint
    assert isinstance(parsed, CheckpointManager.Config)
    assert (parsed.save_mode, parsed.compression, parsed.dataloader_on_resize) == ("replica_group", "zstd", "skip")
    assert parsed.writer_config() == ckptio.WriterConfig(mode="replica_group", compression="zstd", overwrite=True)
    with pytest.raises(ValueError, match="unknown ckptio config key"):
        CheckpointManager.Config(enable=True, writer_options={"part_sise": 1})
    with pytest.raises(ValueError, match="not in writer_options"):
        CheckpointManager.Config(enable=True, writer_options={"mode": "all_ranks"})


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torchtitan's async_with_pinned_mem stages with non-blocking copies, which DefaultStager allows only "
    "with an accelerator: needs a GPU",
)
def test_async_with_pinned_memory(tmp_path):
    folder = str(tmp_path / "checkpoint")
    options = {"async_mode": "async_with_pinned_mem"}
    first = spawn(2, titan.train_with, folder, "fsdp:2", 4, options)
    resumed = spawn(2, titan.resume_or_error, folder, "fsdp:2")
    assert resumed[0]["resumed"] == 4 and differences(first[0]["snapshots"][4], resumed[0]["loaded"]) == []


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A 2-rank FSDP2 run to step 6; step 6's save is then cut short (its commit marker removed)."""
    folder = str(tmp_path_factory.mktemp("titan") / "checkpoint")
    runs = spawn(2, titan.train_run, folder, "fsdp:2", 6)
    os.remove(os.path.join(folder, "step-6", "ckptio.json"))
    return folder, runs


def test_resume_continues_the_run_exactly(two_rank_run):
    folder, first = two_rank_run
    assert committed(folder) == ["step-2", "step-4"]
    again = spawn(2, titan.train_run, folder, "fsdp:2", 6)
    for rank in range(2):
        assert again[rank]["resumed"] == 4  # the unfinished step-6 is skipped
        assert again[rank]["batches"] == {s: first[rank]["batches"][s] for s in (5, 6)}
    assert differences(first[0]["snapshots"][4], again[0]["loaded"]) == []
    assert differences(first[0]["snapshots"][6], again[0]["snapshots"][6]) == []


@pytest.mark.parametrize("ranks,layout", [(4, "fsdp:4"), (1, "single")])
def test_resume_on_another_data_parallel_size(two_rank_run, ranks, layout):
    folder, first = two_rank_run
    calls = [
        (titan.resume_or_error, (folder, layout), {"load_step": 4}),
        (titan.resume_or_error, (folder, layout), {"load_step": 4, "dataloader_on_resize": "skip"}),
    ]
    for rank, (error, skipped) in enumerate(spawn(ranks, titan.each, *calls)):
        assert error["error"].startswith("PerRankStateError: ")
        assert f"step-4 was saved by 2 data-parallel ranks, but this job has {ranks}" in error["error"]
        assert "dataloader_on_resize='skip'" in error["error"]
        assert skipped["resumed"] == 4 and skipped["next_batch"] == rank  # the data loader starts afresh
        if rank == 0:
            assert differences(first[0]["snapshots"][4], skipped["loaded"]) == []


def test_saves_without_a_coordinator_resume_exactly_and_a_cut_off_one_is_passed_over(tmp_path):
    """writer_options.use_collectives=False: every step is a set of fragments; a step missing one rank's
    fragment is incomplete, and the resume takes the step before it."""
    folder = str(tmp_path / "checkpoint")
    options = {"writer_options": {"use_collectives": False}}
    first = spawn(2, titan.train_with, folder, "fsdp:2", 6, options)
    # rank 0 merged each step's fragments into its ckptio.json once both were there (the last step's
    # merge may not have ended before the spawned rank left without running atexit)
    assert committed(folder)[:2] == ["step-2", "step-4"]
    assert sorted(n for n in os.listdir(os.path.join(folder, "step-4")) if n.startswith("ckptio.")) == [
        "ckptio.json",
        "ckptio.rank-00000-of-00002.json",
        "ckptio.rank-00001-of-00002.json",
    ]
    os.remove(os.path.join(folder, "step-6", "ckptio.rank-00001-of-00002.json"))  # cut off: never merged
    only_fragments(os.path.join(folder, "step-6"))
    again = spawn(2, titan.train_with, folder, "fsdp:2", 6, options)
    for rank in range(2):
        assert again[rank]["resumed"] == 4
    assert differences(first[0]["snapshots"][4], again[0]["loaded"]) == []
    assert differences(first[0]["snapshots"][6], again[0]["snapshots"][6]) == []


def test_compiled_model_resumes_twice(tmp_path):
    folder = str(tmp_path / "checkpoint")
    calls = [
        (titan.train_run, (folder, "single", 2), {"compile": True}),
        (titan.train_run, (folder, "single", 4), {"compile": True}),
        (titan.resume_or_error, (folder, "single"), {"compile": True}),
        (titan.resume_or_error, (folder, "single"), {}),
    ]
    ((first, second, compiled, plain),) = spawn(1, titan.each, *calls)
    assert second["resumed"] == 2 and differences(first["snapshots"][2], second["loaded"]) == []
    for third in (compiled, plain):
        assert third["resumed"] == 4 and differences(second["snapshots"][4], third["loaded"]) == []
    for step in ("step-2", "step-4"):
        with open(os.path.join(folder, step, "ckptio.json")) as f:
            assert "_orig_mod" not in f.read()


@pytest.mark.slow
def test_fsdp_tp_and_hsdp_with_each_save_mode(tmp_path):
    folders = {name: str(tmp_path / name) for name in ("dp_tp", "hsdp_replica_group", "hsdp_all_ranks")}
    (saved, *_) = spawn(
        4,
        titan.each,
        (titan.train_run, (folders["dp_tp"], "dp_tp:2x2", 4), {}),
        (titan.train_run, (folders["hsdp_replica_group"], "hsdp:2x2", 4), {"save_mode": "replica_group"}),
        (titan.train_run, (folders["hsdp_all_ranks"], "hsdp:2x2", 4), {"compression": "zstd"}),
    )
    assert len(data_files(os.path.join(folders["hsdp_replica_group"], "step-4"))) == 2  # one replica group wrote
    assert len(data_files(os.path.join(folders["hsdp_all_ranks"], "step-4"))) == 4
    resumed = spawn(
        4,
        titan.each,
        (titan.resume_or_error, (folders["dp_tp"], "dp_tp:2x2"), {}),
        (titan.resume_or_error, (folders["hsdp_replica_group"], "fsdp:4"), {}),
        (titan.resume_or_error, (folders["hsdp_all_ranks"], "fsdp:4"), {}),
    )
    for rank, (dp_tp, replica_group, all_ranks) in enumerate(resumed):
        assert dp_tp["next_batch"] == 8 * 2 + rank // 2  # sample 8 of this dp rank: step 5's batch
        assert replica_group["next_batch"] == all_ranks["next_batch"] == 8 * 4 + rank
        if rank == 0:
            for run, got in zip(saved, (dp_tp, replica_group, all_ranks), strict=True):
                assert got["resumed"] == 4 and differences(run["snapshots"][4], got["loaded"]) == []


@pytest.mark.slow
def test_async_saves_and_keep_latest_k_delete_whole_checkpoints(tmp_path):
    folder = str(tmp_path / "checkpoint")
    options = {"async_mode": "async", "keep_latest_k": 2}
    first = spawn(2, titan.train_with, folder, "fsdp:2", 6, options)
    assert sorted(os.listdir(folder)) == ["step-4", "step-6"] == committed(folder)
    resumed = spawn(2, titan.resume_or_error, folder, "fsdp:2")
    assert resumed[0]["resumed"] == 6 and differences(first[0]["snapshots"][6], resumed[0]["loaded"]) == []


def test_incremental_saves_with_keep_latest_k_keep_what_the_kept_steps_reference(tmp_path):
    """writer_options.incremental_from='previous' with a frozen block: every step after the first references
    the frozen block's bytes in step-2; keep_latest_k deletes step-2 but keeps those files until no kept step
    references them; the resume is exact."""
    folder = str(tmp_path / "checkpoint")
    options = {"keep_latest_k": 2, "frozen": "blocks.0.", "writer_options": {"incremental_from": "previous"}}
    first = spawn(2, titan.train_with, folder, "fsdp:2", 6, options)
    assert committed(folder) == ["step-4", "step-6"]
    kept = sorted(os.listdir(os.path.join(folder, "step-2")))  # deleted, its referenced files kept
    assert "ckptio.json" not in kept and any(n.endswith(".ckio") for n in kept), kept
    assert "ckptio.referenced-by-step-6.json" in kept, kept
    ((resumed,), _) = spawn(2, titan.each, (titan.resume_or_error, (folder, "fsdp:2"), {"frozen": "blocks.0."}))
    assert resumed["resumed"] == 6 and differences(first[0]["snapshots"][6], resumed["loaded"]) == []


def test_tiered_checkpoints_resume_from_the_node_and_on_a_replaced_node(tmp_path):
    """writer_options.local_tier: saves land on the node and drain to the folder; a resume whose newest
    step never committed on the folder loads it from the node (and commits it), a replaced node's from
    the folder."""
    folder, node, new_node = (str(tmp_path / name) for name in ("checkpoint", "node", "new-node"))
    first = spawn(2, titan.train_with, folder, "fsdp:2", 6, {"writer_options": {"local_tier": node}})
    assert committed(folder) == ["step-2", "step-4", "step-6"]  # drained before the processes ended
    as_if_cut_off(os.path.join(folder, "step-6"), node)
    calls = [
        (titan.resume_or_error, (folder, "fsdp:2"), {"writer_options": {"local_tier": node}}),
        (ckptio.wait_for_uploads, (), {}),
        (titan.resume_or_error, (folder, "fsdp:2"), {"writer_options": {"local_tier": new_node}}),
    ]
    from_node, _, from_folder = spawn(2, titan.each, *calls)[0]
    assert from_node["resumed"] == 6 and differences(first[0]["snapshots"][6], from_node["loaded"]) == []
    assert from_folder["resumed"] == 6 and differences(first[0]["snapshots"][6], from_folder["loaded"]) == []
    assert "step-6" in committed(folder)


def test_a_resume_from_s3_lists_the_run_folder_on_one_rank_only(s3, moto_server):
    base, options = s3
    folder, env = f"{base}/titan", {"AWS_ENDPOINT_URL": moto_server}
    first = spawn(2, titan.train_with, folder, "fsdp:2", 4, {"storage_options": options}, env=env)
    resumed = spawn(2, titan.resume_counting_listings, folder, "fsdp:2", options, env=env)
    assert [r["resumed"] for r in resumed] == [4, 4]
    assert differences(first[0]["snapshots"][4], resumed[0]["loaded"]) == []
    # rank 0 listed the run's steps and told rank 1; what both sent besides is torchtitan's own
    # exists(folder) and isdir(step) in its _load, one request each per rank
    assert resumed[1]["listings"] == resumed[0]["listings"] - 1 == 2


def test_switch_from_torch_dcp_checkpoints(tmp_path):
    folder = str(tmp_path / "checkpoint")
    torch_run = spawn(2, titan.train_with, folder, "fsdp:2", 4, {"manager": "torch"})
    assert os.path.exists(os.path.join(folder, "step-4", ".metadata")) and committed(folder) == []
    converted = str(tmp_path / "converted")
    assert cli.main(["convert", os.path.join(folder, "step-2"), converted, "--format", "ckptio"]) == 0
    assert differences(torch_dcp_full(os.path.join(folder, "step-2")), ckptio.tools.convert.load_full(converted)) == []
    switched = spawn(2, titan.train_with, folder, "fsdp:2", 6, {"keep_latest_k": 2})
    assert switched[0]["resumed"] == 4 and differences(torch_run[0]["snapshots"][4], switched[0]["loaded"]) == []
    assert switched[1]["batches"] == {5: 17.0, 6: 21.0}  # the data position came back too
    assert sorted(os.listdir(folder)) == ["step-4", "step-6"]  # the torch step-2 was purged whole
    os.makedirs(os.path.join(folder, "step-8"))
    with open(os.path.join(folder, "step-8", "data-0123456789abcdef-r00000.ckio"), "wb") as f:
        f.write(b"an unfinished save")
    os.makedirs(os.path.join(folder, "step-10"))
    latest, unfinished = spawn(
        2,
        titan.each,
        (titan.resume_or_error, (folder, "fsdp:2"), {}),
        (titan.resume_or_error, (folder, "fsdp:2"), {"load_step": 8}),
    )[0]
    assert latest["resumed"] == 6 and differences(switched[0]["snapshots"][6], latest["loaded"]) == []
    assert unfinished["error"].startswith("CheckpointNotFoundError: ")
    assert "step-8 holds no committed checkpoint" in unfinished["error"]


def test_initial_load_of_hugging_face_weights_from_s3(s3, moto_server, tmp_path):
    from tests.helpers import hf
    from tests.helpers.models import build_model

    base, options = s3
    weights = {f"model.{k}": v.detach().clone() for k, v in build_model("single", seed=3).state_dict().items()}
    hf.write_reference(f"{base}/hf-weights", weights, shards=2, storage_options=options)
    env = {"AWS_ENDPOINT_URL": moto_server}  # torchtitan checks the folder with fsspec's defaults
    loaded = spawn(2, titan.initial_hf_load, str(tmp_path / "run"), "fsdp:2", f"{base}/hf-weights", options, env=env)
    model = loaded[0]["model"]
    assert set(model) == {k.removeprefix("model.") for k in weights}
    for key, value in weights.items():
        assert torch.equal(model[key.removeprefix("model.")], value), key
    assert not os.path.exists(tmp_path / "run")  # nothing saved: a load only
