"""A rank's data file (``ckptio.saving.data_file``): the bytes of every kind of tensor view."""

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


def test_conjugate_and_negative_bit_views_save_their_values(tmp_path):
    z = torch.randn(50, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": z.conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url))
    out = {"conj": torch.zeros(50, dtype=torch.complex64), "neg": torch.zeros(50)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and torch.equal(out["neg"], -z.imag)
