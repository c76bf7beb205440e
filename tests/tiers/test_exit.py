"""Issue 65, finding 1: a process whose script ends while its drain (or its copies to partner nodes) runs
exits within the uploads' own time plus ``process_exit.EXIT_STALL_S``, having committed the durable copy, or
leaving a state the next ``ckptio.latest`` resumes. Real interpreter exits: each rank is a subprocess whose
script just ends (``tests/helpers/exiting.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.process_exit import EXIT_STALL_S
from tests.conftest import s3_objects
from tests.helpers.exiting import ELEMENTS, TENSORS, state_of
from tests.helpers.faultproxy import Fault
from tests.helpers.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: What a process may take beyond its uploads' time and the stall bound: starting Python and torch,
#: joining the group, the save itself (a loaded 2-core machine).
SLACK_S = 25.0


def _run_ranks(spec: dict, world: int = 1, nodes: int = 1, limit_s: float = 120.0) -> list[tuple[float, int]]:
    """Run the script on ``world`` ranks over ``nodes`` simulated nodes: each rank's seconds from ``saved`` to
    its exit, and its exit status. A rank still alive after ``limit_s`` fails the test."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_PORT": str(port),
            "CKPTIO_NODE": f"node-{rank * nodes // world}",
            "PYTHONPATH": ROOT,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        env.pop("CKPTIO_LOCAL_TIER", None)
        command = [sys.executable, "-m", "tests.helpers.exiting", json.dumps(spec)]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    end = time.monotonic() + limit_s
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {rank} was still alive {limit_s:.0f} s after it started")
        exited = time.time()
        saved = [float(line.split()[1]) for line in out.splitlines() if line.startswith("saved ")]
        assert saved, f"rank {rank} never finished its save (exit status {proc.returncode})"
        results.append((exited - saved[0], proc.returncode))
    return results


def _spec(url: str, tmp_path, endpoint: str, **extra) -> dict:
    """The script's spec (``tests/helpers/exiting.py``): save ``url`` tiered through ``endpoint``."""
    return {"url": url, "tier": str(tmp_path / "fast"), "endpoint": endpoint, **extra}


def _loads_exactly(url: str, options: dict, step: int = 1) -> None:
    state = {f"w{i}": torch.zeros(ELEMENTS) for i in range(TENSORS)} | {"step": 0}
    dcp.load(state, storage_reader=ckptio.Reader(url, storage_options=options))
    want = state_of(step)
    assert all(torch.equal(state[k], want[k]) for k in want if k != "step") and state["step"] == step


def test_a_script_that_ends_during_its_drain_exits_once_the_upload_commits(s3, tmp_path):
    base, options = s3
    url = f"{base}/run/step-1"
    bandwidth = 512 << 10  # 1 MiB of tensors: ~2 s of upload
    [(seconds, status)] = _run_ranks(
        _spec(url, tmp_path, options["client_kwargs"]["endpoint_url"], bandwidth=bandwidth)
    )
    upload_s = TENSORS * ELEMENTS * 4 / bandwidth
    assert status == 0 and seconds < upload_s + EXIT_STALL_S, seconds
    assert "run/step-1/ckptio.json" in s3_objects(options, f"{base}/run/")
    _loads_exactly(url, options)


@pytest.mark.slow
def test_ranks_with_copies_on_partner_nodes_exit_after_two_async_saves(s3, tmp_path):
    """Two ``dcp.async_save``s, ``local_tier_copies=2``, 2 ranks on 2 nodes: both exit, both steps commit."""
    base, options = s3
    endpoint = options["client_kwargs"]["endpoint_url"]
    spec = _spec(f"{base}/run/step-1", tmp_path, endpoint, bandwidth=512 << 10, copies=2, async_saves=True)
    results = _run_ranks(spec, world=2, nodes=2)
    assert all(status == 0 and seconds < 2 * 2 + EXIT_STALL_S + SLACK_S for seconds, status in results), results
    _loads_exactly(f"{base}/run/step-1", options, 1)
    _loads_exactly(f"{base}/run/step-1-2", options, 2)


def test_a_script_that_dies_of_an_exception_during_its_drain_still_exits(s3, tmp_path):
    base, options = s3
    spec = _spec(f"{base}/run/step-1", tmp_path, options["client_kwargs"]["endpoint_url"], bandwidth=1 << 20)
    spec["raise"] = True
    [(seconds, status)] = _run_ranks(spec)
    assert status == 1 and seconds < 1 + EXIT_STALL_S, seconds
    _loads_exactly(f"{base}/run/step-1", options)  # the drain committed before the process ended


def test_a_drain_that_cannot_reach_the_store_ends_with_the_process_and_the_next_start_resumes_it(s3_proxy, tmp_path):
    """S3 answers 503 to every upload: the process stops waiting ``EXIT_STALL_S`` after its last progress
    (it used to retry toward ``drain_timeout_s``, an hour, into an interpreter that could no longer send),
    and ``ckptio.latest`` on the next start finishes the drain."""
    proxy, base, options = s3_proxy
    proxy.faults[:] = [Fault(lambda r: r.method == "PUT", 503)]
    stall_s = 2.0  # the bound, shortened: this test waits for it
    spec = _spec(f"{base}/run/step-1", tmp_path, proxy.url, stall_s=stall_s)
    [(seconds, status)] = _run_ranks(spec)
    assert status == 0 and stall_s < seconds < stall_s + SLACK_S, seconds
    assert "run/step-1/ckptio.json" not in s3_objects(options, f"{base}/run/")
    proxy.faults.clear()
    assert ckptio.latest(f"{base}/run", local_tier=str(tmp_path / "fast"), storage_options=options).endswith("step-1")
    ckptio.wait_for_uploads()
    _loads_exactly(f"{base}/run/step-1", options)
