"""Data files under spread key prefixes (``WriterConfig.key_prefix="hash"``, format version 5): each
rank's file at ``<url>/<xx>/data-...ckio``, found by every reader and CLI verb, resharded, locally and
on S3; and what the prefixes do for a throttled store."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckptio
from ckptio.format.names import METADATA_NAME, data_file_name, parse_data_file_name
from ckptio.storage import open_store
from ckptio.tools.cli import main as cli_main
from tests.conftest import cli_storage_options, object_store
from tests.helpers import reshard_ranks
from tests.helpers.documents import fresh, load_error, read_doc, read_stored_doc, rewrite_in_version, saved, write_doc
from tests.helpers.faultproxy import PrefixRateLimit
from tests.helpers.harness import spawn

SPREAD = ckptio.WriterConfig(key_prefix="hash", compression="zstd", tuning=ckptio.Tuning(max_block_size=4096))


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.arange(100), "meta": {"x": 1}, "step": 7}


def _empty() -> dict:
    return {"w": torch.zeros(300, 70), "b": torch.zeros(100, dtype=torch.int64), "meta": {"x": 0}, "step": 0}


def _same(loaded: dict, state: dict) -> bool:
    return all(torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v for k, v in state.items())


def _target(where: str, tmp_path, request) -> tuple[str, dict | None, list[str]]:
    if where == "local":
        return str(tmp_path / "ckpt"), None, []
    base, options = object_store(request, where)
    return f"{base}/ckpt", options, cli_storage_options(options)


@pytest.mark.parametrize("where", ["local", "s3", "gcs", "azure"])
def test_a_spread_checkpoint_through_every_reader_and_cli_verb(where, tmp_path, request, capsys):
    url, options, cli_options = _target(where, tmp_path, request)
    state = _state()
    ckptio.save(state, url, SPREAD, storage_options=options)
    store = open_store(url, options)
    listed = store.list_sizes()
    (data,) = [name for name in listed if name != METADATA_NAME]
    parsed = parse_data_file_name(data)
    assert parsed.spread and data == data_file_name(parsed.save_id, 0, spread=True) and len(listed) == 2
    assert store.list_names() == sorted([METADATA_NAME, data.split("/")[0]])  # ckptio.json at the root
    doc = json.loads(store.read(METADATA_NAME))
    assert doc["features"] == ["key_prefix"] and doc["files"]["key_prefix"] == "sha256-2"

    loaded = _empty()
    ckptio.load(loaded, url, storage_options=options)
    assert _same(loaded, state)
    loaded = _empty()
    dcp.load(loaded, storage_reader=ckptio.Reader(url, storage_options=options, dedup_reads=True))
    assert _same(loaded, state)

    assert cli_main(["verify", "-q", url, *cli_options]) == 0 and "every checksum matches" in capsys.readouterr().out
    assert cli_main(["inspect", url, *cli_options]) == 0 and "(format 8, key_prefix)" in capsys.readouterr().out
    assert cli_main(["convert", url, str(tmp_path / "plain.pt"), *cli_options]) == 0
    assert torch.equal(torch.load(tmp_path / "plain.pt", weights_only=True)["w"], state["w"])
    out = str(tmp_path / "hf")
    assert cli_main(["convert", url, out, "--format", "safetensors", *cli_options]) == 0
    (shard,) = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert torch.equal(load_file(os.path.join(out, shard))["w"], state["w"])

    orphan = data_file_name("00000000000000aa", 1, spread=True)  # a killed save's file, under its own prefix
    sink = store.open_sink(orphan)
    sink.write(b"left by a killed save")
    sink.close()
    assert cli_main(["gc", url, *cli_options]) == 0 and orphan in capsys.readouterr().out
    assert cli_main(["gc", url, "--delete", *cli_options]) == 0
    assert sorted(store.list_sizes()) == sorted([METADATA_NAME, data])

    state["step"] = 8  # an overwrite removes the superseded file, wherever it sat
    ckptio.save(state, url, ckptio.WriterConfig(key_prefix="hash", overwrite=True), storage_options=options)
    (newer,) = [name for name in store.list_sizes() if name != METADATA_NAME]
    assert newer != data and parse_data_file_name(newer).spread
    if where == "local":  # the superseded file's folder went with it (unless the new file shares it)
        assert sorted(os.listdir(url)) == sorted({METADATA_NAME, newer.split("/")[0]})
    loaded = _empty()
    ckptio.load(loaded, url, storage_options=options)
    assert _same(loaded, state)


def test_saved_on_2x2_with_spread_prefixes_on_s3_loads_on_1x4_4x1_and_one_process(s3):
    base, options = s3
    url = f"{base}/run/step-1"
    case = {
        "tensors": [([64, 96], "float32"), ([40, 7, 3], "bfloat16")],
        "save_world": 4,
        "save_mesh": [2, 2],
        "save_placements": [[("R",), ("S", 0)], [("S", 1), ("S", 0)]],
        "mode": "replica_group",
        "compression": "zstd",
        "max_block_size": 1024,
        "dedup_reads": False,
        "key_prefix": "hash",
        "storage_options": options,
        "seed": 5,
    }
    spawn(4, reshard_ranks.save, case, url)
    files = [name for name in open_store(url, options).list_sizes() if name != METADATA_NAME]
    assert len(files) == 2 and all(parse_data_file_name(name).spread for name in files)  # replica group 0
    for world, mesh, placements in (
        (4, [1, 4], [[("R",), ("S", 1)], [("S", 0), ("S", 2)]]),
        (4, [4, 1], [[("S", 0), ("R",)], [("R",), ("S", 1)]]),
        (1, [1], [[("R",)], [("R",)]]),
    ):
        loading = {**case, "load_world": world, "load_mesh": mesh, "load_placements": placements}
        assert spawn(world, reshard_ranks.load_and_compare, loading, url) == [[]] * world, (mesh, placements)


def test_spread_prefixes_draw_at_most_half_the_503s_of_one_prefix_under_a_per_prefix_rate(s3_proxy):
    """On moto alone (4-rank spawns, twice): radosgw runs the throttled save and load in test_throttle."""
    proxy, base, options = s3_proxy
    throttled = {}
    for key_prefix in (None, "hash"):
        proxy.reset()
        proxy.faults.append(PrefixRateLimit(rate=10, burst=5))
        spawn(4, reshard_ranks.save_own_tensor, f"{base}/{key_prefix}/step-1", options, key_prefix, 12)
        throttled[key_prefix] = sum(proxy.reset().failed.values())
    # one prefix: 4 ranks x (create, 3 parts, complete) at once; spread: each rank's 5 in its own prefix
    assert throttled[None] > 0 and throttled["hash"] * 2 <= throttled[None], throttled


def test_key_prefixes_in_a_document_are_checked_as_every_name_is(tmp_path):
    url = saved(tmp_path, key_prefix="hash")
    doc = read_stored_doc(url)
    assert doc["features"] == ["key_prefix"] and doc["files"]["key_prefix"] == "sha256-2"
    for features, rule in (([], "sha256-2"), (["key_prefix"], "sha256-3"), (["key_prefix"], None)):
        write_doc(url, {**doc, "features": features, "files": {**doc["files"], "key_prefix": rule}})
        error = load_error(url, fresh())
        assert isinstance(error, ckptio.CheckpointFormatError) and f"key_prefix {rule!r}" in str(error), error
    write_doc(url, {**doc, "files": {k: v for k, v in doc["files"].items() if k != "key_prefix"}})
    assert "are missing" in str(load_error(url, fresh()))  # the plain names: not there
    # a version 1 document names its files: a prefix other than the name's own is refused
    write_doc(url, doc)
    legacy = read_doc(url)
    (name,) = legacy["files"]
    other = f"{int(name[:2], 16) ^ 1:02x}{name[2:]}"
    legacy["files"] = {other: legacy["files"][name]}
    legacy["items"] = [{**item, "file": other} if item.get("file") else item for item in legacy["items"]]
    write_doc(url, legacy)
    assert "not a plain ckptio data file name" in str(load_error(url, fresh()))
    with pytest.raises(ValueError, match="5 or later for data files under key prefixes, not 4"):
        rewrite_in_version(saved(tmp_path, "again", key_prefix="hash"), 4)
