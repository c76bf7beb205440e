"""What outside tests found (issue 13): each case failed before its fix."""

from __future__ import annotations

import json
import os
import resource
import struct
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.config import StorageConfig
from ckptio.format.codec import checksum
from ckptio.format.records import METADATA_NAME, pack_counts, unpack_counts
from ckptio.tools.cli import main as cli_main

from . import findings
from .conftest import S3_SERVERS, s3_client
from .faultproxy import Fault
from .harness import spawn
from .metadata_view import readable_metadata


def _meta_path(url: str) -> str:
    return os.path.join(url, METADATA_NAME)


def _read_doc(url: str) -> dict:
    return readable_metadata(url)


def _write_doc(url: str, doc: dict) -> None:
    with open(_meta_path(url), "w") as f:
        json.dump(doc, f)


def _load_error(url: str, state: dict) -> ckptio.CheckpointError:
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=ckptio.Reader(url))
    return ckptio.unwrap(info.value)


# --- silent data loss or wrong values -------------------------------------------------------------
def test_use_collectives_false_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    url = str(tmp_path / "ckpt")
    outcomes = spawn(2, findings.save_without_collectives, url)
    for outcome in outcomes:
        assert outcome.startswith("CheckpointError") and "use_collectives=False" in outcome, outcome
    assert not os.path.exists(url) or os.listdir(url) == []


def test_plan_caching_never_reuses_the_committed_checkpoints_data_files(tmp_path):
    url = str(tmp_path / "ckpt")
    results = spawn(2, findings.save_twice_with_plan_caching, url)
    first, second, wrong = results[0]
    assert first and second and not set(first) & set(second), (first, second)
    assert all(r[2] == [] for r in results), results


def _frame_declaring(size: int) -> bytes:
    """A small zstd frame whose header claims ``size`` content bytes (a 4-byte content-size field)."""
    frame = zstandard.ZstdCompressor().compress(bytes(70000))
    descriptor = frame[4]
    assert descriptor >> 6 == 2 and descriptor & 3 == 0  # 4-byte content size, no dictionary id
    at = 5 if descriptor & 0x20 else 6  # single-segment frames have no window descriptor
    return frame[:at] + size.to_bytes(4, "little") + frame[at + 4 :]


def _replace_first_block(url: str, key: str, stored: bytes) -> None:
    """Put other stored bytes in block 0 of ``key`` and re-sign the metadata, as a crafted (or
    buggy) checkpoint would: the checksums match, only what the block decodes to is wrong."""
    doc = _read_doc(url)
    item = next(i for i in doc["items"] if i["fqn"] == key)
    path = os.path.join(url, item["file"])
    data = open(path, "rb").read()
    lengths, crcs = unpack_counts(item["stored_lengths"], "x"), unpack_counts(item["crc32c"], "x")
    start = item["offset"]
    data = data[:start] + stored + data[start + lengths[0] :]
    lengths[0], crcs[0] = len(stored), checksum(stored)
    item["stored_lengths"], item["crc32c"] = pack_counts(lengths), pack_counts(crcs)
    doc["files"][item["file"]] = len(data)
    open(path, "wb").write(data)
    _write_doc(url, doc)


def _saved_zeros(tmp_path, codec: str) -> tuple[str, torch.Tensor, int]:
    """A compressed checkpoint of one tensor stored with ``codec`` (zeros for zstd; fp32 values
    for byte planes: on zeros whole-block zstd is smaller and chosen); the tensor, its block size."""
    url = str(tmp_path / "ckpt")
    if codec == "zstd":
        zeros = torch.zeros(256, 1024, dtype=torch.uint8)
    else:
        zeros = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    config = ckptio.WriterConfig(compression="zstd", inline_limit=0)
    dcp.save({"w": zeros}, storage_writer=ckptio.Writer(url, config))
    (item,) = _read_doc(url)["items"]
    assert item["codec"] == codec
    return url, zeros, item["block_size"]


def _block_around(codec: str, block: int, frame: bytes) -> bytes:
    """A stored block for ``codec`` whose (last) zstd frame is ``frame``."""
    if codec == "zstd":
        return frame
    plane = block // 4  # three raw planes, then the compressed one
    return bytes([4]) + struct.pack("<4I", plane, plane, plane, len(frame)) + bytes(3 * plane) + frame


