"""Per-rank bodies for the training-state tests (per-rank objects, PerRank, DDP modules)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

import ckptio
from tests.helpers.metadata_view import readable_metadata


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def save_all(base: str) -> dict:
    """Rank r holds dataloader position 100 + r under one key. Returns what each attempt raised."""
    rank, world = _rank_world()
    seen = {}
    differing = {"w": torch.ones(4), "dataloader": {"position": 100 + rank}}
    try:
        ckptio.save(differing, f"{base}/collapsed")
    except ckptio.PerRankStateError as exc:
        seen["ckptio.save"] = str(exc)
    try:
        dcp.save(differing, storage_writer=ckptio.Writer(f"{base}/collapsed_dcp"))
    except CheckpointException as exc:
        seen["dcp.save"] = f"{type(ckptio.unwrap(exc)).__name__}: {ckptio.unwrap(exc)}"
    ckptio.save(differing, f"{base}/kept", ckptio.WriterConfig(differing_objects="keep_per_rank"))
    per_rank = {"w": torch.ones(4), "loader": ckptio.PerRank({"position": 100 + rank}, dp_rank=rank, dp_size=world)}
    ckptio.save(per_rank, f"{base}/per_rank")
    assert isinstance(per_rank["loader"], ckptio.PerRank)  # the caller's dict is untouched

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    ckptio.save({"model": ddp}, f"{base}/ddp")
    seen["ddp_keys"] = sorted(readable_metadata(os.path.join(base, "ddp"))["state"])
    return seen


def load_all(base: str) -> dict:
    rank, world = _rank_world()
    out: dict = {}
    kept = {"w": torch.zeros(4), "dataloader": {"position": None}}
    try:
        ckptio.load(kept, f"{base}/kept")
        out["kept"] = kept["dataloader"]["position"]
    except ckptio.PerRankStateError as exc:
        out["kept"] = str(exc)

    def loader(on_resize="error"):
        return {
            "w": torch.zeros(4),
            "loader": ckptio.PerRank({"position": -1}, dp_rank=rank, dp_size=world, on_resize=on_resize),
        }

    for policy in ("error", "skip", "spread"):
        state = loader(on_resize=_spread if policy == "spread" else policy)
        try:
            ckptio.load(state, f"{base}/per_rank")
            out[policy] = state["loader"].value
        except ckptio.PerRankStateError as exc:
            out[policy] = str(exc)

    torch.manual_seed(1)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ckptio.load({"model": plain}, f"{base}/ddp")
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    out["ddp_into_plain"] = all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    return out


def _spread(saved: list, new_size: int) -> list:
    """Redistribute dataloader positions: each new rank continues from the furthest saved one."""
    furthest = max(s["position"] for s in saved)
    return [{"position": furthest, "from": len(saved)} for _ in range(new_size)]
