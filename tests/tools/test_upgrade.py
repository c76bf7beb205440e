"""``ckptio upgrade``: checkpoints of ckptio 0.x (samples written by 0.1 and 0.2, and documents of versions 3
to 5 and 7) get 1.0 metadata that loads alike, their data files untouched; nothing is written on --check, on a
1.0 checkpoint, or where the old document does not decode."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format.document import decode_metadata, encode_metadata
from ckptio.format.names import METADATA_NAME
from ckptio.legacy.reader import encode_legacy
from ckptio.storage import open_store
from ckptio.tools.cli import main as cli_main
from ckptio.tools.upgrade import _check_same, _items_of, upgrade
from tests.format.test_versions import DATA, _v2_sample_state, assert_loads_the_v1_samples_state
from tests.helpers.documents import STATE, fresh, meta_path, rewrite_in_version, saved


def _version(url: str) -> int:
    with open(meta_path(url)) as f:
        return json.load(f)["format_version"]


def _data_files(url: str) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(folder, name), url): open(os.path.join(folder, name), "rb").read()
        for folder, _, names in os.walk(url)
        for name in names
        if name != METADATA_NAME
    }


def _upgraded(url: str, capsys) -> None:
    """``ckptio upgrade --check`` (nothing written), then ``ckptio upgrade``: version 8, data files as they were."""
    before, files = open(meta_path(url), "rb").read(), _data_files(url)
    assert cli_main(["upgrade", "--check", url]) == 0
    assert "would get ckptio 1.0's metadata" in capsys.readouterr().out
    assert open(meta_path(url), "rb").read() == before
    assert cli_main(["upgrade", url]) == 0
    assert "now has ckptio 1.0's metadata" in capsys.readouterr().out
    assert _version(url) == 8 and _data_files(url) == files
    assert cli_main(["upgrade", url]) == 0 and "nothing to do" in capsys.readouterr().out
    assert cli_main(["verify", "-q", url]) == 0


@pytest.mark.parametrize("name", ["v1-raw", "v1-zstd"])
def test_checkpoints_of_0_1_upgrade_and_load_bit_exact(tmp_path, capsys, name):
    url = str(tmp_path / name)
    shutil.copytree(os.path.join(DATA, name), url)
    _upgraded(url, capsys)
    assert_loads_the_v1_samples_state(url)


def test_a_sharded_version_2_checkpoint_with_per_rank_values_upgrades(tmp_path, capsys):
    from tests.format.test_versions import _load_v2_sample
    from tests.helpers.harness import spawn

    url = str(tmp_path / "v2")
    shutil.copytree(os.path.join(DATA, "v2-sharded-zstd"), url)
    _upgraded(url, capsys)
    assert spawn(2, _load_v2_sample, url) == [True, True]  # each rank's own "dl" value
    expected = _v2_sample_state(0)
    state = {"w": torch.zeros(256, 130), "e": torch.zeros(64, 96, dtype=torch.bfloat16), "step": 0}
    dcp.load(state, storage_reader=ckptio.Reader(url))
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["e"], expected["e"]) and state["step"] == 7


@pytest.mark.parametrize(
    "version, config",
    [(3, {}), (4, {"compression": "zstd"}), (4, {"tuning": {"inline_limit": 1 << 20}}), (5, {"key_prefix": "hash"})],
)
def test_documents_of_versions_3_to_5_upgrade(tmp_path, capsys, version, config):
    url = str(tmp_path / "ck")
    ckptio.save(STATE, url, ckptio.WriterConfig(**{"tuning": {"inline_limit": 0}, **config}))
    rewrite_in_version(url, version)
    assert _version(url) == version
    _upgraded(url, capsys)
    out = fresh()
    ckptio.load(out, url)
    assert torch.equal(out["w"], STATE["w"]) and torch.equal(out["b"], STATE["b"]) and out["meta"] == STATE["meta"]


def test_an_incremental_chain_of_version_7_upgrades_child_and_base(tmp_path, capsys):
    run = tmp_path / "run"
    g = torch.Generator().manual_seed(3)
    base = {"frozen": torch.randn(256, 64, generator=g), "adapter": torch.randn(8, 64, generator=g)}
    frozen = base["frozen"].clone()
    frozen[100] += 1  # one block of 16 changes: the child stores frozen in pieces (extents)
    child = {"frozen": frozen, "adapter": base["adapter"] + 1}
    # read_gap_bytes=0: a read request costs nothing, so an item with one changed block is kept in pieces
    config = {
        "incremental_from": "previous",
        "tuning": {"max_block_size": 4096},
        "storage_config": {"read_gap_bytes": 0},
    }
    for step, state in (("step-1", base), ("step-2", child)):
        dcp.save(state, storage_writer=ckptio.Writer(str(run / step), ckptio.WriterConfig(**config)))
    for step in ("step-2", "step-1"):  # each written again as 0.2 wrote it: version 7 (digests, references)
        reader = ckptio.Reader(str(run / step))
        reader.read_metadata()
        manifest = reader.manifest
        raw = encode_legacy(manifest.metadata, _items_of(manifest), manifest.header, manifest.per_rank)
        assert json.loads(raw)["format_version"] == 7
        assert (step == "step-2") == bool(json.loads(raw).get("extents"))
        with open(meta_path(str(run / step)), "wb") as f:
            f.write(raw)
    _upgraded(str(run / "step-2"), capsys)
    _upgraded(str(run / "step-1"), capsys)
    for step, state in (("step-1", base), ("step-2", child)):
        out = {"frozen": torch.zeros(256, 64), "adapter": torch.zeros(8, 64)}
        dcp.load(out, storage_reader=ckptio.Reader(str(run / step)))
        assert all(torch.equal(out[k], state[k]) for k in state), step
    # a later incremental save finds its base's digests in the upgraded document
    third = {"frozen": frozen, "adapter": base["adapter"] + 2}
    dcp.save(third, storage_writer=ckptio.Writer(str(run / "step-3"), ckptio.WriterConfig(**config)))
    with open(meta_path(str(run / "step-3"))) as f:
        assert json.load(f)["chain"]["base"] == "step-2"


def test_nothing_is_written_to_a_1_0_checkpoint_or_over_a_damaged_document(tmp_path, capsys):
    url = saved(tmp_path)
    before = open(meta_path(url), "rb").read()
    assert upgrade(open_store(url)).document is None and open(meta_path(url), "rb").read() == before
    rewrite_in_version(url, 4)
    damaged = open(meta_path(url), "rb").read().replace(b'"format_version":4', b'"format_version":4,"keys":7')
    with open(meta_path(url), "wb") as f:
        f.write(damaged)
    with pytest.raises(ckptio.CheckpointFormatError):
        upgrade(open_store(url))
    assert open(meta_path(url), "rb").read() == damaged
    assert cli_main(["upgrade", url]) != 0
    assert METADATA_NAME in capsys.readouterr().err


def test_the_proof_refuses_a_new_document_that_differs_in_any_record(tmp_path):
    url = saved(tmp_path)
    rewrite_in_version(url, 4)
    old = decode_metadata(open(meta_path(url), "rb").read(), url)
    new = decode_metadata(encode_metadata(old.metadata, _items_of(old), old.header, old.per_rank), url)
    _check_same(old, new, url)
    index, record = next(iter(new.items.items()))
    (length, crc), *rest = record.blocks
    changed = {**new.items, index: dataclasses.replace(record, blocks=((length, crc ^ 1), *rest))}
    with pytest.raises(ckptio.CheckpointFormatError, match=f"the record of .*{index.fqn}"):
        _check_same(old, dataclasses.replace(new, items=changed), url)
    moved = {**new.items, index: dataclasses.replace(record, offset=record.offset + 1)}
    with pytest.raises(ckptio.CheckpointFormatError, match="nothing was written"):
        _check_same(old, dataclasses.replace(new, items=moved), url)