@pytest.mark.parametrize("codec", ["zstd", "zstd-byteplanes"])
@pytest.mark.parametrize("content_size", [True, False])
def test_a_compressed_block_that_decodes_to_another_length_is_corrupt(tmp_path, codec, content_size):
    url, zeros, block = _saved_zeros(tmp_path, codec)
    logical = block if codec == "zstd" else block // 4
    frame = zstandard.ZstdCompressor(write_content_size=content_size).compress(bytes(logical - 4))
    _replace_first_block(url, "w", _block_around(codec, block, frame))
    error = _load_error(url, {"w": torch.full_like(zeros, 7)})
    assert isinstance(error, ckptio.CorruptCheckpointError) and "'w'" in str(error) and "block 0" in str(error)
    assert f"{logical - 4} bytes where the metadata records {logical}" in str(error) or (
        content_size and f"declares {logical - 4} bytes" in str(error)
    ), str(error)


@pytest.mark.parametrize("codec", ["zstd", "zstd-byteplanes"])
def test_a_frame_that_declares_a_huge_size_fails_before_allocating(tmp_path, codec):
    url, zeros, block = _saved_zeros(tmp_path, codec)
    _replace_first_block(url, "w", _block_around(codec, block, _frame_declaring(3 << 30)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = _load_error(url, {"w": torch.zeros_like(zeros)})
    assert isinstance(error, ckptio.CorruptCheckpointError) and "declares 3221225472 bytes" in str(error)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1 << 30) // 1024  # KiB


def _two_chunk_checkpoint(tmp_path) -> str:
    """A tensor saved as two chunks (by two 'ranks' of a sharded tensor, written here as one plan)."""
    url = str(tmp_path / "ckpt")
    state = {"w": torch.arange(4096.0).reshape(64, 64), "meta": {"epoch": 3}}
    dcp.save(state, storage_writer=ckptio.Writer(url, ckptio.WriterConfig(inline_limit=0)))
    doc = _read_doc(url)
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
    _write_doc(url, doc)
    return url


def test_chunks_that_do_not_cover_the_tensor_are_refused(tmp_path):
    url = _two_chunk_checkpoint(tmp_path)
    out = {"w": torch.zeros(64, 64), "meta": {"epoch": 0}}
    dcp.load(out, storage_reader=ckptio.Reader(url))  # the crafted split itself is valid
    assert torch.equal(out["w"], torch.arange(4096.0).reshape(64, 64))
    good = _read_doc(url)

    doc = json.loads(json.dumps(good))  # a chunk missing: its item and its declaration
    doc["items"] = [i for i in doc["items"] if i.get("chunk_offset") != [32, 0]]
    doc["state"]["w"]["chunks"] = doc["state"]["w"]["chunks"][:1]
    _write_doc(url, doc)
    error = _load_error(url, {"w": torch.full((64, 64), -1.0)})
    assert isinstance(error, ckptio.CheckpointFormatError) and "does not cover the tensor" in str(error)

    doc = json.loads(json.dumps(good))  # a chunk declared, its item missing
    doc["items"] = [i for i in doc["items"] if i.get("chunk_offset") != [32, 0]]
    _write_doc(url, doc)
    error = _load_error(url, {"w": torch.full((64, 64), -1.0)})
    assert isinstance(error, ckptio.CheckpointFormatError) and "record is missing" in str(error)

    doc = json.loads(json.dumps(good))  # an object record where a tensor chunk is expected
    bytes_item = next(i for i in doc["items"] if i["fqn"] == "meta.epoch")
    tensor_item = next(i for i in doc["items"] if i.get("chunk_offset") == [32, 0])
    tensor_item.update({k: bytes_item[k] for k in ("kind", "dtype", "shape", "logical_bytes", "crc32c", "offset")})
    _write_doc(url, doc)
    error = _load_error(url, {"w": torch.full((64, 64), -1.0)})
    assert isinstance(error, ckptio.CheckpointFormatError) and "bytes" in str(error)


@pytest.mark.parametrize("which", ["rng", "counter", "sampled"])
def test_plain_tensors_that_differ_between_ranks_fail_the_save(tmp_path, which):
    url = str(tmp_path / which)
    key = {"rng": "rng", "counter": "samples_seen", "sampled": "noise"}[which]
    for outcome in spawn(2, findings.save_per_rank_tensor, url, which):
        assert outcome.startswith("PerRankStateError") and f"tensor key '{key}'" in outcome, outcome
        assert "ranks [0]; ranks [1]" in outcome and "ckptio.PerRank" in outcome
    assert not os.path.exists(_meta_path(url))


def test_equal_objects_whose_pickles_differ_are_not_per_rank_state(tmp_path):
    url = str(tmp_path / "ckpt")
    for outcome, config, tags in spawn(2, findings.save_equal_objects_with_different_pickles, url):
        assert outcome == "ok"
        assert config == {"lr": 0.1, "warmup": 100, "betas": (0.9, 0.95), "name": "run"}
        assert tags == {f"tag-{i}" for i in range(32)}


# --- hostile or garbage metadata ------------------------------------------------------------------
def _saved(tmp_path, name: str = "ckpt") -> str:
    url = str(tmp_path / name)
    state = {"w": torch.arange(70000.0), "blob": b"x" * 100, "cfg": {"lr": 0.1}}
    dcp.save(state, storage_writer=ckptio.Writer(url))
    return url


def _format_error_for(url: str, raw: bytes | str) -> str:
    with open(_meta_path(url), "wb") as f:
        f.write(raw.encode() if isinstance(raw, str) else raw)
    error = _load_error(url, {"w": torch.zeros(70000)})
    assert isinstance(error, ckptio.CheckpointFormatError), repr(error)
    return str(error)


def test_garbage_json_is_a_named_format_error(tmp_path):
    url = _saved(tmp_path)
    good = open(_meta_path(url)).read()
    doc, view = json.loads(good), _read_doc(url)  # version 3; the same in version 2's schema
    assert "deeper than" in _format_error_for(url, "[" * 100_000 + "]" * 100_000)
    assert "not valid JSON" in _format_error_for(url, good.replace('"count":1', '"count":' + "9" * 5000, 1))
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
        with open(_meta_path(url), "w") as f:
            f.write(json.dumps({**base, field: value}))
        for command in (["inspect", url], ["verify", "-q", url], ["convert", url, str(tmp_path / "o.pt")]):
            assert cli_main(command) == 2


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    url = _saved(tmp_path)
    open(_meta_path(url), "w").write('{"format": "ckptio", "format_version": 1, "files": 7}')
    for command in (["inspect", url], ["verify", "-q", url], ["convert", url, str(tmp_path / "o.pt")]):
        capsys.readouterr()
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith("ckptio: error: ") and err.count("\n") == 1 and "'files'" in err, err


def test_declared_sizes_are_checked_before_anything_large_is_allocated(tmp_path):
    url = _saved(tmp_path)
    doc = _read_doc(url)
    blob = next(i for i in doc["items"] if i["fqn"] == "blob")
    name = blob["file"]
    block = 64 << 20
    blob.update(logical_bytes=4 << 30, block_size=block, crc32c=pack_counts([0] * 64))
    blob["offset"] = doc["files"][name]
    doc["files"][name] += 4 << 30  # the file "holds" 4 GiB more
    _write_doc(url, doc)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    state = {"w": torch.zeros(70000), "blob": None, "cfg": {"lr": 0.0}}
    error = _load_error(url, state)
    assert isinstance(error, ckptio.CorruptCheckpointError) and name in str(error) and "holds" in str(error)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < (1 << 30) // 1024  # KiB
    assert cli_main(["convert", url, str(tmp_path / "o.pt")]) == 2


def test_convert_does_not_allocate_from_a_declared_shape_or_planner_index(tmp_path, capsys):
    url = _saved(tmp_path)
    doc = _read_doc(url)
    w = next(i for i in doc["items"] if i["fqn"] == "w")
    n = 1 << 28  # a 1 GiB fp32 tensor, from a 280 KB file
    w.update(shape=[n], logical_bytes=4 * n, block_size=64 << 20, crc32c=pack_counts([0] * 16))
    doc["state"]["w"].update(size=[n], chunks=[{"offsets": [0], "sizes": [n]}])
    doc["files"][w["file"]] = w["offset"] + 4 * n
    _write_doc(url, doc)
    assert cli_main(["convert", url, str(tmp_path / "o.pt")]) == 2
    assert "holds" in capsys.readouterr().err

    url = _saved(tmp_path, "planner")
    doc = _read_doc(url)
    doc["planner_data"]["cfg.lr"] = ["cfg", 10**9]
    _write_doc(url, doc)
    assert cli_main(["convert", url, str(tmp_path / "o.pt")]) == 2
    assert "planner_data" in capsys.readouterr().err


def test_unwrap_recovers_the_class_of_metadata_errors_through_plain_dcp_load(tmp_path):
    state = {"w": torch.zeros(4)}
    assert isinstance(_load_error(str(tmp_path / "nothing"), state), ckptio.CheckpointNotFoundError)
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "data-0123456789abcdef-r00000.ckio").write_bytes(b"x")
    assert isinstance(_load_error(str(incomplete), state), ckptio.IncompleteCheckpointError)
    url = _saved(tmp_path)
    open(_meta_path(url), "w").write("{not json")
    assert isinstance(_load_error(url, state), ckptio.CheckpointFormatError)


