"""A rank's data file (``ckptio.saving.data_file``): the bytes of every kind of tensor view."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

import ckptio


def test_conjugate_and_negative_bit_views_save_their_values(tmp_path):
    z = torch.randn(50, dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": z.conj().imag}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptio.Writer(url))
    out = {"conj": torch.zeros(50, dtype=torch.complex64), "neg": torch.zeros(50)}
    dcp.load(out, storage_reader=ckptio.Reader(url))
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and torch.equal(out["neg"], -z.imag)
