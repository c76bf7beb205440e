"""Per-rank state is never collapsed or dropped; wrapper prefixes never reach the checkpoint."""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

import ckptio
from tests.helpers import training_state
from tests.helpers.harness import spawn
from tests.helpers.metadata_view import readable_metadata


def test_per_rank_objects_are_detected_kept_or_resized_explicitly(tmp_path):
    base = str(tmp_path)
    saved = spawn(2, training_state.save_all, base)
    for rank_seen in saved:
        for how in ("ckptio.save", "dcp.save"):
            message = rank_seen[how]
            assert "'dataloader.position'" in message and "ranks [0]" in message and "ranks [1]" in message, message
    assert not os.path.exists(os.path.join(base, "collapsed", "ckptio.json"))
    assert saved[0]["ddp_keys"] == ["model.0.bias", "model.0.weight", "model.1.bias", "model.1.weight"]

    same = spawn(2, training_state.load_all, base)
    for rank, got in enumerate(same):
        assert got["kept"] == 100 + rank and got["error"] == {"position": 100 + rank} and got["ddp_into_plain"]

    more = spawn(4, training_state.load_all, base)
    for got in more:
        assert "saved with one value per rank by 2 ranks; this load runs on 4" in got["kept"], got
        assert "saved by 2 data-parallel ranks, but this job has 4" in got["error"], got
        assert got["skip"] == {"position": -1}
        assert got["spread"] == {"position": 101, "from": 2}

    (fewer,) = spawn(0, training_state.load_all, base)
    assert "saved by 2 data-parallel ranks, but this job has 1" in fewer["error"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(6, 6)  # the user's own name: must survive untouched
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(self.module(x))


def _ac(model):
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


VARIANTS = {
    "plain": lambda m: m,
    "compiled": lambda m: torch.compile(m),
    "checkpointed": _ac,
    "compiled(checkpointed)": lambda m: torch.compile(_ac(m)),
    "checkpointed(compiled)": lambda m: _ac(torch.compile(m)),
}
NAMES = {
    "module.weight",
    "module.bias",
    "blocks.0.lin.weight",
    "blocks.0.lin.bias",
    "blocks.1.lin.weight",
    "blocks.1.lin.bias",
}
CANONICAL = {f"model.{n}" for n in NAMES} | {f"params.{n}" for n in NAMES} | {"step"}


def _state(model, step) -> dict:
    # state_dict() hides activation checkpointing's segment, named_parameters() does not
    return {"model": model.state_dict(), "params": {n: p.detach() for n, p in model.named_parameters()}, "step": step}


def _build(variant: str, seed: int):
    torch.manual_seed(seed)
    return VARIANTS[variant](Model())


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_compile_and_checkpoint_wrappers_never_reach_the_keys(tmp_path):
    assert any("_orig_mod" in k for k in _build("compiled", 0).state_dict())
    assert any("_checkpoint_wrapped_module" in n for n, _ in _build("compiled(checkpointed)", 0).named_parameters())
    for i, src in enumerate(VARIANTS):
        model = _build(src, seed=i)
        state = _state(model, 7)
        before = {k: list(v) if isinstance(v, dict) else v for k, v in state.items()}
        url = str(tmp_path / f"from-{i}")
        ckptio.save(state, url)
        assert {k: list(v) if isinstance(v, dict) else v for k, v in state.items()} == before  # not mutated
        assert set(readable_metadata(url)["state"]) == CANONICAL
        for j, dst in enumerate(VARIANTS):
            target = _build(dst, seed=100 + j)
            loaded = _state(target, 0)
            ckptio.load(loaded, url)
            assert loaded["step"] == 7
            assert all(torch.equal(a, b) for a, b in zip(_weights(target), _weights(model), strict=True)), (src, dst)


def test_three_generations_keep_an_identical_key_set(tmp_path):
    order = ["compiled(checkpointed)", "plain", "checkpointed(compiled)", "compiled"]
    model = _build(order[0], seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    reference = _weights(model)
    keysets = []
    for gen in range(3):
        url = str(tmp_path / f"gen{gen}")
        state = _state(model, gen)
        snapshot = copy.copy(state["model"])
        ckptio.save(state, url)
        assert list(state["model"]) == list(snapshot)
        keysets.append(set(readable_metadata(url)["state"]))
        model = _build(order[gen + 1], seed=50 + gen)
        resumed = _state(model, None)
        ckptio.load(resumed, url)
        assert resumed["step"] == gen
        assert all(torch.equal(a, b) for a, b in zip(_weights(model), reference, strict=True))
    assert keysets[0] == keysets[1] == keysets[2] == CANONICAL
