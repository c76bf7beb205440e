"""Checkpoint ids and URLs (``ckptio.storage.location``)."""

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


def test_checkpoint_ids_fsspec_cannot_open_are_not_claimed():
    for good in ("/tmp/x", "s3://bucket/key", "memory://x", "file:///tmp/x"):
        assert ckptio.Writer.validate_checkpoint_id(good) and ckptio.Reader.validate_checkpoint_id(good)
    for bad in ("nosuchproto://bucket/x", ""):
        assert not ckptio.Writer.validate_checkpoint_id(bad) and not ckptio.Reader.validate_checkpoint_id(bad)
