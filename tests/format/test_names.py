"""The format's names (``ckptio.format.names``)."""

from __future__ import annotations
import json
import math
import os
import pytest
import torch
import ckptio
from ckptio import CheckpointFormatError, WriterConfig
from ckptio.config import MiB
from ckptio.format.codec import BlockEncoder, block_size_for, checksum, decode_block
from ckptio.format.names import FORMAT_VERSION, data_file_name, is_data_file_name
from ckptio.format.v1 import pack_counts
from ckptio.format.versions import decode_metadata
from ckptio.loading.ranges import ReadPiece, blocks_for_runs, box_runs, plan_requests


def test_data_file_names():
    assert is_data_file_name(data_file_name("0123456789abcdef", 12)) and not is_data_file_name("x.ckio")
    from ckptio.format.names import parse_data_file_names

    names = [data_file_name("0123456789abcdef", 7), data_file_name("fedcba9876543210", 100000)]
    assert parse_data_file_names(names) == (["0123456789abcdef", "fedcba9876543210"], [7, 100000])
    assert parse_data_file_names([]) == ([], [])
    for bad in ("x.ckio", names[0] + "\n", names[0] + "\n" + names[1], "/" + names[0]):
        with pytest.raises(ValueError, match="not a ckptio data file name"):
            parse_data_file_names([names[1], bad])  # each name whole: none hides in a joined line
