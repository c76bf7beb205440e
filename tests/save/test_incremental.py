"""Incremental saves (``WriterConfig.incremental_from``): a save stores only the items whose bytes its base
does not already hold, references the rest, and loads like any checkpoint (every link of a chain, on the
save mesh and resharded, through dcp.load and ckptio.load, local and S3, raw and zstd); deletes keep what a
newer checkpoint references; a missing or damaged referenced file is a named error; chains are bounded."""

from __future__ import annotations

import json
import os
import threading

import hypothesis
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.errors import CheckpointError, CorruptCheckpointError, MixedFragmentsError
from ckptio.format.columns import decode_array, encode_packed_array
from ckptio.format.decode import decode_files
from ckptio.format.names import METADATA_NAME, fragment_name, reference_marker_name
from ckptio.format.records import Extent
from ckptio.saving.incremental import READ_OVERHEAD, referenced_blocks
from ckptio.storage import open_store
from ckptio.tools.cleanup import collect_garbage, delete_checkpoint, find_garbage
from ckptio.tools.cli import main as cli_main
from ckptio.tools.inspection import describe
from tests.conftest import STORES_SLOW_BEYOND_MOTO, store_objects
from tests.helpers import incremental_ranks
from tests.helpers.documents import load_error
from tests.helpers.fragment_ranks import only_fragments
from tests.helpers.harness import spawn

HSDP = {"model.base": [("R",), ("S", 0)], "model.lora_a": [("S", 1), ("R",)], "emb": [("R",), ("S", 0)]}
CASE = {"save_mesh": [2, 2], "save_placements": HSDP}
ONE = {"model.base": [("R",)], "model.lora_a": [("R",)], "emb": [("R",)]}


def _own_and_referenced(url: str, options: dict | None = None) -> tuple[list[str], list[str]]:
    doc = json.loads(open_store(url, options).read(METADATA_NAME))
    bases = [b["name"] for b in doc["files"].get("bases", [])]
    return bases, doc.get("chain")


def test_a_chain_saved_on_2x2_loads_every_link_on_2x2_1x4_and_one_process(tmp_path):
    run = str(tmp_path / "run")
    listed = spawn(4, incremental_ranks.save_chain, run, CASE, [1, 2, 3])[0]
    full_bytes = sum(os.path.getsize(f"{run}/step-1/{n}") for n in listed[0] if n.startswith("data-"))
    # references name the folder that wrote the bytes: step-3 those of step-1 and the embedding blocks
    # step-2 changed but step-3 did not
    for step, expected in ((2, ["step-1"]), (3, ["step-1", "step-2"])):
        bases, chain = _own_and_referenced(f"{run}/step-{step}")
        assert bases == expected and chain["depth"] == step - 1
        own = sum(os.path.getsize(f"{run}/step-{step}/{n}") for n in listed[step - 1] if n.startswith("data-"))
        # the frozen base, and of the embedding table all but the blocks of the rows that changed
        assert 0 < own < full_bytes / 4, (own, full_bytes)
    assert sorted(os.listdir(f"{run}/step-1")) == sorted(
        listed[0] + [reference_marker_name("step-2"), reference_marker_name("step-3")]
    )
    loads = {
        "2x2": (4, [2, 2], HSDP, "dcp"),
        "1x4": (4, [1, 4], {**HSDP, "model.base": [("R",), ("S", 1)], "model.lora_a": [("R",), ("S", 0)]}, "ckptio"),
        "one process": (1, [1], ONE, "dcp"),
    }
    for name, (world, mesh, placements, through) in loads.items():
        case = {**CASE, "load_mesh": mesh, "load_placements": placements}
        got = spawn(world, incremental_ranks.load_steps, run, case, [1, 2, 3], through)
        assert got == [{1: [], 2: [], 3: []}] * world, name


