"""Hugging Face safetensors weights for the HFReader tests: reference files written by the
``safetensors`` library, and the per-rank bodies that load them into a parallel layout."""

from __future__ import annotations

import json
import os

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

import ckptio
from tests.helpers import llama

FILE_SEED, MODEL_SEED = 1, 99  # the files' values, and the different values a model starts with


def reference_weights(seed: int = FILE_SEED) -> dict[str, torch.Tensor]:
    """The tiny Llama's weights under their Hugging Face names, bf16."""
    return {k: v.detach().clone() for k, v in llama.build("single", seed=seed).state_dict().items()}


def write_reference(url: str, weights: dict[str, torch.Tensor], shards: int = 2, storage_options=None) -> dict:
    """Write ``weights`` as ``shards`` files plus ``model.safetensors.index.json``, the way
    ``save_pretrained`` lays them out, with the reference ``safetensors`` writer; returns file sizes."""
    from safetensors.torch import save

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    names = sorted(weights)
    groups = [names[i::shards] for i in range(shards)]
    weight_map, sizes = {}, {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        data = save({k: weights[k].contiguous() for k in group}, metadata={"format": "pt"})
        fs.pipe_file(f"{root}/{file}", data)
        sizes[file] = len(data)
        weight_map |= {k: file for k in group}
    total = sum(v.numel() * v.element_size() for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    fs.pipe_file(f"{root}/model.safetensors.index.json", json.dumps(index).encode())
    return sizes


def _full(model) -> dict | None:
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return full if not dist.is_initialized() or dist.get_rank() == 0 else None


def needed_bytes(state: dict, file_itemsize: int = 2) -> int:
    """Bytes of the file this rank's share of ``state`` covers (its local shards)."""
    total = 0
    for value in state.values():
        local = value.to_local() if isinstance(value, DTensor) else value
        total += local.numel() * file_itemsize
    return total


def load_layout(layout: str, url: str, storage_options=None, dtype=torch.bfloat16, reader: dict | None = None):
    """``ckptio.load`` of the files into a state from ``get_state_dict(model, optimizer)`` (AdamW,
    one step taken) plus a step counter: the model part comes from the files, the optimizer state
    and the step must stay exactly as they were. Returns (full model state on rank 0, the bytes
    this rank needed)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = llama.build(layout, dtype, seed=MODEL_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    before = _local_tensors(osd)
    state = {"model": msd, "optim": osd, "step": torch.tensor(5)}
    needed = needed_bytes(state["model"])
    hf = ckptio.HFReader(url, key_map="model.", storage_options=storage_options, **(reader or {}))
    ckptio.load(state, hf)
    after = _local_tensors(state["optim"])
    assert int(state["step"]) == 5 and before and after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)  # the optimizer state is untouched
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full(model), needed


def _local_tensors(state: dict, path: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        name = f"{path}.{key}"
        if isinstance(value, dict):
            out |= _local_tensors(value, name)
        elif isinstance(value, torch.Tensor):
            out[name] = (value.to_local() if isinstance(value, DTensor) else value).clone()
    return out


def load_plain(layout: str, url: str, storage_options=None):
    """Plain ``dcp.load`` of the files into a model's state (Hugging Face names already)."""
    model = llama.build(layout, seed=MODEL_SEED)
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=ckptio.HFReader(url, storage_options=storage_options))
    set_model_state_dict(model, state)
    return _full(model)


def exported_from(layout: str, checkpoint: str, out: str, out_options=None) -> dict | None:
    """Save the model under ``layout`` with ckptio, export it to safetensors; its full state on rank 0."""
    full = llama.save(layout, checkpoint)
    ckptio.export_safetensors(checkpoint, out, keys="model.", output_storage_options=out_options)
    return full


def file_names(url: str, storage_options=None) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return sorted(os.path.basename(p) for p in fs.ls(root, detail=False))


def load_where_rank_1_matches_nothing(url: str) -> str:
    """Rank 1's state holds no key of the files: every rank must fail, none wait alone."""
    weights = reference_weights()
    if dist.get_rank() == 0:
        state = {k: torch.zeros_like(v) for k, v in weights.items()}
    else:
        state = {"optimizer": {"lr": torch.tensor(0.1)}}
    try:
        ckptio.load(state, ckptio.HFReader(url))
    except ckptio.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"