# --- faults -----------------------------------------------------------------------------------
def test_a_stalled_s3_endpoint_is_bounded_by_the_retry_deadline(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/stalled"
    dcp.save({"w": torch.ones(1000)}, storage_writer=ckptio.Writer(url, storage_options=options))
    proxy.faults.append(Fault(lambda r: r.operation == "GET", "stall"))
    started = time.monotonic()
    reader = ckptio.Reader(
        url, storage_options=options, storage_config=StorageConfig(retry_attempts=3, retry_deadline_s=1)
    )
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=reader)
    assert time.monotonic() - started < 20  # the deadline (1 s) bounds it, not botocore's 60 s read timeout
    assert isinstance(ckptio.unwrap(info.value), ckptio.StorageError)

    proxy.faults[:] = [Fault(lambda r: r.operation == "PUT", "stall")]
    config = ckptio.WriterConfig(retry_attempts=3, retry_deadline_s=1)
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(1000)}, storage_writer=ckptio.Writer(f"{base}/s2", config, storage_options=options))
    assert time.monotonic() - started < 20
    assert "ckptio.json" in str(ckptio.unwrap(info.value))


def test_two_saves_racing_to_one_path_commit_exactly_once_locally(tmp_path):
    url = str(tmp_path / "ckpt")
    findings.race_two_saves(url)
    assert len([n for n in os.listdir(url) if n.endswith(".ckio")]) == 0  # everything inline, loser cleaned up


