"""What ``pip install`` puts on a machine."""

from __future__ import annotations
import json
import os
import subprocess
import sys
import zipfile
import pytest
import torch
import torch.distributed.checkpoint as dcp
import ckptio
from ckptio.config import MAX_REQUEST_BYTES
from ckptio.format.names import parse_data_file_name
from ckptio.format.records import Header, MeshRecord, SavedConfig
from ckptio.loading.ranges import ReadPiece, plan_requests
from ckptio.tools.cli import main as cli_main
from tests.conftest import S3_SERVERS


def test_the_benchmark_installs_as_ckptio_bench_and_nothing_named_benchmarks(tmp_path):
    root = os.path.dirname(os.path.dirname(__file__))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), root],
        check=True,
        capture_output=True,
    )
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    assert "ckptio/bench/__main__.py" in names and "ckptio/bench/workload.py" in names
    assert not [n for n in names if n.startswith("benchmarks/")]
    assert not [n for n in names if n.startswith("tests/")]
