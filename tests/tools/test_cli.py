"""The ``ckptio`` command line (``ckptio.tools``): one-line errors, exit codes, convert, gc."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.config import StorageConfig
from ckptio.format.names import METADATA_NAME
from ckptio.legacy.v1 import pack_counts
from ckptio.storage import open_store
from ckptio.storage.gcs import COMPOSE_ABOVE_PARTS
from ckptio.tools.cli import main as cli_main
from ckptio.tools.inspection import open_checkpoint
from tests.conftest import S3_SERVERS, cli_storage_options, object_store, s3_client, store_objects
from tests.helpers.documents import STATE, meta_path, read_doc, saved, saved_with_dcp, write_doc
from tests.helpers.faultproxy import Fault


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    url = saved_with_dcp(tmp_path)
    open(meta_path(url), "w").write('{"format": "ckptio", "format_version": 1, "files": 7}')
    for command in (["inspect", url], ["verify", "-q", url], ["convert", url, str(tmp_path / "o.pt")]):
        capsys.readouterr()
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith("ckptio: error: ") and err.count("\n") == 1 and "'files'" in err, err


def test_convert_does_not_allocate_from_a_declared_shape_or_planner_index(tmp_path, capsys):
    url = saved_with_dcp(tmp_path)
    doc = read_doc(url)
    w = next(i for i in doc["items"] if i["fqn"] == "w")
    n = 1 << 28  # a 1 GiB fp32 tensor, from a 280 KB file
    w.update(shape=[n], logical_bytes=4 * n, block_size=64 << 20, crc32c=pack_counts([0] * 16))
    doc["state"]["w"].update(size=[n], chunks=[{"offsets": [0], "sizes": [n]}])
    doc["files"][w["file"]] = w["offset"] + 4 * n
    write_doc(url, doc)
    assert cli_main(["convert", url, str(tmp_path / "o.pt")]) == 2
    assert "holds" in capsys.readouterr().err

    url = saved_with_dcp(tmp_path, "planner")
    doc = read_doc(url)
    doc["planner_data"]["cfg.lr"] = ["cfg", 10**9]
    write_doc(url, doc)
    assert cli_main(["convert", url, str(tmp_path / "o.pt")]) == 2
    assert "has a list index 1000000000 that is not below" in capsys.readouterr().err


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


def test_convert_is_reachable_after_import_ckptio(tmp_path):
    url = saved_with_dcp(tmp_path)
    full = ckptio.tools.convert.load_full(url)
    assert torch.equal(full["w"], torch.arange(70000.0)) and full["blob"] == b"x" * 100


def test_latest_prints_the_newest_committed_checkpoint_of_a_run(tmp_path, capsys, clean_env):
    run = tmp_path / "run"
    for step in (5, 10, 9):
        ckptio.save({"w": torch.ones(3) * step}, str(run / f"step-{step}"))
    os.remove(run / "step-10" / METADATA_NAME)  # a save that never committed
    assert cli_main(["latest", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "step-9")
    assert cli_main(["latest", str(tmp_path / "nothing-here")]) == 1
    assert "no committed ckptio checkpoint" in capsys.readouterr().err


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
    # the compact metadata, readable: an object per key and per stored item, blocks as they are recorded
    items = {i["fqn"]: i for i in desc["metadata"]["items"]}
    assert items["z"]["shape"] == [256, 256] and items["z"]["codec"] == "zstd" and len(items) == len(desc["keys"])
    assert desc["format_version"] == 8 and desc["metadata"]["state"]["z"]["size"] == [256, 256]
    _, z_record = next((i, r) for i, r in open_checkpoint(url)[1].items.items() if i.fqn == "z")
    assert items["z"]["blocks"] == [list(b) for b in z_record.blocks] and items["z"]["file"] == z_record.file
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


@pytest.mark.parametrize("s3", S3_SERVERS[:1], indirect=True)
def test_gc_delete_lists_what_it_could_not_delete_and_exits_non_zero(s3_proxy, capsys):

    proxy, base, options = s3_proxy
    url = f"{base}/step-5"
    ckptio.save({"w": torch.ones(10)}, url, storage_options=options)
    bucket = base.removeprefix("s3://")
    orphan = "step-5/data-00000000000000aa-r00001.ckio"
    s3_client(options).put_object(Bucket=bucket, Key=orphan, Body=b"left by a killed save")
    proxy.faults.append(Fault(lambda r: r.operation == "DELETE", 403))
    argv = ["gc", url, "--endpoint-url", options["client_kwargs"]["endpoint_url"], "--delete"]
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert f"could not remove s3://{bucket}/{orphan}" in captured.err and "AccessDenied" in captured.err
    assert "removed 0 of 1 file(s)" in captured.out
    keys = [o["Key"] for o in s3_client(options).list_objects_v2(Bucket=bucket)["Contents"]]
    assert orphan in keys
    proxy.faults.clear()
    assert cli_main(argv) == 0  # once the store allows it, the same command finishes the job
    keys = [o["Key"] for o in s3_client(options).list_objects_v2(Bucket=bucket)["Contents"]]
    assert orphan not in keys


def test_gc_lists_and_removes_the_parts_a_killed_gcs_save_left_uncomposed(request, capsys):
    base, options = object_store(request, "gcs")
    url = f"{base}/step-5"
    ckptio.save({"w": torch.ones(10)}, url, storage_options=options)
    store = open_store(url, options, StorageConfig(part_size=5 << 20))
    sink = store.open_sink("data-00000000000000aa-r00001.ckio")
    sink.write(bytes((COMPOSE_ABOVE_PARTS + 1) * (5 << 20)))  # parts sent; the process dies before close
    sink.results("upload")
    cli = cli_storage_options(options)
    assert cli_main(["gc", url, *cli]) == 0
    assert "unfinished upload" in capsys.readouterr().out
    assert cli_main(["gc", url, "--delete", *cli]) == 0
    assert not [name for name in store_objects(url, options) if ".ckptio-part." in name]
    out = {"w": torch.zeros(10)}
    ckptio.load(out, url, storage_options=options)
    assert torch.equal(out["w"], torch.ones(10))