def test_two_saves_racing_to_one_path_commit_exactly_once_on_s3(s3):
    base, options = s3
    findings.race_two_saves(f"{base}/race", options)


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_s3_compatible_stores_without_conditional_writes_still_commit(s3_proxy):
    proxy, base, options = s3_proxy
    url = f"{base}/no-conditional"
    proxy.faults.append(Fault(lambda r: r.operation == "PUT" and r.conditional, 501))
    dcp.save({"w": torch.ones(10)}, storage_writer=ckptio.Writer(url, storage_options=options))
    stats = proxy.reset()
    # 501 is not retried. The first upload to this endpoint carries a CRC32C header too, so the 501 may
    # be about either: the conditional PUT is tried again without the checksum (still 501), then the
    # check and a plain PUT, which carries its checksum (so the store is not taken to refuse them)
    assert stats.failed["PUT"] == 2 and stats.requests["PUT"] == 3 and stats.requests["HEAD"] == 1
    assert [r.checksum for r in stats.log if r.operation == "PUT"] == [True, False, True]
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=ckptio.Reader(url, storage_options=options))
    assert torch.equal(out["w"], torch.ones(10))


def test_ranks_given_different_paths_fail_before_writing_anything(tmp_path):
    for outcome in spawn(2, findings.save_to_a_per_rank_path, str(tmp_path)):
        assert outcome.startswith("CheckpointError") and "different checkpoint locations" in outcome, outcome
    assert os.listdir(tmp_path) == []


