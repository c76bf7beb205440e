"""Host memory a load holds."""

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