@pytest.mark.parametrize("store", STORES_SLOW_BEYOND_MOTO, indirect=True)
@pytest.mark.parametrize("use_collectives", [True, False])
def test_a_chain_on_a_store_loads_resharded_and_keeps_referenced_objects_when_its_base_is_deleted(
    store, use_collectives
):
    """zstd here (the 2x2 chain above is raw): changed blocks of an item in pieces are encoded as its base's.
    Without a coordinator too: each rank's fragment references the base, each rank leaves its marker."""
    compression = "zstd"
    base_url, options = store
    run = f"{base_url}/run"
    case = {
        "save_mesh": [2],
        "save_placements": {"model.base": [("S", 0)], "model.lora_a": [("R",)], "emb": [("S", 0)]},
        "compression": compression,
        "storage_options": options,
        "use_collectives": use_collectives,
        "inline_limit": 64 << 10 if use_collectives else 0,  # a fragment keeps small items inline otherwise
    }
    spawn(2, incremental_ranks.save_chain, run, case, [1, 2])
    assert _own_and_referenced(f"{run}/step-2", options)[0] == ["step-1"]
    delete_checkpoint(open_store(f"{run}/step-1", options))
    left = store_objects(f"{run}/step-1", options)
    assert METADATA_NAME not in left and any(k.endswith(".ckio") for k in left), left
    # two ranks holding replicas: their reads of the referenced objects are shared (dedup_reads="auto" on S3)
    loading = {**case, "load_mesh": [2], "load_placements": ONE}
    assert spawn(2, incremental_ranks.load_steps, run, loading, [2]) == [{2: []}] * 2
    delete_checkpoint(open_store(f"{run}/step-2", options))  # its last referrer: the kept objects go too
    assert store_objects(run, options) == {}


def _save(url: str, values: dict, tuning: dict | None = None, **config) -> None:
    tuning = {"max_block_size": 4096, **(tuning or {})}
    dcp.save(values, storage_writer=ckptio.Writer(url, ckptio.WriterConfig(tuning=tuning, **config)))


def _state(changed: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"frozen": torch.randn(256, 64, generator=g), "adapter": torch.randn(8, 64, generator=g) + changed}


