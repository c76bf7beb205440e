"""State keys (``ckptio.state.keys``): wrapper prefixes never reach a checkpoint."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

import ckptio
from tests.helpers.documents import read_doc


# --- drop-in compatibility with torch's writers -------------------------------------------------
def test_compiled_model_keys_round_trip_through_plain_dcp(tmp_path):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    url = str(tmp_path / "from-compiled")
    dcp.save(compiled.state_dict(), storage_writer=ckptio.Writer(url))
    assert sorted(read_doc(url)["state"]) == sorted(plain.state_dict())
    target = plain.state_dict()
    dcp.load(target, storage_reader=ckptio.Reader(url))
    for key, value in compiled.state_dict().items():
        assert torch.equal(target[key.removeprefix("_orig_mod.")], value)
    url = str(tmp_path / "from-plain")
    dcp.save(plain.state_dict(), storage_writer=ckptio.Writer(url))
    again = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)))
    target = again.state_dict()
    dcp.load(target, storage_reader=ckptio.Reader(url))
    for key, value in plain.state_dict().items():
        assert torch.equal(target["_orig_mod." + key], value)
