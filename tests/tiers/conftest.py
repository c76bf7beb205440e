"""What every tiered test leaves behind in this process: no drain still running into the next test."""

from __future__ import annotations

import pytest

import ckptio


@pytest.fixture(autouse=True)
def _no_leftover_drains():
    yield
    try:
        ckptio.wait_for_uploads(timeout=60)
    except ckptio.DrainError:
        pass
