"""``ckptio.gc_pause``: the collector paused around metadata work, restored as it was."""

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


def test_paused_gc_restores_the_collector_as_it_was():
    import gc

    from ckptio.gc_pause import paused_gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()
