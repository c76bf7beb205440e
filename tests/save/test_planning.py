"""Who writes what: exact assignments on synthetic HSDP-like plans (no processes)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import ckptio
from ckptio.saving.planning import Holdings, item_size
from ckptio.saving.planning import assign_writers as assign_with_flags


def assign_writers(plans, mode):
    return [a.items for a in assign_with_flags(plans, mode)]


def tensor_item(fqn: str, rows: int, row_offset: int = 0) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([row_offset, 0]), sizes=torch.Size([rows, 256]))
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([row_offset, 0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size([2 * rows, 256])
        ),
    )


def object_item(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def hsdp_plans(replicas: int = 2, shards: int = 2, n_params: int = 60, seed: int = 0) -> list[SavePlan]:
    """Rank r = replica * shards + shard holds shard ``shard`` of every parameter, plus shared objects
    and one object only it holds."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 400) for _ in range(n_params)]
    plans = []
    for rank in range(replicas * shards):
        shard = rank % shards
        items = [tensor_item(f"p{i}", rows, shard * rows) for i, rows in enumerate(sizes)]
        items += [object_item("extra.lr"), object_item(f"rank_state.{rank}")]
        plans.append(SavePlan(items=items, storage_data=Holdings(tuple(items))))
    return dedup_save_plans(plans)  # what torch's default planner hands the storage writer


def loads(assigned) -> list[int]:
    return [sum(item_size(it) for it in items) for items in assigned]


def assigned_once(plans, assigned) -> None:
    wanted = sorted((it.index.fqn, tuple(it.index.offset or ())) for p in plans for it in p.items)
    got = sorted((it.index.fqn, tuple(it.index.offset or ())) for items in assigned for it in items)
    assert got == wanted


def test_all_ranks_balances_within_5_percent():
    for seed in range(5):
        plans = hsdp_plans(seed=seed)
        assigned = assign_writers(plans, "all_ranks")
        assigned_once(plans, assigned)
        per_rank = loads(assigned)
        assert all(per_rank)
        assert max(per_rank) <= 1.05 * (sum(per_rank) / len(per_rank)), per_rank


def test_all_ranks_writes_each_item_from_a_holder():
    plans = hsdp_plans()
    for rank, items in enumerate(assign_writers(plans, "all_ranks")):
        for it in items:
            offset = it.index.offset
            if offset is not None:
                assert (offset[0] > 0) == (rank % 2 == 1)  # shard 1 lives on ranks 1 and 3 only
            elif it.index.fqn.startswith("rank_state."):
                assert it.index.fqn == f"rank_state.{rank}"


def test_replica_group_uses_lowest_rank_and_keeps_single_holder_items():
    plans = hsdp_plans()
    assigned = assign_writers(plans, "replica_group")
    assigned_once(plans, assigned)
    names = [{it.index.fqn for it in items} for items in assigned]
    assert {n for n in names[2] | names[3]} == {"rank_state.2", "rank_state.3"}  # only their own state
    assert "extra.lr" in names[0]
    assert all(not n.startswith("rank_state.") or n == "rank_state.0" for n in names[0])
    tensor_ranks = {rank for rank, items in enumerate(assigned) for it in items if it.index.offset is not None}
    assert tensor_ranks == {0, 1}
    assert [a.private_only for a in assign_with_flags(plans, "replica_group")] == [False, False, True, True]


def test_without_holdings_falls_back_to_the_plans():
    items = [tensor_item("a", 4), object_item("b")]
    assigned = assign_writers([SavePlan(items=items)], "all_ranks")
    assert [it.index.fqn for it in assigned[0]] == ["a", "b"]


def _global_plan(planner_class, plans):
    planner = planner_class()
    planner.is_coordinator = True
    return planner.create_global_plan(plans)


@pytest.mark.parametrize("layout", ["hsdp", "fsdp", "fsdp_tp"])
def test_ckptio_save_planner_makes_torchs_global_plan(layout):
    from ckptio.bench import scale
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    plans = scale.local_plans(layout, 64, 1)
    ours, our_metadata = _global_plan(ckptio.SavePlanner, plans)
    theirs, their_metadata = _global_plan(DefaultSavePlanner, plans)
    assert [p.items for p in ours] == [p.items for p in theirs]
    assert our_metadata.state_dict_metadata == their_metadata.state_dict_metadata
    assert our_metadata.planner_data == their_metadata.planner_data


@pytest.mark.parametrize("fault", ["overlap", "outside", "short"])
def test_ckptio_save_planner_refuses_what_torch_refuses(fault):
    from ckptio.bench import scale
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    plans = scale.local_plans("fsdp", 16, 1)
    # rank 3's slice of a (1024, 8192) key/value weight: 64 rows at 192
    item = next(it for it in plans[3].items if it.index.fqn == "model.layers.0.attention.wk.weight")
    moved = {"overlap": (160, 64), "outside": (992, 64), "short": (192, 32)}[fault]
    chunk = ChunkStorageMetadata(offsets=torch.Size((moved[0], 0)), sizes=torch.Size((moved[1], 8192)))
    changed = dataclasses.replace(
        item,
        index=dataclasses.replace(item.index, offset=chunk.offsets),
        tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk),
    )
    plans[3].items[plans[3].items.index(item)] = changed
    for planner_class in (ckptio.SavePlanner, DefaultSavePlanner):
        with pytest.raises(ValueError, match="Failed to validate global plan"):
            _global_plan(planner_class, plans)
