"""Integrity and safety: every way a checkpoint can be damaged, foreign or unsafe gets its own error."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from ckptio.format.records import METADATA_NAME
from ckptio.tools.cli import main as cli_main

from . import scenarios
from .conftest import S3_SERVERS
from .faultproxy import Fault
from .harness import run_ranks, spawn
from .metadata_view import readable_metadata

STATE = {"w": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024), "b": torch.ones(8), "meta": {"x": 1}}


def fresh():
    return {"w": torch.zeros(64, 1024), "b": torch.zeros(8), "meta": {"x": None}}


def saved(tmp_path, name="ck", state=STATE, **config) -> str:
    url = str(tmp_path / name)
    ckptio.save(state, url, ckptio.WriterConfig(inline_limit=0, **config))
    return url


def data_file(url: str) -> str:
    (name,) = [n for n in os.listdir(url) if n.endswith(".ckio")]
    return os.path.join(url, name)


def item_record(url: str, fqn: str) -> dict:
    return next(i for i in readable_metadata(url)["items"] if i["fqn"] == fqn)


def test_flipped_byte_names_key_file_offset_and_both_checksums(tmp_path):
    url = saved(tmp_path)
    record = item_record(url, "w")
    with open(data_file(url), "r+b") as f:
        f.seek(record["offset"] + 5000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ckptio.CorruptCheckpointError) as err:
        ckptio.load(fresh(), url)
    message = str(err.value)
    assert "'w'" in message and os.path.basename(data_file(url)) in message
    assert re.search(r"crc32c recorded [0-9a-f]{8}, read [0-9a-f]{8}", message)
    block = 5000 // record["block_size"]
    assert f"block {block} at byte offset {record['offset'] + block * record['block_size']}" in message
    ckptio.load(fresh(), url, verify=False)  # opting out really skips the check
    assert cli_main(["verify", "-q", url]) == 1


def test_truncated_and_missing_data_files(tmp_path):
    url = saved(tmp_path)
    path = data_file(url)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ckptio.CorruptCheckpointError, match=rf"truncated.*{size}-byte file"):
        ckptio.load(fresh(), url)
    os.remove(path)
    with pytest.raises(ckptio.CorruptCheckpointError, match="are missing"):
        ckptio.load(fresh(), url)


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


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_nonexistent_path_and_bucket(tmp_path, s3):
    with pytest.raises(ckptio.CheckpointNotFoundError, match="does not exist"):
        ckptio.load(fresh(), str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckptio.CheckpointNotFoundError, match="'ckptio.json' is missing"):
        ckptio.load(fresh(), str(tmp_path / "empty"))
    _, options = s3
    with pytest.raises(ckptio.CheckpointNotFoundError, match="does not exist"):
        ckptio.load(fresh(), "s3://no-such-bucket-ckptio/x", storage_options=options)
    with pytest.raises(ckptio.StorageError, match="bucket 'no-such-bucket-ckptio' does not exist"):
        ckptio.save(STATE, "s3://no-such-bucket-ckptio/x", storage_options=options)


@pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
def test_permission_denied_names_the_object(s3_proxy):
    proxy, base, options = s3_proxy
    proxy.faults.append(Fault(lambda r: r.operation == "GET", 403))
    with pytest.raises(ckptio.StorageError, match=r"access denied: get_object .*ckptio.json"):
        ckptio.load(fresh(), f"{base}/denied", storage_options=options)
    proxy.faults = [Fault(lambda r: r.operation in ("PUT", "MPU_CREATE"), 403)]
    with pytest.raises(ckptio.StorageError, match=r"access denied: put_object .*\.ckio"):
        ckptio.save(STATE, f"{base}/denied", ckptio.WriterConfig(inline_limit=0), storage_options=options)


def test_torch_dcp_checkpoint_is_recognised(tmp_path):
    url = str(tmp_path / "torch")
    dcp.save(STATE, storage_writer=dcp.FileSystemWriter(url))
    with pytest.raises(ckptio.NotCkptioCheckpointError, match="torch DCP checkpoint"):
        ckptio.load(fresh(), url)


def test_existing_checkpoint_is_never_overwritten_by_accident(tmp_path):
    url = saved(tmp_path)
    with pytest.raises(ckptio.CheckpointExistsError, match="overwrite=True"):
        ckptio.save(STATE, url)
    old_files = set(os.listdir(url))

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this on purpose")

    with pytest.raises(ckptio.CheckpointError, match="cannot pickle this on purpose"):
        ckptio.save({**STATE, "bad": Unpicklable()}, url, ckptio.WriterConfig(overwrite=True))
    assert set(os.listdir(url)) == old_files  # the failed overwrite left the old checkpoint as it was
    loaded = fresh()
    ckptio.load(loaded, url)
    assert torch.equal(loaded["w"], STATE["w"])

    newer = {**STATE, "w": STATE["w"] + 1}
    ckptio.save(newer, url, ckptio.WriterConfig(overwrite=True, inline_limit=0))
    loaded = fresh()
    ckptio.load(loaded, url)
    assert torch.equal(loaded["w"], newer["w"])
    new_files = set(os.listdir(url))
    assert len(new_files) == 2 and not (new_files - {METADATA_NAME}) & old_files  # superseded files removed


def test_rank_killed_mid_save_leaves_an_incomplete_checkpoint_and_the_previous_one_intact(tmp_path, capsys):
    previous, url = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    outcomes = run_ranks(2, scenarios.save_then_die_mid_save, previous, url, env={"CKPTIO_TEST_PG_TIMEOUT": "30"})
    assert outcomes[1][0] == "died"
    status, (elapsed, message) = outcomes[0]
    assert status == "ok" and elapsed < 30, outcomes[0]
    assert message.startswith("ckptio.errors.CheckpointError") and "another rank died" in message, message
    assert not os.path.exists(os.path.join(url, METADATA_NAME))
    with pytest.raises(ckptio.IncompleteCheckpointError, match=r"holds \d data file\(s\) of save\(s\)"):
        ckptio.load(scenarios.make_state(None, empty=True), url)
    assert scenarios.load(previous, None) == []
    assert cli_main(["verify", "-q", previous]) == 0
    orphans = sorted(os.listdir(url))
    scenarios.save(url, None, "all_ranks")  # saving again to the same path succeeds
    assert scenarios.load(url, None) == []
    capsys.readouterr()
    assert cli_main(["verify", "-q", url]) == 0
    assert f"belong to saves that never committed and are never read; safe to delete: {', '.join(orphans)}" in (
        capsys.readouterr().out
    )


class RunsCode:
    """A pickle that executes code when loaded unsafely."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_safe_loading_refuses_code_in_objects(tmp_path):
    marker = str(tmp_path / "pwned")
    url = str(tmp_path / "evil")
    dcp.save({"w": torch.ones(4), "payload": RunsCode(marker)}, storage_writer=ckptio.Writer(url))
    with pytest.raises(ckptio.UnsafeObjectError, match=r"key 'payload'.*(exec|builtins)"):
        ckptio.load({"w": torch.zeros(4), "payload": None}, url)
    assert not os.path.exists(marker)
    with pytest.raises(CheckpointException) as raw:  # plain dcp.load wraps it in torch's BaseException
        dcp.load(
            {"w": torch.zeros(4), "payload": None}, storage_reader=ckptio.Reader(url), planner=ckptio.SafeLoadPlanner()
        )
    assert isinstance(ckptio.unwrap(raw.value), ckptio.UnsafeObjectError)
    assert not os.path.exists(marker)
    # torch's default planner would run it: the danger the safe planner removes
    dcp.load({"w": torch.zeros(4), "payload": None}, storage_reader=ckptio.Reader(url), planner=DefaultLoadPlanner())
    assert open(marker).read() == "pwned"


