"""``dcp.async_save`` with ckptio (``ckptio.saving.staging``, ``ordering``): executors, ordering, reused
staging buffers."""

from __future__ import annotations

import pytest
import torch

import ckptio
from tests.helpers import findings
from tests.helpers.harness import spawn


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_with_both_executors(tmp_path, executor):
    assert spawn(2, findings.async_saves, str(tmp_path), executor) == [[], []]


@pytest.mark.protocol
@pytest.mark.parametrize("stager", [0, 1, 2], ids=["torch-stager", "ckptio-stager-1", "ckptio-stager-2"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_saves_in_flight_together_run_one_after_the_other(tmp_path, executor, stager):
    # Not awaited before the next starts; torch alone runs the thread executor's saves at once and hangs.
    # With ckptio.Stager the buffers are reused: a save must not see the next one's values.
    assert spawn(2, findings.async_saves, str(tmp_path), executor, True, stager, timeout=180) == [[], []]


@pytest.mark.protocol
@pytest.mark.parametrize("plain", [False, True], ids=["ckptio-stager", "writer-staging"])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_stager_restages_when_the_state_layout_changes(tmp_path, executor, plain):
    assert spawn(2, findings.stager_across_layout_changes, str(tmp_path), executor, plain, timeout=180) == [[], []]


@pytest.mark.protocol
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_plain_async_save_stages_into_reused_buffers(tmp_path, executor):
    # Values at call time, a failed background save followed by a good one, and one set of
    # staging buffers for saves awaited one by one.
    assert spawn(2, findings.plain_async_saves, str(tmp_path), executor, timeout=180) == [([], 1), ([], 1)]


@pytest.mark.timeout(120)
def test_a_writer_made_but_never_used_does_not_hold_up_later_saves(tmp_path, monkeypatch):
    from ckptio.saving import ordering

    monkeypatch.setattr(ordering, "START_WAIT_S", 1e6)  # a wait for the unused Writer would hang
    unused = ckptio.Writer(str(tmp_path / "never"))
    del unused
    ckptio.save({"w": torch.ones(4)}, str(tmp_path / "saved"))
    out = {"w": torch.zeros(4)}
    ckptio.load(out, str(tmp_path / "saved"))
    assert torch.equal(out["w"], torch.ones(4))
