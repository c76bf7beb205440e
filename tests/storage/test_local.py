"""The local POSIX store (``ckptio.storage.local``)."""

from __future__ import annotations

import os

import torch

import ckptio
from ckptio.tools.cli import main as cli_main
from tests.helpers.documents import load_error, saved_with_dcp


def test_a_fifo_in_place_of_a_data_file_is_refused_by_name(tmp_path):
    url = saved_with_dcp(tmp_path)
    (name,) = [n for n in os.listdir(url) if n.endswith(".ckio")]
    os.unlink(os.path.join(url, name))
    os.mkfifo(os.path.join(url, name))
    error = load_error(url, {"w": torch.zeros(70000), "blob": None, "cfg": {"lr": 0.0}})
    assert isinstance(error, ckptio.StorageError) and "not a regular file" in str(error) and name in str(error)
    assert cli_main(["verify", "-q", url]) == 1
