"""Rank bodies for the resharding property: a state of DTensors saved on one mesh and placement, loaded
on another (any world size), every local shard compared with the reference cut of the full tensor.
Cases are plain data (drawn by hypothesis in the test process): see ``tests/test_reshard_ranks.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptio


def _placements(spec: list[tuple]) -> list:
    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in spec]


def full_tensors(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"])
    out = {}
    for k, (shape, dtype) in enumerate(case["tensors"]):
        dtype = getattr(torch, dtype)
        values = torch.randn(shape, generator=g) * 100
        out[f"t{k}"] = values.to(dtype) if dtype.is_floating_point else values.to(torch.int64).to(dtype)
    return out


def _distributed(case: dict[str, Any], side: str, zeros: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", tuple(case[f"{side}_mesh"]))
    state: dict[str, Any] = {}
    for (key, full), spec in zip(full_tensors(case).items(), case[f"{side}_placements"], strict=True):
        # every rank holds the full tensor: no broadcast (gloo has none for bf16)
        value = torch.zeros_like(full) if zeros else full
        state[key] = distribute_tensor(value, mesh, _placements(spec), src_data_rank=None)
    state["step"] = case["seed"]
    return state


def save(case: dict[str, Any], url: str) -> None:
    config = ckptio.WriterConfig(
        mode=case["mode"],
        compression=case["compression"],
        tuning=ckptio.Tuning(max_block_size=case["max_block_size"]),
        key_prefix=case.get("key_prefix"),
    )
    writer = ckptio.Writer(url, config, storage_options=case.get("storage_options"))
    dcp.save(
        _distributed(case, "save", zeros=False), storage_writer=writer, use_collectives=case.get("collectives", True)
    )


def load_and_compare(case: dict[str, Any], url: str) -> list[str]:
    """Load into zeroed DTensors of the load layout; the keys whose local shard is not exactly the
    reference's (``distribute_tensor`` of the full tensor on the same layout)."""
    target = _distributed(case, "load", zeros=True)
    target["step"] = -1
    reader = ckptio.Reader(url, storage_options=case.get("storage_options"), dedup_reads=case["dedup_reads"])
    dcp.load(target, storage_reader=reader)
    reference = _distributed(case, "load", zeros=False)
    wrong = [k for k in reference if k != "step" and not torch.equal(target[k].to_local(), reference[k].to_local())]
    return wrong + ([] if target["step"] == case["seed"] else ["step"])


def save_own_tensor(url: str, storage_options: dict, key_prefix: str | None, mib: int) -> None:
    """Each rank saves a tensor of its own (``mib`` MiB under its own key) in parts of 5 MiB."""
    rank = torch.distributed.get_rank()
    state = {f"rank{rank}": torch.full(((mib << 20) // 4,), float(rank))}
    config = ckptio.WriterConfig(storage_config=ckptio.StorageConfig(part_size=5 << 20), key_prefix=key_prefix)
    dcp.save(state, storage_writer=ckptio.Writer(url, config, storage_options=storage_options))
    loaded = {f"rank{rank}": torch.zeros_like(state[f"rank{rank}"])}
    dcp.load(loaded, storage_reader=ckptio.Reader(url, storage_options=storage_options))
    assert torch.equal(loaded[f"rank{rank}"], state[f"rank{rank}"])
