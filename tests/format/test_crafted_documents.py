"""Crafted or damaged ``ckptio.json`` documents fail with named format errors, through every entry point."""

from __future__ import annotations

import base64
import json
import os
import resource

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.format.names import METADATA_NAME
from ckptio.legacy.v1 import pack_counts, unpack_counts
from ckptio.tools.cli import main as cli_main
from tests.helpers.documents import (
    HUGE,
    fresh,
    load_error,
    meta_path,
    read_doc,
    rewrite_in_version,
    saved,
    saved_with_dcp,
    write_doc,
)


def _two_chunk_checkpoint(tmp_path) -> str:
    """A tensor saved as two chunks (by two 'ranks' of a sharded tensor, written here as one plan)."""
    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(4096.0).reshape(64, 64), "meta": {"epoch": 3}}
    dcp.save(state, storage_writer=ckptio.Writer(url, ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0))))
    doc = read_doc(url)
    # Split "w" into two row chunks the way a 2-way Shard(0) save records it.
    (entry,) = [i for i in doc["items"] if i["fqn"] == "w"]
    top, bottom = dict(entry), dict(entry)
    half = entry["logical_bytes"] // 2
    blocks = unpack_counts(entry["crc32c"], "x")
    per = len(blocks) // 2
    top.update(shape=[32, 64], logical_bytes=half, crc32c=pack_counts(blocks[:per]))
    bottom.update(shape=[32, 64], chunk_offset=[32, 0], offset=entry["offset"] + half, logical_bytes=half)
    bottom.update(crc32c=pack_counts(blocks[per:]), index=1)
    doc["items"] = [i for i in doc["items"] if i["fqn"] != "w"] + [top, bottom]
    doc["state"]["w"]["chunks"] = [{"offsets": [0, 0], "sizes": [32, 64]}, {"offsets": [32, 0], "sizes": [32, 64]}]
    write_doc(url, doc)
    return url


def test_chunks_that_do_not_cover_the_tensor_are_refused(tmp_path):
    url = _two_chunk_checkpoint(tmp_path)
    out = {"w": torch.zeros(64, 64), "meta": {"epoch": 0}}
    dcp.load(out, storage_reader=ckptio.Reader(url))  # the crafted split itself is valid
    assert torch.equal(out["w"], torch.arange(4096.0).reshape(64, 64))
    good = read_doc(url)

    doc = json.loads(json.dumps(good))  # a chunk missing: its item and its declaration
    doc["items"] = [i for i in doc["items"] if i.get("chunk_offset") != [32, 0]]
    doc["state"]["w"]["chunks"] = doc["state"]["w"]["chunks"][:1]
    write_doc(url, doc)
    error = load_error(url, {"w": torch.full((64, 64), -1.0)})
    assert isinstance(error, ckptio.CheckpointFormatError) and "does not cover the tensor" in str(error)

    doc = json.loads(json.dumps(good))  # a chunk declared, its item missing
    doc["items"] = [i for i in doc["items"] if i.get("chunk_offset") != [32, 0]]
    write_doc(url, doc)
    error = load_error(url, {"w": torch.full((64, 64), -1.0)})
    assert isinstance(error, ckptio.CheckpointFormatError) and "record is missing" in str(error)

    doc = json.loads(json.dumps(good))  # an object record where a tensor chunk is expected
    bytes_item = next(i for i in doc["items"] if i["fqn"] == "meta.epoch")
    tensor_item = next(i for i in doc["items"] if i.get("chunk_offset") == [32, 0])
    tensor_item.update({k: bytes_item[k] for k in ("kind", "dtype", "shape", "logical_bytes", "crc32c", "offset")})
    write_doc(url, doc)
    error = load_error(url, {"w": torch.full((64, 64), -1.0)})
    assert isinstance(error, ckptio.CheckpointFormatError) and "bytes" in str(error)


# --- hostile or garbage metadata ------------------------------------------------------------------


def _format_error_for(url: str, raw: bytes | str) -> str:
    with open(meta_path(url), "wb") as f:
        f.write(raw.encode() if isinstance(raw, str) else raw)
    error = load_error(url, {"w": torch.zeros(70000)})
    assert isinstance(error, ckptio.CheckpointFormatError), repr(error)
    return str(error)


