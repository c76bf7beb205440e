"""Integrity and safety: every way a checkpoint can be damaged, foreign or unsafe gets its own error."""

from __future__ import annotations

import os
import re

import pytest
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.conftest import STORES, store_objects
from tests.helpers.documents import STATE, fresh, saved
from tests.helpers.faultproxy import Fault
from tests.helpers.metadata_view import readable_metadata


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


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_nonexistent_path_and_bucket(tmp_path, store):
    with pytest.raises(ckptio.CheckpointNotFoundError, match="does not exist"):
        ckptio.load(fresh(), str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckptio.CheckpointNotFoundError, match="'ckptio.json' is missing"):
        ckptio.load(fresh(), str(tmp_path / "empty"))
    base, options = store
    missing = f"{base.partition('://')[0]}://no-such-bucket-ckptio/x"
    with pytest.raises(ckptio.CheckpointNotFoundError, match="does not exist"):
        ckptio.load(fresh(), missing, storage_options=options)
    with pytest.raises(ckptio.StorageError, match="(bucket|container) 'no-such-bucket-ckptio' does not exist"):
        ckptio.save(STATE, missing, storage_options=options)
    assert store_objects(base, options) == {}


@pytest.mark.parametrize("store", STORES, indirect=True)
def test_permission_denied_names_the_object(store_proxy):
    proxy, base, options = store_proxy
    proxy.faults.append(Fault(lambda r: r.method == "GET", 403))
    with pytest.raises(ckptio.StorageError, match=r"access denied: \S+ .*ckptio.json.*credentials"):
        ckptio.load(fresh(), f"{base}/denied", storage_options=options)
    proxy.faults = [Fault(lambda r: r.method in ("PUT", "POST"), 403)]
    with pytest.raises(ckptio.StorageError, match=r"access denied: \S+ .*(\.ckio|precondition-probe).*credentials"):
        ckptio.save(
            STATE, f"{base}/denied", ckptio.WriterConfig(tuning=ckptio.Tuning(inline_limit=0)), storage_options=options
        )


def test_torch_dcp_checkpoint_is_recognised(tmp_path):
    url = str(tmp_path / "torch")
    dcp.save(STATE, storage_writer=dcp.FileSystemWriter(url))
    with pytest.raises(ckptio.NotCkptioCheckpointError, match="torch DCP checkpoint"):
        ckptio.load(fresh(), url)
