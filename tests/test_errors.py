"""ckptio's errors (``ckptio.errors``): their classes, and what ``unwrap`` recovers through torch's wrapping."""

from __future__ import annotations

import pytest
import torch

import ckptio
from tests.helpers.documents import fresh


def test_errors_are_exceptions_not_base_exceptions(tmp_path):
    assert issubclass(ckptio.CheckpointError, Exception)
    with pytest.raises(Exception) as info:  # noqa: B017 - the point of the test: caught as an Exception
        ckptio.load(fresh(), str(tmp_path / "missing"))
    assert isinstance(info.value, ckptio.CheckpointNotFoundError)


def test_unwrap_returns_ckptio_errors_unchanged_and_wraps_anything_else(tmp_path):
    with pytest.raises(ckptio.CheckpointError) as info:
        ckptio.load({"w": torch.zeros(1)}, str(tmp_path / "nothing-here"))
    assert ckptio.unwrap(info.value) is info.value
    other = ValueError("boom")
    wrapped = ckptio.unwrap(other)
    assert isinstance(wrapped, ckptio.CheckpointError) and "boom" in str(wrapped) and wrapped.__cause__ is other