def _load(url: str) -> dict:
    out = {"frozen": torch.zeros(256, 64), "adapter": torch.zeros(8, 64)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    return out


def test_a_referenced_file_damaged_or_deleted_behind_ckptios_back_is_named_by_load_and_verify(tmp_path, capsys):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    _save(str(run / "step-2"), _state(1.0), incremental_from=str(run / "step-1"))
    assert torch.equal(_load(str(run / "step-2"))["frozen"], _state()["frozen"])
    (data,) = [p for p in (run / "step-1").iterdir() if p.suffix == ".ckio"]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    error = load_error(str(run / "step-2"), _state())
    assert isinstance(error, CorruptCheckpointError) and f"step-1/{data.name}" in str(error), error
    assert cli_main(["verify", str(run / "step-2")]) != 0
    assert f"step-1/{data.name}" in capsys.readouterr().err
    data.unlink()
    error = load_error(str(run / "step-2"), _state())
    assert isinstance(error, CorruptCheckpointError) and f"step-1/{data.name}" in str(error), error
    assert "missing" in str(error)


def test_export_convert_and_inspect_read_through_references(tmp_path, capsys):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    _save(str(run / "step-2"), _state(1.0), incremental_from="previous")
    ckptio.export_safetensors(str(run / "step-2"), str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert torch.equal(exported["frozen"], _state()["frozen"])
    assert torch.equal(exported["adapter"], _state(1.0)["adapter"])
    assert cli_main(["convert", str(run / "step-2"), str(tmp_path / "out.pt")]) == 0
    converted = torch.load(tmp_path / "out.pt")
    assert torch.equal(converted["frozen"], _state()["frozen"])
    capsys.readouterr()
    assert cli_main(["inspect", str(run / "step-2"), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["referenced_bytes"] == {"step-1": 256 * 64 * 4} and described["owned_bytes"] == 8 * 64 * 4
    assert described["chain"]["base"] == "step-1"
    assert cli_main(["inspect", str(run / "step-1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["referenced_by"] == ["step-2"]


def test_deletes_overwrites_and_gc_keep_what_a_newer_checkpoint_references(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    _save(str(run / "step-2"), _state(1.0), incremental_from="previous")
    _save(str(run / "step-3"), _state(2.0), incremental_from="previous")
    # replacing step-1 in full keeps its old file, which step-2 and step-3 reference
    old_files = sorted(p.name for p in (run / "step-1").iterdir() if p.suffix == ".ckio")
    _save(str(run / "step-1"), _state(5.0), overwrite=True)
    assert set(old_files) < {p.name for p in (run / "step-1").iterdir()}
    assert torch.equal(_load(str(run / "step-3"))["frozen"], _state()["frozen"])
    # gc of the folder removes nothing a committed referrer uses
    assert find_garbage(open_store(str(run / "step-1"))).files == []
    kept = delete_checkpoint(open_store(str(run / "step-1")))
    assert kept == old_files
    assert torch.equal(_load(str(run / "step-3"))["adapter"], _state(2.0)["adapter"])
    delete_checkpoint(open_store(str(run / "step-2")))
    assert (run / "step-1").exists()  # step-3 still references it
    delete_checkpoint(open_store(str(run / "step-3")))
    assert not (run / "step-1").exists() and not (run / "step-3").exists()


def test_gc_removes_the_markers_of_referrers_that_never_committed(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    _save(str(run / "step-2"), _state(1.0), incremental_from="previous")
    os.remove(run / "step-2" / METADATA_NAME)  # as if step-2's save had died before its commit
    store = open_store(str(run / "step-1"))
    garbage = find_garbage(store)
    assert garbage.files == [reference_marker_name("step-2")]
    assert collect_garbage(store, garbage) == {}
    assert torch.equal(_load(str(run / "step-1"))["frozen"], _state()["frozen"])


def test_chains_are_bounded_by_depth_and_by_the_share_of_referenced_bytes(tmp_path):
    run = tmp_path / "run"
    for step in range(1, 5):
        _save(str(run / f"step-{step}"), _state(step), incremental_from="previous", tuning={"incremental_max_depth": 2})
    chains = [_own_and_referenced(str(run / f"step-{s}"))[1] for s in range(1, 5)]
    assert [c and c["depth"] for c in chains] == [None, 1, 2, None]  # step-4 is full again
    # the frozen tensor is 97% of the bytes (64 KiB of 66 KiB): an adapter-only save references that share
    _save(str(run / "step-5"), _state(5), incremental_from="previous", tuning={"incremental_min_fraction": 0.99})
    _save(str(run / "step-6"), _state(6), incremental_from="previous", tuning={"incremental_min_fraction": 0.99})
    _save(str(run / "step-7"), _state(7), incremental_from="previous", tuning={"incremental_min_fraction": 0.95})
    assert _own_and_referenced(str(run / "step-5"))[1]["depth"] == 1
    assert _own_and_referenced(str(run / "step-6"))[1] is None  # step-5 referenced < 99%: full
    assert _own_and_referenced(str(run / "step-7"))[1]["depth"] == 1


def test_a_base_that_cannot_be_referenced_is_a_named_error_or_with_previous_a_full_save(tmp_path, caplog):
    run = tmp_path / "run"
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(run / "torch")))
    _save(str(run / "plain"), _state())  # ckptio without incremental_from: no digests
    for base, why in [
        (run / "torch", "cannot be read"),
        (run / "plain", "without block digests"),
        (tmp_path / "elsewhere" / "step-1", "not a checkpoint in the same folder"),
        (run / "missing", "nothing is committed there"),
    ]:
        with pytest.raises(CheckpointException) as info:
            _save(str(run / "step-2"), _state(1.0), incremental_from=str(base))
        error = ckptio.unwrap(info.value)
        assert isinstance(error, CheckpointError) and why in str(error), error
        assert not (run / "step-2" / METADATA_NAME).exists()
    _save(str(run / "step-3"), _state(1.0), incremental_from="previous")  # previous: 'plain', no digests
    assert _own_and_referenced(str(run / "step-3")) == ([], None)
    assert "saving" in caplog.text and "in full" in caplog.text


def test_two_jobs_saving_against_one_base_at_once_both_load_and_both_keep_it(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    errors: list[BaseException] = []

    def save(name: str, changed: float) -> None:
        try:
            _save(str(run / name), _state(changed), incremental_from=str(run / "step-1"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(f"job-{i}", float(i))) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    delete_checkpoint(open_store(str(run / "step-1")))
    for i in (1, 2):
        assert torch.equal(_load(str(run / f"job-{i}"))["adapter"], _state(float(i))["adapter"])


def test_everything_changed_writes_no_references(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    changed = {k: v + 1 for k, v in _state().items()}
    _save(str(run / "step-2"), changed, incremental_from="previous")
    assert _own_and_referenced(str(run / "step-2")) == ([], None)
    assert json.loads((run / "step-2" / METADATA_NAME).read_text())["features"] == ["incremental"]  # digests kept


def test_a_chain_saved_without_a_coordinator_references_its_base_and_loads_everywhere(tmp_path):
    """Each rank resolves the base alone, references it in its own fragment and leaves its own marker;
    the merge joins the ranks' parts into one chain. Loads exact after the merge, from the fragments alone
    (a job that died before its merge), resharded, and after the base was deleted; the base's files go
    with the last checkpoint that references them."""
    run = str(tmp_path / "run")
    case = {**CASE, "save_mesh": [2], "use_collectives": False, "inline_limit": 0}  # small items in files
    case["save_placements"] = {"model.base": [("S", 0)], "model.lora_a": [("R",)], "emb": [("S", 0)]}
    listed = spawn(2, incremental_ranks.save_chain, run, case, [1, 2, 3])[0]
    assert METADATA_NAME in listed[0] and any(n.startswith("ckptio.rank-") for n in listed[0])  # merged once
    for step, expected in ((2, ["step-1"]), (3, ["step-1", "step-2"])):
        bases, chain = _own_and_referenced(f"{run}/step-{step}")
        assert sorted(bases) == expected and chain["base"] == f"step-{step - 1}" and chain["depth"] == step - 1
        assert 0 < chain["referenced_bytes"] < chain["stored_bytes"], chain
    markers = sorted(n for n in os.listdir(f"{run}/step-1") if n.startswith("ckptio.referenced-by-"))
    assert markers == [reference_marker_name(f"step-{s}", r) for s in (2, 3) for r in (0, 1)], markers
    assert describe(f"{run}/step-1")["referenced_by"] == ["step-2", "step-3"]  # each referrer once
    loads = {"2 ranks": (2, [2], case["save_placements"]), "one process": (1, [1], ONE)}
    for name, (world, mesh, placements) in loads.items():
        loading = {**case, "load_mesh": mesh, "load_placements": placements}
        got = spawn(world, incremental_ranks.load_steps, run, loading, [1, 2, 3])
        assert got == [{1: [], 2: [], 3: []}] * world, name
    only_fragments(f"{run}/step-3")
    delete_checkpoint(open_store(f"{run}/step-1"))
    loading = {**case, "load_mesh": [1], "load_placements": ONE}
    assert spawn(1, incremental_ranks.load_steps, run, loading, [2, 3]) == [{2: [], 3: []}]
    assert not os.path.exists(f"{run}/step-1/{METADATA_NAME}") and os.listdir(f"{run}/step-1")
    delete_checkpoint(open_store(f"{run}/step-2"))
    delete_checkpoint(open_store(f"{run}/step-3"))
    assert not os.path.exists(f"{run}/step-1") or not os.listdir(f"{run}/step-1")


@pytest.mark.parametrize("gap", [0, 1 << 20])
def test_an_item_in_pieces_loads_and_a_truncated_piece_is_named(tmp_path, gap):
    """Single rows changed through a table: its changed blocks written, the others referenced (runs of
    two files, read together across the gaps when the read gap allows); a base file cut short is named."""
    run = tmp_path / "run"
    table = torch.randn(512, 64, generator=torch.Generator().manual_seed(4))
    cheap_requests = {
        "incremental_from": "previous",
        "tuning": {"max_block_size": 1024},
        "storage_config": {"read_gap_bytes": 0},
    }
    _save(str(run / "step-1"), {"table": table}, **cheap_requests)
    table[[5, 200, 300]] += 1  # three of 128 blocks
    _save(str(run / "step-2"), {"table": table}, **cheap_requests)
    own = [p for p in (run / "step-2").iterdir() if p.suffix == ".ckio"]
    assert sum(p.stat().st_size for p in own) == 3 * 1024
    reader = ckptio.Reader(str(run / "step-2"), storage_config=ckptio.StorageConfig(read_gap_bytes=gap))
    out = {"table": torch.zeros(512, 64)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["table"], table)
    (base_file,) = [p for p in (run / "step-1").iterdir() if p.suffix == ".ckio"]
    with open(base_file, "r+b") as f:
        f.truncate(100 * 1024)
    error = load_error(str(run / "step-2"), {"table": torch.zeros(512, 64)})
    assert isinstance(error, CorruptCheckpointError) and base_file.name in str(error), error


def test_replacing_an_incremental_checkpoint_in_full_releases_what_it_referenced(tmp_path):
    run = tmp_path / "run"
    _save(str(run / "step-1"), _state(), incremental_from="previous")
    _save(str(run / "step-2"), _state(1.0), incremental_from="previous")
    assert (run / "step-1" / reference_marker_name("step-2")).exists()
    delete_checkpoint(open_store(str(run / "step-1")))  # kept for step-2
    _save(str(run / "step-2"), _state(2.0), overwrite=True)  # now in full: step-1's kept files go
    assert not (run / "step-1").exists()
    assert torch.equal(_load(str(run / "step-2"))["frozen"], _state()["frozen"])


def test_a_listing_that_fails_during_a_delete_keeps_every_referenced_file(s3_proxy):
    """Which files a delete may remove is decided from a listing of the folder's markers: a listing
    that fails (403 here, not retried) raises; it is never taken for a folder without markers."""
    from tests.helpers.faultproxy import Fault

    proxy, base_url, options = s3_proxy
    run = f"{base_url}/run"
    for step, changed in ((1, 0.0), (2, 1.0)):
        config = ckptio.WriterConfig(tuning=ckptio.Tuning(max_block_size=4096), incremental_from="previous")
        dcp.save(_state(changed), storage_writer=ckptio.Writer(f"{run}/step-{step}", config, storage_options=options))
    # the listing of every file below the folder (no delimiter): where its markers and data files are found
    every_file = Fault(lambda r: r.operation == "LIST" and r.query.get("delimiter", [""]) == [""], 403, times=1)
    proxy.faults.append(every_file)
    with pytest.raises(ckptio.StorageError, match="cannot list"):
        delete_checkpoint(open_store(f"{run}/step-1", options))
    assert every_file.hits == 1
    out = {"frozen": torch.zeros(256, 64), "adapter": torch.zeros(8, 64)}
    dcp.load(out, storage_reader=ckptio.Reader(f"{run}/step-2", storage_options=options))
    assert torch.equal(out["frozen"], _state()["frozen"])


def test_an_item_keeps_only_the_references_its_load_can_afford(tmp_path):
    """Local files at the default request cost (256 KiB): an 8 MiB table in 64 blocks may cost its load
    one request more (5% of its bytes), so of two unchanged runs the longer is referenced and the shorter
    written again; a row changed in every other block leaves runs too short to reference: written whole."""
    run = tmp_path / "run"
    table = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(5))  # 8 MiB, 32 rows a block
    steps = [table, table.clone(), table.clone()]
    steps[1][20 * 32 + 3] += 1  # block 20: runs 0-19 and 21-63
    steps[2][::64] += 1  # blocks 0, 2, 4, ...
    for step, values in enumerate(steps, 1):
        _save(
            str(run / f"step-{step}"),
            {"table": values},
            incremental_from="previous",
            tuning={"max_block_size": 1 << 18},
        )

    def own_bytes(step: int) -> int:
        return sum(p.stat().st_size for p in (run / f"step-{step}").iterdir() if p.suffix == ".ckio")

    assert own_bytes(2) == 21 << 17  # blocks 0-20
    assert own_bytes(3) == 64 << 17 and _own_and_referenced(str(run / "step-3"))[0] == []
    for step in (2, 3):
        out = {"table": torch.zeros(2048, 1024)}
        dcp.load(out, storage_reader=ckptio.Reader(str(run / f"step-{step}")))
        assert torch.equal(out["table"], steps[step - 1])


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    hypothesis.strategies.lists(
        hypothesis.strategies.tuples(hypothesis.strategies.booleans(), hypothesis.strategies.integers(1, 4)),
        max_size=40,
    ),
    hypothesis.strategies.sampled_from([0, 1, 100, 1000, 10**9]),
)
def test_references_kept_are_the_longest_runs_the_read_overhead_allows(blocks, cost):
    """Over any layout of unchanged blocks in up to four files: only unchanged blocks are referenced, in
    whole runs at least as long as a request costs, longest first, and the load's extra requests stay in
    the budget (the base's own layout of a wholly unchanged item excepted: it costs no more than the base)."""
    places, at = [], {}
    for k, (_, file) in enumerate(blocks):
        length = 100 + 37 * (k % 5)
        places.append(Extent(f"f{file}", at.get(file, 0), length))
        at[file] = at.get(file, 0) + length
    unchanged = [same for same, _ in blocks]
    kept = referenced_blocks(unchanged, places, cost)
    assert all(u or not k for u, k in zip(unchanged, kept, strict=True))
    runs = _runs(unchanged, places)
    kept_runs = [run for run in runs if kept[run[0]]]
    assert all(all(kept[k] for k in run) for run in kept_runs)  # a run is referenced whole or not at all
    stored = sum(p.length for p in places)
    if not (kept == unchanged and all(unchanged)):
        assert cost == 0 or len(kept_runs) * cost <= READ_OVERHEAD * stored
        assert all(sum(places[k].length for k in run) >= cost for run in kept_runs)
        length = {id(run): sum(places[k].length for k in run) for run in runs}
        dropped = [run for run in runs if not kept[run[0]]]
        if kept_runs and dropped:
            assert min(length[id(r)] for r in kept_runs) >= max(length[id(r)] for r in dropped)
    if cost == 0:
        assert kept == unchanged


def _runs(unchanged: list[bool], places: list) -> list[list[int]]:
    runs: list[list[int]] = []
    for k, same in enumerate(unchanged):
        joined = runs and runs[-1][-1] == k - 1 and places[k].file == places[k - 1].file
        if same and joined and places[k].offset == places[k - 1].offset + places[k - 1].length:
            runs[-1].append(k)
        elif same:
            runs.append([k])
    return runs


def test_a_block_that_changed_in_a_row_of_changes_is_referenced_again_once_saved_unchanged(tmp_path):
    """Raw blocks whose CRC32C differs from the base's are hashed only at the start of a row of changes
    (a training step's saves cost no digest for most blocks): a tensor that changed everywhere and then
    stops changing is written once more (its blocks past the row's start had no digest), then referenced."""
    from ckptio.format.codec import HASHED_CHANGED_IN_ROW

    run = tmp_path / "run"
    frozen = torch.randn(256, 1024, generator=torch.Generator().manual_seed(6))  # 1 MiB: keeps the chain going
    moving = torch.randn(64, 1024, generator=torch.Generator().manual_seed(7))  # 64 blocks of 4 KiB
    config = {"incremental_from": "previous", "storage_config": {"read_gap_bytes": 0}}
    steps = [moving, moving + 1, moving + 1, moving + 1]
    for step, values in enumerate(steps, 1):
        _save(str(run / f"step-{step}"), {"frozen": frozen, "moving": values}, **config)

    def own_bytes(step: int) -> int:
        return sum(p.stat().st_size for p in (run / f"step-{step}").iterdir() if p.suffix == ".ckio")

    assert own_bytes(2) == 64 * 4096  # changed everywhere
    assert own_bytes(3) == (64 - HASHED_CHANGED_IN_ROW) * 4096  # unchanged, but only the row's start was hashed
    assert own_bytes(4) == 0  # every block hashed unchanged at step 3
    for step, values in enumerate(steps, 1):
        out = {"frozen": torch.zeros(256, 1024), "moving": torch.zeros(64, 1024)}
        dcp.load(out, storage_reader=ckptio.Reader(str(run / f"step-{step}")))
        assert torch.equal(out["frozen"], frozen) and torch.equal(out["moving"], values)


def test_fragments_referencing_one_base_file_merge_it_once_and_a_forged_size_or_base_is_caught(tmp_path):
    """A base written by rank 0 alone (replica_group, everything replicated), then a save without a
    coordinator whose two ranks each write part of the replicated items: both fragments reference the
    base's one file, which the merged document names once. A fragment that records another size for it
    is refused; one whose chain names another base merges into the chain of an "unknown" base."""
    run = str(tmp_path / "run")
    replicated = {"model.base": [("R",)], "model.lora_a": [("R",)], "emb": [("R",)]}
    case = {"save_mesh": [2], "save_placements": replicated, "inline_limit": 0, "use_collectives": False}
    case["steps"] = {1: {"mode": "replica_group", "use_collectives": True}}
    spawn(2, incremental_ranks.save_chain, run, case, [1, 2])
    step_2 = f"{run}/step-2"
    fragments = [json.loads(open_store(step_2).read(fragment_name(r, 2))) for r in (0, 1)]
    shared = set.intersection(*(set(_file_names(doc)) for doc in fragments))
    assert len(shared) == 1 and next(iter(shared)).startswith("../step-1/"), shared
    assert _file_names(json.loads(open_store(step_2).read(METADATA_NAME))).count(next(iter(shared))) == 1
    loading = {**case, "load_mesh": [1], "load_placements": ONE}
    assert spawn(1, incremental_ranks.load_steps, run, loading, [2]) == [{2: []}]
    only_fragments(step_2)
    original = open_store(step_2).read(fragment_name(1, 2))
    forged = json.loads(original)
    forged["chain"]["base"] = "step-0"
    open_store(step_2).put_atomic(fragment_name(1, 2), json.dumps(forged).encode())
    reader = ckptio.Reader(step_2)
    reader.read_metadata()
    assert reader.manifest.header.chain.base == "unknown"
    assert spawn(1, incremental_ranks.load_steps, run, loading, [2]) == [{2: []}]
    sizes = decode_array(forged["files"]["sizes"], len(_file_names(forged)), "sizes")
    sizes[_file_names(forged).index(next(iter(shared)))] += 1
    forged["files"]["sizes"] = encode_packed_array(sizes)
    open_store(step_2).put_atomic(fragment_name(1, 2), json.dumps(forged).encode())
    with pytest.raises(MixedFragmentsError, match="both name data file ../step-1/"):
        ckptio.Reader(step_2).read_metadata()


def _file_names(doc: dict) -> list[str]:
    """A document's data file names, as the decoder spells them."""
    return list(decode_files(doc["files"], frozenset({"incremental", "key_prefix"}), "test")[0])


def test_markers_of_a_save_without_a_coordinator_go_when_it_is_overwritten_or_deleted(tmp_path):
    """A rank's marker is replaced with its fragment; a ``ckptio.json`` saved over the set releases every
    rank's; the base then goes whole when deleted, nothing of it kept for a checkpoint that no longer
    references it."""
    run = tmp_path / "run"
    config = {"incremental_from": "previous", "tuning": {"max_block_size": 4096}}
    _save(str(run / "step-1"), _state(), **config)

    def alone(**more) -> None:
        writer = ckptio.Writer(str(run / "step-2"), ckptio.WriterConfig(**{**config, **more}))
        dcp.save(_state(1.0), storage_writer=writer, use_collectives=False)
        ckptio.wait_for_uploads()

    def markers() -> list[str]:
        return sorted(p.name for p in (run / "step-1").iterdir() if p.name.startswith("ckptio.referenced-by-"))

    alone()
    assert markers() == [reference_marker_name("step-2", 0)]
    assert torch.equal(_load(str(run / "step-2"))["frozen"], _state()["frozen"])
    alone(overwrite=True, incremental_from=str(run / "step-1"))  # again: the rank's marker replaced, not doubled
    assert markers() == [reference_marker_name("step-2", 0)]
    alone(overwrite=True)  # "previous" is step-2 itself now: in full, so the rank's marker goes
    assert markers() == []
    alone(overwrite=True, incremental_from=str(run / "step-1"))
    _save(str(run / "step-2"), _state(1.0), overwrite=True)  # in full, with a coordinator
    assert markers() == []
    delete_checkpoint(open_store(str(run / "step-1")))
    assert not (run / "step-1").exists() or not list((run / "step-1").iterdir())
    assert torch.equal(_load(str(run / "step-2"))["adapter"], _state(1.0)["adapter"])


def test_previous_is_the_last_save_beside_the_new_one_not_one_elsewhere_in_between(tmp_path):
    """An export or an evaluation checkpoint saved to another folder between two training saves is not
    the training run's previous checkpoint (the save was a full one)."""
    run, config = tmp_path / "run", {"incremental_from": "previous"}
    _save(str(run / "step-1"), _state(), **config)
    _save(str(tmp_path / "exports" / "eval-1"), _state(), **config)
    _save(str(run / "step-2"), _state(1.0), **config)
    with open(run / "step-2" / METADATA_NAME) as f:
        assert json.load(f)["chain"]["base"] == "step-1"
    assert torch.equal(_load(str(run / "step-2"))["frozen"], _state()["frozen"])
