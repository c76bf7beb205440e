"""ckptio's errors (``ckptio.errors``): their classes, and what ``unwrap`` recovers through torch's wrapping."""

from __future__ import annotations
import json
import os
import re
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
import ckptio
from ckptio.format.names import METADATA_NAME
from ckptio.tools.cli import main as cli_main
from tests.helpers import scenarios
from tests.conftest import S3_SERVERS
from tests.helpers.faultproxy import Fault
from tests.helpers.harness import run_ranks, spawn
from tests.helpers.metadata_view import readable_metadata
import base64
import math
from typing import Any
from hypothesis import HealthCheck, given, settings
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from ckptio.loading.conversion import is_exact, is_rounding
from tests.conftest import S3_SERVERS, s3_client
from tests.helpers.harness import spawn
from tests.helpers.random_states import blank, differences, round_trip, states


def fresh():
    return {"w": torch.zeros(64, 1024), "b": torch.zeros(8), "meta": {"x": None}}


def test_errors_are_exceptions_not_base_exceptions(tmp_path):
    assert issubclass(ckptio.CheckpointError, Exception)
    with pytest.raises(Exception) as info:  # noqa: B017 - the point of the test: caught as an Exception
        ckptio.load(fresh(), str(tmp_path / "missing"))
    assert isinstance(info.value, ckptio.CheckpointNotFoundError)


# --- item 5: unwrap takes whatever a handler caught ---------------------------------------------------
def test_unwrap_returns_ckptio_errors_unchanged_and_wraps_anything_else(tmp_path):
    with pytest.raises(ckptio.CheckpointError) as info:
        ckptio.load({"w": torch.zeros(1)}, str(tmp_path / "nothing-here"))
    assert ckptio.unwrap(info.value) is info.value
    other = ValueError("boom")
    wrapped = ckptio.unwrap(other)
    assert isinstance(wrapped, ckptio.CheckpointError) and "boom" in str(wrapped) and wrapped.__cause__ is other