def test_garbage_json_is_a_named_format_error(tmp_path):
    url = saved_with_dcp(tmp_path)
    good = open(meta_path(url)).read()
    doc, view = json.loads(good), read_doc(url)  # version 8; the same in version 2's schema
    assert "deeper than" in _format_error_for(url, "[" * 100_000 + "]" * 100_000)
    assert "not valid JSON" in _format_error_for(
        url, good.replace('"format_version":8', '"format_version":' + "9" * 5000, 1)
    )
    assert "repeats the JSON key 'files'" in _format_error_for(url, good[:-1] + ',"files":{}}')
    items = view["items"] + [view["items"][0]]
    assert "listed twice" in _format_error_for(url, json.dumps({**view, "items": items}))
    assert "format_version" in _format_error_for(url, json.dumps({**doc, "format_version": -1}))
    name = next(iter(view["files"]))
    files = {name + "\n": view["files"][name]}
    assert "plain ckptio data file name" in _format_error_for(url, json.dumps({**view, "files": files}))
    files = {**doc["files"], "save_ids": [doc["files"]["save_ids"][0] + "\n"]}
    assert "plain ckptio data file name" in _format_error_for(url, json.dumps({**doc, "files": files}))
    for field, value in [
        ("created_unix", "yesterday"),
        ("created_unix", 1e300),
        ("config", ["all_ranks"]),
        ("mesh", "2x2"),
        ("writer_ranks", [0]),
        ("world_size", -2),
    ]:
        base = view if field == "writer_ranks" else doc  # version 3 keeps writers in 'files'
        message = _format_error_for(url, json.dumps({**base, field: value}))
        assert repr(field) in message or f"field {field!r}" in message or field in message, (field, message)
        with open(meta_path(url), "w") as f:
            f.write(json.dumps({**base, field: value}))
        for command in (["inspect", url], ["verify", "-q", url], ["convert", url, str(tmp_path / "o.pt")]):
            assert cli_main(command) == 2


def test_declared_sizes_are_checked_before_anything_large_is_allocated(tmp_path):
    url = saved_with_dcp(tmp_path)
    doc = read_doc(url)
    blob = next(i for i in doc["items"] if i["fqn"] == "blob")
    name = blob["file"]
    block = 64 << 20
    blob.update(logical_bytes=4 << 30, block_size=block, crc32c=pack_counts([0] * 64))
    blob["offset"] = doc["files"][name]
    doc["files"][name] += 4 << 30  # the file "holds" 4 GiB more
    write_doc(url, doc)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    state = {"w": torch.zeros(70000), "blob": None, "cfg": {"lr": 0.0}}
    error = load_error(url, state)
    assert isinstance(error, ckptio.CorruptCheckpointError) and name in str(error) and "holds" in str(error)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1 << 30) // 1024  # KiB
    assert cli_main(["convert", url, str(tmp_path / "o.pt")]) == 2


def test_unwrap_recovers_the_class_of_metadata_errors_through_plain_dcp_load(tmp_path):
    state = {"w": torch.zeros(4)}
    assert isinstance(load_error(str(tmp_path / "nothing"), state), ckptio.CheckpointNotFoundError)
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "data-0123456789abcdef-r00000.ckio").write_bytes(b"x")
    assert isinstance(load_error(str(incomplete), state), ckptio.IncompleteCheckpointError)
    url = saved_with_dcp(tmp_path)
    open(meta_path(url), "w").write("{not json")
    assert isinstance(load_error(url, state), ckptio.CheckpointFormatError)


def test_missing_garbage_and_future_metadata(tmp_path):
    url = saved(tmp_path)
    meta_path = os.path.join(url, METADATA_NAME)
    good = open(meta_path, "rb").read()
    os.remove(meta_path)
    with pytest.raises(ckptio.IncompleteCheckpointError, match="never committed"):
        ckptio.load(fresh(), url)
    open(meta_path, "wb").write(b"\x80\x04\x95 not json at all")
    with pytest.raises(ckptio.CheckpointFormatError, match="not valid JSON"):
        ckptio.load(fresh(), url)
    doc = json.loads(good)
    doc["format_version"] = 99
    doc["written_by"] = "ckptio 9.9.9"
    open(meta_path, "w").write(json.dumps(doc))
    with pytest.raises(ckptio.CheckpointFormatError, match="written by ckptio 9.9.9 .* upgrade ckptio"):
        ckptio.load(fresh(), url)
    doc = json.loads(good)
    doc["files"]["save_ids"] = ["../../etc/data-0123456789abcdef"]  # names ../../etc/data-...-r00000.ckio
    open(meta_path, "w").write(json.dumps(doc))
    with pytest.raises(ckptio.CheckpointFormatError, match="plain ckptio data file name"):
        ckptio.load(fresh(), url)


# --- numbers in headers bounded where they are parsed -----------------------------------------------


def _packed_q(values: list[int]) -> str:
    """A packed column of 8-byte entries (2^64 and more saturate at the largest one it can hold)."""
    return "Q" + base64.b64encode(b"".join(min(v, 2**64 - 1).to_bytes(8, "little") for v in values)).decode()


