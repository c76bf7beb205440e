"""Rank bodies for the ShardedTensor property: torch's legacy ``ShardedTensor`` (what FSDP1's
SHARDED_STATE_DICT and older training code save), whose ``EnumerableShardingSpec`` lets a rank hold
several pieces of one tensor, not next to each other, or none; saved and loaded as a sharded tensor or
as a plain tensor every rank holds whole. Cases are plain data drawn in the test process: see
``tests/load/test_sharded_tensor_layouts.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

import ckptio
from tests.helpers import reshard_ranks


def full_tensors(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each tensor's full value: the DTensor property's (``reshard_ranks.full_tensors``) for its shape and dtype."""
    tensors = [(tensor["shape"], tensor["dtype"]) for tensor in case["tensors"]]
    return reshard_ranks.full_tensors({"tensors": tensors, "seed": case["seed"]})


def _spec(shape: list[int], layout: dict[str, Any]) -> EnumerableShardingSpec:
    """Pieces ``(start, length, rank)`` along ``layout["dim"]``, each whole along the other dimensions."""
    shards = []
    for start, length, rank in layout["pieces"]:
        offsets, sizes = [0] * len(shape), list(shape)
        offsets[layout["dim"]], sizes[layout["dim"]] = start, length
        shards.append(ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{rank}"))
    return EnumerableShardingSpec(shards=shards)


def _cut(full: torch.Tensor, shard: Any) -> torch.Tensor:
    """The part of ``full`` a local shard holds."""
    meta = shard.metadata
    return full[tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes, strict=True))]


def _value(full: torch.Tensor, layout: dict[str, Any], zeros: bool) -> Any:
    if layout["kind"] == "plain":
        return torch.zeros_like(full) if zeros else full.clone()
    value = sharded_tensor.zeros(_spec(list(full.shape), layout), *full.shape, dtype=full.dtype)
    if not zeros:
        for shard in value.local_shards():
            shard.tensor.copy_(_cut(full, shard))
    return value


def _state(case: dict[str, Any], side: str, zeros: bool) -> dict[str, Any]:
    fulls = full_tensors(case)
    return {key: _value(full, t[side], zeros) for (key, full), t in zip(fulls.items(), case["tensors"], strict=True)}


def save(case: dict[str, Any], url: str) -> None:
    config = ckptio.WriterConfig(
        mode=case["mode"], compression=case["compression"], tuning=ckptio.Tuning(max_block_size=case["max_block_size"])
    )
    writer = ckptio.Writer(url, config)
    dcp.save(_state(case, "save", zeros=False), storage_writer=writer, use_collectives=case["collectives"])


def load_and_compare(case: dict[str, Any], url: str) -> list[str]:
    """Load into zeroed values of the load layout; the keys whose local part is not exactly the
    reference's (each local shard against its cut of the full tensor, a plain tensor against the whole)."""
    target = _state(case, "load", zeros=True)
    dcp.load(target, storage_reader=ckptio.Reader(url))
    wrong = []
    for (key, full), value in zip(full_tensors(case).items(), target.values(), strict=True):
        if not isinstance(value, ShardedTensor):  # a ShardedTensor is a torch.Tensor too
            exact = torch.equal(value, full)
        else:
            exact = all(torch.equal(shard.tensor, _cut(full, shard)) for shard in value.local_shards())
        if not exact:
            wrong.append(key)
    return wrong
