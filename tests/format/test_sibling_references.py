"""Format version 7's references to sibling checkpoints and block digests, read as untrusted input: a
sibling is one folder name beside the checkpoint (never a path out of the run folder), and every field is
checked before any file is opened."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.errors import CheckpointFormatError
from ckptio.format.document import decode_metadata
from ckptio.format.names import METADATA_NAME
from ckptio.storage import open_store


@pytest.fixture
def incremental_doc(tmp_path) -> dict:
    """The metadata of a checkpoint that references its sibling ``step-1``."""
    config = ckptio.WriterConfig(incremental_from="previous", tuning=ckptio.Tuning(inline_limit=0))
    frozen = torch.arange(4096.0).reshape(64, 64)
    for step in (1, 2):
        state = {"frozen": frozen, "adapter": torch.full((4, 64), float(step))}
        dcp.save(state, storage_writer=ckptio.Writer(str(tmp_path / "run" / f"step-{step}"), config))
    return json.loads(open_store(str(tmp_path / "run" / "step-2")).read(METADATA_NAME))


def _decode(doc: dict) -> None:
    decode_metadata(json.dumps(doc).encode(), "crafted")


def test_the_saved_document_names_its_sibling_and_decodes(incremental_doc):
    assert incremental_doc["format_version"] == 8 and incremental_doc["features"] == ["incremental"]
    assert incremental_doc["files"]["bases"] == [{"name": "step-1"}]
    manifest = decode_metadata(json.dumps(incremental_doc).encode(), "saved")
    assert sorted(manifest.files)[0].startswith("../step-1/data-")
    assert all(len(item.digests) == 16 * len(item.blocks) for item in manifest.items.values())


@pytest.mark.parametrize(
    "name", ["..", ".", "a/b", "../step-0", "/abs", "", "x\n", "step-1/..", 7, None, "a" * 300, ".hidden"]
)
def test_a_sibling_name_that_is_not_one_folder_beside_it_is_refused(incremental_doc, name):
    incremental_doc["files"]["bases"] = [{"name": name}]
    with pytest.raises(CheckpointFormatError, match="sibling"):
        _decode(incremental_doc)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.update(features=[]), "belongs to feature 'incremental'"),
        (lambda d: d["files"].update(base=5), "past the 1 of 'bases'"),
        (lambda d: d["files"].update(bases=[]), "non-empty list"),
        (lambda d: d["files"].update(bases=[{"name": "step-1"}, {"name": "step-1"}]), "twice"),
        (lambda d: d["files"]["bases"][0].update(key_prefix="md5-9"), "key_prefix"),
        (lambda d: d["files"]["bases"][0].update(path="/etc"), "sibling"),
        (lambda d: d["chain"].update(referenced_bytes=d["chain"]["stored_bytes"] + 1), "more bytes"),
        (lambda d: d["chain"].update(base="../x"), "chain"),
        (lambda d: d["chain"].update(depth=-1), "depth"),
    ],
)
def test_malformed_references_and_chains_are_named_format_errors(incremental_doc, change, match):
    change(incremental_doc)
    with pytest.raises(CheckpointFormatError, match=match):
        _decode(incremental_doc)


def test_digests_of_the_wrong_length_are_refused(incremental_doc):
    table = incremental_doc["blocks"]
    table["digests"] = table["digests"][:-8]
    with pytest.raises(CheckpointFormatError, match="digests"):
        _decode(incremental_doc)


def test_digests_without_the_incremental_feature_are_refused(tmp_path):
    url = str(tmp_path / "plain")
    dcp.save({"w": torch.ones(8)}, storage_writer=ckptio.Writer(url, ckptio.WriterConfig(incremental_from="previous")))
    doc = json.loads(open_store(url).read(METADATA_NAME))
    del doc["features"]
    with pytest.raises(CheckpointFormatError, match="'digests' belongs to feature 'incremental'"):
        _decode(doc)


@pytest.fixture
def pieces_doc(tmp_path) -> dict:
    """The metadata of a checkpoint whose one tensor is stored in pieces: its changed first block in its
    own file, the rest in its sibling ``step-1``'s."""
    config = ckptio.WriterConfig(
        incremental_from="previous",
        tuning=ckptio.Tuning(inline_limit=0, max_block_size=1024),
        storage_config=ckptio.StorageConfig(read_gap_bytes=0),
    )
    weights = torch.arange(4096.0)
    for step in (1, 2):
        weights[0] = step
        dcp.save({"w": weights}, storage_writer=ckptio.Writer(str(tmp_path / "run" / f"step-{step}"), config))
    return json.loads(open_store(str(tmp_path / "run" / "step-2")).read(METADATA_NAME))


def test_an_item_in_pieces_names_its_runs_and_decodes(pieces_doc):
    manifest = decode_metadata(json.dumps(pieces_doc).encode(), "saved")
    ((virtual, runs),) = manifest.extents.items()
    assert [run.file.startswith("../step-1/") for run in runs] == [False, True]
    assert [run.length for run in runs] == [1024, 15 * 1024]
    assert next(iter(manifest.items.values())).file == virtual


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.update(features=[]), "belongs to feature 'incremental'"),
        (lambda d: d["extents"].update(items=0), "'items'"),
        (lambda d: d["extents"].update(items=2), "entries"),
        (lambda d: d["extents"].update(file=0), "names one of the"),
        (lambda d: d["extents"].update(file=9), "names one of the"),
        (lambda d: d["extents"].update(length=0), "holds a byte"),
        (lambda d: d["extents"].update(at=10**9), "spans bytes"),
        (lambda d: d["extents"].update(count=0), "at least one run"),
        (lambda d: d["extents"].update(count=10**12), "within the document"),
    ],
)
def test_malformed_runs_of_an_item_in_pieces_are_named_format_errors(pieces_doc, change, match):
    change(pieces_doc)
    with pytest.raises(CheckpointFormatError, match=match):
        _decode(pieces_doc)


def test_an_item_past_its_pieces_is_refused(pieces_doc):
    table = pieces_doc["items"]
    table["at"] = 1  # the item now ends a byte past its virtual file
    with pytest.raises(CheckpointFormatError, match="spans bytes"):
        _decode(pieces_doc)