def test_errors_are_exceptions_not_base_exceptions(tmp_path):
    assert issubclass(ckptio.CheckpointError, Exception)
    with pytest.raises(Exception) as info:  # noqa: B017 - the point of the test: caught as an Exception
        ckptio.load(fresh(), str(tmp_path / "missing"))
    assert isinstance(info.value, ckptio.CheckpointNotFoundError)


def test_inspect_and_verify_cli(tmp_path, capsys):
    url = saved(tmp_path, compression="zstd", state={**STATE, "z": torch.zeros(256, 256)})
    assert cli_main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "saved on     1 ranks" in out and "mode all_ranks, compression zstd" in out
    assert re.search(r"^z\s+float32\s+256x256\s+1\s+", out, re.M)
    assert cli_main(["inspect", "--json", url]) == 0
    desc = json.loads(capsys.readouterr().out)
    z = next(k for k in desc["keys"] if k["key"] == "z")
    assert z["logical_bytes"] == 256 * 256 * 4 and z["compression_ratio"] > 50 and desc["world_size"] == 1
    # the compact metadata, readable: a JSON object per item, itself a loadable (version 1 or 2) document
    items = {i["fqn"]: i for i in desc["metadata"]["items"]}
    assert items["z"]["shape"] == [256, 256] and items["z"]["codec"] == "zstd" and len(items) == len(desc["keys"])
    assert desc["format_version"] == 3 and desc["metadata"]["format_version"] in (1, 2)
    os.replace(os.path.join(url, METADATA_NAME), os.path.join(url, "v3.json"))
    with open(os.path.join(url, METADATA_NAME), "w") as f:
        json.dump(desc["metadata"], f)
    out = fresh()
    ckptio.load(out, url)
    assert torch.equal(out["w"], STATE["w"])
    os.replace(os.path.join(url, "v3.json"), os.path.join(url, METADATA_NAME))
    assert cli_main(["verify", "-q", url]) == 0
    assert "every checksum matches" in capsys.readouterr().out
    assert cli_main(["verify", "-q", str(tmp_path / "none")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    plain = str(tmp_path / "plain.pt")
    assert cli_main(["convert", url, plain]) == 0
    converted = torch.load(plain, weights_only=True)
    assert torch.equal(converted["w"], STATE["w"]) and converted["meta"] == {"x": 1}
    with pytest.raises(SystemExit) as help_exit:
        cli_main(["bench", "--help"])
    assert help_exit.value.code == 0 and "--mesh" in capsys.readouterr().out


def test_cli_refuses_bad_outputs_in_one_line_before_any_work(tmp_path, capsys):
    url = saved(tmp_path)
    (tmp_path / "a-file").write_text("x")
    cases = [
        (["convert", url, str(tmp_path / "no/such/dir/model.pt")], "does not exist"),
        (["convert", url, str(tmp_path)], "is a directory"),
        (["convert", url, str(tmp_path / "a-file"), "--format", "safetensors"], "is not a directory"),
        (["convert", url, str(tmp_path / "a-file"), "--format", "ckptio"], "is not a directory"),
        (["bench", "--out", str(tmp_path / "a-file")], "is not a directory"),
        (["bench", "--path", str(tmp_path / "a-file")], "is not a directory"),
        (["bench", "--compare", str(tmp_path / "none.json")], "is not a file"),
        (["bench", "--mesh", "2y2"], "REPLICASxSHARDS"),
        (["bench", "--mesh", "1x3"], "--ranks is 4"),
        (["bench", "--writers", "nope"], "unknown writer"),
    ]
    for argv, expected in cases:
        try:
            code = cli_main(argv)
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (argv, code, err)
        assert "Traceback" not in err
    assert not (tmp_path / "no").exists()


def test_a_metadata_failure_on_one_rank_fails_every_rank_promptly(tmp_path):
    url = str(tmp_path / "ok")
    spawn(2, scenarios.save, url, (1, 2), "all_ranks")
    outcomes = spawn(2, scenarios.load_where_only_rank_1_is_wrong, url, env={"CKPTIO_TEST_PG_TIMEOUT": "60"})
    for elapsed, message in outcomes:
        assert elapsed < 20 and message.startswith("CheckpointNotFoundError") and "-typo" in message, message
