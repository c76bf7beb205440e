"""Safe loading (``ckptio.loading.safe_load``): no code runs from a checkpoint's objects."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

import ckptio


class RunsCode:
    """A pickle that executes code when loaded unsafely."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def test_safe_loading_refuses_code_in_objects(tmp_path):
    marker = str(tmp_path / "pwned")
    url = str(tmp_path / "evil")
    dcp.save({"w": torch.ones(4), "payload": RunsCode(marker)}, storage_writer=ckptio.Writer(url))
    with pytest.raises(ckptio.UnsafeObjectError, match=r"key 'payload'.*(exec|builtins)"):
        ckptio.load({"w": torch.zeros(4), "payload": None}, url)
    assert not os.path.exists(marker)
    with pytest.raises(CheckpointException) as raw:  # plain dcp.load wraps it in torch's BaseException
        dcp.load(
            {"w": torch.zeros(4), "payload": None}, storage_reader=ckptio.Reader(url), planner=ckptio.SafeLoadPlanner()
        )
    assert isinstance(ckptio.unwrap(raw.value), ckptio.UnsafeObjectError)
    assert not os.path.exists(marker)
    # torch's default planner would run it: the danger the safe planner removes
    dcp.load({"w": torch.zeros(4), "payload": None}, storage_reader=ckptio.Reader(url), planner=DefaultLoadPlanner())
    assert open(marker).read() == "pwned"
