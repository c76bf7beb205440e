"""What ``pip install`` puts on a machine."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile


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