def test_a_fifo_in_place_of_a_data_file_is_refused_by_name(tmp_path):
    url = _saved(tmp_path)
    (name,) = [n for n in os.listdir(url) if n.endswith(".ckio")]
    os.unlink(os.path.join(url, name))
    os.mkfifo(os.path.join(url, name))
    error = _load_error(url, {"w": torch.zeros(70000), "blob": None, "cfg": {"lr": 0.0}})
    assert isinstance(error, ckptio.StorageError) and "not a regular file" in str(error) and name in str(error)
    assert cli_main(["verify", "-q", url]) == 1


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_gc_lists_and_aborts_what_unfinished_saves_left_on_s3(s3, capsys):
    base, options = s3
    url = f"{base}/step-5"
    dcp.save({"w": torch.ones(10)}, storage_writer=ckptio.Writer(url, storage_options=options))
    bucket = base.removeprefix("s3://")
    client = s3_client(options)
    orphan = "step-5/data-00000000000000aa-r00001.ckio"
    client.put_object(Bucket=bucket, Key=orphan, Body=b"left by a killed save")
    client.create_multipart_upload(Bucket=bucket, Key="step-5/data-00000000000000aa-r00002.ckio")
    argv = ["gc", url, "--endpoint-url", options["client_kwargs"]["endpoint_url"]]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "orphaned data file   " + f"s3://{bucket}/{orphan}" in out and "unfinished upload" in out
    assert cli_main([*argv, "--delete"]) == 0
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert orphan not in keys and f"step-5/{METADATA_NAME}" in keys
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=ckptio.Reader(url, storage_options=options))
    assert torch.equal(out["w"], torch.ones(10))


# --- drop-in compatibility with torch's writers -------------------------------------------------
def test_compiled_model_keys_round_trip_through_plain_dcp(tmp_path):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    url = str(tmp_path / "from-compiled")
    dcp.save(compiled.state_dict(), storage_writer=ckptio.Writer(url))
    assert sorted(_read_doc(url)["state"]) == sorted(plain.state_dict())
    target = plain.state_dict()
    dcp.load(target, storage_reader=ckptio.Reader(url))
    for key, value in compiled.state_dict().items():
        assert torch.equal(target[key.removeprefix("_orig_mod.")], value)
    url = str(tmp_path / "from-plain")
    dcp.save(plain.state_dict(), storage_writer=ckptio.Writer(url))
    again = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    target = again.state_dict()
    dcp.load(target, storage_reader=ckptio.Reader(url))
    for key, value in plain.state_dict().items():
        assert torch.equal(target["_orig_mod." + key], value)


def test_storage_meta_on_save_and_load(tmp_path):
    url = str(tmp_path / "ckpt")
    metadata = dcp.save({"w": torch.ones(3)}, storage_writer=ckptio.Writer(url))
    assert metadata.storage_meta.checkpoint_id == url and metadata.storage_meta.save_id
    read = ckptio.Reader(url).read_metadata()
    assert read.storage_meta.save_id == metadata.storage_meta.save_id and read.storage_meta.load_id


def test_checkpoint_ids_fsspec_cannot_open_are_not_claimed():
    for good in ("/tmp/x", "s3://bucket/key", "memory://x", "file:///tmp/x"):
        assert ckptio.Writer.validate_checkpoint_id(good) and ckptio.Reader.validate_checkpoint_id(good)
    for bad in ("nosuchproto://bucket/x", ""):
        assert not ckptio.Writer.validate_checkpoint_id(bad) and not ckptio.Reader.validate_checkpoint_id(bad)


def test_writer_accepts_torchs_overwrite_keyword(tmp_path):
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=ckptio.Writer(url))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3)}, storage_writer=ckptio.Writer(url))
    assert "ckptio.Writer(path, overwrite=True)" in str(ckptio.unwrap(info.value))
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=ckptio.Writer(url, overwrite=True))
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["w"], torch.full((3,), 2.0))


