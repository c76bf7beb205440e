"""Portable training state: real FSDP2 / HSDP / FSDP2+TP models resharded across meshes, bit-exact."""

from __future__ import annotations

import pytest
import torch

from ckptio.tools.convert import to_torch_save
from tests.helpers import models
from tests.helpers.harness import spawn


@pytest.mark.slow
def test_fsdp2_hsdp_state_reshards_to_fsdp_hsdp_and_one_process(tmp_path):
    reference = str(tmp_path / "reference.pt")
    urls = [str(tmp_path / mode) for mode in ("all_ranks", "replica_group")]
    for url, mode in zip(urls, ("all_ranks", "replica_group"), strict=True):
        spawn(4, models.save_trained, "hsdp:2x2", url, mode, reference)
    assert spawn(2, models.load_into, ["fsdp:2"], urls, reference) == [[], []]
    assert spawn(8, models.load_into, ["hsdp:2x4", "fsdp:8"], urls, reference, timeout=400) == [[]] * 8
    assert spawn(0, models.load_into, ["single"], urls, reference) == [[]]

    converted = str(tmp_path / "plain.pt")
    to_torch_save(urls[1], converted)
    plain = torch.load(converted, weights_only=True)
    expected = torch.load(reference, weights_only=True)
    assert models.differences(expected["model"], plain["model"]) == []
    assert models.differences(expected["optim"]["state"], plain["optim"]["state"]) == []


@pytest.mark.slow
def test_fsdp2_tp_strided_state_reshards_exactly(tmp_path):
    reference = str(tmp_path / "reference.pt")
    url = str(tmp_path / "dp_tp")
    spawn(4, models.save_trained, "dp_tp:2x2", url, "all_ranks", reference)
    layouts = ["fsdp:4", "tp:4", "hsdp:2x2", "dp_tp:2x2"]
    assert spawn(4, models.load_into, layouts, [url], reference) == [[]] * 4
    assert spawn(0, models.load_into, ["single"], [url], reference) == [[]]
