"""A drain slower than the saves (``tiers/lag.py``): said once per run with its rates, and the queue bounded
by ``drain_max_queued_saves`` (a save waits for the oldest upload), every save uploaded and loadable."""

from __future__ import annotations

import logging

import torch
import torch.distributed.checkpoint as dcp

import ckptio
from ckptio.tiers.drain import drain_queue

MiB = 1 << 20


def _state(step: int) -> dict:
    return {"w": torch.randn(MiB // 4, generator=torch.Generator().manual_seed(step)), "step": step}


def test_a_lagging_drain_is_said_once_and_bounded_and_every_save_lands(tmp_path, caplog):
    run, fast = tmp_path / "durable" / "run", tmp_path / "fast"
    tuning = ckptio.Tuning(drain_max_queued_saves=4)
    config = ckptio.WriterConfig(local_tier=str(fast), drain_bandwidth=2 * MiB, tuning=tuning)
    behind = []
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        for step in range(1, 9):  # 1 MiB each, at 2 MiB/s: saves come far faster than that
            dcp.save(_state(step), storage_writer=ckptio.Writer(str(run / f"step-{step}"), config))
            behind.append(len(drain_queue().backlog()[0]))
        ckptio.wait_for_uploads()
    assert max(behind) <= 4 and behind[-1] == 4, behind  # it reached the bound and never passed it
    said = [r.getMessage() for r in caplog.records if "lag behind the saves" in r.getMessage()]
    assert len(said) == 1, said
    assert "MiB/s" in said[0] and "drain_bandwidth=2097152" in said[0] and "a save comes every" in said[0]
    for step in range(1, 9):
        value = {"w": torch.zeros(MiB // 4), "step": -1}
        dcp.load(value, storage_reader=ckptio.Reader(str(run / f"step-{step}")))
        assert value["step"] == step and torch.equal(value["w"], _state(step)["w"])
