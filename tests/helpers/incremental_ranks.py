"""Rank bodies for incremental saves: a state whose parts change as real ones do between two saves (a
frozen base model with trainable adapters, a sparse embedding table of which a few rows change, a step
counter, an object), saved as a chain of steps with ``incremental_from="previous"`` and loaded back on
any mesh, every value compared with the state of that step."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptio
from tests.helpers.fragment_ranks import wrong_keys

#: key -> (shape, dtype, what changes between steps)
SHAPES = {
    "model.base": ((96, 64), torch.bfloat16, "frozen"),
    "model.lora_a": ((8, 64), torch.float32, "all"),
    "emb": ((128, 16), torch.float32, "rows"),
}


def full(step: int, seed: int = 5) -> dict[str, torch.Tensor]:
    """Every tensor's value at ``step``: frozen ones never change, ``all`` ones every step, and of ``rows``
    ones two rows per step."""
    out = {}
    for key, (shape, dtype, changes) in SHAPES.items():
        g = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
        value = torch.randn(shape, generator=g)
        if changes == "all":
            value = value + step
        elif changes == "rows":
            for s in range(1, step + 1):
                value[(s * 37) % shape[0]] += s
                value[(s * 91) % shape[0]] -= s
        out[key] = value.to(dtype)
    return out


def state(mesh_shape: list[int], placements: dict[str, list[tuple]], step: int, zeros: bool = False) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    out: dict[str, Any] = {}
    for key, value in full(step).items():
        value = torch.zeros_like(value) if zeros else value
        spec = [Shard(p[1]) if p[0] == "S" else Replicate() for p in placements[key]]
        out[key] = distribute_tensor(value, mesh, spec, src_data_rank=None)
    out["optim.step"] = torch.tensor(0 if zeros else step)
    out["meta"] = {"step": -1 if zeros else step}
    return out


def save_chain(run: str, case: dict[str, Any], steps: list[int]) -> list[list[str]]:
    """Save ``steps`` in turn as ``run/step-N`` (the second through ``dcp.async_save``); the names of the
    files each step's folder holds right after it was saved. ``case["steps"][N]`` overrides the case's
    settings for step N (``mode``, ``use_collectives``, ...)."""
    options = case.get("storage_options")
    listed = []
    for i, step in enumerate(steps):
        this = {**case, **case.get("steps", {}).get(step, {})}
        config = ckptio.WriterConfig(
            compression=this.get("compression"),
            incremental_from="previous",
            mode=this.get("mode", "all_ranks"),
            # requests cost nothing: every unchanged run of a small table is referenced
            storage_config=ckptio.StorageConfig(read_gap_bytes=0),
            tuning=ckptio.Tuning(
                max_block_size=this.get("max_block_size", 1024),
                incremental_max_depth=this.get("max_depth", 8),
                inline_limit=this.get("inline_limit", 64 << 10),
            ),
        )
        url = f"{run}/step-{step}"
        values = state(case["save_mesh"], case["save_placements"], step)
        writer = ckptio.Writer(url, config, storage_options=options)
        alone = {} if this.get("use_collectives", True) else {"use_collectives": False}  # no coordinator
        if i == 1:
            dcp.async_save(values, storage_writer=writer, **alone).result()
        else:
            dcp.save(values, storage_writer=writer, **alone)
        if alone:
            ckptio.wait_for_uploads()  # rank 0's merge of the fragments: the listing shows its ckptio.json
            dist.barrier()
        listed.append(sorted(ckptio.storage.open_store(url, options).list_sizes() or {}))
    return listed


def load_steps(run: str, case: dict[str, Any], steps: list[int], through: str = "dcp") -> dict[int, list[str]]:
    """Load each of ``steps`` into a zeroed state of the load layout; the keys that came back wrong."""
    options = case.get("storage_options")
    wrong = {}
    for step in steps:
        url = f"{run}/step-{step}"
        target = state(case["load_mesh"], case["load_placements"], step, zeros=True)
        if through == "dcp":
            dcp.load(target, storage_reader=ckptio.Reader(url, storage_options=options))
        else:
            ckptio.load(target, url, storage_options=options)
        wrong[step] = wrong_keys(target, state(case["load_mesh"], case["load_placements"], step))
    if dist.is_initialized():
        dist.barrier()
    return wrong