#: The numbers of a version 4 document (``w`` and ``b`` are the tensors table's two keys, in that order).
V4_FIELDS = {
    "chunk offset (at)": lambda doc, v: doc["tensors"].__setitem__("at", v),
    "chunk offset (at, packed)": lambda doc, v: doc["tensors"].__setitem__("at", _packed_q([v, v])),
    "tensor size": lambda doc, v: doc["tensors"].__setitem__("size", _packed_q([v, 7])),
    "chunk count": lambda doc, v: doc["tensors"].__setitem__("count", v),
    "dimension count": lambda doc, v: doc["tensors"].__setitem__("ndim", v),
    "block size": lambda doc, v: doc["tensors"].__setitem__("block_size", v),
    "object length": lambda doc, v: doc["objects"].__setitem__("length", v),
    "document block size": lambda doc, v: doc.__setitem__("block_size", v),
}
#: The same numbers of a version 3 document (a ``keys`` record per tensor).
V3_FIELDS = {
    "chunk offset (at)": lambda doc, v: doc["keys"]["w"].__setitem__("at", v),
    "chunk offset (at, packed)": lambda doc, v: doc["keys"]["w"].__setitem__("at", _packed_q([v])),
    "tensor size": lambda doc, v: doc["keys"]["w"].__setitem__("size", [v]),
    "chunk size": lambda doc, v: doc["keys"]["w"].__setitem__("sizes", [v]),
    "chunk offsets": lambda doc, v: doc["keys"]["w"].__setitem__("offsets", [v]),
    "block size": lambda doc, v: doc["keys"]["w"].__setitem__("block_size", v),
    "object length": lambda doc, v: doc["objects"].__setitem__("length", v),
    "document block size": lambda doc, v: doc.__setitem__("block_size", v),
}
FIELDS = {4: V4_FIELDS, 3: V3_FIELDS}


#: Past int64 only: a file size larger than the file is a claim the decoder cannot see through (it
#: reads no file); loads find the file short, and paths that allocate first check sizes (below).
HEADER_FIELDS_INT64_ONLY = {
    "file size": lambda doc, v: doc["files"].__setitem__("sizes", v),
    "world size": lambda doc, v: doc.__setitem__("world_size", v),
    "file rank": lambda doc, v: doc["files"].__setitem__("ranks", v),
    "mesh shape": lambda doc, v: doc.__setitem__("mesh", {"shape": [v], "dims": ["dp"]}),
    "configured block size": lambda doc, v: doc["config"].__setitem__("max_block_size", v),
}


@pytest.mark.parametrize(
    "version, field, value",
    [(n, f, v) for n in (4, 3) for f in FIELDS[n] for v in [*HUGE, "past the file"]]
    + [(n, f, v) for n in (4, 3) for f in HEADER_FIELDS_INT64_ONLY for v in HUGE[:2]],
)
def test_ckptio_json_numbers_past_int64_or_the_file_are_format_errors_at_decode(version, field, value, raw_checkpoint):
    url, _ = raw_checkpoint
    doc = rewrite_in_version(url, version)
    if value == "past the file":
        value = doc["files"]["sizes"] + 1
    {**FIELDS[version], **HEADER_FIELDS_INT64_ONLY}[field](doc, value)
    write_doc(url, doc)
    with pytest.raises(ckptio.CheckpointFormatError) as info:
        ckptio.Reader(url).read_metadata()
    assert "ckptio.json" in str(info.value), info.value


LEGACY_FIELDS = {
    "item offset": lambda doc, v: doc["items"][0].__setitem__("offset", v),
    "file size": lambda doc, v: doc["files"].__setitem__(next(iter(doc["files"])), v),
    "tensor size": lambda doc, v: doc["state"]["w"].__setitem__("size", [v]),
    "chunk offset": lambda doc, v: doc["state"]["w"]["chunks"][0].__setitem__("offsets", [v]),
    "logical bytes": lambda doc, v: doc["items"][0].__setitem__("logical_bytes", v),
    "list index": lambda doc, v: doc["planner_data"].__setitem__("w", ["w", v]),
}


@pytest.mark.parametrize("value", HUGE[:2])
@pytest.mark.parametrize("field", list(LEGACY_FIELDS))
def test_version_1_documents_bound_the_same_numbers(field, value, raw_checkpoint):
    """ckptio 0.1's schema (a JSON object per item), which every later ckptio still reads: the same
    bounds, through the same rule functions."""
    from ckptio.legacy.v1 import legacy_document

    url, _ = raw_checkpoint
    reader = ckptio.Reader(url)
    reader.read_metadata()
    doc = legacy_document(reader.manifest)
    assert doc["format_version"] == 1 and doc["items"][0]["fqn"] == "w"
    LEGACY_FIELDS[field](doc, value)
    write_doc(url, doc)
    with pytest.raises(ckptio.CheckpointFormatError) as info:
        ckptio.Reader(url).read_metadata()
    assert "ckptio" in str(info.value), info.value
