"""The local POSIX store (``ckptio.storage.local``)."""

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
from ckptio.format.names import METADATA_NAME
from ckptio.format.v1 import pack_counts, unpack_counts
from ckptio.tools.cli import main as cli_main
from tests.helpers import findings
from tests.conftest import S3_SERVERS, s3_client
from tests.helpers.faultproxy import Fault
from tests.helpers.harness import spawn
from tests.helpers.metadata_view import readable_metadata


def _load_error(url: str, state: dict) -> ckptio.CheckpointError:
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=ckptio.Reader(url))
    return ckptio.unwrap(info.value)


# --- hostile or garbage metadata ------------------------------------------------------------------
def _saved(tmp_path, name: str = "ckpt") -> str:
    url = str(tmp_path / name)
    state = {"w": torch.arange(70000.0), "blob": b"x" * 100, "cfg": {"lr": 0.1}}
    dcp.save(state, storage_writer=ckptio.Writer(url))
    return url


def test_a_fifo_in_place_of_a_data_file_is_refused_by_name(tmp_path):
    url = _saved(tmp_path)
    (name,) = [n for n in os.listdir(url) if n.endswith(".ckio")]
    os.unlink(os.path.join(url, name))
    os.mkfifo(os.path.join(url, name))
    error = _load_error(url, {"w": torch.zeros(70000), "blob": None, "cfg": {"lr": 0.0}})
    assert isinstance(error, ckptio.StorageError) and "not a regular file" in str(error) and name in str(error)
    assert cli_main(["verify", "-q", url]) == 1
