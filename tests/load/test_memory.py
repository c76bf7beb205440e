"""Host memory a load holds."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from tests.helpers.harness import spawn


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