def test_conjugate_and_negative_bit_views_save_their_values(tmp_path):
    z = torch.randn(50, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": z.conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url))
    out = {"conj": torch.zeros(50, dtype=torch.complex64), "neg": torch.zeros(50)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and torch.equal(out["neg"], -z.imag)


def test_convert_is_reachable_after_import_ckptio(tmp_path):
    url = _saved(tmp_path)
    full = ckptio.tools.convert.load_full(url)
    assert torch.equal(full["w"], torch.arange(70000.0)) and full["blob"] == b"x" * 100


@pytest.mark.slow
def test_compressed_load_memory_stays_a_small_multiple_of_a_raw_load(tmp_path):
    peaks = spawn(0, _load_peak, str(tmp_path), 256 << 20)
    raw, compressed = peaks[0]
    assert compressed <= 3 * max(raw, 32 << 20), (raw, compressed)


def _load_peak(base: str, nbytes: int) -> tuple[int, int]:
    """Peak RSS growth (bytes) of loading one large tensor, raw and zstd, in this fresh process."""
    values = torch.randn(nbytes // 4).to(torch.bfloat16).float()  # compressible: bf16 values in fp32
    for name, compression in (("raw", None), ("zstd", "zstd")):
        config = ckptio.WriterConfig(compression=compression)
        dcp.save({"t": values}, storage_writer=ckptio.Writer(os.path.join(base, name), config))
    target = torch.zeros_like(values)
    peaks = []
    for name in ("raw", "zstd"):
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        _reset_peak()
        dcp.load({"t": target}, storage_reader=ckptio.Reader(os.path.join(base, name)))
        assert torch.equal(target, values)
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        peaks.append((hwm - rss) * 1024)
    return peaks[0], peaks[1]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_with_both_executors(tmp_path, executor):
    assert spawn(2, findings.async_saves, str(tmp_path), executor) == [[], []]


@pytest.mark.protocol
@pytest.mark.parametrize("stager", [0, 1, 2], ids=["torch-stager", "ckptio-stager-1", "ckptio-stager-2"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_saves_in_flight_together_run_one_after_the_other(tmp_path, executor, stager):
    # Not awaited before the next starts; torch alone runs the thread executor's saves at once and hangs.
    # With ckptio.Stager the buffers are reused: a save must not see the next one's values.
    assert spawn(2, findings.async_saves, str(tmp_path), executor, True, stager, timeout=180) == [[], []]


@pytest.mark.protocol
@pytest.mark.parametrize("plain", [False, True], ids=["ckptio-stager", "writer-staging"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_stager_restages_when_the_state_layout_changes(tmp_path, executor, plain):
    assert spawn(2, findings.stager_across_layout_changes, str(tmp_path), executor, plain, timeout=180) == [[], []]


@pytest.mark.protocol
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_plain_async_save_stages_into_reused_buffers(tmp_path, executor):
    # Values at call time, a failed background save followed by a good one, and one set of
    # staging buffers for saves awaited one by one.
    assert spawn(2, findings.plain_async_saves, str(tmp_path), executor, timeout=180) == [([], 1), ([], 1)]


def test_a_mode_change_under_torchs_plan_cache_is_reported(tmp_path):
    # the cached plan is replayed as it was made (all_ranks); the save is right, and rank 0 says so
    (messages0, exact0), (messages1, exact1) = spawn(2, findings.switch_mode_under_plan_cache, str(tmp_path))
    assert exact0 and exact1
    assert len(messages0) == 1 and "mode 'all_ranks'" in messages0[0] and "'replica_group'" in messages0[0]
    assert messages1 == []


@pytest.mark.timeout(120)
def test_a_writer_made_but_never_used_does_not_hold_up_later_saves(tmp_path, monkeypatch):
    from ckptio.saving import ordering

    monkeypatch.setattr(ordering, "START_WAIT_S", 1e6)  # a wait for the unused Writer would hang
    unused = ckptio.Writer(str(tmp_path / "never"))
    del unused
    ckptio.save({"w": torch.ones(4)}, str(tmp_path / "saved"))
    out = {"w": torch.zeros(4)}
    ckptio.load(out, str(tmp_path / "saved"))
    assert torch.equal(out["w"], torch.ones(4))
